"""Neox-style rotary embedding on Triton (twin: norm_rope.rotary_ref).

Returns new q and k tensors (the ops.py contract). ``cos_sin [max_pos, rot]``
holds cos in its first half and sin in its second; head dims past ``rot`` pass
through unrotated. One program per token handles all q and k heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    src_ptr, dst_ptr, row, stride_st, stride_sh, stride_dt, stride_dh, cos, sin,
    NH: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    m = (h[:, None] < NH) & (j[None, :] < HALF)
    src = src_ptr + row * stride_st + h[:, None] * stride_sh
    dst = dst_ptr + row * stride_dt + h[:, None] * stride_dh
    x1 = tl.load(src + j[None, :], mask=m, other=0.0).to(tl.float32)  # [H, half]
    x2 = tl.load(src + HALF + j[None, :], mask=m, other=0.0).to(tl.float32)
    ty = dst_ptr.dtype.element_ty
    tl.store(dst + j[None, :], (x1 * cos[None, :] - x2 * sin[None, :]).to(ty), mask=m)
    tl.store(dst + HALF + j[None, :], (x2 * cos[None, :] + x1 * sin[None, :]).to(ty), mask=m)
    if 2 * HALF < D:  # partial rotary: copy the tail
        d = 2 * HALF + tl.arange(0, BLOCK_D)
        mt = (h[:, None] < NH) & (d[None, :] < D)
        tl.store(dst + d[None, :], tl.load(src + d[None, :], mask=mt, other=0.0), mask=mt)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cs_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
    HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cs_ptr + pos * stride_cs + j, mask=j < HALF, other=0.0)  # [half] fp32
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + j, mask=j < HALF, other=0.0)
    _rotate_heads(q_ptr, qo_ptr, row, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin,
                  HQ, D, HALF, BLOCK_HQ, BLOCK_HALF, BLOCK_D)
    _rotate_heads(k_ptr, ko_ptr, row, stride_kt, stride_kh, stride_kot, stride_koh, cos, sin,
                  HK, D, HALF, BLOCK_HK, BLOCK_HALF, BLOCK_D)


def rotary_triton(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D], positions [T] int64, cos_sin [max_pos, rot] fp32."""
    t, hq, d = q.shape
    hk = k.shape[1]
    half = cos_sin.shape[-1] // 2
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin.stride(-1) == 1
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, Hq, D]
    ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)  # [T, Hkv, D]
    if t:
        _rotary_kernel[(t,)](
            q, k, qo, ko, positions, cos_sin,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1), cos_sin.stride(0),
            HQ=hq, HK=hk, D=d, HALF=half,
            BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HK=triton.next_power_of_2(hk),
            BLOCK_HALF=triton.next_power_of_2(half),
            BLOCK_D=triton.next_power_of_2(max(1, d - 2 * half)),
        )
    return qo, ko
