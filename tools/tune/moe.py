"""Tune the grouped-GEMM fused MoE tiles on this GPU; write the table moe_configs loads.

    python -m tools.tune.moe --out DIR --budget-s 150

For each shape (qwen3-30b-a3b first, then mixtral-8x7b and qwen3-next-80b-a3b's
512 experts if the budget allows; ``--shapes`` picks) and
each token count T (most important first), with realistic routing
(route_topk_triton over random logits):

1. time the heuristic config (today's default) for both kernels;
2. sweep gate/up and down candidates independently, interleaved so a cut-off
   run has tried both; every candidate is checked against fused_moe_ref at bf16
   tolerance before it is timed; a config that fails to compile (shared memory,
   registers) or to match is skipped with its reason;
3. refine the three fastest of each kernel with group_m 16;
4. keep the block_m whose gate/up + down + alignment time is lowest.

Triton compiles each config once (~1-2 s) and reuses it for every T (the int
arguments specialize the same way at all tuned T), so the first T pays for the
compiles. The clock is checked between configs; results are written after every
T, so a run cut by --budget-s still leaves a valid table. Progress goes to
stderr; a markdown report (default vs best, TFLOP/s against an 8192^3 bf16
matmul measured in the same run) goes to stdout and DIR/tune_moe.md.

Copy DIR/moe_<device>.json to ftserve_kernels/configs/ to ship it, or point
FTSERVE_MOE_CONFIG_FILE at it to try it first.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ftserve_kernels import moe_align_triton as ma
from ftserve_kernels import moe_triton as mt
from ftserve_kernels.moe import fused_moe_ref
from ftserve_kernels.moe_configs import (
    MoeConfig,
    heuristic,
    parse_shape_key,
    shape_key,
    table_file_name,
)
from tools.bench.common import median_time
from tools.tune.common import (  # noqa: F401  (SMEM_LIMIT: re-exported)
    SMEM_LIMIT,
    Sweep,
    TuneRun,
    attempt_until,
    check_close,
    us,
)
from tools.tune.moe_space import (  # noqa: F401  (re-exported names)
    ALIGN_CHUNKS,
    Tile,
    align_chunks,
    block_ms,
    candidates,
    cap_for,
    choose,
    fits,
    merge_table,
    refinements,
    smem_bytes,
    split_config,
    to_config,
)

SHAPES: dict[str, tuple[int, int, int, int]] = {  # name -> (E, k, H, I)
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "qwen3-next-80b-a3b": (512, 10, 2048, 512),  # the hybrid's routed experts (issue 33)
}
TOKENS = (4096, 8192, 2048, 1024, 512)  # prefill chunk sizes, most important first


class Bench:
    """One (shape, T) problem on the GPU: inputs, reference, alignments per block_m."""

    def __init__(self, shape: tuple[int, int, int, int], tokens: int,
                 w13: torch.Tensor, w2: torch.Tensor, iters: int = 15) -> None:
        e, k, h, inter = shape
        self.shape, self.tokens, self.w13, self.w2 = shape, tokens, w13, w2
        self.device, self.iters = w13.device, iters
        dt = w13.dtype
        self.x = torch.randn(tokens, h, device=self.device).to(dt)
        logits = torch.randn(tokens, e, device=self.device)
        self.weights, self.ids = mt.route_topk_triton(logits, k, True)
        self.flat_w = self.weights.reshape(-1).contiguous()
        self.ref = fused_moe_ref(self.x, w13, w2, self.weights, self.ids)
        n = tokens * k
        self.act = torch.empty(n, inter, device=self.device, dtype=dt)
        self.y = torch.empty(n, h, device=self.device, dtype=dt)
        self._aligns: dict[int, mt.Alignment] = {}
        self.align_s: dict[int, float] = {}
        self.base: dict[int, MoeConfig] = {}  # block_m -> a verified config for the other kernel

    def align(self, bm: int) -> mt.Alignment:
        if bm not in self._aligns:
            e = self.shape[0]
            self._aligns[bm] = ma.moe_align(self.ids, e, bm)
            self.align_s[bm] = self.time(lambda: ma.moe_align(self.ids, e, bm))
        return self._aligns[bm]

    def align_chunk_times(self, bm: int, deadline: float) -> dict[int, float]:
        """Seconds of moe_align per chunk (0: default); a chunk whose result is
        not bit-identical to the default's is left out."""
        e = self.shape[0]
        ref = self.align(bm)
        out = {0: self.align_s[bm]}
        for chunk in align_chunks(self.ids.numel(), e, bm):
            if time.monotonic() > deadline:
                break
            try:
                got = ma.moe_align(self.ids, e, bm, chunk)
                if all(torch.equal(a, b) for a, b in zip(got, ref)):
                    out[chunk] = self.time(lambda c=chunk: ma.moe_align(self.ids, e, bm, c))
            except Exception:  # a chunk that does not compile is just not a candidate
                continue
        return out

    def time(self, fn: Callable[[], Any]) -> float:
        return median_time(fn, self.device, self.iters, warmup=min(2, self.iters))

    def _gate_up(self, cfg: MoeConfig) -> None:
        mt.moe_gate_up(self.x, self.w13, self.act, self.align(cfg.block_m), self.shape[1], cfg)

    def _down(self, cfg: MoeConfig) -> None:
        mt.moe_down(self.act, self.w2, self.y, self.flat_w, self.align(cfg.block_m), cfg)

    def _check(self) -> None:
        t, h = self.x.shape
        check_close(self.y.view(t, self.shape[1], h).sum(1), self.ref)

    def measure(self, kind: str, tile: Tile) -> float:
        """Seconds of one kernel launch with this tile; raises if it fails to
        compile or its output differs from the reference."""
        other = self.base.get(tile.block_m) or _fallback(tile.block_m)
        gu, dn = split_config(other)
        cfg = to_config(tile, dn) if kind == "gate_up" else to_config(gu, tile)
        self._gate_up(cfg)
        self._down(cfg)
        self._check()
        self.base.setdefault(tile.block_m, cfg)
        run = self._gate_up if kind == "gate_up" else self._down
        return self.time(lambda: run(cfg))


