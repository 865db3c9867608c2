"""Kernel choice for fp8 weights (Fp8Weight, fp8_quant.py); ops.py calls these
when a layer's weight is fp8, with the step's KernelConfig first (Triton or the
torch twins, as ``kernels.triton(x)`` says; the Triton wrappers take it for PDL).
Signatures, the KernelConfig left out:

    linear(x [T, K], w [N, K], b)          T <= GEMV_MAX_ROWS: fp8 GEMV (bf16 rows, w8a16);
                                           else per-token-group activation quantization
                                           + the block-scaled w8a8 GEMM: cuBLAS's
                                           (fp8_scaled_mm) on Hopper where the weight's
                                           grid is its recipe, else Triton's
    pending_linear(scaled, parts, eps, w, b)   the same over a norm the layer before left
                                           pending (ops.PendingNorm), applied in the GEMV
    fused_moe_add_norm(..., norm_next, route=None)
                                           the expert GEMV pair folding the next norm; ``route``:
                                           a row o_proj routed (ops.fused_moe_routed)
    fused_moe(x [T, H], w13, w2, weights, ids)
                                           T <= MOE_GEMV_MAX_TOKENS: the two expert GEMVs;
                                           else the grouped w8a8 GEMMs over moe_align
    the torch twins: the exact references, weights dequantized per block and
    multiplied in fp32 with the activations as they are (the CPU engine's path).

Every Triton path has fixed shapes and no host read, so decode runs inside the
captured graphs and a prefill chunk syncs nothing. lm_head and embeddings are
never fp8 (ModelConfig keeps them in the model dtype).
"""

from __future__ import annotations

from typing import Any

import torch

from ftserve_kernels.config import KernelConfig
from ftserve_kernels.fp8_quant import Fp8Weight, fp8_linear_ref

GEMV_MAX_ROWS = 4  # dense: rows per GEMV launch (every program holds all of them)
MOE_GEMV_MAX_TOKENS = 2  # experts: up to here the GEMV pair, past it the grouped GEMMs


def linear(kernels: KernelConfig, x: torch.Tensor, w: Fp8Weight, b: torch.Tensor | None) -> torch.Tensor:
    if not kernels.triton(x):
        return fp8_linear_ref(x, w, b)
    if x.shape[0] <= GEMV_MAX_ROWS:
        from ftserve_kernels.fp8_gemv_triton import fp8_gemv_triton

        return fp8_gemv_triton(x, w, b, kernels=kernels)
    from ftserve_kernels import fp8_scaled_mm

    if fp8_scaled_mm.available() and fp8_scaled_mm.fits(w):
        return fp8_scaled_mm.fp8_linear_scaled_mm(x, w, b)
    from ftserve_kernels.fp8_gemm_triton import fp8_linear_triton

    return fp8_linear_triton(x, w, b)


def pending_linear(kernels: KernelConfig, scaled: torch.Tensor, parts: torch.Tensor, eps: float,
                   w: Fp8Weight, b: torch.Tensor | None) -> torch.Tensor:
    """linear(rms_norm applied to a pending norm (ops.PendingNorm: ``scaled`` = weight * s,
    ``parts`` the partial sums of squares of s)): on the GEMV, its 1/rms scales each
    row's dot at the end (no normed row is rounded); else the rows are normed first."""
    if kernels.triton(scaled) and scaled.shape[0] <= GEMV_MAX_ROWS:
        from ftserve_kernels.fp8_gemv_triton import fp8_gemv_triton

        return fp8_gemv_triton(scaled, w, b, parts=parts, eps=eps, kernels=kernels)
    rms = torch.rsqrt(parts.sum(-1, keepdim=True) / scaled.shape[1] + eps)  # [T, 1]
    return linear(kernels, (scaled.float() * rms).to(scaled.dtype), w, b)


def fused_moe(kernels: KernelConfig, x: torch.Tensor, w13: Fp8Weight, w2: Fp8Weight,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor | None = None,
              read_through: Any = None, triton: bool | None = None,
              valid_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``expert_map`` [E] int32: expert -> row of w13 / w2 (an expert-slot cache);
    ``read_through`` (fp8_moe_gemv_triton.Fp8ReadThrough, GEMV sizes): this
    step's misses read from the host bank by the GEMVs; ``triton``: the caller's
    choice of backend (the expert cache picks by device), else ``kernels``';
    ``valid_rows``: the grouped GEMMs skip rows past it (ops.fused_moe)."""
    if not (kernels.triton(x) if triton is None else triton):
        assert read_through is None, "read-through is a Triton GEMV path"
        from ftserve_kernels.fp8_moe_triton import fused_moe_fp8_ref

        if expert_map is not None:
            topk_ids = expert_map.index_select(0, topk_ids.reshape(-1).long()).view_as(topk_ids)
        return fused_moe_fp8_ref(x, w13, w2, topk_weights, topk_ids)
    if x.shape[0] <= MOE_GEMV_MAX_TOKENS:
        from ftserve_kernels.fp8_moe_gemv_triton import fused_moe_fp8_gemv_triton

        return fused_moe_fp8_gemv_triton(x, w13, w2, topk_weights, topk_ids, expert_map, read_through,
                                         kernels=kernels)
    assert read_through is None, "read-through is a GEMV path"
    from ftserve_kernels.fp8_moe_triton import fused_moe_fp8_triton

    return fused_moe_fp8_triton(x, w13, w2, topk_weights, topk_ids, expert_map=expert_map, valid_rows=valid_rows)


def fused_moe_add_norm(kernels: KernelConfig, x: torch.Tensor, w13: Fp8Weight, w2: Fp8Weight,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor, norm_next: Any,
                       route: Any = None) -> tuple[Any, Any, Any]:
    """The expert GEMV pair with the next layer's input norm folded into the down
    epilogue (moe_down_gemv_triton.NormNext) -> (normed or weight * sum, sum, parts or None);
    where ops.moe_folds_next_norm (Triton, GEMV sizes). ``route`` (moe_gemv_triton.RouteParts,
    a row ops.oproj_route routed): gate/up applies its pending norm and writes topk_weights."""
    from ftserve_kernels.fp8_moe_gemv_triton import fused_moe_fp8_add_norm_gemv_triton

    return fused_moe_fp8_add_norm_gemv_triton(x, w13, w2, topk_weights, topk_ids, norm_next, kernels=kernels,
                                              route=route)
