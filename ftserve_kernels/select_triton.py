"""The n best tokens of each row without a sort or torch.topk: a three-level
radix select over the logits' order keys, then one compaction. Feeds the
sort-free filters (filter_triton) their candidates. Twin: ``top_candidates_ref``
(torch.topk; any tie choice at the n-th key is a valid answer, see below).

torch.topk of [1, 151,936] took 59-74 us on the H200 (k 64-256; 155-168 us at
B = 64), most of a 70 us sampled step's sampler. Here, with u the 32-bit
unsigned order key of a logit (float order; -0.0 = +0.0)::

    zero      H1, H2, H3 [B, 2048] int32 and two counters per row (one memset)
    level 1   program (row, chunk): histogram of u >> 21           -> atomics into H1[row]
    level 2   each program finds bin b1 that holds the n-th key (H1's suffix sums),
              histogram of (u >> 10) & 2047 over the keys in b1     -> H2[row]
    level 3   likewise b2, histogram of u & 1023 over b1:b2's keys  -> H3[row]
    compact   b3 -> t = the n-th largest key exactly; keys > t (fewer than n) take
              slots from one counter, keys == t fill the rest from another

Every level rereads the row (600 KB at Qwen3's vocabulary: from L2) and only
bins a program saw are added, so the atomics are few. The result is the set
torch.topk returns up to which tokens tied at t are taken (the slots' order
differs, and neither is sorted). filter_triton's cut is exact for any such
choice: every token left out scores at most t, the lowest candidate, and a cut
at t takes its ties in id order from a pass over the whole row.
Fixed shapes, no host reads: capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftserve_kernels.sampling import vocab_chunks

BINS = 2048  # levels 1 and 2: 11 bits each; level 3: 10 bits


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
    LEVEL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    start = tl.program_id(1) * chunk
    logits_row = logits_ptr + row.to(tl.int64) * stride_row
    h1 = work_ptr + row * stride_work  # H1 | H2 | H3 | the two counters
    h2 = h1 + 2048
    h3 = h2 + 2048
    count_ptr = h3 + 2048
    prefix = tl.zeros([], tl.int64)  # the key bits fixed by the levels before this one
    need = n
    if LEVEL >= 2:
        b1, above = _bin_of(h1, need, 2048)
        prefix = b1.to(tl.int64)
        need = n - above
    if LEVEL >= 3:
        b2, above2 = _bin_of(h2, need, 2048)
        prefix = prefix * 2048 + b2
        need = need - above2
    if LEVEL <= 3:
        # Histogram of this level's bits over the keys under ``prefix``; others go
        # to the dummy bins at and past 2048 (no mask: triton 3.6's histogram).
        acc = tl.zeros([2 * 2048], tl.int32)
        for off in range(start, start + chunk, BLOCK):
            idx = off + tl.arange(0, BLOCK)
            ok = idx < V
            u = _order_keys(logits_row, idx, ok)
            if LEVEL == 1:
                bins = u >> 21
                mine = ok
            elif LEVEL == 2:
                bins = (u >> 10) & 2047
                mine = ok & ((u >> 21) == prefix)
            else:
                bins = u & 1023
                mine = ok & ((u >> 10) == prefix)
            acc += tl.histogram(tl.where(mine, bins, 2048).to(tl.int32), 2 * 2048)
        r = tl.arange(0, 2 * 2048)
        dst = h1 if LEVEL == 1 else (h2 if LEVEL == 2 else h3)
        tl.atomic_add(dst + r, acc, mask=(r < 2048) & (acc > 0), sem="relaxed")
    else:
        b3, above3 = _bin_of(h3, need, 2048)
        t = prefix * 1024 + b3  # the n-th largest key
        n_above = n - need + above3  # keys > t: fewer than n
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
            at_eq = n_above + base_eq + tl.cumsum(eq, 0) - 1
            dst = tl.where(gt > 0, at_gt, at_eq)
            keep = ((gt > 0) | (eq > 0)) & (dst < n)
            tl.store(out_ptr + row * stride_out + dst, idx.to(tl.int64), mask=keep)


def top_candidates_triton(
    logits: torch.Tensor,  # [B, V] any float dtype, unit stride along V
    n: int,
    block: int = 1024,
    target_programs: int = 132,
) -> torch.Tensor:
    """-> [B, n] int64: the ids of each row's n largest logits, unsorted (see the
    module for the choice among ties at the n-th)."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and 0 < n
    if n >= vocab:
        return torch.arange(vocab, device=logits.device).expand(rows, vocab).contiguous()
    out = torch.empty(rows, n, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    work = torch.zeros(rows, 3 * BINS + 2, dtype=torch.int32, device=logits.device)
    chunk, num_chunks = vocab_chunks(rows, vocab, block, target_programs)
    for level in (1, 2, 3, 4):
        _select_kernel[(rows, num_chunks)](
            logits, work, out, vocab, n, logits.stride(0), work.stride(0), out.stride(0), chunk,
            LEVEL=level, BLOCK=block, num_warps=4,
        )
    return out
