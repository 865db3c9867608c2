"""Time ftserve's Triton kernels at real shapes against limits measured in the same run.

Usage (CUDA only): python tools/bench_kernels.py --out bench_kernels.json [--quick]

Limits measured first: bf16 matmul TFLOP/s (torch), device copy GB/s (read +
write), pinned host->device GB/s, PyTorch SDPA (flash) for 4,096 causal queries
over 102,400 keys and for one decode query over 102,400 keys. Every kernel's
output is checked (finite, and against SDPA or the torch twin) before it is
timed; a failed check is reported in the JSON and the exit code is 1.
Shapes: attention 32 q heads / 4 kv heads / head_dim 128; MoE qwen3-30b-a3b
(E=128, k=8, H=2048, I=768).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from ftserve_kernels import attention_triton as at  # noqa: E402
from ftserve_kernels import bookkeeping as bk  # noqa: E402
from ftserve_kernels import moe_triton as mt  # noqa: E402
from ftserve_kernels import norm_triton as nt  # noqa: E402
from ftserve_kernels.moe import fused_moe_ref  # noqa: E402
from ftserve_kernels.norm_rope import qk_norm_rotary_ref  # noqa: E402
from ftserve_kernels.norm_triton import fused_add_rms_norm_triton, rms_norm_triton  # noqa: E402
from ftserve_kernels.paged_attention import paged_attention_ref  # noqa: E402
from ftserve_kernels.rope_triton import qk_norm_rotary_triton, rotary_triton  # noqa: E402

HQ, HKV, D, PAGE = 32, 4, 128, 16
RESULTS: dict[str, Any] = {"limits": {}, "kernels": {}, "checks": {}}


def bench(fn: Callable[[], Any], iters: int = 10, warmup: int = 3) -> float:
    """Median seconds of ``fn`` over ``iters`` runs, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def bench_graph(fn: Callable[[], Any], replays: int = 50) -> float:
    """Device seconds per call of ``fn``: captured once in a CUDA graph, replayed
    back to back between two events, so host launch cost is not in the number
    (this is how the engine runs decode)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # compile and warm up outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / replays)
    del graph
    return min(times)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def check(name: str, ok: bool, detail: str) -> None:
    RESULTS["checks"][name] = {"ok": bool(ok), "detail": detail}
    print(f"  check {name}: {'ok' if ok else 'FAILED'} ({detail})")


def record(name: str, secs: float, **metrics: float) -> None:
    RESULTS["kernels"][name] = {"ms": secs * 1e3, **metrics}
    extra = ", ".join(f"{k}={v:.3g}" for k, v in metrics.items())
    print(f"{name:48s} {secs * 1e3:9.3f} ms  {extra}")


# ---------------------------------------------------------------- limits


def measure_limits() -> None:
    lim = RESULTS["limits"]
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    lim["matmul_tflops"] = 2 * n**3 / bench(lambda: a @ b) / 1e12
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    lim["copy_gbps"] = 2 * src.numel() / bench(lambda: dst.copy_(src)) / 1e9
    host = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
    dev = torch.empty(host.shape, dtype=torch.uint8, device="cuda")
    lim["h2d_gbps"] = host.numel() / bench(lambda: dev.copy_(host, non_blocking=True), 5) / 1e9
    print(f"limits: matmul {lim['matmul_tflops']:.0f} TFLOP/s, copy {lim['copy_gbps']:.0f} GB/s, "
          f"pinned h2d {lim['h2d_gbps']:.1f} GB/s")


def causal_flops(n_new: int, prefix: int, heads: int = HQ, d: int = D) -> float:
    # QK^T and PV: 2 * 2 * d per visible (query, key) pair.
    pairs = n_new * prefix + n_new * (n_new + 1) / 2
    return 4.0 * d * heads * pairs


# ---------------------------------------------------------------- attention


def paged_case(kv_lens: list[int], seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A one-layer pool holding random KV for sequences of ``kv_lens`` on shuffled pages."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    need = [math.ceil(n / PAGE) for n in kv_lens]
    num_pages = sum(need) + 1
    kc = torch.randn(num_pages * PAGE, HKV, D, device="cuda", generator=g).bfloat16()
    vc = torch.randn(num_pages * PAGE, HKV, D, device="cuda", generator=g).bfloat16()
    perm = torch.randperm(num_pages - 1, device="cuda", generator=g).int() + 1
    table = torch.zeros(len(kv_lens), max(need), dtype=torch.int32, device="cuda")
    at_ = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[at_ : at_ + n]
        at_ += n
    return kc, vc, table


def gather(kc: torch.Tensor, table_row: torch.Tensor, n: int) -> torch.Tensor:
    slots = (table_row.long()[:, None] * PAGE + torch.arange(PAGE, device="cuda")).reshape(-1)
    return kc[slots[:n]]  # [n, Hkv, D]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lower_right: bool) -> torch.Tensor:
    """q [n, Hq, D], k/v [L, Hkv, D] contiguous; flash backend, causal aligned bottom-right."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    group = HQ // HKV
    qh = q.transpose(0, 1)[None]  # [1, Hq, n, D]
    kh = k.repeat_interleave(group, 1).transpose(0, 1)[None]  # [1, Hq, L, D]
    vh = v.repeat_interleave(group, 1).transpose(0, 1)[None]
    mask = causal_lower_right(q.shape[0], k.shape[0]) if lower_right else None
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
    except RuntimeError:  # flash unavailable for this case: let torch pick
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
    return out[0].transpose(0, 1)  # [n, Hq, D]


