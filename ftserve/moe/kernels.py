"""Fixed-shape kernels of the expert cache, each with a torch twin (``*_ref``).

``fill_rows``: copy bank rows into slot rows, for a padded list of pairs
(src id, dst slot), -1 in either = skip. On CUDA the bank is pinned host
memory read over UVA (its address is passed as an int64 and cast to a pointer),
so the pairs can be decided on the device and the copy still runs inside a
captured graph.

``plan_layer``: place one MoE layer for a prefill chunk. Experts of the layer
already in the LRU cache are used where they are (no copy at all); the others
are read from their row of a whole-layer buffer. The host has already queued
DMA copies (cudaMemcpyAsync on the copy stream: copy engines, no SMs) into that
buffer for every expert it believed uncached (``dma[e] = 1``, from a slightly
stale snapshot of the LRU map); the plan lists for ``fill_rows`` only the
experts the host skipped that are not cached after all (evicted since the
snapshot), normally none::

    slot rows   [ 0 .. N-1 | N .. N+E-1 | N+E .. N+2E-1 | trash ]
                  LRU cache   buffer 0      buffer 1      (twins' "no slot" writes)

    pslot_of_id[j*E + e] = slot_of_id[j*E + e]   if cached
                         = N + b*E + e           otherwise (src[e] = j*E + e if not dma[e])
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
def _fill_rows_kernel(bank, slots_ptr, src_ptr, dst_ptr, ROW_WORDS, CHUNKS,
                      HOST_SRC: tl.constexpr, WORD: tl.constexpr, BLOCK: tl.constexpr):
    # Program w = pair * CHUNKS + chunk copies that chunk of that pair's row.
    # Cast before any runtime branch so the name keeps one type (see bookkeeping).
    if HOST_SRC:
        # Host rows are 16-byte aligned (pinned, row bytes % 16 == 0 checked by
        # the launcher); the cast loses that, so restore it for vector loads.
        src_base = tl.multiple_of(bank.to(tl.pointer_type(WORD)), 16)
    else:
        src_base = bank
    w = tl.program_id(0)
    i = w // CHUNKS
    c = w % CHUNKS
    src = tl.load(src_ptr + i).to(tl.int64)
    dst = tl.load(dst_ptr + i).to(tl.int64)
    if (src >= 0) & (dst >= 0):
        offs = c * BLOCK + tl.arange(0, BLOCK)
        m = offs < ROW_WORDS
        v = tl.load(src_base + src * ROW_WORDS + offs, mask=m)
        tl.store(slots_ptr + dst * ROW_WORDS + offs, v, mask=m)


# One program copies a chunk of this many words (8 bytes each on expert rows: 64 KiB)
# with 8 warps: 50.2 GB/s from pinned memory on the H200, 91% of cudaMemcpy.
FILL_BLOCK_WORDS = 8192
FILL_WARPS = 8


def check_bank(bank: torch.Tensor) -> None:
    """What the UVA path needs of a host bank; checked once at start-up, since
    querying pointer attributes has no place inside a captured step."""
    assert bank.is_contiguous() and bank.is_pinned(), "the host bank must be pinned for UVA reads"
    assert bank.data_ptr() % 16 == 0, "the kernel assumes a 16-byte aligned bank"


def fill_rows(bank: torch.Tensor, slots: torch.Tensor, src_ids: torch.Tensor,
              dst_slots: torch.Tensor, *, bank_checked: bool = False,
              block_words: int = FILL_BLOCK_WORDS, num_warps: int = FILL_WARPS) -> None:
    """One launch over the M pairs (src_ids / dst_slots [M] int32 on the slots' device).
    bank [rows, R] (pinned host memory on CUDA, see check_bank) -> slots [S, R], same dtype.

    One program per (pair, 64 KiB chunk): a 9 MiB expert row is ~144 programs,
    so a few misses hold every SM until the copy is done, which is what a copy
    on the critical path wants."""
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
    block = min(block_words, triton.next_power_of_2(row_words))
    chunks = triton.cdiv(row_words, block)
    _fill_rows_kernel[(m * chunks,)](
        src_arg, slots.view(_WORD[wb]), src_ids, dst_slots, row_words, chunks,
        HOST_SRC=host, WORD=_TL_WORD[wb], BLOCK=block, num_warps=num_warps,
    )


# ---------------------------------------------------------------- plan_layer


def plan_layer_ref(slot_of_id: torch.Tensor, pslot_of_id: torch.Tensor, pid_of_slot: torch.Tensor,
                   src: torch.Tensor, dst: torch.Tensor, dma: torch.Tensor, counters: torch.Tensor,
                   layer: int, buf: int, base: int) -> None:
    """Twin of ``plan_layer``: fills pslot_of_id for layer ``layer``, the buffer's
    pid_of_slot range, the fallback copy list src [E] (-1 = nothing to copy) /
    dst [E], and adds to counters[2] (fallback copies) and counters[3] (experts
    of the layer not in the LRU cache, what a minimal plan must stream)."""
    e = src.numel()
    ar = torch.arange(e, device=src.device, dtype=torch.int32)
    ids = layer * e + ar  # [E]
    cached = slot_of_id[layer * e:(layer + 1) * e]  # [E]
    buf_slots = base + buf * e + ar  # [E]
    pslot_of_id[layer * e:(layer + 1) * e] = torch.where(cached >= 0, cached, buf_slots)
    pid_of_slot[buf * e:(buf + 1) * e] = ids
    fallback = (cached < 0) & (dma == 0)  # [E] the host did not copy it and it is not cached
    src.copy_(torch.where(fallback, ids, -1))
    dst.copy_(buf_slots)
    counters[2] += fallback.sum()
    counters[3] += (cached < 0).sum()


@triton.jit
def _plan_kernel(slot_of_id_ptr, pslot_of_id_ptr, pid_of_slot_ptr, src_ptr, dst_ptr, dma_ptr,
                 counters_ptr, layer, buf, base, E, BLOCK: tl.constexpr):
    e = tl.arange(0, BLOCK)
    m = e < E
    ids = layer * E + e
    cached = tl.load(slot_of_id_ptr + ids, mask=m, other=-1)
    dma = tl.load(dma_ptr + e, mask=m, other=1)
    buf_slots = base + buf * E + e
    fallback = m & (cached < 0) & (dma == 0)
    tl.store(pslot_of_id_ptr + ids, tl.where(cached >= 0, cached, buf_slots), mask=m)
    tl.store(pid_of_slot_ptr + buf * E + e, ids, mask=m)
    tl.store(src_ptr + e, tl.where(fallback, ids, -1), mask=m)
    tl.store(dst_ptr + e, buf_slots, mask=m)
    # One program: plain read-modify-write of the two counters is race-free
    # (the admission path only touches counters 0, 1 and 4).
    n_fb = tl.sum(fallback.to(tl.int64), 0)
    n_needed = tl.sum((m & (cached < 0)).to(tl.int64), 0)
    tl.store(counters_ptr + 2, tl.load(counters_ptr + 2) + n_fb)
    tl.store(counters_ptr + 3, tl.load(counters_ptr + 3) + n_needed)


def plan_layer(slot_of_id: torch.Tensor, pslot_of_id: torch.Tensor, pid_of_slot: torch.Tensor,
               src: torch.Tensor, dst: torch.Tensor, dma: torch.Tensor, counters: torch.Tensor,
               layer: int, buf: int, base: int) -> None:
    """One single-program launch; layer, buffer and base are host data, ``dma`` [E]
    int32 (1 = the host copies that expert's row into the buffer itself) is
    device data, counters [>= 4] int64."""
    e = src.numel()
    _plan_kernel[(1,)](slot_of_id, pslot_of_id, pid_of_slot, src, dst, dma, counters, layer, buf, base, e,
                       BLOCK=triton.next_power_of_2(e))


def host_runs(copy: list[bool]) -> list[tuple[int, int]]:
    """Maximal runs [a, z) of True in ``copy``: one DMA copy per run."""
    runs: list[tuple[int, int]] = []
    a = -1
    for i, c in enumerate([*copy, False]):
        if c and a < 0:
            a = i
        elif not c and a >= 0:
            runs.append((a, i))
            a = -1
    return runs


# ---------------------------------------------------------------- admission lists


def needed_ids_ref(ids: torch.Tensor, needed: torch.Tensor, counters: torch.Tensor, layer: int,
                   num_experts: int, lookup_idx: int) -> None:
    """Twin of ``needed_ids``. ids [T, k] (layer-local experts) -> needed [M] global
    ids for the admission kernel: the T*k ids themselves (repeats allowed, the
    admission dedups) when M = T*k <= E, else one entry per expert ([E], -1 =
    not selected). Adds the number of distinct experts to counters[lookup_idx]."""
    e = num_experts
    flat = ids.reshape(-1).long()  # [T*k]
    sel = torch.zeros(e, dtype=torch.int64, device=ids.device)
    sel.scatter_(0, flat, 1)  # [E] 1 = selected by some token
    if needed.numel() == flat.numel():
        needed.copy_(flat + layer * e)
    else:
        needed.copy_(torch.where(sel > 0, torch.arange(e, device=ids.device) + layer * e, -1))
    if lookup_idx >= 0:
        counters[lookup_idx] += sel.sum()


@triton.jit
def _needed_kernel(ids_ptr, needed_ptr, counters_ptr, base, P, E, LOOKUP_IDX: tl.constexpr,
                   LIST: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    e = tl.arange(0, BLOCK_E)
    em = e < E
    seen = tl.zeros([BLOCK_E], tl.int32)
    for p0 in range(0, P, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        pm = p < P
        v = tl.load(ids_ptr + p, mask=pm, other=-1)
        seen += tl.sum((v[None, :] == e[:, None]).to(tl.int32), 1)
        if LIST:
            tl.store(needed_ptr + p, v + base, mask=pm)
    present = em & (seen > 0)
    if not LIST:
        tl.store(needed_ptr + e, tl.where(present, e + base, -1), mask=em)
    if LOOKUP_IDX >= 0:
        tl.store(counters_ptr + LOOKUP_IDX,
                 tl.load(counters_ptr + LOOKUP_IDX) + tl.sum(present.to(tl.int64), 0))


def needed_ids(ids: torch.Tensor, needed: torch.Tensor, counters: torch.Tensor, layer: int,
               num_experts: int, lookup_idx: int) -> None:
    """One single-program launch (see ``needed_ids_ref``); lookup_idx -1 = no count."""
    p = ids.numel()
    _needed_kernel[(1,)](ids, needed, counters, layer * num_experts, p, num_experts,
                         LOOKUP_IDX=lookup_idx, LIST=needed.numel() == p,
                         BLOCK_E=triton.next_power_of_2(num_experts), CHUNK=16)


def count_valid_ref(x: torch.Tensor, counters: torch.Tensor, idx: int) -> None:
    """counters[idx] += number of entries of x that are >= 0."""
    counters[idx] += (x >= 0).sum()


@triton.jit
def _count_kernel(x_ptr, counters_ptr, N, IDX: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    v = tl.load(x_ptr + i, mask=i < N, other=-1)
    tl.store(counters_ptr + IDX, tl.load(counters_ptr + IDX) + tl.sum((v >= 0).to(tl.int64), 0))


def count_valid(x: torch.Tensor, counters: torch.Tensor, idx: int) -> None:
    """One single-program launch (three torch kernels otherwise)."""
    _count_kernel[(1,)](x, counters, x.numel(), IDX=idx, BLOCK=triton.next_power_of_2(x.numel()))
