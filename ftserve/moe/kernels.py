"""Fixed-shape kernels of the expert cache, each with a torch twin (``*_ref``).

``fill_rows``: copy bank rows into slot rows, for a padded list of pairs
(src id, dst slot), -1 in either = skip. On CUDA the bank is pinned host
memory read over UVA (its address is passed as an int64 and cast to a pointer),
so the pairs can be decided on the device and the copy still runs inside a
captured graph.

``plan_layer``: place one MoE layer for a prefill chunk. Experts of the layer
already in the LRU cache are used where they are (no copy at all); the others
go to their row of a whole-layer buffer and are listed for ``fill_rows``::

    slot rows   [ 0 .. N-1 | N .. N+E-1 | N+E .. N+2E-1 | trash ]
                  LRU cache   buffer 0      buffer 1      (twins' "no slot" writes)

    pslot_of_id[j*E + e] = slot_of_id[j*E + e]   if cached
                         = N + b*E + e           otherwise (and src[e] = j*E + e)
    pid_of_slot[b*E + e] = j*E + e              (so reusing buffer b can unmap it)

Neither reads a device value on the host; shapes depend only on E and M.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_WORD = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}
_TL_WORD = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}


def _word_bytes(row_bytes: int) -> int:
    return next(w for w in (8, 4, 2, 1) if row_bytes % w == 0)


# ---------------------------------------------------------------- fill_rows


def fill_rows_ref(bank: torch.Tensor, slots: torch.Tensor, src_ids: torch.Tensor,
                  dst_slots: torch.Tensor) -> None:
    """slots[dst[i]] = bank[src[i]] where both >= 0. The last slot row is trash:
    skipped pairs write it, so the shapes stay fixed (no mask indexing)."""
    trash = slots.shape[0] - 1
    ok = (src_ids >= 0) & (dst_slots >= 0)  # [M]
    rows = bank.index_select(0, src_ids.clamp_min(0).long().to(bank.device))  # [M, R]
    dst = torch.where(ok, dst_slots.long(), trash)  # [M]
    slots.index_copy_(0, dst, rows.to(slots.device))


@triton.jit
def _fill_rows_kernel(bank, slots_ptr, src_ptr, dst_ptr, ROW_WORDS,
                      HOST_SRC: tl.constexpr, WORD: tl.constexpr, BLOCK: tl.constexpr):
    # Cast before any runtime branch so the name keeps one type (see bookkeeping).
    if HOST_SRC:
        # Host rows are 16-byte aligned (pinned, row bytes % 16 == 0 checked by
        # the launcher); the cast loses that, so restore it for vector loads.
        src_base = tl.multiple_of(bank.to(tl.pointer_type(WORD)), 16)
    else:
        src_base = bank
    i = tl.program_id(0)
    c = tl.program_id(1)
    src = tl.load(src_ptr + i).to(tl.int64)
    dst = tl.load(dst_ptr + i).to(tl.int64)
    if (src >= 0) & (dst >= 0):
        offs = c * BLOCK + tl.arange(0, BLOCK)
        m = offs < ROW_WORDS
        v = tl.load(src_base + src * ROW_WORDS + offs, mask=m)
        tl.store(slots_ptr + dst * ROW_WORDS + offs, v, mask=m)


def check_bank(bank: torch.Tensor) -> None:
    """What the UVA path needs of a host bank; checked once at start-up, since
    querying pointer attributes has no place inside a captured step."""
    assert bank.is_contiguous() and bank.is_pinned(), "the host bank must be pinned for UVA reads"
    assert bank.data_ptr() % 16 == 0, "the kernel assumes a 16-byte aligned bank"


def fill_rows(bank: torch.Tensor, slots: torch.Tensor, src_ids: torch.Tensor,
              dst_slots: torch.Tensor, *, bank_checked: bool = False) -> None:
    """One launch over the M pairs (src_ids / dst_slots [M] int32 on the slots' device).
    bank [rows, R] (pinned host memory on CUDA, see check_bank) -> slots [S, R], same dtype."""
    assert bank.dtype == slots.dtype and bank.shape[1] == slots.shape[1]
    m = src_ids.numel()
    if m == 0:
        return
    wb = _word_bytes(bank.shape[1] * bank.element_size())
    row_words = bank.shape[1] * bank.element_size() // wb
    host = slots.is_cuda and not bank.is_cuda
    if host and not bank_checked:
        check_bank(bank)
    src_arg: torch.Tensor | int = bank.data_ptr() if host else bank.view(_WORD[wb])
    block = min(8192, triton.next_power_of_2(row_words))
    _fill_rows_kernel[(m, triton.cdiv(row_words, block))](
        src_arg, slots.view(_WORD[wb]), src_ids, dst_slots, row_words,
        HOST_SRC=host, WORD=_TL_WORD[wb], BLOCK=block, num_warps=8,
    )


# ---------------------------------------------------------------- plan_layer


def plan_layer_ref(slot_of_id: torch.Tensor, pslot_of_id: torch.Tensor, pid_of_slot: torch.Tensor,
                   src: torch.Tensor, dst: torch.Tensor, layer: int, buf: int, base: int) -> None:
    """Twin of ``plan_layer``: fills pslot_of_id for layer ``layer``, the buffer's
    pid_of_slot range, and the copy list src [E] (-1 = cached) / dst [E]."""
    e = src.numel()
    ar = torch.arange(e, device=src.device, dtype=torch.int32)
    ids = layer * e + ar  # [E]
    cached = slot_of_id[layer * e:(layer + 1) * e]  # [E]
    buf_slots = base + buf * e + ar  # [E]
    pslot_of_id[layer * e:(layer + 1) * e] = torch.where(cached >= 0, cached, buf_slots)
    pid_of_slot[buf * e:(buf + 1) * e] = ids
    src.copy_(torch.where(cached >= 0, -1, ids))
    dst.copy_(buf_slots)


@triton.jit
def _plan_kernel(slot_of_id_ptr, pslot_of_id_ptr, pid_of_slot_ptr, src_ptr, dst_ptr,
                 layer, buf, base, E, BLOCK: tl.constexpr):
    e = tl.arange(0, BLOCK)
    m = e < E
    ids = layer * E + e
    cached = tl.load(slot_of_id_ptr + ids, mask=m, other=-1)
    buf_slots = base + buf * E + e
    tl.store(pslot_of_id_ptr + ids, tl.where(cached >= 0, cached, buf_slots), mask=m)
    tl.store(pid_of_slot_ptr + buf * E + e, ids, mask=m)
    tl.store(src_ptr + e, tl.where(cached >= 0, -1, ids), mask=m)
    tl.store(dst_ptr + e, buf_slots, mask=m)


def plan_layer(slot_of_id: torch.Tensor, pslot_of_id: torch.Tensor, pid_of_slot: torch.Tensor,
               src: torch.Tensor, dst: torch.Tensor, layer: int, buf: int, base: int) -> None:
    """One single-program launch; layer, buffer and base are host data."""
    e = src.numel()
    _plan_kernel[(1,)](slot_of_id, pslot_of_id, pid_of_slot, src, dst, layer, buf, base, e,
                       BLOCK=triton.next_power_of_2(e))
