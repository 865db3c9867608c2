"""Top-k / top-p / min-p without sorting the vocabulary, for steps whose rows'
top-k are short (at most SHORT_K): the sampler's ``filtering`` stage set when
no row needs the whole sorted vocabulary (``wide_filter`` keeps the sort).

The reference (sampling.top_k_top_p_keep & min_p_keep, on the scores after the
stop mask and the temperature) sorts every row (score descending, id ascending
on ties), keeps the first k, then the tokens whose strictly-better mass
(renormalized over those k) is below top_p, then the tokens within log(min_p)
of the max. With k <= SHORT_K only the head of that order matters, and the
kept set is a prefix of it, i.e. a *cut* (key, id): every token scoring above
the cut's score, and the tokens scoring exactly that whose id is at most id::

    order:  s0 > s1 > s2 = s2' = s2'' > s3 ...      cut = (s2, id of s2')
    kept:   s0   s1   s2   s2'                        (ties kept in id order)

1. the C = SHORT_K + M best raw logits per row (M = the stop-id columns, which
   may mask some of them): select_triton's radix select up to RADIX_MAX_ROWS
   rows, else torch.topk; not a sort;
2. ``filter_cuts_triton``, one program per row: the candidates' scores as the
   reference computes them (stop mask, then / temperature), packed with their
   ids into int64 keys whose order is (score desc, id asc), ``tl.sort``-ed;
   softmax over the first k, exclusive cumsum, the last token whose mass
   before it is below top_p -> the cut; max + log(min_p) -> the floor. The
   candidates hold every token scoring above the C-th candidate's score, so
   the cut is exact unless its score *equals* that lowest one: then tokens
   outside the candidates may tie with it, and one more pass over the row
   finds the id of the n-th tie in id order (rare: n is known from the masses);
3. greedy_triton's temperature mode applies the cut in registers (``cuts=``).

``apply_cuts_ref`` is the cut as a keep mask in torch. Masses follow the
reference's operations (softmax, inclusive cumsum in sorted order, minus the
token's own); a scan's summation order can differ from torch's in the last
bit, which moves the cut only when a token's mass before it sits within that
of top_p. Fixed shapes, no host reads: capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftserve_kernels.sampling import SHORT_K  # a row with a longer top-k (or top-p alone) is "wide"
from ftserve_kernels.select_triton import top_candidates_ref, top_candidates_triton

# Up to this many rows select_triton's radix select beats torch.topk on the H200
# (21.5 vs 54.4 us at B = 1, 50.8 vs 68.2 at 8; 238 vs 152 at 64).
RADIX_MAX_ROWS = 8
NEG_KEY = -(2**31)  # below every float's key: "no cut"
NEG_KEY_TL = tl.constexpr(NEG_KEY)


def float_keys(s: torch.Tensor) -> torch.Tensor:
    """fp32 -> int32 keys in the floats' order (-0.0 and +0.0 equal), as the kernels."""
    b = (s.float() + 0.0).view(torch.int32)
    return torch.where(b >= 0, b, b ^ 0x7FFFFFFF)


def apply_cuts_ref(
    scaled: torch.Tensor,  # [B, V] fp32
    cut_key: torch.Tensor,  # [B] int32
    cut_id: torch.Tensor,  # [B] int32
    floor: torch.Tensor,  # [B] fp32
) -> torch.Tensor:
    """The keep mask the cuts describe: [B, V] bool."""
    key = float_keys(scaled)  # [B, V]
    ids = torch.arange(scaled.shape[1], device=scaled.device)[None, :]
    ck = cut_key[:, None]
    prefix = (key > ck) | ((key == ck) & (ids <= cut_id[:, None]))
    return prefix & (scaled >= floor[:, None])


def num_candidates(vocab: int, stop_columns: int) -> int:
    return min(vocab, SHORT_K + stop_columns)


@triton.jit
def _float_key(s):
    b = (s + 0.0).to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def _scores(logits_row, idx, ok, masked, n_stops, stops_ptr, temp):
    """The reference's scores at ``idx``: logits, the stop ids -> -inf on rows below
    min_tokens, / temperature (round-to-nearest, as torch's division); and the
    scores without the stop mask."""
    v = tl.load(logits_row + idx, mask=ok, other=float("-inf")).to(tl.float32)
    plain = tl.math.div_rn(v, temp)
    if masked:
        for j in range(n_stops):
            v = tl.where(idx == tl.load(stops_ptr + j), float("-inf"), v)
    return tl.math.div_rn(v, temp), plain


