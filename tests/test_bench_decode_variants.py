"""tools/bench/decode_variants.py on the CPU: the variant list, each
variant's KernelConfig, the combination of the winners, the table, and a
--smoke run end to end (tiny-moe, no graphs). The GPU parts (graph
re-capture and replay timing) run only on the H200."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from ftserve_kernels.attention_common import AttnKernelConfig
from ftserve_kernels.config import KernelConfig
from tools.bench.decode_variants import main
from tools.bench.variants import (
    KERNEL_FIELDS,
    backend_for,
    combine_best,
    default_variants,
    parse_variant,
    render_table,
    score_ms,
    select_variants,
    should_skip,
)


def test_each_variant_turns_exactly_its_knob() -> None:
    variants = default_variants(AttnKernelConfig())
    names = [v.name for v in variants]
    assert names[0] == "baseline" and len(set(names)) == len(names)
    assert {"kernels pdl=0", "kernels dense_gemv=0",
            "attn programs_per_sm=2", "attn programs_per_sm=8",
            "attn max_splits=32", "attn max_splits=64", "attn max_splits=256"} <= set(names)
    base = KernelConfig(backend="triton", gemv_table="/t.json")
    for v in variants:
        assert (v.group == "") == (v.name == "baseline")
        assert bool(v.kernels) != bool(v.attn) or v.name == "baseline"
        assert set(v.kernels) <= set(KERNEL_FIELDS)
        run = v.kernel_config(base)  # the build's config with the variant's fields, nothing else
        changed = {f.name for f in dataclasses.fields(KernelConfig) if getattr(run, f.name) != getattr(base, f.name)}
        assert changed == set(v.kernels), v.name
        for field_name in v.attn:
            assert hasattr(AttnKernelConfig(), field_name)
    assert next(v for v in variants if v.name == "kernels pdl=0").kernel_config(base).pdl is False
    assert next(v for v in variants if v.name == "kernels dense_gemv=0").kernel_config(base).dense_gemv is False


def test_programs_per_sm_variants_skip_the_baseline_value() -> None:
    names = [v.name for v in default_variants(AttnKernelConfig(decode_programs_per_sm=1, max_splits=2))]
    assert [n for n in names if n.startswith("attn")] == ["attn programs_per_sm=2", "attn max_splits=1",
                                                          "attn max_splits=4"]


def test_ad_hoc_variants_parse_attn_and_kernel_fields() -> None:
    base = AttnKernelConfig()
    v = parse_variant("attn decode_block_n=128 decode_warps=8", base)
    assert v.attn == {"decode_block_n": 128, "decode_warps": 8} and not v.kernels
    assert v.group == "attn:decode_block_n+decode_warps"  # "+": never combined
    assert parse_variant("attn decode_block_n=32", base).group == "attn:decode_block_n"
    w = parse_variant("kernels pdl=0 gemv_entries=dense:N=8+K=8@1=4.128.2.1", base)
    assert w.kernels == {"pdl": False, "gemv_entries": "dense:N=8+K=8@1=4.128.2.1"} and not w.attn
    assert w.group == "kernels:gemv_entries+pdl"
    assert w.kernel_config(KernelConfig()) == KernelConfig(pdl=False, gemv_entries="dense:N=8+K=8@1=4.128.2.1")
    # A GEMV launch entry in its comma-free form survives the list's commas.
    entry = "kernels gemv_entries=dense:N=2048+K=4096@1=4.512.8.3"
    picked = select_variants(default_variants(base), f"{entry},kernels pdl=0", base)
    assert [v.name for v in picked] == ["baseline", entry, "kernels pdl=0"]
    assert picked[1].kernels == {"gemv_entries": "dense:N=2048+K=4096@1=4.512.8.3"}
    assert picked[2].kernels == {"pdl": False} and picked[2].group == "kernels:pdl"
    for bad in ("attn", "attn decode_block_m=64", "attn decode_block_n=big", "kernels backend=torch",
                "kernels pdl=maybe", "kernels gemv_entries=dense:N=8+K=8@1=4.128.2", "FTSERVE_PDL=1", "PDL"):
        with pytest.raises(ValueError, match="variant|GEMV entry"):
            parse_variant(bad, base)


def test_select_variants_keeps_the_baseline_first_then_the_order_given() -> None:
    base = AttnKernelConfig()
    named = default_variants(base)
    picked = select_variants(named, "attn decode_warps=8, kernels pdl=0,baseline, attn decode_warps=8", base)
    assert [v.name for v in picked] == ["baseline", "attn decode_warps=8", "kernels pdl=0"]
    assert picked[2] is next(v for v in named if v.name == "kernels pdl=0")
    assert picked[1].attn == {"decode_warps": 8}
    with pytest.raises(ValueError, match="no_such"):
        select_variants(named, "no_such", base)


def test_backend_for_replaces_only_the_config() -> None:
    from ftserve_kernels.attention_triton import TritonAttentionBackend
    from ftserve_kernels.paged_attention import TorchAttentionBackend

    built = TritonAttentionBackend(scale=0.125, extend_token_bound=256)
    base_cfg = AttnKernelConfig()
    by_name = {v.name: v for v in default_variants(base_cfg)}
    assert backend_for(built, base_cfg, by_name["kernels pdl=0"]) is built
    cpu = torch.device("cpu")
    splits = {}
    for name in ("attn programs_per_sm=2", "attn programs_per_sm=8", "attn max_splits=256"):
        new = backend_for(built, base_cfg, by_name[name])
        assert new is not built and new.scale == 0.125 and new.extend_token_bound == 256
        assert new.cfg.extend_block_m == base_cfg.extend_block_m
        splits[name] = new.num_splits(1, 4, cpu)
    assert new.cfg.max_splits == 256
    # 4 KV heads on the 4 "SMs" the CPU reports: splits = programs per SM.
    assert built.num_splits(1, 4, cpu) == 4
    assert splits["attn programs_per_sm=2"] == 2 and splits["attn programs_per_sm=8"] == 8
    with pytest.raises(RuntimeError, match="triton backend"):
        backend_for(TorchAttentionBackend(), base_cfg, by_name["attn max_splits=256"])


def _row(name: str, ms: float | None, ok: bool | None = True, error: str | None = None) -> dict[str, object]:
    return {"name": name, "replay_ms": ms, "tokens_ok": ok, "error": error}


def test_combine_best_takes_the_fastest_exact_option_per_knob() -> None:
    variants = default_variants(AttnKernelConfig())
    rows = [
        _row("baseline", 1.00),
        _row("kernels pdl=0", 0.90), _row("attn max_splits=256", 0.80, ok=False),
        _row("attn max_splits=32", 0.995),  # under the 1% gain: noise
        _row("attn max_splits=64", 0.50, error="RuntimeError: boom"),
        _row("attn programs_per_sm=8", 0.97), _row("attn programs_per_sm=2", 0.96),
    ]
    combo, winners = combine_best(rows, variants, min_gain=0.01)
    assert winners == {"kernels:pdl": "kernels pdl=0", "attn_programs_per_sm": "attn programs_per_sm=2"}
    assert combo is not None and combo.group == ""
    assert dict(combo.kernels) == {"pdl": False}
    assert dict(combo.attn) == {"decode_programs_per_sm": 2}
    assert "kernels pdl=0" in combo.name and "programs_per_sm=2" in combo.name
    # A combination row itself never wins a knob.
    again, _ = combine_best(rows + [{**_row(combo.name, 0.1)}], [*variants, combo], min_gain=0.01)
    assert again == combo


def test_combine_best_needs_a_baseline_and_two_winners() -> None:
    variants = default_variants(AttnKernelConfig())
    one = [_row("baseline", 1.0), _row("kernels pdl=0", 0.5), _row("attn max_splits=256", 1.2)]
    assert combine_best(one, variants, 0.01) == (None, {"kernels:pdl": "kernels pdl=0"})
    failed_base = [_row("baseline", None, error="x"), _row("kernels pdl=0", 0.5), _row("attn max_splits=256", 0.4)]
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
        {**_row("kernels pdl=0", 0.4, ok=False), "mismatch_at": 3, "decode_b1": {"tokens_per_s": 1500.0}},
        _row("attn max_splits=256", None, ok=None, error="RuntimeError: capture failed\ntraceback..."),
    ]
    text = render_table(rows, (1, 8), skipped=["attn max_splits=256"])
    lines = text.splitlines()
    assert lines[0].count("|") == lines[2].count("|") == lines[4].count("|") == 9  # 8 columns
    assert "tok/s b8" in lines[0] and "% roofline b1" in lines[0]
    assert "| baseline | yes | 0.8 | 1.000x | 50.0% | 1,000 | 40.0% | 5,000 |" in text
    assert "NO (step 3)" in lines[3] and "2.000x" in lines[3]
    assert "FAILED: RuntimeError: capture failed" in lines[4] and "traceback" not in text
    assert lines[-1] == "skipped (time budget): attn max_splits=256"


def test_smoke_run_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "variants.json"
    res = main(["--smoke", "--out", str(out), "--budget-s", "300"])
    assert json.loads(out.read_text())["table"] == res["table"]
    rows = {r["name"]: r for r in res["variants"]}
    variants = default_variants(AttnKernelConfig.for_device(torch.device("cpu"), 128))
    assert list(rows)[:len(variants)] == [v.name for v in variants]
    base = KernelConfig().summary()  # the build's on the CPU: the defaults
    assert rows["baseline"]["kernels_run"] == base
    assert rows["kernels pdl=0"]["kernels_run"] == {**base, "pdl": False}
    assert rows["kernels dense_gemv=0"]["kernels_run"] == {**base, "dense_gemv": False}
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
