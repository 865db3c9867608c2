"""A decode step's device inputs in one launch, from the graph's packed host row
per sequence (see ftserve/engine/cuda_graph.py). Twin: ``decode_inputs_ref``.

    packed [B, WORDS] int64: one DecodeRow per sequence (input id, position, KV
                             slot, seq len, sampler slot | min_tokens flag,
                             step, src row: -1 where the host knows the id)

A batch-1 decode step on the H200 spent ~15 us in ~10 small torch launches
unpacking this (a transpose, the src-row substitution, casts, masks, the page
table rows' gather, the embedding); one program per (sequence, page-table
block) does it all::

    program (b, 0):   input_ids[b] = last[src] if src >= 0 else id; the scalar
                      fields; embeds[b] = embedding row of input_ids[b]; with a
                      norm, normed[b] = the first layer's input norm of that row
    program (b, j):   page_rows[b, block j - 1] = page_table[slot_b, block j - 1]

With ``staged`` (bookkeeping.StagedRows) the rows are read straight from the
pinned pair, row ``parity`` of it, over UVA: a decode graph then needs no copy
kernel in front of this one (H200, batch 1: that kernel was 2.5 us and a gap
of every step).

``embed_rms_norm_triton`` is the same row work for the eager decode path (ids
already on the device), one program per token through the same helper at the
same launch shape, so a graph step and an eager step agree to the bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

import torch
import triton
import triton.language as tl

from ftserve_kernels import pdl
from ftserve_kernels.bookkeeping import StagedRows
from ftserve_kernels.config import DEFAULT_KERNELS, KernelConfig
from ftserve_kernels.norm_rope import rms_norm_ref

W = TypeVar("W")


class DecodeRow(NamedTuple, Generic[W]):
    """One sequence's words of a decode step, in the order of a packed row
    (``DecodeRow[int]`` on the host; ``DecodeRow(*packed.t())`` names the
    columns of a packed [B, WORDS] tensor, as views)."""

    input_id: W  # the step's token, where the host knows it
    position: W
    out_cache_loc: W  # the KV slot the token's K/V go to
    seq_len: W  # position + 1
    slot: W  # sampler slot = page-table row, with the min_tokens flag bit (MIN_FLAG) or'd in
    step: W  # index of the output token being sampled
    src_row: W  # row of ``last`` holding the input id (overlap scheduling: the host does not know it), -1: none

    @classmethod
    def padding(cls, sink_row: int) -> DecodeRow[int]:
        """A padded row: length 1 over the dummy page, the dummy page-table row
        and sampler slot; it writes nowhere real."""
        return DecodeRow(input_id=0, position=0, out_cache_loc=0, seq_len=1, slot=sink_row, step=0, src_row=-1)


WORDS = len(DecodeRow._fields)
# Each field's word within a row, for the kernel.
_W = {name: tl.constexpr(i) for i, name in enumerate(DecodeRow._fields)}
W_INPUT_ID, W_POSITION, W_LOC, W_SEQ_LEN = _W["input_id"], _W["position"], _W["out_cache_loc"], _W["seq_len"]
W_SLOT, W_STEP, W_SRC_ROW = _W["slot"], _W["step"], _W["src_row"]


@dataclass
class DecodeInputs:
    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    out_cache_loc: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int32
    prefix_lens: torch.Tensor  # [B] int32, seq_lens - 1
    slots: torch.Tensor  # [B] int64, sampler slot = page-table row
    steps: torch.Tensor  # [B] int64
    min_active: torch.Tensor  # [B] bool, below min_tokens
    page_rows: torch.Tensor  # [B, max_pages] int32, page_table[slots]
    embeds: torch.Tensor | None  # [B, H], embedding rows of input_ids (None: no table given)
    normed: torch.Tensor | None = None  # [B, H], rms_norm(embeds) (None: no norm given)


@dataclass(frozen=True)
class InputNorm:
    """The first layer's input RMSNorm, applied where the embedding rows are gathered."""

    weight: torch.Tensor  # [H]
    eps: float


