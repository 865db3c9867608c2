"""The MoE down + combine GEMV kernels for a handful of tokens (the second of
moe_gemv_triton's two launches; twin: ``moe.fused_moe_ref``)::

    down:    program (token t, column block) -> out[t, cols]
             = sum_j  round(weight[t, j] * (act[t*k + j] . W2[e_{t,j}, cols]))

The 3-D kernel takes the k choices as a tile axis; it can fold the next
layer's input norm into its epilogue (``NormNext``). The combine adds the k
choices in a fixed order in fp32: deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ftserve_kernels import gemv_configs as gc
from ftserve_kernels import pdl
from ftserve_kernels.config import DEFAULT_KERNELS, KernelConfig
from ftserve_kernels.moe_read_through import (
    ReadThrough,
    _bank_rows,
    _miss_source,
    _read_through_args,
    _read_through_consts,
)


@triton.jit
def _gemv_down_combine3d_kernel(
    a_ptr, w_ptr, out_ptr, weights_ptr, ids_ptr, map_ptr, H, INTER,
    stride_at, stride_we, stride_wn, stride_ot,
    bank, miss_slot_ptr, miss_id_ptr, M, bank_col,
    res_ptr, nw_ptr, sum_ptr, normed_ptr, cnt_ptr, eps, stride_rt,
    TOP_K: tl.constexpr, BLOCK_KP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, HAS_MAP: tl.constexpr, K_STEPS: tl.constexpr,
    READ_THROUGH: tl.constexpr, BLOCK_M: tl.constexpr,
    PDL: tl.constexpr, NORM_NEXT: tl.constexpr = False, BLOCK_H: tl.constexpr = 16,
    NORM_DEFER: tl.constexpr = False, part_ptr=None,
):
    pdl.enter(PDL)  # the ids / activations come from the kernel before
    # The k choices are a third tile axis: the weight tile is [KP, N, K] and each
    # choice's act row loads once as [KP, K] (a [k * N, K] tile would load it N
    # times into registers, a second full-size tile that halves the programs an
    # SM can hold, and so the bytes in flight).
    t = tl.program_id(0).to(tl.int64)
    jj = tl.arange(0, BLOCK_KP)  # [KP]
    jmask = jj < TOP_K
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [N]
    nmask = cols < H
    pair = t * TOP_K + jj  # [KP]
    e = tl.load(ids_ptr + pair, mask=jmask, other=0)
    if HAS_MAP:
        e = tl.load(map_ptr + e, mask=jmask, other=0)
    e = e.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    tile = (cols * stride_wn)[None, :, None] + offs_k[None, None, :]  # [1, N, K] within a row
    b_ptrs = w_ptr + (e * stride_we)[:, None, None] + tile  # [KP, N, K]
    a_ptrs = a_ptr + (pair * stride_at)[:, None] + offs_k[None, :]  # [KP, K]
    bmask = jmask[:, None, None] & nmask[None, :, None]  # [KP, N, 1]
    if READ_THROUGH:  # as in the gate/up kernel, per choice
        src = _miss_source(e[:, None], miss_slot_ptr, miss_id_ptr, M, BLOCK_M)  # [KP]
        h_ptrs = (_bank_rows(bank, w_ptr.dtype.element_ty) + (tl.maximum(src, 0) * stride_we)[:, None, None]
                  + bank_col + tile)
        from_host = (src >= 0)[:, None, None]  # [KP, 1, 1]
    acc = tl.zeros([BLOCK_KP, BLOCK_N], tl.float32)
    # Unrolled (K_STEPS = cdiv(I, BLOCK_K), 3 at I = 768): the steps' loads are
    # independent, so they can all be in flight at once (one memory round trip per
    # program, not three; these loads are not cp.async-pipelined).
    for step in tl.static_range(K_STEPS):
        k0 = step * BLOCK_K
        if EVEN_K:
            av = tl.load(a_ptrs, mask=jmask[:, None], other=0.0)
            m3 = bmask
        else:
            kmask = offs_k < INTER - k0
            av = tl.load(a_ptrs, mask=jmask[:, None] & kmask[None, :], other=0.0)
            m3 = bmask & kmask[None, None, :]
        if READ_THROUGH:
            b = tl.load(tl.where(from_host, h_ptrs, b_ptrs), mask=m3, other=0.0)
            tl.store(b_ptrs, b, mask=m3 & from_host)
            h_ptrs += BLOCK_K
        else:
            b = tl.load(b_ptrs, mask=m3, other=0.0)
        acc += tl.sum(b.to(tl.float32) * av.to(tl.float32)[:, None, :], 2)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    wt = tl.load(weights_ptr + pair, mask=jmask, other=0.0)  # [KP]
    # Round each weighted row as the grouped path stores it, then sum the k choices
    # in fp32 in a fixed order: deterministic.
    y = (acc * wt[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)  # [KP, N]
    out = tl.sum(y, 0)  # [N]
    if NORM_NEXT and NORM_DEFER:
        _add_then_part(out, t, cols, nmask, res_ptr, nw_ptr, sum_ptr, normed_ptr, part_ptr, stride_rt,
                       out_ptr.dtype.element_ty, tl.program_id(1), tl.num_programs(1), t < tl.num_programs(0))
    elif NORM_NEXT:
        _add_then_norm_last(out, t, cols, nmask, res_ptr, nw_ptr, sum_ptr, normed_ptr, cnt_ptr, H, eps,
                            stride_rt, out_ptr.dtype.element_ty, BLOCK_H)
    else:
        tl.store(out_ptr + t * stride_ot + cols, out.to(out_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _add_then_norm_last(out, t, cols, nmask, res_ptr, nw_ptr, sum_ptr, normed_ptr, cnt_ptr, H, eps,
                        stride_rt, dt, BLOCK_H: tl.constexpr):
    """The next layer's input norm as the down kernel's epilogue: each program
    stores its columns of s = round(round(out) + residual) (fused_add_rms_norm's
    sum); the last program of the grid to arrive norms every row of s (from L2)
    as fused_add_rms_norm rounds it, and re-zeroes the counter."""
    res = tl.load(res_ptr + t * stride_rt + cols, mask=nmask, other=0.0).to(tl.float32)
    tl.store(sum_ptr + t * stride_rt + cols, (out.to(dt).to(tl.float32) + res).to(dt), mask=nmask)
    # Every thread's stores precede the barrier, the barrier the release by the
    # atomic; the winner's acquire precedes its (L2, .cg) loads.
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) * tl.num_programs(1) - 1:
        hh = tl.arange(0, BLOCK_H)
        hmask = hh < H
        nw = tl.load(nw_ptr + hh, mask=hmask, other=0.0).to(tl.float32)
        for r in range(tl.num_programs(0)):
            sv = tl.load(sum_ptr + r * stride_rt + hh, mask=hmask, other=0.0, cache_modifier=".cg")
            sv = sv.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(sv * sv, 0) / H + eps)
            tl.store(normed_ptr + r * stride_rt + hh, (nw * (sv * rstd).to(dt).to(tl.float32)).to(dt),
                     mask=hmask)
        tl.atomic_xchg(cnt_ptr, 0)


@triton.jit
def _add_then_part(out, t, cols, nmask, res_ptr, nw_ptr, sum_ptr, scaled_ptr, part_ptr, stride_rt, dt,
                   part, num_parts, row_ok):
    """The next layer's input norm left pending (NormNext.deferred): each program
    stores its columns of s = round(round(out) + residual), of round(w * s), and
    their sum of squares of s, parts[t, part] (``part`` of ``num_parts``: the
    program's column block; stored where ``row_ok``); the GEMV that reads w * s adds
    the parts up itself and scales its dot by 1/rms (gemv_triton, HAS_PARTS). No
    counter, no last program. Also the dense GEMV's epilogue (gemv_triton, NORM_DEFER)."""
    res = tl.load(res_ptr + t * stride_rt + cols, mask=nmask, other=0.0).to(tl.float32)
    sv = (out.to(dt).to(tl.float32) + res).to(dt)
    tl.store(sum_ptr + t * stride_rt + cols, sv, mask=nmask)
    nw = tl.load(nw_ptr + cols, mask=nmask, other=0.0).to(tl.float32)
    tl.store(scaled_ptr + t * stride_rt + cols, (nw * sv.to(tl.float32)).to(dt), mask=nmask)
    sf = tl.where(nmask, sv.to(tl.float32), 0.0)
    tl.store(part_ptr + t * num_parts + part, tl.sum(sf * sf, 0), mask=row_ok)


def norm_parts(h: int, cfg: gc.GemvConfig) -> int:
    """Partial sums of squares per row a deferred NormNext leaves: the down
    kernel's column programs."""
    return triton.cdiv(h, cfg.block_n)


@dataclass(frozen=True)
class NormNext:
    """The next layer's input norm, folded into the down kernel (its epilogue):
    the MoE output is added to ``residual`` and the sum normed with ``weight``;
    ``counter`` is one int32 the caller owns, zero between launches (None: a
    deferred norm in the dense GEMV, gemv_triton.gemv_add_norm_triton, which
    has no last program).
    ``deferred``: the kernel leaves the norm pending instead: the sum, weight *
    sum in place of the normed rows, and the partial sums of squares ([T,
    norm_parts] fp32), for a consumer that applies it (gemv_triton's ``parts``)."""

    residual: torch.Tensor  # [T, H]
    weight: torch.Tensor  # [H]
    eps: float
    counter: torch.Tensor | None  # [1] int32
    deferred: bool = False


def moe_down_gemv(
    act: torch.Tensor,  # [T*k, I]
    w2: torch.Tensor,  # [E, H, I]
    out: torch.Tensor,  # [T, H] out: the weighted sum over the k choices
    weights: torch.Tensor,  # [T*k] fp32, contiguous
    ids: torch.Tensor,  # [T*k] int32
    top_k: int,
    cfg: gc.GemvConfig,
    expert_map: torch.Tensor | None = None,
    read_through: ReadThrough | None = None,
    norm_next: NormNext | None = None,  # writes ``outs`` instead of ``out``
    outs: tuple[torch.Tensor, ...] | None = None,  # (normed, summed) [T, H] each (+ parts: deferred)
    kernels: KernelConfig = DEFAULT_KERNELS,
) -> None:
    """The down + combine kernel alone (tools/tune/gemv times it on its own)."""
    t, h = out.shape
    inter = act.shape[1]
    emap = expert_map if expert_map is not None else ids
    args = (act, w2, out, weights, ids, emap, h, inter,
            act.stride(0), w2.stride(0), w2.stride(1), out.stride(0))
    on = pdl.active(act, kernels)
    consts = dict(TOP_K=top_k, BLOCK_KP=triton.next_power_of_2(top_k), BLOCK_N=cfg.block_n,
                  BLOCK_K=cfg.block_k, EVEN_K=inter % cfg.block_k == 0, HAS_MAP=expert_map is not None,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages, PDL=on, **pdl.launch(on))
    grid = (t, triton.cdiv(h, cfg.block_n))
    if norm_next is not None:
        assert outs is not None and norm_next.residual.shape == out.shape
        assert norm_next.residual.stride() == outs[0].stride() == outs[1].stride() == (h, 1)
        assert (len(outs) == 3) == norm_next.deferred
        if norm_next.deferred:
            assert outs[2].shape == (t, grid[1]) and outs[2].dtype == torch.float32
            assert outs[2].is_contiguous()
        assert norm_next.counter is not None and norm_next.counter.dtype == torch.int32
        assert norm_next.weight.is_contiguous()
        norm_args = (norm_next.residual, norm_next.weight, outs[1], outs[0], norm_next.counter,
                     norm_next.eps, h)
    else:
        norm_args = (out, out, out, out, ids, 0.0, 0)  # unread
    _gemv_down_combine3d_kernel[grid](*args, *_read_through_args(read_through, ids, w2, "w2_col"),
                                      *norm_args, K_STEPS=triton.cdiv(inter, cfg.block_k),
                                      NORM_NEXT=norm_next is not None,
                                      NORM_DEFER=norm_next is not None and norm_next.deferred,
                                      part_ptr=outs[2] if outs is not None and len(outs) == 3 else None,
                                      BLOCK_H=triton.next_power_of_2(h),
                                      **_read_through_consts(read_through), **consts)
