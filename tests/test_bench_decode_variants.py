"""tools/bench_decode_variants.py on the CPU: the variant list, the
environment switching, the combination of the winners, the table, and a
--smoke run end to end (tiny-moe, no graphs). The GPU parts (graph
re-capture and replay timing) run only on the H200."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from ftserve import envs
from ftserve_kernels.attention_common import AttnKernelConfig
from tools.bench_common import env_applied
from tools.bench_decode_variants import main
from tools.decode_variants import (
    DEFAULT_ENV,
    backend_for,
    combine_best,
    default_variants,
    parse_variant,
    render_table,
    score_ms,
    select_variants,
    should_skip,
)


def _switches() -> dict[str, object]:
    return {"pdl": envs.pdl(), "gemv_entries": envs.gemv_entries()}


def test_default_env_is_what_envs_reads_when_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in DEFAULT_ENV:
        monkeypatch.delenv(k, raising=False)
    unset = _switches()
    monkeypatch.setenv("FTSERVE_PDL", "0")
    monkeypatch.setenv("FTSERVE_GEMV_ENTRY", "dense:N=8+K=8@1=4.128.2.1")
    with env_applied(DEFAULT_ENV):
        assert _switches() == unset  # the caller's settings do not leak into the baseline
    assert envs.pdl() is False and envs.gemv_entries() == "dense:N=8+K=8@1=4.128.2.1"


def test_env_applied_restores_after_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTSERVE_PDL", "1")
    monkeypatch.delenv("FTSERVE_GEMV_ENTRY", raising=False)
    with pytest.raises(RuntimeError), env_applied({"FTSERVE_PDL": "0", "FTSERVE_GEMV_ENTRY": "x"}):
        assert envs.pdl() is False and envs.gemv_entries() == "x"
        raise RuntimeError("a failing variant")
    assert os.environ["FTSERVE_PDL"] == "1"
    assert "FTSERVE_GEMV_ENTRY" not in os.environ


def test_each_variant_turns_exactly_its_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    variants = default_variants(AttnKernelConfig())
    names = [v.name for v in variants]
    assert names[0] == "baseline" and len(set(names)) == len(names)
    assert {"PDL=0",
            "attn fused_reduce=1", "attn programs_per_sm=2", "attn programs_per_sm=8",
            "attn max_splits=32", "attn max_splits=64", "attn max_splits=256"} <= set(names)
    with env_applied(DEFAULT_ENV):
        base = _switches()
    for v in variants:
        assert set(v.env) <= set(DEFAULT_ENV) and (v.group == "") == (v.name == "baseline")
        assert bool(v.env) != bool(v.attn) or v.name == "baseline"
        with env_applied({**DEFAULT_ENV, **v.env}):
            changed = {k for k, x in _switches().items() if x != base[k]}
        assert changed == (set(v.group.split("+")) if v.env else set()), v.name
        for field_name in v.attn:
            assert hasattr(AttnKernelConfig(), field_name)


def test_programs_per_sm_variants_skip_the_baseline_value() -> None:
    names = [v.name for v in default_variants(AttnKernelConfig(decode_programs_per_sm=1, max_splits=2,
                                                               decode_fused_reduce=True))]
    assert [n for n in names if n.startswith("attn")] == ["attn fused_reduce=0", "attn round_robin=0",
                                                          "attn page_ahead=0", "attn programs_per_sm=2",
                                                          "attn max_splits=1", "attn max_splits=4"]
    no_rr = AttnKernelConfig(decode_round_robin=False)  # page ahead needs round robin: no variant
    assert not any("page_ahead" in v.name for v in default_variants(no_rr))


def test_ad_hoc_variants_parse_attn_fields_and_switches() -> None:
    base = AttnKernelConfig()
    v = parse_variant("attn decode_block_n=128 decode_round_robin=1", base)
    assert v.attn == {"decode_block_n": 128, "decode_round_robin": True} and not v.env
    assert v.group == "attn:decode_block_n+decode_round_robin"  # "+": never combined
    assert parse_variant("attn decode_block_n=32", base).group == "attn:decode_block_n"
    w = parse_variant("FTSERVE_PDL=0 FTSERVE_GEMV_ENTRY=dense:N=8+K=8@1=4.128.2.1", base)
    assert w.env == {"FTSERVE_PDL": "0", "FTSERVE_GEMV_ENTRY": "dense:N=8+K=8@1=4.128.2.1"} and not w.attn
    assert w.group == "env:FTSERVE_GEMV_ENTRY+FTSERVE_PDL"
    # A GEMV launch entry in its comma-free form survives the list's commas.
    entry = "FTSERVE_GEMV_ENTRY=dense:N=2048+K=4096@1=4.512.8.3"
    picked = select_variants(default_variants(base), f"{entry},FTSERVE_PDL=0", base)
    assert [v.name for v in picked] == ["baseline", entry, "FTSERVE_PDL=0"]
    assert picked[1].env == {"FTSERVE_GEMV_ENTRY": "dense:N=2048+K=4096@1=4.512.8.3"}
    for bad in ("attn", "attn decode_block_m=64", "attn decode_block_n=big", "FTSERVE_NOPE=1", "PDL"):
        with pytest.raises(ValueError, match="variant"):
            parse_variant(bad, base)


def test_select_variants_keeps_the_baseline_first_then_the_order_given() -> None:
    base = AttnKernelConfig()
    named = default_variants(base)
    picked = select_variants(named, "attn decode_warps=8, PDL=0,baseline, attn decode_warps=8", base)
    assert [v.name for v in picked] == ["baseline", "attn decode_warps=8", "PDL=0"]
    assert picked[2] is next(v for v in named if v.name == "PDL=0")
    assert picked[1].attn == {"decode_warps": 8}
    with pytest.raises(ValueError, match="no_such"):
        select_variants(named, "no_such", base)


def test_backend_for_replaces_only_the_config() -> None:
    from ftserve_kernels.attention_triton import TritonAttentionBackend
    from ftserve_kernels.paged_attention import TorchAttentionBackend

    built = TritonAttentionBackend(scale=0.125, extend_token_bound=256)
    base_cfg = AttnKernelConfig()
    by_name = {v.name: v for v in default_variants(base_cfg)}
    assert backend_for(built, base_cfg, by_name["PDL=0"]) is built
    cpu = torch.device("cpu")
    splits = {}
    for name in ("attn programs_per_sm=2", "attn programs_per_sm=8", "attn fused_reduce=1"):
        new = backend_for(built, base_cfg, by_name[name])
        assert new is not built and new.scale == 0.125 and new.extend_token_bound == 256
        assert new.cfg.extend_block_m == base_cfg.extend_block_m
        splits[name] = new.num_splits(1, 4, cpu)
    assert new.cfg.decode_fused_reduce is True
    # 4 KV heads on the 4 "SMs" the CPU reports: splits = programs per SM.
    assert built.num_splits(1, 4, cpu) == 4
    assert splits["attn programs_per_sm=2"] == 2 and splits["attn programs_per_sm=8"] == 8
    with pytest.raises(RuntimeError, match="triton backend"):
        backend_for(TorchAttentionBackend(), base_cfg, by_name["attn fused_reduce=1"])


def _row(name: str, ms: float | None, ok: bool | None = True, error: str | None = None) -> dict[str, object]:
    return {"name": name, "replay_ms": ms, "tokens_ok": ok, "error": error}


def test_combine_best_takes_the_fastest_exact_option_per_knob() -> None:
    variants = default_variants(AttnKernelConfig())
    rows = [
        _row("baseline", 1.00),
        _row("PDL=0", 0.90), _row("attn round_robin=0", 0.80, ok=False),
        _row("attn max_splits=32", 0.995),  # under the 1% gain: noise
        _row("attn max_splits=64", 0.50, error="RuntimeError: boom"),
        _row("attn fused_reduce=1", 1.10),
        _row("attn programs_per_sm=8", 0.97), _row("attn programs_per_sm=2", 0.96),
    ]
    combo, winners = combine_best(rows, variants, min_gain=0.01)
    assert winners == {"pdl": "PDL=0", "attn_programs_per_sm": "attn programs_per_sm=2"}
    assert combo is not None and combo.group == ""
    assert dict(combo.env) == {"FTSERVE_PDL": "0"}
    assert dict(combo.attn) == {"decode_programs_per_sm": 2}
    assert "PDL=0" in combo.name and "programs_per_sm=2" in combo.name
    # A combination row itself never wins a knob.
    again, _ = combine_best(rows + [{**_row(combo.name, 0.1)}], [*variants, combo], min_gain=0.01)
    assert again == combo


def test_combine_best_needs_a_baseline_and_two_winners() -> None:
    variants = default_variants(AttnKernelConfig())
    one = [_row("baseline", 1.0), _row("PDL=0", 0.5), _row("attn fused_reduce=1", 1.2)]
    assert combine_best(one, variants, 0.01) == (None, {"pdl": "PDL=0"})
    failed_base = [_row("baseline", None, error="x"), _row("PDL=0", 0.5), _row("attn fused_reduce=1", 0.4)]
    assert combine_best(failed_base, variants, 0.01) == (None, {})


def test_score_falls_back_to_the_engine_step_without_graphs() -> None:
    assert score_ms({"replay_ms": 0.7, "decode_b1": {"tokens_per_s": 100.0}}) == 0.7
    assert score_ms({"replay_ms": None, "decode_b1": {"tokens_per_s": 500.0}}) == pytest.approx(2.0)
    assert score_ms({"error": "x"}) is None


def test_should_skip_keeps_room_for_the_slowest_variant() -> None:
    assert not should_skip(100.0, 101.0, [], reserve=2)  # nothing measured yet
    assert not should_skip(100.0, 121.0, [5.0, 10.0], reserve=2)
    assert should_skip(100.0, 119.0, [5.0, 10.0], reserve=2)
    assert not should_skip(100.0, 111.0, [5.0, 10.0], reserve=1)


def test_render_table_rows_and_skips() -> None:
    rows = [
        {**_row("baseline", 0.8), "replay_frac_of_roofline": 0.5,
         "decode_b1": {"tokens_per_s": 1000.0, "frac_of_roofline": 0.4}, "decode_b8": {"tokens_per_s": 5000.0}},
        {**_row("PDL=0", 0.4, ok=False), "mismatch_at": 3, "decode_b1": {"tokens_per_s": 1500.0}},
        _row("attn fused_reduce=1", None, ok=None, error="RuntimeError: capture failed\ntraceback..."),
    ]
    text = render_table(rows, (1, 8), skipped=["attn fused_reduce=1"])
    lines = text.splitlines()
    assert lines[0].count("|") == lines[2].count("|") == lines[4].count("|") == 9  # 8 columns
    assert "tok/s b8" in lines[0] and "% roofline b1" in lines[0]
    assert "| baseline | yes | 0.8 | 1.000x | 50.0% | 1,000 | 40.0% | 5,000 |" in text
    assert "NO (step 3)" in lines[3] and "2.000x" in lines[3]
    assert "FAILED: RuntimeError: capture failed" in lines[4] and "traceback" not in text
    assert lines[-1] == "skipped (time budget): attn fused_reduce=1"


def test_smoke_run_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTSERVE_PDL", "1")  # the caller's setting: back afterwards
    out = tmp_path / "variants.json"
    res = main(["--smoke", "--out", str(out), "--budget-s", "300"])
    assert os.environ["FTSERVE_PDL"] == "1"
    assert json.loads(out.read_text())["table"] == res["table"]
    rows = {r["name"]: r for r in res["variants"]}
    variants = default_variants(AttnKernelConfig.for_device(torch.device("cpu"), 128))
    assert list(rows)[:len(variants)] == [v.name for v in variants]
    assert rows["baseline"]["env_seen"] == DEFAULT_ENV
    assert rows["PDL=0"]["env_seen"] == {**DEFAULT_ENV, "FTSERVE_PDL": "0"}
    assert len(rows["baseline"]["tokens"]) == res["args"]["check_steps"]
    for name, r in rows.items():
        if name.startswith("attn"):  # the CPU engine runs the torch attention backend
            assert "triton backend" in r["error"] and name in res["table"]
            continue
        # The CPU runs the torch kernels whatever the switches say: same tokens.
        assert not r.get("error") and r["tokens_ok"] is True, (name, r.get("error"))
        assert r["decode_b1"]["tokens_per_s"] > 0 and r["decode_b3"]["tokens_per_s"] > 0
        assert r.get("replay_ms") is None and r["capture_s"] is None
    assert res["best"]["name"] in rows
    assert res["roofline_b1"]["ms"] > 0 and not res["skipped"]


def test_smoke_run_out_of_budget_measures_only_the_baseline(tmp_path: Path) -> None:
    res = main(["--smoke", "--out", str(tmp_path / "v.json"), "--budget-s", "0"])
    assert [r["name"] for r in res["variants"]] == ["baseline"]
    assert not res["variants"][0].get("error") and res["variants"][0]["tokens_ok"] is True
    cpu_attn = AttnKernelConfig.for_device(torch.device("cpu"), 128)
    assert res["skipped"] == [v.name for v in default_variants(cpu_attn)][1:]
    assert res["table"].endswith("skipped (time budget): " + ", ".join(res["skipped"]))
