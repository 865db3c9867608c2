"""Dense GEMV for decode-sized T (y = x W^T + b), optionally applying an RMSNorm
the layer before left pending (``parts``). Twin: F.linear (ops.py). Two
epilogues fold the launches around a dense layer's linears into it:

- ``glu``: W is a gated MLP's gate/up; the program pairs gate and up rows and
  writes SiLU(gate) * up (twin: F.linear, F.silu, mul), as moe_gemv_triton's
  gate/up kernel does for an expert;
- ``gemv_add_norm_triton``: y is added to a residual and the next RMSNorm left
  pending (twin: fused_add_rms_norm(F.linear(...), residual)), as the MoE down
  kernel leaves it (moe_down_gemv_triton, NormNext deferred): the next GEMV
  applies it from ``parts``.

At batch 1 the cuBLAS GEMVs of the attention projections read their weights at
about half of HBM bandwidth; here every program streams BLOCK_N full weight
rows in [BLOCK_N, BLOCK_K] tiles, for all T rows at once, with an fp32
accumulator per row shaped like the tile, so the unrolled K loop is loads and
FMAs only (no barrier: loads issue ahead) and K is summed once at the end::

    program p: y[:, p*BN : (p+1)*BN] = in[T, K] . W[p*BN : (p+1)*BN, K]^T

Launch parameters (BLOCK_N, BLOCK_K, warps, stages) come from this GPU's table
in gemv_configs (written by tools/tune/gemv.py) where it has the shape, else
from gemv_configs.default.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ftserve_kernels import gemv_configs as gc
from ftserve_kernels import pdl
from ftserve_kernels.config import DEFAULT_KERNELS, KernelConfig
from ftserve_kernels.moe_down_gemv_triton import NormNext, _add_then_part

GEMV_MAX_ROWS = 4  # rows per launch: every program holds all of them


@triton.jit
def _row_in(x_ptr, t, T, stride_x, kk, kmask):
    """Row t's input chunk as an fp32 tile shaped like the weight tile (kk [N, BK]
    repeats one K chunk down the rows: the loads hit L1, and the tile needs no
    layout conversion, so no shared memory and no barrier in the K loop)."""
    m = kmask & ((kk * 0 + t) < T)
    return tl.load(x_ptr + t * stride_x + kk, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _row_scale(parts, t, K, eps, HAS_PARTS: tl.constexpr, BLOCK_T: tl.constexpr):
    """1 / rms of row t from its partial sums of squares (``parts`` [BLOCK_T,
    BLOCK_P], loaded at the kernel's start; added in a fixed order, so every
    program gets the same value); 1 without parts."""
    scale = 1.0
    if HAS_PARTS and BLOCK_T == 1:  # [N, P], every row the same parts: [N]
        scale = tl.rsqrt(tl.sum(parts, 1) / K + eps)
    elif HAS_PARTS:
        tt = tl.arange(0, BLOCK_T)
        scale = tl.rsqrt(tl.sum(tl.sum(tl.where(tt[:, None] == t, parts, 0.0), 1), 0) / K + eps)
    return scale


@triton.jit
def _fp8_scaled(w, s_rows, k0, nmask, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                SCALE_K: tl.constexpr, SCALE_STEP: tl.constexpr):
    """An fp32 tile of e4m3 codes [N, BK] (columns k0..k0+BK of rows whose
    scale rows start at s_rows [N]) times their block scales. A lane's 16 codes
    (one 16-byte load) share one scale, loaded once: SCALE_STEP (the step inside
    one scale column) one per weight row [N]; else the step spans BLOCK_K //
    SCALE_K whole scale columns, [N, KB], applied through a [N, KB, SCALE_K]
    view of the tile (a per-column gather k // SCALE_K would issue one load per
    code, a [1, BK] scale row a layout conversion through shared memory).
    One return after both branches: Triton compiles the statements after an
    ``if`` that returns, so a SCALE_STEP step shorter than a scale column
    (BLOCK_K < SCALE_K) would build the other branch's empty arange."""
    if SCALE_STEP:
        out = w * tl.load(s_rows + k0 // SCALE_K, mask=nmask, other=0.0)[:, None]
    else:
        kb = k0 // SCALE_K + tl.arange(0, BLOCK_K // SCALE_K)
        sc = tl.load(s_rows[:, None] + kb[None, :], mask=nmask[:, None] & (kb[None, :] * SCALE_K < K),
                     other=0.0)  # [N, KB]
        out = tl.reshape(tl.reshape(w, [BLOCK_N, BLOCK_K // SCALE_K, SCALE_K]) * sc[:, :, None],
                         [BLOCK_N, BLOCK_K])
    return out


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    T, N, K, eps,
    stride_x, stride_w, stride_y,
    HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, K_STEPS: tl.constexpr, PDL: tl.constexpr,
    parts_ptr=None, P=1, HAS_PARTS: tl.constexpr = False, BLOCK_P: tl.constexpr = 1,
    s_ptr=None, stride_s=0, SCALE_N: tl.constexpr = 1, SCALE_K: tl.constexpr = 1,
    FP8: tl.constexpr = False, SCALE_STEP: tl.constexpr = True,
    GLU: tl.constexpr = False,
    res_ptr=None, nw_ptr=None, sum_ptr=None, part_out_ptr=None, NORM_DEFER: tl.constexpr = False,
):
    # FP8 (fp8_gemv_triton): w holds e4m3 codes with block scales s
    # [cdiv(N, SCALE_N), cdiv(K, SCALE_K)]; each tile is dequantized as it
    # arrives (_fp8_scaled: codes * scale in fp32, as the twin dequantizes), so
    # the loop stays loads and FMAs and K is still summed once at the end.
    # HAS_PARTS: x is w * s of a norm the layer before left pending (s the
    # residual sum; its programs' partial sums of squares of s in parts [T, P]):
    # the K loop is the plain GEMV's, and the row's 1/rms, known only from all
    # the parts, scales the dot at the end (the parts load first, in flight
    # beside the weights: loaded at the end it was an L2 round trip after the loop).
    # Rows are unrolled (BLOCK_T in 1, 2, 4), each with its own [N, BK] fp32
    # accumulator summed over K once at the end: the K loop is loads and FMAs only.
    # GLU (a gated MLP's gate/up, W rows [0, N/2) the gate, [N/2, N) the up
    # projection): a program's tile rows interleave gate row c and up row N/2 + c
    # for BLOCK_N / 2 output columns c, and its epilogue writes SiLU(gate) * up
    # (_row_out), as moe_gemv_triton's gate/up kernel does: the loop is the plain one.
    # NORM_DEFER (moe_down_gemv_triton.NormNext, deferred): y is added to a
    # residual and the next RMSNorm left pending, as the MoE down kernel leaves it.
    pid = tl.program_id(0)
    dt = x_ptr.dtype.element_ty
    vrows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [N]: y's columns (GLU: gate, up interleaved)
    nmask = vrows < N
    if GLU:
        cols = (vrows % 2) * (N // 2) + vrows // 2  # the weight row of each tile row
    else:
        cols = vrows
    offs_k = tl.arange(0, BLOCK_K)
    zero_n = tl.zeros([BLOCK_N, 1], tl.int32)  # broadcasts a K chunk down the rows
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_w + offs_k[None, :]  # [N, BK]
    if FP8:
        s_rows = s_ptr + (cols // SCALE_N) * stride_s  # [N]: each weight row's scale row
    if PDL:
        # The weights are no earlier kernel's output: the first K step's tile is
        # in flight before the wait (pdl.py), while the kernel before finishes.
        kk_first = offs_k[None, :] + zero_n
        w_first = tl.load(w_ptrs, mask=nmask[:, None] & (kk_first < K), other=0.0)
    pdl.enter(PDL)
    parts = 0.0
    if HAS_PARTS and BLOCK_T == 1:
        # One row: its parts loaded down the N rows of the weight tile's layout
        # ([N, P], L1 hits), so the sum at the end stays inside each warp (no
        # shared memory, no barrier on the tail) and lands in the dots' layout.
        pp = tl.arange(0, BLOCK_P)
        parts = tl.load(parts_ptr + pp[None, :] + zero_n, mask=(pp[None, :] + zero_n) < P, other=0.0)
    elif HAS_PARTS:  # in flight beside the weights; summed only at the end
        tt = tl.arange(0, BLOCK_T)
        pp = tl.arange(0, BLOCK_P)
        parts = tl.load(parts_ptr + tt[:, None] * P + pp[None, :],
                        mask=(tt[:, None] < T) & (pp[None, :] < P), other=0.0)
    acc0 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    if BLOCK_T > 1:
        acc1 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    if BLOCK_T > 2:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        acc3 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    # Unrolled (K_STEPS = cdiv(K, BLOCK_K)): the steps' loads are independent and
    # the body has no barrier, so the compiler can issue them ahead.
    for step in tl.static_range(K_STEPS):
        kk = step * BLOCK_K + offs_k[None, :] + zero_n  # [N, BK]
        kmask = kk < K
        if PDL and step == 0:
            w = w_first.to(tl.float32)
        elif EVEN_K:
            w = tl.load(w_ptrs, mask=nmask[:, None], other=0.0).to(tl.float32)
        else:
            w = tl.load(w_ptrs, mask=nmask[:, None] & kmask, other=0.0).to(tl.float32)
        if FP8:
            w = _fp8_scaled(w, s_rows, step * BLOCK_K, nmask, K, BLOCK_N, BLOCK_K, SCALE_K, SCALE_STEP)
        acc0 += w * _row_in(x_ptr, 0, T, stride_x, kk, kmask)
        if BLOCK_T > 1:
            acc1 += w * _row_in(x_ptr, 1, T, stride_x, kk, kmask)
        if BLOCK_T > 2:
            acc2 += w * _row_in(x_ptr, 2, T, stride_x, kk, kmask)
            acc3 += w * _row_in(x_ptr, 3, T, stride_x, kk, kmask)
        w_ptrs += BLOCK_K
    bias = tl.zeros([BLOCK_N], tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols, mask=nmask, other=0.0).to(tl.float32)
    _row_out(acc0, 0, T, N, K, eps, parts, bias, vrows, nmask, y_ptr, stride_y, res_ptr, nw_ptr, sum_ptr, part_out_ptr,
             dt, HAS_PARTS, BLOCK_T, BLOCK_N, GLU, NORM_DEFER)
    if BLOCK_T > 1:
        _row_out(acc1, 1, T, N, K, eps, parts, bias, vrows, nmask, y_ptr, stride_y, res_ptr, nw_ptr, sum_ptr, part_out_ptr,
                 dt, HAS_PARTS, BLOCK_T, BLOCK_N, GLU, NORM_DEFER)
    if BLOCK_T > 2:
        _row_out(acc2, 2, T, N, K, eps, parts, bias, vrows, nmask, y_ptr, stride_y, res_ptr, nw_ptr, sum_ptr, part_out_ptr,
                 dt, HAS_PARTS, BLOCK_T, BLOCK_N, GLU, NORM_DEFER)
        _row_out(acc3, 3, T, N, K, eps, parts, bias, vrows, nmask, y_ptr, stride_y, res_ptr, nw_ptr, sum_ptr, part_out_ptr,
                 dt, HAS_PARTS, BLOCK_T, BLOCK_N, GLU, NORM_DEFER)


@triton.jit
def _row_out(acc, t, T, N, K, eps, parts, bias, vrows, nmask, y_ptr, stride_y, res_ptr, nw_ptr, sum_ptr,
             part_out_ptr, dt, HAS_PARTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
             GLU: tl.constexpr, NORM_DEFER: tl.constexpr):
    """Row t's epilogue: y = dot * (1/rms of a pending norm) + bias, rounded to
    x's dtype ``dt`` as F.linear's output (also into an fp32 y: the lm_head); then
    stored, or (GLU) round(round(SiLU(gate)) * up) stored at the output column
    (F.silu's and mul's roundings), or (NORM_DEFER) added to the residual with
    the next norm left pending (moe_down_gemv_triton._add_then_part: the sum,
    weight * sum into y, this program's partial sum of squares)."""
    ydt = y_ptr.dtype.element_ty
    if t == 0:  # T >= 1
        row_ok = nmask
    else:  # the row block pads T up to BLOCK_T
        row_ok = (vrows * 0 + t) < T  # [N]
    y = tl.sum(acc, 1) * _row_scale(parts, t, K, eps, HAS_PARTS, BLOCK_T) + bias  # [N] fp32
    if GLU:
        g, u = tl.split(tl.reshape(y.to(dt).to(tl.float32), [BLOCK_N // 2, 2]))  # [N/2] each
        h = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u
        c = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(y_ptr + t * stride_y + c, h.to(dt).to(ydt), mask=(c < N // 2) & ((c * 0 + t) < T))
    elif NORM_DEFER:
        _add_then_part(y, t, vrows, nmask & row_ok, res_ptr, nw_ptr, sum_ptr, y_ptr, part_out_ptr, stride_y, dt,
                       tl.program_id(0), tl.num_programs(0), T > t)
    else:
        tl.store(y_ptr + t * stride_y + vrows, y.to(dt).to(ydt), mask=nmask & row_ok)


def gemv_triton(
    x: torch.Tensor,  # [T, K], T <= GEMV_MAX_ROWS
    w: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    eps: float = 1e-6,  # of the pending norm (``parts``)
    block: tuple[int, int] | None = None,  # (BLOCK_N, BLOCK_K) over the default's warps
    config: gc.GemvConfig | None = None,  # all launch parameters; wins over block
    out_dtype: torch.dtype | None = None,  # y's dtype (values rounded to x's dtype first)
    parts: torch.Tensor | None = None,  # [T, P] fp32: x is w * s of a pending norm (eps)
    kernels: KernelConfig = DEFAULT_KERNELS,
    glu: bool = False,  # W is a gated MLP's gate/up [2I, K]: y = SiLU(gate) * up [T, I]
) -> torch.Tensor:
    """-> y [T, N] in ``out_dtype`` or x's dtype. With ``parts``: y = (x . W^T)
    / rms(s), 1/rms from the sum of ``parts`` (x = w * s: a pending norm,
    moe_down_gemv_triton.NormNext deferred); the launch is the plain GEMV's.
    ``glu``: y [T, N/2] = round(SiLU(g)) * u of the rounded g = x . W[:N/2]^T (+ b),
    u = x . W[N/2:]^T (+ b), as F.linear, F.silu and mul round them (the
    launch's tile rows pair gate and up rows). Launch: ``config``, else
    ``block``, else the device table's entry for W's shape (gemv_configs), else
    the default."""
    t, n = x.shape[0], w.shape[0]
    if glu:
        assert n % 2 == 0 and out_dtype is None
    y = torch.empty((t, n // 2 if glu else n), dtype=out_dtype or x.dtype, device=x.device)
    _launch(x, w, bias, y, eps, block, config, parts, kernels, glu=glu)
    return y


def gemv_add_norm_triton(
    x: torch.Tensor,  # [T, K], T <= GEMV_MAX_ROWS
    w: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None,  # [N]
    norm_next: NormNext,  # deferred: residual [T, N], weight [N]
    config: gc.GemvConfig | None = None,
    kernels: KernelConfig = DEFAULT_KERNELS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fused_add_rms_norm(linear(x, w, bias), residual, weight) with the norm left
    pending in the GEMV's epilogue (as moe_down_gemv_triton leaves a deferred
    NormNext): -> (round(weight * s), s = round(round(y) + residual), parts [T,
    cdiv(N, BLOCK_N)] fp32: each program's sum of squares of its columns of s),
    for a GEMV that applies the norm (``parts``, ops.PendingNorm). The launch is
    the plain GEMV's at W's shape."""
    assert norm_next.deferred, "the dense GEMV leaves the norm pending (no last program)"
    t, n = x.shape[0], w.shape[0]
    res = norm_next.residual
    assert res.shape == (t, n) and res.is_contiguous() and norm_next.weight.is_contiguous()
    scaled, summed = torch.empty_like(res), torch.empty_like(res)
    config = config or _config(x, w, kernels)
    parts = torch.empty((t, triton.cdiv(n, config.block_n)), dtype=torch.float32, device=x.device)
    _launch(x, w, bias, scaled, 0.0, None, config, None, kernels, norm=(norm_next, summed, parts))
    return scaled, summed, parts


def _config(x: torch.Tensor, w: torch.Tensor, kernels: KernelConfig) -> gc.GemvConfig:
    """The device table's entry for W's shape at x's row block, else the default."""
    n, k = w.shape
    block_t = triton.next_power_of_2(x.shape[0])
    return gc.pick(gc.dense_key(n, k), block_t, x.device, kernels) or gc.default("dense", x.is_cuda, n, x.shape[0])


def _launch(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, eps: float,
    block: tuple[int, int] | None, config: gc.GemvConfig | None, parts: torch.Tensor | None,
    kernels: KernelConfig, glu: bool = False,
    norm: tuple[NormNext, torch.Tensor, torch.Tensor] | None = None,  # (norm_next, summed, parts out)
) -> None:
    t, k = x.shape
    n = w.shape[0]
    assert t <= GEMV_MAX_ROWS and w.shape[1] == k
    if parts is not None:
        assert parts.dtype == torch.float32 and parts.shape[0] == t and parts.is_contiguous()
    assert x.stride(-1) == 1 and w.stride(-1) == 1 and y.stride(-1) == 1
    if t == 0:
        return
    cuda = x.is_cuda
    block_t = triton.next_power_of_2(t)
    # Default (gemv_configs.default): BLOCK_K = 256 bf16 is one warp's width (8 a
    # lane), so warps split the rows and the final K sum stays inside a warp. qkv
    # (N = 5120, K = 2048): 320 programs of 16 rows (64 KB, 53 registers on sm_90);
    # o_proj (N = 2048, K = 4096): 256 programs of 8 rows (64 KB, 80 registers).
    # 4 rows of 16 would take 255 registers: 8. Tuned per device: tools/tune/gemv.py.
    if config is None:
        if block is not None:
            config = dataclasses.replace(gc.default("dense", cuda, n, t), block_n=block[0], block_k=block[1])
        else:
            config = _config(x, w, kernels)
    bn, bk = config.block_n, min(config.block_k, triton.next_power_of_2(k))
    if glu:
        bn = max(bn, 2)  # a gate row and its up row at least
    extra: dict[str, object] = {}
    if parts is not None:
        extra.update(parts_ptr=parts, P=parts.shape[1], HAS_PARTS=True, BLOCK_P=triton.next_power_of_2(parts.shape[1]))
    if norm is not None:
        nn, summed, part_out = norm
        assert summed.stride() == y.stride() == nn.residual.stride() == (n, 1)
        assert part_out.shape == (t, triton.cdiv(n, bn)) and part_out.is_contiguous()
        extra.update(res_ptr=nn.residual, nw_ptr=nn.weight, sum_ptr=summed, part_out_ptr=part_out, NORM_DEFER=True)
    on = pdl.active(x, kernels)
    _gemv_kernel[(triton.cdiv(n, bn),)](
        x, w, bias if bias is not None else w, y,
        t, n, k, eps,
        x.stride(0), w.stride(0), y.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_T=block_t, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0, K_STEPS=triton.cdiv(k, bk),
        num_warps=config.num_warps, num_stages=config.num_stages, PDL=on, GLU=glu, **extra, **pdl.launch(on),
    )
