"""Decode GEMV launch tables (gemv_configs), the launchers' use of them, and
tools/tune/gemv on the interpreter."""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # The interpreter is chosen when a kernel is decorated (see test_kernels_attention).
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in ("ftserve_kernels.gemv_triton", "ftserve_kernels.moe_gemv_triton"):
        if _name in sys.modules:
            importlib.reload(sys.modules[_name])

from ftserve_kernels import gemv_configs as gc  # noqa: E402
from ftserve_kernels import gemv_triton as gv  # noqa: E402
from ftserve_kernels import moe_gemv_triton as mg  # noqa: E402
from ftserve_kernels.config import KernelConfig  # noqa: E402
from ftserve_kernels.gemv_configs import GemvConfig  # noqa: E402
from ftserve_kernels.moe import fused_moe_ref, route_topk_ref  # noqa: E402
from tools.tune import gemv as tune  # noqa: E402

CUDA0 = torch.device("cuda", 0)  # index given: no CUDA call is needed to find an override table


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))


def _write(path: Path, configs: dict[str, Any]) -> str:
    path.write_text(json.dumps({"meta": {"device": "test"}, "configs": configs}))
    return str(path)


def test_defaults_are_the_launches_before_tables() -> None:
    """No table must mean no change: the defaults are the launches the kernels
    used before gemv_configs existed (H200-measured; tools/bench/decode_layer)."""
    assert gc.default("dense", True, 5120, 1) == GemvConfig(16, 256, 8, 3)
    assert gc.default("dense", True, 5120, 2) == GemvConfig(16, 256, 8, 3)
    assert gc.default("dense", True, 5120, 4) == GemvConfig(8, 256, 8, 3)
    assert gc.default("dense", True, 2048, 1) == GemvConfig(8, 256, 8, 3)
    assert gc.default("moe_gate_up", True) == GemvConfig(16, 512, 8, 2)
    assert gc.default("moe_down", True) == GemvConfig(8, 256, 8, 2)
    assert gc.default("dense", False, 5120, 1) == GemvConfig(8, 16, 1, 3)
    assert gc.default("moe_gate_up", False) == GemvConfig(16, 16, 4, 1)
    # The fp8 dense GEMV (added with tables): 512 codes a row step, 4 warps; 8 rows at
    # one row of K >= 4096 (o_proj), else 4.
    assert gc.default("dense_fp8", True, 5120, 1, 2048) == GemvConfig(4, 512, 4, 1)
    assert gc.default("dense_fp8", True, 2048, 1, 4096) == GemvConfig(8, 512, 4, 1)
    assert gc.default("dense_fp8", True, 2048, 2, 4096) == GemvConfig(4, 512, 4, 1)
    assert gc.default("dense_fp8", False, 5120, 1, 2048) == GemvConfig(8, 16, 1, 3)
    for retired in ("dense_norm", "moe_gate_up_acc", "moe_down2d"):
        with pytest.raises(ValueError, match="unknown GEMV kernel kind"):
            gc.default(retired, True)


def test_table_lookup_is_exact_in_t(tmp_path: Path) -> None:
    """The table KernelConfig.gemv_table names drives pick on CUDA devices: an
    entry serves only its own key and T; CPU tensors never read a table."""
    gu_key = gc.moe_key("moe_gate_up", 8, 64, 32, 2)
    dense_key = gc.dense_key(48, 64)
    a, b = GemvConfig(32, 256, 4, 3), GemvConfig(4, 128, 2, 1)
    path = _write(tmp_path / "t.json", {gu_key: {"1": a.to_dict()}, dense_key: {"2": b.to_dict(), "4": a.to_dict()}})
    kc = KernelConfig(gemv_table=path)
    assert gc.pick(gu_key, 1, CUDA0, kc) == a
    assert gc.pick(gu_key, 2, CUDA0, kc) is None  # a neighbour's entry is not used
    assert gc.pick(dense_key, 2, CUDA0, kc) == b and gc.pick(dense_key, 4, CUDA0, kc) == a
    assert gc.pick(gc.moe_key("moe_down", 8, 64, 32, 2), 1, CUDA0, kc) is None
    assert gc.pick(gu_key, 1, torch.device("cpu"), kc) is None
    assert gc.parse_key(gu_key) == ("moe_gate_up", {"E": 8, "H": 64, "I": 32, "k": 2})
    assert gc.parse_key(dense_key) == ("dense", {"N": 48, "K": 64})
    assert gc.table_file_name("NVIDIA H200") == "gemv_NVIDIA_H200.json"


