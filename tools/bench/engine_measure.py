"""What the engine benchmarks time through an EngineDriver, each as a dict row.

Prefill: one chunk over a cached prefix (FLOPs, TFLOP/s, GPU-busy fraction
from a profiled run) and the shared base prompt that leaves a prefix cached.
Decode: N steps at a batch size and context, overlapped as the engine thread
runs them and again without overlap, against the HBM roofline of the bytes a
step reads; plus the CUDA-graph replay alone and a host-side profile.

Every timed region is bracketed by torch.cuda.synchronize and CUDA events
(bench_common.timed). Used by tools/bench/engine.py, bench_decode_variants.py
and bench_kv_tiers.py.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from ftserve.engine.cuda_graph import DecodeGraphs
from ftserve.engine.driver import EngineDriver
from ftserve.engine.request import ReqState
from ftserve.engine.sampler import SamplerFeatures
from ftserve.engine.sampling_params import SamplingParams
from ftserve.engine.scheduler import ScheduledBatch
from tools.bench.common import (
    decode_step_bytes,
    gpu_kernel_seconds,
    prefill_flops,
    say,
    timed,
)

# ----------------------------------------------------------------- prefill


def prefill_chunk(drv: EngineDriver, prompt: list[int], prefix: int, chunk: int,
                  device: torch.device, profile: bool = False) -> dict[str, Any]:
    """Time the single prefill chunk of ``prompt`` that follows ``prefix``
    cached tokens (the prompt must end right after the chunk)."""
    drv.flush()
    req = drv.add(prompt, max_tokens=1)
    t0 = time.perf_counter()
    batch = drv.sched.schedule()
    sched_s = time.perf_counter() - t0
    assert batch is not None and batch.reqs == [req], "the chunk must run alone"
    got_prefix, got_new = batch.prefix_lens[0], len(batch.new_tokens[0])
    if (got_prefix, got_new) != (prefix, chunk):
        drv.sync_step(batch)
        drv.run_all()
        raise RuntimeError(f"expected a {chunk}-token chunk over {prefix} cached tokens, "
                           f"the scheduler planned {got_new} over {got_prefix} (prefix evicted?)")
    out: dict[str, Any] = {"schedule_s": sched_s}
    if profile:
        res: list[Any] = []
        out["profile"] = gpu_kernel_seconds(lambda: res.append(drv.runner.step(batch)), device,
                                            ("extend", "attention"))
        token_ids = res[0][0]
    else:
        out["wall_s"], out["gpu_s"], (token_ids, _) = timed(lambda: drv.runner.step(batch), device)
    drv.sched.commit(batch, token_ids, None)
    drv.sched.finished_reqs.clear()
    assert req.finished, "a one-token request ends with its final chunk"
    return out


def bench_prefill(drv: EngineDriver, device: torch.device, mcfg: Any, limits: dict[str, Any],
                  chunk: int, prefix: int, base: list[int], reps: int) -> dict[str, Any]:
    """Median over ``reps`` chunks (after one warm-up) plus one profiled chunk."""
    runs = []
    for i in range(reps + 2):
        prompt = base[:prefix] + drv.tokens(chunk)
        runs.append(prefill_chunk(drv, prompt, prefix, chunk, device, profile=i == reps + 1))
    timed_runs = runs[1:reps + 1]
    wall = statistics.median(r["wall_s"] for r in timed_runs)
    gpu = statistics.median(r["gpu_s"] for r in timed_runs)
    sched = statistics.median(r["schedule_s"] for r in timed_runs)
    fl = prefill_flops(mcfg, chunk, prefix)
    prof = runs[-1]["profile"]
    out: dict[str, Any] = {
        "prefix": prefix, "chunk": chunk, "wall_s": wall, "gpu_event_s": gpu, "schedule_s": sched,
        "tokens_per_s": chunk / wall, **fl,
        "tflops": fl["total_flops"] / wall / 1e12,
        "matmul_tflops": fl["matmul_flops"] / wall / 1e12,
        "walls_s": [r["wall_s"] for r in timed_runs],
        "kernel_s": prof["kernel_s"], "top_kernels": prof["top"],
    }
    mm = (limits or {}).get("matmul", {}).get("tflops")
    if mm:
        out["matmul_frac_of_peak"] = out["matmul_tflops"] / mm
        out["total_frac_of_peak"] = out["tflops"] / mm
        # The issue's own count (bench_common.prefill_flops): attention as a square.
        out["issue_count_frac_of_peak"] = (fl["matmul_flops"] + fl["attention_square_flops"]) / wall / 1e12 / mm
    if prof["kernel_s"] is not None:
        out["gpu_busy"] = prof["kernel_s"] / wall
        out["gpu_busy_incl_schedule"] = prof["kernel_s"] / (wall + sched)
        attn_s = prof["by_filter"].get("extend") or 0.0
        if attn_s > 0:
            out["attention_kernel_s"] = attn_s
            out["attention_tflops"] = fl["attention_flops"] / attn_s / 1e12
            if mm:
                out["attention_frac_of_peak"] = out["attention_tflops"] * 1e12 / (mm * 1e12)
    return out


def prefill_base(drv: EngineDriver, base: list[int], device: torch.device) -> dict[str, Any]:
    """Prefill the shared base prompt chunk by chunk (timing each), then leave
    it in the prefix cache for the cached-prefix and decode sections."""
    drv.flush()
    req = drv.add(base, max_tokens=1)
    curve: list[tuple[int, int, float]] = []
    while not req.finished:
        batch = drv.sched.schedule()
        assert batch is not None
        wall, _, _ = timed(lambda b=batch: drv.sync_step(b), device)
        curve.append((batch.prefix_lens[0], len(batch.new_tokens[0]), wall))
        if len(curve) % 8 == 0:
            say(f"  base prefill: {batch.prefix_lens[0] + len(batch.new_tokens[0])} / {len(base)} "
                f"tokens, last chunk {wall:.3f} s")
    return {"tokens": len(base), "chunks": [{"prefix": p, "new": n, "wall_s": w} for p, n, w in curve],
            "total_s": sum(w for _, _, w in curve)}


# ----------------------------------------------------------------- decode


def count_routed_experts(drv: EngineDriver, batch: ScheduledBatch) -> float | None:
    """Mean distinct experts per MoE layer for this decode batch, from one
    eager forward with hooks on the routers (outside any timed region; it
    writes the KV this batch would write anyway)."""
    from ftserve.models.layers import MoEBlock

    blocks = [m for m in drv.runner.model.modules() if isinstance(m, MoEBlock)]
    if not blocks:
        return None
    counts: list[int] = []

    def hook(mod: torch.nn.Module, _inp: Any, out: torch.Tensor) -> None:
        ids = out.float().topk(mod.top_k, dim=-1).indices  # [B, k]
        counts.append(int(torch.unique(ids).numel()))

    handles = [b.gate.register_forward_hook(
        lambda m, i, o, blk=b: hook(blk, i, o)) for b in blocks]
    try:
        drv.runner.prepare_slots(batch.reqs)
        fb, _, _, _ = drv.runner.build(batch)
        with torch.inference_mode():
            drv.runner.model(fb)
    finally:
        for h in handles:
            h.remove()
    # No router call seen (the fused decode route of T <= 8 bypasses the gate
    # module): fall back to the expectation instead of failing the section.
    return sum(counts) / len(counts) if counts else None


def profile_host(fn: Any, top: int = 25) -> list[tuple[str, int, float, float]]:
    """cProfile of the host side of fn: (function, calls, tottime ms, cumtime ms)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    try:
        fn()
    finally:
        prof.disable()
    st = pstats.Stats(prof)
    rows = []
    for (file, line, name), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        rows.append((f"{file.rsplit('/', 1)[-1]}:{line}({name})", nc, tt * 1e3, ct * 1e3))
    rows.sort(key=lambda r: -r[2])
    return rows[:top]


