"""Gated DeltaNet: the linear-attention token mixer of hybrid models (Qwen3-Next).

    x [T, H] -> in_proj -> q k v (per key-head groups) | z (output gate) | b a
             -> causal conv over q|k|v (+ SiLU), state: the last K-1 inputs
             -> gated delta rule (ftserve_kernels/gated_delta.py), state: S per value head
             -> RMSNorm(o) * SiLU(z) per value head -> out_proj -> [T, H]

Both states live in the batch's StatePool (ftserve/kvcache/state_pool.py), in
the slot ``batch.state_slots[b]`` of each sequence: the layer reads the state
there (zeros for a sequence without a prefix: ``prefix_lens[b] == 0``) and
writes the state after its last token back. A step whose every sequence has
one new token runs the fixed-shape decode path: the conv, the rule (its gates
computed from a and b in the launch) and the gated norm read their inputs where
the projection left them and the states in place in their slots, no copies. A
speculative verify step (``batch.state_verify``) runs each sequence's few
tokens one by one as decode would, writes no slot, and logs its conv and rule
inputs for the commit that follows sampling (kvcache/state_pool.py). In a
captured prefill or verify graph the host knows no step's bounds: the kernels
read them from qo_indptr within ``batch.graph_seq_bound`` tokens a sequence.

The checkpoint's in_proj_qkvz rows are grouped by key head,
[Hk, (q dk | k dk | v r*dv | z r*dv)] with r = Hv / Hk, and in_proj_ba's
[Hk, (b r | a r)]; the two are one fused projection here (rows qkvz then ba)
and the grouping is undone by views after the matmul.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ftserve.models.config import LinearAttentionConfig
from ftserve.models.forward_batch import ForwardBatch
from ftserve.models.layers import Linear
from ftserve_kernels import ops
from ftserve_kernels.config import KernelConfig
from ftserve_kernels.gated_delta import gate_params


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dim, times SiLU(gate): w * norm(x) * SiLU(z) (plain
    weight, not zero-centered), the norm in fp32 and rounded to x's dtype before
    the weight, as the reference does (ops.gated_rms_norm: one launch on Triton)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor, kernels: KernelConfig) -> torch.Tensor:
        """x [T, Hv, dv], gate [T, Hk, Hv / Hk, dv] (a view into the projection) -> [T, Hv, dv]."""
        return ops.gated_rms_norm(kernels, x, gate, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    def __init__(self, state_idx: int, hidden_size: int, la: LinearAttentionConfig, eps: float,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.state_idx = state_idx  # this layer's index in the state pool
        self.la = la
        self.ratio = la.num_value_heads // la.num_key_heads
        self.qkvz_size = 2 * la.key_dim + 2 * la.value_dim
        # rows [0, qkvz) = in_proj_qkvz, [qkvz, qkvz + 2 Hv) = in_proj_ba (checkpoint layouts)
        self.in_proj = Linear(hidden_size, self.qkvz_size + 2 * la.num_value_heads, False, dtype)
        # [C, 1, K]: the checkpoint's depthwise Conv1d weight as it is stored
        self.conv1d_weight = nn.Parameter(torch.empty(la.conv_dim, 1, la.conv_kernel, dtype=dtype),
                                          requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(la.num_value_heads, dtype=dtype), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(la.num_value_heads, dtype=dtype), requires_grad=False)
        self.norm = GatedRMSNorm(la.value_head_dim, eps, dtype)
        self.out_proj = Linear(la.value_dim, hidden_size, False, dtype)

    def _split(self, proj: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """proj [T, qkvz + 2Hv] -> views into it, value heads grouped by key head:
        q, k [T, Hk, dk], v [T, Hk, r dv], z [T, Hk, r, dv], b, a [T, Hk, r]."""
        la, r, t = self.la, self.ratio, proj.shape[0]
        qkvz, ba = proj.split([self.qkvz_size, 2 * la.num_value_heads], dim=-1)
        qkvz = qkvz.view(t, la.num_key_heads, -1)  # [T, Hk, 2dk + 2r dv]
        q, k, v, z = qkvz.split([la.key_head_dim, la.key_head_dim, r * la.value_head_dim,
                                 r * la.value_head_dim], dim=-1)
        b, a = ba.view(t, la.num_key_heads, 2 * r).split([r, r], dim=-1)
        return q, k, v, z.view(t, la.num_key_heads, r, la.value_head_dim), b, a

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        pool, slots = batch.state_pool, batch.state_slots
        if pool is None or slots is None:
            raise ValueError("a model with linear-attention layers needs batch.state_pool and state_slots")
        if batch.state_verify and pool.verify_log is None:
            raise ValueError("a verify step needs a state pool built with a verify log")
        la, t, meta = self.la, x.shape[0], batch.attn
        q, k, v, z, b, a = self._split(self.in_proj(x, batch.kernels))
        gated_delta = ops.gated_delta(batch.kernels, x)  # Triton on CUDA, the torch reference elsewhere
        conv_states = pool.conv[self.state_idx]  # [S+1, C, K-1]
        states = pool.recurrent[self.state_idx]  # [S+1, Hv, dk, dv]
        has_state = meta.prefix_lens  # [B], nonzero: the slot holds the prefix's state
        weight = self.conv1d_weight[:, 0]  # [C, K]
        if meta.max_extend_len == 1 and not batch.state_verify and not batch.graph_seq_bound:
            # Decode: the conv reads q, k, v where the projection left them, the rule
            # computes its gates from a and b in its launch.
            mixed = gated_delta.conv_decode((q, k, v), weight, conv_states, slots, has_state)
            q, k, v = self._heads(mixed)
            o = gated_delta.gated_delta_decode_fused(q, k, v, a, b, self.A_log, self.dt_bias, states, slots,
                                                     has_state)
        else:
            o = self._extend(gated_delta, batch, (q, k, v), a, b, weight, conv_states, states)
        o = self.norm(o, z, batch.kernels)  # [T, Hv, dv]
        return self.out_proj(o.reshape(t, la.value_dim), batch.kernels)  # [T, H]

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's output [T, C] -> q, k [T, Hk, dk], v [T, Hv, dv] (views)."""
        la, t = self.la, mixed.shape[0]
        q, k, v = mixed.split([la.key_dim, la.key_dim, la.value_dim], dim=-1)
        return (q.reshape(t, la.num_key_heads, la.key_head_dim), k.reshape(t, la.num_key_heads, la.key_head_dim),
                v.reshape(t, la.num_value_heads, la.value_head_dim))

    def _extend(self, gated_delta: Any, batch: ForwardBatch, qkv: tuple[torch.Tensor, ...], a: torch.Tensor,
                b: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, states: torch.Tensor,
                ) -> torch.Tensor:
        """Prefill chunks and verify steps: packed sequences of any lengths -> o [T, Hv, dv]."""
        pool, slots, meta = batch.state_pool, batch.state_slots, batch.attn
        assert pool is not None and slots is not None
        t, j, has_state = a.shape[0], self.state_idx, meta.prefix_lens
        log = pool.verify_log if batch.state_verify else None
        mixed = torch.cat([p.reshape(t, -1) for p in qkv], dim=-1)  # [T, C]
        # A captured graph's step: no host bounds, a static bound per sequence
        # (ForwardBatch.graph_seq_bound); eager: the step's own.
        bound = batch.graph_seq_bound or None
        bounds: list[int] | None = None
        if bound is None:
            bounds = [0]
            for n in meta.extend_lens_host:
                bounds.append(bounds[-1] + n)
        if log is not None:
            log.conv_in[j, :t].copy_(mixed)
            mixed = gated_delta.conv_verify(mixed, weight, conv_states, slots, has_state, bounds,
                                            cu_seqlens=meta.qo_indptr, static_len=bound)
        else:
            mixed = gated_delta.conv_prefill(mixed, weight, conv_states, slots, has_state, bounds,
                                             cu_seqlens=meta.qo_indptr, static_len=bound, saves=batch.state_inner)
        q, k, v = self._heads(mixed)
        g, beta = gate_params(a.reshape(t, -1), b.reshape(t, -1), self.A_log, self.dt_bias)  # [T, Hv] each
        if log is not None:
            for dst, src in ((log.k, k), (log.v, v), (log.g, g), (log.beta, beta)):
                dst[j, :t].copy_(src)
            return gated_delta.gated_delta_verify(q, k, v, g, beta, states, slots, has_state, bounds,  # type: ignore[no-any-return]
                                                  cu_seqlens=meta.qo_indptr, static_len=bound)
        return gated_delta.gated_delta_prefill(q, k, v, g, beta, states, slots, has_state, bounds,  # type: ignore[no-any-return]
                                               cu_seqlens=meta.qo_indptr, static_len=bound,
                                               saves=batch.state_inner)
