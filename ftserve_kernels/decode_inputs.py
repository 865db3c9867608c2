"""A decode step's device inputs in one launch, from the graph's packed host row
per sequence (see ftserve/engine/cuda_graph.py). Twin: ``decode_inputs_ref``.

    packed [B, 7] int64: input id, position, KV slot, seq len, sampler slot
                         (| min_tokens flag), step, src row (-1: the host knows the id)

A batch-1 decode step on the H200 spent ~15 us in ~10 small torch launches
unpacking this (a transpose, the src-row substitution, casts, masks, the page
table rows' gather, the embedding); one program per (sequence, page-table
block) does it all::

    program (b, 0):   input_ids[b] = last[src] if src >= 0 else id; the scalar
                      fields; embeds[b] = embedding row of input_ids[b]
    program (b, j):   page_rows[b, block j - 1] = page_table[slot_b, block j - 1]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


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


def decode_inputs_ref(
    packed: torch.Tensor, last: torch.Tensor, page_table: torch.Tensor, embed: torch.Tensor | None,
    flag: int,
) -> DecodeInputs:
    g = packed.t()  # [7, B]
    src = g[6]
    prev = last.index_select(0, src.clamp(min=0))  # [B]
    ids = torch.where(src >= 0, prev, g[0])
    seq = g[3].to(torch.int32)
    slots = g[4] & (flag - 1)
    return DecodeInputs(
        ids, g[1].contiguous(), g[2].contiguous(), seq, seq - 1, slots, g[5].contiguous(),
        (g[4] & flag) != 0, page_table.index_select(0, slots),
        None if embed is None else embed.index_select(0, ids),
    )


@triton.jit
def _decode_inputs_kernel(
    packed_ptr, last_ptr, pt_ptr, emb_ptr,
    ids_ptr, pos_ptr, loc_ptr, seq_ptr, pre_ptr, slot_ptr, step_ptr, min_ptr, rows_ptr, out_emb_ptr,
    max_pages, hidden, stride_pt, stride_rows, stride_emb, stride_out_emb,
    FLAG: tl.constexpr, HAS_EMB: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr,
):
    b = tl.program_id(0)
    j = tl.program_id(1)
    row = packed_ptr + b * 7
    packed_slot = tl.load(row + 4)
    slot = packed_slot & (FLAG - 1)
    if j == 0:
        src = tl.load(row + 6)
        tok = tl.load(row + 0)
        if src >= 0:
            tok = tl.load(last_ptr + src)
        seq = tl.load(row + 3)
        tl.store(ids_ptr + b, tok)
        tl.store(pos_ptr + b, tl.load(row + 1))
        tl.store(loc_ptr + b, tl.load(row + 2))
        tl.store(seq_ptr + b, seq.to(tl.int32))
        tl.store(pre_ptr + b, (seq - 1).to(tl.int32))
        tl.store(slot_ptr + b, slot)
        tl.store(step_ptr + b, tl.load(row + 5))
        tl.store(min_ptr + b, ((packed_slot & FLAG) != 0).to(tl.int8))
        if HAS_EMB:
            h = tl.arange(0, BLOCK_H)
            for h0 in range(0, hidden, BLOCK_H):
                m = h0 + h < hidden
                v = tl.load(emb_ptr + tok * stride_emb + h0 + h, mask=m)
                tl.store(out_emb_ptr + b.to(tl.int64) * stride_out_emb + h0 + h, v, mask=m)
    else:
        p = (j - 1) * BLOCK_P + tl.arange(0, BLOCK_P)
        m = p < max_pages
        v = tl.load(pt_ptr + slot * stride_pt + p, mask=m)
        tl.store(rows_ptr + b.to(tl.int64) * stride_rows + p, v, mask=m)


def decode_inputs_triton(
    packed: torch.Tensor, last: torch.Tensor, page_table: torch.Tensor, embed: torch.Tensor | None,
    flag: int, block_p: int = 1024,
) -> DecodeInputs:
    """As decode_inputs_ref; fixed shapes (B, max_pages, H): graph-capturable."""
    assert packed.is_contiguous() and packed.shape[1] == 7 and page_table.stride(1) == 1
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
    if bsz == 0:
        return out
    hidden = embed.shape[1] if embed is not None else 1
    emb_out = out.embeds if out.embeds is not None else out.page_rows
    _decode_inputs_kernel[(bsz, 1 + triton.cdiv(max_pages, block_p))](
        packed, last, page_table, embed if embed is not None else page_table,
        out.input_ids, out.positions, out.out_cache_loc, out.seq_lens, out.prefix_lens, out.slots,
        out.steps, out.min_active.view(torch.int8), out.page_rows, emb_out,
        max_pages, hidden, page_table.stride(0), out.page_rows.stride(0),
        embed.stride(0) if embed is not None else 0, emb_out.stride(0),
        FLAG=flag, HAS_EMB=embed is not None, BLOCK_P=block_p,
        BLOCK_H=min(2048, triton.next_power_of_2(hidden)), num_warps=4,
    )
    return out
