"""Triton attention over the paged KV cache: KV store, split-K decode, extend, split-K extend.

Twins of ``paged_attention.store_kv_ref`` / ``paged_attention_ref``. Shapes as in
``paged_attention.py``; the cache is one layer of the pool ``[slots, Hkv, D]``
(last dim contiguous), ``slot = page * page_size + offset``.

Decode (one query per sequence) splits every sequence's KV range over a fixed
number of programs so one 100k-token request still fills the GPU. Its tiles
of ``decode_block_n`` tokens are dealt out in turn, tile t to split t % S: a
split's first tile is then known before the sequence length is, so its page
entries load alongside it::

    seq b tiles:  0  1  2 .. S-1 | S  S+1 .. 2S-1 | 2S ..    (S fixed per batch size)
    split:        0  1  2 .. S-1 | 0  1   .. S-1  | 0  ..
                  partial (o, lse) per split  ->  reduce kernel  ->  o[b, h]

Each split program serves all query heads of one KV head (GQA), so K/V are read
once per KV head. Which tiles exist comes from ``seq_lens`` on the device: the grid
is ``(B, Hkv, S)`` and never depends on device values, so a decode step can be
captured in a CUDA graph. What must stay static between capture and replay:
q/k/v/out buffers, the pool, ``page_table`` (fixed width), ``seq_lens`` and
``out_cache_loc`` tensors (refill them in place), and the split count (a
function of the batch size only, see ``TritonAttentionBackend.num_splits``).
The decode kernels live in attention_decode_triton.py, the shared helpers and
``AttnKernelConfig`` in attention_common.py (both re-exported here).

Extend/prefill runs one program per (query head, block of BLOCK_M new tokens,
sequence): keys below the block's first query position need no mask (the
bulk of a long cached prefix), the last few tiles get the causal mask.

Split-K extend (``extend_split_attention_triton``): few new tokens over a long
prefix give that grid a handful of programs, each walking the whole prefix
alone. Each program is then cut into S, dealing the block's KV tiles as decode
does (tile t to split t % S, unmasked tiles first, then the masked ones), each
split writing a partial (o, lse) per row, and a reduce launch combines them::

    block's tiles:  0 1 .. S-1 | S .. | .. full_end | masked .. kv_end
    split:          0 1 .. S-1 | 0 .. |             | (t % S)
                    partial (o, lse) [T, Hq, S]  ->  reduce  ->  o[t, h]

The grid ``(heads * S, cdiv(max_extend_len, BLOCK_M), B)`` and S come from host
values only (``TritonAttentionBackend.extend_splits``, policy
``extend_num_splits``: S = 1, the plain kernel, whenever the plain grid fills
the GPU), so the CUDA-graph contract below holds for it unchanged.

Extend in a CUDA graph (fixed token budget). The grid is
``(heads, cdiv(max_extend_len, BLOCK_M), B)`` and depends only on the
host ints ``max_extend_len`` and ``B = page_table.shape[0]``. Every program reads
its sequence's extent from ``qo_indptr`` / ``prefix_lens`` on the device and
exits at once when its token block lies past that sequence's new tokens. So
``max_extend_len`` may be any upper bound, e.g. the chunk size: capture with
``max_extend_len = chunk`` and fixed buffers, then between replays refill in
place ``q`` (first ``sum(new)`` rows), ``qo_indptr`` [B+1], ``prefix_lens`` [B],
``page_table`` [B, W] and the pool; unused sequences get equal ``qo_indptr``
entries (zero new tokens) and write nothing. Rows of ``out`` past
``qo_indptr[B]`` are left untouched. ``TritonAttentionBackend(extend_token_bound=
chunk)`` launches extend this way (split-K too, at an S fixed by the bound and
the graph's context bound); batches with one token per sequence still
take the decode path only when the host says so (``batch.is_decode``).

fp8 pools (``float8_e4m3fn`` caches, format in ``paged_attention``): the store
kernel quantizes each (token, KV head) row with its own scale; decode and
extend load codes plus per-key scales, cast codes to q's dtype (exact), scale
the score columns by the K scales and the V rows by the V scales, so no
dequantized copy of a page ever exists. The scale tensors are as static as the
pool, so graph capture is unchanged; ``FP8`` is a constexpr (one specialization).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from ftserve_kernels.attention_common import (  # noqa: F401  (re-exported names)
    LOG2E,
    AttnKernelConfig,
    interpreting,
    mma,
    mma_acc,
    quantize_e4m3,
    scale_args,
)
from ftserve_kernels.attention_decode_triton import (  # noqa: F401  (re-exported names)
    DecodeQK,
    _decode_reduce_kernel,
    _decode_split_kernel,
    decode_attention_triton,
)
from ftserve_kernels.paged_attention import gate_output

if TYPE_CHECKING:
    from ftserve.models.forward_batch import AttentionMetadata, ForwardBatch


# ---------------------------------------------------------------- KV store


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, loc_ptr, ks_ptr, vs_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch, stride_ss,
    HKV: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
):
    t = tl.program_id(0)
    loc = tl.load(loc_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    hmask = h < HKV
    mask = hmask[:, None] & (d[None, :] < D)
    dst = loc * stride_cs + h[:, None] * stride_ch + d[None, :]
    kk = tl.load(k_ptr + t.to(tl.int64) * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask,
                 other=0.0)  # [H, D]
    vv = tl.load(v_ptr + t.to(tl.int64) * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask,
                 other=0.0)  # [H, D]
    if FP8:
        # One scale per (token, KV head) over D; padded lanes load 0 and cannot raise amax.
        kq, ksc = quantize_e4m3(kk.to(tl.float32), 1)  # [H, D], [H]
        vq, vsc = quantize_e4m3(vv.to(tl.float32), 1)
        tl.store(kc_ptr + dst, kq.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + dst, vq.to(vc_ptr.dtype.element_ty), mask=mask)
        tl.store(ks_ptr + loc * stride_ss + h, ksc, mask=hmask)
        tl.store(vs_ptr + loc * stride_ss + h, vsc, mask=hmask)
    else:
        tl.store(kc_ptr + dst, kk.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + dst, vv.to(vc_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,
    out_cache_loc: torch.Tensor,  # [T] int64
    k_scale: torch.Tensor | None = None,  # [slots, Hkv] fp32, fp8 caches only
    v_scale: torch.Tensor | None = None,
) -> None:
    t, hkv, d = k.shape
    if t == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride()
    ks, vs, stride_ss, fp8 = scale_args(k_cache, k_scale, v_scale)
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, out_cache_loc, ks, vs,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1),
        stride_ss,
        HKV=hkv, D=d, BLOCK_H=triton.next_power_of_2(hkv), BLOCK_D=triton.next_power_of_2(d),
        FP8=fp8,
    )


# ---------------------------------------------------------------- extend


@triton.jit
def _extend_tile(
    q, acc, m_i, l_i, kc_ptr, vc_ptr, pt_row, head_off, n0, q_pos, kv_end, stride_cs,
    scale_log2, d, ks_ptr, vs_ptr, stride_ss, kvh,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    UPCAST: tl.constexpr, FP8: tl.constexpr, EMPTY_ROWS: tl.constexpr = False,
):
    # EMPTY_ROWS (split-K extend): a row may have seen no key yet and see none in
    # this masked tile (m_new = -inf); its exponents then use 0 for m_new, so alpha
    # and p are 0, not exp2(-inf + inf) = NaN. The plain kernel's rows always see key 0 first.
    pos = n0 + tl.arange(0, BLOCK_N)
    nmask = pos < kv_end  # used by the MASKED variant only
    if MASKED:
        page = tl.load(pt_row + pos // PAGE_SIZE, mask=nmask, other=0)
    else:
        page = tl.load(pt_row + pos // PAGE_SIZE)
    slot = page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE  # [N]
    kt = tl.load(kc_ptr + slot[None, :] * stride_cs + head_off + d[:, None])  # [D, N]
    if FP8:
        # Codes -> q's dtype is exact; each key's scale multiplies its score column.
        # Slots past kv_end read the dummy page (zero or finite scales, finite codes).
        ksc = tl.load(ks_ptr + slot * stride_ss + kvh)  # [N]
        qk = mma(q, kt.to(q.dtype), UPCAST) * ksc[None, :]  # [M, N]
    else:
        qk = mma(q, kt, UPCAST)  # [M, N] unscaled scores
    if MASKED:
        ok = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] < kv_end)
        qk = tl.where(ok, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)  # log2 domain
    if EMPTY_ROWS and MASKED:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(qk * scale_log2 - m_use[:, None])  # one FMA per score
    l_i = l_i * alpha + tl.sum(p, 1)
    v_ptrs = vc_ptr + slot[:, None] * stride_cs + head_off + d[None, :]
    if MASKED:  # the dummy page may hold anything (padding writes): 0 * NaN = NaN
        vv = tl.load(v_ptrs, mask=nmask[:, None], other=0.0)  # [N, D]
    else:
        vv = tl.load(v_ptrs)  # [N, D]
    if FP8:
        if MASKED:
            vsc = tl.load(vs_ptr + slot * stride_ss + kvh, mask=nmask, other=0.0)  # [N]
        else:
            vsc = tl.load(vs_ptr + slot * stride_ss + kvh)  # [N]
        vd = (vv.to(tl.float32) * vsc[:, None]).to(q.dtype)  # [N, D] dequantized
        acc = mma_acc(p.to(q.dtype), vd, acc * alpha[:, None], UPCAST)
    else:
        acc = mma_acc(p.to(vv.dtype), vv, acc * alpha[:, None], UPCAST)
    return acc, m_new, l_i


@triton.jit
def _extend_kernel(
    q_ptr, o_ptr, kc_ptr, vc_ptr, pt_ptr, qo_indptr_ptr, prefix_ptr, ks_ptr, vs_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cs, stride_ch, stride_pt, stride_ss,
    scale_log2,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, FP8: tl.constexpr,
):
    # A program's BLOCK_M rows are BLOCK_M tokens of one query head.
    # Largest query blocks (longest causal range) first: better tail balance.
    mb = tl.num_programs(1) - 1 - tl.program_id(1)
    b = tl.program_id(2)
    q0 = tl.load(qo_indptr_ptr + b)
    n_new = tl.load(qo_indptr_ptr + b + 1) - q0
    if mb * BLOCK_M < n_new:  # blocks past this sequence's new tokens (static grid) exit
        prefix = tl.load(prefix_ptr + b)
        head = tl.program_id(0)
        kvh = head // GROUP
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # [M] token within the sequence
        mmask = offs_m < n_new
        d = tl.arange(0, D)
        rows = (q0 + offs_m).to(tl.int64)
        q = tl.load(q_ptr + (rows * stride_qt + head * stride_qh)[:, None] + d[None, :],
                    mask=mmask[:, None], other=0.0)  # [M, D]
        q_pos = prefix + offs_m
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        pt_row = pt_ptr + b.to(tl.int64) * stride_pt
        head_off = kvh * stride_ch
        # Keys before the block's first query are visible to every row: no mask.
        full_end = ((prefix + mb * BLOCK_M) // BLOCK_N) * BLOCK_N
        kv_end = prefix + tl.minimum((mb + 1) * BLOCK_M, n_new)
        for n0 in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _extend_tile(
                q, acc, m_i, l_i, kc_ptr, vc_ptr, pt_row, head_off, n0, q_pos, kv_end,
                stride_cs, scale_log2, d, ks_ptr, vs_ptr, stride_ss, kvh,
                PAGE_SIZE, BLOCK_N, False, UPCAST, FP8,
            )
        for n0 in range(full_end, kv_end, BLOCK_N):
            acc, m_i, l_i = _extend_tile(
                q, acc, m_i, l_i, kc_ptr, vc_ptr, pt_row, head_off, n0, q_pos, kv_end,
                stride_cs, scale_log2, d, ks_ptr, vs_ptr, stride_ss, kvh,
                PAGE_SIZE, BLOCK_N, True, UPCAST, FP8,
            )
        out = acc / l_i[:, None]  # every row sees at least key 0: l_i > 0
        tl.store(o_ptr + (rows * stride_ot + head * stride_oh)[:, None] + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=mmask[:, None])


def _extend_prologue(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
    cfg: AttnKernelConfig | None, out: torch.Tensor | None,
) -> tuple[AttnKernelConfig, torch.Tensor]:
    """Both extend launches' argument checks -> (the tiles, the output buffer)."""
    d = q.shape[-1]
    if d & (d - 1):
        raise ValueError(f"head_dim {d} must be a power of two for the Triton extend kernel")
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    assert page_table.stride(-1) == 1
    return cfg or AttnKernelConfig.for_device(q.device, d), torch.empty_like(q) if out is None else out