def test_entries_lay_over_the_table(tmp_path: Path) -> None:
    """KernelConfig.gemv_entries: comma-free entries (KEY@T=BN.BK.W.S, "+" for
    the key's commas) win over the table's at their key and T only; a bad one
    is an error naming it, when the config is made."""
    dense_key = gc.dense_key(48, 64)
    gu_key = gc.moe_key("moe_gate_up", 8, 64, 32, 2)
    a, b = GemvConfig(32, 256, 4, 3), GemvConfig(4, 128, 2, 1)
    path = _write(tmp_path / "t.json", {dense_key: {"1": a.to_dict(), "2": a.to_dict()}})
    entries = f"{dense_key.replace(',', '+')}@1=4.128.2.1; {gu_key.replace(',', '+')}@2=32.256.4.3"
    assert "," not in entries
    assert gc.parse_entries(entries) == {dense_key: {1: b}, gu_key: {2: a}}
    kc = KernelConfig(gemv_table=path, gemv_entries=entries)
    assert gc.pick(dense_key, 1, CUDA0, kc) == b  # the entry over the table's
    assert gc.pick(dense_key, 2, CUDA0, kc) == a  # the table's, another T
    assert gc.pick(gu_key, 2, CUDA0, kc) == a and gc.pick(gu_key, 1, CUDA0, kc) is None
    assert gc.pick(dense_key, 1, torch.device("cpu"), kc) is None
    for bad, needle in [("dense:N=48+K=64@1=4.128.2", "num_stages"), ("dense:N=48+K=64=4.128.2.1", "KEY@T"),
                        ("dense_int4:N=8+K=8@1=4.128.2.1", "unknown GEMV kernel kind"),
                        ("dense:N=48+K=64@1=12.128.2.1", "power of two")]:
        with pytest.raises(ValueError, match="GEMV entry") as err:
            gc.parse_entries(bad)
        assert needle in str(err.value), (bad, str(err.value))
        with pytest.raises(ValueError, match="GEMV entry"):
            KernelConfig(gemv_entries=bad)


@pytest.mark.parametrize("content,needle", [
    ("{not json", "JSONDecodeError"),
    ('{"table": {}}', "KeyError"),
    ('{"configs": []}', "TypeError"),
    ('{"configs": {"dense_int4:N=8,K=8": {}}}', "unknown GEMV kernel kind"),
    ('{"configs": {"dense:N=8,K=8": {"1": {"block_n": 8}}}}', "TypeError"),
    ('{"configs": {"dense:N=8,K=8": {"1": {"block_n": 8, "block_k": 16, "num_warps": 4, '
     '"num_stages": 2, "warps": 4}}}}', "unknown GemvConfig fields"),
    ('{"configs": {"dense:N=8,K=8": {"one": {}}}}', "ValueError"),
    ('{"configs": {"dense:N=8,K=8": {"1": {"block_n": 12, "block_k": 16, "num_warps": 4, '
     '"num_stages": 2}}}}', "power of two"),
    ('{"configs": {"dense:N=8,K=8": {"1": {"block_n": 8, "block_k": 16, "num_warps": 4, '
     '"num_stages": 0}}}}', "positive int"),
    (None, "FileNotFoundError"),
])
def test_bad_table_is_an_error_naming_the_file(
    tmp_path: Path, content: str | None, needle: str
) -> None:
    """A table that exists (or is asked for) but does not parse fails loudly:
    at the lookup, and at start-up (KernelConfig.check_tables)."""
    path = tmp_path / f"bad_{abs(hash(needle + str(content)))}.json"
    if content is not None:
        path.write_text(content)
    kc = KernelConfig(gemv_table=str(path))
    with pytest.raises(ValueError, match="bad GEMV config table") as info:
        gc.pick("dense:N=8,K=8", 1, CUDA0, kc)
    assert str(path) in str(info.value) and needle in str(info.value)
    with pytest.raises(ValueError, match="bad GEMV config table"):
        kc.check_tables(CUDA0)


