"""RMSNorm and fused residual-add + RMSNorm on Triton (twins in norm_rope.py).

Numerics match the reference: the sum ``x + residual`` is rounded to the input
dtype (it becomes the next residual), the norm runs in fp32 and is rounded to
the input dtype before the weight multiply.

Each program normalizes ``BLOCK_R`` rows at once (a [BLOCK_R, BLOCK_H] tile of
about 8k elements). One program per row was far too many tiny programs for the
per-head q/k norms ([T * 32, 128] rows) and left the [T, 2048] case at a fifth
of copy bandwidth on the H200.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ftserve_kernels import pdl
from ftserve_kernels.config import DEFAULT_KERNELS, KernelConfig

_TILE_ELEMS = 8192  # elements per program: 16 KB of bf16 per tensor, 32 per thread at 8 warps


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, y_ptr, lg_ptr, T, H, eps,
    stride_x, stride_r, stride_o, stride_s, stride_y, stride_lg,
    HAS_RESIDUAL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    PDL: tl.constexpr, ZERO_CENTERED: tl.constexpr = False, SHARED: tl.constexpr = False,
):
    pdl.enter(PDL)
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # [R]
    offs = tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < T) & (offs[None, :] < H)  # [R, H]
    x = tl.load(x_ptr + rows[:, None] * stride_x + offs[None, :], mask=mask, other=0.0)
    ty = x_ptr.dtype.element_ty
    if SHARED:  # x + sigmoid(logit) * y, each op rounded as the reference's
        y = tl.load(y_ptr + rows[:, None] * stride_y + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        lg = tl.load(lg_ptr + rows * stride_lg, mask=rows < T, other=0.0).to(tl.float32)  # [R]
        gate = tl.sigmoid(lg).to(ty).to(tl.float32)
        x = (x.to(tl.float32) + (gate[:, None] * y).to(ty).to(tl.float32)).to(ty)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + rows[:, None] * stride_r + offs[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(ty)
        tl.store(sum_ptr + rows[:, None] * stride_s + offs[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 1) / H  # [R]
    w = tl.load(w_ptr + offs, mask=offs < H, other=0.0).to(tl.float32)
    if ZERO_CENTERED:  # norm(x) * (1 + w) in fp32, one rounding
        out = xf * tl.rsqrt(var + eps)[:, None] * (1.0 + w)[None, :]
    else:
        normed = (xf * tl.rsqrt(var + eps)[:, None]).to(ty)
        out = w[None, :] * normed.to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_o + offs[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask)


@functools.lru_cache(maxsize=64)
def norm_launch_params(h: int) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_R, num_warps) for rows of width ``h``; cached, so a launch
    costs no recomputation on the host."""
    block_h = triton.next_power_of_2(h)
    block_r = max(1, min(128, _TILE_ELEMS // block_h))
    warps = max(1, min(16, block_r * block_h // 1024))  # 8 warps at 8k elements: 32 per thread
    return block_h, block_r, warps


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor, eps: float, kernels: KernelConfig,
    zero_centered: bool = False, shared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    h = x.shape[-1]
    x2 = x.reshape(-1, h)  # [T, H]
    assert x2.stride(-1) == 1 and w.is_contiguous()
    t = x2.shape[0]
    out = torch.empty_like(x2)  # [T, H], x's dtype like the reference
    summed = torch.empty_like(x2) if residual is not None else None
    r2 = residual.reshape(-1, h) if residual is not None else x2
    s2 = summed if summed is not None else out
    y2, lg = x2, x2  # unread without ``shared``
    if shared is not None:
        y2, lg = shared[0].reshape(-1, h), shared[1].reshape(-1)
        assert residual is not None and y2.stride(-1) == 1 and lg.shape[0] == t
    if t:
        block_h, block_r, warps = norm_launch_params(h)
        on = pdl.active(x2, kernels)
        _rms_norm_kernel[(triton.cdiv(t, block_r),)](
            x2, r2, w, out, s2, y2, lg, t, h, eps,
            x2.stride(0), r2.stride(0), out.stride(0), s2.stride(0), y2.stride(0), lg.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK_R=block_r, BLOCK_H=block_h, num_warps=warps,
            PDL=on, ZERO_CENTERED=zero_centered, SHARED=shared is not None, **pdl.launch(on),
        )
    shape = x.shape
    return out.view(shape), (summed.view(shape) if summed is not None else None)


def rms_norm_triton(x: torch.Tensor, w: torch.Tensor, eps: float, zero_centered: bool = False,
                    kernels: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    """x [T, H] (or [..., H]), w [H] -> [T, H]; twin norm_rope.rms_norm_ref."""
    return _launch(x, None, w, eps, kernels, zero_centered)[0]


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float, zero_centered: bool = False,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None, kernels: KernelConfig = DEFAULT_KERNELS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual), like fused_add_rms_norm_ref
    (``shared``: a shared expert's output and gate logit, added to x first)."""
    out, summed = _launch(x, residual, w, eps, kernels, zero_centered, shared)
    assert summed is not None
    return out, summed


# ---------------------------------------------------------------- the gated norm of Gated DeltaNet


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, g_ptr, w_ptr, out_ptr, N, eps,
    stride_xt, stride_xh, stride_gt, stride_gg, stride_gr, stride_ot, stride_oh,
    NH: tl.constexpr, RATIO: tl.constexpr, D: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    # Rows are (token, head) pairs: row = token * NH + head; head h's gate is group
    # h // RATIO, member h % RATIO of the gate view.
    pdl.enter(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [R]
    tok = (rows // NH).to(tl.int64)
    head = rows % NH
    d = tl.arange(0, BLOCK_D)
    m = (rows < N)[:, None] & (d < D)[None, :]
    x = tl.load(x_ptr + tok[:, None] * stride_xt + head[:, None] * stride_xh + d[None, :], mask=m, other=0.0)
    gp = g_ptr + tok * stride_gt + (head // RATIO) * stride_gg + (head % RATIO) * stride_gr
    g = tl.load(gp[:, None] + d[None, :], mask=m, other=0.0).to(tl.float32)
    ty = x_ptr.dtype.element_ty
    xf = x.to(tl.float32)
    normed = (xf * tl.rsqrt(tl.sum(xf * xf, 1) / D + eps)[:, None]).to(ty)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    wn = (w[None, :] * normed.to(tl.float32)).to(ty).to(tl.float32)  # w * normed, in the dtype
    out = wn * (g * tl.sigmoid(g))
    tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m)


def gated_rms_norm_triton(x: torch.Tensor, gate: torch.Tensor, w: torch.Tensor, eps: float,
                          kernels: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    """w * norm(x) * SiLU(gate), x [T, NH, D], gate [T, G, NH / G, D] (a view into
    the input projection: no copy) or [T, NH, D] -> [T, NH, D] contiguous. Twin:
    norm_rope.gated_rms_norm_ref."""
    t, nh, d = x.shape
    g4 = gate if gate.dim() == 4 else gate.view(t, nh, 1, d)
    assert g4.shape[0] == t and g4.shape[1] * g4.shape[2] == nh and g4.shape[3] == d
    assert x.stride(-1) == 1 and g4.stride(-1) == 1 and w.is_contiguous()
    out = torch.empty((t, nh, d), dtype=x.dtype, device=x.device)
    n = t * nh
    if n:
        block_d = triton.next_power_of_2(d)
        block_r = max(1, min(16, 2048 // block_d))  # small programs: a decode row is only NH rows
        on = pdl.active(x, kernels)
        _gated_rms_norm_kernel[(triton.cdiv(n, block_r),)](
            x, g4, w, out, n, eps, x.stride(0), x.stride(1), g4.stride(0), g4.stride(1), g4.stride(2),
            out.stride(0), out.stride(1), NH=nh, RATIO=g4.shape[2], D=d, BLOCK_R=block_r, BLOCK_D=block_d,
            num_warps=4, PDL=on, **pdl.launch(on),
        )
    return out
