"""Time ftserve's Triton kernels at real shapes against limits measured in the same run.

Usage (CUDA only): python tools/bench/kernels.py --out bench_kernels.json [--quick]

Limits measured first: bf16 matmul TFLOP/s (torch), device copy GB/s (read +
write), pinned host->device GB/s, PyTorch SDPA (flash) for 4,096 causal queries
over 102,400 keys and for one decode query over 102,400 keys. Every kernel's
output is checked (finite, and against SDPA or the torch twin) before it is
timed; a failed check is reported in the JSON and the exit code is 1.
Shapes: attention 32 q heads / 4 kv heads / head_dim 128; MoE qwen3-30b-a3b
(E=128, k=8, H=2048, I=768).

The timing harness, shapes and limits are in tools/bench/kernel_harness.py, the
attention sections in tools/bench/attention_kernels.py; MoE, norm / rope and
bookkeeping sections, the CLI and the JSON summary stay here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from ftserve_kernels import bookkeeping as bk  # noqa: E402
from ftserve_kernels import moe_align_triton as ma  # noqa: E402
from ftserve_kernels import moe_triton as mt  # noqa: E402
from ftserve_kernels import norm_triton as nt  # noqa: E402
from ftserve_kernels.moe import fused_moe_ref  # noqa: E402
from ftserve_kernels.norm_rope import qk_norm_rotary_ref  # noqa: E402
from ftserve_kernels.norm_triton import fused_add_rms_norm_triton, rms_norm_triton  # noqa: E402
from ftserve_kernels.rope_triton import qk_norm_rotary_triton, rotary_triton  # noqa: E402
from tools.bench.attention_kernels import bench_decode, bench_extend, bench_store  # noqa: E402
from tools.bench.kernel_harness import (  # noqa: E402
    HKV,
    HQ,
    PAGE,
    RESULTS,
    D,
    bench,
    bench_graph,
    check,
    measure_limits,
    record,
    rel_err,
)

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
            al = bench_graph(lambda i=ids, bm=bm: ma.moe_align(i, e, bm), 20)
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
