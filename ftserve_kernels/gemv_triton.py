"""Dense GEMV for decode-sized T (y = x W^T + b), optionally with the decoder's
residual add + RMSNorm folded in as a prologue. Twin: the composition in ops.py.

At batch 1 the cuBLAS GEMVs of the attention projections read their weights at
about half of HBM bandwidth; here every program streams BLOCK_N full weight
rows in [BLOCK_N, BLOCK_K] tiles (32 KB a step; enough programs that every SM
holds two or three), for all T rows at once::

    program p: y[:, p*BN : (p+1)*BN] = in[T, K] . W[p*BN : (p+1)*BN, K]^T

With ``norm_w`` the input is ``round(w * round(rmsnorm(round(x + r))))``, as
ops.fused_add_rms_norm computes it: each program first takes the row's sum of
squares over all of K (T x K from L2, cheap next to its 32-64 KB of weights),
then rebuilds the normed input chunk by chunk; program 0 also stores x + r,
the next residual. So qkv_proj(input_layernorm(x, r)) is one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GEMV_MAX_ROWS = 4  # rows per launch: every program holds all of them


@triton.jit
def _gemv_kernel(
    x_ptr, r_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, sum_ptr,
    T, N, K, eps,
    stride_x, stride_r, stride_w, stride_y, stride_s,
    HAS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_KALL: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_T)  # [TB]
    tmask = rows < T
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [N]
    nmask = cols < N
    offs_k = tl.arange(0, BLOCK_K)
    inv = tl.zeros([BLOCK_T], tl.float32)
    if HAS_NORM:
        ka = tl.arange(0, BLOCK_KALL)
        m = tmask[:, None] & (ka[None, :] < K)
        xa = tl.load(x_ptr + rows[:, None] * stride_x + ka[None, :], mask=m, other=0.0)
        if HAS_RESIDUAL:
            ra = tl.load(r_ptr + rows[:, None] * stride_r + ka[None, :], mask=m, other=0.0)
            xa = (xa.to(tl.float32) + ra.to(tl.float32)).to(x_ptr.dtype.element_ty)
        xf = xa.to(tl.float32)
        inv = tl.rsqrt(tl.sum(xf * xf, 1) / K + eps)  # [TB]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_w + offs_k[None, :]  # [N, K]
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        kmask = kk < K
        xm = tmask[:, None] & kmask[None, :]
        xv = tl.load(x_ptr + rows[:, None] * stride_x + kk[None, :], mask=xm, other=0.0)  # [TB, K]
        if HAS_NORM:
            if HAS_RESIDUAL:
                rv = tl.load(r_ptr + rows[:, None] * stride_r + kk[None, :], mask=xm, other=0.0)
                xv = (xv.to(tl.float32) + rv.to(tl.float32)).to(x_ptr.dtype.element_ty)
                if pid == 0:
                    tl.store(sum_ptr + rows[:, None] * stride_s + kk[None, :], xv, mask=xm)
            normed = (xv.to(tl.float32) * inv[:, None]).to(x_ptr.dtype.element_ty)
            nw = tl.load(nw_ptr + kk, mask=kmask, other=0.0)
            xv = (nw.to(tl.float32)[None, :] * normed.to(tl.float32)).to(x_ptr.dtype.element_ty)
        if EVEN_K:
            w = tl.load(w_ptrs, mask=nmask[:, None], other=0.0)
        else:
            w = tl.load(w_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32)[None, :, :] * xv.to(tl.float32)[:, None, :], 2)  # [TB, N]
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=tmask[:, None] & nmask[None, :])


def gemv_triton(
    x: torch.Tensor,  # [T, K], T <= GEMV_MAX_ROWS
    w: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    norm_w: torch.Tensor | None = None,  # [K]: RMSNorm the input first (see module doc)
    residual: torch.Tensor | None = None,  # [T, K]: add before the norm; needs norm_w
    eps: float = 1e-6,
    block: tuple[int, int] | None = None,  # (BLOCK_N, BLOCK_K)
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """-> (y [T, N] in x's dtype, x + residual [T, K] or None)."""
    t, k = x.shape
    n = w.shape[0]
    assert t <= GEMV_MAX_ROWS and w.shape[1] == k
    assert residual is None or norm_w is not None, "the residual add is part of the norm prologue"
    assert x.stride(-1) == 1 and w.stride(-1) == 1
    y = torch.empty((t, n), dtype=x.dtype, device=x.device)
    summed = torch.empty_like(x) if residual is not None else None
    if t == 0:
        return y, summed
    if residual is not None:
        assert residual.stride(-1) == 1
    cuda = x.is_cuda
    # 32 KB of bf16 weights per step (64 elements a thread at 8 warps), as the MoE
    # gate/up GEMV that streams at ~75% of copy bandwidth: loads outside tl.dot may
    # not be software-pipelined, so one step's tile is what hides the latency.
    # qkv (N = 5120, K = 2048): 320 programs of 2 steps; o_proj (N = 2048, K = 4096):
    # 256 programs of 2 steps. Sweep: tools/bench_decode_layer.py.
    bn, bk = block or (((16, 1024) if n >= 4096 else (8, 2048)) if cuda else (8, 16))
    bk = min(bk, triton.next_power_of_2(k))
    r = residual if residual is not None else x
    nw = norm_w if norm_w is not None else x
    s = summed if summed is not None else y
    _gemv_kernel[(triton.cdiv(n, bn),)](
        x, r, nw, w, bias if bias is not None else w, y, s,
        t, n, k, eps,
        x.stride(0), r.stride(0), w.stride(0), y.stride(0), s.stride(0),
        HAS_NORM=norm_w is not None, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        BLOCK_T=max(2, triton.next_power_of_2(t)), BLOCK_N=bn, BLOCK_K=bk,
        BLOCK_KALL=triton.next_power_of_2(k), EVEN_K=k % bk == 0,
        num_warps=8 if cuda else 1,
    )
    return y, summed