@pytest.mark.parametrize("t", [1, 2, 3])
@pytest.mark.parametrize("cfg", [GemvConfig(16, 32, 2, 2), GemvConfig(4, 128, 4, 1)])
def test_dense_gemv_with_other_configs_matches_reference(t: int, cfg: GemvConfig) -> None:
    """N = 37, K = 80: masked column and K tails under non-default tiles."""
    g = torch.Generator().manual_seed(t)
    n, k = 37, 80
    x = torch.randn(t, k, generator=g).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE)
    y = gv.gemv_triton(x, w, config=cfg)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-4)


def test_moe_gemv_with_other_configs_matches_reference() -> None:
    """I = 48 is not a multiple of the down block_k: masked K tail; k = 3 pads
    the choices to 4."""
    g = torch.Generator().manual_seed(3)
    t, e, k, h, inter = 2, 6, 3, 64, 48
    x = torch.randn(t, h, generator=g).to(DEVICE)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).to(DEVICE)
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).to(DEVICE)
    weights, ids = route_topk_ref(torch.randn(t, e, generator=g).to(DEVICE), k, True)
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    for cfgs in ((GemvConfig(8, 32, 2, 2), GemvConfig(4, 32, 2, 1)),
                 (GemvConfig(32, 64, 8, 1), GemvConfig(32, 64, 4, 3))):
        out = mg.fused_moe_gemv_triton(x, w13, w2, weights, ids, configs=cfgs)
        assert rel_err(out, ref) < 1e-5


