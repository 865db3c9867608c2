"""A batch-1 routed MoE block in one launch: gate/up and down + combine.

moe_gemv_triton runs the experts of one decode row as two launches, and the
second one's ramp (programs placed, expert ids read, first weight bytes in
flight) starts only after the first one's last program is done. Here one grid
does both, and a program's role is the ticket it draws on arrival, so the
down programs are the ones placed last and start streaming their weights as
soon as gate/up programs leave SM room::

    ticket t < G_GU:  gate/up item t: act[pair, cols] = SiLU(gate) * up, the
                      pending post-attention norm applied (RouteParts); item 0
                      also writes the experts' weights; then arrive (release)
    ticket t >= G_GU: down column block t - G_GU: load the k experts' weight
                      rows of its columns (all of K), wait until every gate/up
                      item has arrived (acquire), then dot them with act, weigh,
                      sum the k in a fixed order and leave the next norm pending
                      (as moe_down_gemv_triton._add_then_part)

Tickets, not program ids: a program that waits holds a ticket drawn after
every gate/up ticket, so every gate/up item is already running or done and
the wait ends whatever order the hardware places programs in (the CPU
interpreter runs them one after another, in ticket order). Sync words [0]
tickets, [1] gate/up arrivals, [2] down programs done (the last one zeroes all
three for the next launch), [3] an error flag a wait that gave up sets.

Same arithmetic and rounding as the two launches (``moe_gemv_triton``'s
gate/up kernel with RouteParts, then the 3-D down kernel with a deferred
NormNext): within fp32 summation order of them (a reduction's tree follows
the launch's warps; test). Scope: one row, the
route from oproj_route (RouteParts), resident experts (no expert map), the
next norm deferred. Where it runs is FTSERVE_MOE_ONE_LAUNCH (ftserve/envs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ftserve_kernels.attention_common import interpreting

SYNC_WORDS = 4
MAX_SPIN = 1 << 22


@dataclass(frozen=True)
class OneLaunchConfig:
    """Tiles of the two roles and the launch's warps (one value for the grid)."""

    gu_block_n: int = 16
    gu_block_k: int = 256
    dn_block_n: int = 4
    dn_block_k: int = 128
    num_warps: int = 16
    num_stages: int = 3
    prefetch: bool = True  # the down blocks' weight rows into L2 before their wait (sm_90+)


