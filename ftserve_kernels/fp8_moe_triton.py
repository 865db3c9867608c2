"""Fused MoE over fp8 experts for prefill: grouped w8a8 GEMMs over moe_align,
and the torch twin of every fp8 expert path.

Weights as in moe.py, in fp8 (Fp8Weight): ``w13`` codes [E, 2I, H] (gate rows
then up rows) with scales [E, 2I / bn, H / bk], ``w2`` codes [E, H, I].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ftserve_kernels.fp8_quant import Fp8Weight, dequantize, fake_quant_act


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
