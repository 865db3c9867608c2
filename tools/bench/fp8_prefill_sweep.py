"""The fp8 prefill GEMMs alone at qwen3-30b-a3b's shapes, per tile config, next
to bf16 at the same shapes (issue 32: the cold chunk's fp8 matmuls must run well
ahead of bf16's). One GPU call picks the configs the pick() heuristics return:

    python -m tools.bench.fp8_prefill_sweep --out fp8_sweep.json        # H100/H200, about 1 min
    python -m tools.bench.fp8_prefill_sweep --smoke --out /tmp/s.json   # CPU, interpreter, tiny shapes

Rows: ``moe`` (fused_moe_fp8_triton: act quant, align, gate/up, down, combine;
the bf16 row is fused_moe_triton with its tuned table) and ``gemm`` per
projection (fp8_linear_triton: act quant and the GEMM; ``scaled_mm``:
fp8_scaled_mm, act quant and cuBLAS's block-scaled GEMM, on Hopper; the bf16
row is torch.matmul, cuBLAS). Median device seconds of one call, and TFLOPS of the
matmul work. The row named ``pick`` is the config the launcher takes by itself.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

from tools.bench.common import median_time, say, write_json

# (rows, down_block_n, warps, stages): fp8_moe_triton.Fp8MoeConfig fields
MOE_CONFIGS = [(128, 128, 8, 4), (128, 128, 8, 3), (64, 128, 8, 4), (64, 128, 4, 3), (128, 64, 8, 4)]
GEMM_CONFIGS = [(128, 128, 8, 4), (128, 128, 8, 3), (64, 128, 4, 4), (128, 64, 4, 4)]  # (rows, cols, warps, stages)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="CPU: tiny shapes under the Triton interpreter")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--iters", type=int, default=10)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # Imported after the interpreter choice (kernels are decorated on import).
    from ftserve_kernels import fp8_gemm_triton as fg
    from ftserve_kernels import fp8_moe_triton as fm
    from ftserve_kernels.fp8_quant import quantize_weight
    from ftserve_kernels.moe_triton import fused_moe_triton

    cuda = torch.cuda.is_available() and not args.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.smoke:
        t, e, h, inter, k, projections, iters = 16, 8, 256, 128, 2, {"qkv": (384, 256)}, 1
    else:
        t, e, h, inter, k, iters = args.tokens, 128, 2048, 768, 8, args.iters
        projections = {"qkv": (5120, 2048), "o": (2048, 4096)}  # (N, K)
    g = torch.Generator().manual_seed(0)
    res: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "cpu", "tokens": t,
                           "shape": {"E": e, "H": h, "I": inter, "k": k}, "moe": [], "gemm": {}}

    def row(name: str, fn: Any, flops: float) -> dict[str, Any]:
        s = median_time(fn, dev, iters)
        r = {"config": name, "s": s, "tflops": flops / s / 1e12}
        say(f"{name}: {s * 1e3:.3f} ms, {r['tflops']:.0f} TFLOPS")
        return r

    w13 = torch.randn(e, 2 * inter, h, generator=g) * h ** -0.5
    w2 = torch.randn(e, h, inter, generator=g) * inter ** -0.5
    q13, q2 = (quantize_weight(w.to(dev)) for w in (w13, w2))
    x = torch.randn(t, h, generator=g).to(dtype).to(dev)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).int().to(dev)
    wts = torch.softmax(torch.randn(t, k, generator=g), -1).to(dev)
    moe_flops = 2.0 * t * k * (2 * inter * h + h * inter)
    res["moe"].append(row("fp8 pick", lambda: fm.fused_moe_fp8_triton(x, q13, q2, wts, ids), moe_flops))
    for c in MOE_CONFIGS if cuda else [(16, 32, 4, 1)]:
        cfg = fm.Fp8MoeConfig(*c)
        res["moe"].append(row(f"fp8 {c}", lambda cfg=cfg: fm.fused_moe_fp8_triton(x, q13, q2, wts, ids, cfg),
                              moe_flops))
    b13, b2 = w13.to(dtype).to(dev), w2.to(dtype).to(dev)
    res["moe"].append(row("bf16 table", lambda: fused_moe_triton(x, b13, b2, wts, ids, gemv=False), moe_flops))
    for name, (n, kk) in projections.items():
        w = torch.randn(n, kk, generator=g) * kk ** -0.5
        qw = quantize_weight(w.to(dev))
        a = torch.randn(t, kk, generator=g).to(dtype).to(dev)
        flops = 2.0 * t * n * kk
        rows = [row(f"{name} fp8 pick", lambda a=a, qw=qw: fg.fp8_linear_triton(a, qw), flops)]
        for c in GEMM_CONFIGS if cuda else [(16, 32, 4, 1)]:
            cfg = fg.Fp8GemmConfig(*c)
            rows.append(row(f"{name} fp8 {c}", lambda a=a, qw=qw, cfg=cfg: fg.fp8_linear_triton(a, qw, None, cfg),
                            flops))
        if cuda:
            from ftserve_kernels import fp8_scaled_mm as sm

            if sm.available() and sm.fits(qw):
                rows.append(row(f"{name} fp8 scaled_mm", lambda a=a, qw=qw: sm.fp8_linear_scaled_mm(a, qw), flops))
        wb = w.to(dtype).to(dev)
        rows.append(row(f"{name} bf16 matmul", lambda a=a, wb=wb: a @ wb.T, flops))
        res["gemm"][name] = rows
    write_json(args.out, res)
    return res


if __name__ == "__main__":
    main()
