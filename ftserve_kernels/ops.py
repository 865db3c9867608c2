"""One place that picks a kernel: the Triton kernel or the torch reference
twin, as the KernelConfig each function takes first says (config.py: by
default Triton on CUDA tensors, the twins elsewhere; the interpreter runs
Triton on the CPU under TRITON_INTERPRET=1 with backend "triton").

Model layers call these functions and never import a backend directly.
Signatures, the KernelConfig left out (all shapes are packed tokens, see ForwardBatch):

    rms_norm(x [T, H], w [H], eps, zero_centered=False) -> [T, H]
    fused_add_rms_norm(x [T, H], residual [T, H], w [H], eps, zero_centered=False, shared=None)
        -> (normed, x + residual); ``zero_centered``: norm(x) * (1 + w) (Qwen3-Next);
        ``shared`` = (y [T, H], logit [T, 1]): x + sigmoid(logit) * y is added instead
        (a MoE block's routed experts x beside its gated shared expert y)
    gated_rms_norm(x [T, NH, D], gate [T, G, NH / G, D] or [T, NH, D], w [D], eps)
        -> w * norm(x) * SiLU(gate) [T, NH, D] (Gated DeltaNet's output norm)
    rotary(q [T, Hq, D], k [T, Hkv, D], positions [T] int64,
           cos_sin [max_pos, rot_dim] fp32 (cos | sin halves), kv_store=None) -> (q, k)
        (neox style); kv_store as qk_norm_rotary's: one launch on Triton for both
        (qk_norm_rotary's kernel with the norms off)
    qk_norm_rotary(q [T, Hq, D], k [T, Hkv, D], q_w [D], k_w [D], eps, positions, cos_sin,
                   kv_store=None, zero_centered=False) -> (q, k): per-head RMSNorm of q and k,
        then rotary (Qwen3), one kernel on Triton; kv_store = (k_cache, v_cache, v,
        out_cache_loc) also stores k and v into their pages in that launch
    route_topk(router_logits [T, E], top_k, renormalize) -> (weights [T, k] fp32, ids [T, k] int32)
    fused_moe(x [T, H], w13 [E, 2I, H], w2 [E, H, I], weights [T, k], ids [T, k], valid_rows=None) -> [T, H]
        (w13 rows [0, I) are the gate, [I, 2I) the up projection; SiLU(gate) * up)
    add_rms_norm_route(x [T, H], residual [T, H] | None, norm_w [H], eps, gate_w [E, H],
                       top_k, renormalize, counter [1] int32, zero_centered=False)
        -> (normed [T, H], x + residual | None, weights [T, k] fp32, ids [T, k] int32):
        the (fused-add) norm, the router linear and route_topk; one launch on Triton
        for decode-sized T (decode_fused_triton), the composition otherwise
    fused_moe_add_rms_norm(x, w13, w2, weights, ids, residual [T, H], norm_w [H], eps, counter)
        -> fused_add_rms_norm(fused_moe(...), residual, norm_w, eps): the next layer's input
        norm in the MoE down launch's epilogue where ``moe_folds_next_norm(kernels, x)`` (Triton GEMV
        sizes), the composition otherwise
    oproj_route_applies(a [T, q]) -> bool: whether a MoE layer's o_proj may also route at a's size
    oproj_route(a [1, q], o_w [H, q], o_b | None, residual [1, H], norm_w [H], folded, top_k, counter)
        -> OprojRoute: o_proj, the sum with the residual and the router's top-k in one launch,
        the post-attention norm left pending (oproj_route_triton; ``folded`` from fold_router)
    fused_moe_routed(route: OprojRoute, route_eps, w13, w2, norm_w, eps, counter, defer=False)
        -> fused_moe_add_rms_norm for that row: its gate/up launch applies the pending norm and
        weighs the chosen experts
    linear(x [T, K], w [N, K], b [N] | None) -> [T, N]: F.linear, or the Triton GEMV
        for T <= 4 on Triton (gemv_triton; KernelConfig.dense_gemv) - every dense
        linear of the models takes this choice (layers.Linear, the functions below)
    add_rms_norm_linear(x [T, H], residual [T, H] | None, norm_w [H], eps, w [N, H], b | None)
        -> (linear(norm(x + residual)) [T, N], x + residual (x when residual is None));
        ``prenormed``: x is already the normed sum (the layer before folded the norm):
        ``linear(x, w, b)``; a PendingNorm: the GEMV applies it
    dense_folds_norm(x [T, K]) -> bool: whether linear_add_rms_norm leaves the norm pending at x's size
    linear_add_rms_norm(x [T, K], w [H, K], b, residual [T, H], norm_w [H], eps)
        -> (fused_add_rms_norm(linear(x, w, b), residual, norm_w, eps): the normed rows, or
        where dense_folds_norm(x) a PendingNorm of them left by the GEMV's epilogue; the sum)
    gate_up_silu(x [T, H] | PendingNorm, w [2I, H], b [2I] | None, eps)
        -> SiLU(gate) * up [T, I] (w rows [0, I) the gate, [I, 2I) the up projection):
        one launch where linear runs the GEMV (its GLU epilogue; a PendingNorm x applied
        in it, eps its norm's), otherwise linear, then SiLU * up in place (one
        glu_triton launch on Triton, silu_ and mul_ on torch)
    linear_fp32(x [T, K], w [N, K]) -> [T, N] fp32: the lm_head; F.linear(x, w).float(),
        or for one row on Triton the GEMV writing fp32 itself
    decode_inputs(packed [B, WORDS] int64, last [S] int64, page_table [R, P] int32,
                  embed [V, H] | None, flag, norm: InputNorm | None, staged=None) -> DecodeInputs: a
        decode graph's unpacked inputs, page-table rows, embeddings and (with
        ``norm``) their first-layer input norm (decode_inputs.py); ``staged``: the
        rows are read from a pinned pair (bookkeeping.StagedRows) instead of ``packed``
    embed_rms_norm(ids [T], embed [V, H], norm: InputNorm) -> (rows [T, H], normed [T, H]):
        the same row work for an eager decode step
    gated_delta(t) -> the Gated DeltaNet entry points (conv_prefill, conv_decode,
        gated_delta_prefill, gated_delta_decode(_fused), and a verify step's conv_verify,
        gated_delta_verify, conv_commit, gated_delta_commit; signatures in gated_delta.py) for
        tensors like t: gated_delta_triton's kernels or the torch reference module

Weights are tensors, or in linear, add_rms_norm_linear, linear_add_rms_norm,
gate_up_silu, fused_moe, fused_moe_add_rms_norm, oproj_route and
fused_moe_routed an fp8 checkpoint's ``fp8_quant.Fp8Weight`` (e4m3 codes and
block scales), which goes to fp8_ops with the same KernelConfig (oproj_route's
kernel takes either itself; linear_add_rms_norm and gate_up_silu compose over
fp8_ops' linear, their folds being the bf16 GEMV's).

Backends are imported once into a table per KernelConfig (``_triton_table``:
the Triton wrappers bound to it), picked per call by the config and the
tensor's device (``_table``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ftserve_kernels import fp8_ops
from ftserve_kernels import moe as moe_ref
from ftserve_kernels import norm_rope as nr_ref
from ftserve_kernels.config import KernelConfig
from ftserve_kernels.fp8_quant import Fp8Weight


@dataclass(frozen=True)
class _Kernels:
    rms_norm: Callable[..., torch.Tensor]
    fused_add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    qk_norm_rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    gated_rms_norm: Callable[..., torch.Tensor]
    silu_mul: Callable[..., torch.Tensor]  # gate_up [T, 2I] -> SiLU(gate) * up, in its gate half
    route_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    fused_moe: Callable[..., torch.Tensor]
    # (x, residual, norm_w, eps, gate_w, top_k, renorm, counter) -> 4 tensors; None: compose
    add_norm_route: Callable[..., Any] | None
    fused_max_tokens: int
    # (x, w13, w2, weights, ids, NormNext) -> (normed, summed), up to moe_gemv_tokens rows; None: compose
    moe_add_norm: Callable[..., Any] | None = None
    moe_gemv_tokens: int = 0
    # (x, w, bias, eps, ..., parts=, glu=) -> y; None: F.linear
    gemv: Callable[..., Any] | None = None
    gemv_max_rows: int = 0
    # (x, w, bias, NormNext) -> (scaled, summed, parts): the GEMV leaving the next norm pending
    gemv_add_norm: Callable[..., Any] | None = None


_REF = _Kernels(
    rms_norm=nr_ref.rms_norm_ref, fused_add_rms_norm=nr_ref.fused_add_rms_norm_ref,
    rotary=nr_ref.rotary_ref, qk_norm_rotary=nr_ref.qk_norm_rotary_ref, gated_rms_norm=nr_ref.gated_rms_norm_ref,
    silu_mul=nr_ref.silu_mul_ref, route_topk=moe_ref.route_topk_ref, fused_moe=moe_ref.fused_moe_ref,
    add_norm_route=None, fused_max_tokens=0,
)


@functools.cache
def _triton_table(kernels: KernelConfig) -> _Kernels:
    """The Triton kernels, imported once and bound to ``kernels`` (their launch
    choices); the reference table if Triton is missing."""
    try:
        from ftserve_kernels import decode_fused_triton as df
        from ftserve_kernels import gemv_triton as gv
        from ftserve_kernels import glu_triton as gl
        from ftserve_kernels import moe_gemv_triton as mg
        from ftserve_kernels import moe_triton as mt
        from ftserve_kernels import norm_triton as nt
        from ftserve_kernels import rope_triton as rt
    except ImportError:
        return _REF
    bind = functools.partial(functools.partial, kernels=kernels)
    return _Kernels(
        rms_norm=bind(nt.rms_norm_triton), fused_add_rms_norm=bind(nt.fused_add_rms_norm_triton),
        rotary=rt.rotary_triton, qk_norm_rotary=bind(rt.qk_norm_rotary_triton),
        gated_rms_norm=bind(nt.gated_rms_norm_triton), silu_mul=bind(gl.silu_mul_triton),
        route_topk=mt.route_topk_triton, fused_moe=bind(mt.fused_moe_triton),
        add_norm_route=bind(df.add_norm_route_triton), fused_max_tokens=df.FUSED_MAX_TOKENS,
        moe_add_norm=bind(mg.fused_moe_add_norm_gemv_triton), moe_gemv_tokens=mg.GEMV_MAX_TOKENS,
        gemv=bind(gv.gemv_triton), gemv_max_rows=gv.GEMV_MAX_ROWS,
        gemv_add_norm=bind(gv.gemv_add_norm_triton),
    )


def _table(kernels: KernelConfig, t: torch.Tensor) -> _Kernels:
    return _triton_table(kernels) if kernels.triton(t) else _REF


def uses_triton(kernels: KernelConfig, t: torch.Tensor) -> bool:
    """Whether ops on ``t`` run the Triton kernels."""
    return _table(kernels, t) is not _REF


def rms_norm(kernels: KernelConfig, x: torch.Tensor, w: torch.Tensor, eps: float,
             zero_centered: bool = False) -> torch.Tensor:
    return _table(kernels, x).rms_norm(x, w, eps, zero_centered)


def fused_add_rms_norm(
    kernels: KernelConfig, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float,
    zero_centered: bool = False, shared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _table(kernels, x).fused_add_rms_norm(x, residual, w, eps, zero_centered, shared)


def gated_rms_norm(kernels: KernelConfig, x: torch.Tensor, gate: torch.Tensor, w: torch.Tensor,
                   eps: float) -> torch.Tensor:
    return _table(kernels, x).gated_rms_norm(x, gate, w, eps)


def rotary(
    kernels: KernelConfig, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
    cos_sin: torch.Tensor,
    kv_store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if kv_store is not None:  # the store in the same launch: qk_norm_rotary's kernel, no norms
        return _table(kernels, q).qk_norm_rotary(q, k, None, None, 0.0, positions, cos_sin, kv_store)
    return _table(kernels, q).rotary(q, k, positions, cos_sin)


def qk_norm_rotary(
    kernels: KernelConfig, q: torch.Tensor, k: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor,
    eps: float, positions: torch.Tensor, cos_sin: torch.Tensor,
    kv_store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    zero_centered: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _table(kernels, q).qk_norm_rotary(q, k, q_w, k_w, eps, positions, cos_sin, kv_store, zero_centered)


def route_topk(
    kernels: KernelConfig, router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return _table(kernels, router_logits).route_topk(router_logits, top_k, renormalize)


def fused_moe(
    kernels: KernelConfig,
    x: torch.Tensor,
    w13: torch.Tensor | Fp8Weight,
    w2: torch.Tensor | Fp8Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    valid_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """``valid_rows`` [1] int on the device (ForwardBatch.valid_tokens: a padded
    graph bucket's real tokens): the grouped GEMMs skip the pairs of rows past
    it, whose outputs are then unspecified."""
    if isinstance(w13, Fp8Weight):  # an fp8 checkpoint's experts (fp8_ops)
        assert isinstance(w2, Fp8Weight)
        return fp8_ops.fused_moe(kernels, x, w13, w2, topk_weights, topk_ids, valid_rows=valid_rows)
    assert isinstance(w2, torch.Tensor)
    return _table(kernels, x).fused_moe(x, w13, w2, topk_weights, topk_ids, valid_rows=valid_rows)


def add_rms_norm_route(
    kernels: KernelConfig, x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor,
    eps: float, gate_w: torch.Tensor, top_k: int, renormalize: bool, counter: torch.Tensor,
    zero_centered: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    k = _table(kernels, x)
    if k.add_norm_route is not None and x.shape[0] <= k.fused_max_tokens:
        return k.add_norm_route(x, residual, norm_w, eps, gate_w, top_k, renormalize, counter,
                                zero_centered=zero_centered)
    # The composition (the reference twin of the fused kernel).
    if residual is None:
        normed, summed = k.rms_norm(x, norm_w, eps, zero_centered), None
    else:
        normed, summed = k.fused_add_rms_norm(x, residual, norm_w, eps, zero_centered)
    weights, ids = k.route_topk(F.linear(normed, gate_w), top_k, renormalize)  # [T, k] x2
    return normed, summed, weights, ids


def moe_folds_next_norm(kernels: KernelConfig, x: torch.Tensor) -> bool:
    """Whether fused_moe_add_rms_norm runs as one kernel pair at x's size (the
    decoder folds the next layer's norm into the MoE only then: elsewhere the
    norm stays where it was, after the logits rows are picked)."""
    k = _table(kernels, x)
    return k.moe_add_norm is not None and x.shape[0] <= k.moe_gemv_tokens


@dataclass(frozen=True)
class PendingNorm:
    """An RMSNorm the layer before left pending (fused_moe_add_rms_norm with
    ``defer``): x is the residual sum s itself, ``scaled`` = round(weight * s),
    ``parts`` [T, P] fp32 the partial sums of squares of each row of s (they add
    up to sum(s * s)); the qkv GEMV applies the 1/rms (add_rms_norm_linear)."""

    scaled: torch.Tensor
    parts: torch.Tensor


def moe_defers_next_norm(kernels: KernelConfig, x: torch.Tensor) -> bool:
    """Whether fused_moe_add_rms_norm(defer=True) leaves the norm pending at x's
    size: the down kernel folds it and the GEMV that applies it runs there."""
    return moe_folds_next_norm(kernels, x) and _gemv_for(kernels, x) is not None


def fused_moe_add_rms_norm(
    kernels: KernelConfig, x: torch.Tensor, w13: torch.Tensor | Fp8Weight, w2: torch.Tensor | Fp8Weight,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor,
    eps: float, counter: torch.Tensor, defer: bool = False,
) -> tuple[torch.Tensor | PendingNorm, torch.Tensor]:
    """-> (the normed rows, or with ``defer`` where moe_defers_next_norm(x) a
    PendingNorm of them; the sum MoE(x) + residual)."""
    k = _table(kernels, x)
    if isinstance(w13, Fp8Weight):  # an fp8 checkpoint's experts: their GEMV pair folds it alike
        assert isinstance(w2, Fp8Weight)
        if moe_folds_next_norm(kernels, x):
            from ftserve_kernels.moe_down_gemv_triton import NormNext

            pending = defer and moe_defers_next_norm(kernels, x)
            nn = NormNext(residual.contiguous(), norm_w, eps, counter, deferred=pending)
            first, summed, parts = fp8_ops.fused_moe_add_norm(kernels, x, w13, w2, topk_weights, topk_ids, nn)
            return (first if parts is None else PendingNorm(first, parts)), summed
        return k.fused_add_rms_norm(fused_moe(kernels, x, w13, w2, topk_weights, topk_ids), residual, norm_w, eps)
    assert isinstance(w2, torch.Tensor)
    if moe_folds_next_norm(kernels, x) and k.moe_add_norm is not None:
        from ftserve_kernels.moe_down_gemv_triton import NormNext

        pending = defer and moe_defers_next_norm(kernels, x)
        nn = NormNext(residual.contiguous(), norm_w, eps, counter, deferred=pending)
        first, summed, parts = k.moe_add_norm(x, w13, w2, topk_weights, topk_ids, nn)
        return (first if parts is None else PendingNorm(first, parts)), summed
    return k.fused_add_rms_norm(k.fused_moe(x, w13, w2, topk_weights, topk_ids), residual, norm_w, eps)


def oproj_route_applies(kernels: KernelConfig, a: torch.Tensor) -> bool:
    """Whether a MoE layer's o_proj may take its router at a's size (one decode
    row on the Triton kernels): the experts then run as the GEMV pair that folds
    the next norm (moe_folds_next_norm)."""
    return a.shape[0] == 1 and uses_triton(kernels, a) and moe_folds_next_norm(kernels, a)


def oproj_route(kernels: KernelConfig, a: torch.Tensor, o_w: torch.Tensor | Fp8Weight, o_b: torch.Tensor | None,
                residual: torch.Tensor, norm_w: torch.Tensor, folded: Any, top_k: int,
                counter: torch.Tensor) -> Any:
    """o_proj + the router's logits and top-k, the post-attention norm left
    pending (oproj_route_triton, an fp8 o_w too; where oproj_route_applies) -> OprojRoute."""
    from ftserve_kernels.oproj_route_triton import oproj_route_triton

    return oproj_route_triton(a, o_w, o_b, residual, norm_w, folded, top_k, counter, kernels=kernels)


def fused_moe_routed(
    kernels: KernelConfig, route: Any, route_eps: float, w13: torch.Tensor | Fp8Weight,
    w2: torch.Tensor | Fp8Weight, norm_w: torch.Tensor, eps: float, counter: torch.Tensor, defer: bool = False,
) -> tuple[torch.Tensor | PendingNorm, torch.Tensor]:
    """fused_moe_add_rms_norm for a row oproj_route routed: the gate/up launch
    applies the pending post-attention norm and writes the experts' weights
    (fp8 experts: their GEMV pair, fp8_ops.fused_moe_add_norm, alike)."""
    from ftserve_kernels.moe_down_gemv_triton import NormNext
    from ftserve_kernels.moe_gemv_triton import RouteParts

    k = _table(kernels, route.scaled)
    assert k.moe_add_norm is not None, "oproj_route_applies said the GEMV pair runs"
    weights = torch.empty(route.ids.shape, dtype=torch.float32, device=route.ids.device)
    pending = defer and moe_defers_next_norm(kernels, route.scaled)
    nn = NormNext(route.summed, norm_w, eps, counter, deferred=pending)
    parts_in = RouteParts(route.parts, route.pre_sel, route_eps)
    if isinstance(w13, Fp8Weight):
        assert isinstance(w2, Fp8Weight)
        first, summed, parts = fp8_ops.fused_moe_add_norm(kernels, route.scaled, w13, w2, weights, route.ids, nn,
                                                          route=parts_in)
    else:
        first, summed, parts = k.moe_add_norm(route.scaled, w13, w2, weights, route.ids, nn, route=parts_in)
    return (first if parts is None else PendingNorm(first, parts)), summed


def decode_inputs(
    kernels: KernelConfig, packed: torch.Tensor, last: torch.Tensor, page_table: torch.Tensor,
    embed: torch.Tensor | None, flag: int, norm: Any = None, staged: Any = None,
) -> Any:
    """A decode graph's inputs from its packed rows, one launch on Triton
    (ftserve_kernels/decode_inputs.py) -> DecodeInputs; with ``norm`` (an
    InputNorm) also the first layer's input norm of the embedding rows; with
    ``staged`` (a bookkeeping.StagedRows) the rows come from its pinned pair."""
    from ftserve_kernels import decode_inputs as di

    if uses_triton(kernels, packed):
        return di.decode_inputs_triton(packed, last, page_table, embed, flag, norm, staged=staged,
                                       kernels=kernels)
    return di.decode_inputs_ref(packed, last, page_table, embed, flag, norm, staged=staged)


def embed_rms_norm(
    kernels: KernelConfig, ids: torch.Tensor, embed: torch.Tensor, norm: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding rows [T, H], their first-layer input norm [T, H]): one launch on
    Triton, the same row work as decode_inputs' (so eager and graph decode agree)."""
    from ftserve_kernels import decode_inputs as di

    if uses_triton(kernels, embed):
        return di.embed_rms_norm_triton(ids, embed, norm)
    return di.embed_rms_norm_ref(ids, embed, norm)


