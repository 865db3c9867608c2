"""o_proj with the MoE router folded in, for one decode row: no route launch.

At batch 1 the layer's add + norm + router + top-k launch (decode_fused_triton)
is a ~5 us latency chain between o_proj and the experts. Its logits are a
linear function of o_proj's input, up to the norm's scale::

    z = o + r,   o = W_o a + b        a: attention output [q], r: residual [H]
    logits = G (w * z) / rms(z)
           = (R_o a + R_r r + R_b) / rms(z),
    R_o = G diag(w) W_o [E, q],  R_r = G diag(w) [E, H],  R_b = G diag(w) b [E]

R_o, R_r and R_b are folded from the weights once (``fold_router``). So programs of
the o_proj launch compute ``pre = R_o a + R_r r + R_b`` (the logits times rms(z))
beside the o_proj rows. Top-k depends only on the logits' order, which rms > 0
keeps: the last router program to arrive takes the top-k ids from ``pre``
while the o_proj programs still stream their weights. The expert weights
(softmax of the k chosen logits) need 1/rms, known only once every o_proj
program is done: the MoE gate/up launch applies it (moe_gemv_triton, parts)::

    program p < PE:   pre[e] = R_o[e] . a + R_r[e] . r + R_b[e]   for its BLOCK_E rows e
                      the last of them (acq_rel counter, left 0): top-k of pre
                      -> ids [k], pre[ids] [k] (ties: lowest index; NaN never wins)
    program p >= PE:  s = round(round(W_o[cols] . a + b) + r[cols]) -> z; round(w * s),
                      and sum(s^2) over cols -> parts[p - PE]: the norm left pending,
                      as the MoE down kernel leaves it (moe_down_gemv_triton._add_then_part)

An fp8 checkpoint's o_proj (``Fp8Weight``: e4m3 codes, block scales) streams
its codes and dequantizes each tile as it arrives, as the dense fp8 GEMV does
(gemv_triton._fp8_scaled; its K step from fp8_gemv_triton.k_step, its launch
from the ``dense_fp8`` table entry): half the bytes of bf16. The router is
folded from the dequantized weight (R_o in the model's dtype, as for bf16), so
the pre-logits are those of the o_proj the unfused fp8 path computes.

The logits are not rounded through the normed row as the route kernel's are
(bf16 there), so near-ties can pick other experts than the unfused path;
within bf16 tolerance otherwise. Twin: ``oproj_route_ref``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ftserve_kernels import gemv_configs as gc
from ftserve_kernels import pdl
from ftserve_kernels.config import DEFAULT_KERNELS, KernelConfig
from ftserve_kernels.fp8_gemm_triton import check_weight
from ftserve_kernels.fp8_gemv_triton import k_step
from ftserve_kernels.fp8_quant import Fp8Weight, dequantize, fp8_linear_ref
from ftserve_kernels.gemv_triton import _fp8_scaled


@dataclass(frozen=True)
class FoldedRouter:
    """R_o = G diag(w) W_o [E, q] and R_r = G diag(w) [E, H] in the router's
    dtype, R_b = G diag(w) b [E] fp32 (o_proj's bias; None without), folded in
    fp32 (an fp8 W_o dequantized), and the versions of the tensors they were
    folded from (fold_versions)."""

    r_o: torch.Tensor
    r_r: torch.Tensor
    r_b: torch.Tensor | None
    versions: tuple[int, ...]


def fold_versions(gate_w: torch.Tensor, norm_w: torch.Tensor, o_w: torch.Tensor | Fp8Weight,
                  o_b: torch.Tensor | None = None) -> tuple[int, ...]:
    """The versions of the tensors a fold reads (an fp8 o_proj: its codes and
    scales): a fold is stale once they differ."""
    ws = (gate_w, norm_w) + ((o_w.codes, o_w.scale) if isinstance(o_w, Fp8Weight) else (o_w,))
    return tuple(w._version for w in ws + (() if o_b is None else (o_b,)))


def fold_router(gate_w: torch.Tensor, norm_w: torch.Tensor, o_w: torch.Tensor | Fp8Weight,
                o_b: torch.Tensor | None = None) -> FoldedRouter:
    """The folded router of one layer (gate_w [E, H], norm_w [H], o_w [H, q] or
    its fp8 codes and scales, o_b [H])."""
    g = gate_w.float() * norm_w.float()[None, :]  # [E, H]
    w_o = dequantize(o_w) if isinstance(o_w, Fp8Weight) else o_w.float()  # [H, q] fp32
    r_o = (g @ w_o).to(gate_w.dtype)  # [E, q]
    r_b = None if o_b is None else (g @ o_b.float()).contiguous()
    return FoldedRouter(r_o.contiguous(), g.to(gate_w.dtype).contiguous(), r_b,
                        fold_versions(gate_w, norm_w, o_w, o_b))


@dataclass(frozen=True)
class OprojRoute:
    """What the fused launch leaves for the experts: the sum z = o + r (the
    residual the MoE adds to), round(w * z) and the partial sums of squares of
    z (a pending norm), the top-k ids and their pre-logits."""

    summed: torch.Tensor  # [1, H]
    scaled: torch.Tensor  # [1, H]
    parts: torch.Tensor  # [1, P] fp32
    pre_sel: torch.Tensor  # [1, k] fp32
    ids: torch.Tensor  # [1, k] int32


def oproj_route_ref(
    a: torch.Tensor, o_w: torch.Tensor | Fp8Weight, o_b: torch.Tensor | None, residual: torch.Tensor,
    norm_w: torch.Tensor, folded: FoldedRouter, top_k: int,
) -> OprojRoute:
    """The torch twin (one part per row: the whole row's sum of squares; an fp8
    o_proj: fp8_linear_ref, the exact reference)."""
    o = fp8_linear_ref(a, o_w, o_b) if isinstance(o_w, Fp8Weight) else F.linear(a, o_w, o_b)  # in a's dtype
    s = (o.float() + residual.float()).to(a.dtype)
    scaled = (norm_w.float() * s.float()).to(a.dtype)
    parts = (s.float() * s.float()).sum(-1, keepdim=True)
    pre = a.float() @ folded.r_o.float().t() + residual.float() @ folded.r_r.float().t()  # [T, E]
    if folded.r_b is not None:
        pre = pre + folded.r_b
    pre = torch.nan_to_num(pre, nan=float("-inf"))
    sel, ids = torch.topk(pre, top_k, dim=-1, sorted=True)  # ties: torch's order
    return OprojRoute(s, scaled, parts, sel, ids.to(torch.int32))


@triton.jit
def _dot_rows(acc, w_ptrs, x_ptr, rmask, zero, offs_k, n, STEPS: tl.constexpr, BLOCK_K: tl.constexpr,
              s_rows=None, ROWS: tl.constexpr = 1, SCALE_K: tl.constexpr = 1, SCALE_STEP: tl.constexpr = True,
              FP8: tl.constexpr = False):
    """acc [R, BK] + W[rows, :n] * x[:n], chunk by chunk (x's chunk repeated down
    the rows, as gemv_triton's loop: L1 hits, no layout conversion). FP8: W
    holds e4m3 codes whose R = ROWS rows' scale rows start at s_rows [R], each
    tile dequantized as it arrives (the dense fp8 GEMV's _fp8_scaled)."""
    for step in tl.static_range(STEPS):
        kk = step * BLOCK_K + offs_k[None, :] + zero  # [R, BK]
        kmask = kk < n
        w = tl.load(w_ptrs, mask=rmask[:, None] & kmask, other=0.0).to(tl.float32)
        if FP8:
            w = _fp8_scaled(w, s_rows, step * BLOCK_K, rmask, n, ROWS, BLOCK_K, SCALE_K, SCALE_STEP)
        acc += w * tl.load(x_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
        w_ptrs += BLOCK_K
    return acc


@triton.jit
def _oproj_route_kernel(
    a_ptr, wo_ptr, bo_ptr, r_ptr, nw_ptr, ro_ptr, rr_ptr, rb_ptr,
    z_ptr, scaled_ptr, parts_ptr, pre_ptr, sel_ptr, ids_ptr, cnt_ptr,
    N, K, E, PE, stride_wo, stride_ro, stride_rr,
    HAS_BIAS: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr, N_STEPS: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_EALL: tl.constexpr, BLOCK_TK: tl.constexpr,
    PDL: tl.constexpr = 0,
    ws_ptr=None, stride_ws=0, SCALE_N: tl.constexpr = 1, SCALE_K: tl.constexpr = 1,
    FP8: tl.constexpr = False, SCALE_STEP: tl.constexpr = True,
):
    # FP8: wo holds e4m3 codes, ws their block scales [cdiv(N, SCALE_N),
    # cdiv(K, SCALE_K)] (Fp8Weight); the router rows stay in the model's dtype.
    pdl.enter(PDL)  # a (the attention) and r come from the launches before
    pid = tl.program_id(0)
    dt = a_ptr.dtype.element_ty
    offs_k = tl.arange(0, BLOCK_K)
    if pid < PE:
        # Router rows: their dot over a (K) and over r (N), one accumulator.
        rows = pid * BLOCK_E + tl.arange(0, BLOCK_E)
        emask = rows < E
        zero_e = tl.zeros([BLOCK_E, 1], tl.int32)
        acc_e = tl.zeros([BLOCK_E, BLOCK_K], tl.float32)
        row_off = rows.to(tl.int64)[:, None]
        acc_e = _dot_rows(acc_e, ro_ptr + row_off * stride_ro + offs_k[None, :], a_ptr, emask, zero_e,
                          offs_k, K, K_STEPS, BLOCK_K)
        acc_e = _dot_rows(acc_e, rr_ptr + row_off * stride_rr + offs_k[None, :], r_ptr, emask, zero_e,
                          offs_k, N, N_STEPS, BLOCK_K)
        pre = tl.sum(acc_e, 1)
        if HAS_BIAS:
            pre += tl.load(rb_ptr + rows, mask=emask, other=0.0)
        tl.store(pre_ptr + rows, pre, mask=emask)
        # Every thread's store precedes the barrier, the barrier the release by the
        # atomic; the winner's acquire precedes its (L2, .cg) loads.
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
        if done == PE - 1:
            e = tl.arange(0, BLOCK_EALL)
            eall = e < E
            lg = tl.load(pre_ptr + e, mask=eall, other=float("-inf"), cache_modifier=".cg")
            work = tl.where(eall & (lg == lg), lg, float("-inf"))  # NaN (padding garbage) never wins
            taken = e >= E
            tk = tl.arange(0, BLOCK_TK)
            sel = tl.zeros([BLOCK_TK], tl.float32)
            isel = tl.zeros([BLOCK_TK], tl.int32)
            for i in tl.static_range(TOP_K):
                best = tl.max(tl.where(taken, float("-inf"), work), 0)
                idx = tl.min(tl.where(~taken & (work == best), e, BLOCK_EALL), 0)  # lowest index on ties
                idx = tl.minimum(idx, E - 1)
                sel = tl.where(tk == i, best, sel)
                isel = tl.where(tk == i, idx, isel)
                taken = taken | (e == idx)
            tl.store(sel_ptr + tk, sel, mask=tk < TOP_K)
            tl.store(ids_ptr + tk, isel, mask=tk < TOP_K)
            tl.atomic_xchg(cnt_ptr, 0)
    else:
        # o_proj rows, as gemv_triton's one-row GEMV, then the pending norm's stores.
        q = pid - PE
        cols = q * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = cols < N
        s_rows = ws_ptr
        if FP8:
            s_rows = ws_ptr + (cols // SCALE_N) * stride_ws  # [N]: each weight row's scale row
        acc = _dot_rows(tl.zeros([BLOCK_N, BLOCK_K], tl.float32),
                        wo_ptr + cols.to(tl.int64)[:, None] * stride_wo + offs_k[None, :], a_ptr, nmask,
                        tl.zeros([BLOCK_N, 1], tl.int32), offs_k, K, K_STEPS, BLOCK_K,
                        s_rows, BLOCK_N, SCALE_K, SCALE_STEP, FP8)
        o = tl.sum(acc, 1)
        if HAS_BIAS:
            o += tl.load(bo_ptr + cols, mask=nmask, other=0.0).to(tl.float32)
        res = tl.load(r_ptr + cols, mask=nmask, other=0.0).to(tl.float32)
        sv = (o.to(dt).to(tl.float32) + res).to(dt)
        tl.store(z_ptr + cols, sv, mask=nmask)
        nw = tl.load(nw_ptr + cols, mask=nmask, other=0.0).to(tl.float32)
        tl.store(scaled_ptr + cols, (nw * sv.to(tl.float32)).to(dt), mask=nmask)
        sf = tl.where(nmask, sv.to(tl.float32), 0.0)
        tl.store(parts_ptr + q, tl.sum(sf * sf, 0))


def oproj_route_triton(
    a: torch.Tensor,  # [1, q] attention output
    o_w: torch.Tensor | Fp8Weight,  # [H, q]: the weight, or its e4m3 codes and block scales
    o_b: torch.Tensor | None,  # [H]
    residual: torch.Tensor,  # [1, H]
    norm_w: torch.Tensor,  # [H] the post-attention norm's weight
    folded: FoldedRouter,
    top_k: int,
    counter: torch.Tensor,  # [1] int32, zero; left zero
    block_e: int = 2,  # router rows a program
    kernels: KernelConfig = DEFAULT_KERNELS,
    config: gc.GemvConfig | None = None,  # the o_proj rows' launch, else as below
) -> OprojRoute:
    """-> OprojRoute. The o_proj rows launch as the dense GEMV launches o_proj
    (this device's table entry for the shape, ``dense`` or for an fp8 weight
    ``dense_fp8``, else the default)."""
    t, k = a.shape
    fp8 = isinstance(o_w, Fp8Weight)
    w = o_w.codes if isinstance(o_w, Fp8Weight) else o_w  # [H, q]
    h = w.shape[0]
    e = folded.r_o.shape[0]
    assert t == 1, "one decode row"
    assert a.stride(-1) == 1 and w.stride(-1) == 1 and residual.stride(-1) == 1 and norm_w.is_contiguous()
    assert w.shape[1] == k and folded.r_o.shape == (e, k) and folded.r_r.shape == (e, h)
    assert counter.dtype == torch.int32
    assert (o_b is None) == (folded.r_b is None), "folded with o_proj's bias iff it has one"
    if config is None:
        config = (gc.pick(gc.dense_key(h, k, fp8=fp8), 1, a.device, kernels)
                  or gc.default("dense_fp8" if fp8 else "dense", a.is_cuda, h, 1, k))
    scales: dict[str, object] = {}
    if isinstance(o_w, Fp8Weight):
        check_weight(o_w)
        bk, step = k_step(k, o_w.block_k, config.block_k)
        scales = dict(ws_ptr=o_w.scale, stride_ws=o_w.scale.stride(0), SCALE_N=o_w.block_n,
                      SCALE_K=o_w.block_k, FP8=True, SCALE_STEP=step)
    else:
        bk = min(config.block_k, triton.next_power_of_2(k))
    on = pdl.active(a, kernels)
    bn = config.block_n
    pe = triton.cdiv(e, block_e)
    pn = triton.cdiv(h, bn)
    summed = torch.empty((1, h), dtype=a.dtype, device=a.device)
    scaled = torch.empty_like(summed)
    parts = torch.empty((1, pn), dtype=torch.float32, device=a.device)
    pre = torch.empty(e, dtype=torch.float32, device=a.device)  # scratch
    sel = torch.empty((1, top_k), dtype=torch.float32, device=a.device)
    ids = torch.empty((1, top_k), dtype=torch.int32, device=a.device)
    _oproj_route_kernel[(pe + pn,)](
        a, w, o_b if o_b is not None else w, residual, norm_w, folded.r_o, folded.r_r,
        folded.r_b if folded.r_b is not None else folded.r_r,
        summed, scaled, parts, pre, sel, ids, counter,
        h, k, e, pe, w.stride(0), folded.r_o.stride(0), folded.r_r.stride(0),
        HAS_BIAS=o_b is not None, TOP_K=top_k, BLOCK_N=bn, BLOCK_K=bk,
        K_STEPS=triton.cdiv(k, bk), N_STEPS=triton.cdiv(h, bk),
        BLOCK_E=block_e, BLOCK_EALL=triton.next_power_of_2(e), BLOCK_TK=triton.next_power_of_2(top_k),
        num_warps=config.num_warps, num_stages=config.num_stages, PDL=on, **pdl.launch(on), **scales,
    )
    return OprojRoute(summed, scaled, parts, sel, ids)
