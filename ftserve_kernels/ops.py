"""One place that picks a kernel: Triton on CUDA tensors (or under
TRITON_INTERPRET=1 when FTSERVE_KERNELS=triton), the torch reference otherwise.

Model layers call these functions and never import a backend directly.
Signatures (all shapes are packed tokens, see ForwardBatch):

    rms_norm(x [T, H], w [H], eps) -> [T, H]
    fused_add_rms_norm(x [T, H], residual [T, H], w [H], eps) -> (normed, x + residual)
    rotary(q [T, Hq, D], k [T, Hkv, D], positions [T] int64,
           cos_sin [max_pos, rot_dim] fp32 (cos | sin halves)) -> (q, k)   (neox style)
    qk_norm_rotary(q [T, Hq, D], k [T, Hkv, D], q_w [D], k_w [D], eps, positions, cos_sin)
        -> (q, k): per-head RMSNorm of q and k, then rotary (Qwen3), one kernel on Triton
    route_topk(router_logits [T, E], top_k, renormalize) -> (weights [T, k] fp32, ids [T, k] int32)
    fused_moe(x [T, H], w13 [E, 2I, H], w2 [E, H, I], weights [T, k], ids [T, k]) -> [T, H]
        (w13 rows [0, I) are the gate, [I, 2I) the up projection; SiLU(gate) * up)
"""

from __future__ import annotations

import os

import torch


def _triton_enabled(t: torch.Tensor) -> bool:
    choice = os.environ.get("FTSERVE_KERNELS", "auto")
    if choice == "torch":
        return False
    if choice == "triton":
        return True
    return t.is_cuda


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if _triton_enabled(x):
        try:
            from ftserve_kernels.norm_triton import rms_norm_triton
        except ImportError:
            pass
        else:
            return rms_norm_triton(x, w, eps)
    from ftserve_kernels.norm_rope import rms_norm_ref

    return rms_norm_ref(x, w, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if _triton_enabled(x):
        try:
            from ftserve_kernels.norm_triton import fused_add_rms_norm_triton
        except ImportError:
            pass
        else:
            return fused_add_rms_norm_triton(x, residual, w, eps)
    from ftserve_kernels.norm_rope import fused_add_rms_norm_ref

    return fused_add_rms_norm_ref(x, residual, w, eps)


def rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if _triton_enabled(q):
        try:
            from ftserve_kernels.rope_triton import rotary_triton
        except ImportError:
            pass
        else:
            return rotary_triton(q, k, positions, cos_sin)
    from ftserve_kernels.norm_rope import rotary_ref

    return rotary_ref(q, k, positions, cos_sin)


def qk_norm_rotary(
    q: torch.Tensor, k: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor, eps: float,
    positions: torch.Tensor, cos_sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    if _triton_enabled(q):
        try:
            from ftserve_kernels.rope_triton import qk_norm_rotary_triton
        except ImportError:
            pass
        else:
            return qk_norm_rotary_triton(q, k, q_w, k_w, eps, positions, cos_sin)
    from ftserve_kernels.norm_rope import qk_norm_rotary_ref

    return qk_norm_rotary_ref(q, k, q_w, k_w, eps, positions, cos_sin)


def route_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if _triton_enabled(router_logits):
        try:
            from ftserve_kernels.moe_triton import route_topk_triton
        except ImportError:
            pass
        else:
            return route_topk_triton(router_logits, top_k, renormalize)
    from ftserve_kernels.moe import route_topk_ref

    return route_topk_ref(router_logits, top_k, renormalize)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    if _triton_enabled(x):
        try:
            from ftserve_kernels.moe_triton import fused_moe_triton
        except ImportError:
            pass
        else:
            return fused_moe_triton(x, w13, w2, topk_weights, topk_ids)
    from ftserve_kernels.moe import fused_moe_ref

    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids)
