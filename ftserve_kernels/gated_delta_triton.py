"""Gated DeltaNet in Triton: the four entry points of ftserve_kernels/gated_delta.py
(its torch reference twins, and the math) with the same signatures.

The conv's two are in short_conv_triton.py, a speculative verify step's four
(verify and commit, of the conv and the rule) in gated_delta_verify_triton.py;
all re-exported here. Decode (one
token per sequence) is one launch for the conv and one for the rule, fixed
shapes, state read and written in place in its pool slot by index: no gather /
scatter copies, no host data, nothing that syncs; capturable.

    gated_delta_decode   grid (B, Hv, dv / BLOCK_V): S [dk, BLOCK_V] of one slot in
                         registers, decayed, delta-updated, read by q, written back;
                         ``_fused``: the gates g, beta computed from the layer's a, b
                         in the launch (views into the projection, read in place)

Prefill of packed sequences (device ``cu_seqlens``; the host ``seq_bounds`` only
size the grids) is two launches for the rule:

    chunk_local          grid (chunks, Hv), every chunk of every sequence at once:
                         A = strictly-lower (beta k k^T * D), Tinv = (I + A)^-1,
                         Aqk = causal (q k^T * D)           -> scratch [chunks, Hv, C, C] each
    chunk_scan           grid (B, Hv, dv / BLOCK_V), serial over one sequence's chunks:
                         U = Tinv (beta v - beta gamma k S), O = gamma q S + Aqk U,
                         S = gamma_C S + (gamma_C / gamma k)^T U; S starts in and
                         ends in the sequence's slot

Chunk c of the packed batch is chunk j of sequence b when the chunks of the
sequences before b number c - j: programs find (b, j) by a scan over cu_seqlens
(a handful of scalar loads), so the chunk grid may also be a bound (programs
past the last chunk store nothing that is read).

The inverse: (I + A) = D (I + N) with D = I + A's 16x16 diagonal blocks and
N = D^-1 (A's blocks below them). Each diagonal block is inverted by forward
substitution (16 rows, the four blocks side by side), then, N being nilpotent
of block order 4, (I + A)^-1 = (I - N + N^2 - N^3) D^-1: the same products a
blocked forward substitution forms, as four 64x64 matmuls (Horner's form). For a
bf16 model those run in tf32x3 (about fp32), A's and Aqk's in tf32 from fp32 q
and k; the scan's matmuls take their operands in the input dtype (bf16; the
rounding of flash-linear-attention's kernels) with fp32 accumulation
(attention_common.mma: upcast under the interpreter, whose bf16 tl.dot is
wrong), and the state S stays fp32. An fp32 model runs every one of them in
fp32 ("ieee", EXACT): fp32 is the dtype parity with transformers is measured
in, and what the interpreter tests check (mma's docstring).

Padding rows of a partial chunk load as k = q = v = 0, beta = g = 0, as the
reference pads: they change neither S nor the decay, and their outputs are not
stored.

Why not flash-linear-attention (fla-core, MIT), whose chunked kernels are the
usual choice: its gated delta rule takes per-sequence initial states and returns
final states, never a pool and slot indices, so decode would gather and scatter
every state around the kernel (three times the HBM traffic of a step that is
nothing but that traffic); its kernels do not run under the CPU interpreter
(autotuning needs a driver), so CI could not test them; and staying free of host
syncs would rest on its internals (device cu_seqlens are read back unless the
host copy is passed; autotuning times kernels at first use). tools/bench/gated_delta
runs it behind this seam next to these kernels, to settle prefill speed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ftserve_kernels.attention_common import interpreting, mma
from ftserve_kernels.gated_delta import CHUNK, L2_EPS, InnerSaves, segment_bounds
from ftserve_kernels.gated_delta_verify_triton import block, decode_warps, rule_shapes
from ftserve_kernels.gated_delta_verify_triton import conv_commit as conv_commit
from ftserve_kernels.gated_delta_verify_triton import conv_verify as conv_verify
from ftserve_kernels.gated_delta_verify_triton import gated_delta_commit as gated_delta_commit
from ftserve_kernels.gated_delta_verify_triton import gated_delta_verify as gated_delta_verify
from ftserve_kernels.short_conv_triton import conv_decode as conv_decode
from ftserve_kernels.short_conv_triton import conv_prefill as conv_prefill
from ftserve_kernels.short_conv_triton import device_bounds, seq_grid, slot_flag

SUB = 16  # diagonal block of the triangular inverse (tl.dot's smallest tile)
assert CHUNK == 4 * SUB, "the inverse's Neumann series has exactly four block terms"

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # q, k: what the casts for tl.dot expect


# Launch shapes (tests/test_kernels_sm90_compile.py compiles these for sm_90).
LOCAL_WARPS = 4  # chunk_local: [C, C] fp32 tiles, four of them live across the inverse
# chunk_scan: 8 V blocks x 32 heads = 256 programs, two a SM, of 4 warps at 2 stages:
# the fastest on the device (tools/bench/gated_delta's sweep), and free of spills
# in its chunk loop without segments (the sm_90 compile tests).
SCAN_BLOCK_V, SCAN_WARPS, SCAN_STAGES = 16, 4, 2


def scan_stages(elem_bytes: int) -> int:
    """chunk_scan's stages for q/k of ``elem_bytes``: fp32 tiles (an fp32 model)
    take twice the shared memory, where 3 stages (288 KB) would not fit: 2."""
    return SCAN_STAGES if elem_bytes <= 2 else min(SCAN_STAGES, 2)


def decode_block_v(batch: int, heads: int, dv: int, sms: int = 132) -> int:
    """Columns of S per decode program: the widest that still gives every SM two
    programs (a memory-bound kernel wants bytes in flight on every SM)."""
    bv = min(block(dv), 64)
    while bv > 16 and batch * heads * triton.cdiv(dv, bv) < 2 * sms:
        bv //= 2
    return bv


# ------------------------------------------------------------------ the rule, decode


@triton.jit
def _gdn_decode_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, alog_ptr, dtb_ptr, o_ptr, s_ptr, slot_ptr, has_ptr,
                       stride_qt, stride_kt, stride_vt, stride_gt, stride_gg, stride_gr,
                       stride_bt, stride_bg, stride_br, stride_ot, stride_ss,
                       scale, eps,
                       HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, GR: tl.constexpr,
                       GATES: tl.constexpr = False):
    # g and beta of value head h: group h // GR, member h % GR of their views. GATES:
    # they hold the layer's raw a and b, turned into the gates here (gate_params).
    b = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // (HV // HK)
    ok = tl.arange(0, BLOCK_K)
    ov = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mk = ok < DK
    mv = ov < DV
    q = tl.load(q_ptr + b * stride_qt + kh * DK + ok, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * stride_kt + kh * DK + ok, mask=mk, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q) + eps) * scale
    k = k * tl.rsqrt(tl.sum(k * k) + eps)
    v = tl.load(v_ptr + b * stride_vt + h * DV + ov, mask=mv, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + b * stride_gt + (h // GR) * stride_gg + (h % GR) * stride_gr).to(tl.float32)
    beta = tl.load(beta_ptr + b * stride_bt + (h // GR) * stride_bg + (h % GR) * stride_br)
    if GATES:
        # g = -exp(A_log) softplus(a + dt_bias) (torch's softplus: linear past 20);
        # beta = sigmoid(b), rounded to b's dtype as the reference's
        x = g + tl.load(dtb_ptr + h).to(tl.float32)
        g = -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
        beta = tl.sigmoid(beta.to(tl.float32)).to(beta_ptr.dtype.element_ty)
    beta = beta.to(tl.float32)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    has = slot_flag(has_ptr + b, ov)
    ms = mk[:, None] & mv[None, :]
    sp = s_ptr + slot * stride_ss + h * (DK * DV) + ok[:, None] * DV + ov[None, :]
    s = tl.load(sp, mask=ms & has[None, :], other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_V]
    s = s * tl.exp(g)
    u = (v - tl.sum(k[:, None] * s, 0)) * beta  # what S already says for k, corrected
    s = s + k[:, None] * u[None, :]
    o = tl.sum(q[:, None] * s, 0)
    tl.store(o_ptr + b * stride_ot + h * DV + ov, o.to(o_ptr.dtype.element_ty), mask=mv)
    tl.store(sp, s.to(s_ptr.dtype.element_ty), mask=ms)


# ------------------------------------------------------------------ the rule, chunked prefill


@triton.jit
def _find_chunk(cu_ptr, N, c, C: tl.constexpr):
    """Chunk c of the packed batch -> (its sequence or -1, its index there)."""
    seq = -1
    first = 0
    acc = 0
    for m in range(0, N):
        cnt = (tl.load(cu_ptr + m + 1) - tl.load(cu_ptr + m) + C - 1) // C
        hit = (c >= acc) & (c < acc + cnt)
        seq = tl.where(hit, m, seq)
        first = tl.where(hit, acc, first)
        acc += cnt
    return seq, c - first


@triton.jit
def _load_normed(ptr, r, mr, stride_t, head, scale, eps, DK: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows r (below the chunk's first, where ptr points) of one key head,
    L2-normalized in fp32 and scaled: [len(r), BLOCK_K]."""
    ok = tl.arange(0, BLOCK_K)
    x = tl.load(ptr + r[:, None] * stride_t + head * DK + ok[None, :],
                mask=mr[:, None] & (ok < DK)[None, :], other=0.0).to(tl.float32)
    return x * (tl.rsqrt(tl.sum(x * x, 1) + eps) * scale)[:, None]