def test_launchers_ask_for_the_keys_the_tuner_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each launcher looks its table entry up under the key and T that
    tools/tune/gemv writes (dense: the row block, so T = 3 asks for 4), and
    launches what it gets. pick is wrapped to answer on the CPU (it answers
    None off CUDA, tested above); everything else is the real launch path."""
    asked: list[tuple[str, int]] = []
    served = {"moe_gate_up": GemvConfig(32, 32, 2, 1), "moe_down": GemvConfig(8, 32, 2, 1),
              "dense": GemvConfig(32, 64, 1, 1)}

    def spy(key: str, tokens: int, device: torch.device, kernels: KernelConfig) -> GemvConfig | None:
        asked.append((key, tokens))
        return served.get(gc.parse_key(key)[0])

    monkeypatch.setattr(gc, "pick", spy)
    g = torch.Generator().manual_seed(4)
    e, k, h, inter = 8, 2, 64, 32
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).to(DEVICE)
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).to(DEVICE)
    x = torch.randn(1, h, generator=g).to(DEVICE)
    weights, ids = route_topk_ref(torch.randn(1, e, generator=g).to(DEVICE), k, True)
    out = mg.fused_moe_gemv_triton(x, w13, w2, weights, ids)
    assert rel_err(out, fused_moe_ref(x, w13, w2, weights, ids)) < 1e-5
    shape = (e, k, h, inter)
    assert asked == [(tune.Problem("g", "moe_gate_up", shape).key(), 1),
                     (tune.Problem("d", "moe_down", shape).key(), 1)]
    asked.clear()
    xs = torch.randn(3, h, generator=g).to(DEVICE)
    wd = (torch.randn(40, h, generator=g) / h**0.5).to(DEVICE)
    y = gv.gemv_triton(xs, wd)
    torch.testing.assert_close(y, torch.nn.functional.linear(xs, wd), rtol=1e-5, atol=1e-4)
    o = tune.Problem("o", "dense", (40, h))
    assert asked == [(o.key(), o.table_t(3))] and o.table_t(3) == 4
    asked.clear()
    gv.gemv_triton(xs, wd, block=(8, 16))  # an explicit block (benchmarks) skips the table
    assert asked == []


@pytest.mark.parametrize("name", list(tune.PROBLEMS))
@pytest.mark.parametrize("tokens", [1, 2, 4])
def test_tune_candidates_are_pruned_and_capped(name: str, tokens: int) -> None:
    """Never empty at the qwen3 shapes, under the cap, unique, the default left
    out, every candidate fits, and the first ones cover distinct tile shapes."""
    problem = tune.PROBLEMS[name]
    default = problem.default(True, tokens)
    sweep = tune.candidates(problem, tokens, 132)
    full = tune.candidates(problem, tokens, 132, cap=10**6)
    assert 0 < len(sweep) <= tune.CAP and len(sweep) == min(tune.CAP, len(full))
    assert len(set(full)) == len(full) and default not in full
    assert all(tune.fits(problem, c, tokens, 132) for c in full)
    shapes = {(c.block_n, c.block_k) for c in full}
    head = sweep[:min(len(shapes), len(sweep))]
    assert len({(c.block_n, c.block_k) for c in head}) == len(head)
    if problem.kind not in tune.PIPELINED:  # stages do nothing there: never swept
        assert {c.num_stages for c in full} == {default.num_stages}
    assert tune.candidates(problem, tokens, 132, cap=0) == []


def test_tune_fits_rejects_what_cannot_run_well() -> None:
    qkv, down, gate_up = tune.PROBLEMS["qkv"], tune.PROBLEMS["down"], tune.PROBLEMS["gate_up"]
    assert not tune.fits(qkv, GemvConfig(16, 256, 8, 3), 4, 132)  # 4 rows of 16: 64 acc regs
    assert tune.fits(qkv, GemvConfig(8, 256, 8, 3), 4, 132)
    assert not tune.fits(down, GemvConfig(64, 256, 8, 2), 1, 132)  # 32 programs for 132 SMs
    assert not tune.fits(down, GemvConfig(8, 1024, 8, 2), 1, 132)  # block_k past I = 768
    assert not tune.fits(gate_up, GemvConfig(64, 1024, 16, 2), 1, 132)  # 256 KB of stages


def test_tune_refinements_vary_only_warps_and_stages() -> None:
    """Refinements keep the tile shape, skip what was tried or does not fit, and
    sweep stages only where the kernel pipelines."""
    gate_up, o_proj = tune.PROBLEMS["gate_up"], tune.PROBLEMS["o_proj"]
    best = [GemvConfig(16, 512, 8, 2), GemvConfig(8, 256, 8, 2)]
    out = tune.refinements(gate_up, best, set(best), 1, 132)
    assert out and not set(out) & set(best) and len(set(out)) == len(out)
    assert {(c.block_n, c.block_k) for c in out} <= {(16, 512), (8, 256)}
    assert {c.num_stages for c in out} == set(tune.STAGES)
    assert all(tune.fits(gate_up, c, 1, 132) for c in out)
    dense = tune.refinements(o_proj, [GemvConfig(8, 256, 8, 3)], set(), 1, 132)
    assert {c.num_stages for c in dense} == {3} and GemvConfig(8, 256, 4, 3) in dense


def test_tune_case_stops_at_the_deadline() -> None:
    """Past the deadline only the default is timed, and it is the best."""
    problem = tune.Problem("o", "dense", (16, 64))
    case = tune.DenseCase(problem, 1, torch.device("cpu"), torch.float32, iters=1)
    cut = tune.tune_case(case, [GemvConfig(16, 64, 1, 3)], -1.0, lambda msg: None, refine_sms=1)
    assert cut is not None and cut["timing"]["budget_cut"] and cut["timing"]["configs_timed"] == 1
    assert cut["config"] == gc.default("dense", False, 16, 1)


def test_tune_run_writes_a_table_the_runtime_picks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """tools/tune/gemv end to end on the interpreter (tiny shapes): a spent
    budget still leaves a loadable table; a full run writes an entry exactly for
    the (kernel, T) whose best beat the default, gc.pick returns those entries,
    and the launchers with them match the reference."""
    e, k, h, inter = 8, 2, 32, 32
    problems = [tune.Problem("gu", "moe_gate_up", (e, k, h, inter)),
                tune.Problem("dn", "moe_down", (e, k, h, inter)),
                tune.Problem("qkv", "dense", (24, 64)),
                tune.Problem("o", "dense", (16, 64), optional=True)]
    # Larger tiles than the interpreter's defaults: fewer programs, so they win there.
    sweep = {"moe_gate_up": [GemvConfig(32, 32, 4, 1)], "moe_down": [GemvConfig(32, 32, 4, 1)],
             "dense": [GemvConfig(16, 64, 1, 3), GemvConfig(32, 64, 1, 3), GemvConfig(4, 16, 1, 3)]}
    cpu = torch.device("cpu")
    kw: dict[str, Any] = dict(sweep=lambda p, t: sweep[p.kind], dtype=torch.float32, iters=3,
                              min_gain=0.0, copy_bytes=1 << 20)
    empty = tune.run(tmp_path, 0.0, problems, (1, 2), cpu, **kw)
    assert gc.load_table(str(empty)) == {} and empty.name == "gemv_cpu.json"
    path = tune.run(tmp_path, 600.0, problems, (1, 2, 3), cpu, **kw)
    assert path == empty
    raw = json.loads(path.read_text())
    assert raw["meta"]["device"] == "cpu" and raw["meta"]["copy_gbps"] > 0
    table = gc.load_table(str(path))
    listed = 0
    for p in problems:
        ts = [1, 2, 4] if p.kind.startswith("dense") else [1, 2, 3]
        assert sorted(int(t) for t in raw["timings"][p.key()]) == ts
        for t in ts:
            tm = raw["timings"][p.key()][str(t)]
            entry = table.get(p.key(), {}).get(t)
            assert (entry is not None) == tm["in_table"]
            assert tm["in_table"] == (tm["best_us"] < tm["default_us"] and tm["best"] != tm["default"])
            if entry is not None:
                assert entry.to_dict() == tm["best"]
                listed += 1
    assert listed >= 6  # of 12: the larger tiles win on the interpreter
    assert f"| {problems[0].key()} | 1 |" in capsys.readouterr().out
    kc = KernelConfig(gemv_table=str(path))
    g = torch.Generator().manual_seed(5)
    w13 = torch.randn(e, 2 * inter, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, inter, generator=g) / inter**0.5
    for t in (1, 2):
        gu = gc.pick(problems[0].key(), t, CUDA0, kc) or gc.default("moe_gate_up", False)
        dn = gc.pick(problems[1].key(), t, CUDA0, kc) or gc.default("moe_down", False)
        x = torch.randn(t, h, generator=g)
        weights, ids = route_topk_ref(torch.randn(t, e, generator=g), k, True)
        out = mg.fused_moe_gemv_triton(x, w13, w2, weights, ids, configs=(gu, dn))
        assert rel_err(out, fused_moe_ref(x, w13, w2, weights, ids)) < 1e-5


def record_picks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """gc.pick wrapped to log each (key, T) it is asked for, answering as before."""
    asked: list[tuple[str, int]] = []
    real_pick = gc.pick

    def spy(key: str, tokens: int, *a: Any, **kw: Any) -> Any:
        asked.append((key, tokens))
        return real_pick(key, tokens, *a, **kw)

    monkeypatch.setattr(gc, "pick", spy)
    return asked


def test_tune_fp8_expert_pair_and_the_launchers_lookup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fp8_* problems on the interpreter: tools/tune/gemv times
    fp8_moe_gemv_triton's pair over e4m3 experts (each candidate checked against
    fused_moe_fp8_ref first), files the gate/up and down under their own keys
    at T, and an entry it writes is what gc.pick returns; the launcher asks the
    table for exactly those keys (its weights' E, H, I and top-k, x's T)."""
    from ftserve_kernels import fp8_moe_gemv_triton as fmg
    from ftserve_kernels.fp8_moe_triton import fused_moe_fp8_ref
    from ftserve_kernels.fp8_quant import quantize_weight

    e, k, h, inter = 4, 2, 128, 128
    problems = [tune.Problem("fgu", "moe_fp8_gate_up", (e, k, h, inter)),
                tune.Problem("fdn", "moe_fp8_down", (e, k, h, inter))]
    assert [p.key() for p in problems] == [f"moe_fp8_gate_up:E={e},H={h},I={inter},k={k}",
                                           f"moe_fp8_down:E={e},H={h},I={inter},k={k}"]
    # a byte a code, both kernels' (the pair is timed)
    assert problems[0].weight_bytes(1) == problems[1].weight_bytes(1) == k * 3 * inter * h
    # Larger tiles than the interpreter's defaults (16 x 128): fewer programs win there.
    sweep = [GemvConfig(64, 128, 4, 1), GemvConfig(128, 128, 4, 1)]
    path = tune.run(tmp_path, 600.0, problems, (1,), torch.device("cpu"), sweep=lambda p, t: sweep,
                    dtype=torch.float32, iters=2, min_gain=0.0, copy_bytes=1 << 20)
    raw = json.loads(path.read_text())
    kc = KernelConfig(gemv_table=str(path))
    for p in problems:
        tm = raw["timings"][p.key()]["1"]
        assert tm["configs_timed"] == 3 and tm["skipped"] == 0, tm  # the default and both candidates ran
        entry = gc.pick(p.key(), 1, CUDA0, kc)
        assert (entry is not None) == tm["in_table"] and (entry is None or entry.to_dict() == tm["best"])
    asked = record_picks(monkeypatch)
    g = torch.Generator().manual_seed(9)
    w13 = quantize_weight(torch.randn(e, 2 * inter, h, generator=g) / h**0.5)
    w2 = quantize_weight(torch.randn(e, h, inter, generator=g) / inter**0.5)
    x = torch.randn(2, h, generator=g)
    weights, ids = route_topk_ref(torch.randn(2, e, generator=g), k, True)
    out = fmg.fused_moe_fp8_gemv_triton(x, w13, w2, weights, ids, kernels=kc)
    assert asked == [(problems[0].key(), 2), (problems[1].key(), 2)]
    assert rel_err(out, fused_moe_fp8_ref(x, w13, w2, weights, ids)) < 2e-2