def extend_attention_triton(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [slots, Hkv, D], new tokens already stored
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # [B, max_pages] int32
    qo_indptr: torch.Tensor,  # [B+1] int32
    prefix_lens: torch.Tensor,  # [B] int32
    max_extend_len: int,  # host value bounding every sequence's new tokens: sizes the grid
    page_size: int,
    scale: float,
    cfg: AttnKernelConfig | None = None,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,  # [slots, Hkv] fp32, fp8 caches only
    v_scale: torch.Tensor | None = None,
    num_splits: int = 1,
) -> torch.Tensor:
    """Causal over the new tokens, full over the cached prefix. ``max_extend_len``
    may exceed the real maximum (a static bound for CUDA graphs, see the module
    docstring); programs past a sequence's extent exit early. fp8 caches need
    ``k_scale`` / ``v_scale`` (dequantized in registers). ``num_splits`` > 1:
    extend_split_attention_triton's split-K launch pair instead."""
    if num_splits > 1:
        return extend_split_attention_triton(q, k_cache, v_cache, page_table, qo_indptr, prefix_lens,
                                             max_extend_len, page_size, scale, num_splits, cfg, out,
                                             k_scale, v_scale)
    cfg, out = _extend_prologue(q, k_cache, v_cache, page_table, cfg, out)
    t, hq, d = q.shape
    if t == 0:
        return out
    bsz = page_table.shape[0]
    group = hq // k_cache.shape[1]
    grid = (hq, triton.cdiv(max_extend_len, cfg.extend_block_m), bsz)
    ks, vs, stride_ss, fp8 = scale_args(k_cache, k_scale, v_scale)
    _extend_kernel[grid](
        q, out, k_cache, v_cache, page_table, qo_indptr, prefix_lens, ks, vs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), page_table.stride(0), stride_ss,
        scale * LOG2E,
        PAGE_SIZE=page_size, GROUP=group, D=d,
        BLOCK_M=cfg.extend_block_m, BLOCK_N=cfg.extend_block_n, UPCAST=interpreting(),
        FP8=fp8,
        num_warps=cfg.extend_warps, num_stages=cfg.extend_stages,
    )
    return out


