"""Split-K decode attention over the paged KV cache (see attention_triton's
module docstring for the split layout and the CUDA-graph contract).

Twin: ``paged_attention.paged_attention_ref`` with one query per sequence.
"""

from __future__ import annotations

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


@triton.jit
def _decode_split_kernel(
    q_ptr, kc_ptr, vc_ptr, pt_ptr, seq_lens_ptr, mid_o_ptr, mid_lse_ptr, o_ptr, count_ptr,
    ks_ptr, vs_ptr,
    stride_qt, stride_qh, stride_cs, stride_ch, stride_pt, stride_ss,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ot, stride_oh,
    scale_log2,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, UPCAST: tl.constexpr,
    FUSED_REDUCE: tl.constexpr, BLOCK_S: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
):
    pdl.enter(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    kv_len = tl.load(seq_lens_ptr + b)
    # Splits are BLOCK_N-aligned; trailing splits of a short sequence are empty.
    per_split = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = s * per_split
    end = tl.minimum(start + per_split, kv_len)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    dmask = d < D
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=gmask[:, None] & dmask[None, :], other=0.0,
    )  # [G, D]
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    pt_row = pt_ptr + b.to(tl.int64) * stride_pt
    head_off = kvh * stride_ch
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        nmask = pos < end
        page = tl.load(pt_row + pos // PAGE_SIZE, mask=nmask, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE  # [N]
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
    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(
        mid_o_ptr + b * stride_mob + heads[:, None] * stride_moh + s * stride_mos + d[None, :],
        out, mask=gmask[:, None] & dmask[None, :],
    )
    tl.store(mid_lse_ptr + b * stride_mlb + heads * stride_mlh + s, lse, mask=gmask)
    if FUSED_REDUCE:
        # The last split program of (b, kv head) to finish combines all splits: no
        # second launch. All threads' stores precede the barrier, the barrier
        # precedes the release by the atomic; the winner's acquire precedes its
        # loads (L2, .cg). The winner re-zeroes the counter for the next launch.
        tl.debug_barrier()
        cnt_ptr = count_ptr + b * tl.num_programs(1) + kvh
        done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
        if done == NUM_SPLITS - 1:
            ss = tl.arange(0, BLOCK_S)
            lse_all = tl.load(
                mid_lse_ptr + b * stride_mlb + heads[:, None] * stride_mlh + ss[None, :],
                mask=gmask[:, None] & (ss[None, :] < NUM_SPLITS), other=float("-inf"),
                cache_modifier=".cg",
            )  # [G, S]
            m = tl.max(lse_all, 1)
            m = tl.where(m == float("-inf"), 0.0, m)  # empty sequence (graph padding): output 0
            tot = tl.sum(tl.exp2(lse_all - m[:, None]), 1)  # [G]
            o_acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
            for j in range(NUM_SPLITS):
                lse_j = tl.load(mid_lse_ptr + b * stride_mlb + heads * stride_mlh + j,
                                mask=gmask, other=float("-inf"), cache_modifier=".cg")
                o_j = tl.load(
                    mid_o_ptr + b * stride_mob + heads[:, None] * stride_moh + j * stride_mos
                    + d[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0,
                    cache_modifier=".cg",
                )  # [G, D]
                o_acc += o_j * tl.exp2(lse_j - m)[:, None]
            res = o_acc / tl.where(tot > 0.0, tot, 1.0)[:, None]
            tl.store(o_ptr + b * stride_ot + heads[:, None] * stride_oh + d[None, :],
                     res.to(o_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])
            tl.atomic_xchg(cnt_ptr, 0)


@triton.jit
def _decode_reduce_kernel(
    mid_o_ptr, mid_lse_ptr, o_ptr,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.enter(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = s < NUM_SPLITS
    lse = tl.load(mid_lse_ptr + b * stride_mlb + h * stride_mlh + s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # empty sequence (graph padding): output 0
    w = tl.exp2(lse - m)  # [S]
    tot = tl.sum(w, 0)
    o = tl.load(
        mid_o_ptr + b * stride_mob + h * stride_moh + s[:, None] * stride_mos + d[None, :],
        mask=smask[:, None] & (d[None, :] < D), other=0.0,
    )  # [S, D]
    out = tl.sum(o * w[:, None], 0) / tl.where(tot > 0.0, tot, 1.0)
    tl.store(o_ptr + b * stride_ot + h * stride_oh + d, out.to(o_ptr.dtype.element_ty), mask=d < D)


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
    counters: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,  # [slots, Hkv] fp32, fp8 caches only
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Split-K decode. With ``cfg.decode_fused_reduce`` the last split program of
    each (sequence, KV head) combines the splits itself (one launch); it needs
    ``counters``: int32, at least B * Hkv entries, zero before the first call and
    left zero after every call (allocated zeroed here when not given). fp8 caches
    (float8_e4m3fn codes) need ``k_scale`` / ``v_scale``; tiles are dequantized in
    registers."""
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
    fused = cfg.decode_fused_reduce
    if fused and counters is None:
        counters = torch.zeros(bsz * hkv, dtype=torch.int32, device=q.device)
    if fused:
        assert counters is not None and counters.numel() >= bsz * hkv
    ks, vs, stride_ss, fp8 = scale_args(k_cache, k_scale, v_scale)
    on = pdl.active(q)
    _decode_split_kernel[(bsz, hkv, num_splits)](
        q, k_cache, v_cache, page_table, seq_lens, mid_o, mid_lse, out,
        counters if counters is not None else seq_lens,  # unread unless fused
        ks, vs,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), page_table.stride(0),
        stride_ss,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        scale * LOG2E,
        PAGE_SIZE=page_size, GROUP=group, D=d, BLOCK_D=block_d,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=cfg.decode_block_n,
        NUM_SPLITS=num_splits, UPCAST=interpreting(), FUSED_REDUCE=fused,
        BLOCK_S=triton.next_power_of_2(num_splits), FP8=fp8,
        num_warps=cfg.decode_warps, num_stages=cfg.decode_stages, PDL=on, **pdl.launch(on),
    )
    if fused:
        return out
    _decode_reduce_kernel[(bsz, hq)](
        mid_o, mid_lse, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits), D=d, BLOCK_D=block_d,
        num_warps=4, PDL=on, **pdl.launch(on),
    )
    return out
