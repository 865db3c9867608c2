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
E / BLOCK_E programs so enough SMs stream it (``block_e``: one row a program
by default, measured fastest on the H200). The counter is one int32 that
the caller owns, zero between launches; launches that share it must be
stream-ordered (they are: one engine stream). Sync-free and capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftserve_kernels import pdl
from ftserve_kernels.config import DEFAULT_KERNELS, KernelConfig

# Rows one launch handles. Each program loops over them, one L2 round trip for x
# and r per row, so the fusion pays only while a few rows' latency stays below
# the two launches it saves.
FUSED_MAX_TOKENS = 4


@triton.jit
def _add_norm_route_kernel(
    x_ptr, r_ptr, nw_ptr, g_ptr, normed_ptr, sum_ptr, logits_ptr, w_out_ptr, ids_out_ptr, cnt_ptr,
    T, H, E, eps,
    stride_x, stride_r, stride_n, stride_s, stride_g,
    HAS_RESIDUAL: tl.constexpr, TOP_K: tl.constexpr, RENORM: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_EALL: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr, ZERO_CENTERED: tl.constexpr = False,
):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK_H)
    hmask = offs < H
    rows_e = pid * BLOCK_E + tl.arange(0, BLOCK_E)  # [BE] this program's experts
    emask = rows_e < E
    g = tl.load(g_ptr + rows_e.to(tl.int64)[:, None] * stride_g + offs[None, :],
                mask=emask[:, None] & hmask[None, :], other=0.0)  # [BE, H], x's dtype
    nw = tl.load(nw_ptr + offs, mask=hmask, other=0.0).to(tl.float32)  # [H]
    if ZERO_CENTERED:  # norm(x) * (1 + w) in fp32, one rounding (Qwen3-Next)
        nw = nw + 1.0
    pdl.enter(PDL)  # the router and norm weights above are in flight; x and r are not yet written
    for t in range(T):
        x = tl.load(x_ptr + t * stride_x + offs, mask=hmask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + t * stride_r + offs, mask=hmask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # the next residual
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, 0) / H
        if ZERO_CENTERED:
            n = (xf * tl.rsqrt(var + eps) * nw).to(x_ptr.dtype.element_ty)
        else:
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
            p = tl.exp(lg - tl.max(lg, 0))
            p = tl.where(eall, p, 0.0)
            p = p / tl.sum(p, 0)  # [E] softmax
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


def route_warps(block_e: int, block_h: int) -> int:
    """Warps for ``_add_norm_route_kernel`` at ``block_e`` router rows of ``block_h``.

    One warp where it fits: every reduction (the norm, the dot, the winner's
    softmax and k rounds of max) stays in shuffles; with 4 warps each went
    through shared memory and a barrier (47 in the sm_90 PTX, 6 at one warp), a
    serial tail the last program pays k times. The router tile held across the
    row loop sets the floor: at most 64 of its elements a thread (one 2048-wide
    row a warp, about 220 registers on sm_90); 128 spill inside the loop (a
    [4, 2048] tile on one warp: 632 stack bytes, 160 spill loads and stores a
    row). Rows wider than 2048 take 4 warps at least, so the [H] vectors stay
    at 32 a thread or fewer."""
    need = max(1, block_e * block_h // 2048)
    return min(32, max(need, 1 if block_h <= 2048 else 4))


def add_norm_route_triton(
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor | None,  # [T, H] or None (plain RMSNorm, no sum returned)
    norm_w: torch.Tensor,  # [H]
    eps: float,
    gate_w: torch.Tensor,  # [E, H] router weight
    top_k: int,
    renormalize: bool,
    counter: torch.Tensor,  # [1] int32, zero; left zero
    block_e: int = 1,  # router rows a program streams (a power of two)
    kernels: KernelConfig = DEFAULT_KERNELS,
    zero_centered: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """-> (normed [T, H], x + residual [T, H] or None, weights [T, k] fp32, ids [T, k] int32);
    ``zero_centered``: the norm is norm_rope.rms_norm_ref's zero-centered one."""
    if block_e < 1 or block_e & (block_e - 1):
        raise ValueError(f"block_e={block_e}: a power of two, at least 1")
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
    on = pdl.active(x, kernels)
    _add_norm_route_kernel[(triton.cdiv(e, block_e),)](
        x, r, norm_w, gate_w, normed, s, logits, weights, ids, counter,
        t, h, e, eps,
        x.stride(0), r.stride(0), normed.stride(0), s.stride(0), gate_w.stride(0),
        HAS_RESIDUAL=residual is not None, TOP_K=top_k, RENORM=renormalize,
        BLOCK_E=block_e, BLOCK_H=block_h, BLOCK_EALL=triton.next_power_of_2(e),
        BLOCK_K=triton.next_power_of_2(top_k), num_warps=route_warps(block_e, block_h),
        PDL=on, ZERO_CENTERED=zero_centered, **pdl.launch(on),
    )
    return normed, summed, weights, ids
