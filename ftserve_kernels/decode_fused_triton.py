"""Decode-sized fusions (a handful of tokens): fewer, fuller launches per layer.

At batch 1 a decode layer is a dozen launches, and each small one costs a few
microseconds of launch latency and tail whatever it does. Twins in ops.py
(the unfused composition of the reference ops).

``add_norm_route``: residual add + RMSNorm + router GEMV + softmax top-k, one
launch instead of three (norm, cuBLAS GEMV, top-k)::

    every program p:  s_t = round(x_t + r_t); n_t = round(w * round(norm(s_t)))  (all t, from L2)
                      logits[t, experts of p] = round(n_t . G[experts of p])       -> scratch
                      (program 0 also stores n and s: the expert kernels read n)
    the last program to arrive (acq_rel counter, left at 0 again):
                      softmax + top-k of every row of the scratch -> weights, ids

Every program recomputes the norm: a [T, H] row from L2 is cheaper than a
launch. The router weight ([E, H], 0.5 MB on Qwen3-30B) is split over
E / BLOCK_E programs so enough SMs stream it. The counter is one int32 that
the caller owns, zero between launches; launches that share it must be
stream-ordered (they are: one engine stream). Sync-free and capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftserve_kernels import gemv_configs as gc
from ftserve_kernels import pdl

# Rows one launch handles. Each program loops over them, one L2 round trip for x
# and r per row, so the fusion pays only while a few rows' latency stays below
# the two launches it saves.
FUSED_MAX_TOKENS = 4
_ROUTE_BLOCK_E = 4  # experts per program: 32 programs of 16 KB at E = 128, H = 2048


@triton.jit
def _softmax(lg, eall):
    """fp32 softmax of one row of router logits [BE] (-inf outside E)."""
    p = tl.exp(lg - tl.max(lg, 0))
    p = tl.where(eall, p, 0.0)
    return p / tl.sum(p, 0)


@triton.jit
def _add_norm_route_kernel(
    x_ptr, r_ptr, nw_ptr, g_ptr, normed_ptr, sum_ptr, logits_ptr, w_out_ptr, ids_out_ptr, cnt_ptr,
    T, H, E, eps,
    stride_x, stride_r, stride_n, stride_s, stride_g,
    HAS_RESIDUAL: tl.constexpr, TOP_K: tl.constexpr, RENORM: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_EALL: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK_H)
    hmask = offs < H
    rows_e = pid * BLOCK_E + tl.arange(0, BLOCK_E)  # [BE] this program's experts
    emask = rows_e < E
    g = tl.load(g_ptr + rows_e.to(tl.int64)[:, None] * stride_g + offs[None, :],
                mask=emask[:, None] & hmask[None, :], other=0.0)  # [BE, H], x's dtype
    nw = tl.load(nw_ptr + offs, mask=hmask, other=0.0).to(tl.float32)  # [H]
    pdl.enter(PDL)  # the router and norm weights above are in flight; x and r are not yet written
    for t in range(T):
        x = tl.load(x_ptr + t * stride_x + offs, mask=hmask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + t * stride_r + offs, mask=hmask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # the next residual
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, 0) / H
        normed = (xf * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
        n = (nw * normed).to(x_ptr.dtype.element_ty)  # [H], what the experts read
        if pid == 0:
            tl.store(normed_ptr + t * stride_n + offs, n, mask=hmask)
            if HAS_RESIDUAL:
                tl.store(sum_ptr + t * stride_s + offs, x, mask=hmask)
        logit = tl.sum(g.to(tl.float32) * n.to(tl.float32)[None, :], 1)  # [BE]
        # Rounded like the reference's router output (a linear in x's dtype).
        logit = logit.to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(logits_ptr + t * E + rows_e, logit, mask=emask)
    # Every thread's logits store precedes the barrier, the barrier precedes the
    # release by the atomic; the winner's acquire precedes its (L2, .cg) loads.
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        e = tl.arange(0, BLOCK_EALL)
        eall = e < E
        kk = tl.arange(0, BLOCK_K)
        for t in range(T):
            lg = tl.load(logits_ptr + t * E + e, mask=eall, other=float("-inf"), cache_modifier=".cg")
            p = _softmax(lg, eall)
            work = tl.where(eall, p, -1.0)
            wsel = tl.zeros([BLOCK_K], tl.float32)
            isel = tl.zeros([BLOCK_K], tl.int32)
            for i in tl.static_range(TOP_K):
                best = tl.max(work, 0)
                idx = tl.min(tl.where(work == best, e, BLOCK_EALL), 0)  # lowest index on ties
                idx = tl.minimum(idx, E - 1)  # NaN rows (graph padding garbage): ids stay in bounds
                wsel = tl.where(kk == i, best, wsel)
                isel = tl.where(kk == i, idx, isel)
                work = tl.where(e == idx, -2.0, work)
            if RENORM:
                wsel = wsel / tl.sum(tl.where(kk < TOP_K, wsel, 0.0), 0)
            tl.store(w_out_ptr + t * TOP_K + kk, wsel, mask=kk < TOP_K)
            tl.store(ids_out_ptr + t * TOP_K + kk, isel, mask=kk < TOP_K)
        tl.atomic_xchg(cnt_ptr, 0)


def add_norm_route_triton(
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor | None,  # [T, H] or None (plain RMSNorm, no sum returned)
    norm_w: torch.Tensor,  # [H]
    eps: float,
    gate_w: torch.Tensor,  # [E, H] router weight
    top_k: int,
    renormalize: bool,
    counter: torch.Tensor,  # [1] int32, zero; left zero
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """-> (normed [T, H], x + residual [T, H] or None, weights [T, k] fp32, ids [T, k] int32)."""
    t, h = x.shape
    e = gate_w.shape[0]
    assert t <= FUSED_MAX_TOKENS, "decode-sized batches only: every program loops over the rows"
    assert x.stride(-1) == 1 and gate_w.stride(-1) == 1 and norm_w.is_contiguous()
    assert counter.dtype == torch.int32 and counter.device == x.device
    normed = torch.empty_like(x)  # [T, H]
    summed = torch.empty_like(x) if residual is not None else None
    weights = torch.empty((t, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=x.device)
    if t == 0:
        return normed, summed, weights, ids
    if residual is not None:
        assert residual.stride(-1) == 1
    logits = torch.empty((t, e), dtype=torch.float32, device=x.device)  # [T, E] scratch
    r = residual if residual is not None else x
    s = summed if summed is not None else normed
    block_h = triton.next_power_of_2(h)
    on = pdl.active(x)
    _add_norm_route_kernel[(triton.cdiv(e, _ROUTE_BLOCK_E),)](
        x, r, norm_w, gate_w, normed, s, logits, weights, ids, counter,
        t, h, e, eps,
        x.stride(0), r.stride(0), normed.stride(0), s.stride(0), gate_w.stride(0),
        HAS_RESIDUAL=residual is not None, TOP_K=top_k, RENORM=renormalize,
        BLOCK_E=_ROUTE_BLOCK_E, BLOCK_H=block_h, BLOCK_EALL=triton.next_power_of_2(e),
        # One warp: every reduction (the norm, the dot, the winner's softmax and k
        # rounds of max) stays in shuffles; with 4 warps each went through shared
        # memory and a barrier (47 in the sm_90 PTX, 6 at one warp), a serial tail
        # the last program pays k times. 32 one-warp programs still issue the whole
        # 0.5 MB router weight at once (16 KB each). Wider rows would spill: 4 warps.
        BLOCK_K=triton.next_power_of_2(top_k), num_warps=1 if block_h <= 2048 else 4,
        PDL=on, **pdl.launch(on),
    )
    return normed, summed, weights, ids


# ---------------------------------------------------------------- o_proj + route

@triton.jit
def _topk_ranked(p, e, eall, E, TOP_K: tl.constexpr, RENORM: tl.constexpr, BLOCK_K: tl.constexpr):
    """Top-k of one softmax row [BE] by rank, not k rounds of max: expert i's rank
    is the count of experts above it (a higher p, or an equal p at a lower index:
    the k-rounds order, lowest index first on ties). Two reductions instead of 2k,
    which is what counts in a many-warp program (each goes through shared memory)."""
    pw = tl.where(eall, p, -1.0)  # [BE]
    above = (pw[None, :] > pw[:, None]) | ((pw[None, :] == pw[:, None]) & (e[None, :] < e[:, None]))
    rank = tl.sum(above.to(tl.int32), 1)  # [BE]: row i counts the experts above i
    kk = tl.arange(0, BLOCK_K)
    hit = rank[None, :] == kk[:, None]  # [BK, BE]: one expert per slot (NaN rows: any number)
    wsel = tl.sum(tl.where(hit, pw[None, :], 0.0), 1)  # [BK]
    isel = tl.minimum(tl.sum(tl.where(hit, e[None, :], 0), 1), E - 1)  # ids in bounds on NaN rows
    if RENORM:
        wsel = wsel / tl.sum(tl.where(kk < TOP_K, wsel, 0.0), 0)
    return wsel, isel


@triton.jit
def _oproj_route_kernel(
    a_ptr, w_ptr, b_ptr, h_ptr, nw_ptr, g_ptr, sum_ptr, normed_ptr, part_ptr, ss_ptr,
    w_out_ptr, ids_out_ptr, cnt_ptr,
    H, K, E, eps, stride_w, stride_g,
    HAS_BIAS: tl.constexpr, TOP_K: tl.constexpr, RENORM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_EALL: tl.constexpr, BLOCK_P: tl.constexpr, CHUNK_P: tl.constexpr, BLOCK_TK: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0)
    dt = a_ptr.dtype.element_ty
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [N] this program's output columns
    nmask = cols < H
    e = tl.arange(0, BLOCK_EALL)
    eall = e < E
    # Weights first (no earlier kernel writes them): the router's columns of this slice.
    gt = tl.load(g_ptr + e[:, None] * stride_g + cols[None, :], mask=eall[:, None] & nmask[None, :],
                 other=0.0)  # [E, N]
    nw = tl.load(nw_ptr + cols, mask=nmask, other=0.0).to(tl.float32)
    # o = a . W[cols]^T: gemv_triton's T = 1 loop ([N, BK] fp32 accumulator, unrolled K).
    offs_k = tl.arange(0, BLOCK_K)
    zero_n = tl.zeros([BLOCK_N, 1], tl.int32)
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_w + offs_k[None, :]  # [N, BK]
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for step in tl.static_range(K_STEPS):
        kk = step * BLOCK_K + offs_k[None, :] + zero_n  # [N, BK]
        kmask = kk < K
        if EVEN_K:
            w = tl.load(w_ptrs, mask=nmask[:, None], other=0.0)
        else:
            w = tl.load(w_ptrs, mask=nmask[:, None] & kmask, other=0.0)
        acc += w.to(tl.float32) * tl.load(a_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
        w_ptrs += BLOCK_K
    o = tl.sum(acc, 1)  # [N]
    if HAS_BIAS:
        o += tl.load(b_ptr + cols, mask=nmask, other=0.0).to(tl.float32)
    # The residual add rounded as F.linear's output then fused_add_rms_norm's sum.
    hv = tl.load(h_ptr + cols, mask=nmask, other=0.0).to(tl.float32)
    s = (o.to(dt).to(tl.float32) + hv).to(dt)  # [N] the next residual
    tl.store(sum_ptr + cols, s, mask=nmask)
    sf = tl.where(nmask, s.to(tl.float32), 0.0)
    # norm(s) . Gr = rstd * (Gr * w) . s: this slice's share of every expert's logit,
    # and of the sum of squares, for the last program to add up in a fixed order.
    tl.store(part_ptr + pid * BLOCK_EALL + e, tl.sum(gt.to(tl.float32) * (nw * sf)[None, :], 1))
    tl.store(ss_ptr + pid, tl.sum(sf * sf, 0))
    # Every thread's stores precede the barrier, the barrier the release by the
    # atomic; the winner's acquire precedes its (L2, .cg) loads.
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        n_prog = tl.num_programs(0)
        pp = tl.arange(0, BLOCK_P)
        ss = tl.sum(tl.load(ss_ptr + pp, mask=pp < n_prog, other=0.0, cache_modifier=".cg"), 0)
        rstd = tl.rsqrt(ss / H + eps)
        cp = tl.arange(0, CHUNK_P)
        tot = tl.zeros([CHUNK_P, BLOCK_EALL], tl.float32)
        for c0 in tl.static_range(0, BLOCK_P, CHUNK_P):  # unrolled: every chunk's loads in flight
            rows = c0 + cp
            tot += tl.load(part_ptr + rows[:, None] * BLOCK_EALL + e[None, :],
                           mask=(rows < n_prog)[:, None], other=0.0, cache_modifier=".cg")
        # Rounded like the reference's router output (a linear in x's dtype).
        lg = (tl.sum(tot, 0) * rstd).to(dt).to(tl.float32)
        lg = tl.where(eall, lg, float("-inf"))
        wsel, isel = _topk_ranked(_softmax(lg, eall), e, eall, E, TOP_K, RENORM, BLOCK_TK)
        kk2 = tl.arange(0, BLOCK_TK)
        tl.store(w_out_ptr + kk2, wsel, mask=kk2 < TOP_K)
        tl.store(ids_out_ptr + kk2, isel, mask=kk2 < TOP_K)
        # The experts' input, as fused_add_rms_norm rounds it.
        hh = tl.arange(0, BLOCK_H)
        hmask = hh < H
        sv = tl.load(sum_ptr + hh, mask=hmask, other=0.0, cache_modifier=".cg").to(tl.float32)
        nwa = tl.load(nw_ptr + hh, mask=hmask, other=0.0).to(tl.float32)
        tl.store(normed_ptr + hh, (nwa * (sv * rstd).to(dt).to(tl.float32)).to(dt), mask=hmask)
        tl.atomic_xchg(cnt_ptr, 0)


def oproj_add_norm_route_triton(
    a: torch.Tensor,  # [1, K] attention output
    w: torch.Tensor,  # [H, K] o_proj weight
    bias: torch.Tensor | None,  # [H]
    residual: torch.Tensor,  # [1, H]
    norm_w: torch.Tensor,  # [H] post-attention norm
    eps: float,
    gate_w: torch.Tensor,  # [E, H] router weight
    top_k: int,
    renormalize: bool,
    counter: torch.Tensor,  # [1] int32, zero; left zero
    config: gc.GemvConfig | None = None,  # the GEMV part's launch (default: the o_proj table entry)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """o_proj, the residual add, RMSNorm, the router and top-k for one decode row,
    one launch (twin: ops.linear then ops.add_rms_norm_route). Each GEMV program
    owns BLOCK_N columns of o and of the sum s = residual + o; norm(s) . G is
    rstd * ((G * w) . s), so each program also writes its columns' share of the
    E logits and of s's sum of squares; the last program to arrive adds the
    shares in a fixed order (deterministic, unlike float atomics), takes rstd,
    the logits (rounded to x's dtype as the router linear's output), softmax +
    top-k, and writes the normed row the experts read. The logits differ from
    the composition's by the bf16 rounding of the normed row it skips.
    -> (normed [1, H], s [1, H], weights [1, k] fp32, ids [1, k] int32)."""
    t, k = a.shape
    h, e = w.shape[0], gate_w.shape[0]
    assert t == 1 and w.shape[1] == k and residual.shape == (1, h) and gate_w.shape[1] == h
    assert a.stride(-1) == 1 and w.stride(-1) == 1 and gate_w.stride(-1) == 1 and residual.stride(-1) == 1
    assert norm_w.is_contiguous() and counter.dtype == torch.int32 and counter.device == a.device
    if config is None:
        config = gc.pick(gc.dense_key(False, h, k), 1, a.device) or gc.default("dense", a.is_cuda, h, 1)
    bn, bk = config.block_n, min(config.block_k, triton.next_power_of_2(k))
    n_prog = triton.cdiv(h, bn)
    block_e = triton.next_power_of_2(e)
    block_p = triton.next_power_of_2(n_prog)
    normed = torch.empty_like(residual)
    summed = torch.empty_like(residual)
    weights = torch.empty((1, top_k), dtype=torch.float32, device=a.device)
    ids = torch.empty((1, top_k), dtype=torch.int32, device=a.device)
    part = torch.empty((n_prog, block_e), dtype=torch.float32, device=a.device)  # [P, E] scratch
    ss = torch.empty((n_prog,), dtype=torch.float32, device=a.device)  # [P] scratch
    _oproj_route_kernel[(n_prog,)](
        a, w, bias if bias is not None else w, residual, norm_w, gate_w, summed, normed, part, ss,
        weights, ids, counter,
        h, k, e, eps, w.stride(0), gate_w.stride(0),
        HAS_BIAS=bias is not None, TOP_K=top_k, RENORM=renormalize,
        BLOCK_N=bn, BLOCK_K=bk, K_STEPS=triton.cdiv(k, bk), EVEN_K=k % bk == 0,
        BLOCK_EALL=block_e, BLOCK_P=block_p, CHUNK_P=min(block_p, 32),
        BLOCK_TK=triton.next_power_of_2(top_k), BLOCK_H=triton.next_power_of_2(h),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return normed, summed, weights, ids
