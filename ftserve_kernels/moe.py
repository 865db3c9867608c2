"""MoE routing and expert compute: torch reference twins (see ops.py).

Expert weights are stacked per layer:

    w13 [E, 2I, H]   rows [0, I) gate_proj, rows [I, 2I) up_proj
    w2  [E, H, I]    down_proj

The reference groups tokens by expert with a host-side split, which reads the
per-expert counts back from the device. That is fine on the CPU and as a test
oracle; the CUDA step path uses the Triton kernel, which never syncs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route_topk_ref(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in fp32, keep the top k, optionally renormalize them
    to sum to 1. router_logits [T, E] -> (weights [T, k] fp32, ids [T, k] int32).
    """
    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    valid_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_k weights[t, k] * down(SiLU(gate(x_t)) * up(x_t)) over the experts
    ids[t, k]. x [T, H] -> [T, H] in x's dtype; accumulation in fp32.
    ``valid_rows``: the Triton twin may leave rows past it unspecified; this
    computes every row.

    Per-expert matmuls run in the weights' dtype (as the HF experts do); the
    routing weight is applied in the activation dtype, matching HF's cast of the
    router scores to the hidden dtype.
    """
    top_k = topk_ids.shape[1]
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
    flat_ids = topk_ids.reshape(-1).long()  # [T*k]
    order = torch.argsort(flat_ids, stable=True)  # [T*k], grouped by expert
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()  # host read: reference only
    token_of = order // top_k  # [T*k]
    weight_of = topk_weights.reshape(-1).index_select(0, order).to(x.dtype)  # [T*k]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tok = token_of[start : start + n]  # [n]
        xe = x.index_select(0, tok)  # [n, H]
        gate_up = F.linear(xe, w13[e])  # [n, 2I]
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # [n, I]
        y = F.linear(h, w2[e]) * weight_of[start : start + n, None]  # [n, H]
        out.index_add_(0, tok, y.float())
        start += n
    return out.to(x.dtype)
