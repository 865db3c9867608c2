"""Device-side pieces of the one-launch decode layer (decode_layer_triton.py):
the grid barrier and timestamps, the GEMV span tiles, the norms, the router's
top-k. Each is a @triton.jit helper inlined into the layer kernel."""

from __future__ import annotations

import triton
import triton.language as tl

from ftserve_kernels.attention_common import mma_acc


@triton.jit
def _phase_end(sync_ptr, target, tm_ptr, pid, slot: tl.constexpr, TIMING: tl.constexpr, SPIN: tl.constexpr):
    """The barrier at a phase's end, stamped on arrival (slot) and release (slot + 1)."""
    _stamp(tm_ptr, pid, slot, TIMING)
    _grid_sync(sync_ptr, target, SPIN)
    _stamp(tm_ptr, pid, slot + 1, TIMING)


@triton.jit
def _grid_sync(sync_ptr, target, SPIN: tl.constexpr):
    tl.debug_barrier()  # every thread's stores precede the release below
    tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")
    seen = tl.load(sync_ptr, volatile=True)
    spins = 0
    while (seen < target) & (spins < SPIN):
        seen = tl.load(sync_ptr, volatile=True)
        spins += 1
    if spins >= SPIN:
        tl.atomic_xchg(sync_ptr + 2, 1)
    tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _stamp(tm_ptr, pid, i: tl.constexpr, TIMING: tl.constexpr):
    """With TIMING, program pid's %globaltimer (ns) into slot i of its row."""
    if TIMING:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [pid], dtype=tl.int64,
                                        is_pure=False, pack=1)
        tl.store(tm_ptr + pid * 16 + i, now)


@triton.jit
def _span(pid, G: tl.constexpr, N):
    """Program pid's contiguous share [lo, hi) of N items."""
    return (pid * N) // G, ((pid + 1) * N) // G


