"""Fused MoE for a handful of tokens: two GEMV kernels, no alignment, combine fused.

At decode batch 1-2 the grouped-GEMM path of moe_triton pays for an alignment
launch, 16-row tiles holding one real row, a [T*k, H] intermediate and a
separate combine. Here (twin: ``moe.fused_moe_ref``, same signature)::

    gate_up: program (pair p = t*k + j, column block) -> act[p, cols]
             = SiLU(x_t . W13[e_p, gate cols]) * (x_t . W13[e_p, up cols])
    down:    program (token t, column block) -> out[t, cols]
             = sum_j  round(weight[t, j] * (act[t*k + j] . W2[e_{t,j}, cols]))

Each expert weight row is streamed once per (token, choice); with more tokens,
experts shared between tokens would be read once per token, which is why the
grouped path takes over past ``GEMV_MAX_TOKENS``. The combine adds the k
choices in a fixed order in fp32: the output is deterministic. Rounding
follows the grouped path: act and each weighted down row round to x's dtype.

The down kernels live in moe_down_gemv_triton.py. Launch parameters of each
kernel (block_n, block_k, warps, stages) come from this GPU's table in
gemv_configs (written by tools/tune/gemv.py) where it has the shape and T,
else from gemv_configs.default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ftserve_kernels import gemv_configs as gc
from ftserve_kernels import pdl
from ftserve_kernels.config import DEFAULT_KERNELS, KernelConfig
from ftserve_kernels.moe_down_gemv_triton import NormNext, moe_down_gemv, norm_parts
from ftserve_kernels.moe_read_through import (
    ReadThrough,
    _bank_rows,
    _miss_source,
    _read_through_args,
    _read_through_consts,
)

GEMV_MAX_TOKENS = 2  # fused_moe_triton's default switch point (tokens, not pairs)


@dataclass(frozen=True)
class RouteParts:
    """One row's routing as oproj_route_triton leaves it: x (the gate/up input)
    is w * s of the post-attention norm left pending, ``parts`` [1, P] the
    partial sums of squares of s, ``pre_sel`` [1, k] the chosen experts'
    logits times rms(s); the gate/up launch writes their weights (softmax over
    the k) into the topk_weights it is given."""

    parts: torch.Tensor  # [1, P] fp32
    pre_sel: torch.Tensor  # [1, k] fp32
    eps: float


@triton.jit
def _route_inv_rms(parts_ptr, P, H, eps, BLOCK_P: tl.constexpr):
    """1 / rms(s) of a routed row (RouteParts) from its partial sums of squares
    [P], added in a fixed order: every program gets the same value."""
    pp = tl.arange(0, BLOCK_P)
    return tl.rsqrt(tl.sum(tl.load(parts_ptr + pp, mask=pp < P, other=0.0), 0) / H + eps)


@triton.jit
def _route_weights(sel_ptr, wout_ptr, inv, dt: tl.constexpr, TOP_K: tl.constexpr, BLOCK_TK: tl.constexpr):
    """The chosen experts' weights of a routed row: the softmax over the k of
    round(pre / rms), the logits rounded to the activations' dtype ``dt`` as the
    router's are, into wout [k] for the down kernel."""
    kk = tl.arange(0, BLOCK_TK)
    km = kk < TOP_K
    lg = tl.load(sel_ptr + kk, mask=km, other=0.0) * inv
    lg = tl.where(km, lg.to(dt).to(tl.float32), float("-inf"))
    p = tl.exp(lg - tl.max(lg, 0))
    tl.store(wout_ptr + kk, p / tl.sum(p, 0), mask=km)


