"""Sort-free top-k / top-p / min-p: where each row's kept set ends, found by
searching, not sorting the vocabulary.

The reference (sampling.top_k_top_p_keep & min_p_keep) sorts every row
(score descending, id ascending on ties), keeps the first k, then the tokens
whose strictly-better mass (renormalized over those k) is below top_p, then
the tokens within log(min_p) of the max. The first two give a prefix of that
order, and a prefix is a *cut* (key, id): every token scoring above the cut's
score, and the tokens scoring exactly that whose id is at most ``id``::

    order:  s0 > s1 > s2 = s2' = s2'' > s3 ...      cut = (s2, id of s2')
    kept:   s0   s1   s2   s2'                        (ties kept in id order)

One program per row finds the cut with 16-way searches over the scores'
order-preserving int32 keys (-0.0 folded into +0.0), each pass one read of the
row (from L2) counting or weighing 16 thresholds at once, so 32 key bits take
at most 9 passes:

1. m = max, Z = sum exp(s - m)                                     (1 pass)
2. top-k (k < V): the largest key t with #(key >= t) >= k: the k-th score
   v_k; t_k = k - #(key > v_k) of its ties are in; Z_k = mass of the top k
3. top-p (p < 1): the largest key t above v_k with mass(key >= t) >= p Z_k:
   the crossing score v_p; the crossing tie is the j-th one with
   mass(key > v_p) + j e(v_p) >= p Z_k (if no key above v_k qualifies, the
   crossing is inside v_k's kept ties)
4. when only some ties of the cut score are kept, one more pass finds the id
   of the j-th (a running count in id order)

``floor`` = m + log(min_p) is the min-p bound. ``apply_cuts_ref`` turns the
three per-row values back into the keep mask; sampling's Gumbel kernel
applies them in registers (``HAS_CUT``). Masses are fp32 sums in block order,
not the reference's cumsum in sorted order, so a row whose boundary mass sits
within rounding of top_p can keep one token more or less; nothing else differs.
No host reads, fixed grid: capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NEG_KEY = -(2**31)  # below every float's key: "no cut"
_WAYS = 16


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


@triton.jit
def _keys(s):
    b = (s + 0.0).to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def _value(key):
    b = tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.int32)
    return b.to(tl.float32, bitcast=True)


NEG_KEY_TL = tl.constexpr(NEG_KEY)


@triton.jit
def _search(row_ptr, V, lo, hi, c_lo, c_hi, m_lo, m_hi, floor_key, m, target,
            BY_MASS: tl.constexpr, WAYS: tl.constexpr, BLOCK: tl.constexpr):
    """16-way search for the largest key t in [lo, hi) with F(t) >= target, F =
    count (BY_MASS False) or exp-mass (True) of the keys >= t; keys <= floor_key
    do not count. Invariant F(lo) >= target > F(hi); (c, m)_(lo, hi) carry the
    count and mass at lo and hi. Returns (lo, hi, c_lo, c_hi, m_lo, m_hi)."""
    j = tl.arange(0, WAYS)
    while hi - lo > 1:
        step = (hi - lo + WAYS - 1) // WAYS
        t = lo + j.to(tl.int64) * step  # [W], t[0] = lo
        valid = t < hi
        cnt = tl.zeros([WAYS], tl.float32)
        mass = tl.zeros([WAYS], tl.float32)
        for off in range(0, V, BLOCK):
            idx = off + tl.arange(0, BLOCK)
            inb = idx < V
            s = tl.load(row_ptr + idx, mask=inb, other=float("-inf"))
            k = _keys(s).to(tl.int64)
            ge = (k[:, None] >= t[None, :]) & (inb & (k > floor_key))[:, None]  # [N, W]
            cnt += tl.sum(ge.to(tl.float32), 0)
            e = tl.exp(s - m)
            mass += tl.sum(tl.where(ge, e[:, None], 0.0), 0)
        f = mass if BY_MASS else cnt
        ok = (valid & (f >= target)) | (j == 0)  # F(lo) >= target holds by the invariant
        best = tl.max(tl.where(ok, j, 0), 0)  # the largest qualifying threshold
        nxt = (j == best + 1) & valid
        has_nxt = tl.sum(nxt.to(tl.int32), 0) > 0
        new_lo = tl.max(tl.where(j == best, t, NEG_KEY_TL), 0)
        new_hi = tl.where(has_nxt, tl.max(tl.where(nxt, t, NEG_KEY_TL), 0), hi)
        nc_lo = tl.sum(tl.where(j == best, cnt, 0.0), 0)
        nm_lo = tl.sum(tl.where(j == best, mass, 0.0), 0)
        c_hi = tl.where(has_nxt, tl.sum(tl.where(nxt, cnt, 0.0), 0), c_hi)
        m_hi = tl.where(has_nxt, tl.sum(tl.where(nxt, mass, 0.0), 0), m_hi)
        c_lo = tl.where(best == 0, c_lo, nc_lo)
        m_lo = tl.where(best == 0, m_lo, nm_lo)
        lo = new_lo
        hi = new_hi
    return lo, hi, c_lo, c_hi, m_lo, m_hi




@triton.jit
def _filter_cuts_kernel(
    scaled_ptr, top_k_ptr, top_p_ptr, min_p_ptr, cut_key_ptr, cut_id_ptr, floor_ptr,
    V, stride_row,
    WAYS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = scaled_ptr + row.to(tl.int64) * stride_row
    k = tl.load(top_k_ptr + row).to(tl.int64)
    p = tl.load(top_p_ptr + row).to(tl.float32)
    # 1. max and the softmax normalizer (online: rescale the sum when the max grows).
    m = tl.full([], float("-inf"), tl.float32)
    z = tl.zeros([], tl.float32)
    kmax = tl.full([], NEG_KEY_TL, tl.int32)
    for off in range(0, V, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        s = tl.load(row_ptr + idx, mask=idx < V, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 0))
        empty = m_new == float("-inf")  # nothing finite yet: exp(-inf - -inf) would be NaN
        z = tl.where(empty, 0.0, z * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new), 0))
        m = m_new
        kmax = tl.maximum(kmax, tl.max(tl.where(idx < V, _keys(s), NEG_KEY_TL), 0))
    top = kmax.to(tl.int64) + 1  # every F is 0 above the max key
    # 2. top-k: the k-th largest key and how many of its ties are in.
    # Loop-carried and branch-assigned values are tensors from the start (compiled
    # Triton wants one type per variable; a Python 0.0 is a constexpr).
    f0 = tl.zeros([], tl.float32)
    nokey = NEG_KEY_TL + tl.zeros([], tl.int64)
    cut = nokey
    ties_in = f0
    ties_all = f0
    zk = z + f0
    mk_gt = f0  # mass strictly above the top-k cut score (over the kept set)
    vf = V * 1.0 + f0
    if k < V:
        lo, hi, c_lo, c_hi, m_lo, m_hi = _search(
            row_ptr, V, nokey, top, vf, f0, zk, f0, NEG_KEY_TL - 1, m, k.to(tl.float32), False, WAYS, BLOCK)
        cut = lo
        ties_all = c_lo - c_hi
        ties_in = k.to(tl.float32) - c_hi
        ev = tl.exp(_value(lo) - m)
        mk_gt = m_hi
        zk = m_hi + ties_in * ev
    # 3. top-p over the top-k set: the crossing score above the cut, if any.
    if p < 1.0:
        target = p * zk
        if k < V:
            # keys > cut only (the cut's own ties are handled below); F(cut) = zk >= target.
            lo, hi, c_lo, c_hi, m_lo, m_hi = _search(
                row_ptr, V, cut, top, k.to(tl.float32), f0, zk, f0, cut, m, target, True, WAYS, BLOCK)
        else:
            lo, hi, c_lo, c_hi, m_lo, m_hi = _search(
                row_ptr, V, nokey, top, vf, f0, zk, f0, NEG_KEY_TL - 1, m, target, True, WAYS, BLOCK)
        ev = tl.exp(_value(lo) - m)
        if (k < V) & (lo == cut):
            # The crossing is inside the top-k cut's kept ties.
            need = tl.where(ev > 0, tl.ceil((target - mk_gt) / ev), ties_in)
            ties_in = tl.minimum(tl.maximum(need, 1.0), ties_in)
        else:
            n_ties = c_lo - c_hi
            need = tl.where(ev > 0, tl.ceil((target - m_hi) / ev), n_ties)
            cut = lo
            ties_all = n_ties
            ties_in = tl.minimum(tl.maximum(need, 1.0), n_ties)
    # 4. the id of the last kept tie, when not all are kept.
    cut_id = V + tl.zeros([], tl.int32)
    if ties_in < ties_all:
        want = ties_in
        seen = f0
        found = V + tl.zeros([], tl.int32)
        for off in range(0, V, BLOCK):
            idx = off + tl.arange(0, BLOCK)
            s = tl.load(row_ptr + idx, mask=idx < V, other=float("-inf"))
            eq = ((_keys(s).to(tl.int64) == cut) & (idx < V)).to(tl.float32)
            run = tl.cumsum(eq, 0) + seen
            hit = (eq > 0) & (run == want)
            found = tl.minimum(found, tl.min(tl.where(hit, idx, V), 0))
            seen += tl.sum(eq, 0)
        cut_id = found
    tl.store(cut_key_ptr + row, cut.to(tl.int32))
    tl.store(cut_id_ptr + row, cut_id.to(tl.int32))
    min_p = tl.load(min_p_ptr + row).to(tl.float32)
    tl.store(floor_ptr + row, tl.where(min_p > 0.0, m + tl.log(tl.maximum(min_p, 1e-38)), float("-inf")))


def filter_cuts_triton(
    scaled: torch.Tensor,  # [B, V] fp32, after temperature
    top_k: torch.Tensor,  # [B] int64, V = off
    top_p: torch.Tensor,  # [B] fp32, 1 = off
    min_p: torch.Tensor,  # [B] fp32, 0 = off
    block: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (cut_key [B] int32, cut_id [B] int32, floor [B] fp32): see the module."""
    assert scaled.dtype == torch.float32 and scaled.stride(-1) == 1
    rows, vocab = scaled.shape
    cut_key = torch.empty(rows, dtype=torch.int32, device=scaled.device)
    cut_id = torch.empty(rows, dtype=torch.int32, device=scaled.device)
    floor = torch.empty(rows, dtype=torch.float32, device=scaled.device)
    if rows:
        _filter_cuts_kernel[(rows,)](
            scaled, top_k.contiguous(), top_p.contiguous(), min_p.contiguous(), cut_key, cut_id, floor,
            vocab, scaled.stride(0), WAYS=_WAYS, BLOCK=block, num_warps=8,
        )
    return cut_key, cut_id, floor