def prime_graph(graphs: DecodeGraphs, batch: ScheduledBatch,
                feats: SamplerFeatures | None = None) -> torch.cuda.CUDAGraph:
    """For a measurement that replays one decode graph back to back: the batch's
    words in both staging rows (and the device rows), and the graph (the greedy
    one unless ``feats``). Each replay toggles the graphs' parity word: call
    graphs.reset_parity() once those replays are done."""
    torch.cuda.synchronize()  # both rows are rewritten: no graph in flight may still read one
    pbs, words = graphs.step_rows(batch)
    graphs.io.host_rows[:, :words.numel()] = words
    graphs.io.rows[:pbs].view(-1).copy_(words)
    return graphs.graph_for(batch, feats if feats is not None else SamplerFeatures())


def time_decode_device(drv: EngineDriver, batch: ScheduledBatch, device: torch.device,
                       reps: int = 50) -> dict[str, Any]:
    """Device time of one decode step alone: replay its CUDA graph back to back
    (no host work between replays), plus the eager step's heaviest kernels."""
    out: dict[str, Any] = {}
    if device.type != "cuda":
        return out
    with torch.inference_mode():
        return _time_decode_device(drv, batch, device, reps, out)


def _time_decode_device(drv: EngineDriver, batch: ScheduledBatch, device: torch.device,
                        reps: int, out: dict[str, Any]) -> dict[str, Any]:
    runner = drv.runner
    graphs = runner.graphs
    if graphs is not None and graphs.can_run(len(batch.reqs)):
        runner.prepare_slots(batch.reqs)
        g = prime_graph(graphs, batch)  # the batch's words in both staging rows; the greedy graph
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(reps):
            g.replay()
        launch_s = time.perf_counter() - t0  # the host's part of "host ms/step" a replay is
        end.record()
        torch.cuda.synchronize()
        graphs.reset_parity()
        out["graph_replay_ms"] = start.elapsed_time(end) / reps
        out["graph_launch_host_ms"] = launch_s / reps * 1e3
    saved, runner.graphs = runner.graphs, None
    try:
        prof = gpu_kernel_seconds(lambda: runner.launch(batch), device)
    finally:
        runner.graphs = saved
    out["eager_kernel_ms"] = (prof.get("kernel_s") or 0.0) * 1e3
    out["eager_top_kernels"] = [(n, round(t * 1e3, 4)) for n, t in prof.get("top", [])]
    return out