def route_consts(route: RouteParts, weights_out: torch.Tensor | None, pairs: int, top_k: int) -> dict[str, object]:
    """The gate/up kernels' keyword arguments for a routed row (HAS_PARTS)."""
    assert weights_out is not None and route.parts.shape[0] == 1 and pairs == top_k
    assert route.parts.dtype == torch.float32 and route.parts.is_contiguous()
    p = route.parts.shape[1]
    return dict(parts_ptr=route.parts, P=p, eps=route.eps, sel_ptr=route.pre_sel, wout_ptr=weights_out,
                HAS_PARTS=True, BLOCK_P=triton.next_power_of_2(p), BLOCK_TK=triton.next_power_of_2(top_k))


@triton.jit
def _gemv_gate_up_kernel(
    x_ptr, w_ptr, out_ptr, ids_ptr, map_ptr, H, INTER,
    stride_xt, stride_we, stride_wn, stride_ot,
    bank, miss_slot_ptr, miss_id_ptr, M, bank_col,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, HAS_MAP: tl.constexpr,
    READ_THROUGH: tl.constexpr, BLOCK_M: tl.constexpr,
    PDL: tl.constexpr,
    parts_ptr=None, P=1, eps=0.0, sel_ptr=None, wout_ptr=None,
    HAS_PARTS: tl.constexpr = False, BLOCK_P: tl.constexpr = 1, BLOCK_TK: tl.constexpr = 1,
):
    # HAS_PARTS (RouteParts; one row): x is w * s of a norm left pending (the
    # partial sums of squares of s in parts [P]); the dots are scaled by 1/rms
    # at the end, as gemv_triton's. Program (0, 0) also turns the chosen
    # experts' pre-logits (logits * rms, oproj_route_triton) into their
    # weights: the softmax of round(pre / rms) over the k, for the down kernel.
    # 1/rms is summed before the K loop (its load beside the ids', which the
    # weights wait for anyway): with the parts held across the loop, ptxas
    # issued up's tile only after gate's had arrived, two memory round trips a
    # step.
    pdl.enter(PDL)  # the ids / activations come from the kernel before
    pair = tl.program_id(0)
    e = tl.load(ids_ptr + pair)
    if HAS_PARTS:
        inv = _route_inv_rms(parts_ptr, P, H, eps, BLOCK_P)
    if HAS_MAP:  # expert -> row of w (an expert-slot cache)
        e = tl.load(map_ptr + e)
    e = e.to(tl.int64)
    tok = (pair // TOP_K).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    tile = offs_n[:, None] * stride_wn + offs_k[None, :]  # [N, K] offsets within a weight row
    g_ptrs = w_ptr + e * stride_we + tile
    u_off = INTER * stride_wn
    if READ_THROUGH:  # a miss of this step: read the bank row over UVA, write the slot as it passes
        src = _miss_source(e, miss_slot_ptr, miss_id_ptr, M, BLOCK_M)
        h_ptrs = _bank_rows(bank, w_ptr.dtype.element_ty) + tl.maximum(src, 0) * stride_we + bank_col + tile
        # As [N, 1] tensors, not scalars: the interpreter turns scalar & tensor masks into ints.
        src_n = src + tl.zeros([BLOCK_N, 1], tl.int64)
        from_host = src_n >= 0
    x_ptrs = x_ptr + tok * stride_xt + offs_k  # [K]
    acc_g = tl.zeros([BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        if EVEN_K:
            xv = tl.load(x_ptrs).to(tl.float32)
            m2 = nmask[:, None]
        else:
            kmask = offs_k < H - k0
            xv = tl.load(x_ptrs, mask=kmask, other=0.0).to(tl.float32)
            m2 = nmask[:, None] & kmask[None, :]
        if READ_THROUGH:
            r_ptrs = tl.where(from_host, h_ptrs, g_ptrs)  # the bank row on a miss, else the slot
            g = tl.load(r_ptrs, mask=m2, other=0.0)
            u = tl.load(r_ptrs + u_off, mask=m2, other=0.0)
            tl.store(g_ptrs, g, mask=m2 & from_host)
            tl.store(g_ptrs + u_off, u, mask=m2 & from_host)
            h_ptrs += BLOCK_K
        else:
            g = tl.load(g_ptrs, mask=m2, other=0.0)
            u = tl.load(g_ptrs + u_off, mask=m2, other=0.0)
        acc_g += tl.sum(g.to(tl.float32) * xv[None, :], 1)
        acc_u += tl.sum(u.to(tl.float32) * xv[None, :], 1)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
    if HAS_PARTS:
        acc_g = acc_g * inv
        acc_u = acc_u * inv
        if (pair == 0) & (tl.program_id(1) == 0):
            _route_weights(sel_ptr, wout_ptr, inv, x_ptr.dtype.element_ty, TOP_K, BLOCK_TK)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # SiLU(gate) * up, [N]
    tl.store(out_ptr + pair.to(tl.int64) * stride_ot + offs_n, h.to(out_ptr.dtype.element_ty),
             mask=nmask)


def fused_moe_gemv_triton(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_ids: torch.Tensor,  # [T, k] int32
    expert_map: torch.Tensor | None = None,  # [E] int32: expert -> row of w13/w2
    block_n: tuple[int, int] | None = None,  # (gate_up, down) output columns per program
    configs: tuple[gc.GemvConfig, gc.GemvConfig] | None = None,  # (gate_up, down): wins over block_n
    read_through: ReadThrough | None = None,  # misses read from the host bank (needs expert_map)
    kernels: KernelConfig = DEFAULT_KERNELS,
) -> torch.Tensor:
    """Launch parameters of each kernel: ``configs``, else ``block_n`` over the
    defaults, else the device table's entry (gemv_configs), else the default."""
    out = torch.empty_like(x)  # [T, H]
    _fused_moe_gemv(x, w13, w2, topk_weights, topk_ids, out, expert_map, block_n, configs, read_through,
                    kernels)
    return out


def fused_moe_add_norm_gemv_triton(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_ids: torch.Tensor,  # [T, k] int32
    norm_next: NormNext,
    configs: tuple[gc.GemvConfig, gc.GemvConfig] | None = None,  # (gate_up, down)
    route: RouteParts | None = None,  # x is pending: gate/up applies it and writes topk_weights
    kernels: KernelConfig = DEFAULT_KERNELS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """fused_moe_gemv_triton with the next layer's input norm folded into the
    down kernel's epilogue (``_add_then_norm_last``)
    -> (rms_norm(out + residual) [T, H], out + residual [T, H], None), as
    ops.fused_add_rms_norm of the MoE output rounds them. With
    ``norm_next.deferred`` the norm is left pending: (weight * (out + residual),
    out + residual, the partial sums of squares [T, P] fp32) (``_add_then_part``)."""
    normed, summed = torch.empty_like(x), torch.empty_like(x)
    parts = None
    if norm_next.deferred:
        if configs is None:
            configs = _configs(x, w13, topk_ids, None, None, kernels)
        p = norm_parts(x.shape[1], configs[1])
        parts = torch.empty((x.shape[0], p), dtype=torch.float32, device=x.device)
    _fused_moe_gemv(x, w13, w2, topk_weights, topk_ids, normed, None, None, configs, None, kernels,
                    norm_next, summed, parts, route)
    return normed, summed, parts


def _fused_moe_gemv(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, out: torch.Tensor, expert_map: torch.Tensor | None,
    block_n: tuple[int, int] | None,
    configs: tuple[gc.GemvConfig, gc.GemvConfig] | None, read_through: ReadThrough | None,
    kernels: KernelConfig, norm_next: NormNext | None = None, summed: torch.Tensor | None = None,
    parts: torch.Tensor | None = None, route: RouteParts | None = None,
) -> None:
    """Both launches into ``out`` (with ``norm_next``: the normed rows, and the
    sums into ``summed``; deferred: the partial sums of squares into ``parts``)."""
    t, h = x.shape
    inter = w13.shape[1] // 2
    k = topk_ids.shape[1]
    if t == 0:
        return
    assert x.stride(-1) == 1 and w13.stride(-1) == 1 and w2.stride(-1) == 1
    ids = topk_ids.reshape(-1)  # [N]
    weights = topk_weights.reshape(-1)  # [N]
    if route is not None:  # gate/up writes them
        assert weights.dtype == torch.float32 and weights.data_ptr() == topk_weights.data_ptr()
        assert expert_map is None and read_through is None and t == 1
    if weights.dtype != torch.float32 or weights.stride(0) != 1:
        weights = weights.float().contiguous()
    act = torch.empty((t * k, inter), dtype=x.dtype, device=x.device)  # [N, I]
    assert read_through is None or expert_map is not None, "read-through resolves misses by slot"
    if configs is None:
        configs = _configs(x, w13, topk_ids, expert_map, block_n, kernels)
    moe_gate_up_gemv(x, w13, act, ids, k, configs[0], expert_map, read_through,
                     route, weights if route is not None else None, kernels=kernels)
    outs = None
    if norm_next is not None and summed is not None:
        outs = (out, summed) if parts is None else (out, summed, parts)
    moe_down_gemv(act, w2, out, weights, ids, k, configs[1], expert_map, read_through, norm_next, outs,
                  kernels=kernels)


def _configs(
    x: torch.Tensor, w13: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor | None,
    block_n: tuple[int, int] | None, kernels: KernelConfig,
) -> tuple[gc.GemvConfig, gc.GemvConfig]:
    """(gate/up, down) launch parameters: ``block_n`` over the defaults, else
    this device's table entry, else the defaults."""
    t, h = x.shape
    inter, k = w13.shape[1] // 2, topk_ids.shape[1]
    kinds = ("moe_gate_up", "moe_down")
    cuda = x.is_cuda
    if block_n is not None:
        cfgs = [dataclasses.replace(gc.default(kind, cuda), block_n=bn) for kind, bn in zip(kinds, block_n)]
    else:
        # The model's expert count, not the rows of w13 (an expert-slot cache holds fewer).
        e = expert_map.shape[0] if expert_map is not None else w13.shape[0]
        cfgs = [gc.pick(gc.moe_key(kind, e, h, inter, k), t, x.device, kernels) or gc.default(kind, cuda)
                for kind in kinds]
    return cfgs[0], cfgs[1]


def moe_gate_up_gemv(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    act: torch.Tensor,  # [T*k, I] out: SiLU(gate) * up per (token, choice)
    ids: torch.Tensor,  # [T*k] int32
    top_k: int,
    cfg: gc.GemvConfig,
    expert_map: torch.Tensor | None = None,
    read_through: ReadThrough | None = None,
    route: RouteParts | None = None,  # one row: x is pending
    weights_out: torch.Tensor | None = None,  # [k] fp32, with route: the experts' weights
    kernels: KernelConfig = DEFAULT_KERNELS,
) -> None:
    """The gate/up kernel alone (tools/tune/gemv times it on its own)."""
    h = x.shape[1]
    inter = act.shape[1]
    pairs = ids.shape[0]
    emap = expert_map if expert_map is not None else ids  # unread without HAS_MAP
    args = (x, w13, act, ids, emap, h, inter, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0))
    grid = (pairs, triton.cdiv(inter, cfg.block_n))
    # Default (gemv_configs.default): narrow column blocks, enough programs for every
    # SM at batch 1 (8 pairs x 48 blocks); wide K steps keep 32 KB per program in flight.
    extra: dict[str, object] = _read_through_consts(read_through)
    args += _read_through_args(read_through, ids, w13, "w13_col")
    if route is not None:
        extra.update(route_consts(route, weights_out, pairs, top_k))
    on = pdl.active(x, kernels)
    _gemv_gate_up_kernel[grid](*args, TOP_K=top_k, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                               EVEN_K=h % cfg.block_k == 0, HAS_MAP=expert_map is not None,
                               num_warps=cfg.num_warps, num_stages=cfg.num_stages, PDL=on, **extra,
                               **pdl.launch(on))
