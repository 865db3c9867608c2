"""Block-scaled fp8 GEMM for prefill (w8a8 on the tensor cores): y = x W^T (+ b).

x [M, K] (bf16 rows) is first quantized per token and 128-column group
(fp8_quant.quantize_act_triton: codes + scales [M, K / 128]); then each
program computes a [BLOCK_M, BLOCK_N] tile of y, K in steps of 128 = one
activation group, so every step has one scale per row and one per weight row
block::

    acc += dot(a_codes[BM, 128], w_codes[128, BN]) * a_scale[BM, 1] * w_scale[1, BN]

(w_scale[n] = scale[n // bn, k0 // bk]; bk is 128, or >= K for per-channel
weights). The dot multiplies e4m3 codes on Hopper's fp8 wgmma with fp32
accumulation; the scales apply to each step's partial sum, so the result is the
dequantized product up to fp32 rounding. Twin: fp8_quant.fp8_linear_ref with
``act_quant``. Two launches, fixed shapes, no host read (a prefill chunk stays
sync-free and graph-capturable).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ftserve_kernels.attention_common import interpreting, mma
from ftserve_kernels.fp8_quant import GROUP, Fp8Weight, quantize_act_triton
from ftserve_kernels.moe_triton import _block_coords


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    group_m: int = 8

    @staticmethod
    def pick(m: int, cuda: bool) -> Fp8GemmConfig:
        """Hopper: 64 or 128 rows per tile (the fp8 wgmma shapes), 128 columns,
        four stages of 2 x 8-16 KB; 128 rows take eight warps (a warp group per
        64 rows: the accumulator and each step's dot, 128 registers a thread).
        The interpreter: small tiles."""
        if not cuda:
            return Fp8GemmConfig(16, 32, 4, 1)
        if m <= 1024:
            return Fp8GemmConfig(64, 128, 4, 4)
        return Fp8GemmConfig(128, 128, 8, 4)


@triton.jit
def block_scaled_dot(a_ptrs, b_ptrs, as_ptrs, bs_ptrs, mmask, nmask, K,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SCALE_K: tl.constexpr, TILE_SCALE: tl.constexpr, EVEN_K: tl.constexpr,
                     UPCAST: tl.constexpr):
    """sum over K in BLOCK_K steps of dot(a codes, b codes) x row scale x weight
    scale -> [BLOCK_M, BLOCK_N] fp32. a_ptrs [BM, BK], b_ptrs [BK, BN] at k = 0;
    as_ptrs [BM] the rows' scales (+ the K group); bs_ptrs the weight scales (+ the
    K block): a scalar with TILE_SCALE (folded into the row scales), else [BN].
    Each step's dot adds in fp32; the scales for step k+1 load during step k."""
    if TILE_SCALE:
        sb = tl.load(bs_ptrs)
    else:
        sb = tl.load(bs_ptrs, mask=nmask, other=0.0)
    sa = tl.load(as_ptrs, mask=mmask, other=0.0)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mmask[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=nmask[None, :], other=0.0)
        else:
            kmask = offs_k < K - k0
            a = tl.load(a_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        kn = tl.minimum(k0 + BLOCK_K, K - 1)  # the next step's column, in bounds
        sa_next = tl.load(as_ptrs + kn // BLOCK_K, mask=mmask, other=0.0)
        if TILE_SCALE:
            sb_next = tl.load(bs_ptrs + kn // SCALE_K)
            acc += mma(a, b, UPCAST) * (sa * sb)[:, None]
        else:
            sb_next = tl.load(bs_ptrs + kn // SCALE_K, mask=nmask, other=0.0)
            acc += mma(a, b, UPCAST) * sa[:, None] * sb[None, :]
        sa = sa_next
        sb = sb_next
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    return acc


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, bias_ptr,
    M, N, K, NUM_M, NUM_N,
    stride_am, stride_asm, stride_bn, stride_bsn, stride_cm,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, TILE_SCALE: tl.constexpr = False,
):
    # TILE_SCALE (SCALE_N a multiple of BLOCK_N: the tile's columns share one
    # scale row block): one weight scale per K step, folded into the row scales,
    # instead of a column vector in the accumulator's layout (32 registers a
    # thread at 128 columns). Scales for step k+1 load during step k.
    pid_m, pid_n = _block_coords(NUM_M, NUM_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = offs_m < M
    nmask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    rows = offs_m.to(tl.int64)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]  # [BM, BK]
    b_ptrs = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]  # [BK, BN]
    as_ptrs = as_ptr + rows * stride_asm  # [BM], + the K group
    if TILE_SCALE:
        bs_ptrs = bs_ptr + (pid_n * BLOCK_N // SCALE_N) * stride_bsn  # scalar, + the K block
    else:
        bs_ptrs = bs_ptr + (offs_n // SCALE_N) * stride_bsn  # [BN], + the K block
    acc = block_scaled_dot(a_ptrs, b_ptrs, as_ptrs, bs_ptrs, mmask, nmask, K,
                           BLOCK_M, BLOCK_N, BLOCK_K, SCALE_K, TILE_SCALE, EVEN_K, UPCAST)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + rows[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def check_weight(w: Fp8Weight) -> None:
    """What the kernels assume of an Fp8Weight's scale grid (host shapes only)."""
    k = w.codes.shape[-1]
    assert w.codes.stride(-1) == 1 and w.scale.stride(-1) == 1, "codes and scales must be row-major"
    assert w.block_k % GROUP == 0 or w.block_k >= k, (
        f"weight scale blocks of {w.block_k} columns do not align with the {GROUP}-column steps")


def fp8_gemm_triton(
    a_codes: torch.Tensor,  # [M, K] e4m3, activation codes
    a_scale: torch.Tensor,  # [M, ceil(K / 128)] fp32
    w: Fp8Weight,  # [N, K]
    out: torch.Tensor,  # [M, N]
    bias: torch.Tensor | None = None,
    cfg: Fp8GemmConfig | None = None,
) -> torch.Tensor:
    """out = dequant(a) dequant(w)^T (+ bias): one launch."""
    m, k = a_codes.shape
    n = w.codes.shape[0]
    check_weight(w)
    if m == 0:
        return out
    cfg = cfg or Fp8GemmConfig.pick(m, a_codes.is_cuda)
    num_m, num_n = triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n)
    _fp8_gemm_kernel[(num_m * num_n,)](
        a_codes, a_scale, w.codes, w.scale, out, bias if bias is not None else w.scale,
        m, n, k, num_m, num_n,
        a_codes.stride(0), a_scale.stride(0), w.codes.stride(0), w.scale.stride(0), out.stride(0),
        SCALE_N=w.block_n, SCALE_K=w.block_k, HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=GROUP, GROUP_M=cfg.group_m,
        EVEN_K=k % GROUP == 0, UPCAST=interpreting(), TILE_SCALE=w.block_n % cfg.block_n == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def fp8_linear_triton(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None,
                      cfg: Fp8GemmConfig | None = None) -> torch.Tensor:
    """y [M, N] in x's dtype: x quantized per token and 128 columns, then the GEMM."""
    assert x.stride(-1) == 1 and x.shape[1] == w.codes.shape[1]
    codes, scales = quantize_act_triton(x)
    out = torch.empty((x.shape[0], w.codes.shape[0]), dtype=x.dtype, device=x.device)
    return fp8_gemm_triton(codes, scales, w, out, bias, cfg)
