"""Gated DeltaNet across a speculative verify step, in Triton: conv_verify,
gated_delta_verify, conv_commit and gated_delta_commit of
ftserve_kernels/gated_delta.py (the torch twins, and the contract: a verify
step leaves every slot as it was; the commit redoes each sequence's kept
tokens from the step's log), with the same signatures; gated_delta_triton
re-exports them.

    gated_delta_verify   grid (B, Hv, dv / BLOCK_V): the decode kernel's update, token by
                         token over the sequence's few tokens, S in registers; the outputs
                         are stored, S never is
    gated_delta_commit   grid (B, layers x Hv, dv / BLOCK_V): S from the slot, the same
                         update over the first kept[b] logged tokens, S stored back
    conv_verify          the prefill conv launch alone (short_conv_triton), without the
                         launch that moves the windows
    conv_commit          grid (B, layers, C / BLOCK_C): the window after kept[b] tokens,
                         from the slot's window and the logged inputs

The update is the decode kernel's arithmetic (fp32 state, q and k normalized
in fp32), so a kept token leaves the state a plain decode step would. Every
loop bound (a sequence's length, its kept count) is read on the device:
no host data beyond the grid, nothing that syncs; in a captured graph
(``seq_bounds=None``) the grid comes from the slot rows and ``static_len``
(short_conv_triton.seq_grid).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ftserve_kernels.gated_delta import L2_EPS
from ftserve_kernels.short_conv_triton import (
    CONV_BLOCK_C,
    check_slot_state,
    conv_prefill,
    device_bounds,
    seq_grid,
    slot_flag,
)

VERIFY_BLOCK_V = 32  # columns of S per program: Qwen3-Next's 32 heads x 4 blocks = 128 programs per sequence


@triton.jit
def _gdn_tokens_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, s_ptr, slot_ptr, has_ptr,
                       lo_ptr, kept_ptr,
                       stride_kl, stride_kt, stride_vl, stride_vt, stride_gl, stride_gt, stride_bl, stride_bt,
                       stride_qt, stride_ot, stride_sl, stride_ss, scale, eps,
                       HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, VERIFY: tl.constexpr):
    """Sequence b's tokens through one value head's state column block. VERIFY:
    all its tokens, lo_ptr[b] .. lo_ptr[b + 1] - 1 (lo_ptr: cu_seqlens), q read,
    o stored, S not. Else (commit): its first kept_ptr[b] tokens from lo_ptr[b],
    S stored, in layer program_id(1) // HV of the log and the pool."""
    b = tl.program_id(0)
    lh = tl.program_id(1)
    layer = (lh // HV).to(tl.int64)
    h = lh % HV
    kh = h // (HV // HK)
    ok = tl.arange(0, BLOCK_K)
    ov = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mk = ok < DK
    mv = ov < DV
    ms = mk[:, None] & mv[None, :]
    lo = tl.load(lo_ptr + b).to(tl.int64)
    if VERIFY:
        n = (tl.load(lo_ptr + b + 1) - tl.load(lo_ptr + b)).to(tl.int32)
    else:
        n = tl.load(kept_ptr + b).to(tl.int32)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    has = slot_flag(has_ptr + b, ov)
    sp = s_ptr + layer * stride_sl + slot * stride_ss + h * (DK * DV) + ok[:, None] * DV + ov[None, :]
    s = tl.load(sp, mask=ms & has[None, :], other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_V]
    k_base = k_ptr + layer * stride_kl + kh * DK
    v_base = v_ptr + layer * stride_vl + h * DV
    g_base = g_ptr + layer * stride_gl + h
    b_base = beta_ptr + layer * stride_bl + h
    for j in range(0, n):
        t = lo + j
        k = tl.load(k_base + t * stride_kt + ok, mask=mk, other=0.0).to(tl.float32)
        k = k * tl.rsqrt(tl.sum(k * k) + eps)
        v = tl.load(v_base + t * stride_vt + ov, mask=mv, other=0.0).to(tl.float32)
        g = tl.load(g_base + t * stride_gt).to(tl.float32)
        beta = tl.load(b_base + t * stride_bt).to(tl.float32)
        s = s * tl.exp(g)
        u = (v - tl.sum(k[:, None] * s, 0)) * beta  # what S already says for k, corrected
        s = s + k[:, None] * u[None, :]
        if VERIFY:
            q = tl.load(q_ptr + t * stride_qt + kh * DK + ok, mask=mk, other=0.0).to(tl.float32)
            q = q * tl.rsqrt(tl.sum(q * q) + eps) * scale
            o = tl.sum(q[:, None] * s, 0)
            tl.store(o_ptr + t * stride_ot + h * DV + ov, o.to(o_ptr.dtype.element_ty), mask=mv)
    if not VERIFY:
        tl.store(sp, s.to(s_ptr.dtype.element_ty), mask=ms)


@triton.jit
def _conv_commit_kernel(x_ptr, cs_ptr, slot_ptr, has_ptr, lo_ptr, kept_ptr,
                        stride_xl, stride_xt, stride_csl, stride_cs, C,
                        W: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr):
    """The last W window positions of [old window | the sequence's first kept
    tokens] of layer program_id(1) become its window (short_conv_triton's state
    launch, with a layer axis and the kept count for the length)."""
    n = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    lo = tl.load(lo_ptr + n).to(tl.int64)
    kept = tl.load(kept_ptr + n).to(tl.int64)
    oc = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = oc < C
    e = tl.arange(0, BLOCK_W)
    me = e < W
    slot = tl.load(slot_ptr + n).to(tl.int64)
    has = slot_flag(has_ptr + n, oc)
    pos = kept + e  # window position of new entry e: [0, W) the old window, W + j token j
    in_x = pos >= W
    m = mc[:, None] & me[None, :]
    x_layer = x_ptr + layer * stride_xl
    xv = tl.load(x_layer + (lo + pos - W)[None, :] * stride_xt + oc[:, None], mask=m & in_x[None, :], other=0.0)
    st_ptr = cs_ptr + layer * stride_csl + slot * stride_cs + oc[:, None] * W
    sv = tl.load(st_ptr + pos[None, :], mask=m & (~in_x)[None, :] & has[:, None], other=0.0)
    val = tl.where(in_x[None, :], xv, sv.to(xv.dtype)).to(cs_ptr.dtype.element_ty)
    tl.debug_barrier()  # one kept token moves old entries within the same row
    tl.store(st_ptr + e[None, :], val, mask=m)


def block(n: int) -> int:
    """A tile's side for n (a head's dk or dv): a power of two, at least 16 (tl.dot's)."""
    return max(16, triton.next_power_of_2(n))


def decode_warps(block_k: int, block_v: int) -> int:
    """Warps of a token-by-token update over a [block_k, block_v] slice of S
    (the decode kernel's, and the verify and commit launches')."""
    return 4 if block_k * block_v >= 4096 else 2


def conv_verify(x: torch.Tensor, w: torch.Tensor, conv_states: torch.Tensor, slots: torch.Tensor,
                has_state: torch.Tensor, seq_bounds: Sequence[int] | None,
                cu_seqlens: torch.Tensor | None = None, static_len: int | None = None) -> torch.Tensor:
    return conv_prefill(x, w, conv_states, slots, has_state, seq_bounds, cu_seqlens, static_len,
                        move_windows=False)


def rule_shapes(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None, beta: torch.Tensor | None,
                 states: torch.Tensor) -> tuple[int, int, int, int]:
    """(Hk, Hv, dk, dv), the layouts checked (g, beta None: a launch that reads other gates)."""
    hk, dk = k.shape[-2:]
    hv, dv = v.shape[-2:]
    assert hv % hk == 0 and k.stride(-1) == v.stride(-1) == 1
    assert k.stride(-2) == dk and v.stride(-2) == dv, "heads must be packed in a row"
    if g is not None and beta is not None:
        assert g.stride(-1) == beta.stride(-1) == 1 and g.shape == beta.shape == v.shape[:-1]
    check_slot_state(states, (hv, dk, dv))
    return hk, hv, dk, dv


def gated_delta_verify(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                       has_state: torch.Tensor, seq_bounds: Sequence[int] | None,
                       cu_seqlens: torch.Tensor | None = None, block_v: int | None = None,
                       static_len: int | None = None) -> torch.Tensor:
    hk, hv, dk, dv = rule_shapes(k, v, g, beta, states)
    assert q.shape == k.shape and q.stride(-1) == 1 and q.stride(-2) == dk
    nseq, _ = seq_grid(seq_bounds, slots, static_len)
    o = torch.empty((q.shape[0], hv, dv), dtype=v.dtype, device=v.device)
    if nseq == 0:
        return o
    cu = device_bounds(seq_bounds, cu_seqlens, q.device)
    bk = block(dk)
    bv = min(block_v or VERIFY_BLOCK_V, block(dv))
    _gdn_tokens_kernel[(nseq, hv, triton.cdiv(dv, bv))](
        q, k, v, g, beta, o, states, slots, has_state, cu, cu,
        0, k.stride(0), 0, v.stride(0), 0, g.stride(0), 0, beta.stride(0),
        q.stride(0), o.stride(0), 0, states.stride(0), dk**-0.5, L2_EPS,
        HK=hk, HV=hv, DK=dk, DV=dv, BLOCK_K=bk, BLOCK_V=bv, VERIFY=True, num_warps=decode_warps(bk, bv))
    return o


def conv_commit(x: torch.Tensor, conv_states: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor,
                starts: torch.Tensor, kept: torch.Tensor, max_kept: int) -> None:
    n_layers, _, c = x.shape
    width = conv_states.shape[-1]
    assert conv_states.shape[0] == n_layers and conv_states.shape[2:] == (c, width)
    assert x.stride(-1) == 1 and conv_states[0].is_contiguous()
    nseq = slots.shape[0]
    if nseq == 0:
        return
    block_c = min(triton.next_power_of_2(c), CONV_BLOCK_C)
    _conv_commit_kernel[(nseq, n_layers, triton.cdiv(c, block_c))](
        x, conv_states, slots, has_state, starts, kept, x.stride(0), x.stride(1),
        conv_states.stride(0), conv_states.stride(1), c,
        W=width, BLOCK_W=triton.next_power_of_2(width), BLOCK_C=block_c)


def gated_delta_commit(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       states: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor,
                       starts: torch.Tensor, kept: torch.Tensor, max_kept: int,
                       block_v: int | None = None) -> None:
    n_layers = k.shape[0]
    assert states.shape[0] == n_layers
    hk, hv, dk, dv = rule_shapes(k[0], v[0], g[0], beta[0], states[0])
    nseq = slots.shape[0]
    if nseq == 0:
        return
    bk = block(dk)
    bv = min(block_v or VERIFY_BLOCK_V, block(dv))
    _gdn_tokens_kernel[(nseq, n_layers * hv, triton.cdiv(dv, bv))](
        k, k, v, g, beta, k, states, slots, has_state, starts, kept,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1),
        beta.stride(0), beta.stride(1), 0, 0, states.stride(0), states.stride(1), 1.0, L2_EPS,
        HK=hk, HV=hv, DK=dk, DV=dv, BLOCK_K=bk, BLOCK_V=bv, VERIFY=False, num_warps=decode_warps(bk, bv))
