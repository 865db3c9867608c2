"""Gated DeltaNet: the linear-attention token mixer of hybrid models (Qwen3-Next).

    x [T, H] -> in_proj -> q k v (per key-head groups) | z (output gate) | b a
             -> causal conv over q|k|v (+ SiLU), state: the last K-1 inputs
             -> gated delta rule (ftserve_kernels/gated_delta.py), state: S per value head
             -> RMSNorm(o) * SiLU(z) per value head -> out_proj -> [T, H]

Both states live in the batch's StatePool (ftserve/kvcache/state_pool.py), in
the slot ``batch.state_slots[b]`` of each sequence: the layer reads the state
there (zeros for a sequence without a prefix: ``prefix_lens[b] == 0``) and
writes the state after its last token back. A step whose every sequence has
one new token runs the fixed-shape decode path (gather / scatter by slot). A
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

import torch
import torch.nn.functional as F
from torch import nn

from ftserve.models.config import LinearAttentionConfig
from ftserve.models.forward_batch import ForwardBatch
from ftserve.models.layers import Linear
from ftserve_kernels import ops


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dim, times SiLU(gate): w * norm(x) * SiLU(z) (plain
    weight, not zero-centered), the norm in fp32 and rounded to x's dtype before
    the weight, as the reference does."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return ((self.weight * normed) * F.silu(gate.float())).to(x.dtype)


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
        """proj [T, qkvz + 2Hv] -> (q|k|v [T, conv_dim], z [T, Hv, dv], b [T, Hv], a [T, Hv])."""
        la, r, t = self.la, self.ratio, proj.shape[0]
        qkvz, ba = proj.split([self.qkvz_size, 2 * la.num_value_heads], dim=-1)
        qkvz = qkvz.view(t, la.num_key_heads, -1)  # [T, Hk, 2dk + 2r dv]
        q, k, v, z = qkvz.split([la.key_head_dim, la.key_head_dim, r * la.value_head_dim,
                                 r * la.value_head_dim], dim=-1)
        b, a = ba.view(t, la.num_key_heads, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)  # [T, C]
        z = z.reshape(t, la.num_value_heads, la.value_head_dim)
        return mixed, z, b.reshape(t, -1), a.reshape(t, -1)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        pool, slots = batch.state_pool, batch.state_slots
        if pool is None or slots is None:
            raise ValueError("a model with linear-attention layers needs batch.state_pool and state_slots")
        if batch.state_verify and pool.verify_log is None:
            raise ValueError("a verify step needs a state pool built with a verify log")
        la, t, meta = self.la, x.shape[0], batch.attn
        mixed, z, b, a = self._split(self.in_proj(x, batch.kernels))
        conv_states = pool.conv[self.state_idx]  # [S+1, C, K-1]
        states = pool.recurrent[self.state_idx]  # [S+1, Hv, dk, dv]
        has_state = meta.prefix_lens > 0  # [B], on the device: no sync
        weight = self.conv1d_weight[:, 0]  # [C, K]
        verify = batch.state_verify
        decode = meta.max_extend_len == 1 and not verify and not batch.graph_seq_bound
        gated_delta = ops.gated_delta(batch.kernels, x)  # Triton on CUDA, the torch reference elsewhere
        log = pool.verify_log if verify else None
        j = self.state_idx
        if decode:
            mixed = gated_delta.conv_decode(mixed, weight, conv_states, slots, has_state)
        else:
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
                                                 cu_seqlens=meta.qo_indptr, static_len=bound)
        q, k, v = mixed.split([la.key_dim, la.key_dim, la.value_dim], dim=-1)
        q = q.reshape(t, la.num_key_heads, la.key_head_dim)
        k = k.reshape(t, la.num_key_heads, la.key_head_dim)
        v = v.reshape(t, la.num_value_heads, la.value_head_dim)
        beta = b.sigmoid()  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # [T, Hv], log decay
        if decode:
            o = gated_delta.gated_delta_decode(q, k, v, g, beta, states, slots, has_state)
        elif log is not None:
            for dst, src in ((log.k, k), (log.v, v), (log.g, g), (log.beta, beta)):
                dst[j, :t].copy_(src)
            o = gated_delta.gated_delta_verify(q, k, v, g, beta, states, slots, has_state, bounds,
                                               cu_seqlens=meta.qo_indptr, static_len=bound)
        else:
            o = gated_delta.gated_delta_prefill(q, k, v, g, beta, states, slots, has_state, bounds,
                                                cu_seqlens=meta.qo_indptr, static_len=bound)
        o = self.norm(o, z)  # [T, Hv, dv]
        return self.out_proj(o.reshape(t, la.value_dim), batch.kernels)  # [T, H]
