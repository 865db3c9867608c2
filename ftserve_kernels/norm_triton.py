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
    x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, T, H, eps,
    stride_x, stride_r, stride_o, stride_s,
    HAS_RESIDUAL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.enter(PDL)
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # [R]
    offs = tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < T) & (offs[None, :] < H)  # [R, H]
    x = tl.load(x_ptr + rows[:, None] * stride_x + offs[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + rows[:, None] * stride_r + offs[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + rows[:, None] * stride_s + offs[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 1) / H  # [R]
    normed = (xf * tl.rsqrt(var + eps)[:, None]).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=offs < H, other=0.0)
    out = w.to(tl.float32)[None, :] * normed.to(tl.float32)
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    h = x.shape[-1]
    x2 = x.reshape(-1, h)  # [T, H]
    assert x2.stride(-1) == 1 and w.is_contiguous()
    t = x2.shape[0]
    out = torch.empty_like(x2)  # [T, H], x's dtype like the reference
    summed = torch.empty_like(x2) if residual is not None else None
    r2 = residual.reshape(-1, h) if residual is not None else x2
    s2 = summed if summed is not None else out
    if t:
        block_h, block_r, warps = norm_launch_params(h)
        on = pdl.active(x2, kernels)
        _rms_norm_kernel[(triton.cdiv(t, block_r),)](
            x2, r2, w, out, s2, t, h, eps,
            x2.stride(0), r2.stride(0), out.stride(0), s2.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK_R=block_r, BLOCK_H=block_h, num_warps=warps,
            PDL=on, **pdl.launch(on),
        )
    shape = x.shape
    return out.view(shape), (summed.view(shape) if summed is not None else None)


def rms_norm_triton(x: torch.Tensor, w: torch.Tensor, eps: float,
                    kernels: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    """x [T, H] (or [..., H]), w [H] -> [T, H]."""
    return _launch(x, None, w, eps, kernels)[0]


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float,
    kernels: KernelConfig = DEFAULT_KERNELS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual), like fused_add_rms_norm_ref."""
    out, summed = _launch(x, residual, w, eps, kernels)
    assert summed is not None
    return out, summed
