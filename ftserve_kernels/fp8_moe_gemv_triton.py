"""Fused MoE over fp8 experts for a handful of tokens (decode): two GEMV kernels,
no alignment, the combine fused; the e4m3 twins of moe_gemv_triton's::

    gate/up: program (pair p = t*k + j, column block) -> act[p, cols]
             = SiLU(x_t . W13[e_p, gate cols]) * (x_t . W13[e_p, up cols])
    down:    program (token t, column block) -> out[t, cols]
             = sum_j  round(weight[t, j] * (act[t*k + j] . W2[e_{t,j}, cols]))

Weights are Fp8Weight (codes [E, N, K] + scales [E, N / bn, K / bk]). The
gate/up kernel is built like gemv_triton's: each tile dequantized as it
arrives (_fp8_scaled), fp32 accumulator tiles, K summed once at the end, so
its unrolled K loop is loads and FMAs only; the down kernel's K steps are 128
columns, one scale per weight row, applied to the step's partial dot (its k
choices are a tile axis: an accumulator tile per choice would not fit the
registers). Activations stay in their dtype (w8a16). Rounding follows the grouped
path: act and each weighted down row round to x's dtype; the k rows add up in
fp32 in a fixed order. Twin: fp8_moe_triton.fused_moe_fp8_ref.

The next layer's input norm folds into the down kernel's epilogue as in the
bf16 pair (moe_down_gemv_triton's NormNext: normed by the grid's last program,
or left pending for the next qkv GEMV, ``fused_moe_fp8_add_norm_gemv_triton``).
A row routed by o_proj (oproj_route_triton, moe_gemv_triton.RouteParts) enters
as the bf16 pair's does: gate/up applies the post-attention norm left pending
and writes the chosen experts' weights.

Expert-slot cache (``expert_map``: expert -> slot row) and read-through
(``Fp8ReadThrough``): this step's misses are read by the GEMVs straight from
the pinned host bank over UVA, codes and scales, and written into their slot
as they pass (moe/cache.py), as the bf16 GEMVs do (moe_read_through.py). A
bank row is laid out as a slot row (moe/banks.Fp8Row); offsets are bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ftserve_kernels import gemv_configs as gc
from ftserve_kernels import pdl
from ftserve_kernels.config import DEFAULT_KERNELS, KernelConfig
from ftserve_kernels.fp8_gemm_triton import check_weight
from ftserve_kernels.fp8_gemv_triton import k_step
from ftserve_kernels.fp8_quant import GROUP, Fp8Weight
from ftserve_kernels.gemv_triton import _fp8_scaled
from ftserve_kernels.moe_down_gemv_triton import NormNext, _add_then_norm_last, _add_then_part
from ftserve_kernels.moe_gemv_triton import RouteParts, _route_inv_rms, _route_weights, route_consts
from ftserve_kernels.moe_read_through import _miss_source


class Fp8ReadThrough(NamedTuple):
    """This step's expert-cache misses (the admission's fill list, -1 = none:
    slot miss_slot[i] gets bank row miss_id[i]) and where a bank row keeps each
    part, in bytes from the row's start."""

    bank: torch.Tensor  # [ids, R] uint8, pinned (any CPU tensor for the interpreter)
    miss_slot: torch.Tensor  # [M] int32
    miss_id: torch.Tensor  # [M] int32
    row_bytes: int
    w13_col: int
    w2_col: int
    w13_scale_col: int
    w2_scale_col: int


@triton.jit
def _host_ptr(bank, src, row_bytes, col, dtype: tl.constexpr, ALIGN: tl.constexpr):
    """Pointer to byte ``col`` of bank row ``src`` (pinned memory over UVA), as dtype.
    The bank and its rows are 16-byte aligned (moe.kernels.check_bank, Fp8Row), codes
    start on 16 bytes and scales on 4 (ALIGN): the cast forgets it, so it is restored
    for vector loads."""
    return tl.multiple_of((bank + tl.maximum(src, 0) * row_bytes + col).to(tl.pointer_type(dtype)), ALIGN)


