"""Tune the decode GEMV kernels' launches on this GPU; write the table gemv_configs loads.

    python -m tools.tune.gemv --out DIR --budget-s 90

Problems (qwen3-30b-a3b decode; gemv_configs names the kernel of each kind):
the MoE gate/up and down + combine GEMVs (E=128, k=8, H=2048, I=768), the qkv
projection (2048 -> 5120, its input already normed), o_proj (4096 -> 2048), and
lm_head (2048 -> 151936) only with budget to spare. Only when ``--problems``
names them: qwen3-30b-a3b-fp8's expert GEMV pair (fp8_gate_up, fp8_down: e4m3
codes; a time is the pair's, the other kernel at its default) and its qkv and
o_proj over e4m3 weights (fp8_qkv, fp8_o_proj), qwen3-next-80b-a3b's decode
shapes (next_*), SmolLM2-135M's dense linears (smol_*: decode and the batch-1
verify step, ``--tokens 1,4``). A dense launch of T rows takes the entry of T's
row block, the next power of two, as this tool files it. For each T (default
1, 2) and problem, most important first:

1. time today's default launch (gemv_configs.default): the baseline;
2. time a pruned candidate list (``candidates``: registers, shared memory,
   enough programs for the SMs, tile shapes nearest the default first); each
   candidate is checked against the torch reference at bf16 tolerance before
   it is timed; one that fails to compile or to match is skipped with its reason;
3. time the other warps / stages of the three fastest tile shapes (``refinements``);
4. keep the fastest; it goes into the table only if it beats the default by
   more than --min-gain (2%): a noise-level "win" must not replace a launch
   that has been measured in the whole decode step.

Times are CUDA-graph replays (as decode runs) cycling over enough distinct
weights (tools/bench/decode_layer: 160 MB; the MoE over routings to distinct
experts) that weights stream from HBM, not from an L2 warmed by the last call.
Rates are weight bytes / time, also as % of the device copy rate (read + write,
tools/bench/common) measured in the same run; the bf16 dense rows also time
cuBLAS F.linear on the same input.

Budget: every (problem, T) gets an equal share of the time left (a share it
does not use passes on); lm_head runs only on what is left. The clock is
checked between candidates and the table is rewritten after every (problem, T),
so a run cut short still leaves a valid table. Progress goes to stderr; the
markdown report to stdout and DIR/tune_gemv.md.

Copy DIR/gemv_<device>.json to ftserve_kernels/configs/ to ship it, or point
FTSERVE_GEMV_CONFIG_FILE at it to try it first.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ftserve_kernels import fp8_gemv_triton as fv
from ftserve_kernels import fp8_moe_gemv_triton as fmg
from ftserve_kernels import gemv_configs as gc
from ftserve_kernels import gemv_triton as gv
from ftserve_kernels import moe_down_gemv_triton as md
from ftserve_kernels import moe_gemv_triton as mg
from ftserve_kernels.fp8_moe_triton import fused_moe_fp8_ref
from ftserve_kernels.fp8_quant import Fp8Weight, fp8_linear_ref, quantize_weight
from ftserve_kernels.gemv_configs import GemvConfig
from ftserve_kernels.moe import fused_moe_ref, route_topk_ref
from tools.bench.common import measure_copy_gbps, median_time
from tools.bench.decode_layer import copies, rotate
from tools.bench.kernels import bench_graph
from tools.tune.common import Sweep, TuneRun, attempt_until, check_close, us
from tools.tune.gemv_space import (  # noqa: F401  (re-exported names)
    CAP,
    PIPELINED,
    PROBLEMS,
    QWEN3_MOE,
    STAGES,
    Problem,
    candidates,
    fits,
    refinements,
)

DEFAULT_PROBLEMS = ("gate_up", "down", "qkv", "o_proj", "lm_head")  # the kernels decode runs
TOKENS = (1, 2)
REPLAYS = 20
MIN_GAIN = 0.02


def _time_calls(fns: list[Callable[[], Any]], device: torch.device, iters: int) -> float:
    """Seconds per call, cycling over ``fns`` (distinct weights): CUDA-graph
    replay on the GPU, wall clock on the interpreter (tests only)."""
    if device.type == "cuda":
        return bench_graph(rotate(fns), replays=REPLAYS) / len(fns)
    return median_time(rotate(fns), device, iters, warmup=1) / len(fns)


def distinct_routes(problem: Problem, tokens: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Routings of ``tokens`` rows, each to distinct experts ([T, k] fp32 weights,
    [T, k] int32 ids): as many as push a call's weights past the L2 (one on the
    interpreter)."""
    e, k, _, _ = problem.shape
    assert tokens * k <= e, "each routing takes distinct experts"
    n_routes = min(max(1, e // (tokens * k)), copies(problem.weight_bytes(tokens)) if device.type == "cuda" else 1)
    perm = torch.randperm(e, device=device).to(torch.int32)
    routes = []
    for r in range(n_routes):
        weights, _ = route_topk_ref(torch.randn(tokens, e, device=device), k, True)
        ids = perm[r * tokens * k:(r + 1) * tokens * k].reshape(tokens, k).contiguous()
        routes.append((weights.float().contiguous(), ids))
    return routes


class MoeCase:
    """One MoE kernel at one T: routings to distinct experts (as many as push a
    call's weights past the L2), the reference, buffers. The kernel not under
    test runs with its default to complete the output the check compares."""

    def __init__(self, problem: Problem, tokens: int, w13: torch.Tensor, w2: torch.Tensor,
                 iters: int) -> None:
        e, k, h, inter = problem.shape
        self.problem, self.tokens, self.w13, self.w2, self.iters = problem, tokens, w13, w2, iters
        dev = self.device = w13.device
        routes = distinct_routes(problem, tokens, dev)
        self.routes = [(w.reshape(-1), ids.reshape(-1)) for w, ids in routes]  # the kernels' flat pairs
        self.x = torch.randn(tokens, h, device=dev).to(w13.dtype)
        self.ref = fused_moe_ref(self.x, w13, w2, *routes[0])
        self.act = torch.empty(tokens * k, inter, device=dev, dtype=w13.dtype)
        self.out = torch.empty(tokens, h, device=dev, dtype=w13.dtype)

    def _gate_up(self, cfg: GemvConfig, route: int) -> None:
        _, ids = self.routes[route]
        mg.moe_gate_up_gemv(self.x, self.w13, self.act, ids, self.problem.shape[1], cfg)

    def _down(self, cfg: GemvConfig, route: int) -> None:
        weights, ids = self.routes[route]
        md.moe_down_gemv(self.act, self.w2, self.out, weights, ids, self.problem.shape[1], cfg)

    def measure(self, cfg: GemvConfig) -> float:
        """Seconds per call of the kernel under test; raises if it fails to
        compile or the output differs from the reference."""
        cuda = self.device.type == "cuda"
        gate_up = gc.default("moe_gate_up", cuda)
        down = gc.default("moe_down", cuda)
        tuning_gate_up = self.problem.kind == "moe_gate_up"
        gate_up, down = (cfg, down) if tuning_gate_up else (gate_up, cfg)
        self.act.fill_(float("nan"))  # a launch that writes nothing must not pass on stale output
        self.out.fill_(float("nan"))
        self._gate_up(gate_up, 0)
        self._down(down, 0)
        check_close(self.out, self.ref)
        run = self._gate_up if tuning_gate_up else self._down
        fns = [lambda r=r: run(cfg, r) for r in range(len(self.routes))]
        return _time_calls(fns, self.device, self.iters)

    def cublas(self) -> float | None:
        return None


class MoeFp8Case:
    """fp8_moe_gemv_triton's pair at one T over e4m3 experts (the bf16 case's
    routings to distinct experts): both kernels run, the one not under test at
    its default, so a time is the pair's (the other kernel's share is the same
    for every candidate)."""

    def __init__(self, problem: Problem, tokens: int, w13: Fp8Weight, w2: Fp8Weight, dtype: torch.dtype,
                 iters: int) -> None:
        h = problem.shape[2]
        self.problem, self.tokens, self.w13, self.w2, self.iters = problem, tokens, w13, w2, iters
        dev = self.device = w13.codes.device
        self.routes = distinct_routes(problem, tokens, dev)
        self.x = torch.randn(tokens, h, device=dev).to(dtype)
        self.ref = fused_moe_fp8_ref(self.x, w13, w2, *self.routes[0])

    def _pair(self, cfg: GemvConfig, route: int) -> torch.Tensor:
        cuda = self.device.type == "cuda"
        gate_up, down = gc.default("moe_fp8_gate_up", cuda), gc.default("moe_fp8_down", cuda)
        tiles = (cfg, down) if self.problem.gate_up else (gate_up, cfg)
        weights, ids = self.routes[route]
        return fmg.fused_moe_fp8_gemv_triton(self.x, self.w13, self.w2, weights, ids, tiles=tiles)

    def measure(self, cfg: GemvConfig) -> float:
        check_close(self._pair(cfg, 0), self.ref)
        return _time_calls([lambda r=r: self._pair(cfg, r) for r in range(len(self.routes))],
                           self.device, self.iters)

    def cublas(self) -> float | None:
        return None


class DenseCase:
    """One dense GEMV at one T over enough weight copies to defeat the L2; a
    dense_fp8 problem's weights block-quantized to e4m3 (fp8_gemv_triton, each
    candidate checked against fp8_linear_ref, no cuBLAS peer)."""

    def __init__(self, problem: Problem, tokens: int, device: torch.device, dtype: torch.dtype,
                 iters: int) -> None:
        n, k = problem.shape
        self.problem, self.tokens, self.device, self.iters = problem, tokens, device, iters
        n_copies = copies(problem.weight_bytes(tokens)) if device.type == "cuda" else 1
        ws = [(torch.randn(n, k, device=device) / k**0.5).to(dtype) for _ in range(n_copies)]
        self.x = torch.randn(tokens, k, device=device).to(dtype)
        self.ws: list[torch.Tensor | Fp8Weight]
        if problem.fp8:
            self.ws = [quantize_weight(w) for w in ws]
            self.ref = fp8_linear_ref(self.x, self.ws[0]).float()
        else:
            self.ws = list(ws)
            self.ref = F.linear(self.x.float(), ws[0].float())

    def _run(self, cfg: GemvConfig, w: torch.Tensor | Fp8Weight) -> torch.Tensor:
        if isinstance(w, Fp8Weight):
            return fv.fp8_gemv_triton(self.x, w, config=cfg)
        return gv.gemv_triton(self.x, w, config=cfg)

    def measure(self, cfg: GemvConfig) -> float:
        check_close(self._run(cfg, self.ws[0]), self.ref)
        return _time_calls([lambda w=w: self._run(cfg, w) for w in self.ws], self.device, self.iters)

    def cublas(self) -> float | None:
        """F.linear on the same input (bf16 weights only)."""
        if self.problem.fp8:
            return None
        return _time_calls([lambda w=w: F.linear(self.x, w) for w in self.ws], self.device, self.iters)


Case = MoeCase | MoeFp8Case | DenseCase


def tune_case(case: Case, sweep: list[GemvConfig], deadline: float, log: Callable[[str], None],
              refine_sms: int = 0) -> dict[str, Any] | None:
    """Default and best config of one (problem, T) with their timings; None if
    even the default did not run. The default is always timed (the baseline).
    With ``refine_sms`` (the SM count) the sweep is followed, time allowing, by
    the other warps / stages of the three fastest tile shapes."""
    problem, t = case.problem, case.tokens
    default = problem.default(case.device.type == "cuda", t)
    timed = Sweep(case.measure, log)
    times = timed.times
    timed.attempt(default)
    if default not in times:
        return None
    cut = attempt_until(deadline, ((timed, cfg) for cfg in sweep))
    if refine_sms and not cut:
        fastest: list[GemvConfig] = []
        for cfg in sorted(times, key=times.__getitem__):  # one per tile shape
            if all((c.block_n, c.block_k) != (cfg.block_n, cfg.block_k) for c in fastest):
                fastest.append(cfg)
        refine = refinements(problem, fastest[:3], set(times), t, refine_sms)
        cut = attempt_until(deadline, ((timed, cfg) for cfg in refine))
    best = min(times, key=times.__getitem__)
    try:
        cublas = case.cublas()
    except Exception as exc:  # reported as missing, the tuning result stands
        log(f"  cuBLAS: {type(exc).__name__}: {exc}"[:200])
        cublas = None
    log(f"  {problem.name} T={t}: {len(times)} configs timed, {timed.skipped} skipped"
        f"{' (budget cut)' if cut else ''}; default {us(times[default])} us, best {us(times[best])} us")
    return {"config": best, "default_s": times[default], "best_s": times[best], "cublas_s": cublas,
            "timing": {"default_us": us(times[default]), "best_us": us(times[best]),
                       "cublas_us": us(cublas), "weight_mb": round(problem.weight_bytes(t) / 1e6, 2),
                       "default": default.to_dict(), "best": best.to_dict(),
                       "configs_timed": len(times), "skipped": timed.skipped, "budget_cut": cut}}


def merge(table: dict[str, Any], key: str, t: int, cfg: GemvConfig | None,
          timing: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``table`` with the timing of (key, T) set and its config set
    (``cfg``) or removed (None: the default won, an older entry is stale)."""
    out = {"configs": {}, "timings": {}} | table
    for part, value in (("configs", cfg.to_dict() if cfg is not None else None), ("timings", timing)):
        by_t = dict(out[part].get(key, {}))
        by_t.pop(str(t), None)
        if value is not None:
            by_t[str(t)] = value
        rest = {k: v for k, v in out[part].items() if k != key}
        out[part] = rest | ({key: dict(sorted(by_t.items(), key=lambda kv: int(kv[0])))} if by_t else {})
    return out


def report(table: dict[str, Any], copy_gbps: float) -> str:
    """Markdown: per kernel and T, default vs best as time, weight GB/s and % of
    the copy rate, the speedup, cuBLAS for the dense kernels, and whether the
    best went into the table."""
    def rate(us: float | None, mb: float) -> str:
        if not us:
            return "-"
        gbps = mb * 1e3 / us
        return f"{gbps:.0f} ({100 * gbps / copy_gbps:.0f}%)"

    rows = [f"copy rate (read + write): {copy_gbps:.0f} GB/s", "",
            "| kernel | T | weights MB | default us | GB/s (% copy) | best us | GB/s (% copy) | speedup "
            "| cuBLAS us | GB/s (% copy) | in table | best config |", "|" + "---|" * 12]
    for key, by_t in table.get("timings", {}).items():
        for t, tm in by_t.items():
            mb, d, b, c = tm["weight_mb"], tm["default_us"], tm["best_us"], tm.get("cublas_us")
            listed = str(t) in table.get("configs", {}).get(key, {})
            best = " ".join(f"{name}={v}" for name, v in tm["best"].items())
            rows.append(f"| {key} | {t} | {mb} | {d} | {rate(d, mb)} | {b} | {rate(b, mb)} | "
                        f"{d / b:.3f}x | {c if c is not None else '-'} | {rate(c, mb)} | "
                        f"{'yes' if listed else 'no'} | {best} |")
    return "\n".join(rows)


def run(out_dir: Path, budget_s: float, problems: Iterable[Problem], tokens: Iterable[int],
        device: torch.device, sweep: Callable[[Problem, int], list[GemvConfig]] | None = None,
        dtype: torch.dtype = torch.bfloat16, iters: int = 15, min_gain: float = MIN_GAIN,
        copy_bytes: int = 2 << 30, cap: int = CAP) -> Path:
    """Tune every (problem, T) within ``budget_s``; returns the table path
    (rewritten after every (problem, T)). ``sweep`` replaces the generated
    candidates (tests run tiny tiles on the interpreter)."""
    tr = TuneRun(out_dir, budget_s, device, gc.table_file_name)
    t0, deadline, log = tr.t0, tr.deadline, tr.log
    cuda = device.type == "cuda"
    sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 1
    copy_gbps = measure_copy_gbps(device, copy_bytes, iters=10 if cuda else 2)["gbps_read_plus_write"]
    tr.stamp(copy_gbps=round(copy_gbps, 1), min_gain=min_gain)
    log(f"{tr.device_name}: copy rate {copy_gbps:.0f} GB/s, {sms} SMs")
    problems = list(problems)
    order = ([(p, t) for t in tokens for p in problems if not p.optional]
             + [(p, t) for t in tokens for p in problems if p.optional])
    required_left = sum(not p.optional for p, _ in order)
    moe_weights: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
    fp8_weights: dict[tuple[int, ...], tuple[Fp8Weight, Fp8Weight]] = {}
    torch.manual_seed(0)
    for problem, t in order:
        now = time.monotonic()
        if now > deadline:
            log(f"budget spent before {problem.name} T={t}")
            break
        # An equal share of what is left; optional problems get only the leftover.
        share_end = now + (deadline - now) / required_left if not problem.optional else deadline
        required_left -= not problem.optional
        log(f"{problem.name} T={t} ({problem.key()}), until +{share_end - t0:.0f}s")
        case: Case
        if problem.moe:
            if problem.shape not in moe_weights:
                e, k, h, inter = problem.shape
                moe_weights[problem.shape] = ((torch.randn(e, 2 * inter, h, device=device) / h**0.5).to(dtype),
                                              (torch.randn(e, h, inter, device=device) / inter**0.5).to(dtype))
            if problem.fp8:
                if problem.shape not in fp8_weights:
                    w13, w2 = moe_weights[problem.shape]
                    fp8_weights[problem.shape] = (quantize_weight(w13), quantize_weight(w2))
                case = MoeFp8Case(problem, t, *fp8_weights[problem.shape], dtype=dtype, iters=iters)
            else:
                case = MoeCase(problem, t, *moe_weights[problem.shape], iters=iters)
        else:
            case = DenseCase(problem, t, device, dtype, iters)
        configs = sweep(problem, t) if sweep is not None else candidates(problem, t, sms, cap)
        result = tune_case(case, configs, share_end, log, refine_sms=sms if sweep is None else 0)
        del case
        if result is None:
            continue
        win = result["default_s"] / result["best_s"] > 1 + min_gain and result["config"] != problem.default(
            cuda, t)
        result["timing"]["in_table"] = win
        tr.save(merge(tr.table, problem.key(), problem.table_t(t), result["config"] if win else None,
                      result["timing"]))
    return tr.finish("tune_gemv.md", report(tr.table, copy_gbps))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for gemv_<device>.json and tune_gemv.md")
    ap.add_argument("--budget-s", type=float, default=90.0, help="stop starting configs after this")
    ap.add_argument("--problems", default=",".join(DEFAULT_PROBLEMS), help=f"comma list of {sorted(PROBLEMS)}")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--min-gain", type=float, default=MIN_GAIN, help="fraction the best must beat the default by")
    ap.add_argument("--cap", type=int, default=CAP, help="candidates per (problem, T)")
    args = ap.parse_args(argv)
    problems = [PROBLEMS[name] for name in args.problems.split(",")]
    assert torch.cuda.is_available(), "tune_gemv needs a CUDA device"
    run(Path(args.out), args.budget_s, problems, [int(t) for t in args.tokens.split(",")],
        torch.device("cuda"), min_gain=args.min_gain, cap=args.cap)


if __name__ == "__main__":
    main()