# ---------------------------------------------------------------- split-K extend


@triton.jit
def _extend_split_kernel(
    q_ptr, kc_ptr, vc_ptr, pt_ptr, qo_indptr_ptr, prefix_ptr, ks_ptr, vs_ptr, mid_o_ptr, mid_lse_ptr,
    stride_qt, stride_qh, stride_cs, stride_ch, stride_pt, stride_ss,
    stride_mot, stride_moh, stride_mos, stride_mlt, stride_mlh,
    scale_log2,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr, FP8: tl.constexpr, BLOCK_G: tl.constexpr = 1,
):
    # _extend_kernel's program (query head, block of new tokens, sequence), cut
    # NUM_SPLITS ways over its KV tiles: split s takes tiles t = s, s + S, ...
    # of the block's range [0, kv_end), unmasked ones (below the block's first
    # query) and then the masked ones, and writes a partial (o, lse) per row.
    # BLOCK_G = 1: a program's BLOCK_M rows are tokens of one query head.
    # BLOCK_G >= GROUP (a power of two): its rows are BLOCK_M // BLOCK_G tokens
    # x the GROUP query heads of one KV head (padding heads masked), so each
    # K/V tile is read once for the whole group, as the decode split kernel does.
    BLOCK_T: tl.constexpr = BLOCK_M // BLOCK_G  # tokens per program
    hg = tl.program_id(0) // NUM_SPLITS
    s = tl.program_id(0) % NUM_SPLITS
    mb = tl.num_programs(1) - 1 - tl.program_id(1)
    b = tl.program_id(2)
    q0 = tl.load(qo_indptr_ptr + b)
    n_new = tl.load(qo_indptr_ptr + b + 1) - q0
    if mb * BLOCK_T < n_new:  # blocks past this sequence's new tokens (static grid) exit
        prefix = tl.load(prefix_ptr + b)
        if BLOCK_G == 1:
            kvh = hg // GROUP
            head0 = hg
        else:
            kvh = hg
            head0 = hg * GROUP
        r = tl.arange(0, BLOCK_M)
        g = r % BLOCK_G
        heads = head0 + g  # [M]
        offs_m = mb * BLOCK_T + r // BLOCK_G  # [M] token within the sequence
        mmask = (offs_m < n_new) & (g < GROUP)
        d = tl.arange(0, D)
        rows = (q0 + offs_m).to(tl.int64)
        q = tl.load(q_ptr + (rows * stride_qt + heads * stride_qh)[:, None] + d[None, :],
                    mask=mmask[:, None], other=0.0)  # [M, D]
        q_pos = prefix + offs_m
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        pt_row = pt_ptr + b.to(tl.int64) * stride_pt
        head_off = kvh * stride_ch
        full_tiles = (prefix + mb * BLOCK_T) // BLOCK_N
        full_end = full_tiles * BLOCK_N
        kv_end = prefix + tl.minimum((mb + 1) * BLOCK_T, n_new)
        for n0 in range(s * BLOCK_N, full_end, NUM_SPLITS * BLOCK_N):
            acc, m_i, l_i = _extend_tile(
                q, acc, m_i, l_i, kc_ptr, vc_ptr, pt_row, head_off, n0, q_pos, kv_end,
                stride_cs, scale_log2, d, ks_ptr, vs_ptr, stride_ss, kvh,
                PAGE_SIZE, BLOCK_N, False, UPCAST, FP8, True,
            )
        # This split's first masked tile: the first t >= full_tiles with t % S == s.
        first = full_tiles + (s + NUM_SPLITS - full_tiles % NUM_SPLITS) % NUM_SPLITS
        for n0 in range(first * BLOCK_N, kv_end, NUM_SPLITS * BLOCK_N):
            acc, m_i, l_i = _extend_tile(
                q, acc, m_i, l_i, kc_ptr, vc_ptr, pt_row, head_off, n0, q_pos, kv_end,
                stride_cs, scale_log2, d, ks_ptr, vs_ptr, stride_ss, kvh,
                PAGE_SIZE, BLOCK_N, True, UPCAST, FP8, True,
            )
        has = l_i > 0.0  # false: no key of this split is visible to the row
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))  # log2 domain
        tl.store(mid_o_ptr + (rows * stride_mot + heads * stride_moh + s * stride_mos)[:, None] + d[None, :],
                 out, mask=(mmask & has)[:, None])
        tl.store(mid_lse_ptr + rows * stride_mlt + heads * stride_mlh + s, lse, mask=mmask)


