"""Fixed-shape token-to-expert alignment for the grouped-GEMM MoE (moe_triton).

No host sync, no data-dependent shape. The N = T*k (token, choice) pairs are
grouped by expert, each expert's group padded to a multiple of BLOCK_M::

    sorted_ids  [ e0 e0 e0 pad | e3 e3 pad pad | e7 ... | pad pad ... ]
                  block 0        block 1         ...      (unused tail)
    block_expert [0, 3, 7, ..., -1, -1]      num_padded [1] on the device

Capacity is fixed at N + min(E, N) * (BLOCK_M - 1) rows (every non-empty expert
wastes at most BLOCK_M - 1), so the grid is sized from host shapes; blocks past
``num_padded`` exit at once. Entries hold the flat pair id ``t*k + j``; padding
holds N. The grouping is stable (pairs keep their order inside an expert) and
uses no atomics: the pairs are cut into chunks; each program places one chunk
at expert start + the counts of earlier chunks + the rank inside its chunk
(counts come from a per-chunk histogram pass past a few thousand pairs, else
every program counts all ids itself: one launch for decode).

``valid_rows`` (a [1] device tensor): only the first valid_rows tokens' pairs
are grouped; the rest belong to no expert, as ids outside [0, E) do. A captured
prefill graph pads its bucket with rows of garbage (engine/prefill_graph.py)
whose routing would otherwise scatter over the experts: a 16-token step in a
256-token bucket then read nearly every expert's weights, and a half-full
bucket spent half its expert GEMMs on padding.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _pair_limit(valid_ptr, N, K, HAS_VALID: tl.constexpr):
    # Pairs at or past this index are dropped (moe_align's valid_rows).
    if HAS_VALID:
        return tl.minimum(N, tl.load(valid_ptr).to(tl.int32) * K)
    return N


@triton.jit
def _chunk_ids(ids_ptr, offs, lim, BLOCK_E: tl.constexpr):
    # A chunk's expert ids and which of them are grouped (past lim, or outside
    # [0, BLOCK_E): no expert's).
    ids = tl.load(ids_ptr + offs, mask=offs < lim, other=-1)
    return ids, (ids >= 0) & (ids < BLOCK_E)


@triton.jit
def _align_hist_kernel(ids_ptr, hist_ptr, valid_ptr, N, K, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
                       HAS_VALID: tl.constexpr):
    # Large N only: per-chunk expert counts hist[c, e], plain stores (no atomics,
    # so no zeroed buffer and no extra launch to zero it).
    c = tl.program_id(0)
    ids, ok = _chunk_ids(ids_ptr, c * CHUNK + tl.arange(0, CHUNK), _pair_limit(valid_ptr, N, K, HAS_VALID),
                         BLOCK_E)
    tl.store(hist_ptr + c * BLOCK_E + tl.arange(0, BLOCK_E), tl.histogram(ids, BLOCK_E, mask=ok))


@triton.jit
def _align_place_kernel(
    ids_ptr, hist_ptr, sorted_ptr, block_expert_ptr, total_ptr, valid_ptr,
    N, K, MAX_ROWS, MAX_BLOCKS, ROWS_PER_PROG, BLOCKS_PER_PROG, EXPERTS_PER_PROG,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, HIST_ROWS: tl.constexpr,
    FILL: tl.constexpr, PRECOUNTED: tl.constexpr, HAS_VALID: tl.constexpr,
    E_TILE: tl.constexpr = 16, TAIL: tl.constexpr = 256,
):
    # Program c: (1) counts per expert over all pairs and over chunks before c,
    # (2) places the pairs of chunk c at expert start + earlier chunks' count +
    # rank inside the chunk (stable: pair order within an expert), (3) writes the
    # sentinel into the padding rows of its share of experts (each fewer than
    # BLOCK_M, after the expert's pairs) and of its share of rows past the last
    # expert, and its share of block -> expert entries.
    # A chunk is placed SUB pairs at a time: a pair's rank is the number of
    # earlier pairs of its expert in the sub-chunk ([SUB, SUB] compares), its
    # expert's next free row is gathered from the [E] vector, which then moves
    # on by the sub-chunk's histogram. No [SUB, E] one-hot tile and no cumsum
    # over it, whose cost grew with the expert count (512 for qwen3-next).
    SUB: tl.constexpr = CHUNK if CHUNK <= 128 else 128
    c = tl.program_id(0)
    nchunks = tl.num_programs(0)
    e = tl.arange(0, BLOCK_E)
    lim = _pair_limit(valid_ptr, N, K, HAS_VALID)
    totals = tl.zeros([BLOCK_E], tl.int32)
    before = tl.zeros([BLOCK_E], tl.int32)
    if PRECOUNTED:
        hr = tl.arange(0, HIST_ROWS)
        for c0 in range(0, nchunks, HIST_ROWS):
            rows = c0 + hr
            h = tl.load(hist_ptr + rows[:, None] * BLOCK_E + e[None, :],
                        mask=rows[:, None] < nchunks, other=0)  # [HIST_ROWS, E]
            totals += tl.sum(h, 0)
            before += tl.sum(tl.where(rows[:, None] < c, h, 0), 0)
    else:
        for c0 in range(0, nchunks):
            ids, ok = _chunk_ids(ids_ptr, c0 * CHUNK + tl.arange(0, CHUNK), lim, BLOCK_E)
            cnt = tl.histogram(ids, BLOCK_E, mask=ok)  # [E]
            totals += cnt
            before += cnt * (c0 < c).to(tl.int32)
    padded = tl.cdiv(totals, BLOCK_M) * BLOCK_M  # [E]
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    total = tl.sum(padded, 0)
    tl.store(total_ptr, total, mask=c == 0)
    base = starts + before  # [E] next free row of each expert for this program
    jj = tl.arange(0, SUB)
    earlier = jj[None, :] < jj[:, None]  # [S, S]: pair j comes before pair i
    for s0 in range(0, CHUNK, SUB):
        offs = c * CHUNK + s0 + jj
        ids, ok = _chunk_ids(ids_ptr, offs, lim, BLOCK_E)
        rank = tl.sum(((ids[:, None] == ids[None, :]) & earlier).to(tl.int32), 1)  # [S]
        dest = tl.gather(base, tl.where(ok, ids, 0), 0) + rank
        # An id outside [0, E) belongs to no expert: dropped, never written over row 0.
        tl.store(sorted_ptr + dest, offs, mask=ok)
        base += tl.histogram(ids, BLOCK_E, mask=ok)
    pad_lo = starts + totals  # [E] first padding row of each expert
    # An expert's padding, rows pad_lo..end: its bounds picked out of the [E]
    # vectors for E_TILE experts at a time ([E_TILE, E] selects; testing every
    # row against every expert's range was [rows, E] compares, most of a
    # 512-expert prefill's alignment).
    et = tl.arange(0, E_TILE)
    j = tl.arange(0, BLOCK_M)
    e_begin = c * EXPERTS_PER_PROG
    e_end = tl.minimum(e_begin + EXPERTS_PER_PROG, BLOCK_E)
    for e0 in range(e_begin, e_end, E_TILE):
        ee = e0 + et  # [ET]
        sel = e[None, :] == ee[:, None]  # [ET, E]
        lo = tl.sum(tl.where(sel, pad_lo[None, :], 0), 1)  # [ET]
        hi = tl.sum(tl.where(sel, ends[None, :], 0), 1)
        rows = lo[:, None] + j[None, :]  # [ET, BLOCK_M]
        tl.store(sorted_ptr + rows, tl.zeros([E_TILE, BLOCK_M], tl.int32) + N,
                 mask=(rows < hi[:, None]) & (ee < e_end)[:, None])
    r_begin = c * ROWS_PER_PROG
    r_end = tl.minimum(r_begin + ROWS_PER_PROG, MAX_ROWS)
    t = tl.arange(0, TAIL)
    for r0 in range(tl.maximum(r_begin, total), r_end, TAIL):  # the unused tail
        rows = r0 + t
        tl.store(sorted_ptr + rows, tl.zeros([TAIL], tl.int32) + N, mask=rows < r_end)
    f = tl.arange(0, FILL)
    b_begin = c * BLOCKS_PER_PROG
    b_end = tl.minimum(b_begin + BLOCKS_PER_PROG, MAX_BLOCKS)
    for b0 in range(b_begin, b_end, FILL):
        blk = b0 + f
        first_row = blk * BLOCK_M
        owner = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), 1)  # [F]
        owner = tl.where(first_row < total, owner, -1)
        tl.store(block_expert_ptr + blk, owner, mask=blk < b_end)


_PRECOUNT_MIN = 4096  # pairs; past it a histogram pass beats every program counting all ids


@functools.lru_cache(maxsize=256)
def _align_plan(n: int, num_experts: int, block_m: int, chunk: int = 0) -> tuple[int, ...]:
    """Host-only sizes for moe_align, cached: (max_rows, max_blocks, BLOCK_E, chunk,
    chunks, rows per program, blocks per program, experts per program). ``chunk`` (a power of two,
    0: the default below) is the pairs per program, a tuned-table field."""
    max_rows = triton.cdiv(n + min(num_experts, n) * (block_m - 1), block_m) * block_m
    max_blocks = max_rows // block_m
    block_e = triton.next_power_of_2(num_experts)
    # Chunks of at least 128 pairs (every program reads all [chunks, E] counts,
    # so chunks must stay few), more for few experts (16k / E pairs): the counts
    # to read shrink with E, a program's placement grows with its chunk.
    default = max(16, min(triton.next_power_of_2(n), max(128, 16384 // block_e)))
    assert chunk & (chunk - 1) == 0, f"align chunk {chunk} is not a power of two"
    chunk = max(default, min(chunk, triton.next_power_of_2(n)))
    chunks = triton.cdiv(n, chunk)
    return (max_rows, max_blocks, block_e, chunk, chunks,
            triton.cdiv(max_rows, chunks), triton.cdiv(max_blocks, chunks), triton.cdiv(block_e, chunks))


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, chunk: int = 0,
    valid_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted_ids [R] int32, block_expert [R / block_m] int32,
    num_padded [1] int32), R = N + min(E, N) * (block_m - 1) rounded up to block_m.
    One launch up to _PRECOUNT_MIN pairs (decode), two past it. ``chunk``: pairs
    per program (0: default; never below it); the result does not depend on it.
    ``valid_rows`` [1] int: group only the pairs of rows below it (module doc)."""
    n = topk_ids.numel()
    k = topk_ids.shape[-1] if topk_ids.dim() > 1 else 1
    dev = topk_ids.device
    max_rows, max_blocks, block_e, chunk, chunks, rows_pp, blocks_pp, experts_pp = _align_plan(
        n, num_experts, block_m, chunk)
    ids = topk_ids.reshape(-1)
    sorted_ids = torch.empty(max_rows, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    total = torch.empty(1, dtype=torch.int32, device=dev)
    precount = n > _PRECOUNT_MIN
    hist = total  # unread unless precount
    has_valid = valid_rows is not None
    valid = valid_rows if has_valid else total  # unread without HAS_VALID
    if precount:
        hist = torch.empty((chunks, block_e), dtype=torch.int32, device=dev)
        _align_hist_kernel[(chunks,)](ids, hist, valid, n, k, BLOCK_E=block_e, CHUNK=chunk, HAS_VALID=has_valid)
    _align_place_kernel[(chunks,)](
        ids, hist, sorted_ids, block_expert, total, valid, n, k, max_rows, max_blocks, rows_pp, blocks_pp,
        experts_pp, BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=chunk, HIST_ROWS=max(1, 4096 // block_e),
        FILL=max(16, 8192 // block_e), PRECOUNTED=precount, HAS_VALID=has_valid,
        E_TILE=max(2, min(16, triton.next_power_of_2(experts_pp))),
        num_warps=8 if chunk >= 128 else 4,  # [128, 128] rank compares a sub-chunk
    )
    return sorted_ids, block_expert, total
