"""Fused MoE on Triton: routing top-k, then grouped GEMMs over an alignment.

Twins of ``moe.route_topk_ref`` / ``moe.fused_moe_ref``. Weights as in moe.py:
``w13 [E, 2I, H]`` (gate rows then up rows), ``w2 [E, H, I]``.

Alignment (pairs grouped by expert, fixed-shape, padded blocks): see moe_align_triton.

Kernels: (1) gate/up GEMM with SiLU(gate) * up fused, written per pair into
``inter [N, I]``; (2) down GEMM scaled by the routing weight into ``y [N, H]``;
(3) ``y.view(T, k, H).sum(1)`` combines. Up to GEMV_MAX_TOKENS tokens (decode at
small batch) the two GEMV kernels of moe_gemv_triton replace all of this.
Tile sizes come from moe_configs (a tuned per-device table, else a heuristic);
the gate/up and down GEMMs share only BLOCK_M (one alignment feeds both).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftserve_kernels.attention_triton import interpreting, mma
from ftserve_kernels.config import DEFAULT_KERNELS, KernelConfig
from ftserve_kernels.moe_align_triton import moe_align
from ftserve_kernels.moe_configs import MoeConfig
from ftserve_kernels.moe_gemv_triton import GEMV_MAX_TOKENS, fused_moe_gemv_triton

# ---------------------------------------------------------------- routing


@triton.jit
def _route_kernel(
    logits_ptr, w_ptr, ids_ptr, T, E, stride_t,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    RENORM: tl.constexpr,
):
    # BLOCK_T tokens per program (one token per program was thousands of tiny programs).
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # [R]
    tmask = t < T
    e = tl.arange(0, BLOCK_E)
    emask = e < E
    x = tl.load(logits_ptr + t[:, None] * stride_t + e[None, :],
                mask=tmask[:, None] & emask[None, :], other=float("-inf")).to(tl.float32)
    x = tl.where(tmask[:, None], x, 0.0)  # rows past T: finite, never stored
    p = tl.exp(x - tl.max(x, 1)[:, None])
    p = tl.where(emask[None, :], p, 0.0)
    p = p / tl.sum(p, 1)[:, None]  # [R, E] softmax
    kk = tl.arange(0, BLOCK_K)
    wsel = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    isel = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    work = tl.where(emask[None, :], p, -1.0)
    for i in tl.static_range(TOP_K):
        best = tl.max(work, 1)  # [R]
        idx = tl.min(tl.where(work == best[:, None], e[None, :], BLOCK_E), 1)  # lowest index on ties
        # NaN logits (e.g. garbage in padding rows of a captured batch) match nothing:
        # clamp so ids always index the expert maps in bounds.
        idx = tl.minimum(idx, E - 1)
        wsel = tl.where(kk[None, :] == i, best[:, None], wsel)
        isel = tl.where(kk[None, :] == i, idx[:, None], isel)
        work = tl.where(e[None, :] == idx[:, None], -2.0, work)
    if RENORM:
        wsel = wsel / tl.sum(wsel, 1)[:, None]
    out = t[:, None] * TOP_K + kk[None, :]
    omask = tmask[:, None] & (kk[None, :] < TOP_K)
    tl.store(w_ptr + out, wsel, mask=omask)
    tl.store(ids_ptr + out, isel, mask=omask)


def route_topk_triton(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] fp32, ids [T, k] int32), descending."""
    t, e = router_logits.shape
    assert router_logits.stride(-1) == 1
    weights = torch.empty((t, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=router_logits.device)
    if t:
        block_e = triton.next_power_of_2(e)
        block_t = max(1, min(16, 2048 // block_e))
        _route_kernel[(triton.cdiv(t, block_t),)](
            router_logits, weights, ids, t, e, router_logits.stride(0),
            TOP_K=top_k, BLOCK_T=block_t, BLOCK_E=block_e,
            BLOCK_K=triton.next_power_of_2(top_k), RENORM=renormalize,
        )
    return weights, ids


# ---------------------------------------------------------------- grouped GEMMs


@triton.jit
def _block_coords(NUM_M, NUM_N, GROUP_M: tl.constexpr):
    # Grouped order: GROUP_M row blocks sweep all column blocks together, so
    # their activations and the expert's weight tiles stay in L2.
    pid = tl.program_id(0)
    per_group = GROUP_M * NUM_N
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(NUM_M - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr, total_ptr, map_ptr,
    N, H, INTER, NUM_M, stride_xt, stride_we, stride_wn, stride_ot,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, HAS_MAP: tl.constexpr,
):
    pid_m, pid_n = _block_coords(NUM_M, tl.cdiv(INTER, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M < tl.load(total_ptr):
        e = tl.load(block_expert_ptr + pid_m)
        if HAS_MAP:  # expert -> row of w (an expert-slot cache)
            e = tl.load(map_ptr + e)
        e = e.to(tl.int64)
        rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [M] pair ids
        rmask = rows < N
        tok = (rows // TOP_K).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < INTER
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :]  # [M, K]
        g_ptrs = w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]  # [K, N]
        u_off = INTER * stride_wn
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=rmask[:, None], other=0.0)
                g = tl.load(g_ptrs, mask=nmask[None, :], other=0.0)
                u = tl.load(g_ptrs + u_off, mask=nmask[None, :], other=0.0)
            else:
                kmask = offs_k < H - k0
                a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
                g = tl.load(g_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
                u = tl.load(g_ptrs + u_off, mask=kmask[:, None] & nmask[None, :], other=0.0)
            acc_g += mma(a, g, UPCAST)
            acc_u += mma(a, u, UPCAST)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # SiLU(gate) * up, [M, N]
        o_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_ot + offs_n[None, :]
        tl.store(o_ptrs, h.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


@triton.jit
def _moe_down_kernel(
    a_ptr, w_ptr, out_ptr, weights_ptr, sorted_ptr, block_expert_ptr, total_ptr, map_ptr,
    N, H, INTER, NUM_M, stride_at, stride_we, stride_wn, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, HAS_MAP: tl.constexpr,
):
    pid_m, pid_n = _block_coords(NUM_M, tl.cdiv(H, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M < tl.load(total_ptr):
        e = tl.load(block_expert_ptr + pid_m)
        if HAS_MAP:
            e = tl.load(map_ptr + e)
        e = e.to(tl.int64)
        rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [M] pair ids
        rmask = rows < N
        rows64 = rows.to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < H
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows64[:, None] * stride_at + offs_k[None, :]  # [M, K]
        b_ptrs = w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]  # [K, N]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=rmask[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=nmask[None, :], other=0.0)
            else:
                kmask = offs_k < INTER - k0
                a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
            acc += mma(a, b, UPCAST)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        wt = tl.load(weights_ptr + rows64, mask=rmask, other=0.0)  # [M] routing weight
        acc = acc * wt[:, None]
        o_ptrs = out_ptr + rows64[:, None] * stride_ot + offs_n[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


Alignment = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # moe_align's result


def fused_moe_triton(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_ids: torch.Tensor,  # [T, k] int32
    cfg: MoeConfig | None = None,
    expert_map: torch.Tensor | None = None,  # [E] int32: expert -> row of w13/w2 (slot cache)
    gemv: bool | None = None,
    kernels: KernelConfig = DEFAULT_KERNELS,
    valid_rows: torch.Tensor | None = None,  # [1] int: rows past it are padding (moe_align)
) -> torch.Tensor:
    """Grouped-GEMM MoE; ``gemv`` (default: no ``cfg`` and T <= GEMV_MAX_TOKENS)
    takes the two-kernel GEMV path of moe_gemv_triton instead. With
    ``valid_rows`` the grouped GEMMs skip the padding rows' pairs, whose output
    rows are then left unspecified (the GEMV path computes every row)."""
    if gemv or (gemv is None and cfg is None and x.shape[0] <= GEMV_MAX_TOKENS):
        return fused_moe_gemv_triton(x, w13, w2, topk_weights, topk_ids, expert_map, kernels=kernels)
    t, h = x.shape
    two_i = w13.shape[1]
    # With a map, ids index the map (E entries) and the map indexes the weight rows.
    e = expert_map.numel() if expert_map is not None else w13.shape[0]
    inter = two_i // 2
    k = topk_ids.shape[1]
    n = t * k
    if t == 0:
        return torch.empty_like(x)
    assert x.stride(-1) == 1 and w13.stride(-1) == 1 and w2.stride(-1) == 1
    cfg = cfg or MoeConfig.pick(n, e, x.device, hidden=h, inter=inter, top_k=k, kernels=kernels)
    align = moe_align(topk_ids, e, cfg.block_m, cfg.align_chunk, valid_rows)
    weights = topk_weights.reshape(-1)  # [N]
    if weights.dtype != torch.float32 or weights.stride(0) != 1:
        weights = weights.float().contiguous()
    act = torch.empty((n, inter), dtype=x.dtype, device=x.device)  # [N, INTER]
    y = torch.empty((n, h), dtype=x.dtype, device=x.device)  # [N, H]
    moe_gate_up(x, w13, act, align, k, cfg, expert_map)
    moe_down(act, w2, y, weights, align, cfg, expert_map)
    return y.view(t, k, h).sum(dim=1)  # [T, H]


def moe_gate_up(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    act: torch.Tensor,  # [N, I] out
    align: Alignment,
    top_k: int,
    cfg: MoeConfig,
    expert_map: torch.Tensor | None = None,
) -> None:
    """act[pair] = SiLU(gate) * up of the pair's token through its expert.
    One launch; tools/tune/moe.py times it alone."""
    sorted_ids, block_expert, total = align
    h = x.shape[1]
    inter = w13.shape[1] // 2
    num_m = block_expert.shape[0]
    emap = expert_map if expert_map is not None else block_expert  # unread without HAS_MAP
    _moe_gate_up_kernel[(num_m * triton.cdiv(inter, cfg.block_n),)](
        x, w13, act, sorted_ids, block_expert, total, emap,
        act.shape[0], h, inter, num_m, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOP_K=top_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, EVEN_K=h % cfg.block_k == 0, UPCAST=interpreting(),
        HAS_MAP=expert_map is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def moe_down(
    act: torch.Tensor,  # [N, I]
    w2: torch.Tensor,  # [E, H, I]
    y: torch.Tensor,  # [N, H] out
    weights: torch.Tensor,  # [N] fp32 routing weights
    align: Alignment,
    cfg: MoeConfig,
    expert_map: torch.Tensor | None = None,
) -> None:
    """y[pair] = weight * down(act[pair]) with the ``down_*`` tiles of cfg. One launch."""
    sorted_ids, block_expert, total = align
    h, inter = w2.shape[1], w2.shape[2]
    num_m = block_expert.shape[0]
    block_n, block_k, group_m, warps, stages = cfg.down
    emap = expert_map if expert_map is not None else block_expert
    _moe_down_kernel[(num_m * triton.cdiv(h, block_n),)](
        act, w2, y, weights, sorted_ids, block_expert, total, emap,
        act.shape[0], h, inter, num_m, act.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        EVEN_K=inter % block_k == 0, UPCAST=interpreting(), HAS_MAP=expert_map is not None,
        num_warps=warps, num_stages=stages,
    )