@triton.jit
def _extend_reduce_kernel(
    mid_o_ptr, mid_lse_ptr, o_ptr, qo_indptr_ptr, num_seqs,
    stride_mot, stride_moh, stride_mos, stride_mlt, stride_mlh, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, D: tl.constexpr,
):
    # Program (token row, head): the splits' partials weighed by their lse. Rows
    # past qo_indptr[B] (graph padding) are left untouched, as _extend_kernel does.
    r = tl.program_id(0)
    h = tl.program_id(1)
    if r < tl.load(qo_indptr_ptr + num_seqs):
        s = tl.arange(0, BLOCK_S)
        d = tl.arange(0, D)
        smask = s < NUM_SPLITS
        row = r.to(tl.int64)
        lse = tl.load(mid_lse_ptr + row * stride_mlt + h * stride_mlh + s, mask=smask, other=float("-inf"))
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)  # cannot happen for a real row (key 0): no NaN if it did
        w = tl.exp2(lse - m)  # [S]; splits without a visible key weigh 0
        tot = tl.sum(w, 0)
        o = tl.load(mid_o_ptr + row * stride_mot + h * stride_moh + s[:, None] * stride_mos + d[None, :],
                    mask=(smask & (lse > float("-inf")))[:, None], other=0.0)  # [S, D]; empty splits unread
        out = tl.sum(o * w[:, None], 0) / tl.where(tot > 0.0, tot, 1.0)
        tl.store(o_ptr + row * stride_ot + h * stride_oh + d, out.to(o_ptr.dtype.element_ty))


