"""The n best tokens of each row without a sort or torch.topk: a radix select
over the logits' order keys, four levels of 8 bits, then one compaction. Feeds
the sort-free filters (filter_triton) their candidates at small batches. Twin:
``top_candidates_ref`` (torch.topk; any tie choice at the n-th key is a valid
answer, see below).

With u the 32-bit unsigned order key of a logit (float order; -0.0 = +0.0)::

    zero      H0..H3 [B, 256] int32 and two counters per row (one memset)
    level 0   program (row, chunk): histogram of u >> 24 -> atomics into H0[row]
    level l   each program finds, from H0..H(l-1)'s suffix sums, the bins that
              hold the n-th key (the key's top 8l bits), and counts the next 8
              bits of the keys under that prefix -> Hl[row]
    compact   H3 fixes the last bits: t = the n-th largest key exactly; keys > t
              (fewer than n) take slots from one counter, keys == t fill the
              rest from the other

Every level rereads the row (600 KB at Qwen3's vocabulary: from L2) and only
bins a program saw are added, so the atomics are few. The result is the set
torch.topk returns up to which tokens tied at t are taken (the slots' order
differs, and neither is sorted). filter_triton's cut is exact for any such
choice: every token left out scores at most t, the lowest candidate, and a cut
at t takes its ties in id order from a pass over the whole row.

It beats torch.topk at small batches and loses at large ones (the per-key
histogram work grows with the batch while topk's does not), so filter_triton
takes this up to RADIX_MAX_ROWS rows. Levels are 8 bits: tl.histogram's cost
grows with its bins, and counting bins by comparisons is slower still.
Fixed shapes, no host reads: capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftserve_kernels.sampling import vocab_chunks


def top_candidates_ref(logits: torch.Tensor, n: int) -> torch.Tensor:
    """[B, n] int64: ids of each row's n largest logits (unsorted)."""
    return logits.topk(n, dim=-1, sorted=False).indices


@triton.jit
def _order_keys(logits_row, idx, ok):
    """u [BLOCK] int64 in [0, 2^32): the logits' float order (masked lanes: 0)."""
    v = tl.load(logits_row + idx, mask=ok, other=float("-inf")).to(tl.float32)
    b = (v + 0.0).to(tl.int32, bitcast=True)
    key = tl.where(b >= 0, b, b ^ 0x7FFFFFFF)
    return tl.where(ok, key.to(tl.int64) + 2147483648, 0)


@triton.jit
def _bin_of(hist_row, need, NB: tl.constexpr):
    """(b, above): the highest bin whose suffix count reaches ``need``, and the
    count of the bins above it."""
    r = tl.arange(0, NB)
    h = tl.load(hist_row + r)
    total = tl.sum(h, 0)
    suffix = total - tl.cumsum(h, 0) + h  # [NB] keys in bins >= r
    b = tl.sum((suffix >= need).to(tl.int32), 0) - 1
    above = tl.sum(tl.where(r > b, h, 0), 0)
    return b, above


@triton.jit
def _select_kernel(
    logits_ptr, work_ptr, out_ptr,
    V, n, stride_row, stride_work, stride_out, chunk,
    LEVEL: tl.constexpr, LEVELS: tl.constexpr, BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """LEVEL < LEVELS: count this level's bins; LEVEL == LEVELS: compact."""
    NB: tl.constexpr = 1 << BITS
    row = tl.program_id(0)
    start = tl.program_id(1) * chunk
    logits_row = logits_ptr + row.to(tl.int64) * stride_row
    hist = work_ptr + row * stride_work  # LEVELS histograms of NB bins | the two counters
    count_ptr = hist + LEVELS * NB
    prefix = tl.zeros([], tl.int64)  # the key bits the levels before this one fixed
    need = n + tl.zeros([], tl.int32)  # rank of the n-th key among the keys under prefix
    n_above = tl.zeros([], tl.int32)  # keys above the prefix's range
    for lv in tl.static_range(LEVEL):
        b, above = _bin_of(hist + lv * NB, need, NB)
        prefix = prefix * NB + b
        need = need - above
        n_above += above
    shift: tl.constexpr = 32 - (LEVEL + 1) * BITS  # this level's bits: u >> shift, NB of them
    top: tl.constexpr = 32 - LEVEL * BITS  # bits of u below the prefix
    if LEVEL < LEVELS:
        acc = tl.zeros([NB], tl.int32)
        r = tl.arange(0, NB)
        for off in range(start, start + chunk, BLOCK):
            idx = off + tl.arange(0, BLOCK)
            ok = idx < V
            u = _order_keys(logits_row, idx, ok)
            if LEVEL == 0:
                mine = ok
            else:
                mine = ok & ((u >> top) == prefix)
            bins = ((u >> shift) & (NB - 1)).to(tl.int32)
            # The other keys (and lanes past V) are counted in bin 0, then taken
            # out again: no histogram mask (triton 3.6), no dummy bins.
            others = BLOCK - tl.sum(mine.to(tl.int32), 0)
            acc += tl.histogram(tl.where(mine, bins, 0), NB) - tl.where(r == 0, others, 0)
        tl.atomic_add(hist + LEVEL * NB + r, acc, mask=acc > 0, sem="relaxed")
    else:
        t = prefix  # the n-th largest key: every level fixed its bits
        for off in range(start, start + chunk, BLOCK):
            idx = off + tl.arange(0, BLOCK)
            ok = idx < V
            u = _order_keys(logits_row, idx, ok)
            gt = (ok & (u > t)).to(tl.int32)
            eq = (ok & (u == t)).to(tl.int32)
            n_gt = tl.sum(gt, 0)
            n_eq = tl.sum(eq, 0)
            base_gt = tl.atomic_add(count_ptr, n_gt, sem="relaxed")
            base_eq = tl.atomic_add(count_ptr + 1, n_eq, sem="relaxed")
            at_gt = base_gt + tl.cumsum(gt, 0) - 1
            at_eq = n_above + base_eq + tl.cumsum(eq, 0) - 1  # n_above: keys > t, fewer than n
            dst = tl.where(gt > 0, at_gt, at_eq)
            keep = ((gt > 0) | (eq > 0)) & (dst < n)
            tl.store(out_ptr + row * stride_out + dst, idx.to(tl.int64), mask=keep)


def top_candidates_triton(
    logits: torch.Tensor,  # [B, V] any float dtype, unit stride along V
    n: int,
    block: int = 512,
    target_programs: int = 2048,
    bits: int = 8,
) -> torch.Tensor:
    """-> [B, n] int64: the ids of each row's n largest logits, unsorted (see the
    module for the choice among ties at the n-th). ``bits`` per level (levels =
    32 / bits)."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and 0 < n
    if n >= vocab:
        return torch.arange(vocab, device=logits.device).expand(rows, vocab).contiguous()
    out = torch.empty(rows, n, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    assert 32 % bits == 0, "levels of equal width"
    levels = 32 // bits
    work = torch.zeros(rows, levels * (1 << bits) + 2, dtype=torch.int32, device=logits.device)
    chunk, num_chunks = vocab_chunks(rows, vocab, block, target_programs)
    for level in range(levels + 1):
        _select_kernel[(rows, num_chunks)](
            logits, work, out, vocab, n, logits.stride(0), work.stride(0), out.stride(0), chunk,
            LEVEL=level, LEVELS=levels, BITS=bits, BLOCK=block, num_warps=4,
        )
    return out
