"""Split-K decode attention over the paged KV cache (see attention_triton's
module docstring for the split layout and the CUDA-graph contract).

Twin: ``paged_attention.paged_attention_ref`` with one query per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ftserve_kernels import pdl
from ftserve_kernels.attention_common import (
    LOG2E,
    AttnKernelConfig,
    interpreting,
    mma,
    mma_acc,
    scale_args,
)
from ftserve_kernels.config import DEFAULT_KERNELS, KernelConfig


@triton.jit
def _norm_rope_halves(x1, x2, w_ptr, j, cos, sin, eps, D: tl.constexpr, HALF: tl.constexpr, ty,
                      NORM: tl.constexpr):
    """Per-row RMSNorm over both halves [R, HALF] (NORM), then neox rotary: the
    roundings of rope_triton._norm_rotate_rows (normed -> ty, w * normed -> ty,
    out -> ty); without NORM the rotary alone, as rotary_ref rounds it."""
    if NORM:
        rs = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / D + eps)[:, None]  # [R, 1]
        w1 = tl.load(w_ptr + j).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + j).to(tl.float32)[None, :]
        x1 = (w1 * (x1 * rs).to(ty).to(tl.float32)).to(ty).to(tl.float32)
        x2 = (w2 * (x2 * rs).to(ty).to(tl.float32)).to(ty).to(tl.float32)
    return (x1 * cos - x2 * sin).to(ty), (x2 * cos + x1 * sin).to(ty)


@triton.jit
def _decode_split_kernel(
    q_ptr, kc_ptr, vc_ptr, pt_ptr, seq_lens_ptr, mid_o_ptr, mid_lse_ptr,
    ks_ptr, vs_ptr,
    stride_qt, stride_qh, stride_cs, stride_ch, stride_pt, stride_ss, max_pages,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
    scale_log2,
    k_ptr, v_ptr, qw_ptr, kw_ptr, pos_ptr, cs_ptr, loc_ptr, eps,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cos,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, UPCAST: tl.constexpr,
    FP8: tl.constexpr, PDL: tl.constexpr,
    QK: tl.constexpr, NORM: tl.constexpr = True,
    first_ptr=None, BLOCK_J: tl.constexpr = 1,
):
    # QK (DecodeQK): q and the new token's k arrive raw (before the per-head
    # norms, NORM, and the rotary) and this kernel normalizes and rotates them
    # itself; the split holding the new token (position kv_len - 1) stores
    # its K/V into the pages and adds it from registers after its loop, so no
    # program reads that slot back. Halves [*, D/2] throughout (full rotary).
    # BLOCK_J > 1 (a verify step: query b is row b - first[b] of its sequence's
    # rows first[b]..b, consecutive positions): the keys of the earlier rows are
    # this step's too, and another program stores them, so this one never reads
    # them from the pages: it rotates all of its sequence's new keys up to its
    # own (at most BLOCK_J) from k itself, adds them after the loop, and stores
    # only its own.
    #
    # Tiles of BLOCK_N cached tokens are dealt to the splits in turn: split s
    # takes tiles s, s + NUM_SPLITS, ..., so its first tile does not depend on
    # the sequence length and its page entries load alongside it, and the new
    # token goes to split n_tiles % NUM_SPLITS, one with a tile fewer than the
    # splits before it (at short contexts an otherwise empty one, which then
    # runs beside the tile splits instead of after its own tile).
    pdl.enter(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    pos0 = s * BLOCK_N + tl.arange(0, BLOCK_N)
    page0 = tl.load(pt_ptr + b.to(tl.int64) * stride_pt + pos0 // PAGE_SIZE,
                    mask=pos0 // PAGE_SIZE < max_pages, other=0)
    kv_len = tl.load(seq_lens_ptr + b)
    start = s * BLOCK_N
    end = kv_len
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    if QK:
        if BLOCK_J > 1:
            tok0 = tl.load(first_ptr + b).to(tl.int32)  # the row of the sequence's first new token
            n_new = b - tok0 + 1  # this step's keys up to this query's own
        else:
            n_new = 1
        new0 = kv_len - n_new  # the first new key's position: the pages hold those before it
        # the split after the last tile's, in turn
        new_here = (s == tl.cdiv(new0, BLOCK_N) % NUM_SPLITS) & (kv_len > 0)
        cached_end = tl.minimum(end, new0)  # the new tokens come after the loop
    else:
        new_here = False
        cached_end = end
    HALF: tl.constexpr = D // 2
    hj = tl.arange(0, HALF)
    if QK:
        # q's rows and the position load beside the sequence length, not after
        # the empty-split exit below that waits for it: two memory round trips
        # become one.
        q_rows = q_ptr + b.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
        qa = tl.load(q_rows + hj[None, :], mask=gmask[:, None], other=0.0)
        qb = tl.load(q_rows + HALF + hj[None, :], mask=gmask[:, None], other=0.0)
        p_new = tl.load(pos_ptr + b).to(tl.int64)
    # A split with no cached tile that does not hold the new token (most of
    # them at short contexts) stores its -inf lse and ends, before any of q's
    # math (only q's 2 KB of loads, issued above, go unused).
    if (start >= cached_end) & (not new_here):
        tl.store(mid_lse_ptr + b * stride_mlb + heads * stride_mlh + s, float("-inf"), mask=gmask)
        return
    dmask = d < D
    if QK:
        ty = q_ptr.dtype.element_ty
        cos = tl.load(cs_ptr + p_new * stride_cos + hj)[None, :]  # [1, HALF] fp32
        sin = tl.load(cs_ptr + p_new * stride_cos + HALF + hj)[None, :]
        q1, q2 = _norm_rope_halves(qa.to(tl.float32), qb.to(tl.float32),
                                   qw_ptr, hj, cos, sin, eps, D, HALF, ty, NORM)  # [G, HALF] each
        end = cached_end
        q = q1  # unused (the loop takes the halves)
    else:
        q = tl.load(
            q_ptr + b.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
            mask=gmask[:, None] & dmask[None, :], other=0.0,
        )  # [G, D]
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    pt_row = pt_ptr + b.to(tl.int64) * stride_pt
    head_off = kvh * stride_ch
    page_next = page0
    for n0 in range(start, end, NUM_SPLITS * BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        nmask = pos < end
        # This tile's page entries came in the iteration before (the first
        # tile's with the sequence length); the next tile's load now, under
        # this tile's K/V loads and math.
        page = page_next
        pos_ahead = pos + NUM_SPLITS * BLOCK_N
        page_next = tl.load(pt_row + pos_ahead // PAGE_SIZE, mask=pos_ahead < end, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE  # [N]
        if QK:
            k_rows = kc_ptr + slot[None, :] * stride_cs + head_off
            kt1 = tl.load(k_rows + hj[:, None], mask=nmask[None, :], other=0.0)  # [HALF, N]
            kt2 = tl.load(k_rows + HALF + hj[:, None], mask=nmask[None, :], other=0.0)
            qk = mma(q1, kt1, UPCAST) + mma(q2, kt2, UPCAST)  # [G, N] unscaled scores
        else:
            kt = tl.load(
                kc_ptr + slot[None, :] * stride_cs + head_off + d[:, None],
                mask=nmask[None, :] & dmask[:, None], other=0.0,
            )  # [D, N]
            if FP8:
                # e4m3 codes -> q's dtype is exact; a key's scale multiplies its whole score column.
                ksc = tl.load(ks_ptr + slot * stride_ss + kvh, mask=nmask, other=0.0)  # [N]
                qk = mma(q, kt.to(q.dtype), UPCAST) * ksc[None, :]  # [G, N]
            else:
                qk = mma(q, kt, UPCAST)  # [G, N] unscaled scores
        qk = tl.where(nmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)  # log2 domain
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk * scale_log2 - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vv = tl.load(
            vc_ptr + slot[:, None] * stride_cs + head_off + d[None, :],
            mask=nmask[:, None] & dmask[None, :], other=0.0,
        )  # [N, D]
        if FP8:
            # Scale V rows (not p): values keep their own magnitude, safe in fp16 too.
            vsc = tl.load(vs_ptr + slot * stride_ss + kvh, mask=nmask, other=0.0)  # [N]
            vd = (vv.to(tl.float32) * vsc[:, None]).to(q.dtype)  # [N, D]
            acc = mma_acc(p.to(q.dtype), vd, acc * alpha[:, None], UPCAST)
        else:
            acc = mma_acc(p.to(vv.dtype), vv, acc * alpha[:, None], UPCAST)
        m_i = m_new
    if QK and BLOCK_J > 1:
        if new_here:
            # The step's keys up to this query's, one at a time with the decode
            # tail's [1, HALF] math (normalized and rotated at their positions,
            # rounded as the pages hold them); this query's own K/V stored. Keys
            # past its own (j >= n_new) score -inf and add nothing.
            dst = tl.load(loc_ptr + b).to(tl.int64) * stride_cs + head_off
            cty = kc_ptr.dtype.element_ty
            vty = vc_ptr.dtype.element_ty
            for j in tl.static_range(BLOCK_J):
                # j's masks as vectors: the interpreter takes no scalar mask
                hlive = hj * 0 + j < n_new  # [HALF]
                dlive = d * 0 + j < n_new  # [BLOCK_D]
                trow = (tok0 + j).to(tl.int64)
                k_row = k_ptr + trow * stride_kt + kvh * stride_kh
                pj = (new0 + j).to(tl.int64)
                cj = tl.load(cs_ptr + pj * stride_cos + hj, mask=hlive, other=0.0)[None, :]  # [1, HALF]
                sj = tl.load(cs_ptr + pj * stride_cos + HALF + hj, mask=hlive, other=0.0)[None, :]
                k1, k2 = _norm_rope_halves(
                    tl.load(k_row + hj, mask=hlive, other=0.0).to(tl.float32)[None, :],
                    tl.load(k_row + HALF + hj, mask=hlive, other=0.0).to(tl.float32)[None, :],
                    kw_ptr, hj, cj, sj, eps, D, HALF, ty, NORM)  # [1, HALF] each
                v_new = tl.load(v_ptr + trow * stride_vt + kvh * stride_vh + d,
                                mask=dmask & dlive, other=0.0)  # [D]
                # this query's own token, stored by this program
                hown = (hj * 0 + j == n_new - 1)[None, :]
                tl.store(kc_ptr + dst + hj[None, :], k1.to(cty), mask=hown)
                tl.store(kc_ptr + dst + HALF + hj[None, :], k2.to(cty), mask=hown)
                tl.store(vc_ptr + dst + d, v_new.to(vty), mask=dmask & (d * 0 + j == n_new - 1))
                kf1 = k1.to(cty).to(tl.float32)
                kf2 = k2.to(cty).to(tl.float32)
                sc = (tl.sum(q1.to(tl.float32) * kf1, 1) + tl.sum(q2.to(tl.float32) * kf2, 1)) * scale_log2
                sc = tl.where(g * 0 + j < n_new, sc, float("-inf"))  # [G]
                m_new = tl.maximum(m_i, sc)
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(sc - m_new)
                l_i = l_i * alpha + p
                vf = v_new.to(vty).to(tl.float32)
                acc = acc * alpha[:, None] + p.to(ty).to(tl.float32)[:, None] * vf[None, :]
                m_i = m_new
    elif QK:
        if new_here:
            # The new token: normalize and rotate its k, store K/V into its slot
            # (what the backend's KV store would do), and add it to this split.
            k_row = k_ptr + b.to(tl.int64) * stride_kt + kvh * stride_kh
            k1, k2 = _norm_rope_halves(
                tl.load(k_row + hj[None, :]).to(tl.float32),
                tl.load(k_row + HALF + hj[None, :]).to(tl.float32),
                kw_ptr, hj, cos, sin, eps, D, HALF, ty, NORM)  # [1, HALF] each
            v_new = tl.load(v_ptr + b.to(tl.int64) * stride_vt + kvh * stride_vh + d,
                            mask=dmask, other=0.0)  # [D]
            dst = tl.load(loc_ptr + b).to(tl.int64) * stride_cs + head_off
            cty = kc_ptr.dtype.element_ty
            tl.store(kc_ptr + dst + hj[None, :], k1.to(cty))
            tl.store(kc_ptr + dst + HALF + hj[None, :], k2.to(cty))
            tl.store(vc_ptr + dst + d, v_new.to(vc_ptr.dtype.element_ty), mask=dmask)
            kf1 = k1.to(cty).to(tl.float32)
            kf2 = k2.to(cty).to(tl.float32)
            sc = (tl.sum(q1.to(tl.float32) * kf1, 1) + tl.sum(q2.to(tl.float32) * kf2, 1)) * scale_log2
            m_new = tl.maximum(m_i, sc)
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(sc - m_new)
            l_i = l_i * alpha + p
            vf = v_new.to(vc_ptr.dtype.element_ty).to(tl.float32)
            acc = acc * alpha[:, None] + p.to(ty).to(tl.float32)[:, None] * vf[None, :]
            m_i = m_new
    has = l_i > 0.0  # false only for an empty split (a row max contributes p = 1)
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    # An empty split (most of them at short contexts) stores only its -inf lse:
    # the reduce kernel never reads its partial output.
    tl.store(
        mid_o_ptr + b * stride_mob + heads[:, None] * stride_moh + s * stride_mos + d[None, :],
        out, mask=gmask[:, None] & dmask[None, :] & has[:, None],
    )
    tl.store(mid_lse_ptr + b * stride_mlb + heads * stride_mlh + s, lse, mask=gmask)


@triton.jit
def _decode_reduce_kernel(
    mid_o_ptr, mid_lse_ptr, o_ptr,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ot, stride_oh,
    g_ptr, stride_gt, stride_gh,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr, GATE: tl.constexpr = False,
):
    # Program (b, h, c) combines columns [c * BLOCK_D, (c + 1) * BLOCK_D) of head
    # h (BLOCK_D < D: more, smaller programs; each one weighs the splits itself).
    pdl.enter(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    smask = s < NUM_SPLITS
    lse = tl.load(mid_lse_ptr + b * stride_mlb + h * stride_mlh + s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # empty sequence (graph padding): output 0
    w = tl.exp2(lse - m)  # [S]
    tot = tl.sum(w, 0)
    o = tl.load(
        mid_o_ptr + b * stride_mob + h * stride_moh + s[:, None] * stride_mos + d[None, :],
        mask=(smask & (lse > float("-inf")))[:, None] & (d[None, :] < D), other=0.0,
    )  # [S, D]; empty splits' were never stored (and are not read: no traffic)
    out = tl.sum(o * w[:, None], 0) / tl.where(tot > 0.0, tot, 1.0)
    ty = o_ptr.dtype.element_ty
    if GATE:  # out * sigmoid(gate), each rounded to the dtype as the torch ops would
        g = tl.load(g_ptr + b * stride_gt + h * stride_gh + d, mask=d < D, other=0.0).to(tl.float32)
        out = out.to(ty).to(tl.float32) * tl.sigmoid(g).to(ty).to(tl.float32)
    tl.store(o_ptr + b * stride_ot + h * stride_oh + d, out.to(ty), mask=d < D)


@dataclass(frozen=True)
class DecodeQK:
    """The raw inputs of a decode step's per-head q/k norms and rotary, for the
    split kernel to apply itself (float pages, full rotary): q is passed
    raw as decode_attention_triton's ``q``. Norm weights None: a model without
    q/k norms, the rotary and the KV store alone."""

    k: torch.Tensor  # [B, Hkv, D] raw (a view of the qkv projection is fine)
    v: torch.Tensor  # [B, Hkv, D]
    q_w: torch.Tensor | None  # [D] q_norm weight (Qwen3)
    k_w: torch.Tensor | None  # [D] k_norm weight
    eps: float
    positions: torch.Tensor  # [B] int64
    cos_sin: torch.Tensor  # [max_pos, D] fp32, cos | sin halves
    out_cache_loc: torch.Tensor  # [B] int64, the new token's KV slot
    # A verify step's queries (several new tokens a sequence, one query each):
    # [B] int64, the row of each query's sequence's first new token, its rows
    # consecutive up to the query's own; ``rows_bound`` bounds a sequence's rows
    # (<= MAX_VERIFY_ROWS). None: one new token a sequence (decode).
    first_rows: torch.Tensor | None = None
    rows_bound: int = 1


# The most new tokens of one sequence the fold takes in a verify step: each
# query's program adds that many keys from registers ([G, J, D/2] products).
MAX_VERIFY_ROWS = 8


def decode_attention_triton(
    q: torch.Tensor,  # [B, Hq, D], one query per sequence
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # [B, max_pages] int32
    seq_lens: torch.Tensor,  # [B] int32
    page_size: int,
    scale: float,
    num_splits: int,
    cfg: AttnKernelConfig | None = None,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,  # [slots, Hkv] fp32, fp8 caches only
    v_scale: torch.Tensor | None = None,
    qk: DecodeQK | None = None,
    kernels: KernelConfig = DEFAULT_KERNELS,
    out_gate: torch.Tensor | None = None,  # [B, Hq, D]
) -> torch.Tensor:
    """Split-K decode: the split kernel, then the reduce kernel that combines
    the splits (and with ``out_gate`` multiplies by sigmoid(out_gate): Qwen3-Next's
    gated attention; twin: paged_attention.gate_output). fp8 caches (float8_e4m3fn codes) need ``k_scale`` /
    ``v_scale``; tiles are dequantized in registers. With ``qk``, ``q`` is raw and the kernel applies the q/k norms
    (where ``qk`` has them) and the rotary and stores the new K/V itself (twin:
    norm_rope.qk_norm_rotary_ref with its kv_store, then this function without ``qk``),
    also for a verify step's queries (``qk.first_rows``: each query attends to its
    sequence's new keys up to its own, rotated from ``qk.k``)."""
    bsz, hq, d = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    cfg = cfg or AttnKernelConfig.for_device(q.device, d)
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    assert page_table.stride(-1) == 1
    out = torch.empty_like(q) if out is None else out
    block_d = triton.next_power_of_2(d)
    mid_o = torch.empty((bsz, hq, num_splits, block_d), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((bsz, hq, num_splits), dtype=torch.float32, device=q.device)
    ks, vs, stride_ss, fp8 = scale_args(k_cache, k_scale, v_scale)
    verify: dict[str, object] = {}
    if qk is not None and qk.first_rows is not None:
        assert 1 <= qk.rows_bound <= MAX_VERIFY_ROWS and qk.first_rows.shape == (bsz,)
        verify = dict(first_ptr=qk.first_rows, BLOCK_J=max(2, triton.next_power_of_2(qk.rows_bound)))
    if qk is not None:
        assert not fp8 and qk.cos_sin.shape[-1] == d and d % 2 == 0 and triton.next_power_of_2(d) == d
        assert qk.k.stride(-1) == 1 and qk.v.stride(-1) == 1 and qk.cos_sin.stride(-1) == 1
        assert (qk.q_w is None) == (qk.k_w is None)
        q_w = qk.q_w if qk.q_w is not None else q  # unread without norms
        k_w = qk.k_w if qk.k_w is not None else q
        qk_args = (qk.k, qk.v, q_w, k_w, qk.positions, qk.cos_sin, qk.out_cache_loc, qk.eps,
                   qk.k.stride(0), qk.k.stride(1), qk.v.stride(0), qk.v.stride(1), qk.cos_sin.stride(0))
    else:
        qk_args = (q, q, q, q, seq_lens, q, seq_lens, 0.0, 0, 0, 0, 0, 0)  # unread
    on = pdl.active(q, kernels)
    _decode_split_kernel[(bsz, hkv, num_splits)](
        q, k_cache, v_cache, page_table, seq_lens, mid_o, mid_lse,
        ks, vs,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), page_table.stride(0),
        stride_ss, page_table.shape[1],
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        scale * LOG2E,
        *qk_args,
        PAGE_SIZE=page_size, GROUP=group, D=d, BLOCK_D=block_d,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=cfg.decode_block_n,
        NUM_SPLITS=num_splits, UPCAST=interpreting(), FP8=fp8, QK=qk is not None,
        NORM=qk is not None and qk.q_w is not None,
        num_warps=cfg.decode_warps, num_stages=cfg.decode_stages, PDL=on, **verify, **pdl.launch(on),
    )
    # Columns a reduce program combines: the whole head, or decode_reduce_block_d.
    block_r = min(block_d, triton.next_power_of_2(cfg.decode_reduce_block_d)) if cfg.decode_reduce_block_d else block_d
    gate = out_gate if out_gate is not None else out  # unread without a gate
    assert gate.shape == out.shape and gate.stride(-1) == 1
    _decode_reduce_kernel[(bsz, hq, triton.cdiv(d, block_r))](
        mid_o, mid_lse, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1), gate, gate.stride(0), gate.stride(1),
        NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits), D=d, BLOCK_D=block_r,
        num_warps=4, PDL=on, GATE=out_gate is not None, **pdl.launch(on),
    )
    return out