@triton.jit
def _tile(w_ptr, rows, hi, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows [R] (masked from hi) of a contiguous [N, K] weight: an [R, BLOCK_K] tile."""
    k = tl.arange(0, BLOCK_K)
    return tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + k[None, :],
                   mask=(rows < hi)[:, None] & (k < K)[None, :], other=0.0)


@triton.jit
def _span_mma(w_ptr, w_off, rmask, x_ptr, x_col, NX: tl.constexpr, K: tl.constexpr, ROWS: tl.constexpr,
              BK: tl.constexpr, UPCAST: tl.constexpr):
    """[ROWS, 16] fp32 = W[rows] . X^T: row r of a weight (offset w_off[r]) against
    NX input vectors (vector n at x_ptr + n * x_col; columns >= NX are zero).

    A program's whole row span is one [ROWS, BK] tile per K step, multiplied on
    the tensor cores so that the loop is the matmul pattern the compiler
    pipelines (num_stages async copies into shared memory): the next steps'
    weights are in flight while this one is summed, in shared memory rather
    than registers."""
    n = tl.arange(0, 16)
    acc = tl.zeros([ROWS, 16], tl.float32)
    k = tl.arange(0, BK)
    for k0 in range(0, K, BK):
        kk = k0 + k
        w = tl.load(w_ptr + w_off[:, None] + kk[None, :], mask=rmask[:, None] & (kk < K)[None, :], other=0.0)
        xt = tl.load(x_ptr + n[None, :] * x_col + kk[:, None], mask=(kk < K)[:, None] & (n < NX)[None, :],
                     other=0.0, cache_modifier=".cg")  # [BK, 16]
        acc = mma_acc(w, xt, acc, UPCAST)
    return acc


@triton.jit
def _col(acc, j):
    """acc[r, j[r]] for each row r (j: [ROWS], or a scalar for one column)."""
    n = tl.arange(0, 16)
    return tl.sum(tl.where(n[None, :] == j, acc, 0.0), 1)


@triton.jit
def _gemv_span(w_ptr, x_ptr, y_ptr, lo, hi, K: tl.constexpr, ROWS: tl.constexpr, SEG: tl.constexpr,
               BK: tl.constexpr, UPCAST: tl.constexpr):
    """y[lo:hi] = W[lo:hi] . x for a contiguous [N, K] weight; hi - lo <= ROWS.
    Each row is cut into SEG segments, tile row (r, s) taking segment s against
    x's segment s (column s), so the tile has ROWS * SEG rows: 128 keeps both
    warpgroups of an 8-warp program on the tensor cores."""
    KS: tl.constexpr = K // SEG
    rr = tl.arange(0, ROWS * SEG)
    sg = rr % SEG
    rows = lo + rr // SEG
    acc = _span_mma(w_ptr, rows.to(tl.int64) * K + sg * KS, rows < hi, x_ptr, KS, SEG, KS, ROWS * SEG, BK,
                    UPCAST)
    y = tl.sum(tl.reshape(_col(acc, sg[:, None]), [ROWS, SEG]), 1)
    out = lo + tl.arange(0, ROWS)
    tl.store(y_ptr + out, y.to(y_ptr.dtype.element_ty), mask=out < hi)


@triton.jit
def _add_norm(x_ptr, r_ptr, w_ptr, eps, H: tl.constexpr, HAS_RES: tl.constexpr,
              BLOCK_H: tl.constexpr):
    """(s = x + r in x's dtype, rmsnorm(s) * w in x's dtype), both [BLOCK_H]."""
    offs = tl.arange(0, BLOCK_H)
    m = offs < H
    dt = x_ptr.dtype.element_ty
    s = tl.load(x_ptr + offs, mask=m, other=0.0, cache_modifier=".cg")
    if HAS_RES:
        r = tl.load(r_ptr + offs, mask=m, other=0.0, cache_modifier=".cg")
        s = (s.to(tl.float32) + r.to(tl.float32)).to(dt)
    sf = s.to(tl.float32)
    inv = tl.rsqrt(tl.sum(sf * sf, 0) / H + eps)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    n = (w * (sf * inv).to(dt).to(tl.float32)).to(dt)
    return s, n


@triton.jit
def _norm_rope(src_ptr, w_ptr, cos, sin, eps, NROWS: tl.constexpr, D: tl.constexpr,
               HALF: tl.constexpr, BLOCK_R: tl.constexpr, QK_NORM: tl.constexpr, dt):
    """Rows [BLOCK_R, D] at src (NROWS real): per-head RMSNorm (QK_NORM) then
    neox rotary, as the two halves [BLOCK_R, HALF] in dt."""
    g = tl.arange(0, BLOCK_R)
    j = tl.arange(0, HALF)
    m = (g < NROWS)[:, None]
    x1 = tl.load(src_ptr + g[:, None] * D + j[None, :], mask=m, other=0.0, cache_modifier=".cg")
    x2 = tl.load(src_ptr + g[:, None] * D + HALF + j[None, :], mask=m, other=0.0, cache_modifier=".cg")
    y1 = x1.to(tl.float32)
    y2 = x2.to(tl.float32)
    if QK_NORM:
        rs = tl.rsqrt((tl.sum(y1 * y1, 1) + tl.sum(y2 * y2, 1)) / D + eps)[:, None]
        w1 = tl.load(w_ptr + j).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + j).to(tl.float32)[None, :]
        y1 = (w1 * (y1 * rs).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        y2 = (w2 * (y2 * rs).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    o1 = (y1 * cos[None, :] - y2 * sin[None, :]).to(dt)
    o2 = (y2 * cos[None, :] + y1 * sin[None, :]).to(dt)
    return o1, o2


@triton.jit
def _topk(logits_s, own_s, E: tl.constexpr, TOP_K: tl.constexpr, RENORM: tl.constexpr,
          BLOCK_E: tl.constexpr, BLOCK_TK: tl.constexpr):
    """Softmax top-k of the router logits -> (weights [BLOCK_TK] fp32, ids [BLOCK_TK]
    int32), ordered by weight, lowest expert first on ties (as route_topk). One
    rank count over an [E, E] comparison instead of k rounds of max.

    The logits are read from L2 once, one per thread, and the probabilities go
    through this program's own row ``own_s`` to reach the comparison's two
    layouts: read straight into them, every thread of every program would load
    E / 4 scalars from the same few L2 lines (17 us of contention, H200)."""
    e = tl.arange(0, BLOCK_E)
    em = e < E
    lg = tl.load(logits_s + e, mask=em, other=float("-inf"), cache_modifier=".cg")
    p = tl.exp(lg - tl.max(lg, 0))
    p = tl.where(em, p, 0.0)
    p = p / tl.sum(p, 0)
    tl.store(own_s + e, tl.where(em, p, -1.0))
    tl.debug_barrier()
    wr = tl.load(own_s + e[None, :])  # [1, E]
    wc = tl.load(own_s + e[:, None])  # [E, 1]
    beats = (wr > wc) | ((wr == wc) & (e[None, :] < e[:, None]))
    rank = tl.sum(beats.to(tl.int32), 1)  # [E]: experts ahead of each
    kk = tl.arange(0, BLOCK_TK)
    sel = (rank[None, :] == kk[:, None]) & (kk < TOP_K)[:, None]  # [TK, E]
    w = tl.sum(tl.where(sel, wr, 0.0), 1)
    ids = tl.minimum(tl.sum(tl.where(sel, e[None, :], 0), 1), E - 1)
    if RENORM:
        w = w / tl.sum(w, 0)
    return w, ids


@triton.jit
def _pick(vals, kk, j):
    """vals[j] for a vector of indices j [R] (vals [TK] in registers)."""
    return tl.sum(tl.where(kk[None, :] == j[:, None], vals[None, :], 0), 1)