def test_tune_fp8_dense_gemv_and_the_launchers_lookup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dense_fp8 problem on the interpreter: tools/tune/gemv block-quantizes its
    weights, checks every candidate of fp8_gemv_triton against fp8_linear_ref,
    files the winner under the dense_fp8 key at the row block, and the launcher
    asks the table for exactly that key; its bytes are a byte a code."""
    from ftserve_kernels import fp8_gemv_triton as fv
    from ftserve_kernels.fp8_quant import fp8_linear_ref, quantize_weight

    n, k = 256, 512
    problem = tune.Problem("f8", "dense_fp8", (n, k))
    assert problem.key() == f"dense_fp8:N={n},K={k}" and problem.weight_bytes(1) == n * k
    assert problem.default(True, 1) == gc.default("dense_fp8", True, n, 1, k)
    sweep = [GemvConfig(64, 128, 4, 1), GemvConfig(128, 256, 4, 1)]
    path = tune.run(tmp_path, 600.0, [problem], (1, 2), torch.device("cpu"), sweep=lambda p, t: sweep,
                    dtype=torch.float32, iters=2, min_gain=0.0, copy_bytes=1 << 20)
    raw = json.loads(path.read_text())
    kc = KernelConfig(gemv_table=str(path))
    for t in (1, 2):
        tm = raw["timings"][problem.key()][str(t)]
        assert tm["configs_timed"] == 3 and tm["skipped"] == 0 and tm["cublas_us"] is None, tm
        entry = gc.pick(problem.key(), t, CUDA0, kc)
        assert (entry is not None) == tm["in_table"] and (entry is None or entry.to_dict() == tm["best"])
    asked = record_picks(monkeypatch)
    g = torch.Generator().manual_seed(3)
    w = quantize_weight(torch.randn(n, k, generator=g) / k**0.5)
    x = torch.randn(2, k, generator=g)
    out = fv.fp8_gemv_triton(x, w, kernels=kc)
    assert asked == [(problem.key(), 2)]
    assert rel_err(out, fp8_linear_ref(x, w)) < 1e-4


def test_tune_merge_drops_a_stale_entry() -> None:
    """A rerun where the default wins removes the old entry (it was measured
    as no better) and keeps the other T and keys."""
    a = GemvConfig(8, 128, 4, 3)
    table = tune.merge({}, "dense:N=8,K=8", 1, a, {"x": 1})
    table = tune.merge(table, "dense:N=8,K=8", 2, a, {"x": 2})
    table = tune.merge(table, "dense:N=8,K=16", 1, a, {"x": 3})
    table = tune.merge(table, "dense:N=8,K=8", 1, None, {"x": 4})
    assert table["configs"] == {"dense:N=8,K=8": {"2": a.to_dict()}, "dense:N=8,K=16": {"1": a.to_dict()}}
    assert table["timings"]["dense:N=8,K=8"] == {"1": {"x": 4}, "2": {"x": 2}}


def _check_entry(key: str, t: int, cfg: GemvConfig) -> float:
    """rel err of the kernel of ``key`` launched with ``cfg`` at T = t (CUDA, bf16)."""
    kind, shape = gc.parse_key(key)
    if kind in gc.FP8_MOE_KINDS:
        from ftserve_kernels import fp8_moe_gemv_triton as fmg
        from ftserve_kernels.fp8_moe_triton import fused_moe_fp8_ref
        from ftserve_kernels.fp8_quant import quantize_weight

        e, h, inter, k = shape["E"], shape["H"], shape["I"], shape["k"]
        w13 = quantize_weight((torch.randn(e, 2 * inter, h, device="cuda") / h**0.5).bfloat16())
        w2 = quantize_weight((torch.randn(e, h, inter, device="cuda") / inter**0.5).bfloat16())
        x = torch.randn(t, h, device="cuda").bfloat16()
        weights, ids = route_topk_ref(torch.randn(t, e, device="cuda"), k, True)
        gu, dn = fmg.moe_gemv_tiles(True)
        tiles = (cfg, dn) if kind == "moe_fp8_gate_up" else (gu, cfg)
        out = fmg.fused_moe_fp8_gemv_triton(x, w13, w2, weights, ids, tiles=tiles)
        return rel_err(out, fused_moe_fp8_ref(x, w13, w2, weights, ids))
    if kind in gc.MOE_KINDS:
        e, h, inter, k = shape["E"], shape["H"], shape["I"], shape["k"]
        w13 = (torch.randn(e, 2 * inter, h, device="cuda") / h**0.5).bfloat16()
        w2 = (torch.randn(e, h, inter, device="cuda") / inter**0.5).bfloat16()
        x = torch.randn(t, h, device="cuda").bfloat16()
        weights, ids = route_topk_ref(torch.randn(t, e, device="cuda"), k, True)
        cfgs = (cfg if kind == "moe_gate_up" else gc.default("moe_gate_up", True),
                cfg if kind == "moe_down" else gc.default("moe_down", True))
        out = mg.fused_moe_gemv_triton(x, w13, w2, weights, ids, configs=cfgs)
        return rel_err(out, fused_moe_ref(x, w13, w2, weights, ids))
    n, kd = shape["N"], shape["K"]
    w = (torch.randn(n, kd, device="cuda") / kd**0.5).bfloat16()
    x = torch.randn(t, kd, device="cuda").bfloat16()
    if kind == "dense_fp8":
        from ftserve_kernels.fp8_gemv_triton import fp8_gemv_triton
        from ftserve_kernels.fp8_quant import fp8_linear_ref, quantize_weight

        wq = quantize_weight(w)
        return rel_err(fp8_gemv_triton(x, wq, config=cfg), fp8_linear_ref(x, wq))
    return rel_err(gv.gemv_triton(x, w, config=cfg), torch.nn.functional.linear(x.float(), w.float()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_packaged_gemv_table_configs_match_reference() -> None:
    """Every entry of this GPU's packaged table runs and matches the reference
    (the tuner checked them; this guards kernel edits and Triton upgrades)."""
    path = gc.CONFIG_DIR / gc.table_file_name(torch.cuda.get_device_name())
    if not path.is_file():
        pytest.skip(f"no tuned table {path.name} for this GPU")
    torch.manual_seed(0)
    for key, by_t in gc.load_table(str(path)).items():
        for t, cfg in by_t.items():
            assert _check_entry(key, t, cfg) < 2e-2, (key, t, cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_tune_gemv_short_run_feeds_the_launchers(tmp_path: Path) -> None:
    """A short real tuner run (3 candidates per kernel, every best written):
    the table loads, and with a KernelConfig naming it the launchers' own
    lookup (no launch config passed) runs the entries and matches the reference."""
    problems = [tune.PROBLEMS["gate_up"], tune.PROBLEMS["down"], tune.PROBLEMS["o_proj"]]
    path = tune.run(tmp_path, 60.0, problems, (1,), torch.device("cuda"), cap=3, min_gain=-0.5,
                    copy_bytes=256 << 20)
    table = gc.load_table(str(path))
    kc = KernelConfig(gemv_table=str(path))
    torch.manual_seed(1)
    for key, by_t in table.items():
        for t, cfg in by_t.items():
            assert gc.pick(key, t, torch.device("cuda"), kc) == cfg
    e, k, h, inter = tune.QWEN3_MOE
    w13 = (torch.randn(e, 2 * inter, h, device="cuda") / h**0.5).bfloat16()
    w2 = (torch.randn(e, h, inter, device="cuda") / inter**0.5).bfloat16()
    x = torch.randn(1, h, device="cuda").bfloat16()
    weights, ids = route_topk_ref(torch.randn(1, e, device="cuda"), k, True)
    out = mg.fused_moe_gemv_triton(x, w13, w2, weights, ids, kernels=kc)
    assert rel_err(out, fused_moe_ref(x, w13, w2, weights, ids)) < 2e-2
    xo = torch.randn(1, 4096, device="cuda").bfloat16()
    wo = (torch.randn(2048, 4096, device="cuda") / 64).bfloat16()
    assert rel_err(gv.gemv_triton(xo, wo, kernels=kc), torch.nn.functional.linear(xo.float(), wo.float())) < 2e-2


def test_shipped_tables_parse() -> None:
    """Every table under ftserve_kernels/configs/ loads with its own parser (a
    bad key or entry there would fail on the GPU at the first launch)."""
    from ftserve_kernels import moe_configs

    root = Path(gc.__file__).parent / "configs"
    tables = sorted(root.glob("*.json"))
    assert any(p.name.startswith("gemv_") for p in tables)
    for path in tables:
        load = gc.load_table if path.name.startswith("gemv_") else moe_configs.load_table
        table = load(str(path))
        assert table and all(table.values()), path.name
