"""KV cache tiers benchmark (issue 7 item 5) at the qwen3-30b-a3b shape (8
layers, dummy bf16 weights).

    python -m tools.bench.kv_tiers --out bench_kv_tiers.json         # H200, < 3 min
    python -m tools.bench.kv_tiers --smoke --out /tmp/kv_smoke.json  # CPU, tiny-moe

A conversation of 8 turns x 16k tokens: turns 1-7 are prefilled turn by turn
(each turn's prompt is the previous one plus 16k new tokens), then turn 8 (the
112k-token prefix + 16k new tokens, a fresh tail every repetition so only the
prefix can hit) is served three ways and its time to first token compared:

    device     the prefix is in the device prefix cache
    host       the whole prefix cache was pushed to the host tier first
               (offload finished before the clock starts): restore + 16k prefill,
               the restore streaming in layer by layer under the first chunk's
               compute (one untimed warm-up run first: the eager forward
               compiles its own shapes)
    recompute  the prefix cache was emptied: 128k tokens prefilled

Sections (each one recorded, or its error recorded, in the JSON; the run goes on):
    limits        pinned cudaMemcpy H2D / D2H GB/s of one 1 GiB buffer (the peer)
    engine_build  start-up summary (device pool, host tier)
    conversation  turns 1-7, TTFT per turn
    ttft          turn 8: device / host / recompute, median of
                  --reps, and ratios
    bandwidth     the host tier's own page moves: restore (H2D) and offload (D2H)
                  of the whole prefix as one flush, GB/s vs the pinned memcpy;
                  plus the same restore as copy_ calls over runs of consecutive
                  pages (DMA engines), the alternative to the copy kernel
    decode_kv_dtype  issue 7 item 1: decode tok/s at 32k context (batch 1 and 4)
                  per --kv-dtypes value (auto = the model dtype, fp8_e4m3), the KV
                  bytes per token of each, and fp8's speed-up over the first value

The "host" TTFT minus the "device" TTFT is what is left of the restore's copy
when it overlaps the compute.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from ftserve.config import EngineConfig
from ftserve.engine.driver import EngineDriver
from ftserve.engine.engine import Engine
from ftserve.kvcache.host_tier import HostKVTier
from tools.bench.common import (
    measure_h2d_gbps,
    run_section,
    say,
    start_run,
    sync,
    timed,
    write_json,
)


def build(args: argparse.Namespace, model_dir: str, device: torch.device, **kw: Any) -> Engine:
    from ftserve.engine.setup import build_engine

    cfg = EngineConfig(
        model=model_dir, load_format="dummy", dtype=args.dtype, device=str(device), page_size=16,
        kv_cache_tokens=args.device_tokens, kv_host_pages=args.host_tokens // 16,
        max_prefill_length=args.chunk, max_running_requests=4, cuda_graph_max_bs=4,
        attention_backend="auto", status_log_interval=0.0, max_model_len=args.max_len, **kw)
    return build_engine(cfg)


def ttft(drv: EngineDriver, prompt: list[int], device: torch.device) -> dict[str, Any]:
    """Wall time from submission to the first token of a 1-token request, alone."""
    drv.flush()
    sync(device)
    t0 = time.perf_counter()
    req = drv.add(prompt, max_tokens=1)
    while not req.finished:
        drv.sync_step()
    sync(device)
    return {"ttft_s": time.perf_counter() - t0, "prompt_tokens": len(prompt),
            "cached_tokens": req.cached_len}


def host_of(engine: Engine) -> HostKVTier:
    host = engine.runner.kv_host
    assert host is not None, "the engine was built without a host tier"
    return host


def push_to_host(engine: Engine, device: torch.device) -> int:
    """Move every unlocked device page of the prefix cache to the host tier and
    wait for the copies; returns the pages moved."""
    radix = engine.scheduler.radix
    before = host_of(engine).counters.pages_offloaded_total
    radix.evict(radix.evictable_pages)
    host_of(engine).flush()
    sync(device)
    return host_of(engine).counters.pages_offloaded_total - before


def warm_copy_kernels(engine: Engine, device: torch.device) -> None:
    """Compile both directions of the page-copy kernel outside any timed region."""
    sched, host = engine.scheduler, host_of(engine)
    dev_pages, host_pages = sched.allocator.alloc(1), host.alloc(1)
    assert dev_pages is not None and host_pages is not None
    host.queue_offload(dev_pages, host_pages)
    host.queue_load(host_pages, dev_pages)
    host.flush()
    sync(device)
    sched.allocator.free(dev_pages)
    host.free(host_pages)


def conversation(drv: EngineDriver, conv: list[int], turn: int, device: torch.device) -> dict[str, Any]:
    rows = []
    for k in range(1, 8):
        r = ttft(drv, conv[:k * turn], device)
        rows.append({"turn": k, **r})
        say(f"  turn {k}: {r['prompt_tokens']} tokens, {r['cached_tokens']} cached, "
            f"TTFT {r['ttft_s']:.3f} s")
    return {"turns": rows}


def bench_ttft(drv: EngineDriver, engine: Engine, prefix: list[int], turn: int, reps: int,
               device: torch.device) -> dict[str, Any]:
    radix = engine.scheduler.radix
    out: dict[str, Any] = {"prefix_tokens": len(prefix), "new_tokens": turn, "reps": reps}
    runs: dict[str, list[dict[str, Any]]] = {"device": [], "host": [], "recompute": []}
    for _ in range(reps):
        runs["device"].append(ttft(drv, prefix + drv.tokens(turn), device))
    warm_copy_kernels(engine, device)

    def from_host() -> dict[str, Any]:
        moved = push_to_host(engine, device)
        m = radix.match_prefix(prefix, count_stats=False)
        r = ttft(drv, prefix + drv.tokens(turn), device)
        return {**r, "pages_offloaded": moved, "host_tokens_before": m.host_tokens,
                "device_tokens_before": m.num_tokens}

    from_host()  # warm-up: the eager first chunk compiles shapes the graphs never needed
    for _ in range(reps):
        runs["host"].append(from_host())
    for _ in range(reps):
        assert radix.reset(), "nothing may be locked between requests"
        runs["recompute"].append(ttft(drv, prefix + drv.tokens(turn), device))
    for name, rows in runs.items():
        out[name] = {"ttft_s": statistics.median(r["ttft_s"] for r in rows),
                     "cached_tokens": rows[-1]["cached_tokens"], "runs": rows}
    dev_s, host_s, rec_s = (out[k]["ttft_s"] for k in ("device", "host", "recompute"))
    out["host_over_device"] = host_s / dev_s
    out["recompute_over_host"] = rec_s / host_s
    out["restore_cost_s"] = host_s - dev_s
    return out


def bench_bandwidth(drv: EngineDriver, engine: Engine, prefix: list[int], turn: int,
                    limits: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """One flush of the restore of the whole prefix (H2D), then one of its
    offload (D2H); bytes / device time vs the pinned memcpy peer."""
    radix, host = engine.scheduler.radix, host_of(engine)
    ttft(drv, prefix + drv.tokens(turn), device)  # the prefix back in the cache
    push_to_host(engine, device)
    page_bytes = engine.runner.kv_pool.bytes_per_page()
    t0 = time.perf_counter()
    m = radix.restore(radix.match_prefix(prefix, count_stats=False))
    plan_s = time.perf_counter() - t0
    loaded = host.num_pending
    moves = host.pending_moves()
    _, load_s, _ = timed(host.flush, device)
    # Peer for the same bytes: the DMA engines (copy_ of coalesced page runs).
    dma_s, dma_launches = dma_copy_seconds(engine, moves, device)
    assert m.num_tokens == len(prefix), "the whole prefix must come back for this measurement"
    # The device cache now holds exactly the restored prefix: offload it again.
    t0 = time.perf_counter()
    before = host.counters.pages_offloaded_total
    radix.evict(radix.evictable_pages)
    evict_plan_s = time.perf_counter() - t0
    stored = host.counters.pages_offloaded_total - before
    _, store_s, _ = timed(host.flush, device)
    out: dict[str, Any] = {
        "page_bytes": page_bytes, "restore_pages": loaded, "restore_bytes": loaded * page_bytes,
        "restore_plan_host_s": plan_s, "restore_copy_s": load_s,
        "h2d_gbps": loaded * page_bytes / load_s / 1e9,
        "offload_pages": stored, "offload_plan_host_s": evict_plan_s, "offload_copy_s": store_s,
        "d2h_gbps": stored * page_bytes / store_s / 1e9,
        "copy_launches_total": host.counters.copy_launches_total,
        "dma_restore_copy_s": dma_s, "dma_copies": dma_launches,
        "dma_h2d_gbps": loaded * page_bytes / dma_s / 1e9,
    }
    peer = (limits or {}).get("h2d", {})
    if peer.get("h2d_gbps"):
        out["h2d_frac_of_pinned_memcpy"] = out["h2d_gbps"] / peer["h2d_gbps"]
    if peer.get("d2h_gbps"):
        out["d2h_frac_of_pinned_memcpy"] = out["d2h_gbps"] / peer["d2h_gbps"]
    return out


def dma_copy_seconds(engine: Engine, moves: list[tuple[bool, list[int], list[int]]],
                     device: torch.device) -> tuple[float, int]:
    """Device seconds to redo the planned loads as tensor.copy_ calls over runs of
    consecutive pages (what a DMA-engine alternative to the copy kernel would cost)."""
    pool, host = engine.runner.kv_pool, host_of(engine)
    ps = pool.page_size
    spans: list[tuple[int, int, int]] = []  # (src page, dst page, pages)
    for to_host, src, dst in moves:
        assert not to_host, "only loads are planned here"
        for s, d in zip(src, dst):
            if spans and spans[-1][0] + spans[-1][2] == s and spans[-1][1] + spans[-1][2] == d:
                spans[-1] = (spans[-1][0], spans[-1][1], spans[-1][2] + 1)
            else:
                spans.append((s, d, 1))

    pairs = [(host.k, pool.k), (host.v, pool.v)]
    if pool.k_scale is not None and pool.v_scale is not None:  # fp8: scales move too
        assert host.k_scale is not None and host.v_scale is not None
        pairs += [(host.k_scale, pool.k_scale), (host.v_scale, pool.v_scale)]

    def run() -> None:
        # Per layer, so each copy is one contiguous cudaMemcpyAsync from pinned memory.
        for layer in range(pool.num_layers):
            for s, d, n in spans:
                for src_t, dst_t in pairs:
                    dst_t[layer, d * ps:(d + n) * ps].copy_(
                        src_t[layer, s * ps:(s + n) * ps], non_blocking=True)

    _, secs, _ = timed(run, device)
    return secs, len(pairs) * pool.num_layers * len(spans)


def decode_kv_dtype(args: argparse.Namespace, model_dir: str, device: torch.device,
                    limits: dict[str, Any]) -> dict[str, Any]:
    """Issue 7 item 1 (fp8 KV): decode tokens/s at 32k context per KV dtype. At
    batch 1 decode reads the whole KV of every layer per token, so halving its
    bytes should show up as speed once attention dominates the step."""
    from ftserve.kvcache.pool import KVPool
    from tools.bench.engine_measure import bench_decode, prefill_base

    rows: dict[str, Any] = {}
    kinds = args.kv_dtypes.split(",")
    for kvd in kinds:
        eng = build(args, model_dir, device, kv_cache_dtype=kvd)
        try:
            d = EngineDriver(eng)
            base = d.tokens(args.decode_ctx)
            prefill_base(d, base, device)
            mcfg, pool = eng.model_config, eng.runner.kv_pool
            row: dict[str, Any] = {
                "kv_cache_dtype": eng.summary.get("kv_cache_dtype"),
                # Codes + (fp8) scales; bench_decode's byte model assumes model-dtype KV.
                "kv_bytes_per_token": KVPool.bytes_per_token(
                    mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim, pool.dtype),
            }
            for bs in args.decode_batches:
                row[f"bs{bs}"] = bench_decode(d, device, mcfg, limits, base, args.decode_ctx,
                                              bs, 2, args.decode_steps, 16)
            rows[kvd] = row
        finally:
            eng.shutdown()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    first = rows.get(kinds[0])
    for kvd in kinds[1:]:
        if first is not None and kvd in rows:
            rows[kvd]["speedup_vs_" + kinds[0]] = {
                f"bs{bs}": rows[kvd][f"bs{bs}"]["tokens_per_s"] / first[f"bs{bs}"]["tokens_per_s"]
                for bs in args.decode_batches}
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_kv_tiers.json", help="JSON results path")
    p.add_argument("--smoke", action="store_true", help="tiny-moe on the CPU, tiny lengths")
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--turn", type=int, default=16384, help="tokens added per turn")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--kv-dtypes", default="auto,fp8_e4m3",
                   help="decode_kv_dtype: --kv-cache-dtype values to compare (first = baseline)")
    args = p.parse_args(argv)
    args.chunk, args.max_len, args.decode_ctx, args.decode_steps = 8192, 163840, 32768, 32
    args.decode_batches = (1, 4)
    if args.smoke:
        args.preset, args.layers, args.dtype, args.device = "tiny-moe", 2, "float32", "cpu"
        args.turn, args.reps, args.chunk, args.max_len = 48, 1, 64, 1024
        args.decode_ctx, args.decode_steps, args.decode_batches = 256, 3, (1,)
    # The device pool holds the conversation plus every repetition's tail; the
    # host tier the same (the whole cache is pushed down before each host run).
    args.device_tokens = 8 * args.turn + (4 * args.reps + 5) * args.turn
    args.host_tokens = args.device_tokens
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device, results, _, _, model_dir = start_run(args, "ftserve-kvt-")

    def section(name: str, fn: Any) -> Any:
        out = run_section(results, name, fn)
        write_json(args.out, results)  # a run killed later still leaves what it measured
        return out

    limits = section("limits", lambda: {"h2d": measure_h2d_gbps(device, 1 << 30, 5)}) or {}
    engine = section("engine_build", lambda: build(args, model_dir, device))
    if engine is not None:
        results["engine_build"] = dict(engine.summary)
        drv = EngineDriver(engine)
        conv = drv.tokens(8 * args.turn)
        prefix = conv[:7 * args.turn]
        section("conversation", lambda: conversation(drv, conv, args.turn, device))
        section("ttft", lambda: bench_ttft(drv, engine, prefix, args.turn, args.reps, device))
        drv.abort_all()
        section("bandwidth", lambda: bench_bandwidth(drv, engine, prefix, args.turn, limits, device))
        drv.abort_all()
        engine.shutdown()
        del drv, engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    section("decode_kv_dtype", lambda: decode_kv_dtype(args, model_dir, device, limits))
    write_json(args.out, results)
    t = results.get("ttft") or {}
    if t:
        say(f"turn 8 TTFT: device {t['device']['ttft_s']:.3f} s, host {t['host']['ttft_s']:.3f} s, "
            f"recompute {t['recompute']['ttft_s']:.3f} s (recompute/host {t['recompute_over_host']:.1f}x)")
    bw = results.get("bandwidth") or {}
    if bw:
        say(f"host tier H2D {bw['h2d_gbps']:.1f} GB/s (copy_ of page runs: "
            f"{bw['dma_h2d_gbps']:.1f} GB/s), D2H {bw['d2h_gbps']:.1f} GB/s; pinned memcpy "
            f"{limits.get('h2d', {}).get('h2d_gbps', float('nan')):.1f} / "
            f"{limits.get('h2d', {}).get('d2h_gbps', float('nan')):.1f} GB/s")
    return results


if __name__ == "__main__":
    main()
