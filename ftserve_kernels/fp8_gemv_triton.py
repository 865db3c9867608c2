"""Dense fp8 GEMV for decode-sized T (y = x W^T + b, W in e4m3 with block scales).

At one to four rows a projection is bound by the bytes of its weight: here
each program streams BLOCK_N weight rows of e4m3 codes (half the bytes of
bf16) in [BLOCK_N, BLOCK_K] tiles, BLOCK_K = 128 columns so every step meets
one scale per weight row (Fp8Weight: scale[n // bn, k0 // bk]), for all T rows
at once; the activation rows stay in their dtype (w8a16: no activation
rounding at decode)::

    program p: y[:, p*BN : (p+1)*BN] = sum_k0  (x[T, k0:k0+128] . codes[p*BN.., k0:k0+128]^T) * scale

The K loop is unrolled (K_STEPS) so the steps' loads can all be in flight.
Twin: fp8_quant.fp8_linear_ref (the exact reference: the rounding is fp32's).
Fixed shapes, no host read: it runs inside the decode graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftserve_kernels import pdl
from ftserve_kernels.config import DEFAULT_KERNELS, KernelConfig
from ftserve_kernels.fp8_gemm_triton import check_weight
from ftserve_kernels.fp8_quant import GROUP, Fp8Weight

GEMV_MAX_ROWS = 4  # rows per launch: every program holds all of them


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr,
    T, N, K, stride_x, stride_w, stride_s, stride_y,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr,
    EVEN_K: tl.constexpr, PDL: tl.constexpr,
    parts_ptr=None, P=1, eps=0.0, HAS_PARTS: tl.constexpr = False, BLOCK_P: tl.constexpr = 1,
):
    # HAS_PARTS: x is w * s of a norm the layer before left pending (its programs'
    # partial sums of squares of s in parts [T, P]): each row's dot is scaled by
    # its 1/rms at the end, as gemv_triton's (ops.PendingNorm).
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [N]
    nmask = cols < N
    offs_k = tl.arange(0, BLOCK_K)
    tt = tl.arange(0, BLOCK_T)
    tmask = tt < T
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_w + offs_k[None, :]  # [N, BK]
    s_ptrs = s_ptr + (cols // SCALE_N) * stride_s  # [N], + the K block
    x_ptrs = x_ptr + tt.to(tl.int64)[:, None] * stride_x + offs_k[None, :]  # [T, BK]
    if PDL:
        # The weights are no earlier kernel's output: the first step's tile and
        # scales are in flight before the wait (pdl.py), while the kernel before finishes.
        w_first = tl.load(w_ptrs, mask=nmask[:, None] & (offs_k[None, :] < K), other=0.0)
        s_first = tl.load(s_ptrs, mask=nmask, other=0.0)
    pdl.enter(PDL)  # x comes from the kernel before
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for step in tl.static_range(K_STEPS):
        k0 = step * BLOCK_K
        if EVEN_K:
            xv = tl.load(x_ptrs + k0, mask=tmask[:, None], other=0.0)
        else:
            kmask = offs_k < K - k0
            xv = tl.load(x_ptrs + k0, mask=tmask[:, None] & kmask[None, :], other=0.0)
        if PDL and step == 0:
            w = w_first
            sc = s_first
        else:
            if EVEN_K:
                w = tl.load(w_ptrs + k0, mask=nmask[:, None], other=0.0)
            else:
                w = tl.load(w_ptrs + k0, mask=nmask[:, None] & kmask[None, :], other=0.0)
            sc = tl.load(s_ptrs + k0 // SCALE_K, mask=nmask, other=0.0)  # [N]
        part = tl.sum(w.to(tl.float32)[None, :, :] * xv.to(tl.float32)[:, None, :], 2)  # [T, N]
        acc += part * sc[None, :]
    if HAS_PARTS:
        pp = tl.arange(0, BLOCK_P)
        parts = tl.load(parts_ptr + tt[:, None] * P + pp[None, :], mask=tmask[:, None] & (pp[None, :] < P),
                        other=0.0)
        acc = acc * tl.rsqrt(tl.sum(parts, 1) / K + eps)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=nmask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + tt.to(tl.int64)[:, None] * stride_y + cols[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=tmask[:, None] & nmask[None, :])


def gemv_tiles(n: int, k: int, cuda: bool) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, warps). Hopper: 64 KB of codes per program at K 2048
    (32 rows), 16 rows past it, so qkv (5120 x 2048) and o_proj (2048 x 4096)
    each spread over 130-160 programs; the interpreter: few, wide programs."""
    bk = min(GROUP, triton.next_power_of_2(k))
    if not cuda:
        return 16, bk, 4
    return (32 if k <= 2048 else 16), bk, 4


def fp8_gemv_triton(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None,
                    tiles: tuple[int, int, int] | None = None, parts: torch.Tensor | None = None,
                    eps: float = 0.0, kernels: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    """x [T, K] (T <= GEMV_MAX_ROWS) -> y [T, N] in x's dtype. ``parts`` [T, P] fp32:
    x is w * s of a pending norm (eps): y = (x . W^T) / rms(s) (+ b). ``kernels``: PDL."""
    t, k = x.shape
    n = w.codes.shape[0]
    assert t <= GEMV_MAX_ROWS and w.codes.shape[1] == k and x.stride(-1) == 1
    assert parts is None or (parts.dtype == torch.float32 and parts.shape[0] == t and parts.is_contiguous())
    check_weight(w)
    y = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t == 0:
        return y
    bn, bk, warps = tiles or gemv_tiles(n, k, x.is_cuda)
    on = pdl.active(x, kernels)
    _fp8_gemv_kernel[(triton.cdiv(n, bn),)](
        x, w.codes, w.scale, bias if bias is not None else w.scale, y,
        t, n, k, x.stride(0), w.codes.stride(0), w.scale.stride(0), y.stride(0),
        SCALE_N=w.block_n, SCALE_K=w.block_k, HAS_BIAS=bias is not None,
        BLOCK_T=triton.next_power_of_2(t), BLOCK_N=bn, BLOCK_K=bk, K_STEPS=triton.cdiv(k, bk),
        EVEN_K=k % bk == 0, PDL=on, num_warps=warps, num_stages=1, **pdl.launch(on),
        **({} if parts is None else dict(parts_ptr=parts, P=parts.shape[1], eps=eps, HAS_PARTS=True,
                                         BLOCK_P=triton.next_power_of_2(parts.shape[1]))),
    )
    return y
