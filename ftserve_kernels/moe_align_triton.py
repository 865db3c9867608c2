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
def _align_hist_kernel(ids_ptr, hist_ptr, valid_ptr, N, K, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
                       HAS_VALID: tl.constexpr):
    # Large N only: per-chunk expert counts hist[c, e], plain stores (no atomics,
    # so no zeroed buffer and no extra launch to zero it).
    # Sub-chunks keep the [SUB, E] one-hot tile near 16k elements (as _align_place_kernel).
    SUB: tl.constexpr = CHUNK if CHUNK * BLOCK_E <= 16384 else (16384 // BLOCK_E if BLOCK_E >= 128 else 128)
    c = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    lim = _pair_limit(valid_ptr, N, K, HAS_VALID)
    cnt = tl.zeros([BLOCK_E], tl.int32)
    for s0 in range(0, CHUNK, SUB):
        offs = c * CHUNK + s0 + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + offs, mask=offs < lim, other=-1)
        cnt += tl.sum((ids[:, None] == e[None, :]).to(tl.int32), 0)  # [E]
    tl.store(hist_ptr + c * BLOCK_E + e, cnt)


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
    # A chunk is walked in sub-chunks of SUB pairs: one-hot tiles [SUB, E] stay
    # near 16k elements while a large CHUNK keeps the chunk count (every program
    # reads all chunks' counts) small. SUB == CHUNK for the default plan up to 128
    # experts; past them the default's 128-pair chunks are cut too: the rank's
    # cumsum over [SUB, E] may be laid out with warps along SUB, and then its
    # scratch is the whole tile in shared memory (E=512: [128, 512] int32 is
    # 256 KiB, over Hopper's 227 KiB; [32, 512] is 64 KiB).
    SUB: tl.constexpr = CHUNK if CHUNK * BLOCK_E <= 16384 else (16384 // BLOCK_E if BLOCK_E >= 128 else 128)
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
        j = tl.arange(0, SUB)
        for c0 in range(0, nchunks):
            for s0 in range(0, CHUNK, SUB):
                p = c0 * CHUNK + s0 + j
                ids = tl.load(ids_ptr + p, mask=p < lim, other=-1)
                cnt = tl.sum((ids[:, None] == e[None, :]).to(tl.int32), 0)  # [E]
                totals += cnt
                before += cnt * (c0 < c).to(tl.int32)
    padded = tl.cdiv(totals, BLOCK_M) * BLOCK_M  # [E]
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    total = tl.sum(padded, 0)
    tl.store(total_ptr, total, mask=c == 0)
    base = starts + before  # [E] next free row of each expert for this program
    for s0 in range(0, CHUNK, SUB):
        offs = c * CHUNK + s0 + tl.arange(0, SUB)
        m = offs < lim
        ids = tl.load(ids_ptr + offs, mask=m, other=-1)
        onehot = (ids[:, None] == e[None, :]).to(tl.int32)  # [S, E]
        rank = tl.cumsum(onehot, 0) - onehot  # [S, E] earlier pairs of the same expert in the sub-chunk
        dest = tl.sum(onehot * (base[None, :] + rank), 1)  # [S]
        # An id outside [0, E) belongs to no expert: dropped, never written over row 0.
        tl.store(sorted_ptr + dest, offs, mask=m & (tl.sum(onehot, 1) > 0))
        base += tl.sum(onehot, 0)
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
    # [chunk, E] one-hot tiles of about 16k elements, but chunks of at least 128
    # pairs: every program reads all [chunks, E] counts, so chunks must stay few.
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
        num_warps=8 if min(chunk, 16384 // block_e) * block_e > 4096 else 4,
    )
    return sorted_ids, block_expert, total