def bench_extend(n_new: int, total: int, quick: bool) -> None:
    prefix = total - n_new
    kc, vc, table = paged_case([total])
    q = torch.randn(n_new, HQ, D, device="cuda").bfloat16()
    indptr = torch.tensor([0, n_new], dtype=torch.int32, device="cuda")
    pre = torch.tensor([prefix], dtype=torch.int32, device="cuda")
    flops = causal_flops(n_new, prefix)
    # Oracle: the torch twin for the last 256 queries (fp32; the full problem would
    # need a 50 GB score matrix).
    tail = 256
    ref = paged_attention_ref(q[-tail:], kc, vc, table, [0, tail], [total], PAGE, D**-0.5)
    peer_key = f"sdpa_extend_{n_new}x{total}_tflops"
    try:
        k_full, v_full = gather(kc, table[0], total), gather(vc, table[0], total)
        secs = bench(lambda: sdpa(q, k_full, v_full, lower_right=True), 5)
        RESULTS["limits"][peer_key] = flops / secs / 1e12
        record(f"sdpa flash (contiguous) {n_new} over {total}", secs, tflops=flops / secs / 1e12)
    except RuntimeError as exc:  # the peer is optional; the kernel is still timed
        print(f"  SDPA peer unavailable: {str(exc)[:200]}")
    base = at.AttnKernelConfig()
    configs = [base, replace(base, extend_pack_gqa=True)]
    if not quick:
        configs += [
            replace(base, extend_block_n=128, extend_stages=2),
            replace(base, extend_stages=4),
            replace(base, extend_block_m=128, extend_warps=8),
            replace(base, extend_block_m=128, extend_warps=8, extend_pack_gqa=True),
            replace(base, extend_block_m=128, extend_block_n=128, extend_warps=8, extend_stages=2,
                    extend_pack_gqa=True),
            replace(base, extend_block_m=64, extend_block_n=128, extend_warps=4, extend_stages=2,
                    extend_pack_gqa=True),
        ]
    for cfg in configs:
        tag = cfg.tag()
        out = torch.full_like(q, float("nan"))

        def run(cfg: at.AttnKernelConfig = cfg, out: torch.Tensor = out) -> torch.Tensor:
            return at.extend_attention_triton(
                q, kc, vc, table, indptr, pre, n_new, PAGE, D**-0.5, cfg, out=out)

        try:
            run()
        except Exception as exc:  # a config that does not fit this GPU's shared memory
            print(f"  config {tag} failed: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        err = rel_err(out[-tail:], ref)
        check(f"extend_{n_new}x{total}_{tag}", bool(torch.isfinite(out).all()) and err < 2e-2,
              f"rel err vs torch twin (last {tail} queries) {err:.2e}")
        secs = bench(run, 5)
        tf = flops / secs / 1e12
        ratios = {"vs_matmul": tf / RESULTS["limits"]["matmul_tflops"]}
        if peer_key in RESULTS["limits"]:
            ratios["vs_sdpa"] = tf / RESULTS["limits"][peer_key]
        record(f"triton extend {n_new} over {total} [{tag}]", secs, tflops=tf, **ratios)


def bench_decode(batch: int, kv_len: int, quick: bool) -> None:
    """Split-K decode, timed by CUDA-graph replay (device time, as the engine runs
    it) for the default config and a sweep of tiles / stages / split targets."""
    kc, vc, table = paged_case([kv_len] * batch, seed=batch)
    q = torch.randn(batch, HQ, D, device="cuda").bfloat16()
    seq_lens = torch.full((batch,), kv_len, dtype=torch.int32, device="cuda")
    kv_bytes = 2 * batch * kv_len * HKV * D * 2
    rows = min(batch, 4)
    ref = paged_attention_ref(q[:rows], kc, vc, table, list(range(rows + 1)), [kv_len] * rows,
                              PAGE, D**-0.5)
    base = at.AttnKernelConfig()
    configs = [base]
    if not quick:
        configs += [
            replace(base, decode_block_n=128),
            replace(base, decode_stages=4),
            replace(base, decode_block_n=128, decode_warps=8),
            replace(base, decode_block_n=32, decode_stages=4),
            replace(base, decode_programs_per_sm=2),
            replace(base, decode_programs_per_sm=8, max_splits=256),
        ]
    configs.append(replace(base, decode_fused_reduce=True))  # one launch per decode
    counters = torch.zeros(batch * HKV, dtype=torch.int32, device="cuda")
    for cfg in configs:
        be = at.TritonAttentionBackend(cfg=cfg)
        splits = be.num_splits(batch, HKV, q.device)
        tag = (f"bn{cfg.decode_block_n}_w{cfg.decode_warps}_s{cfg.decode_stages}_sp{splits}"
               + ("_fused" if cfg.decode_fused_reduce else ""))
        out = torch.full_like(q, float("nan"))

        def run(cfg: at.AttnKernelConfig = cfg, splits: int = splits,
                out: torch.Tensor = out) -> torch.Tensor:
            return at.decode_attention_triton(q, kc, vc, table, seq_lens, PAGE, D**-0.5, splits,
                                              cfg, out=out, counters=counters)

        try:
            run()
        except Exception as exc:  # a config this GPU cannot run: report, keep sweeping
            print(f"  config {tag} failed: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        err = rel_err(out[:rows], ref)
        check(f"decode_b{batch}_{kv_len}_{tag}", bool(torch.isfinite(out).all()) and err < 2e-2,
              f"rel err vs torch twin {err:.2e}")
        secs = bench_graph(run)
        gbps = kv_bytes / secs / 1e9
        record(f"triton decode b{batch} kv{kv_len} graph [{tag}]", secs, kv_gbps=gbps,
               vs_copy_read=gbps / (RESULTS["limits"]["copy_gbps"] / 2))
        if cfg is base:
            secs = bench(run, 20)
            record(f"triton decode b{batch} kv{kv_len} eager (incl. launch)", secs,
                   kv_gbps=kv_bytes / secs / 1e9)
    if batch == 1:
        # Peer: SDPA over contiguous MHA KV (32 heads) of the same length, graph-timed.
        km = torch.randn(1, HQ, kv_len, D, device="cuda").bfloat16()
        vm = torch.randn_like(km)
        qm = q[:1].transpose(0, 1)[None].contiguous()
        try:
            s2 = bench_graph(lambda: F.scaled_dot_product_attention(qm, km, vm))
        except RuntimeError as exc:  # the peer is optional
            print(f"  SDPA decode peer unavailable: {str(exc)[:200]}")
            return
        peer = 2 * km.numel() * 2 / s2 / 1e9
        RESULTS["limits"][f"sdpa_decode_{kv_len}_gbps"] = peer
        record(f"sdpa decode (MHA, contiguous) kv{kv_len} graph", s2, kv_gbps=peer)


def bench_store() -> None:
    t = 4096
    kc = torch.zeros(t * 4, HKV, D, device="cuda").bfloat16()
    vc = torch.zeros_like(kc)
    k = torch.randn(t, HKV, D, device="cuda").bfloat16()
    v = torch.randn_like(k)
    loc = torch.randperm(t * 4, device="cuda")[:t]
    at.store_kv_triton(kc, vc, k, v, loc)
    check("store_kv", torch.equal(kc[loc], k) and torch.equal(vc[loc], v), "exact")
    secs = bench(lambda: at.store_kv_triton(kc, vc, k, v, loc), 20)
    gbps = 4 * k.numel() * 2 / secs / 1e9
    record(f"store_kv T={t}", secs, gbps=gbps, vs_copy=gbps / RESULTS["limits"]["copy_gbps"])


# ---------------------------------------------------------------- MoE / norm / rope


def bench_moe(quick: bool) -> None:
    """fused_moe (alignment + both GEMMs + combine) eager, and by CUDA-graph replay
    (device time, as decode runs it) with a config sweep for small T. Weight GB/s
    counts only the experts the batch was routed to."""
    e, k, h, inter = 128, 8, 2048, 768
    w13 = (torch.randn(e, 2 * inter, h, device="cuda") / h**0.5).bfloat16()
    w2 = (torch.randn(e, h, inter, device="cuda") / inter**0.5).bfloat16()
    expert_bytes = (w13[0].numel() + w2[0].numel()) * 2
    read_limit = RESULTS["limits"]["copy_gbps"] / 2
    small = [mt.MoeConfig(16, 32, 128, 1, 4, 4), mt.MoeConfig(16, 64, 128, 1, 4, 4),
             mt.MoeConfig(16, 16, 128, 1, 4, 4), mt.MoeConfig(16, 32, 256, 1, 4, 3),
             mt.MoeConfig(16, 64, 64, 1, 4, 5), mt.MoeConfig(16, 128, 64, 1, 4, 4)]
    large = [mt.MoeConfig(128, 64, 64, 8, 8, 3, down_block_n=128),
             mt.MoeConfig(128, 64, 64, 8, 8, 4, down_block_n=128),
             mt.MoeConfig(128, 128, 64, 8, 8, 3), mt.MoeConfig(64, 128, 64, 8, 4, 4),
             mt.MoeConfig(128, 64, 64, 8, 8, 4), mt.MoeConfig(128, 128, 32, 8, 8, 4),
             mt.MoeConfig(64, 64, 64, 8, 4, 4)]
    for t in ([1, 64, 4096] if quick else [1, 2, 4, 8, 16, 32, 64, 512, 4096, 8192]):
        x = torch.randn(t, h, device="cuda").bfloat16()
        logits = torch.randn(t, e, device="cuda")
        weights, ids = mt.route_topk_triton(logits, k, True)
        out = mt.fused_moe_triton(x, w13, w2, weights, ids)
        if t <= 512:
            err = rel_err(out, fused_moe_ref(x, w13, w2, weights, ids))
            check(f"moe_T{t}", bool(torch.isfinite(out).all()) and err < 2e-2, f"rel err {err:.2e}")
        flops = 2 * t * k * (h * 2 * inter + inter * h)
        touched = int(torch.zeros(e, device="cuda").index_fill_(0, ids.reshape(-1).long(), 1).sum())
        wbytes = touched * expert_bytes

        def rec(name: str, secs: float, flops: float = flops, touched: int = touched,
                wbytes: int = wbytes) -> None:
            record(name, secs, tflops=flops / secs / 1e12,
                   vs_matmul=flops / secs / 1e12 / RESULTS["limits"]["matmul_tflops"],
                   experts=touched, weight_gbps=wbytes / secs / 1e9,
                   vs_copy_read=wbytes / secs / 1e9 / read_limit)

        default = mt.MoeConfig.pick(t * k, e, x.device)  # grouped path (cfg given)
        configs = [default]
        if t <= 64 and not quick:
            configs += [c for c in small if c != default]
        if t == 4096 and not quick:
            configs += [c for c in large if c != default]
        for cfg in configs:
            def run(x: torch.Tensor = x, w: torch.Tensor = weights, i: torch.Tensor = ids,
                    cfg: mt.MoeConfig = cfg) -> torch.Tensor:
                return mt.fused_moe_triton(x, w13, w2, w, i, cfg=cfg)

            tag = (f"m{cfg.block_m}_n{cfg.block_n}_k{cfg.block_k}_g{cfg.group_m}"
                   f"_w{cfg.num_warps}_s{cfg.num_stages}"
                   + (f"_dn{cfg.down_block_n}" if cfg.down_block_n else ""))
            if cfg is default:
                rec(f"fused_moe T={t} eager (incl. launch) [{tag}]", bench(run))
            else:
                try:
                    err = rel_err(run(), out)
                except Exception as exc:  # a config this GPU cannot run: keep sweeping
                    print(f"  config {tag} failed: {type(exc).__name__}: {str(exc)[:120]}")
                    continue
                check(f"moe_T{t}_{tag}", err < 2e-2, f"rel err vs default config {err:.2e}")
            if t <= 4096:
                rec(f"fused_moe T={t} graph [{tag}]", bench_graph(run, 20 if t > 64 else 50))
        if t <= 16:  # GEMV path (no alignment, combine fused): default up to GEMV_MAX_TOKENS
            def run_gemv(x: torch.Tensor = x, w: torch.Tensor = weights,
                         i: torch.Tensor = ids) -> torch.Tensor:
                return mt.fused_moe_triton(x, w13, w2, w, i, gemv=True)

            err = rel_err(run_gemv(), out)
            check(f"moe_T{t}_gemv", err < 2e-2, f"rel err vs grouped path {err:.2e}")
            rec(f"fused_moe T={t} graph [gemv]", bench_graph(run_gemv))
            if t == 1:
                rec(f"fused_moe T={t} eager (incl. launch) [gemv]", bench(run_gemv))
        if t == 8192 or (quick and t == 4096):
            rs = bench(lambda lg=logits: mt.route_topk_triton(lg, k, True))
            record(f"route_topk T={t} E={e}", rs)
            bm = default.block_m
            al = bench_graph(lambda i=ids, bm=bm: mt.moe_align(i, e, bm), 20)
            record(f"moe_align T={t} E={e} graph", al)


def bench_norm_rope() -> None:
    """Norms and rotary by CUDA-graph replay (device time). GB/s = bytes read +
    written once, against the copy rate (which counts read + write too)."""
    t, h = 8192, 2048
    x = torch.randn(t, h, device="cuda").bfloat16()
    r = torch.randn_like(x)
    w = torch.randn(h, device="cuda").bfloat16()
    copy = RESULTS["limits"]["copy_gbps"]

    def rec(name: str, secs: float, moved: float) -> None:
        record(name, secs, gbps=moved / secs / 1e9, vs_copy=moved / secs / 1e9 / copy)

    heads = torch.randn(t * HQ, D, device="cuda").bfloat16()
    hw = torch.randn(D, device="cuda").bfloat16()
    default_tile = nt._TILE_ELEMS
    for tile in (default_tile, 2048, 4096, 16384):  # elements per program: default first
        nt._TILE_ELEMS = tile
        nt.norm_launch_params.cache_clear()
        tag = f"tile{tile}" + (" (default)" if tile == default_tile else "")
        rec(f"rms_norm T={t} H={h} [{tag}]",
            bench_graph(lambda: rms_norm_triton(x, w, 1e-6)), 4 * x.numel())
        rec(f"fused_add_rms_norm T={t} H={h} [{tag}]",
            bench_graph(lambda: fused_add_rms_norm_triton(x, r, w, 1e-6)), 8 * x.numel())
        rec(f"rms_norm (q head norm) rows={t * HQ} H={D} [{tag}]",
            bench_graph(lambda: rms_norm_triton(heads, hw, 1e-6)), 4 * heads.numel())
    nt._TILE_ELEMS = default_tile
    nt.norm_launch_params.cache_clear()
    q = torch.randn(t, HQ, D, device="cuda").bfloat16()
    kk = torch.randn(t, HKV, D, device="cuda").bfloat16()
    pos = torch.randint(0, 131072, (t,), device="cuda")
    table = torch.randn(131072, D, device="cuda")
    moved = 2 * (q.numel() + kk.numel()) * 2
    rec(f"rotary T={t}", bench_graph(lambda: rotary_triton(q, kk, pos, table)), moved)
    # Qwen3 attention input: q/k views into the qkv projection output.
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, device="cuda").bfloat16()
    qv = qkv[:, : HQ * D].view(t, HQ, D)
    kv = qkv[:, HQ * D : (HQ + HKV) * D].view(t, HKV, D)
    kw = torch.randn(D, device="cuda").bfloat16()
    qo, ko = qk_norm_rotary_triton(qv, kv, hw, kw, 1e-6, pos, table)
    rq, rk = qk_norm_rotary_ref(qv, kv, hw, kw, 1e-6, pos, table)
    err = max(rel_err(qo, rq), rel_err(ko, rk))
    check("qk_norm_rotary", bool(torch.isfinite(qo).all()) and err < 1e-2, f"rel err {err:.2e}")
    rec(f"qk_norm_rotary (fused) T={t}",
        bench_graph(lambda: qk_norm_rotary_triton(qv, kv, hw, kw, 1e-6, pos, table)), moved)

    def unfused() -> None:
        qn = rms_norm_triton(qv.reshape(-1, D), hw, 1e-6).view(t, HQ, D)
        kn = rms_norm_triton(kv.reshape(-1, D), kw, 1e-6).view(t, HKV, D)
        rotary_triton(qn, kn, pos, table)

    rec(f"q_norm + k_norm + rotary (3 launches + copies) T={t}", bench_graph(unfused), moved)


def bench_bookkeeping() -> None:
    maps = bk.new_slot_maps(48 * 128, 1536, "cuda")
    needed = torch.randint(-1, 48 * 128, (512,), device="cuda").int()
    record("admit_experts M=512 S=1536", bench(lambda: bk.admit_experts(needed, *maps), 20))
    record("invalidate_slots 128", bench(lambda: bk.invalidate_slots(maps[0], maps[1], 0, 128), 20))
    layers, pages = 48, 512
    shape = (layers, pages * PAGE, HKV, D)
    dk = torch.randn(shape, device="cuda").bfloat16()
    dv = torch.randn_like(dk)
    hk = torch.empty(shape, dtype=torch.bfloat16).pin_memory()
    hv = torch.empty(shape, dtype=torch.bfloat16).pin_memory()
    # Finite bf16 bit patterns (0..29999), distinct along the page, for an exact check.
    pattern = (torch.arange(hk.numel(), dtype=torch.int32) % 30000).to(torch.int16).view(shape)
    hk.view(torch.int16).copy_(pattern)
    hv.view(torch.int16).copy_(pattern)
    del pattern
    n = 256
    sp = torch.arange(n, dtype=torch.int32, device="cuda")
    dp = torch.arange(n, 2 * n, dtype=torch.int32, device="cuda")
    moved = 2 * layers * n * PAGE * HKV * D * 2
    s = bench(lambda: bk.copy_kv_pages(dk, dv, dk, dv, sp, dp, PAGE), 10)
    record(f"copy_kv_pages d2d {n} pages x {layers} layers", s, gbps=2 * moved / s / 1e9,
           vs_copy=2 * moved / s / 1e9 / RESULTS["limits"]["copy_gbps"])
    s = bench(lambda: bk.copy_kv_pages(hk, hv, dk, dv, sp, dp, PAGE), 5)
    record(f"copy_kv_pages h2d {n} pages x {layers} layers", s, gbps=moved / s / 1e9,
           vs_h2d=moved / s / 1e9 / RESULTS["limits"]["h2d_gbps"])
    torch.cuda.synchronize()
    got = dk[:, n * PAGE : 2 * n * PAGE].cpu().view(torch.int16)
    ok = torch.equal(got, hk[:, : n * PAGE].view(torch.int16))
    check("copy_kv_pages_h2d", ok, "exact")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="path of the JSON summary")
    ap.add_argument("--quick", action="store_true", help="fewer shapes and configs")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_kernels needs CUDA", file=sys.stderr)
        return 2
    t0 = time.time()
    RESULTS["device"] = torch.cuda.get_device_name()
    RESULTS["date"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    RESULTS["versions"] = {"torch": torch.__version__, "triton": __import__("triton").__version__}
    measure_limits()
    sections: list[tuple[str, Callable[[], None]]] = [
        ("extend", lambda: [bench_extend(4096, 102_400, args.quick),
                            bench_extend(4096, 4096, True)]),  # cold prefill chunk
        ("decode", lambda: [bench_decode(b, n, args.quick)
                            for b, n in ((1, 102_400), (8, 32_768), (64, 2048))]),
        ("store", bench_store),
        ("moe", lambda: bench_moe(args.quick)),
        ("norm_rope", bench_norm_rope),
        ("bookkeeping", bench_bookkeeping),
    ]
    for name, fn in sections:
        try:
            fn()
        except Exception as exc:  # keep going: one broken section must not hide the rest
            check(f"section_{name}", False, f"{type(exc).__name__}: {exc}"[:300])
        torch.cuda.empty_cache()
    RESULTS["wall_s"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(RESULTS, f, indent=2)
    bad = [k for k, v in RESULTS["checks"].items() if not v["ok"]]
    print(f"wrote {args.out} in {RESULTS['wall_s']:.0f} s; failed checks: {bad or 'none'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
