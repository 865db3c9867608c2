"""Triton extend (prefill) attention over the paged KV cache: plain and split-K.

Twin: ``paged_attention.paged_attention_ref``. Shapes, the pool layout and the
fp8 format as in attention_triton's module docstring; the KV store and the
backend that launches these kernels (``TritonAttentionBackend``) live there.

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

fp8 caches: the kernels load codes plus per-key scales, cast codes to q's
dtype (exact), scale the score columns by the K scales and the V rows by the V
scales; ``FP8`` is a constexpr (one specialization).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ftserve_kernels.attention_common import (
    LOG2E,
    AttnKernelConfig,
    interpreting,
    mma,
    mma_acc,
    scale_args,
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