@triton.jit
def _copy_scales(src_rows, dst_rows, k0, mask_n, K, BLOCK_K: tl.constexpr, SCALE_K: tl.constexpr,
                 SCALE_STEP: tl.constexpr):
    """Read-through: the scales of the K step at k0 (as _fp8_scaled indexes
    them) from the bank's scale rows [N] into the slot's, where mask_n."""
    if SCALE_STEP:
        tl.store(dst_rows + k0 // SCALE_K, tl.load(src_rows + k0 // SCALE_K, mask=mask_n), mask=mask_n)
    else:
        kb = k0 // SCALE_K + tl.arange(0, BLOCK_K // SCALE_K)
        m = mask_n[:, None] & (kb[None, :] * SCALE_K < K)
        tl.store(dst_rows[:, None] + kb[None, :], tl.load(src_rows[:, None] + kb[None, :], mask=m), mask=m)


@triton.jit
def _fp8_gate_up_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, ids_ptr, map_ptr, H, INTER,
    stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_o,
    bank, miss_slot_ptr, miss_id_ptr, M, ROW_BYTES, W_COL, S_COL,
    TOP_K: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_MAP: tl.constexpr, READ_THROUGH: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr,
    SCALE_STEP: tl.constexpr = True,
    parts_ptr=None, P=1, eps=0.0, sel_ptr=None, wout_ptr=None,
    HAS_PARTS: tl.constexpr = False, BLOCK_P: tl.constexpr = 1, BLOCK_TK: tl.constexpr = 1,
):
    # HAS_PARTS (RouteParts, one row routed by oproj_route_triton): as the bf16
    # kernel, x is w * s of the post-attention norm left pending; the dots are
    # scaled by its 1/rms at the end and program (0, 0) writes the chosen
    # experts' weights (moe_gemv_triton._route_inv_rms, _route_weights).
    pdl.enter(PDL)  # the ids / activations come from the kernel before
    pair = tl.program_id(0)
    e = tl.load(ids_ptr + pair)
    if HAS_PARTS:  # summed before the K loop, its load beside the ids' (the bf16 kernel's reason)
        inv = _route_inv_rms(parts_ptr, P, H, eps, BLOCK_P)
    if HAS_MAP:  # expert -> row of w (an expert-slot cache)
        e = tl.load(map_ptr + e)
    e = e.to(tl.int64)
    tok = (pair // TOP_K).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    tile = offs_n[:, None] * stride_wn + offs_k[None, :]  # [N, K] within an expert's codes
    g_ptrs = w_ptr + e * stride_we + tile
    u_off = INTER * stride_wn
    sg_rel = (offs_n // SCALE_N) * stride_sn  # [N] within an expert's scales
    su_rel = ((offs_n + INTER) // SCALE_N) * stride_sn
    sg_ptrs = s_ptr + e * stride_se + sg_rel
    su_ptrs = s_ptr + e * stride_se + su_rel
    if READ_THROUGH:  # a miss of this step: read the bank row, write the slot as it passes
        src = _miss_source(e, miss_slot_ptr, miss_id_ptr, M, BLOCK_M)
        hw_ptrs = _host_ptr(bank, src, ROW_BYTES, W_COL, w_ptr.dtype.element_ty, 16) + tile
        hs_base = _host_ptr(bank, src, ROW_BYTES, S_COL, s_ptr.dtype.element_ty, 4)
        from_host = (src + tl.zeros([BLOCK_N, 1], tl.int64)) >= 0  # [N, 1]
        from_host_n = (src + tl.zeros([BLOCK_N], tl.int64)) >= 0  # [N]
    if READ_THROUGH:  # the scale rows: the bank's on a miss, else the slot's
        s_g = tl.where(from_host_n, hs_base + sg_rel, sg_ptrs)
        s_u = tl.where(from_host_n, hs_base + su_rel, su_ptrs)
    else:
        s_g = sg_ptrs
        s_u = su_ptrs
    x_ptrs = x_ptr + tok * stride_x + offs_k  # [K]
    # One fp32 accumulator tile per half, summed over K once at the end
    # (gemv_triton's structure): the unrolled loop is loads and FMAs only.
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for step in tl.static_range(K_STEPS):
        k0 = step * BLOCK_K
        if EVEN_K:
            xv = tl.load(x_ptrs + k0).to(tl.float32)
            m2 = nmask[:, None]
        else:
            kmask = offs_k < H - k0
            xv = tl.load(x_ptrs + k0, mask=kmask, other=0.0).to(tl.float32)
            m2 = nmask[:, None] & kmask[None, :]
        if READ_THROUGH:
            g = tl.load(tl.where(from_host, hw_ptrs + k0, g_ptrs + k0), mask=m2, other=0.0)
            u = tl.load(tl.where(from_host, hw_ptrs + k0 + u_off, g_ptrs + k0 + u_off), mask=m2, other=0.0)
            tl.store(g_ptrs + k0, g, mask=m2 & from_host)
            tl.store(g_ptrs + k0 + u_off, u, mask=m2 & from_host)
            _copy_scales(hs_base + sg_rel, sg_ptrs, k0, nmask & from_host_n, H, BLOCK_K, SCALE_K, SCALE_STEP)
            _copy_scales(hs_base + su_rel, su_ptrs, k0, nmask & from_host_n, H, BLOCK_K, SCALE_K, SCALE_STEP)
        else:
            g = tl.load(g_ptrs + k0, mask=m2, other=0.0)
            u = tl.load(g_ptrs + k0 + u_off, mask=m2, other=0.0)
        g = _fp8_scaled(g.to(tl.float32), s_g, k0, nmask, H, BLOCK_N, BLOCK_K, SCALE_K, SCALE_STEP)
        u = _fp8_scaled(u.to(tl.float32), s_u, k0, nmask, H, BLOCK_N, BLOCK_K, SCALE_K, SCALE_STEP)
        acc_g += g * xv[None, :]
        acc_u += u * xv[None, :]
    acc_g = tl.sum(acc_g, 1)  # [N]
    acc_u = tl.sum(acc_u, 1)
    if HAS_PARTS:
        acc_g = acc_g * inv
        acc_u = acc_u * inv
        if (pair == 0) & (tl.program_id(1) == 0):
            _route_weights(sel_ptr, wout_ptr, inv, x_ptr.dtype.element_ty, TOP_K, BLOCK_TK)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # SiLU(gate) * up, [N]
    tl.store(out_ptr + pair.to(tl.int64) * stride_o + offs_n, h.to(out_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _fp8_down_kernel(
    a_ptr, w_ptr, s_ptr, out_ptr, weights_ptr, ids_ptr, map_ptr, H, INTER,
    stride_a, stride_we, stride_wn, stride_se, stride_sn, stride_o,
    bank, miss_slot_ptr, miss_id_ptr, M, ROW_BYTES, W_COL, S_COL,
    TOP_K: tl.constexpr, BLOCK_KP: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_MAP: tl.constexpr, READ_THROUGH: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr,
    res_ptr=None, nw_ptr=None, sum_ptr=None, normed_ptr=None, cnt_ptr=None, eps=0.0, stride_rt=0,
    part_ptr=None, NORM_NEXT: tl.constexpr = False, NORM_DEFER: tl.constexpr = False,
    BLOCK_H: tl.constexpr = 16,
):
    pdl.enter(PDL)  # the ids / activations come from the kernel before
    # The k choices are a third tile axis: codes [KP, N, K], each choice's act
    # row loaded once as [KP, K] (moe_down_gemv_triton's 3-D kernel).
    t = tl.program_id(0).to(tl.int64)
    jj = tl.arange(0, BLOCK_KP)
    jmask = jj < TOP_K
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [N]
    nmask = cols < H
    pair = t * TOP_K + jj  # [KP]
    e = tl.load(ids_ptr + pair, mask=jmask, other=0)
    if HAS_MAP:
        e = tl.load(map_ptr + e, mask=jmask, other=0)
    e = e.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    tile = (cols * stride_wn)[None, :, None] + offs_k[None, None, :]  # [1, N, K] within an expert
    b_ptrs = w_ptr + (e * stride_we)[:, None, None] + tile  # [KP, N, K]
    s_rel = ((cols // SCALE_N) * stride_sn)[None, :]  # [1, N]
    s_ptrs = s_ptr + (e * stride_se)[:, None] + s_rel  # [KP, N]
    a_ptrs = a_ptr + (pair * stride_a)[:, None] + offs_k[None, :]  # [KP, K]
    bmask = jmask[:, None, None] & nmask[None, :, None]  # [KP, N, 1]
    smask = jmask[:, None] & nmask[None, :]  # [KP, N]
    if READ_THROUGH:  # as in the gate/up kernel, per choice
        src = _miss_source(e[:, None], miss_slot_ptr, miss_id_ptr, M, BLOCK_M)  # [KP]
        hw_ptrs = _host_ptr(bank, src, ROW_BYTES, W_COL, w_ptr.dtype.element_ty, 16)[:, None, None] + tile
        hs_ptrs = _host_ptr(bank, src, ROW_BYTES, S_COL, s_ptr.dtype.element_ty, 4)[:, None] + s_rel
        from_host = (src >= 0)[:, None, None]  # [KP, 1, 1]
        from_host_s = (src >= 0)[:, None]  # [KP, 1]
    acc = tl.zeros([BLOCK_KP, BLOCK_N], tl.float32)
    for step in tl.static_range(K_STEPS):
        k0 = step * BLOCK_K
        if EVEN_K:
            av = tl.load(a_ptrs + k0, mask=jmask[:, None], other=0.0)
            m3 = bmask
        else:
            kmask = offs_k < INTER - k0
            av = tl.load(a_ptrs + k0, mask=jmask[:, None] & kmask[None, :], other=0.0)
            m3 = bmask & kmask[None, None, :]
        kb = k0 // SCALE_K
        if READ_THROUGH:
            b = tl.load(tl.where(from_host, hw_ptrs + k0, b_ptrs + k0), mask=m3, other=0.0)
            sc = tl.load(tl.where(from_host_s, hs_ptrs + kb, s_ptrs + kb), mask=smask, other=0.0)
            tl.store(b_ptrs + k0, b, mask=m3 & from_host)
            tl.store(s_ptrs + kb, sc, mask=smask & from_host_s)
        else:
            b = tl.load(b_ptrs + k0, mask=m3, other=0.0)
            sc = tl.load(s_ptrs + kb, mask=smask, other=0.0)
        acc += tl.sum(b.to(tl.float32) * av.to(tl.float32)[:, None, :], 2) * sc
    wt = tl.load(weights_ptr + pair, mask=jmask, other=0.0)  # [KP]
    y = (acc * wt[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)  # [KP, N]
    out = tl.sum(y, 0)  # [N]
    if NORM_NEXT and NORM_DEFER:
        _add_then_part(out, t, cols, nmask, res_ptr, nw_ptr, sum_ptr, normed_ptr, part_ptr, stride_rt,
                       out_ptr.dtype.element_ty, tl.program_id(1), tl.num_programs(1), t < tl.num_programs(0))
    elif NORM_NEXT:
        _add_then_norm_last(out, t, cols, nmask, res_ptr, nw_ptr, sum_ptr, normed_ptr, cnt_ptr, H, eps,
                            stride_rt, out_ptr.dtype.element_ty, BLOCK_H)
    else:
        tl.store(out_ptr + t * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=nmask)


def moe_gemv_tiles(cuda: bool) -> tuple[gc.GemvConfig, gc.GemvConfig]:
    """The built-in (gate/up, down) launch parameters (block_n, block_k, warps;
    no stages: the K loops are unrolled): gemv_configs.default's, tuned per
    device into the GEMV table (tools/tune/gemv.py, the fp8_* problems). Hopper:
    a gate/up program streams 2 x 8 rows of H codes (32 KB at H 2048) in steps
    of 512 codes a row (a lane's 16-byte load, one scale a lane), accumulating
    like gemv_triton; a down program 8 choices x 4 rows of I codes in 128-code
    steps (24 KB at I 768: 512 programs a token at H 2048, as the tuned bf16
    down; 16 rows left 128, fewer than the SMs)."""
    return gc.default("moe_fp8_gate_up", cuda), gc.default("moe_fp8_down", cuda)


def _tiles(x: torch.Tensor, w13: Fp8Weight, top_k: int, kernels: KernelConfig,
           ) -> tuple[gc.GemvConfig, gc.GemvConfig]:
    """The device table's entries for this shape at x's token count (keyed by
    w13's expert rows, as moe_gemv_triton's), else the built-in tiles."""
    e, two_i, h = w13.codes.shape
    t = x.shape[0]
    gate_up, down = moe_gemv_tiles(x.is_cuda)
    return (gc.pick(gc.moe_key("moe_fp8_gate_up", e, h, two_i // 2, top_k), t, x.device, kernels) or gate_up,
            gc.pick(gc.moe_key("moe_fp8_down", e, h, two_i // 2, top_k), t, x.device, kernels) or down)


def _rt_args(rt: Fp8ReadThrough | None, ids: torch.Tensor, part: str) -> tuple[object, ...]:
    if rt is None:
        return 0, ids, ids, 0, 0, 0, 0  # unread: READ_THROUGH=False
    assert rt.bank.dtype == torch.uint8 and rt.bank.shape[1] == rt.row_bytes
    assert rt.row_bytes % 16 == 0 and rt.w13_col % 16 == 0 and rt.w2_col % 16 == 0, "_host_ptr's alignment"
    assert rt.w13_scale_col % 4 == 0 and rt.w2_scale_col % 4 == 0 and rt.bank.data_ptr() % 16 == 0
    assert rt.miss_slot.dtype == rt.miss_id.dtype == torch.int32 and rt.miss_slot.shape == rt.miss_id.shape
    w_col, s_col = (rt.w13_col, rt.w13_scale_col) if part == "w13" else (rt.w2_col, rt.w2_scale_col)
    return rt.bank.data_ptr(), rt.miss_slot, rt.miss_id, rt.miss_slot.numel(), rt.row_bytes, w_col, s_col


def fused_moe_fp8_gemv_triton(
    x: torch.Tensor,  # [T, H]
    w13: Fp8Weight,  # [E, 2I, H]
    w2: Fp8Weight,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_ids: torch.Tensor,  # [T, k] int32
    expert_map: torch.Tensor | None = None,  # [E] int32: expert -> row of w13 / w2
    read_through: Fp8ReadThrough | None = None,  # misses read from the host bank (needs expert_map)
    tiles: tuple[gc.GemvConfig, gc.GemvConfig] | None = None,  # (gate/up, down)
    kernels: KernelConfig = DEFAULT_KERNELS,
) -> torch.Tensor:
    """Both launches -> [T, H] in x's dtype."""
    out = torch.empty_like(x)
    _launch(x, w13, w2, topk_weights, topk_ids, expert_map, read_through, kernels, tiles, out)
    return out


def fused_moe_fp8_add_norm_gemv_triton(
    x: torch.Tensor, w13: Fp8Weight, w2: Fp8Weight, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    norm_next: NormNext, tiles: tuple[gc.GemvConfig, gc.GemvConfig] | None = None,
    kernels: KernelConfig = DEFAULT_KERNELS, route: RouteParts | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The pair with the next layer's input norm in the down epilogue ->
    (rms_norm(out + residual), out + residual, None), or with ``norm_next.deferred``
    (weight * (out + residual), out + residual, partial sums of squares [T, P] fp32),
    as moe_gemv_triton.fused_moe_add_norm_gemv_triton. ``route`` (one row routed
    by oproj_route_triton): x is pending; gate/up applies its norm and writes the
    experts' weights into ``topk_weights`` (fp32), as there."""
    t, h = x.shape
    normed, summed = torch.empty_like(x), torch.empty_like(x)
    bn_d = (tiles or _tiles(x, w13, topk_ids.shape[1], kernels))[1].block_n
    parts = (torch.empty((t, triton.cdiv(h, bn_d)), dtype=torch.float32, device=x.device)
             if norm_next.deferred else None)
    assert norm_next.residual.shape == x.shape and norm_next.residual.stride() == (h, 1)
    assert norm_next.counter is not None and norm_next.counter.dtype == torch.int32
    assert norm_next.weight.is_contiguous()
    _launch(x, w13, w2, topk_weights, topk_ids, None, None, kernels, tiles, normed,
            (norm_next, summed, parts), route)
    return normed, summed, parts


def _launch(
    x: torch.Tensor, w13: Fp8Weight, w2: Fp8Weight, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None, read_through: Fp8ReadThrough | None, kernels: KernelConfig,
    tiles: tuple[gc.GemvConfig, gc.GemvConfig] | None, out: torch.Tensor,
    norm: tuple[NormNext, torch.Tensor, torch.Tensor | None] | None = None, route: RouteParts | None = None,
) -> None:
    """Both launches into ``out`` (with ``norm``: (the NormNext, the sums' output,
    the parts' output when deferred), ``out`` receiving the normed rows; with
    ``route``: gate/up writes the weights into topk_weights)."""
    t, h = x.shape
    inter = w13.codes.shape[1] // 2
    k = topk_ids.shape[1]
    if t == 0:
        return
    assert x.stride(-1) == 1 and w13.codes.stride(-1) == 1 and w2.codes.stride(-1) == 1
    check_weight(w13)
    check_weight(w2)
    assert read_through is None or expert_map is not None, "read-through resolves misses by slot"
    ids = topk_ids.reshape(-1).contiguous()  # [N]
    weights = topk_weights.reshape(-1)
    if route is not None:  # gate/up writes them
        assert weights.dtype == torch.float32 and weights.data_ptr() == topk_weights.data_ptr()
        assert expert_map is None and read_through is None and t == 1
    if weights.dtype != torch.float32 or weights.stride(0) != 1:
        weights = weights.float().contiguous()
    act = torch.empty((t * k, inter), dtype=x.dtype, device=x.device)  # [N, I]
    cfg_gu, cfg_d = tiles or _tiles(x, w13, k, kernels)
    bn_gu, bn_d = cfg_gu.block_n, cfg_d.block_n
    bk_gu, step_gu = k_step(h, w13.block_k, cfg_gu.block_k)
    # The down kernel's steps stay inside one scale column (GROUP divides its blocks).
    bk_d = min(cfg_d.block_k, GROUP, triton.next_power_of_2(inter))
    emap = expert_map if expert_map is not None else ids
    m = 0 if read_through is None else read_through.miss_slot.numel()
    on = pdl.active(x, kernels)
    common = dict(HAS_MAP=expert_map is not None, READ_THROUGH=read_through is not None,
                  BLOCK_M=max(2, triton.next_power_of_2(max(m, 1))), PDL=on, num_stages=1, **pdl.launch(on))
    routed = {} if route is None else route_consts(route, weights, ids.shape[0], k)
    _fp8_gate_up_kernel[(t * k, triton.cdiv(inter, bn_gu))](
        x, w13.codes, w13.scale, act, ids, emap, h, inter,
        x.stride(0), w13.codes.stride(0), w13.codes.stride(1), w13.scale.stride(0), w13.scale.stride(1),
        act.stride(0), *_rt_args(read_through, ids, "w13"),
        TOP_K=k, SCALE_N=w13.block_n, SCALE_K=w13.block_k, BLOCK_N=bn_gu, BLOCK_K=bk_gu,
        K_STEPS=triton.cdiv(h, bk_gu), EVEN_K=h % bk_gu == 0, SCALE_STEP=step_gu, num_warps=cfg_gu.num_warps,
        **routed, **common)
    fold: dict[str, object] = {}
    if norm is not None:
        nn, summed, parts = norm
        fold = dict(res_ptr=nn.residual, nw_ptr=nn.weight, sum_ptr=summed, normed_ptr=out, cnt_ptr=nn.counter,
                    eps=nn.eps, stride_rt=h, part_ptr=parts, NORM_NEXT=True, NORM_DEFER=nn.deferred,
                    BLOCK_H=triton.next_power_of_2(h))
    _fp8_down_kernel[(t, triton.cdiv(h, bn_d))](
        act, w2.codes, w2.scale, out, weights, ids, emap, h, inter,
        act.stride(0), w2.codes.stride(0), w2.codes.stride(1), w2.scale.stride(0), w2.scale.stride(1),
        out.stride(0), *_rt_args(read_through, ids, "w2"),
        TOP_K=k, BLOCK_KP=triton.next_power_of_2(k), SCALE_N=w2.block_n, SCALE_K=w2.block_k,
        BLOCK_N=bn_d, BLOCK_K=bk_d, K_STEPS=triton.cdiv(inter, bk_d), EVEN_K=inter % bk_d == 0,
        num_warps=cfg_d.num_warps, **fold, **common)