@triton.jit
def _chunk_local_kernel(q_ptr, k_ptr, g_ptr, beta_ptr, cu_ptr, tinv_ptr, aqk_ptr, N,
                        stride_qt, stride_kt, stride_gt, stride_bt, scale, eps,
                        HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, BLOCK_K: tl.constexpr,
                        C: tl.constexpr, SB: tl.constexpr, EXACT: tl.constexpr = False):
    # EXACT (an fp32 model): every matmul in fp32; else A and Aqk in tf32, the inverse in tf32x3.
    QK_PREC: tl.constexpr = "ieee" if EXACT else "tf32"
    INV_PREC: tl.constexpr = "ieee" if EXACT else "tf32x3"
    c = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // (HV // HK)
    seq, j = _find_chunk(cu_ptr, N, c, C)
    # Row offsets are int32 from the chunk's first token t0 (64-bit pointer tiles
    # would cost twice the registers).
    t0 = tl.load(cu_ptr + tl.maximum(seq, 0)).to(tl.int64) + j * C
    rows = tl.load(cu_ptr + tl.maximum(seq, 0) + 1) - t0  # real rows of the chunk (more than C: all)
    rows = tl.where(seq >= 0, rows, 0)  # past the last chunk: none
    r = tl.arange(0, C)
    mt = r < rows
    # q and k stay fp32 here (tf32 matmuls for a bf16 model): the triangular system is the
    # most rounding-sensitive input, and this kernel is not on the serial path.
    k = _load_normed(k_ptr + t0 * stride_kt, r, mt, stride_kt, kh, 1.0, eps, DK, BLOCK_K)
    g = tl.load(g_ptr + t0 * stride_gt + r * stride_gt + h, mask=mt, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + t0 * stride_bt + r * stride_bt + h, mask=mt, other=0.0).to(tl.float32)
    cum = tl.cumsum(g, 0)  # log gamma_t within the chunk
    causal = r[:, None] >= r[None, :]
    # D[t, s] = gamma_t / gamma_s, masked before exp (s > t would overflow); 1 on the diagonal
    decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], 0.0))
    tile = r[:, None] * C + r[None, :]
    tinv_ptr += (c * HV + h).to(tl.int64) * (C * C)  # this program's [C, C] tiles
    aqk_ptr += (c * HV + h).to(tl.int64) * (C * C)
    q = _load_normed(q_ptr + t0 * stride_qt, r, mt, stride_qt, kh, scale, eps, DK, BLOCK_K)
    aqk = tl.where(causal, tl.dot(q, tl.trans(k), input_precision=QK_PREC) * decay, 0.0)
    tl.store(aqk_ptr + tile, aqk.to(aqk_ptr.dtype.element_ty))
    a = tl.dot(k, tl.trans(k), input_precision=QK_PREC) * (beta[:, None] * decay)
    tl.store(tinv_ptr + tile, tl.where(r[:, None] > r[None, :], a, 0.0))  # A, strictly lower

    # Diagonal blocks of (I + A)^-1 by forward substitution, the C / SB blocks side by
    # side: row i of a block is e_i - sum_{s<i} A[i, s] X[s, :], its rows above final.
    tl.debug_barrier()  # rows are read back by other threads
    nb: tl.constexpr = C // SB
    bi = tl.arange(0, nb)
    si = tl.arange(0, SB)
    # block b's row i, column s is A[b SB + i, b SB + s]
    blk = tinv_ptr + bi * (SB * (C + 1))  # [nb]
    eye = (si[:, None] == si[None, :]).to(tl.float32)
    x = tl.zeros([nb, SB, SB], dtype=tl.float32) + eye[None, :, :]
    for i in tl.static_range(1, SB):  # unrolled: the rows, which no step changes, load up front
        row = tl.load(blk[:, None] + i * C + si[None, :])  # [nb, SB]: A[i, s], zero for s >= i
        new = tl.where(si[None, :] == i, 1.0, 0.0) - tl.sum(row[:, :, None] * x, 1)  # [nb, SB]
        x = tl.where((si == i)[None, :, None], new[:, None, :], x)
    tl.debug_barrier()  # all rows read before the blocks are overwritten
    tl.store(blk[:, None, None] + si[None, :, None] * C + si[None, None, :], x)
    tl.debug_barrier()
    # The tile now holds D^-1 on its diagonal blocks and A below them.
    m = tl.load(tinv_ptr + tile)
    same = (r // SB)[:, None] == (r // SB)[None, :]
    dinv = tl.where(same, m, 0.0)
    nil = tl.dot(dinv, tl.where(same, 0.0, m), input_precision=INV_PREC)  # N = D^-1 A_below
    # (I + N)^-1 = I - N + N^2 - N^3 = I - N (I - N (I - N)), Horner's form
    eye64 = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    series = eye64 - nil
    series = eye64 - tl.dot(nil, series, input_precision=INV_PREC)
    series = eye64 - tl.dot(nil, series, input_precision=INV_PREC)
    tinv = tl.dot(series, dinv, input_precision=INV_PREC)
    tl.debug_barrier()  # the block-diagonal load above completes everywhere first
    tl.store(tinv_ptr + tile, tinv)


@triton.jit
def _chunk_scan_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, s_ptr, slot_ptr, has_ptr, cu_ptr,
                       tinv_ptr, aqk_ptr, save_ptr,
                       stride_qt, stride_kt, stride_vt, stride_gt, stride_bt, stride_ot, stride_ss,
                       scale, eps,
                       HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, C: tl.constexpr,
                       UPCAST: tl.constexpr, NSEG: tl.constexpr = 1):
    # NSEG > 1 (InnerSaves): cu_ptr holds segments, NSEG a sequence, chunked each on
    # its own; the state runs on through them, and after each but the last goes
    # into the slot save_ptr[n (NSEG - 1) + i] names (-1: none), as a chunk ending
    # there would leave it.
    n = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // (HV // HK)
    dt = q_ptr.dtype.element_ty
    base = 0  # chunks of the segments before this one
    for m in range(0, n * NSEG):
        base += (tl.load(cu_ptr + m + 1) - tl.load(cu_ptr + m) + C - 1) // C
    slot = tl.load(slot_ptr + n).to(tl.int64)
    ok = tl.arange(0, BLOCK_K)
    ov = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    has = slot_flag(has_ptr + n, ov)
    mk = ok < DK
    mv = ov < DV
    ms = mk[:, None] & mv[None, :]
    sp = s_ptr + slot * stride_ss + h * (DK * DV) + ok[:, None] * DV + ov[None, :]
    s = tl.load(sp, mask=ms & has[None, :], other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_V]
    r = tl.arange(0, C)
    for sg in range(0, NSEG):  # a loop, not unrolled: one copy of the pipelined chunk loop
        lo = tl.load(cu_ptr + n * NSEG + sg).to(tl.int64)
        hi = tl.load(cu_ptr + n * NSEG + sg + 1).to(tl.int64)
        nc = tl.cdiv(hi - lo, C).to(tl.int32)
        for j in range(0, nc):
            t0 = lo + j * C  # the chunk's first token; rows below it as int32 offsets
            mt = r < hi - t0
            k = _load_normed(k_ptr + t0 * stride_kt, r, mt, stride_kt, kh, 1.0, eps, DK, BLOCK_K).to(dt)
            q = _load_normed(q_ptr + t0 * stride_qt, r, mt, stride_qt, kh, scale, eps, DK, BLOCK_K).to(dt)
            v = tl.load(v_ptr + t0 * stride_vt + r[:, None] * stride_vt + h * DV + ov[None, :],
                        mask=mt[:, None] & mv[None, :], other=0.0).to(tl.float32)
            g = tl.load(g_ptr + t0 * stride_gt + r * stride_gt + h, mask=mt, other=0.0).to(tl.float32)
            beta = tl.load(beta_ptr + t0 * stride_bt + r * stride_bt + h, mask=mt, other=0.0).to(tl.float32)
            cum = tl.cumsum(g, 0)
            # log gamma_C: the cumsum's own last entry (padding rows add exact zeros), not a
            # separate sum, whose rounding would put exp(last - cum) of the last row off 1
            last = tl.sum(tl.where(r == C - 1, cum, 0.0), 0)
            gamma = tl.exp(cum)
            tile = ((base + j) * HV + h).to(tl.int64) * (C * C) + (r[:, None] * C + r[None, :])
            tinv = tl.load(tinv_ptr + tile).to(dt)
            aqk = tl.load(aqk_ptr + tile).to(dt)
            sd = s.to(dt)
            # U = Tinv (beta V - (beta gamma K) S): the chunk's corrected writes
            x = beta[:, None] * v - (beta * gamma)[:, None] * mma(k, sd, UPCAST)
            u = mma(tinv, x.to(dt), UPCAST).to(dt)  # [C, BLOCK_V]
            o = gamma[:, None] * mma(q, sd, UPCAST) + mma(aqk, u, UPCAST)
            tl.store(o_ptr + t0 * stride_ot + r[:, None] * stride_ot + h * DV + ov[None, :],
                     o.to(o_ptr.dtype.element_ty), mask=mt[:, None] & mv[None, :])
            k_end = (k.to(tl.float32) * tl.exp(last - cum)[:, None]).to(dt)  # (gamma_C / gamma_s) k_s
            s = mma(tl.trans(k_end), u, UPCAST) + s * tl.exp(last)
        base += nc
        if NSEG > 1:  # (a constant: save_ptr is not read without segments)
            if sg < NSEG - 1:
                dst = tl.load(save_ptr + n * (NSEG - 1) + sg).to(tl.int64)
                if dst >= 0:
                    tl.store(sp + (dst - slot) * stride_ss, s.to(s_ptr.dtype.element_ty), mask=ms)
    tl.store(sp, s.to(s_ptr.dtype.element_ty), mask=ms)


