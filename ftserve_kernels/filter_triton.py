"""Top-k / top-p / min-p without sorting the vocabulary, for rows whose top-k is
short (at most SHORT_K): the sampler's ``filtering`` stage when no row of the
step needs the whole sorted vocabulary (``wide_filter``, see Sampler).

The reference (sampling.top_k_top_p_keep & min_p_keep) sorts every row (score
descending, id ascending on ties), keeps the first k, then the tokens whose
strictly-better mass (renormalized over those k) is below top_p, then the
tokens within log(min_p) of the max. With k <= SHORT_K only the first SHORT_K
tokens of that order matter, and the kept set is a prefix of it, i.e. a *cut*
(key, id): every token scoring above the cut's score, and the tokens scoring
exactly that whose id is at most ``id``::

    order:  s0 > s1 > s2 = s2' = s2'' > s3 ...      cut = (s2, id of s2')
    kept:   s0   s1   s2   s2'                        (ties kept in id order)

1. ``tie_broken_keys``: one int64 per token, (order-preserving int32 key of the
   score) * 2^32 + (2^32 - 1 - id), so integer order is the reference's order
   with no ties (-0.0 and +0.0 share a key, as they compare equal);
2. ``torch.topk`` of those keys, SHORT_K per row (a radix select, not a sort);
3. ``filter_cuts_triton``: one program per row turns its SHORT_K candidates into
   the cut (softmax over the first k, exclusive cumsum, the last token whose
   mass before it is below top_p) and the min-p floor (max + log(min_p)).

sampling's Gumbel kernel applies the cut in registers (``HAS_CUT``);
``apply_cuts_ref`` is the same test in torch. Masses follow the reference's
operations (softmax, inclusive cumsum in sorted order, minus the token's own);
a scan's summation order can still differ from torch's in the last bit, which
moves the cut only when a token's mass before it sits within that of top_p. Rows with no top-k and no top-p get
no cut (min-p only). Fixed shapes, no host reads: capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SHORT_K = 256  # candidates per row; a row with a longer top-k (or top-p alone) is "wide"
NEG_KEY = -(2**31)  # below every float's key: "no cut"


def float_keys(s: torch.Tensor) -> torch.Tensor:
    """fp32 -> int32 keys in the floats' order (-0.0 and +0.0 equal), as the kernels."""
    b = (s.float() + 0.0).view(torch.int32)
    return torch.where(b >= 0, b, b ^ 0x7FFFFFFF)


def tie_broken_keys(scaled: torch.Tensor) -> torch.Tensor:
    """[B, V] fp32 -> [B, V] int64 keys whose descending order is (score desc, id asc)."""
    ids = torch.arange(scaled.shape[1], device=scaled.device, dtype=torch.int64)
    return float_keys(scaled).to(torch.int64) * (1 << 32) + ((1 << 32) - 1 - ids)[None, :]


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


@triton.jit
def _cuts_kernel(
    scaled_ptr, cand_ptr, top_k_ptr, top_p_ptr, min_p_ptr, cut_key_ptr, cut_id_ptr, floor_ptr,
    V, stride_row, stride_cand, n_cand,
    K: tl.constexpr,
):
    row = tl.program_id(0)
    r = tl.arange(0, K)
    have = r < n_cand
    ids = tl.load(cand_ptr + row * stride_cand + r, mask=have, other=0).to(tl.int32)  # [K] best first
    vals = tl.load(scaled_ptr + row.to(tl.int64) * stride_row + ids, mask=have,
                   other=float("-inf"))  # [K] fp32, descending
    k = tl.load(top_k_ptr + row)
    p = tl.load(top_p_ptr + row).to(tl.float32)
    top = tl.max(vals, 0)
    in_k = (r < k) & have
    e = tl.where(in_k, tl.exp(vals - top), 0.0)  # [K]
    prob = e / tl.sum(e, 0)  # the reference's order of operations: softmax, cumsum, minus
    before = tl.cumsum(prob, 0) - prob  # mass of the strictly better candidates
    bound = tl.where(p >= 1.0, float("inf"), p)  # top_p 1 keeps every rank < k
    keep = in_k & (before < bound)
    last = tl.sum(keep.to(tl.int32), 0) - 1  # >= 0: the best token is always kept
    b = (tl.sum(tl.where(r == last, vals, 0.0), 0) + 0.0).to(tl.int32, bitcast=True)
    key = tl.where(b >= 0, b, b ^ 0x7FFFFFFF)
    cut_id = tl.sum(tl.where(r == last, ids, 0), 0)
    no_cut = tl.where(k >= V, p >= 1.0, False)  # min-p alone: no prefix
    tl.store(cut_key_ptr + row, tl.where(no_cut, NEG_KEY_TL, key))
    tl.store(cut_id_ptr + row, tl.where(no_cut, V, cut_id))
    min_p = tl.load(min_p_ptr + row).to(tl.float32)
    tl.store(floor_ptr + row, tl.where(min_p > 0.0, top + tl.log(tl.maximum(min_p, 1e-38)), float("-inf")))


NEG_KEY_TL = tl.constexpr(NEG_KEY)


def filter_cuts_triton(
    scaled: torch.Tensor,  # [B, V] fp32, after temperature
    top_k: torch.Tensor,  # [B] int64: <= SHORT_K, or >= V (off) with top_p 1
    top_p: torch.Tensor,  # [B] fp32, 1 = off
    min_p: torch.Tensor,  # [B] fp32, 0 = off
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (cut_key [B] int32, cut_id [B] int32, floor [B] fp32): see the module.
    A row with SHORT_K < top_k < V, or top_p < 1 without a short top-k, would be
    cut at SHORT_K tokens: the caller keeps those on the sorting path."""
    assert scaled.dtype == torch.float32 and scaled.stride(-1) == 1
    rows, vocab = scaled.shape
    cut_key = torch.empty(rows, dtype=torch.int32, device=scaled.device)
    cut_id = torch.empty(rows, dtype=torch.int32, device=scaled.device)
    floor = torch.empty(rows, dtype=torch.float32, device=scaled.device)
    if rows == 0:
        return cut_key, cut_id, floor
    k = min(SHORT_K, vocab)
    cand = tie_broken_keys(scaled).topk(k, dim=-1, sorted=True).indices  # [B, k] int64, best first
    _cuts_kernel[(rows,)](
        scaled, cand, top_k.contiguous(), top_p.contiguous(), min_p.contiguous(), cut_key, cut_id, floor,
        vocab, scaled.stride(0), cand.stride(0), k, K=triton.next_power_of_2(k),
    )
    return cut_key, cut_id, floor
