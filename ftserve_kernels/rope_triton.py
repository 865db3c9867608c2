"""Neox-style rotary embedding on Triton (twin: norm_rope.rotary_ref).

Returns new q and k tensors (the ops.py contract). ``cos_sin [max_pos, rot]``
holds cos in its first half and sin in its second; head dims past ``rot`` pass
through unrotated. One program per token handles all q and k heads.

``qk_norm_rotary_triton`` fuses Qwen3's per-head q/k RMSNorm with the rotary in
one launch over (token, head) rows, many rows per program: three launches and
two [T * H, D] round trips through memory become one read and one write. With
the norms off (NORM, a model without q/k norms) the same launch is the rotary
that also stores K/V into the pages (ops.rotary with ``kv_store``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftserve_kernels import pdl
from ftserve_kernels.config import DEFAULT_KERNELS, KernelConfig


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


# ---------------------------------------------------------------- q/k RMSNorm + rotary, fused


@triton.jit
def _scale_normed(normed, w, ty: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    """The norm's weight on fp32 ``normed`` -> dtype ``ty``: rms_norm_ref's roundings."""
    if ZERO_CENTERED:
        return (normed * (1.0 + w)).to(ty)
    return (w * normed.to(ty).to(tl.float32)).to(ty)


@triton.jit
def _norm_rotate_rows(
    src_ptr, dst_ptr, w_ptr, pos_ptr, cs_ptr, r0, R, eps,
    stride_st, stride_sh, stride_dt, stride_dh, stride_cs,
    kc_ptr, vc_ptr, v_ptr, loc_ptr, stride_cslot, stride_chead, stride_vt, stride_vh,
    NH: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr,
    BLOCK_D: tl.constexpr, STORE: tl.constexpr, NORM: tl.constexpr, ZERO_CENTERED: tl.constexpr,
):
    # STORE (k rows only): the rotated row also goes to the paged K cache at its
    # token's slot, and the row's V (untouched) to the V cache: no KV-store launch.
    # NORM off (a model without q/k norms): the rows are rotated as they are, as
    # rotary_ref rotates them (w_ptr unread).
    # Rows are (token, head) pairs of one tensor: row = token * NH + head.
    rows = r0 + tl.arange(0, BLOCK_R)  # [R]
    rmask = rows < R
    tok = (rows // NH).to(tl.int64)
    head = rows % NH
    src = src_ptr + tok[:, None] * stride_st + head[:, None] * stride_sh  # [R, 1]
    dst = dst_ptr + tok[:, None] * stride_dt + head[:, None] * stride_dh
    j = tl.arange(0, BLOCK_HALF)
    mh = rmask[:, None] & (j[None, :] < HALF)  # [R, half]
    x1 = tl.load(src + j[None, :], mask=mh, other=0.0).to(tl.float32)  # [R, half]
    x2 = tl.load(src + HALF + j[None, :], mask=mh, other=0.0).to(tl.float32)
    ty = dst_ptr.dtype.element_ty
    if 2 * HALF < D:  # partial rotary: the tail is normed but not rotated
        tt = 2 * HALF + tl.arange(0, BLOCK_TAIL)
        mt = rmask[:, None] & (tt[None, :] < D)
        x3 = tl.load(src + tt[None, :], mask=mt, other=0.0).to(tl.float32)
    if NORM:
        ss = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)  # [R]
        if 2 * HALF < D:
            ss += tl.sum(x3 * x3, 1)
        rs = tl.rsqrt(ss / D + eps)[:, None]  # [R, 1]
        # Same roundings as rms_norm_ref then rotary_ref: normed -> dtype, w * normed -> dtype
        # (zero-centered: (1 + w) * normed in fp32 -> dtype).
        w1 = tl.load(w_ptr + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
        y1 = _scale_normed(x1 * rs, w1, ty, ZERO_CENTERED).to(tl.float32)  # [R, half]
        y2 = _scale_normed(x2 * rs, w2, ty, ZERO_CENTERED).to(tl.float32)
    else:
        y1 = x1
        y2 = x2
    pos = tl.load(pos_ptr + tok, mask=rmask, other=0).to(tl.int64)  # [R]
    cs = cs_ptr + pos[:, None] * stride_cs + j[None, :]
    cos = tl.load(cs, mask=mh, other=0.0)  # [R, half] fp32
    sin = tl.load(cs + HALF, mask=mh, other=0.0)
    o1 = (y1 * cos - y2 * sin).to(ty)
    o2 = (y2 * cos + y1 * sin).to(ty)
    tl.store(dst + j[None, :], o1, mask=mh)
    tl.store(dst + HALF + j[None, :], o2, mask=mh)
    if STORE:
        loc = tl.load(loc_ptr + tok, mask=rmask, other=0).to(tl.int64)  # [R] KV slot
        cdst = loc[:, None] * stride_cslot + head[:, None] * stride_chead  # [R, 1]
        cty = kc_ptr.dtype.element_ty
        tl.store(kc_ptr + cdst + j[None, :], o1.to(cty), mask=mh)
        tl.store(kc_ptr + cdst + HALF + j[None, :], o2.to(cty), mask=mh)
        dd = tl.arange(0, BLOCK_D)
        mv = rmask[:, None] & (dd[None, :] < D)
        vv = tl.load(v_ptr + tok[:, None] * stride_vt + head[:, None] * stride_vh + dd[None, :],
                     mask=mv, other=0.0)
        tl.store(vc_ptr + cdst + dd[None, :], vv.to(vc_ptr.dtype.element_ty), mask=mv)
    if 2 * HALF < D:
        if NORM:
            w3 = tl.load(w_ptr + tt, mask=tt < D, other=0.0).to(tl.float32)[None, :]
            o3 = _scale_normed(x3 * rs, w3, ty, ZERO_CENTERED)
        else:
            o3 = x3.to(ty)
        tl.store(dst + tt[None, :], o3, mask=mt)
        if STORE:
            tl.store(kc_ptr + cdst + tt[None, :], o3.to(kc_ptr.dtype.element_ty), mask=mt)


@triton.jit
def _qk_norm_rotary_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, qw_ptr, kw_ptr, pos_ptr, cs_ptr, T, eps,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
    kc_ptr, vc_ptr, v_ptr, loc_ptr, stride_cslot, stride_chead, stride_vt, stride_vh,
    HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr,
    BLOCK_D: tl.constexpr, STORE: tl.constexpr, PDL: tl.constexpr, NORM: tl.constexpr = True,
    ZERO_CENTERED: tl.constexpr = False,
):
    # Programs [0, cdiv(T*HQ, R)) take q rows, the rest k rows: one launch for both.
    pdl.enter(PDL)
    pid = tl.program_id(0)
    q_programs = tl.cdiv(T * HQ, BLOCK_R)
    if pid < q_programs:
        _norm_rotate_rows(q_ptr, qo_ptr, qw_ptr, pos_ptr, cs_ptr, pid * BLOCK_R, T * HQ, eps,
                          stride_qt, stride_qh, stride_qot, stride_qoh, stride_cs,
                          kc_ptr, vc_ptr, v_ptr, loc_ptr, stride_cslot, stride_chead,
                          stride_vt, stride_vh,
                          HQ, D, HALF, BLOCK_R, BLOCK_HALF, BLOCK_TAIL, BLOCK_D, False, NORM, ZERO_CENTERED)
    else:
        _norm_rotate_rows(k_ptr, ko_ptr, kw_ptr, pos_ptr, cs_ptr, (pid - q_programs) * BLOCK_R,
                          T * HK, eps, stride_kt, stride_kh, stride_kot, stride_koh, stride_cs,
                          kc_ptr, vc_ptr, v_ptr, loc_ptr, stride_cslot, stride_chead,
                          stride_vt, stride_vh,
                          HK, D, HALF, BLOCK_R, BLOCK_HALF, BLOCK_TAIL, BLOCK_D, STORE, NORM, ZERO_CENTERED)


def qk_norm_rotary_triton(
    q: torch.Tensor, k: torch.Tensor, q_w: torch.Tensor | None, k_w: torch.Tensor | None, eps: float,
    positions: torch.Tensor, cos_sin: torch.Tensor,
    kv_store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    zero_centered: bool = False, kernels: KernelConfig = DEFAULT_KERNELS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k (Qwen3's q_norm / k_norm), then neox rotary, in one
    launch. q [T, Hq, D], k [T, Hkv, D] (views into the qkv projection are fine),
    q_w/k_w [D] -> new contiguous (q, k). Twin: norm_rope.qk_norm_rotary_ref.
    q_w = k_w = None: no norms (a model without them), the rotary alone (and
    with ``kv_store`` the store: ops.rotary's one launch).

    ``kv_store`` = (k_cache [slots, Hkv, D], v_cache, v [T, Hkv, D], out_cache_loc [T]):
    the same launch also stores the rotated k and v at each token's slot (what the
    attention backend's KV store would do; caches in a float dtype, not fp8)."""
    t, hq, d = q.shape
    hk = k.shape[1]
    half = cos_sin.shape[-1] // 2
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin.stride(-1) == 1
    norm = q_w is not None
    if norm:
        assert k_w is not None and q_w.is_contiguous() and k_w.is_contiguous()
    else:
        assert k_w is None
        q_w = k_w = q  # unread
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, Hq, D]
    ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)  # [T, Hkv, D]
    if kv_store is not None:
        kc, vc, v, loc = kv_store
        assert kc.dtype.is_floating_point and kc.element_size() > 1, "fp8 caches: store_kv"
        assert kc.stride() == vc.stride() and kc.stride(-1) == 1 and v.stride(-1) == 1
    else:
        kc, vc, v, loc = ko, ko, k, positions  # unread
    if t:
        block_half = triton.next_power_of_2(half)
        block_tail = triton.next_power_of_2(max(1, d - 2 * half))
        # [R, half] tiles of 4k elements, two of them; a partial rotary's tail tile
        # [R, D - rot] no larger (Qwen3-Next: 192 of 256 unrotated; more spills)
        block_r = max(16, 4096 // max(block_half, block_tail))
        grid = (triton.cdiv(t * hq, block_r) + triton.cdiv(t * hk, block_r),)
        on = pdl.active(q, kernels)
        _qk_norm_rotary_kernel[grid](
            q, k, qo, ko, q_w, k_w, positions, cos_sin, t, eps,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1), cos_sin.stride(0),
            kc, vc, v, loc, kc.stride(0), kc.stride(1), v.stride(0), v.stride(1),
            HQ=hq, HK=hk, D=d, HALF=half, BLOCK_R=block_r, BLOCK_HALF=block_half,
            BLOCK_TAIL=block_tail, BLOCK_D=triton.next_power_of_2(d), STORE=kv_store is not None, NORM=norm,
            num_warps=8, PDL=on, ZERO_CENTERED=zero_centered, **pdl.launch(on),
        )
    return qo, ko
