"""MoE expert-cache benchmark (issue 6 item 9): offload mode against the PCIe
bound and against resident mode, measured in the same run.

    python -m tools.bench.moe_cache --out bench_moe_cache.json        # H200, < 4 min
    python -m tools.bench.moe_cache --smoke --out /tmp/moe_smoke.json  # CPU, tiny-moe

qwen3-30b-a3b shapes (8 layers, 128 experts of 9.4 MB in bf16), dummy weights.
Sections (each recorded, or its error recorded, in the JSON; the run goes on):
    limits        pinned host->device GB/s (cudaMemcpy) and the UVA row-copy kernel's GB/s
    <mode>_build  engine start-up; modes: resident, offload (25% of experts in
                  slots), offload_full (slots for every expert: must never stream)
    <mode>_prefill  one 4,096-token chunk over 0 / 32k / 100k cached tokens:
                  seconds, experts streamed, PCIe bound = bytes of the experts not in
                  the LRU cache (what had to be streamed) / H2D GB/s
    <mode>_decode   tokens/s at batch 1 and 8, cache hit rate, PCIe bound at that
                  hit rate = bytes copied per step (the misses) / H2D GB/s; each
                  offload row's ceiling = bound / (bound + the resident step's time
                  outside the expert kernels)
Targets: offload prefill <= 1.1 x max(PCIe bound, resident) at every cached
length; offload decode >= 90% of its PCIe bound.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from typing import Any

import torch

from ftserve.config import EngineConfig
from ftserve.engine.driver import EngineDriver
from ftserve.engine.engine import Engine
from ftserve.engine.request import ReqState
from ftserve.moe.cache import ExpertCache
from tools.bench.common import (
    gpu_kernel_seconds,
    measure_h2d_gbps,
    run_section,
    say,
    start_run,
    sync,
    write_json,
)
from tools.bench.moe_cache_report import render, summarize

MODES = ("resident", "offload", "offload_full")
DECODE_SEED = 7000  # + batch size: every mode decodes the same prompts


def cache_of(engine: Engine) -> ExpertCache | None:
    return getattr(engine.runner.model, "expert_cache", None)


def stats(engine: Engine) -> dict[str, float]:
    cache = cache_of(engine)
    return cache.stats() if cache is not None else {}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0) for k in ("lookups", "misses", "experts_streamed",
                                                     "experts_uncached", "bytes_streamed", "bytes_missed")
            if k in after}


# ----------------------------------------------------------------- limits


def measure_uva_gbps(device: torch.device, row_elems: int, rows: int) -> dict[str, Any]:
    """The row-copy kernel reading pinned host memory (what a miss costs)."""
    from ftserve.moe.kernels import fill_rows

    bank = torch.empty(rows, row_elems, dtype=torch.bfloat16, pin_memory=True).fill_(1.0)
    slots = torch.empty(rows + 1, row_elems, dtype=torch.bfloat16, device=device)
    ids = torch.arange(rows, dtype=torch.int32, device=device)
    fill_rows(bank, slots, ids, ids)  # compile
    times = []
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        fill_rows(bank, slots, ids, ids)
        sync(device)
        times.append(time.perf_counter() - t0)
    ok = bool(torch.equal(slots[:rows].cpu(), bank))
    nbytes = bank.numel() * 2
    return {"bytes": nbytes, "median_s": statistics.median(times),
            "gbps": nbytes / statistics.median(times) / 1e9, "correct": ok}


# ----------------------------------------------------------------- prefill / decode


def prefill_chunk(drv: EngineDriver, engine: Engine, device: torch.device, prompt: list[int], prefix: int,
                  chunk: int) -> dict[str, Any]:
    req = drv.add(prompt, max_tokens=1)
    batch = drv.sched.schedule()
    assert batch is not None and batch.reqs == [req], "the chunk must run alone"
    if (batch.prefix_lens[0], len(batch.new_tokens[0])) != (prefix, chunk):
        raise RuntimeError(f"planned {len(batch.new_tokens[0])} over {batch.prefix_lens[0]} cached, "
                           f"wanted {chunk} over {prefix}")
    before = stats(engine)
    sync(device)
    t0 = time.perf_counter()
    token_ids, lp = drv.runner.step(batch)
    sync(device)
    wall = time.perf_counter() - t0
    drv.sched.commit(batch, token_ids, lp)
    drv.sched.finished_reqs.clear()
    return {"wall_s": wall, **delta(stats(engine), before)}


def bench_prefill(drv: EngineDriver, engine: Engine, device: torch.device, base: list[int],
                  prefix: int, chunk: int, reps: int) -> dict[str, Any]:
    runs = [prefill_chunk(drv, engine, device, base[:prefix] + drv.tokens(chunk), prefix, chunk)
            for _ in range(reps + 1)][1:]  # the first one warms up (compiles, fills caches)
    out: dict[str, Any] = {"prefix": prefix, "chunk": chunk,
                           "wall_s": statistics.median(r["wall_s"] for r in runs),
                           "walls_s": [r["wall_s"] for r in runs]}
    if "experts_streamed" in runs[0]:
        for k in ("experts_streamed", "experts_uncached", "bytes_streamed"):
            out[k] = statistics.median(r[k] for r in runs)
        # The bound counts only what had to cross PCIe: experts not in the LRU cache.
        out["bytes_needed"] = out["experts_uncached"] * cache_of(engine).bank.row_bytes
    return out


def prefill_base(drv: EngineDriver, device: torch.device, base: list[int]) -> dict[str, Any]:
    req = drv.add(base, max_tokens=1)
    sync(device)
    t0 = time.perf_counter()
    drv.run_all()
    sync(device)
    assert req.finished
    return {"tokens": len(base), "total_s": time.perf_counter() - t0}


PROFILE_STEPS = 4  # decode steps run under the profiler after the timed ones
# Warm-up steps after the expert cache is emptied: at batch 1 the first steps
# miss nearly every expert (2026-11-30 03:53 H200, 4 warm-up steps: hit rate 0.51).
SEEDED_WARMUP = 24
EXPERT_KERNELS = ("_gemv_gate_up", "_gemv_down", "_moe_gate_up", "_moe_down")  # GEMV and grouped paths


def bench_decode(drv: EngineDriver, engine: Engine, device: torch.device, bs: int, prompt_len: int,
                 warmup: int, steps: int, seed: int | None = None) -> dict[str, Any]:
    """``seed``: the prompts come from it, and the expert cache is emptied once
    the prompts are in, so runs with the same seed decode the same tokens from
    the same cache state (modes compare like for like)."""
    rng = random.Random(seed) if seed is not None else None
    prompts = [drv.tokens(prompt_len, rng) for _ in range(bs)]
    if seed is not None:
        warmup = max(warmup, SEEDED_WARMUP)  # from an empty cache to its steady state
    reqs = [drv.add(p, max_tokens=warmup + steps + PROFILE_STEPS + 4) for p in prompts]
    for _ in range(20 * bs + 50):
        if all(r.state is ReqState.DECODE for r in reqs):
            break
        drv.sync_step()
    cache = cache_of(engine)
    if seed is not None and cache is not None and not cache.full:
        sync(device)
        cache.reset()  # in place: the captured graphs keep their pointers
    for _ in range(warmup):
        drv.sync_step()
    before = stats(engine)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        b = drv.sync_step()
        assert b is not None and b.is_decode and len(b.reqs) == bs
    sync(device)
    wall = time.perf_counter() - t0
    d = delta(stats(engine), before)
    out: dict[str, Any] = {"batch": bs, "steps": steps, "step_ms": wall / steps * 1e3,
                           "tokens_per_s": bs * steps / wall, "seed": seed,
                           "tokens": list(reqs[0].output_ids),
                           "graph": engine.runner.graphs is not None and engine.runner.graphs.can_run(bs)}
    if device.type == "cuda":
        # Whether the expert copies ran beside compute: of the fill kernels' time,
        # the part some other kernel shared.
        prof = gpu_kernel_seconds(lambda: [drv.sync_step() for _ in range(PROFILE_STEPS)], device,
                                  name_filters=EXPERT_KERNELS, overlap_of="fill_rows", top=12)
        ov = prof["overlap"]
        # The expert GEMMs / GEMVs: in offload mode the only compute a layer's
        # copies can run beside (everything else waits on them or feeds them).
        out["expert_ms_per_step"] = sum(prof["by_filter"].values()) * 1e3 / PROFILE_STEPS
        out["profile"] = {"kernel_ms_per_step": prof["kernel_s"] * 1e3 / PROFILE_STEPS,
                          "fill_ms_per_step": ov["key_s"] * 1e3 / PROFILE_STEPS,
                          "fill_overlapped_frac": ov["overlapped_s"] / ov["key_s"] if ov["key_s"] else None,
                          "top": prof["top"]}
    drv.abort_all()
    if d.get("lookups"):
        out["hit_rate"] = 1.0 - d["misses"] / d["lookups"]  # lookups served from VRAM
        out["experts_missed_per_step"] = d["misses"] / steps
        # Every byte decode moved over PCIe: the bound is these bytes at the measured H2D rate.
        out["missed_bytes_per_step"] = d["bytes_missed"] / steps
    return out


# ----------------------------------------------------------------- one mode


def build(args: argparse.Namespace, model_dir: str, device: torch.device, slots: int | None) -> Engine:
    from ftserve.engine.setup import build_engine

    return build_engine(EngineConfig(
        model=model_dir, load_format="dummy", dtype=args.dtype, device=str(device), page_size=16,
        kv_cache_tokens=args.kv_tokens, max_prefill_length=args.chunk, max_running_requests=max(args.batches),
        cuda_graph_max_bs=max(args.batches), status_log_interval=0.0, max_model_len=args.max_len,
        moe_cache_size=slots))


def run_mode(mode: str, args: argparse.Namespace, model_dir: str, device: torch.device,
             results: dict[str, Any], section: Any) -> None:
    total = args.layers * args.num_experts
    slots = {"resident": None, "offload": max(1, int(total * args.cache_frac)), "offload_full": total}[mode]
    engine = section(f"{mode}_build", lambda: build(args, model_dir, device, slots))
    if engine is None:
        return
    results[f"{mode}_build"] = dict(engine.summary)
    drv = EngineDriver(engine, seed=1)
    cached = args.cached if mode != "offload_full" else [p for p in args.cached if p <= args.cached[1]]
    base = drv.tokens(max(cached))

    def prefill() -> list[dict[str, Any]]:
        rows = [bench_prefill(drv, engine, device, [], 0, args.chunk, args.reps)]
        say(f"  {mode} cold chunk {rows[0]['wall_s']:.3f} s")
        if max(cached) > 0:
            rows.append({"base_prefill": prefill_base(drv, device, base)})
            for p in cached:
                if p > 0:
                    rows.append(bench_prefill(drv, engine, device, base, p, args.chunk, args.reps))
                    say(f"  {mode} chunk over {p}: {rows[-1]['wall_s']:.3f} s")
        drv.abort_all()
        return rows

    section(f"{mode}_prefill", prefill)
    def decode() -> list[dict[str, Any]]:
        return [bench_decode(drv, engine, device, bs, args.decode_prompt, args.decode_warmup,
                             args.decode_steps, seed=DECODE_SEED + bs) for bs in args.batches]

    section(f"{mode}_decode", decode)
    engine.shutdown()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_moe_cache.json")
    p.add_argument("--smoke", action="store_true", help="tiny-moe on the CPU (< 60 s)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--cache-frac", type=float, default=0.25)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--budget-s", type=float, default=None, help="skip sections past this (default 200)")
    args = p.parse_args(argv)
    args.preset, args.dtype, args.device, args.num_experts = "qwen3-30b-a3b", "bfloat16", "cuda", 128
    args.chunk, args.reps, args.max_len, args.kv_tokens = 4096, 2, 131072, 120_000
    args.cached, args.batches = [0, 32768, 102400], [1, 8]
    args.decode_prompt, args.decode_warmup, args.decode_steps = 256, 4, 32
    if args.smoke:
        args.preset, args.dtype, args.device, args.num_experts = "tiny-moe", "float32", "cpu", 16
        args.layers, args.chunk, args.reps, args.max_len, args.kv_tokens = 3, 64, 1, 1024, 4096
        args.cached, args.batches = [0, 64, 256], [1, 3]
        args.decode_prompt, args.decode_warmup, args.decode_steps = 20, 1, 4
    if args.budget_s is None:
        args.budget_s = 50.0 if args.smoke else 200.0
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device, results, t_start, deadline, model_dir = start_run(args, "ftserve-moe-")

    def section(name: str, fn: Any) -> Any:
        out = run_section(results, name, fn, deadline)
        write_json(args.out, results)  # a run killed later still leaves what it measured
        return out

    def limits() -> dict[str, Any]:
        out: dict[str, Any] = {"h2d": measure_h2d_gbps(device, 1 << 30 if not args.smoke else 1 << 24)}
        if device.type == "cuda":
            out["uva_fill"] = measure_uva_gbps(device, 3 * 768 * 2048, 64)
        return out

    section("limits", limits)
    for mode in args.modes.split(","):
        run_mode(mode, args, model_dir, device, results, section)
        gc.collect()  # the mode's engine is unreachable now: free its VRAM and pinned bank
        if device.type == "cuda":
            torch.cuda.empty_cache()
    results["summary"] = summarize(results)
    results["total_s"] = time.perf_counter() - t_start
    write_json(args.out, results)
    print(render(results["summary"]), flush=True)
    say(f"wrote {args.out} in {results['total_s']:.0f} s")
    return results


if __name__ == "__main__":
    main()