def _fallback(bm: int) -> MoeConfig:
    """A conservative config at this block_m for the kernel not being tuned."""
    return MoeConfig(bm, 64, 64, 8, 4 if bm <= 64 else 8, 3)


def tune_one(bench: Bench, deadline: float, log: Callable[[str], None],
             sweep: tuple[list[Tile], list[Tile]] | None = None) -> dict[str, Any] | None:
    """Best config for one (shape, T), with its timings; None if nothing ran.
    ``sweep`` (gate/up tiles, down tiles) replaces the generated candidates."""
    e, k, h, inter = bench.shape
    t = bench.tokens
    n = t * k
    default = heuristic(n, e, bench.device.type)
    d_gu, d_dn = split_config(default)
    kinds = ("gate_up", "down")
    sweeps = {kind: Sweep(lambda tile, kind=kind: bench.measure(kind, tile), log, f"{kind} ") for kind in kinds}
    times = {kind: s.times for kind, s in sweeps.items()}

    bench.base[default.block_m] = default
    sweeps["gate_up"].attempt(d_gu)
    sweeps["down"].attempt(d_dn)
    default_s = {kind: times[kind].get(tile) for kind, tile in zip(kinds, (d_gu, d_dn))}
    if sweep is None:
        bms, cap = block_ms(n / e), cap_for(t)
        sweep = candidates("gate_up", bms, h, inter, cap), candidates("down", bms, inter, h, cap)
    # Interleaved so a run cut by the deadline has tried both kernels.
    cut = attempt_until(deadline, ((sweeps[kind], tile) for pair in itertools.zip_longest(*sweep)
                                   for kind, tile in zip(kinds, pair) if tile is not None))
    if not cut:
        fastest = {kind: sorted(times[kind], key=times[kind].__getitem__)[:3] for kind in kinds}
        cut = attempt_until(deadline, ((sweeps[kind], tile) for kind in kinds
                                       for tile in refinements(fastest[kind], set(times[kind]))))
    for bm in {tile.block_m for tile in times["gate_up"]}:
        bench.align(bm)
    chosen = choose(times["gate_up"], times["down"], bench.align_s)
    if chosen is None:
        log(f"  T={t}: nothing measured")
        return None
    cfg, _ = chosen
    chunk_s = bench.align_chunk_times(cfg.block_m, deadline)
    cfg = replace(cfg, align_chunk=min(chunk_s, key=chunk_s.__getitem__))
    gu_tile, dn_tile = split_config(cfg)
    log(f"  T={t}: {len(times['gate_up'])}+{len(times['down'])} configs timed, "
        f"{sweeps['gate_up'].skipped}+{sweeps['down'].skipped} skipped{' (budget cut)' if cut else ''}")
    return {
        "config": cfg,
        "timing": {
            "gate_up_default_us": us(default_s["gate_up"]), "gate_up_best_us": us(times["gate_up"][gu_tile]),
            "down_default_us": us(default_s["down"]), "down_best_us": us(times["down"][dn_tile]),
            "align_us": us(chunk_s[cfg.align_chunk]),
            "align_chunk_us": {str(c): us(s) for c, s in chunk_s.items()},
            "align_default_us": us(bench.align_s.get(default.block_m)),
            "configs_timed": [len(times["gate_up"]), len(times["down"])],
            "budget_cut": cut,
        },
    }