@triton.jit
def _moe_one_launch_kernel(
    x_ptr, w13_ptr, act_ptr, ids_ptr, parts_ptr, sel_ptr, wout_ptr,
    w2_ptr, res_ptr, nw_ptr, sum_ptr, scaled_ptr, pout_ptr, sync_ptr,
    H, INTER, P, eps, stride_we1, stride_wn1, stride_we2, stride_wn2,
    TOP_K: tl.constexpr, BLOCK_TK: tl.constexpr, BLOCK_P: tl.constexpr,
    GU_N: tl.constexpr, GU_K: tl.constexpr, NB_GU: tl.constexpr,
    DN_N: tl.constexpr, DN_K: tl.constexpr, DN_STEPS: tl.constexpr, G_DN: tl.constexpr,
    SPIN: tl.constexpr, PF: tl.constexpr, SLEEP: tl.constexpr, NT: tl.constexpr,
):
    G_GU: tl.constexpr = TOP_K * NB_GU
    dt = x_ptr.dtype.element_ty
    ticket = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
    pp = tl.arange(0, BLOCK_P)
    if ticket < G_GU:
        pair = ticket // NB_GU
        e = tl.load(ids_ptr + pair).to(tl.int64)
        inv = tl.rsqrt(tl.sum(tl.load(parts_ptr + pp, mask=pp < P, other=0.0), 0) / H + eps)
        offs_n = (ticket % NB_GU) * GU_N + tl.arange(0, GU_N)
        nmask = offs_n < INTER
        offs_k = tl.arange(0, GU_K)
        g_ptrs = w13_ptr + e * stride_we1 + offs_n[:, None] * stride_wn1 + offs_k[None, :]
        u_off = INTER * stride_wn1
        x_ptrs = x_ptr + offs_k
        acc_g = tl.zeros([GU_N], tl.float32)
        acc_u = tl.zeros([GU_N], tl.float32)
        for _k0 in range(0, H, GU_K):  # H % GU_K == 0 (the wrapper checks)
            xv = tl.load(x_ptrs).to(tl.float32)
            g = tl.load(g_ptrs, mask=nmask[:, None], other=0.0)
            u = tl.load(g_ptrs + u_off, mask=nmask[:, None], other=0.0)
            acc_g += tl.sum(g.to(tl.float32) * xv[None, :], 1)
            acc_u += tl.sum(u.to(tl.float32) * xv[None, :], 1)
            x_ptrs += GU_K
            g_ptrs += GU_K
        acc_g = acc_g * inv
        acc_u = acc_u * inv
        if ticket == 0:  # the chosen experts' weights, as the gate/up kernel writes them
            kk = tl.arange(0, BLOCK_TK)
            km = kk < TOP_K
            lg = tl.load(sel_ptr + kk, mask=km, other=0.0) * inv
            lg = tl.where(km, lg.to(dt).to(tl.float32), float("-inf"))
            p = tl.exp(lg - tl.max(lg, 0))
            tl.store(wout_ptr + kk, p / tl.sum(p, 0), mask=km)
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(act_ptr + pair.to(tl.int64) * INTER + offs_n, h.to(dt), mask=nmask)
        # Every thread's stores precede the barrier, the barrier the release.
        tl.debug_barrier()
        tl.atomic_add(sync_ptr + 1, 1, sem="release", scope="gpu")
    else:
        q = ticket - G_GU
        jj = tl.arange(0, BLOCK_TK)
        jmask = jj < TOP_K
        cols = q * DN_N + tl.arange(0, DN_N)
        cmask = cols < H
        ed = tl.load(ids_ptr + jj, mask=jmask, other=0).to(tl.int64)
        if PF:
            # This block's rows of each chosen expert (DN_N x INTER contiguous
            # elements) into L2 while the gate/up items run: thread j < k
            # issues expert j's (l2_prefetch's instruction).
            t = tl.arange(0, NT)
            et = tl.load(ids_ptr + t, mask=t < TOP_K, other=0).to(tl.int64)
            row0 = w2_ptr + et * stride_we2 + (q * DN_N).to(tl.int64) * stride_wn2
            nbytes = tl.where(t < TOP_K, tl.minimum(DN_N, H - q * DN_N) * stride_wn2 * 2, 0).to(tl.int32)
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; "
                "mov.u32 $0, 0; }",
                "=r,l,r", [row0.to(tl.pointer_type(tl.uint8)), nbytes], dtype=tl.int32, is_pure=False, pack=1)
        res = tl.load(res_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        nw = tl.load(nw_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        seen = tl.load(sync_ptr + 1, volatile=True)
        spins = 0
        while (seen < G_GU) & (spins < SPIN):
            if SLEEP:  # spare the counter's L2 line from the waiting programs' polls
                tl.inline_asm_elementwise("nanosleep.u32 256; mov.u32 $0, $1;", "=r,r", [spins],
                                          dtype=tl.int32, is_pure=False, pack=1)
            seen = tl.load(sync_ptr + 1, volatile=True)
            spins += 1
        if spins >= SPIN:
            tl.atomic_xchg(sync_ptr + 3, 1)
        tl.atomic_add(sync_ptr + 1, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()
        # As the 3-D down kernel (moe_down_gemv_triton): K in DN_K steps, unrolled.
        offs_i = tl.arange(0, DN_K)
        b_ptrs = (w2_ptr + (ed * stride_we2)[:, None, None] + (cols * stride_wn2)[None, :, None]
                  + offs_i[None, None, :])  # [KP, N, K]
        a_ptrs = act_ptr + jj[:, None].to(tl.int64) * INTER + offs_i[None, :]  # [KP, K]
        bmask = jmask[:, None, None] & cmask[None, :, None]
        acc = tl.zeros([BLOCK_TK, DN_N], tl.float32)
        for step in tl.static_range(DN_STEPS):
            imask = offs_i < INTER - step * DN_K
            av = tl.load(a_ptrs, mask=jmask[:, None] & imask[None, :], other=0.0, cache_modifier=".cg")
            bv = tl.load(b_ptrs, mask=bmask & imask[None, None, :], other=0.0)
            acc += tl.sum(bv.to(tl.float32) * av.to(tl.float32)[:, None, :], 2)
            a_ptrs += DN_K
            b_ptrs += DN_K
        wt = tl.load(wout_ptr + jj, mask=jmask, other=0.0, cache_modifier=".cg")
        y = (acc * wt[:, None]).to(dt).to(tl.float32)
        out = tl.sum(y, 0)  # [N], the k choices in a fixed order
        sv = (out.to(dt).to(tl.float32) + res).to(dt)
        tl.store(sum_ptr + cols, sv, mask=cmask)
        tl.store(scaled_ptr + cols, (nw * sv.to(tl.float32)).to(dt), mask=cmask)
        sf = tl.where(cmask, sv.to(tl.float32), 0.0)
        tl.store(pout_ptr + q, tl.sum(sf * sf, 0))
        done = tl.atomic_add(sync_ptr + 2, 1, sem="acq_rel", scope="gpu")
        if done == G_DN - 1:  # every ticket is drawn and every program past its wait
            tl.atomic_xchg(sync_ptr, 0)
            tl.atomic_xchg(sync_ptr + 1, 0)
            tl.atomic_xchg(sync_ptr + 2, 0)


def down_parts(h: int, cfg: OneLaunchConfig) -> int:
    """Partial sums of squares the launch leaves (its down column blocks)."""
    return triton.cdiv(h, cfg.dn_block_n)


def moe_one_launch(
    x: torch.Tensor,  # [1, H]: w * s of the pending post-attention norm
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    ids: torch.Tensor,  # [1, k] int32
    parts: torch.Tensor,  # [1, P] fp32: the pending norm's partial sums of squares
    pre_sel: torch.Tensor,  # [1, k] fp32: the chosen experts' logits times rms
    eps: float,  # the post-attention norm's
    residual: torch.Tensor,  # [1, H]: s, the sum the experts' output adds to
    next_w: torch.Tensor,  # [H]: the next norm's weight
    sync: torch.Tensor,  # [SYNC_WORDS] int32, zero; left zero
    cfg: OneLaunchConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (next_w * (out + residual), out + residual, the partial sums of squares
    [1, down_parts] fp32, the experts' weights [1, k] fp32): what
    moe_gemv_triton.fused_moe_add_norm_gemv_triton with ``route`` and a
    deferred NormNext returns (and writes into the weights), in one launch."""
    cfg = cfg or OneLaunchConfig()
    t, h = x.shape
    e, two_i, _ = w13.shape
    inter = two_i // 2
    k = ids.shape[1]
    assert t == 1 and ids.shape == (1, k) and pre_sel.shape == (1, k) and parts.shape[0] == 1
    assert x.is_contiguous() and residual.is_contiguous() and next_w.is_contiguous()
    assert w13.stride(-1) == 1 and w2.stride(-1) == 1 and w2.shape == (e, h, inter)
    assert h % cfg.gu_block_k == 0 and sync.dtype == torch.int32 and sync.numel() >= SYNC_WORDS
    assert ids.is_contiguous() and parts.is_contiguous() and pre_sel.is_contiguous()
    act = torch.empty((k, inter), dtype=x.dtype, device=x.device)
    weights = torch.empty((1, k), dtype=torch.float32, device=x.device)
    scaled, summed = torch.empty_like(x), torch.empty_like(x)
    g_dn = down_parts(h, cfg)
    p_out = torch.empty((1, g_dn), dtype=torch.float32, device=x.device)
    nb = triton.cdiv(inter, cfg.gu_block_n)
    gpu = x.is_cuda and not interpreting() and torch.cuda.get_device_capability(x.device) >= (9, 0)
    assert cfg.num_warps * 32 >= k, "one prefetching thread per chosen expert"
    _moe_one_launch_kernel[(k * nb + g_dn,)](
        x, w13, act, ids, parts, pre_sel, weights,
        w2, residual, next_w, summed, scaled, p_out, sync,
        h, inter, parts.shape[1], eps, w13.stride(0), w13.stride(1), w2.stride(0), w2.stride(1),
        TOP_K=k, BLOCK_TK=triton.next_power_of_2(k), BLOCK_P=triton.next_power_of_2(parts.shape[1]),
        GU_N=cfg.gu_block_n, GU_K=cfg.gu_block_k, NB_GU=nb,
        DN_N=cfg.dn_block_n, DN_K=cfg.dn_block_k, DN_STEPS=triton.cdiv(inter, cfg.dn_block_k), G_DN=g_dn,
        SPIN=MAX_SPIN, PF=cfg.prefetch and gpu, SLEEP=gpu, NT=32 * cfg.num_warps,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return scaled, summed, p_out, weights
