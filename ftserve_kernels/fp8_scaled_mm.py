"""Block-scaled fp8 prefill GEMM on cuBLAS (torch's scaled_mm, the 1x128 x
128x128 recipe of Hopper's cuBLAS 12.9+): y = x W^T (+ b), the same product as
fp8_gemm_triton.fp8_linear_triton (same activation codes and scales, fp32
accumulation, each 128-column step scaled), on cuBLAS's fp8 kernels.

Layout cuBLAS takes (torch checks it):

    codes  [M4, K] e4m3 row-major        M4 = M rounded up to 4; rows past M zero
    scales [M4, K / 128] fp32, column-major (stride (1, M4))
    weight codes [N, K] row-major, passed transposed (K-major columns)
    weight scales [K4 / 128, N / 128] fp32, column-major: the checkpoint's
        [N / 128, K / 128] grid transposed, K / 128 a multiple of 4

so the activation quantization kernel writes its scales transposed into one
[K / 128, M4] buffer, and the weight's grid is used as it is stored. Weights
that do not fit (block not 128 x 128, N not a multiple of 128, K / 128 not a
multiple of 4: fused projections with smaller row blocks, per-channel
checkpoints) stay on the Triton GEMM, as does a torch without the recipe.
One quantization launch and one cuBLAS call, fixed shapes, no host read.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ftserve_kernels.fp8_quant import FP8, GROUP, Fp8Weight, quantize_act_triton

ROW_ALIGN = 4  # cuBLAS's row alignment of the scaled operands


@functools.cache
def available() -> bool:
    """torch exposes scaled_mm with the block recipes, and the GPU is a Hopper
    (the recipe is sm_90's: other architectures take other block formats)."""
    return (hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")
            and hasattr(F.ScalingType, "BlockWise128x128") and torch.cuda.is_available()
            and torch.cuda.get_device_capability() == (9, 0))


def fits(w: Fp8Weight) -> bool:
    """The weight's scale grid is the recipe's (module docstring), without a copy."""
    n, k = w.codes.shape[-2:]
    return (w.codes.dim() == 2 and w.block_n == GROUP and w.block_k == GROUP and n % GROUP == 0
            and k % (4 * GROUP) == 0 and w.codes.stride(-1) == 1 and w.scale.is_contiguous())


def weight_operands(w: Fp8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes as [K, N] K-major, scales as [K / 128, N / 128] column-major): views."""
    return w.codes.t(), w.scale.t()


def act_buffers(m: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [M4, K], scales [M4, K / 128] column-major) for the quantization kernel."""
    m4 = -(-m // ROW_ALIGN) * ROW_ALIGN
    codes = torch.empty((m4, k), dtype=FP8, device=device)
    scales = torch.empty((k // GROUP, m4), dtype=torch.float32, device=device).t()
    return codes, scales


def scaled_mm(codes: torch.Tensor, scales: torch.Tensor, w: Fp8Weight, out_dtype: torch.dtype) -> torch.Tensor:
    """[M4, N] = dequant(codes) dequant(w)^T on cuBLAS."""
    wc, ws = weight_operands(w)
    return F.scaled_mm(codes, wc, scales, F.ScalingType.BlockWise1x128, ws, F.ScalingType.BlockWise128x128,
                       output_dtype=out_dtype)


def fp8_linear_scaled_mm(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] in x's dtype (``fits(w)``, ``available()``)."""
    m, k = x.shape
    assert x.stride(-1) == 1 and k == w.codes.shape[1]
    codes, scales = quantize_act_triton(x, act_buffers(m, k, x.device))
    y = scaled_mm(codes, scales, w, x.dtype)[:m]
    return y if bias is None else y.add_(bias)