def extend_split_block_m(rows: int, cfg: AttnKernelConfig) -> int:
    """Query rows of a split-K extend program: the chunk's rows (its token
    bound, times the padded GQA group with ``group_heads``) rounded up to a
    power of two, from 16 (tl.dot's least M) to cfg.extend_block_m, so a
    16-token chunk does not multiply 48 rows of padding on every tile."""
    return min(cfg.extend_block_m, max(16, triton.next_power_of_2(max(1, rows))))


def extend_num_splits(programs: int, kv_tiles: int, num_sms: int, cfg: AttnKernelConfig) -> int:
    """KV splits S of one extend launch, from host values only (a CUDA graph
    captured with a static bound keeps its S).

    ``programs``: the plain grid's working programs (query heads x query
    blocks); ``kv_tiles``: KV tiles of the longest sequence (a bound). A grid
    that already fills every SM keeps S = 1 (today's kernel, e.g. a 4,096-token
    chunk). Otherwise S aims at cfg.extend_programs_per_sm programs per SM,
    rounded up to a power of two (few kernel specializations), at most
    cfg.extend_max_splits, and halved while a split would hold fewer than
    cfg.extend_split_min_tiles tiles of the longest sequence (short contexts:
    the partials and the reduce launch would cost more than they save)."""
    if programs >= num_sms or cfg.extend_max_splits <= 1:
        return 1
    want = math.ceil(cfg.extend_programs_per_sm * num_sms / max(1, programs))
    splits = min(cfg.extend_max_splits, triton.next_power_of_2(want))
    while splits > 1 and splits * cfg.extend_split_min_tiles > kv_tiles:
        splits //= 2
    return splits


