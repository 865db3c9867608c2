"""RMSNorm and fused residual-add + RMSNorm on Triton (twins in norm_rope.py).

Numerics match the reference: the sum ``x + residual`` is rounded to the input
dtype (it becomes the next residual), the norm runs in fp32 and is rounded to
the input dtype before the weight multiply. One program per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, H, eps,
    stride_x, stride_r, stride_o, stride_s,
    HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / H
    normed = (xf * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    h = x.shape[-1]
    x2 = x.reshape(-1, h)  # [T, H]
    assert x2.stride(-1) == 1 and w.is_contiguous()
    out = torch.empty_like(x2)  # [T, H], x's dtype like the reference
    summed = torch.empty_like(x2) if residual is not None else None
    r2 = residual.reshape(-1, h) if residual is not None else x2
    s2 = summed if summed is not None else out
    if x2.shape[0]:
        block = triton.next_power_of_2(h)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, w, out, s2, h, eps,
            x2.stride(0), r2.stride(0), out.stride(0), s2.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK_H=block,
            num_warps=min(16, max(1, block // 256)),
        )
    shape = x.shape
    return out.view(shape), (summed.view(shape) if summed is not None else None)


def rms_norm_triton(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] (or [..., H]), w [H] -> [T, H]."""
    return _launch(x, None, w, eps)[0]


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual), like fused_add_rms_norm_ref."""
    out, summed = _launch(x, residual, w, eps)
    assert summed is not None
    return out, summed
