"""The attention phase of the one-launch decode layer (decode_layer_triton.py):
one (kv head, split) item of split-K attention over the paged cache, with the
step's q/k norm + rotary and K/V store folded in, and the split combine done by
the last split of each kv head to finish."""

from __future__ import annotations

import triton
import triton.language as tl

from ftserve_kernels.attention_common import mma, mma_acc
from ftserve_kernels.decode_layer_parts import _norm_rope


@triton.jit
def _attn_item(
    it, qkv_s, qn_ptr, kn_ptr, pos_ptr, cs_ptr, loc_ptr, pt_ptr, seq_lens_ptr, kc_ptr, vc_ptr,
    mid_o, mid_lse, attn_s, sync_ptr, eps, scale_log2, stride_cs, stride_slot, stride_head,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, S: tl.constexpr, PAGE_SIZE: tl.constexpr,
    QK_NORM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_GQ: tl.constexpr, UPCAST: tl.constexpr,
):
    GROUP: tl.constexpr = HQ // HKV
    HALF: tl.constexpr = D // 2
    dt = qkv_s.dtype.element_ty
    kvh = it // S
    s = it % S
    kv_len = tl.load(seq_lens_ptr)
    cur = kv_len - 1  # this step's token
    per_split = tl.cdiv(tl.cdiv(kv_len, S), BLOCK_N) * BLOCK_N
    start = s * per_split
    end = tl.minimum(start + per_split, kv_len)
    j = tl.arange(0, HALF)
    d = tl.arange(0, D)
    g = tl.arange(0, BLOCK_G)
    gmask = g < GROUP
    pos = tl.load(pos_ptr).to(tl.int64)
    cos = tl.load(cs_ptr + pos * stride_cs + j)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + j)
    q1, q2 = _norm_rope(qkv_s + kvh * GROUP * D, qn_ptr, cos, sin, eps, GROUP, D, HALF, BLOCK_G,
                        QK_NORM, dt)  # [G, HALF] each
    k1, k2 = _norm_rope(qkv_s + (HQ + kvh) * D, kn_ptr, cos, sin, eps, 1, D, HALF, 2,
                        QK_NORM, dt)  # [2, HALF], row 0 real
    cty = kc_ptr.dtype.element_ty
    k1c = tl.sum(k1.to(tl.float32), 0).to(cty)  # [HALF] (row 1 is zeros: exact)
    k2c = tl.sum(k2.to(tl.float32), 0).to(cty)
    vc = tl.load(qkv_s + (HQ + HKV + kvh) * D + d, cache_modifier=".cg").to(cty)  # [D]
    if (cur >= start) & (cur < end):  # the split that holds the token stores its K/V
        loc = tl.load(loc_ptr).to(tl.int64)
        dst = loc * stride_slot + kvh * stride_head
        tl.store(kc_ptr + dst + j, k1c)
        tl.store(kc_ptr + dst + HALF + j, k2c)
        tl.store(vc_ptr + dst + d, vc)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    head_off = kvh * stride_head
    for n0 in range(start, end, BLOCK_N):
        p_ = n0 + tl.arange(0, BLOCK_N)
        nmask = p_ < end
        page = tl.load(pt_ptr + p_ // PAGE_SIZE, mask=nmask, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + p_ % PAGE_SIZE  # [N]
        is_cur = p_ == cur  # its K/V come from registers (the store above may not be visible)
        kb = kc_ptr + slot[None, :] * stride_slot + head_off
        kt1 = tl.load(kb + j[:, None], mask=nmask[None, :], other=0.0)  # [HALF, N]
        kt2 = tl.load(kb + HALF + j[:, None], mask=nmask[None, :], other=0.0)
        kt1 = tl.where(is_cur[None, :], k1c[:, None], kt1)
        kt2 = tl.where(is_cur[None, :], k2c[:, None], kt2)
        qk = mma_acc(q2, kt2, mma(q1, kt1, UPCAST), UPCAST)  # [G, N]
        qk = tl.where(nmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk * scale_log2 - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vv = tl.load(vc_ptr + slot[:, None] * stride_slot + head_off + d[None, :],
                     mask=nmask[:, None], other=0.0)  # [N, D]
        vv = tl.where(is_cur[:, None], vc[None, :], vv)
        acc = mma_acc(p.to(vv.dtype), vv, acc * alpha[:, None], UPCAST)
        m_i = m_new
    has = l_i > 0.0
    heads = kvh * GROUP + g
    tl.store(mid_o + (heads[:, None] * S + s) * D + d[None, :], acc / tl.where(has, l_i, 1.0)[:, None],
             mask=gmask[:, None])
    tl.store(mid_lse + heads * S + s, tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf")),
             mask=gmask)
    # The last split of this kv head to finish combines all S (as the split-K kernel's fused reduce).
    tl.debug_barrier()
    cnt = sync_ptr + 8 + kvh
    if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == S - 1:
        # All S splits of the group's heads, SC splits per (unrolled) step, so the
        # loads of every step can be in flight together.
        SC: tl.constexpr = 4
        gq = tl.arange(0, BLOCK_GQ)
        hq2 = kvh * GROUP + gq
        qm = gq < GROUP
        ss = tl.arange(0, BLOCK_S)
        lse = tl.load(mid_lse + hq2[:, None] * S + ss[None, :], mask=qm[:, None] & (ss < S)[None, :],
                      other=float("-inf"), cache_modifier=".cg")  # [GQ, S]
        mx = tl.max(lse, 1)
        mx = tl.where(mx == float("-inf"), 0.0, mx)  # empty sequence: output 0
        tot = tl.sum(tl.exp2(lse - mx[:, None]), 1)
        o = tl.zeros([BLOCK_GQ, D], tl.float32)
        for c in tl.static_range(BLOCK_S // SC):
            sj = c * SC + tl.arange(0, SC)
            m2 = qm[:, None] & (sj < S)[None, :]
            lj = tl.load(mid_lse + hq2[:, None] * S + sj[None, :], mask=m2, other=float("-inf"),
                         cache_modifier=".cg")  # [GQ, SC]
            oj = tl.load(mid_o + (hq2[:, None, None] * S + sj[None, :, None]) * D + d[None, None, :],
                         mask=m2[:, :, None], other=0.0, cache_modifier=".cg")  # [GQ, SC, D]
            o += tl.sum(oj * tl.exp2(lj - mx[:, None])[:, :, None], 1)
        o = o / tl.where(tot > 0.0, tot, 1.0)[:, None]
        tl.store(attn_s + hq2[:, None] * D + d[None, :], o.to(dt), mask=qm[:, None])
        tl.atomic_xchg(cnt, 0)