# ------------------------------------------------------------------ launchers


def _rule_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, states: torch.Tensor,
               ) -> tuple[int, int, int, int]:
    hk, hv, dk, dv = rule_shapes(k, v, None, None, states)
    assert q.shape == k.shape and q.stride(-1) == 1 and q.stride(-2) == dk
    assert q.dtype == k.dtype and q.dtype in _DTYPES
    return hk, hv, dk, dv


def _head_view(x: torch.Tensor, n: int, hk: int, hv: int) -> torch.Tensor:
    """A per-value-head tensor [B, Hv] or [B, Hk, Hv / Hk] as [B, groups, members]."""
    return x.view(n, hv, 1) if x.dim() == 2 else x.view(n, hk, hv // hk)


def _decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            gates: tuple[torch.Tensor, torch.Tensor] | None, states: torch.Tensor, slots: torch.Tensor,
            has_state: torch.Tensor, block_v: int | None) -> torch.Tensor:
    hk, hv, dk, dv = _rule_args(q, k, v, states)
    b = q.shape[0]
    g3, b3 = _head_view(g, b, hk, hv), _head_view(beta, b, hk, hv)
    assert g3.shape == b3.shape and g3.shape[1] * g3.shape[2] == hv
    a_log, dt_bias = gates if gates is not None else (g, g)  # unread without gates
    o = torch.empty((b, hv, dv), dtype=v.dtype, device=v.device)
    bv = block_v or decode_block_v(b, hv, dv)
    _gdn_decode_kernel[(b, hv, triton.cdiv(dv, bv))](
        q, k, v, g3, b3, a_log, dt_bias, o, states, slots, has_state,
        q.stride(0), k.stride(0), v.stride(0), *g3.stride(), *b3.stride(), o.stride(0), states.stride(0),
        dk**-0.5, L2_EPS, HK=hk, HV=hv, DK=dk, DV=dv, BLOCK_K=block(dk), BLOCK_V=bv, GR=g3.shape[2],
        GATES=gates is not None, num_warps=decode_warps(block(dk), bv))
    return o