@triton.jit
def _cuts_kernel(
    logits_ptr, cand_ptr, slots_ptr, min_ptr, itab_ptr, ftab_ptr,
    cut_key_ptr, cut_id_ptr, floor_ptr, min_temperature,
    V, n_cand, stride_row, stride_cand, stride_itab, stride_ftab,
    NI: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    itab_row = itab_ptr + slot * stride_itab
    ftab_row = ftab_ptr + slot * stride_ftab
    masked = tl.load(min_ptr + row) != 0
    n_stops = tl.load(itab_row + NI - 1)
    k = tl.load(itab_row + 1)  # top_k, V when off
    temp = tl.maximum(tl.load(ftab_row), min_temperature)
    p = tl.load(ftab_row + 1)
    min_p = tl.load(ftab_row + 2)
    logits_row = logits_ptr + row.to(tl.int64) * stride_row
    r = tl.arange(0, C)
    have = r < n_cand
    ids = tl.load(cand_ptr + row * stride_cand + r, mask=have, other=0)  # [C] int64
    s, plain = _scores(logits_row, ids, have, masked, n_stops, itab_row + NI, temp)  # [C] each
    # (score desc, id asc) as one int64 order; padding sorts last.
    packed = _float_key(s).to(tl.int64) * 4294967296 + (4294967295 - ids)
    packed = tl.sort(tl.where(have, packed, -9223372036854775807), descending=True)
    key = (packed >> 32).to(tl.int32)  # [C] sorted
    sid = (4294967295 - (packed & 4294967295)).to(tl.int32)
    b = tl.where(key >= 0, key, key ^ 0x7FFFFFFF)
    ss = b.to(tl.float32, bitcast=True)  # sorted scores
    top = tl.max(tl.where(have, ss, float("-inf")), 0)
    # Every token outside the candidates scores at most the lowest candidate's
    # unmasked score (the topk is of the raw logits; / temperature keeps the order).
    low_key = tl.min(tl.where(have, _float_key(plain), 2147483647), 0)
    in_k = (r < k) & have
    e = tl.where(in_k, tl.exp(ss - top), 0.0)
    prob = e / tl.sum(e, 0)  # the reference's order of operations: softmax, cumsum, minus
    before = tl.cumsum(prob, 0) - prob
    keep = in_k & (before < tl.where(p >= 1.0, float("inf"), p))  # top_p 1 keeps every rank < k
    last = tl.sum(keep.to(tl.int32), 0) - 1  # >= 0: the best token is always kept
    cut_key = tl.sum(tl.where(r == last, key, 0), 0)
    cut_id = tl.sum(tl.where(r == last, sid, 0), 0)
    no_cut = tl.where(k >= V, p >= 1.0, False)  # min-p alone: no prefix
    draw = tl.load(itab_row) == 0  # greedy rows take the argmax: no cut needed
    tie = (cut_key <= low_key).to(tl.int32) * (n_cand < V).to(tl.int32) * (1 - no_cut.to(tl.int32))
    if tie * draw.to(tl.int32) > 0:
        # Tokens outside the candidates may tie with the cut: keep the first n ties
        # of the whole row in id order (n = the kept ones among the candidates).
        n = last + 1 - tl.sum(((key > cut_key) & have).to(tl.int32), 0)
        seen = tl.zeros([], tl.int32)
        found = V + tl.zeros([], tl.int32)
        for off in range(0, V, BLOCK):
            idx = off + tl.arange(0, BLOCK)
            sv, _ = _scores(logits_row, idx, idx < V, masked, n_stops, itab_row + NI, temp)
            eq = ((_float_key(sv) == cut_key) & (idx < V)).to(tl.int32)
            run = tl.cumsum(eq, 0) + seen
            found = tl.minimum(found, tl.min(tl.where((eq > 0) & (run == n), idx, V), 0))
            seen += tl.sum(eq, 0)
        cut_id = found
    tl.store(cut_key_ptr + row, tl.where(no_cut, NEG_KEY_TL, cut_key))
    tl.store(cut_id_ptr + row, tl.where(no_cut, V, cut_id))
    tl.store(floor_ptr + row, tl.where(min_p > 0.0, top + tl.log(tl.maximum(min_p, 1e-38)), float("-inf")))


def filter_cuts_triton(
    logits: torch.Tensor,  # [B, V] fp32 raw (before the stop mask and temperature)
    slots: torch.Tensor,  # [B] int64: rows of itab / ftab
    min_active: torch.Tensor,  # [B] bool: mask the slot's stop ids
    itab: torch.Tensor,  # [S, ni + M] int64: greedy, top_k (V = off), seed_lo, seed_hi, n_stops | stops
    ni: int,
    ftab: torch.Tensor,  # [S, >= 3] fp32: temperature, top_p, min_p, ...
    min_temperature: float = 1e-6,
    block: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (cut_key [B] int32, cut_id [B] int32, floor [B] fp32) of each row's scores
    (see the module). Rows must have top_k <= SHORT_K, or top_k off and top_p 1:
    a longer top-k would be cut at SHORT_K tokens (the sampler keeps such steps on
    the sorting path)."""
    assert logits.dtype == torch.float32 and logits.stride(-1) == 1
    assert itab.is_contiguous() and ftab.is_contiguous()
    rows, vocab = logits.shape
    cut_key = torch.empty(rows, dtype=torch.int32, device=logits.device)
    cut_id = torch.empty(rows, dtype=torch.int32, device=logits.device)
    floor = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return cut_key, cut_id, floor
    n = num_candidates(vocab, itab.shape[1] - ni)
    radix = rows <= RADIX_MAX_ROWS
    select = top_candidates_triton if radix else top_candidates_ref
    cand = select(logits, n)  # [B, n] int64
    _cuts_kernel[(rows,)](
        logits, cand, slots, min_active, itab, ftab, cut_key, cut_id, floor, min_temperature,
        vocab, n, logits.stride(0), cand.stride(0), itab.stride(0), ftab.stride(0),
        NI=ni, C=triton.next_power_of_2(n), BLOCK=block, num_warps=4,
    )
    return cut_key, cut_id, floor