def extend_split_attention_triton(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [slots, Hkv, D], new tokens already stored
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # [B, max_pages] int32
    qo_indptr: torch.Tensor,  # [B+1] int32
    prefix_lens: torch.Tensor,  # [B] int32
    max_extend_len: int,  # host bound on every sequence's new tokens: sizes the grid
    page_size: int,
    scale: float,
    num_splits: int,
    cfg: AttnKernelConfig | None = None,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,  # [slots, Hkv] fp32, fp8 caches only
    v_scale: torch.Tensor | None = None,
    block_m: int | None = None,  # query rows per program; None: extend_split_block_m
    group_heads: bool = False,
) -> torch.Tensor:
    """extend_attention_triton's attention with every program's KV tiles dealt
    to ``num_splits`` programs (tile t to split t % S), partials combined by a
    reduce launch: for few new tokens over a long prefix, where the plain grid
    has too few programs to fill the GPU. Same arguments and graph contract
    (grid from host values only; rows past ``qo_indptr[B]`` untouched).
    ``group_heads``: a program's rows are tokens x all query heads of one KV
    head (``block_m`` // the group, padded to a power of two, tokens each), so
    every K/V tile is read once per KV head rather than once per query head."""
    assert num_splits >= 1
    cfg, out = _extend_prologue(q, k_cache, v_cache, page_table, cfg, out)
    t, hq, d = q.shape
    if t == 0:
        return out
    hkv = k_cache.shape[1]
    bsz = page_table.shape[0]
    group = hq // hkv
    block_g = triton.next_power_of_2(group) if group_heads else 1
    bm = max(block_m or extend_split_block_m(max_extend_len * block_g, cfg), block_g)
    mid_o = torch.empty((t, hq, num_splits, d), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((t, hq, num_splits), dtype=torch.float32, device=q.device)
    ks, vs, stride_ss, fp8 = scale_args(k_cache, k_scale, v_scale)
    programs = hkv if group_heads else hq
    _extend_split_kernel[(programs * num_splits, triton.cdiv(max_extend_len, bm // block_g), bsz)](
        q, k_cache, v_cache, page_table, qo_indptr, prefix_lens, ks, vs, mid_o, mid_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), page_table.stride(0), stride_ss,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        scale * LOG2E,
        PAGE_SIZE=page_size, GROUP=group, D=d, BLOCK_M=bm, BLOCK_N=cfg.extend_block_n,
        NUM_SPLITS=num_splits, UPCAST=interpreting(), FP8=fp8, BLOCK_G=block_g,
        num_warps=cfg.extend_warps, num_stages=cfg.extend_stages,
    )
    _extend_reduce_kernel[(t, hq)](
        mid_o, mid_lse, out, qo_indptr, bsz,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits), D=d, num_warps=4,
    )
    return out


# ---------------------------------------------------------------- backend


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


class TritonAttentionBackend:
    """AttentionBackend (see forward_batch.py) on Triton kernels.

    Decode batches (``batch.is_decode``, or any batch with one new token per
    sequence) take the split-K path, which is CUDA-graph capturable; everything
    else takes the extend path. ``num_splits`` depends only on the batch size and
    the KV head count, so a graph captured for batch size B stays valid.

    ``extend_token_bound``: when set (the prefill chunk size), extend grids are
    sized from it instead of the batch's ``max_extend_len``, so a prefill chunk
    can be captured once per token budget and replayed (see the module
    docstring); the one-token-per-sequence shortcut to the decode kernel is then
    taken only for ``batch.is_decode``, since ``max_extend_len`` may change
    between replays.

    Extend steps whose plain grid leaves SMs idle (few new tokens over a long
    prefix) take the split-K extend at ``extend_splits`` splits, chosen from the
    token bound and ``max_seq_len`` (host values; a graph's are static);
    the constructor's ``extend_splits`` fixes the count instead (tests, benches).
    """

    name = "triton"

    def __init__(
        self, scale: float | None = None, cfg: AttnKernelConfig | None = None,
        extend_token_bound: int | None = None, extend_splits: int | None = None,
    ) -> None:
        self.scale = scale
        self.cfg = cfg
        self.extend_token_bound = extend_token_bound
        self.forced_splits = extend_splits  # None: extend_num_splits decides

    def decode_qk(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch,
        q_w: torch.Tensor | None, k_w: torch.Tensor | None, eps: float, cos_sin: torch.Tensor,
    ) -> torch.Tensor | None:
        """Decode attention from raw q/k [B, H, D]: the split kernel applies the
        per-head norms (q_w / k_w; None: a model without them) and the rotary and
        stores K/V itself (one launch fewer than qk_norm_rotary + forward, two
        fewer than rotary + store + forward). None where it does not apply (not a
        decode batch, fp8 pages, partial rotary, a head dim not a power of two):
        the caller takes the usual path."""
        pool = batch.kv_pool
        d = q.shape[-1]
        if (not batch.is_decode or pool.k_scale is not None or cos_sin.shape[-1] != d
                or triton.next_power_of_2(d) != d):
            return None
        qk = DecodeQK(k, v, q_w, k_w, eps, batch.positions, cos_sin, batch.attn.out_cache_loc)
        return self._decode(q, pool.k[layer], pool.v[layer], batch, None, None, qk)

    def _decode(
        self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, batch: ForwardBatch,
        ks: torch.Tensor | None, vs: torch.Tensor | None, qk: DecodeQK | None = None,
        out_gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Split-K decode attention over this layer's pages at the backend's
        split count and config (forward's decode path, and decode_qk's)."""
        meta = batch.attn
        cfg = self.cfg or AttnKernelConfig.for_device(q.device, q.shape[-1])
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        splits = self.num_splits(q.shape[0], kc.shape[1], q.device, meta.max_seq_len)
        return decode_attention_triton(
            q, kc, vc, meta.page_table, meta.seq_lens, meta.page_size, scale, splits, cfg,
            k_scale=ks, v_scale=vs, qk=qk, kernels=batch.kernels, out_gate=out_gate,
        )

    def num_splits(self, batch_size: int, num_kv_heads: int, device: torch.device,
                   max_seq_len: int | None = None) -> int:
        """Splits of a decode batch: a function of the batch size and, through
        ``max_seq_len`` (a host bound on every sequence's length; None: no
        bound), of AttnKernelConfig.short_context_splits. A CUDA graph captured
        with a bound stays valid for every batch within it."""
        cfg = self.cfg or AttnKernelConfig.for_device(device, 128)
        # About decode_programs_per_sm split programs per SM over all (sequence,
        # kv head) pairs: one 100k-token sequence needs many splits to fill the HBM pipe.
        want = math.ceil(cfg.decode_programs_per_sm * _num_sms(device)
                         / max(1, batch_size * num_kv_heads))
        splits = max(1, min(cfg.max_splits, want))
        if max_seq_len is not None and max_seq_len <= self.short_context_limit(device):
            splits = min(splits, cfg.short_context_splits)
        return splits

    def short_context_limit(self, device: torch.device) -> int:
        """The longest sequence a decode batch may hold and still take the
        short-context split cap: fewer tiles than short_context_splits, so
        every split (the new token's included) holds at most one (0: no cap)."""
        cfg = self.cfg or AttnKernelConfig.for_device(device, 128)
        return max(0, cfg.short_context_splits - 1) * cfg.decode_block_n

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch,
        kv_stored: bool = False, out_gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``kv_stored``: the caller already put this step's K/V into the pages.
        ``out_gate`` [T, Hq, D]: the output times sigmoid(out_gate), in the decode
        kernels' reduce launch (paged_attention.gate_output after the extend kernel)."""
        pool = batch.kv_pool
        meta = batch.attn
        kc, vc = pool.k[layer], pool.v[layer]
        ks, vs = pool.scales(layer)  # None, None unless the pool holds fp8 codes
        if not kv_stored:
            store_kv_triton(kc, vc, k, v, meta.out_cache_loc, ks, vs)
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        cfg = self.cfg or AttnKernelConfig.for_device(q.device, q.shape[-1])
        bound = self.extend_token_bound
        assert bound is None or bound >= meta.max_extend_len, "extend_token_bound below a chunk"
        # One new token per sequence (host metadata): the split-K kernel reads each
        # KV head once for all its query heads, far cheaper than 64-row extend tiles.
        if batch.is_decode or (bound is None and meta.max_extend_len == 1):
            assert q.shape[0] == meta.num_seqs, "decode batches carry one token per sequence"
            return self._decode(q, kc, vc, batch, ks, vs, out_gate=out_gate)
        if meta.query_seq_lens is not None:  # a verify step: one decode query per token
            assert meta.query_page_table is not None and meta.query_seq_lens.shape[0] == q.shape[0]
            splits = self.num_splits(q.shape[0], kc.shape[1], q.device, meta.max_seq_len)
            return decode_attention_triton(
                q, kc, vc, meta.query_page_table, meta.query_seq_lens, meta.page_size, scale, splits, cfg,
                k_scale=ks, v_scale=vs, kernels=batch.kernels, out_gate=out_gate,
            )
        out = extend_attention_triton(
            q, kc, vc, meta.page_table, meta.qo_indptr, meta.prefix_lens,
            bound if bound is not None else meta.max_extend_len, meta.page_size, scale, cfg,
            k_scale=ks, v_scale=vs, num_splits=self.extend_splits(q.shape[1], meta, cfg, q.device),
        )
        return gate_output(out, out_gate)

    def extend_splits(self, num_q_heads: int, meta: AttentionMetadata, cfg: AttnKernelConfig,
                      device: torch.device) -> int:
        """KV splits of an extend launch (1: the plain kernel), from host values
        only: the token bound (``extend_token_bound``, a graph's bucket; else
        the step's new tokens per sequence) and ``meta.max_seq_len`` (a graph's
        static context bound). ``cfg``: the launch's tiles (head-dim dependent).
        See extend_num_splits for the policy; the constructor's
        ``extend_splits`` overrides it."""
        if self.forced_splits is not None:
            return self.forced_splits
        bm = cfg.extend_block_m  # the plain grid's rows: does it fill the GPU already?
        if self.extend_token_bound is not None:  # a graph: one sequence filling its bucket
            blocks = triton.cdiv(self.extend_token_bound, bm)
        else:
            blocks = sum(triton.cdiv(n, bm) for n in meta.extend_lens_host)
        kv_tiles = triton.cdiv(meta.max_seq_len, cfg.extend_block_n)
        return extend_num_splits(num_q_heads * blocks, kv_tiles, _num_sms(device), cfg)