def gated_delta_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                       has_state: torch.Tensor, block_v: int | None = None) -> torch.Tensor:
    rule_shapes(k, v, g, beta, states)
    return _decode(q, k, v, g, beta, None, states, slots, has_state, block_v)


def gated_delta_decode_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                             b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, states: torch.Tensor,
                             slots: torch.Tensor, has_state: torch.Tensor, block_v: int | None = None,
                             ) -> torch.Tensor:
    """gated_delta_decode with its gates from a, b (views into the projection are
    read in place) and A_log, dt_bias [Hv], in the launch."""
    assert a.stride(-1) == b.stride(-1) == 1 and a_log.is_contiguous() and dt_bias.is_contiguous()
    return _decode(q, k, v, a, b, (a_log, dt_bias), states, slots, has_state, block_v)


def gated_delta_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                        has_state: torch.Tensor, seq_bounds: Sequence[int] | None, chunk: int = CHUNK,
                        cu_seqlens: torch.Tensor | None = None, block_v: int | None = None,
                        static_len: int | None = None, saves: InnerSaves | None = None) -> torch.Tensor:
    assert chunk == CHUNK, "the Triton kernels are built for one chunk size"
    rule_shapes(k, v, g, beta, states)
    hk, hv, dk, dv = _rule_args(q, k, v, states)
    nseq, _ = seq_grid(seq_bounds, slots, static_len)
    o = torch.empty((q.shape[0], hv, dv), dtype=v.dtype, device=v.device)
    if nseq == 0:
        return o
    cu = device_bounds(seq_bounds, cu_seqlens, q.device)
    nseg = 1 if saves is None else saves.per_seq + 1  # segments a sequence
    if seq_bounds is None:  # a graph: a bound (each segment wastes less than one chunk)
        chunks = triton.cdiv(q.shape[0], CHUNK) + nseq * nseg
    else:
        rows = saves.host_rows(nseq) if saves is not None else [[] for _ in range(nseq)]
        chunks = 0
        for i in range(nseq):
            cuts = [0] + [off for off, _ in rows[i]] + [seq_bounds[i + 1] - seq_bounds[i]]
            chunks += sum(triton.cdiv(b - a, CHUNK) for a, b in zip(cuts, cuts[1:]))
    if saves is not None:
        assert saves.slots.shape[0] == nseq and saves.slots.is_contiguous()
        cu = segment_bounds(cu, saves)
    # Tinv in fp32 (chunk_local reads its own partial results back from it); Aqk in the
    # input dtype, which is what the scan's matmul takes it in.
    tinv = torch.empty((max(chunks, 1), hv, CHUNK, CHUNK), dtype=torch.float32, device=q.device)
    aqk = torch.empty(tinv.shape, dtype=q.dtype, device=q.device)
    bk = block(dk)
    if chunks:
        _chunk_local_kernel[(chunks, hv)](
            q, k, g, beta, cu, tinv, aqk, nseq * nseg,
            q.stride(0), k.stride(0), g.stride(0), beta.stride(0), dk**-0.5, L2_EPS,
            HK=hk, HV=hv, DK=dk, BLOCK_K=bk, C=CHUNK, SB=SUB, EXACT=q.dtype == torch.float32,
            num_warps=LOCAL_WARPS, num_stages=1)
    bv = min(block_v or SCAN_BLOCK_V, block(dv))
    _chunk_scan_kernel[(nseq, hv, triton.cdiv(dv, bv))](
        q, k, v, g, beta, o, states, slots, has_state, cu, tinv, aqk, saves.slots if saves is not None else slots,
        q.stride(0), k.stride(0), v.stride(0), g.stride(0), beta.stride(0), o.stride(0), states.stride(0),
        dk**-0.5, L2_EPS, HK=hk, HV=hv, DK=dk, DV=dv, BLOCK_K=bk, BLOCK_V=bv, C=CHUNK,
        UPCAST=interpreting(), NSEG=nseg, num_warps=SCAN_WARPS, num_stages=scan_stages(q.element_size()))
    return o