def gated_delta(kernels: KernelConfig, t: torch.Tensor) -> Any:
    """The module whose four Gated DeltaNet functions run on tensors like ``t``."""
    if uses_triton(kernels, t):
        from ftserve_kernels import gated_delta_triton

        return gated_delta_triton
    from ftserve_kernels import gated_delta as gated_delta_ref

    return gated_delta_ref


def _gemv_for(kernels: KernelConfig, x: torch.Tensor) -> Callable[..., Any] | None:
    """The dense GEMV where linear runs it at x's size (rows [T, K]), else None."""
    k = _table(kernels, x)
    if k.gemv is not None and kernels.dense_gemv and x.dim() == 2 and x.shape[0] <= k.gemv_max_rows:
        return k.gemv
    return None


def linear(
    kernels: KernelConfig, x: torch.Tensor, w: torch.Tensor | Fp8Weight, b: torch.Tensor | None
) -> torch.Tensor:
    if isinstance(w, Fp8Weight):  # fp8 GEMV at decode sizes, w8a8 GEMM above (fp8_ops)
        return fp8_ops.linear(kernels, x, w, b)
    gemv = _gemv_for(kernels, x)
    if gemv is not None:
        return gemv(x, w, b)
    return F.linear(x, w, b)


def add_rms_norm_linear(
    kernels: KernelConfig, x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor,
    eps: float, w: torch.Tensor | Fp8Weight, b: torch.Tensor | None, prenormed: bool | PendingNorm = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(w, Fp8Weight):
        return _add_rms_norm_fp8_linear(kernels, x, residual, norm_w, eps, w, b, prenormed)
    if isinstance(prenormed, PendingNorm):  # x is the sum s; the GEMV applies the norm
        gemv = _gemv_for(kernels, x)
        assert gemv is not None and residual is not None, "moe_defers_next_norm said it would run"
        return gemv(prenormed.scaled, w, b, eps, parts=prenormed.parts), residual
    if prenormed:  # x is already norm(x' + residual): a plain linear (ops.linear's kernel choice)
        assert residual is not None
        return linear(kernels, x, w, b), residual
    if residual is None:
        return linear(kernels, rms_norm(kernels, x, norm_w, eps), w, b), x
    normed, summed = fused_add_rms_norm(kernels, x, residual, norm_w, eps)
    return linear(kernels, normed, w, b), summed


def dense_folds_norm(kernels: KernelConfig, x: torch.Tensor) -> bool:
    """Whether linear_add_rms_norm leaves the norm pending at x's size (where
    linear runs the GEMV: its epilogue adds and leaves it, the next GEMV applies it)."""
    return _gemv_for(kernels, x) is not None and _table(kernels, x).gemv_add_norm is not None


def linear_add_rms_norm(
    kernels: KernelConfig, x: torch.Tensor, w: torch.Tensor | Fp8Weight, b: torch.Tensor | None,
    residual: torch.Tensor, norm_w: torch.Tensor, eps: float,
) -> tuple[torch.Tensor | PendingNorm, torch.Tensor]:
    """fused_add_rms_norm(linear(x, w, b), residual, norm_w, eps) -> (normed, sum);
    where dense_folds_norm(x) (a tensor w) one launch: the GEMV adds the residual
    in its epilogue and leaves the norm pending -> (PendingNorm, sum), for a GEMV
    to apply (add_rms_norm_linear, gate_up_silu)."""
    gemv_add_norm = _table(kernels, x).gemv_add_norm
    if isinstance(w, torch.Tensor) and gemv_add_norm is not None and dense_folds_norm(kernels, x):
        from ftserve_kernels.moe_down_gemv_triton import NormNext

        scaled, summed, parts = gemv_add_norm(x, w, b, NormNext(residual.contiguous(), norm_w, eps, None,
                                                                 deferred=True))
        return PendingNorm(scaled, parts), summed
    return fused_add_rms_norm(kernels, linear(kernels, x, w, b), residual, norm_w, eps)


def gate_up_silu(
    kernels: KernelConfig, x: torch.Tensor | PendingNorm, w: torch.Tensor | Fp8Weight, b: torch.Tensor | None,
    eps: float = 0.0,
) -> torch.Tensor:
    """SiLU(gate) * up [T, I] of linear(x, w, b), w [2I, H]: the GEMV with its GLU
    epilogue where linear runs it (a tensor w), a PendingNorm x applied in it (eps:
    its norm's); otherwise the composition: linear, then SiLU and the product in
    place in the gate half (no [T, I] buffer; the down linear reads the strided rows),
    one launch on Triton (glu_triton)."""
    if isinstance(x, PendingNorm):
        if isinstance(w, Fp8Weight):
            gate_up = fp8_ops.pending_linear(kernels, x.scaled, x.parts, eps, w, b)
        else:
            gemv = _gemv_for(kernels, x.scaled)
            assert gemv is not None, "dense_folds_norm said the GEMV runs"
            return gemv(x.scaled, w, b, eps, parts=x.parts, glu=True)
    else:
        gemv = _gemv_for(kernels, x)
        if gemv is not None and isinstance(w, torch.Tensor):
            return gemv(x, w, b, glu=True)
        gate_up = linear(kernels, x, w, b)  # [T, 2I]
    return _table(kernels, gate_up).silu_mul(gate_up)  # [T, I], in the gate half


def _add_rms_norm_fp8_linear(
    kernels: KernelConfig, x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor,
    eps: float, w: Fp8Weight, b: torch.Tensor | None, prenormed: bool | PendingNorm,
) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm_linear with an fp8 weight: the norm, then the fp8 linear."""
    if isinstance(prenormed, PendingNorm):  # x is the sum s; the GEMV applies the norm
        assert residual is not None
        return fp8_ops.pending_linear(kernels, prenormed.scaled, prenormed.parts, eps, w, b), residual
    if prenormed:
        assert residual is not None
        return linear(kernels, x, w, b), residual
    if residual is None:
        return linear(kernels, rms_norm(kernels, x, norm_w, eps), w, b), x
    normed, summed = fused_add_rms_norm(kernels, x, residual, norm_w, eps)
    return linear(kernels, normed, w, b), summed


# The lm_head GEMV wins at one row only (H200 tune table, 151,936 x 2048: 137.5 us vs
# cuBLAS 144.1 at one row, 156.8 vs 144.2 at two).
LM_HEAD_GEMV_MAX_ROWS = 1


def linear_fp32(kernels: KernelConfig, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The lm_head: logits in fp32. A single row (batch-1 decode) runs the
    Triton GEMV (its tuned table has the lm_head shape)."""
    k = _table(kernels, x)
    if k.gemv is not None and x.shape[0] <= LM_HEAD_GEMV_MAX_ROWS:
        # fp32 logits straight from the kernel (rounded to x's dtype first, as
        # F.linear's output): no cast launch after the GEMV.
        return k.gemv(x, w, None, out_dtype=torch.float32)
    return F.linear(x, w).float()