def _matmul_tflops(device: torch.device, n: int = 8192) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    secs = median_time(lambda: torch.matmul(a, b, out=c), device, iters=10, warmup=3)
    return 2 * n**3 / secs / 1e12


def report(table: dict[str, Any], matmul_tflops: float, matmul_n: int = 8192) -> str:
    """Markdown: per shape and T, default vs best time of each kernel, the
    achieved rate of the best as TFLOP/s and % of the measured matmul rate, and
    the speedup of gate/up + down + alignment together."""
    rows = ["| shape | T | gate_up default us | best us | TFLOP/s (% mm) | down default us | best us "
            "| TFLOP/s (% mm) | align default us | best us | speedup | config |", "|" + "---|" * 12]
    for shape, by_t in table.get("timings", {}).items():
        e, h, inter, k = parse_shape_key(shape)
        for t, tm in by_t.items():
            n = int(t) * k
            cells: list[Any] = [shape, t]
            for kind, flops in (("gate_up", 2 * n * h * 2 * inter), ("down", 2 * n * inter * h)):
                best = tm[f"{kind}_best_us"]
                rate = flops / (best * 1e-6) / 1e12 if best else 0.0
                cells += [tm[f"{kind}_default_us"], best,
                          f"{rate:.0f} ({100 * rate / matmul_tflops:.0f}%)"]
            cells += [tm.get("align_default_us"), tm.get("align_us")]
            parts = [(tm.get(f"{p}_default_us"), tm.get(f"{p}_us" if p == "align" else f"{p}_best_us"))
                     for p in ("gate_up", "down", "align")]
            ok = all(d is not None and b for d, b in parts)
            cells.append(f"{sum(d for d, _ in parts) / sum(b for _, b in parts):.2f}x" if ok else "-")
            cfg = table["configs"][shape][t]
            cells.append(" ".join(f"{key}={v}" for key, v in cfg.items() if v))
            rows.append("| " + " | ".join(str(c) for c in cells) + " |")
    head = f"bf16 matmul {matmul_n}^3: {matmul_tflops:.0f} TFLOP/s"
    return head + "\n\n" + "\n".join(rows)


def run(out_dir: Path, budget_s: float, shapes: dict[str, tuple[int, int, int, int]],
        tokens: Iterable[int], device: torch.device, matmul_n: int = 8192,
        sweep: Callable[[tuple[int, int, int, int], int], tuple[list[Tile], list[Tile]]] | None = None,
        dtype: torch.dtype = torch.bfloat16, iters: int = 15) -> Path:
    """Tune every (shape, T) in order until ``budget_s`` is spent; returns the
    table path (rewritten after every T). ``sweep`` replaces the generated
    candidates (tests run tiny tiles on the interpreter)."""
    tr = TuneRun(out_dir, budget_s, device, table_file_name)
    deadline, log = tr.deadline, tr.log
    mm = _matmul_tflops(device, matmul_n)
    tr.stamp(matmul_tflops=round(mm, 1))
    log(f"{tr.device_name}: bf16 matmul {mm:.0f} TFLOP/s")
    torch.manual_seed(0)
    for name, shape in shapes.items():
        e, k, h, inter = shape
        if time.monotonic() > deadline:
            log(f"budget spent before {name}")
            break
        w13 = (torch.randn(e, 2 * inter, h, device=device) / h**0.5).to(dtype)
        w2 = (torch.randn(e, h, inter, device=device) / inter**0.5).to(dtype)
        key = shape_key(e, h, inter, k)
        for t in tokens:
            if time.monotonic() > deadline:
                log(f"budget spent before {name} T={t}")
                break
            log(f"{name} T={t}")
            bench = Bench(shape, t, w13, w2, iters=iters)
            result = tune_one(bench, deadline, log, sweep(shape, t) if sweep else None)
            if result is not None:
                tr.save(merge_table(tr.table, key, t, result["config"], result["timing"]))
            del bench
        del w13, w2
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return tr.finish("tune_moe.md", report(tr.table, mm, matmul_n))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for moe_<device>.json and tune_moe.md")
    ap.add_argument("--budget-s", type=float, default=150.0, help="stop starting configs after this")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {sorted(SHAPES)}")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    args = ap.parse_args(argv)
    assert torch.cuda.is_available(), "tune_moe needs a CUDA device"
    shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    run(Path(args.out), args.budget_s, shapes, [int(t) for t in args.tokens.split(",")],
        torch.device("cuda"))


if __name__ == "__main__":
    main()