def bench_decode(drv: EngineDriver, device: torch.device, mcfg: Any, limits: dict[str, Any],
                 base: list[int], context: int, batch_size: int, warmup: int, steps: int,
                 tail: int, params: SamplingParams | None = None) -> dict[str, Any]:
    """``params``: the requests' sampling (None: greedy)."""
    reqs = [drv.add(base[:context - tail] + drv.tokens(tail), max_tokens=warmup + 4 * steps + 8,
                    params=params)
            for _ in range(batch_size)]
    prefill_steps = 0
    while any(r.state is not ReqState.DECODE for r in reqs):
        drv.step()
        prefill_steps += 1
        if prefill_steps > 10 * batch_size + 100:
            raise RuntimeError("requests never reached decode")
    for _ in range(warmup):
        drv.step()
    drv.flush()
    ctx_before = sum(r.computed_len for r in reqs)

    def run(step: Any) -> None:
        for _ in range(steps):
            batch = step()
            assert batch is not None and batch.is_decode and len(batch.reqs) == batch_size
        drv.flush()  # the last step's tokens must reach the host too

    drv.host_s = 0.0
    wall, gpu, _ = timed(lambda: run(drv.step), device)  # overlapped, as the engine runs
    host_s = drv.host_s
    ctx_after = sum(r.computed_len for r in reqs)
    mean_ctx = (ctx_before + ctx_after) / 2 / batch_size
    wall_sync, _, _ = timed(lambda: run(drv.sync_step), device)  # no overlap, for reference
    host_profile = profile_host(lambda: run(drv.step)) if batch_size == 1 else None
    batch = drv.sched.schedule()
    measured_experts = None
    replay: dict[str, Any] = {}
    if batch is not None and batch.is_decode:
        measured_experts = count_routed_experts(drv, batch)
        replay = time_decode_device(drv, batch, device)
    drv.abort_all()
    elem = torch.empty((), dtype=next(drv.runner.model.parameters()).dtype).element_size()
    nbytes = decode_step_bytes(mcfg, elem, batch_size, [int(mean_ctx)] * batch_size, measured_experts)
    expected = decode_step_bytes(mcfg, elem, batch_size, [int(mean_ctx)] * batch_size)
    out: dict[str, Any] = {
        "context": context, "batch": batch_size, "steps": steps, "wall_s": wall, "gpu_event_s": gpu,
        "step_ms": wall / steps * 1e3, "tokens_per_s": batch_size * steps / wall,
        "tokens_per_s_no_overlap": batch_size * steps / wall_sync,
        "host_ms_per_step": host_s / steps * 1e3, "host_frac": host_s / wall, "mean_context": mean_ctx,
        "experts_per_layer_measured": measured_experts,
        "experts_per_layer_expected": expected["experts_per_layer"],
        "experts_source": "measured routing" if measured_experts is not None else "expectation",
        **{k: v for k, v in nbytes.items() if k != "experts_per_layer"},
        "graph": drv.runner.graphs is not None and drv.runner.graphs.can_run(batch_size),
        **replay,
    }
    if host_profile is not None:
        out["host_profile_top"] = host_profile
    bw = (limits or {}).get("copy", {}).get("gbps_read_plus_write")
    if bw:
        t_roof = nbytes["total_bytes"] / (bw * 1e9)
        out["roofline_tokens_per_s"] = batch_size / t_roof
        out["frac_of_roofline"] = out["tokens_per_s"] / out["roofline_tokens_per_s"]
    return out