def embed_rms_norm_ref(
    ids: torch.Tensor, embed: torch.Tensor, norm: InputNorm
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (embedding rows [T, H], rms_norm of them [T, H])."""
    rows = embed.index_select(0, ids)
    return rows, rms_norm_ref(rows, norm.weight, norm.eps)


def decode_inputs_ref(
    packed: torch.Tensor, last: torch.Tensor, page_table: torch.Tensor, embed: torch.Tensor | None,
    flag: int, norm: InputNorm | None = None, staged: StagedRows | None = None,
) -> DecodeInputs:
    """``staged``: the rows are its picked row's first B * WORDS words, not
    ``packed`` (which gives only B and the device)."""
    if staged is not None:
        packed = staged.host_row()[:packed.numel()].view(packed.shape).to(packed.device)
    row: DecodeRow[torch.Tensor] = DecodeRow(*packed.t())  # [B] views, one per field
    prev = last.index_select(0, row.src_row.clamp(min=0))  # [B]
    ids = torch.where(row.src_row >= 0, prev, row.input_id)
    seq = row.seq_len.to(torch.int32)
    slots = row.slot & (flag - 1)
    assert norm is None or embed is not None, "the input norm applies to the embedding rows"
    embeds = None if embed is None else embed.index_select(0, ids)
    return DecodeInputs(
        ids, row.position.contiguous(), row.out_cache_loc.contiguous(), seq, seq - 1, slots,
        row.step.contiguous(), (row.slot & flag) != 0, page_table.index_select(0, slots), embeds,
        None if norm is None or embeds is None else rms_norm_ref(embeds, norm.weight, norm.eps),
    )


@triton.jit
def _embed_norm_row(emb_ptr, tok, stride_emb, out_ptr, normed_ptr, nw_ptr, hidden, eps,
                    HAS_NORM: tl.constexpr, BLOCK_H: tl.constexpr):
    """Copy embedding row ``tok`` to out_ptr; with HAS_NORM also write its RMSNorm
    to normed_ptr, rounded as norm_rope.rms_norm_ref (normed -> dtype, then
    w * normed -> dtype). The second pass re-reads the row (L1/L2)."""
    h = tl.arange(0, BLOCK_H)
    row = emb_ptr + tok.to(tl.int64) * stride_emb
    ssq = tl.zeros([BLOCK_H], tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        m = h0 + h < hidden
        v = tl.load(row + h0 + h, mask=m, other=0.0)
        tl.store(out_ptr + h0 + h, v, mask=m)
        vf = v.to(tl.float32)
        ssq += vf * vf
    if HAS_NORM:
        dt = emb_ptr.dtype.element_ty
        inv = tl.rsqrt(tl.sum(ssq, 0) / hidden + eps)
        for h0 in range(0, hidden, BLOCK_H):
            m = h0 + h < hidden
            vf = tl.load(row + h0 + h, mask=m, other=0.0).to(tl.float32)
            w = tl.load(nw_ptr + h0 + h, mask=m, other=0.0).to(tl.float32)
            y = w * (vf * inv).to(dt).to(tl.float32)
            tl.store(normed_ptr + h0 + h, y.to(dt), mask=m)


@triton.jit
def _decode_inputs_kernel(
    packed_ptr, last_ptr, pt_ptr, emb_ptr, nw_ptr, normed_ptr,
    ids_ptr, pos_ptr, loc_ptr, seq_ptr, pre_ptr, slot_ptr, step_ptr, min_ptr, rows_ptr, out_emb_ptr,
    max_pages, hidden, eps, stride_pt, stride_rows, stride_emb, stride_out_emb,
    parity_ptr, pair_stride,
    FLAG: tl.constexpr, HAS_EMB: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr, STAGED: tl.constexpr, RELEASE: tl.constexpr = False,
    NUM_WORDS: tl.constexpr = WORDS, BLOCK_WORDS: tl.constexpr = triton.next_power_of_2(WORDS),
):
    pdl.release(RELEASE)  # the step's first GEMV is placed now and loads its first tile meanwhile
    b = tl.program_id(0)
    j = tl.program_id(1)
    if STAGED:  # packed_ptr: the pinned pair's int64 address; the device word picks the row
        side = tl.load(parity_ptr).to(tl.int64)
        row = packed_ptr.to(tl.int64).to(tl.pointer_type(tl.int64)) + side * pair_stride + b * NUM_WORDS
    else:
        row = packed_ptr + b * NUM_WORDS
    # The row's words in one load (one PCIe round trip when staged: as scalar
    # loads behind the src branch they were two), then picked apart by field.
    w = tl.arange(0, BLOCK_WORDS)
    words = tl.load(row + w, mask=w < NUM_WORDS, other=0)
    packed_slot = tl.sum(tl.where(w == W_SLOT, words, 0), 0)
    slot = packed_slot & (FLAG - 1)
    if j == 0:
        src = tl.sum(tl.where(w == W_SRC_ROW, words, 0), 0)
        tok = tl.sum(tl.where(w == W_INPUT_ID, words, 0), 0)
        if src >= 0:
            tok = tl.load(last_ptr + src)
        seq = tl.sum(tl.where(w == W_SEQ_LEN, words, 0), 0)
        tl.store(ids_ptr + b, tok)
        tl.store(pos_ptr + b, tl.sum(tl.where(w == W_POSITION, words, 0), 0))
        tl.store(loc_ptr + b, tl.sum(tl.where(w == W_LOC, words, 0), 0))
        tl.store(seq_ptr + b, seq.to(tl.int32))
        tl.store(pre_ptr + b, (seq - 1).to(tl.int32))
        tl.store(slot_ptr + b, slot)
        tl.store(step_ptr + b, tl.sum(tl.where(w == W_STEP, words, 0), 0))
        tl.store(min_ptr + b, ((packed_slot & FLAG) != 0).to(tl.int8))
        if HAS_EMB:
            out = b.to(tl.int64) * stride_out_emb
            _embed_norm_row(emb_ptr, tok, stride_emb, out_emb_ptr + out, normed_ptr + out, nw_ptr,
                            hidden, eps, HAS_NORM, BLOCK_H)
    else:
        p = (j - 1) * BLOCK_P + tl.arange(0, BLOCK_P)
        m = p < max_pages
        v = tl.load(pt_ptr + slot * stride_pt + p, mask=m)
        tl.store(rows_ptr + b.to(tl.int64) * stride_rows + p, v, mask=m)


def _row_launch(hidden: int) -> tuple[int, int]:
    """(BLOCK_H, num_warps) of a row's embedding + norm work: one shape for both
    kernels, so their sums of squares reduce in the same order."""
    return min(2048, triton.next_power_of_2(hidden)), 4


def decode_inputs_triton(
    packed: torch.Tensor, last: torch.Tensor, page_table: torch.Tensor, embed: torch.Tensor | None,
    flag: int, norm: InputNorm | None = None, block_p: int = 1024, staged: StagedRows | None = None,
    kernels: KernelConfig = DEFAULT_KERNELS,
) -> DecodeInputs:
    """As decode_inputs_ref; fixed shapes (B, max_pages, H): graph-capturable.
    With ``staged`` the kernel reads the words from the pinned pair itself and
    ``packed`` is not read."""
    assert norm is None or embed is not None, "the input norm applies to the embedding rows"
    assert packed.is_contiguous() and packed.shape[1] == WORDS and page_table.stride(1) == 1
    if staged is not None:
        assert staged.pair.shape[1] >= packed.numel() and staged.parity.device == packed.device
    bsz, dev = packed.shape[0], packed.device
    max_pages = page_table.shape[1]
    i64 = dict(dtype=torch.int64, device=dev)
    i32 = dict(dtype=torch.int32, device=dev)
    out = DecodeInputs(
        torch.empty(bsz, **i64), torch.empty(bsz, **i64), torch.empty(bsz, **i64),
        torch.empty(bsz, **i32), torch.empty(bsz, **i32), torch.empty(bsz, **i64),
        torch.empty(bsz, **i64), torch.empty(bsz, dtype=torch.bool, device=dev),
        torch.empty(bsz, max_pages, **i32),
        None if embed is None else torch.empty(bsz, embed.shape[1], dtype=embed.dtype, device=dev),
    )
    if norm is not None:
        out.normed = torch.empty_like(out.embeds)
    if bsz == 0:
        return out
    hidden = embed.shape[1] if embed is not None else 1
    emb_out = out.embeds if out.embeds is not None else out.page_rows
    block_h, warps = _row_launch(hidden)
    _decode_inputs_kernel[(bsz, 1 + triton.cdiv(max_pages, block_p))](
        packed if staged is None else staged.address(), last, page_table, embed if embed is not None else page_table,
        norm.weight if norm is not None else page_table,
        out.normed if out.normed is not None else emb_out,
        out.input_ids, out.positions, out.out_cache_loc, out.seq_lens, out.prefix_lens, out.slots,
        out.steps, out.min_active.view(torch.int8), out.page_rows, emb_out,
        max_pages, hidden, norm.eps if norm is not None else 0.0,
        page_table.stride(0), out.page_rows.stride(0),
        embed.stride(0) if embed is not None else 0, emb_out.stride(0),
        staged.parity if staged is not None else packed, staged.pair.stride(0) if staged is not None else 0,
        FLAG=flag, HAS_EMB=embed is not None, HAS_NORM=norm is not None, BLOCK_P=block_p,
        BLOCK_H=block_h, STAGED=staged is not None, RELEASE=pdl.active(packed, kernels), num_warps=warps,
    )
    return out


@triton.jit
def _embed_norm_kernel(ids_ptr, emb_ptr, nw_ptr, out_ptr, normed_ptr, hidden, eps, stride_emb, stride_out,
                       BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    out = t.to(tl.int64) * stride_out
    _embed_norm_row(emb_ptr, tl.load(ids_ptr + t), stride_emb, out_ptr + out, normed_ptr + out, nw_ptr,
                    hidden, eps, True, BLOCK_H)


def embed_rms_norm_triton(
    ids: torch.Tensor, embed: torch.Tensor, norm: InputNorm
) -> tuple[torch.Tensor, torch.Tensor]:
    """As embed_rms_norm_ref; the rows of decode_inputs_triton's embeds / normed."""
    t, hidden = ids.shape[0], embed.shape[1]
    assert embed.stride(1) == 1 and ids.is_contiguous()
    rows = torch.empty((t, hidden), dtype=embed.dtype, device=embed.device)
    normed = torch.empty_like(rows)
    if t == 0:
        return rows, normed
    block_h, warps = _row_launch(hidden)
    _embed_norm_kernel[(t,)](ids, embed, norm.weight, rows, normed, hidden, norm.eps, embed.stride(0),
                             rows.stride(0), BLOCK_H=block_h, num_warps=warps)
    return rows, normed
