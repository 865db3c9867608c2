"""One MoE decoder layer of a batch-1 decode step in one persistent launch.

At batch 1 a layer is nine launches, and each pays its ramp, tail and launch
gap: about 57 us per layer against a 28 us HBM roofline (BENCHMARKS.md). Here a
grid of one program per SM walks the layer's phases, with a grid-wide barrier
between phases instead of a kernel boundary::

    A  every program: s1 = x + r, n1 = rmsnorm(s1); its rows of qkv = n1 . Wqkv
    B  attention item (kv head, split): q/k norm + rotary of its heads, the
       token's K/V into its page (the item whose split holds the token), split-K
       attention; the last split of a kv head to finish combines the splits
    C  its rows of o = attn . Wo
    D  every program: s2 = o + s1, n2 = rmsnorm(s2); its rows of the router logits
    E  every program: softmax top-k of the logits; its (choice, column) pairs of
       act = SiLU(n2 . W13[e, gate]) * (n2 . W13[e, up])
    F  its columns of out = sum_j w_j (act_j . W2[e_j])

Each program's rows of a GEMV phase are one contiguous range (bytes balanced
to a row), multiplied as one tensor-core tile against x in column 0 (rows cut
into K segments so the tile has 128 rows): the loop the compiler pipelines
through shared memory with async copies (decode_layer_parts._span_mma).

Barrier: every program adds 1 to a counter (release) and spins until it
reaches phase x grid (acquire); the last program out of the kernel zeroes the
counters for the next launch (stream-ordered: all layers share them). All
programs must be resident at once: the grid is the SM count and each program
fits on an SM by itself. A spin that lasts MAX_SPIN polls gives up and sets
the error word (a test checks it) rather than hang.

The CPU interpreter runs programs one after another, so a barrier would never
open: there PHASE = 0..5 runs one phase per launch and the caller launches six
times (the same code, checked against the unfused twin). PHASE = -1 is the
fused kernel. Reads of what other programs wrote in this launch go through L2
(``.cg``). Rounding follows the unfused path (norm -> dtype, w * normed ->
dtype, each GEMV output -> dtype, the router logits -> dtype, weighted down
rows -> dtype before the sum over choices).

Scope (``eligible`` in ftserve/models/fused_layer.py): one token, q/k-normed or
plain rotary over the full head, no biases, float KV cache, resident experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ftserve_kernels.attention_common import LOG2E, AttnKernelConfig, interpreting
from ftserve_kernels.decode_layer_attention import _attn_item
from ftserve_kernels.decode_layer_parts import (
    _add_norm,
    _col,
    _gemv_span,
    _phase_end,
    _pick,
    _span,
    _span_mma,
    _stamp,
    _tile,
    _topk,
)

# Sync words: [0] barrier arrivals, [1] programs out, [2] error (a barrier gave
# up), then one split counter per kv head.
SYNC_HEAD = 8
MAX_SPIN = 1 << 22
PHASES = 6


@dataclass(frozen=True)
class LayerConfig:
    """Launch parameters: the K step of each GEMV phase, warps, pipeline stages,
    and programs per SM."""

    # H200 (tools/bench_decode_layer_kernel --timing): a phase's bandwidth per SM
    # tracks the bytes each pipeline stage holds; 32 KB stages, 4 deep.
    bk_qkv: int = 128
    bk_o: int = 128
    bk_gu: int = 128
    bk_down: int = 128
    num_warps: int = 8
    num_stages: int = 4
    programs_per_sm: int = 1  # all must be resident at once (barriers): registers permitting
    attn_block_n: int | None = None  # default: the attention backend's decode tile
    fixed_topk: bool = False  # timing diagnostic: skip the router's top-k (wrong outputs)


@triton.jit
def _decode_layer_kernel(
    x_ptr, r_ptr, out_ptr, res_ptr,
    ln1_ptr, wqkv_ptr, qn_ptr, kn_ptr, wo_ptr, ln2_ptr, wg_ptr, w13_ptr, w2_ptr,
    pos_ptr, cs_ptr, loc_ptr, pt_ptr, seq_lens_ptr, kc_ptr, vc_ptr,
    qkv_s, s1_s, n1_s, mid_o, mid_lse, attn_s, o_s, n2_s, logits_s, act_s, part_s, topw_s, topi_s, tk_s,
    sync_ptr, tm_ptr,
    eps, scale_log2, stride_cs, stride_slot, stride_head,
    H: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, E: tl.constexpr,
    INTER: tl.constexpr, TOP_K: tl.constexpr, PAGE_SIZE: tl.constexpr, G: tl.constexpr, S: tl.constexpr,
    HAS_RES: tl.constexpr, QK_NORM: tl.constexpr, RENORM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_QO: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_TK: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_GQ: tl.constexpr,
    ROWS_QKV: tl.constexpr, ROWS_GU: tl.constexpr, BLOCK_SPAN_H: tl.constexpr, BLOCK_SPAN_E: tl.constexpr,
    BK_QKV: tl.constexpr, BK_O: tl.constexpr, BK_GU: tl.constexpr, BK_DN: tl.constexpr,
    SEG_QKV: tl.constexpr, SEG_O: tl.constexpr,
    PHASE: tl.constexpr, UPCAST: tl.constexpr, SPIN: tl.constexpr,
    TIMING: tl.constexpr, FIXED_TOPK: tl.constexpr,
):
    pid = tl.program_id(0)
    ALL: tl.constexpr = PHASE < 0
    NQKV: tl.constexpr = (HQ + 2 * HKV) * D
    QO: tl.constexpr = HQ * D
    dt = x_ptr.dtype.element_ty
    kh = tl.arange(0, BLOCK_H)
    hmask = kh < H
    _stamp(tm_ptr, pid, 0, TIMING)
    # ---- A: s1 = x + r, n1 = norm(s1); qkv rows
    if ALL or PHASE == 0:
        lo, hi = _span(pid, G, NQKV)
        s1, n1 = _add_norm(x_ptr, r_ptr, ln1_ptr, eps, H, HAS_RES, BLOCK_H)
        if pid == 0:
            tl.store(s1_s + kh, s1, mask=hmask)
        tl.store(n1_s + pid * H + kh, n1, mask=hmask)  # this program's copy, read back by K step
        tl.debug_barrier()
        _gemv_span(wqkv_ptr, n1_s + pid * H, qkv_s, lo, hi, H, ROWS_QKV, SEG_QKV, BK_QKV, UPCAST)
        if ALL:
            _phase_end(sync_ptr, G, tm_ptr, pid, 1, TIMING, SPIN)
    # ---- B: attention items (kv head, split), then the split combine
    if ALL or PHASE == 1:
        for it in range(pid, HKV * S, G):
            _attn_item(it, qkv_s, qn_ptr, kn_ptr, pos_ptr, cs_ptr, loc_ptr, pt_ptr, seq_lens_ptr,
                       kc_ptr, vc_ptr, mid_o, mid_lse, attn_s, sync_ptr, eps, scale_log2, stride_cs,
                       stride_slot, stride_head, HQ, HKV, D, S, PAGE_SIZE, QK_NORM, BLOCK_G, BLOCK_N,
                       BLOCK_S, BLOCK_GQ, UPCAST)
        if ALL:
            _phase_end(sync_ptr, 2 * G, tm_ptr, pid, 3, TIMING, SPIN)
    # ---- C: o_proj rows
    if ALL or PHASE == 2:
        lo, hi = _span(pid, G, H)
        _gemv_span(wo_ptr, attn_s, o_s, lo, hi, QO, BLOCK_SPAN_H, SEG_O, BK_O, UPCAST)
        if ALL:
            _phase_end(sync_ptr, 3 * G, tm_ptr, pid, 5, TIMING, SPIN)
    # ---- D: s2 = o + s1, n2 = norm(s2); router rows
    if ALL or PHASE == 3:
        lo, hi = _span(pid, G, E)
        erows = lo + tl.arange(0, BLOCK_SPAN_E)
        gt = _tile(wg_ptr, erows, hi, H, BLOCK_H)
        s2, n2 = _add_norm(o_s, s1_s, ln2_ptr, eps, H, True, BLOCK_H)
        if pid == 0:
            tl.store(res_ptr + kh, s2, mask=hmask)
            tl.store(n2_s + kh, n2, mask=hmask)
        lg = tl.sum(gt.to(tl.float32) * n2.to(tl.float32)[None, :], 1)
        tl.store(logits_s + erows, lg.to(dt).to(tl.float32), mask=erows < hi)
        if ALL:
            _phase_end(sync_ptr, 4 * G, tm_ptr, pid, 7, TIMING, SPIN)
    # ---- E: top-k (every program), then gate/up (choice, column) pairs
    kk = tl.arange(0, BLOCK_TK)
    if ALL or PHASE == 4:
        if FIXED_TOPK:  # timing diagnostic only: experts 0..k-1, wrong outputs
            top_i = kk
            top_w = tl.where(kk < TOP_K, 1.0 / TOP_K, 0.0)
        else:
            top_w, top_i = _topk(logits_s, tk_s + pid * BLOCK_E, E, TOP_K, RENORM, BLOCK_E, BLOCK_TK)
        if pid == 0:
            tl.store(topw_s + kk, top_w)
            tl.store(topi_s + kk, top_i)
        lo, hi = _span(pid, G, TOP_K * INTER)
        # Tile rows: the gate rows of this program's (choice, column) pairs, then their up rows.
        rr = tl.arange(0, 2 * ROWS_GU)
        up = rr // ROWS_GU
        f = lo + rr % ROWS_GU
        e = _pick(top_i, kk, f // INTER).to(tl.int64)
        off = e * (2 * INTER * H) + (up * INTER + f % INTER).to(tl.int64) * H
        y = tl.reshape(_col(_span_mma(w13_ptr, off, f < hi, n2_s, 0, 1, H, 2 * ROWS_GU, BK_GU, UPCAST), 0),
                       [2, ROWS_GU])
        two = tl.arange(0, 2)[:, None]
        hg = tl.sum(tl.where(two == 0, y, 0.0), 0)
        hu = tl.sum(tl.where(two == 1, y, 0.0), 0)
        fo = lo + tl.arange(0, ROWS_GU)
        tl.store(act_s + fo, (hg / (1.0 + tl.exp(-hg)) * hu).to(dt), mask=fo < hi)
        if ALL:
            _phase_end(sync_ptr, 5 * G, tm_ptr, pid, 9, TIMING, SPIN)
    # ---- F: down + weighted combine over the k choices, columns
    if ALL or PHASE == 5:
        if PHASE == 5:
            top_w = tl.load(topw_s + kk, cache_modifier=".cg")
            top_i = tl.load(topi_s + kk, cache_modifier=".cg")
        lo, hi = _span(pid, G, H)
        r = tl.arange(0, BLOCK_SPAN_H * BLOCK_TK)  # rows (column, choice)
        j = r % BLOCK_TK
        col = lo + r // BLOCK_TK
        m = (col < hi) & (j < TOP_K)
        e = _pick(top_i, kk, j).to(tl.int64)
        acc = _span_mma(w2_ptr, e * (H * INTER) + col.to(tl.int64) * INTER, m, act_s, INTER, TOP_K,
                        INTER, BLOCK_SPAN_H * BLOCK_TK, BK_DN, UPCAST)  # [rows, choices]
        y = _col(acc, j[:, None])
        # Each weighted row rounds as the grouped path stores it; summed over choices below.
        tl.store(part_s + col * BLOCK_TK + j, (y * _pick(top_w, kk, j)).to(dt).to(tl.float32), mask=m)
        tl.debug_barrier()  # this program's partials, read back across its warps
        cols = lo + tl.arange(0, BLOCK_SPAN_H)
        pm = (cols < hi)[:, None] & (kk < TOP_K)[None, :]
        part = tl.load(part_s + cols[:, None] * BLOCK_TK + kk[None, :], mask=pm, other=0.0)
        tl.store(out_ptr + cols, tl.sum(part, 1).to(dt), mask=cols < hi)
        if ALL:  # the last program out zeroes the counters for the next launch
            _stamp(tm_ptr, pid, 11, TIMING)
            tl.debug_barrier()
            if tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu") == G - 1:
                tl.atomic_xchg(sync_ptr, 0)
                tl.atomic_xchg(sync_ptr + 1, 0)


@dataclass(frozen=True)
class LayerWeights:
    ln1: torch.Tensor  # [H]
    wqkv: torch.Tensor  # [(Hq + 2 Hkv) D, H]
    q_norm: torch.Tensor | None  # [D] (Qwen3's per-head norms) or None
    k_norm: torch.Tensor | None
    wo: torch.Tensor  # [H, Hq D]
    ln2: torch.Tensor  # [H]
    router: torch.Tensor  # [E, H]
    w13: torch.Tensor  # [E, 2I, H]
    w2: torch.Tensor  # [E, H, I]
    num_heads: int
    num_kv_heads: int
    top_k: int
    renormalize: bool
    eps: float


@dataclass(frozen=True)
class StepInputs:
    positions: torch.Tensor  # [1] int64
    cos_sin: torch.Tensor  # [max_pos, D] fp32
    out_cache_loc: torch.Tensor  # [1] int64
    page_table: torch.Tensor  # [1, max_pages] int32 (row 0 read)
    seq_lens: torch.Tensor  # [1] int32, with this token
    k_cache: torch.Tensor  # [slots, Hkv, D]
    v_cache: torch.Tensor
    page_size: int
    scale: float


@dataclass(frozen=True)
class LayerShape:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    inter: int  # expert intermediate size
    top_k: int
    page_size: int
    qk_norm: bool
    renormalize: bool


def launch_constants(shape: LayerShape, cfg: LayerConfig, grid: int, attn_block_n: int, has_residual: bool,
                     cuda: bool, timing: bool = False) -> dict[str, object]:
    """The kernel's constexprs and launch options (all but PHASE) for one layer
    shape on a grid (tests/test_kernels_sm90_compile.py compiles from these)."""
    h, hq, hkv, d = shape.hidden, shape.num_heads, shape.num_kv_heads, shape.head_dim
    e, inter, block_tk = shape.num_experts, shape.inter, triton.next_power_of_2(shape.top_k)
    splits = max(1, grid // hkv)
    seg_qkv = _segments(_span_rows((hq + 2 * hkv) * d, grid), h)
    seg_o = _segments(_span_rows(h, grid), hq * d)
    return dict(
        H=h, HQ=hq, HKV=hkv, D=d, E=e, INTER=inter, TOP_K=shape.top_k, PAGE_SIZE=shape.page_size, G=grid,
        S=splits, HAS_RES=has_residual, QK_NORM=shape.qk_norm, RENORM=shape.renormalize,
        BLOCK_H=triton.next_power_of_2(h), BLOCK_QO=triton.next_power_of_2(hq * d),
        BLOCK_I=max(64, triton.next_power_of_2(inter)), BLOCK_E=triton.next_power_of_2(e), BLOCK_TK=block_tk,
        BLOCK_G=max(16, triton.next_power_of_2(hq // hkv)), BLOCK_N=attn_block_n,
        BLOCK_S=max(4, triton.next_power_of_2(splits)), BLOCK_GQ=triton.next_power_of_2(hq // hkv),
        # a program's span of each GEMV phase is at most cdiv(N, grid) rows
        # (at least 16: tensor-core tiles)
        ROWS_QKV=_span_rows((hq + 2 * hkv) * d, grid), ROWS_GU=_span_rows(shape.top_k * inter, grid),
        BLOCK_SPAN_H=_span_rows(h, grid), BLOCK_SPAN_E=_span_rows(e, grid, 1),
        BK_QKV=_bk(cfg.bk_qkv, h // seg_qkv), BK_O=_bk(cfg.bk_o, hq * d // seg_o), BK_GU=_bk(cfg.bk_gu, h),
        BK_DN=_bk(cfg.bk_down, inter), SEG_QKV=seg_qkv, SEG_O=seg_o,
        UPCAST=not cuda, SPIN=MAX_SPIN,
        TIMING=timing, FIXED_TOPK=bool(cfg.fixed_topk),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _span_rows(n: int, grid: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(triton.cdiv(n, grid)))


def _segments(rows: int, k: int) -> int:
    """Segments per row so a span tile has 128 rows (K must split evenly, 16+ wide)."""
    seg = max(1, 128 // rows)
    while seg > 1 and (k % seg or k // seg < 16):
        seg //= 2
    return seg


def _bk(want: int, k: int) -> int:
    return min(want, triton.next_power_of_2(k))


def num_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def sync_words(num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """A zeroed sync buffer (see module doc); the kernel leaves it zeroed."""
    return torch.zeros(SYNC_HEAD + num_kv_heads, dtype=torch.int32, device=device)


def decode_layer_triton(
    x: torch.Tensor,  # [1, H]
    residual: torch.Tensor | None,  # [1, H]
    w: LayerWeights,
    step: StepInputs,
    sync: torch.Tensor,  # sync_words(...)
    cfg: LayerConfig | None = None,
    timing: torch.Tensor | None = None,  # int64 [grid, 16]: each program's phase timestamps (fused, CUDA)
    info: dict[str, object] | None = None,  # receives the fused launch's compiled kernel ("kernel")
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (the layer's MoE output [1, H], its residual x + r + attention [1, H])."""
    cfg = cfg or LayerConfig()
    t, h = x.shape
    assert t == 1, "batch-1 decode only"
    hq, hkv, d = w.num_heads, w.num_kv_heads, w.wqkv.shape[0] // (w.num_heads + 2 * w.num_kv_heads)
    e, inter = w.w13.shape[0], w.w13.shape[1] // 2
    for tensor in (x, w.wqkv, w.wo, w.router, w.w13, w.w2, w.ln1, w.ln2):
        assert tensor.is_contiguous()
    assert d == triton.next_power_of_2(d) and step.cos_sin.shape[1] == d, "full rotary, power-of-2 head dim"
    assert step.k_cache.dtype == x.dtype and step.k_cache.stride() == step.v_cache.stride()
    assert sync.numel() >= SYNC_HEAD + hkv
    dev = x.device
    interp = interpreting()
    phased = interp  # six launches, no barrier: the interpreter runs programs one by one
    g = num_programs(dev) * (cfg.programs_per_sm if dev.type == "cuda" else 1)
    splits = max(1, g // hkv)
    f32 = torch.float32
    out, res = torch.empty_like(x), torch.empty_like(x)
    qkv_s = torch.empty((hq + 2 * hkv) * d, dtype=x.dtype, device=dev)
    s1_s, o_s, n2_s = (torch.empty(h, dtype=x.dtype, device=dev) for _ in range(3))
    mid_o = torch.empty(hq * splits * d, dtype=f32, device=dev)
    mid_lse = torch.empty(hq * splits, dtype=f32, device=dev)
    attn_s = torch.empty(hq * d, dtype=x.dtype, device=dev)
    logits_s = torch.empty(e, dtype=f32, device=dev)
    block_tk = triton.next_power_of_2(w.top_k)
    act_s = torch.empty(block_tk * inter, dtype=x.dtype, device=dev)
    n1_s = torch.empty(g * h, dtype=x.dtype, device=dev)  # each program's copy of the normed input
    part_s = torch.empty(h * block_tk, dtype=f32, device=dev)  # weighted down rows, per (column, choice)
    topw_s = torch.empty(block_tk, dtype=f32, device=dev)
    tk_s = torch.empty(g * triton.next_power_of_2(e), dtype=f32, device=dev)  # each program's probabilities
    topi_s = torch.empty(block_tk, dtype=torch.int32, device=dev)
    qn = w.q_norm if w.q_norm is not None else w.ln1
    kn = w.k_norm if w.k_norm is not None else w.ln1
    args = (
        x, residual if residual is not None else x, out, res,
        w.ln1, w.wqkv, qn, kn, w.wo, w.ln2, w.router, w.w13, w.w2,
        step.positions, step.cos_sin, step.out_cache_loc, step.page_table, step.seq_lens,
        step.k_cache, step.v_cache,
        qkv_s, s1_s, n1_s, mid_o, mid_lse, attn_s, o_s, n2_s, logits_s, act_s, part_s, topw_s, topi_s, tk_s, sync,
        timing if timing is not None else sync,
        w.eps, step.scale * LOG2E, step.cos_sin.stride(0), step.k_cache.stride(0), step.k_cache.stride(1),
    )
    shape = LayerShape(h, hq, hkv, d, e, inter, w.top_k, step.page_size, w.q_norm is not None,
                       w.renormalize)
    block_n = cfg.attn_block_n or AttnKernelConfig.for_device(dev, d).decode_block_n
    consts = launch_constants(shape, cfg, g, block_n, residual is not None, cuda=dev.type == "cuda" and not interp,
                              timing=timing is not None and not phased)
    if phased:
        for phase in range(PHASES):
            _decode_layer_kernel[(g,)](*args, PHASE=phase, **consts)
    else:
        kern = _decode_layer_kernel[(g,)](*args, PHASE=-1, **consts)
        if info is not None:
            info["kernel"] = kern
    return out, res


def compiled_stats(kern: object) -> dict[str, int]:
    """Registers, spills and shared memory of a compiled fused launch (the
    ``info["kernel"]`` of decode_layer_triton; tools/bench_decode_layer_kernel)."""
    return {name: int(getattr(kern, name, -1) or 0) for name in ("n_regs", "n_spills", "shared")}
