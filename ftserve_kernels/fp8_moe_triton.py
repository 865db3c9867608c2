"""Fused MoE over fp8 experts for prefill: grouped w8a8 GEMMs over moe_align,
and the torch twin of every fp8 expert path.

Weights as in moe.py, in fp8 (Fp8Weight): ``w13`` codes [E, 2I, H] (gate rows
then up rows) with scales [E, 2I / bn, H / bk], ``w2`` codes [E, H, I].

Kernels (moe_triton's structure, on e4m3 codes and the tensor cores' fp8 dot):
x [T, H] is quantized once per token and 128 columns (fp8_quant); pairs are
grouped by expert by moe_align (fixed shapes, padded blocks); then

    gate/up: a tile of rows (pairs) x 128 columns of I: gate and up accumulate
             dot(x codes, W13 codes) x scales over H in 128-column steps;
             SiLU(gate) * up rounds to x's dtype, and since the tile holds a
             whole 128-column group of each row, the epilogue quantizes it for
             the down GEMM itself (codes [N, I] + scales [N, I / 128])
    down:    the same over I, times the routing weight, into y [N, H]
    combine: y.view(T, k, H).sum(1)

Twin: fused_moe_fp8_ref(..., act_quant=True). No host read anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ftserve_kernels.attention_common import FP8_MAX, FP8_MIN_AMAX, interpreting, mma, round_e4m3
from ftserve_kernels.fp8_gemm_triton import block_scaled_dot, check_weight
from ftserve_kernels.fp8_quant import (
    FP8,
    GROUP,
    Fp8Weight,
    dequantize,
    fake_quant_act,
    quantize_act_triton,
)
from ftserve_kernels.moe_align_triton import moe_align
from ftserve_kernels.moe_triton import _block_coords


def fused_moe_fp8_ref(
    x: torch.Tensor,  # [T, H]
    w13: Fp8Weight,  # [E, 2I, H]
    w2: Fp8Weight,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]: rows of w13 / w2
    act_quant: bool = False,
) -> torch.Tensor:
    """sum_k weights[t, k] * down(SiLU(gate(x_t)) * up(x_t)) -> [T, H] in x's dtype.

    Each expert's weights are dequantized per block and multiplied in fp32;
    SiLU(gate) * up rounds to x's dtype (as the kernels store it), each weighted
    down row too, and the k rows add up in fp32. ``act_quant``: the GEMM inputs
    (x, then the SiLU product) go through the per-token-group fp8 quantization
    first, as in the prefill kernels; without it this is the exact reference.
    """
    top_k = topk_ids.shape[1]
    inter = w2.codes.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
    flat = topk_ids.reshape(-1).long()  # [T*k]
    order = torch.argsort(flat, stable=True)  # [T*k], grouped by expert
    counts = torch.bincount(flat, minlength=w13.codes.shape[0]).tolist()  # host read: reference only
    token_of = order // top_k
    weight_of = topk_weights.reshape(-1).index_select(0, order).float()  # [T*k]
    xin = fake_quant_act(x) if act_quant else x.float()  # [T, H] fp32
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tok = token_of[start:start + n]  # [n]
        gate_up = F.linear(xin.index_select(0, tok), dequantize(w13.expert(e)))  # [n, 2I] fp32
        h = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype)  # [n, I]
        hin = fake_quant_act(h) if act_quant else h.float()
        y = F.linear(hin, dequantize(w2.expert(e))) * weight_of[start:start + n, None]  # [n, H]
        out.index_add_(0, tok, y.to(x.dtype).float())
        start += n
    return out.to(x.dtype)


# ---------------------------------------------------------------- Triton


@dataclass(frozen=True)
class Fp8MoeConfig:
    block_m: int  # pairs per tile (the alignment's block)
    down_block_n: int  # H columns per down tile (gate/up tiles are GROUP = 128 columns of I)
    num_warps: int
    num_stages: int
    group_m: int = 8

    @staticmethod
    def pick(num_pairs: int, num_experts: int, cuda: bool, tile_scale: bool = True) -> Fp8MoeConfig:
        """Rows per tile from the average pairs per expert (each expert's pairs are
        padded to whole tiles): 128 past a few hundred, 64 (the smallest fp8
        wgmma) from a few dozen, 16 below (memory-bound anyway). Eight warps:
        gate/up holds two fp32 [rows, 128] accumulators and a third tile for
        each step's dot, 192 registers a thread at 128 rows (a warp group per
        64 rows), 96 at 64 rows (two warp groups split the columns), where four
        warps would need 255 and spill. Four stages of 48 KB (128 rows) fill
        Hopper's shared memory as the bf16 table's 4 x 48 KB do. Without
        ``tile_scale`` (per-channel or sub-128 weight scale blocks) each step's
        column scales add 64 registers, so at most 64 rows."""
        if not cuda:
            return Fp8MoeConfig(16, 32, 4, 1)
        per_expert = num_pairs / max(num_experts, 1)
        if per_expert >= 256 and tile_scale:
            return Fp8MoeConfig(128, 128, 8, 4)
        if per_expert >= 24:
            return Fp8MoeConfig(64, 128, 8, 4)
        return Fp8MoeConfig(16, 64, 4, 3)


def gate_up_tile_scale(w13: Fp8Weight, inter: int) -> bool:
    """Whether every gate/up tile (GROUP columns of I, at 0 and at INTER) lies in
    one weight scale row block: then the kernel loads one scale per K step."""
    return w13.block_n % GROUP == 0 and inter % GROUP == 0


@triton.jit
def _fp8_moe_gate_up_kernel(
    xq_ptr, xs_ptr, w_ptr, s_ptr, aq_ptr, as_ptr, sorted_ptr, block_expert_ptr, total_ptr, map_ptr,
    N, H, INTER, NUM_M, NUM_N,
    stride_xq, stride_xs, stride_we, stride_wn, stride_se, stride_sn, stride_aq, stride_as,
    TOP_K: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, HAS_MAP: tl.constexpr, OUT_DTYPE: tl.constexpr,
    TILE_SCALE: tl.constexpr = False,
):
    # Registers decide this kernel's speed: gate and up accumulate in fp32
    # [BLOCK_M, 128] each, and each K step's dot lands in a third tile before
    # its scales apply. TILE_SCALE (the host's promise that each tile's gate
    # columns, and its up columns, lie in one weight scale row block) makes the
    # weight scale one scalar per K step, folded into the row scales; a [128]
    # vector of column scales in the accumulator's layout costs 32 registers a
    # thread (twice: gate and up), which at 128 rows and 8 warps spilled.
    # Scales for step k+1 load during step k: a load issued just before the
    # dot that needs it leaves its latency exposed every step.
    pid_m, pid_n = _block_coords(NUM_M, NUM_N, GROUP_M)
    if pid_m * BLOCK_M < tl.load(total_ptr):
        e = tl.load(block_expert_ptr + pid_m)
        if HAS_MAP:  # expert -> row of w (an expert-slot cache)
            e = tl.load(map_ptr + e)
        e = e.to(tl.int64)
        rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [M] pair ids
        rmask = rows < N
        tok = (rows // TOP_K).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # BLOCK_N = GROUP: one group of I
        nmask = offs_n < INTER
        offs_k = tl.arange(0, BLOCK_K)
        # int32 offsets from scalar bases that step along K: half the registers
        # of 64-bit pointer tensors (the host checks the offsets fit).
        a_off = tok.to(tl.int32)[:, None] * stride_xq + offs_k[None, :]  # [M, K]
        g_off = offs_n[None, :] * stride_wn + offs_k[:, None]  # [K, N]
        u_off = g_off + INTER * stride_wn
        w_base = w_ptr + e * stride_we
        xs_off = tok.to(tl.int32) * stride_xs  # [M], + the K group
        if TILE_SCALE:
            sg_ptrs = s_ptr + e * stride_se + (pid_n * BLOCK_N // SCALE_N) * stride_sn  # scalar, + the K block
            su_ptrs = s_ptr + e * stride_se + ((pid_n * BLOCK_N + INTER) // SCALE_N) * stride_sn
            sg = tl.load(sg_ptrs)
            su = tl.load(su_ptrs)
        else:
            sg_ptrs = s_ptr + e * stride_se + (offs_n // SCALE_N) * stride_sn  # [N], + the K block
            su_ptrs = s_ptr + e * stride_se + ((offs_n + INTER) // SCALE_N) * stride_sn
            sg = tl.load(sg_ptrs, mask=nmask, other=0.0)
            su = tl.load(su_ptrs, mask=nmask, other=0.0)
        sa = tl.load(xs_ptr + xs_off, mask=rmask, other=0.0)
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            if EVEN_K:
                a = tl.load(xq_ptr + k0 + a_off, mask=rmask[:, None], other=0.0)
                g = tl.load(w_base + k0 + g_off, mask=nmask[None, :], other=0.0)
                u = tl.load(w_base + k0 + u_off, mask=nmask[None, :], other=0.0)
            else:
                kmask = offs_k < H - k0
                a = tl.load(xq_ptr + k0 + a_off, mask=rmask[:, None] & kmask[None, :], other=0.0)
                g = tl.load(w_base + k0 + g_off, mask=kmask[:, None] & nmask[None, :], other=0.0)
                u = tl.load(w_base + k0 + u_off, mask=kmask[:, None] & nmask[None, :], other=0.0)
            kn = tl.minimum(k0 + BLOCK_K, H - 1)  # the next step's column (the last one: in bounds)
            sa_next = tl.load(xs_ptr + kn // BLOCK_K + xs_off, mask=rmask, other=0.0)
            if TILE_SCALE:
                sg_next = tl.load(sg_ptrs + kn // SCALE_K)
                su_next = tl.load(su_ptrs + kn // SCALE_K)
                acc_g += mma(a, g, UPCAST) * (sa * sg)[:, None]
                acc_u += mma(a, u, UPCAST) * (sa * su)[:, None]
            else:
                sg_next = tl.load(sg_ptrs + kn // SCALE_K, mask=nmask, other=0.0)
                su_next = tl.load(su_ptrs + kn // SCALE_K, mask=nmask, other=0.0)
                acc_g += mma(a, g, UPCAST) * sa[:, None] * sg[None, :]
                acc_u += mma(a, u, UPCAST) * sa[:, None] * su[None, :]
            sa = sa_next
            sg = sg_next
            su = su_next
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # SiLU(gate) * up, [M, N]
        h = h.to(OUT_DTYPE).to(tl.float32)  # rounded as a stored activation would be
        # Quantized for the down GEMM: the tile is one whole group of each row.
        # IEEE divisions (div_rn; "/" is approximate on the GPU), as the twin's.
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(h), 1), FP8_MIN_AMAX), FP8_MAX)  # [M]
        q = round_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(h, scale[:, None]), -FP8_MAX), FP8_MAX))
        rows64 = rows.to(tl.int64)
        tl.store(aq_ptr + rows64[:, None] * stride_aq + offs_n[None, :], q.to(aq_ptr.dtype.element_ty),
                 mask=rmask[:, None] & nmask[None, :])
        tl.store(as_ptr + rows64 * stride_as + pid_n, scale, mask=rmask)


@triton.jit
def _fp8_moe_down_kernel(
    aq_ptr, as_ptr, w_ptr, s_ptr, y_ptr, weights_ptr, sorted_ptr, block_expert_ptr, total_ptr, map_ptr,
    N, H, INTER, NUM_M, NUM_N,
    stride_aq, stride_as, stride_we, stride_wn, stride_se, stride_sn, stride_y,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, HAS_MAP: tl.constexpr,
    TILE_SCALE: tl.constexpr = False,
):
    # TILE_SCALE and the scales loaded a step ahead: as in the gate/up kernel.
    pid_m, pid_n = _block_coords(NUM_M, NUM_N, GROUP_M)
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
        a_ptrs = aq_ptr + rows64[:, None] * stride_aq + offs_k[None, :]  # [M, K]
        b_ptrs = w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]  # [K, N]
        as_ptrs = as_ptr + rows64 * stride_as
        if TILE_SCALE:
            bs_ptrs = s_ptr + e * stride_se + (pid_n * BLOCK_N // SCALE_N) * stride_sn  # scalar
        else:
            bs_ptrs = s_ptr + e * stride_se + (offs_n // SCALE_N) * stride_sn
        acc = block_scaled_dot(a_ptrs, b_ptrs, as_ptrs, bs_ptrs, rmask, nmask, INTER,
                               BLOCK_M, BLOCK_N, BLOCK_K, SCALE_K, TILE_SCALE, EVEN_K, UPCAST)
        wt = tl.load(weights_ptr + rows64, mask=rmask, other=0.0)  # [M] routing weight
        acc = acc * wt[:, None]
        tl.store(y_ptr + rows64[:, None] * stride_y + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=rmask[:, None] & nmask[None, :])


_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def fused_moe_fp8_triton(
    x: torch.Tensor,  # [T, H]
    w13: Fp8Weight,  # [E, 2I, H]
    w2: Fp8Weight,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_ids: torch.Tensor,  # [T, k] int32
    cfg: Fp8MoeConfig | None = None,
    expert_map: torch.Tensor | None = None,  # [E] int32: expert -> row of w13 / w2 (slot cache)
    valid_rows: torch.Tensor | None = None,  # [1] int: rows past it are padding (moe_align)
) -> torch.Tensor:
    """Grouped w8a8 MoE -> [T, H] in x's dtype: quantize x, align, gate/up
    (quantizing its output), down, combine. Five launches, fixed shapes. Rows
    past ``valid_rows`` are left unspecified (their pairs are skipped)."""
    t, h = x.shape
    inter = w13.codes.shape[1] // 2
    k = topk_ids.shape[1]
    n = t * k
    if t == 0:
        return torch.empty_like(x)
    assert x.stride(-1) == 1 and w13.codes.stride(-1) == 1 and w2.codes.stride(-1) == 1
    check_weight(w13)
    check_weight(w2)
    e = expert_map.numel() if expert_map is not None else w13.codes.shape[0]
    tile_scale = gate_up_tile_scale(w13, inter)
    cfg = cfg or Fp8MoeConfig.pick(n, e, x.is_cuda, tile_scale)
    assert x.numel() < 2 ** 31 and w13.codes[0].numel() < 2 ** 31, "int32 offsets in the gate/up kernel"
    xq, xs = quantize_act_triton(x)  # [T, H] e4m3, [T, H / 128]
    sorted_ids, block_expert, total = moe_align(topk_ids, e, cfg.block_m, valid_rows=valid_rows)
    weights = topk_weights.reshape(-1)
    if weights.dtype != torch.float32 or weights.stride(0) != 1:
        weights = weights.float().contiguous()
    gi = triton.cdiv(inter, GROUP)
    aq = torch.empty((n, inter), dtype=FP8, device=x.device)  # [N, I] codes of SiLU(gate) * up
    a_s = torch.empty((n, gi), dtype=torch.float32, device=x.device)  # [N, I / 128]
    y = torch.empty((n, h), dtype=x.dtype, device=x.device)  # [N, H]
    num_m = block_expert.shape[0]
    emap = expert_map if expert_map is not None else block_expert  # unread without HAS_MAP
    upcast = interpreting()
    _fp8_moe_gate_up_kernel[(num_m * gi,)](
        xq, xs, w13.codes, w13.scale, aq, a_s, sorted_ids, block_expert, total, emap,
        n, h, inter, num_m, gi,
        xq.stride(0), xs.stride(0), w13.codes.stride(0), w13.codes.stride(1), w13.scale.stride(0),
        w13.scale.stride(1), aq.stride(0), a_s.stride(0),
        TOP_K=k, SCALE_N=w13.block_n, SCALE_K=w13.block_k, BLOCK_M=cfg.block_m, BLOCK_N=GROUP,
        BLOCK_K=GROUP, GROUP_M=cfg.group_m, EVEN_K=h % GROUP == 0, UPCAST=upcast,
        HAS_MAP=expert_map is not None, OUT_DTYPE=_TL_DTYPE[x.dtype], TILE_SCALE=tile_scale,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    nd = triton.cdiv(h, cfg.down_block_n)
    _fp8_moe_down_kernel[(num_m * nd,)](
        aq, a_s, w2.codes, w2.scale, y, weights, sorted_ids, block_expert, total, emap,
        n, h, inter, num_m, nd,
        aq.stride(0), a_s.stride(0), w2.codes.stride(0), w2.codes.stride(1), w2.scale.stride(0),
        w2.scale.stride(1), y.stride(0),
        SCALE_N=w2.block_n, SCALE_K=w2.block_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.down_block_n,
        BLOCK_K=GROUP, GROUP_M=cfg.group_m, EVEN_K=inter % GROUP == 0, UPCAST=upcast,
        HAS_MAP=expert_map is not None, TILE_SCALE=w2.block_n % cfg.down_block_n == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y.view(t, k, h).sum(dim=1)  # [T, H]
