"""The batch-1 decode path of an MoE decoder layer as one persistent launch
(ftserve_kernels/decode_layer_triton.py), and when a layer may take it.

``eligible`` is checked per layer call (cheap attribute tests); the unfused
path in DecoderLayer.forward stays the reference and the fallback. Each layer
owns its barrier words (zero between launches; the kernel leaves them zero).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from ftserve import envs
from ftserve.models.forward_batch import ForwardBatch
from ftserve_kernels import ops

if TYPE_CHECKING:
    from ftserve.models.decoder import DecoderLayer


def eligible(layer: DecoderLayer, x: torch.Tensor, batch: ForwardBatch, cos_sin: torch.Tensor) -> bool:
    from ftserve.models.layers import MoEBlock

    if not (envs.decode_layer_kernel() and batch.is_decode and x.shape[0] == 1):
        return False
    if not ops.uses_triton(x):
        return False
    mlp, attn = layer.mlp, layer.self_attn
    if not isinstance(mlp, MoEBlock) or mlp.expert_compute is not None or mlp.is_fp8:
        return False
    if attn.qkv_proj.weight_scale is not None or attn.o_proj.weight_scale is not None:
        return False  # fp8 projections: the unfused path's fp8 kernels
    if mlp.gate._forward_hooks or mlp.gate._forward_pre_hooks:
        return False  # someone observes the router: the unfused path calls the modules
    if attn.qkv_proj.bias is not None or attn.o_proj.bias is not None or (attn.q_norm is None) != (attn.k_norm is None):
        return False
    d = attn.head_dim
    if d & (d - 1) or d < 32 or cos_sin.shape[1] != d or attn.num_heads % attn.num_kv_heads:
        return False
    pool = batch.kv_pool
    return (getattr(batch.attn_backend, "name", "") == "triton" and pool.k_scale is None
            and pool.k[attn.layer_idx].dtype == x.dtype)


def forward(
    layer: DecoderLayer, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch,
    cos_sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (MoE output [1, H], residual [1, H]), as DecoderLayer.forward."""
    from ftserve_kernels import decode_layer_triton as dl

    attn, mlp = layer.self_attn, layer.mlp
    idx = attn.layer_idx
    if batch.layer_ready is not None:  # this layer's pages may still be streaming in
        torch.cuda.current_stream().wait_event(batch.layer_ready[idx])
    sync = getattr(layer, "_fused_sync", None)
    if sync is None or sync.device != x.device:
        sync = dl.sync_words(attn.num_kv_heads, x.device)
        layer._fused_sync = sync  # type: ignore[assignment]
    weights = dl.LayerWeights(
        ln1=layer.input_layernorm.weight, wqkv=attn.qkv_proj.weight,
        q_norm=attn.q_norm.weight if attn.q_norm is not None else None,
        k_norm=attn.k_norm.weight if attn.k_norm is not None else None,
        wo=attn.o_proj.weight, ln2=layer.post_attention_layernorm.weight, router=mlp.gate.weight,
        w13=mlp.w13, w2=mlp.w2, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads,
        top_k=mlp.top_k, renormalize=mlp.renormalize, eps=layer.input_layernorm.eps,
    )
    meta, pool = batch.attn, batch.kv_pool
    scale = getattr(batch.attn_backend, "scale", None)
    step = dl.StepInputs(
        positions=batch.positions, cos_sin=cos_sin, out_cache_loc=meta.out_cache_loc,
        page_table=meta.page_table, seq_lens=meta.seq_lens, k_cache=pool.k[idx], v_cache=pool.v[idx],
        page_size=meta.page_size, scale=scale if scale is not None else attn.head_dim ** -0.5,
    )
    cfg = dataclasses.replace(dl.LayerConfig(), **envs.decode_layer_config())
    # Diagnostics a tool may hang on the layer (tools/bench_decode_layer_kernel):
    # a timestamp buffer to fill, and a dict that receives the compiled kernel.
    return dl.decode_layer_triton(x, residual, weights, step, sync, cfg,
                                  timing=getattr(layer, "fused_timing", None),
                                  info=getattr(layer, "fused_info", None))
