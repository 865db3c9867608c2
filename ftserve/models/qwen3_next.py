"""Qwen3-Next: a hybrid decoder. ModelConfig.layer_types picks each layer's token mixer:

    linear_attention  Gated DeltaNet (linear_attention.py), state in the StatePool
    full_attention    gated attention over the paged KV pool: q_proj also yields a
                      per-head output gate, q/k norms, partial rotary, o_proj(attn * sigmoid(gate))

and every layer ends in an MoE block with an always-on shared expert (its own
sigmoid gate) beside the routed experts (or a dense MLP on mlp_only_layers).

Its RMSNorms (layer, final, q/k) are zero-centered: the checkpoint stores w and the
norm scales by (1 + w), in fp32 (ZeroCenteredRMSNorm); only the gated norm inside
DeltaNet uses a plain weight.

Each residual add runs inside the norm after it (ops.fused_add_rms_norm), and a MoE
layer's output reaches it in parts (LayerOut: routed experts, shared expert, its
gate logit), so the shared expert's gate and the two adds are that launch's too;
the post-attention norm also routes (ops.add_rms_norm_route, one launch at decode
sizes)::

    out, residual --[add, input norm]--> mixer --[add, post norm, route]--> MoE -> out', residual'

The KV pool holds only the full-attention layers (pool layer j = ModelConfig.kv_layers[j]),
the state pool only the linear ones (ModelConfig.linear_layers).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
from torch import nn

from ftserve.models.config import FULL_ATTENTION, ModelConfig
from ftserve.models.decoder import Target
from ftserve.models.forward_batch import ForwardBatch
from ftserve.models.layers import DenseMLP, Embedding, Linear, MoEBlock
from ftserve.models.linear_attention import GatedDeltaNet
from ftserve.models.mtp import MTPHead
from ftserve_kernels import ops
from ftserve_kernels.config import KernelConfig


@dataclass(frozen=True)
class LayerOut:
    """What a block adds to the residual stream: ``y``, or on a shared-expert MoE
    block y (the routed experts) + sigmoid(logit) * shared, with ``shared`` =
    (the shared expert's output [T, H], its gate logit [T, 1])."""

    y: torch.Tensor  # [T, H]
    shared: tuple[torch.Tensor, torch.Tensor] | None = None

    def rows(self, idx: torch.Tensor) -> LayerOut:
        """The rows ``idx`` of every part."""
        pick = functools.partial(torch.index_select, dim=0, index=idx)
        return LayerOut(pick(self.y), None if self.shared is None else (pick(self.shared[0]), pick(self.shared[1])))


class ZeroCenteredRMSNorm(nn.Module):
    """norm(x) * (1 + w) in fp32, rounded to x's dtype once at the end."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, kernels: KernelConfig) -> torch.Tensor:
        return ops.rms_norm(kernels, x, self.weight, self.eps, zero_centered=True)

    def forward_add(self, out: LayerOut, residual: torch.Tensor | None,
                    kernels: KernelConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + out), residual + out); residual None: out.y is the stream's start."""
        if residual is None:
            assert out.shared is None
            return self(out.y, kernels), out.y
        return ops.fused_add_rms_norm(kernels, out.y, residual, self.weight, self.eps, zero_centered=True,
                                      shared=out.shared)


class GatedAttention(nn.Module):
    """Full attention with an output gate. ``kv_layer``: this layer's index in the KV pool."""

    def __init__(self, kv_layer: int, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.kv_layer = kv_layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, kv = cfg.q_size, cfg.kv_size
        self.sizes = [2 * q, kv, kv]
        # rows [0, 2q) = q_proj (per head: head_dim query rows, then head_dim gate rows),
        # [2q, 2q + kv) = k_proj, [2q + kv, 2q + 2kv) = v_proj
        self.qkv_proj = Linear(cfg.hidden_size, 2 * q + 2 * kv, cfg.qkv_bias, dtype)
        self.o_proj = Linear(q, cfg.hidden_size, cfg.o_bias, dtype)
        self.q_norm = ZeroCenteredRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = ZeroCenteredRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cos_sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        qg, k, v = self.qkv_proj(x, batch.kernels).split(self.sizes, dim=-1)
        qg = qg.view(t, self.num_heads, 2, self.head_dim)
        q, gate = qg[:, :, 0], qg[:, :, 1]  # [T, Hq, D] each
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if batch.layer_ready is not None:  # this layer's pages may still be streaming in
            torch.cuda.current_stream().wait_event(batch.layer_ready[self.kv_layer])
        # Both norms, the (partial) rotary and, into a float KV cache, the KV store: one launch.
        pool = batch.kv_pool
        stored = pool.k_scale is None
        kv_store = (pool.k[self.kv_layer], pool.v[self.kv_layer], v, batch.attn.out_cache_loc) if stored else None
        q, k = ops.qk_norm_rotary(batch.kernels, q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                  batch.positions, cos_sin, kv_store, zero_centered=True)
        # out * sigmoid(gate): in the decode attention's reduce launch on Triton
        out = batch.attn_backend.forward(q, k, v, self.kv_layer, batch, kv_stored=stored,
                                         out_gate=gate)  # [T, Hq, D]
        return self.o_proj(out.reshape(t, -1), batch.kernels)  # [T, H]


class SharedExpertMoE(MoEBlock):
    """Routed experts (MoEBlock, with its expert-compute hook) plus one shared
    expert that every token runs, weighed by sigmoid(shared_expert_gate(x))."""

    def __init__(self, layer_idx: int, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__(layer_idx, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                         cfg.num_experts_per_tok, cfg.norm_topk_prob, dtype)
        self.shared_expert = DenseMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, False, dtype)
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, False, dtype)

    def forward(self, x: torch.Tensor, kernels: KernelConfig) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x, kernels)) * self.shared_expert(x, kernels)  # [T, H]
        return super().forward(x, kernels) + shared

    def add_norm_route(self, mixed: torch.Tensor, residual: torch.Tensor, norm: ZeroCenteredRMSNorm,
                       kernels: KernelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The residual add, the layer's post-attention norm and the routing: one
        launch at decode sizes on Triton (ops.add_rms_norm_route). -> (normed [T, H],
        residual + mixed [T, H], weights [T, k] fp32, ids [T, k] int32)."""
        if self.observed():  # the router module runs, for the hooks to see its logits
            normed, summed = norm.forward_add(LayerOut(mixed), residual, kernels)
            return (normed, summed, *self.route(normed, kernels))
        normed, summed, weights, ids = ops.add_rms_norm_route(
            kernels, mixed, residual, norm.weight, norm.eps, self.gate.weight, self.top_k, self.renormalize,
            self._counter(mixed), zero_centered=True)
        assert summed is not None
        return normed, summed, weights, ids

    def forward_parts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                      kernels: KernelConfig, valid_rows: torch.Tensor | None = None) -> LayerOut:
        """forward's output on x routed to ``ids``, left in parts for the add + norm
        after it to combine (rows past ``valid_rows``: padding, see compute_experts)."""
        shared = (self.shared_expert(x, kernels), self.shared_expert_gate(x, kernels))  # [T, H], [T, 1]
        return LayerOut(self.compute_experts(x, weights, ids, kernels, valid_rows), shared)


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = ZeroCenteredRMSNorm(h, eps, dtype)
        self.self_attn: GatedAttention | None = None
        self.linear_attn: GatedDeltaNet | None = None
        if cfg.is_full_attention(layer_idx):
            self.self_attn = GatedAttention(cfg.kv_layers.index(layer_idx), cfg, dtype)
        else:
            assert cfg.linear_attn is not None
            self.linear_attn = GatedDeltaNet(cfg.linear_layers.index(layer_idx), h, cfg.linear_attn, eps, dtype)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(h, eps, dtype)
        self.mlp: SharedExpertMoE | DenseMLP
        if cfg.sparse_layers[layer_idx]:
            self.mlp = SharedExpertMoE(layer_idx, cfg, dtype)
        else:
            self.mlp = DenseMLP(h, cfg.intermediate_size, cfg.mlp_bias, dtype)

    def forward(self, out: LayerOut, residual: torch.Tensor | None, batch: ForwardBatch,
                cos_sin: torch.Tensor) -> tuple[LayerOut, torch.Tensor]:
        """(the layer before's output, the residual stream before it; None: out.y is
        the embeddings) -> (this layer's output, the stream before it)."""
        kernels = batch.kernels
        normed, residual = self.input_layernorm.forward_add(out, residual, kernels)
        if self.linear_attn is not None:
            mixed = self.linear_attn(normed, batch)
        else:
            assert self.self_attn is not None
            mixed = self.self_attn(normed, batch, cos_sin)
        assert residual is not None
        if isinstance(self.mlp, SharedExpertMoE):
            normed, residual, weights, ids = self.mlp.add_norm_route(mixed, residual, self.post_attention_layernorm,
                                                                     kernels)
            return self.mlp.forward_parts(normed, weights, ids, kernels, batch.valid_tokens), residual
        normed, residual = self.post_attention_layernorm.forward_add(LayerOut(mixed), residual, kernels)
        return LayerOut(self.mlp(normed, kernels)), residual


class Qwen3NextForCausalLM(nn.Module):
    """model(batch) -> logits [rows, vocab] fp32, as DecoderForCausalLM; the batch
    also carries the state pool and slots (ForwardBatch.state_pool / state_slots)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        if cfg.linear_attn is None:
            raise ValueError("Qwen3NextForCausalLM needs ModelConfig.linear_attn")
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(Qwen3NextDecoderLayer(cfg, i, dtype) for i in range(cfg.num_layers))
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, False, dtype)
        self.register_buffer(
            "cos_sin", torch.empty(cfg.max_context_len, cfg.rotary_dim, dtype=torch.float32), persistent=False
        )
        self.mtp: Qwen3NextMTP | None = None  # attach_mtp

    def attach_mtp(self, num_layers: int) -> None:
        """Build the checkpoint's MTP layers (models/mtp.py) before materializing."""
        self.mtp = Qwen3NextMTP(self.config, num_layers, self.embed_tokens.weight.dtype)

    @property
    def ignorable_prefixes(self) -> tuple[str, ...]:
        """The published checkpoints' MTP tensors, when built without them."""
        return () if self.mtp is not None else ("mtp.",)

    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.no_grad()
    def init_buffers(self) -> None:
        self.cos_sin.copy_(self.config.rope_cos_sin())

    def refresh_derived(self) -> None:
        """Nothing is derived from the weights (no folded routers)."""

    def decode_input_norm(self) -> None:
        """No first-layer norm for the decode inputs launch to fold: it is zero-centered."""
        return None

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = batch.input_embeds if batch.input_embeds is not None else self.embed_tokens(batch.input_ids)
        out, residual = LayerOut(x), None
        for layer in self.layers:
            out, residual = layer(out, residual, batch, self.cos_sin)  # [T, H] parts, [T, H]
        assert residual is not None
        rows = batch.logits_indices
        if batch.keep_hidden:  # every token's normed hidden state, for MTP drafting
            x = batch.hidden = self.norm.forward_add(out, residual, batch.kernels)[0]
            if rows is not None:
                x = x.index_select(0, rows)
            return ops.linear_fp32(batch.kernels, x, self.lm_head_weight())
        if rows is not None and not (batch.is_decode and rows.shape[0] == residual.shape[0]):
            # The norm is per row: select first. A decode batch's rows are all of them, in order.
            out, residual = out.rows(rows), residual.index_select(0, rows)  # [B, H] each
        x, _ = self.norm.forward_add(out, residual, batch.kernels)
        return ops.linear_fp32(batch.kernels, x, self.lm_head_weight())  # [B or T, V] fp32

    def ignorable_checkpoint_names(self) -> set[str]:
        return {"lm_head.weight"} if self.lm_head is None else set()

    def checkpoint_targets(self) -> dict[str, Target]:
        """HF tensor name -> destination, for every tensor the checkpoint must provide."""
        t: dict[str, Target] = {"model.embed_tokens.weight": Target("embed_tokens.weight")}
        for i, layer in enumerate(self.layers):
            t.update(self._layer_targets(f"model.layers.{i}", f"layers.{i}", layer))
        t["model.norm.weight"] = Target("norm.weight")
        if self.lm_head is not None:
            t["lm_head.weight"] = Target("lm_head.weight")
        if self.mtp is not None:
            t.update(self.mtp.checkpoint_targets(self._layer_targets))
        return t

    def _layer_targets(self, hf: str, me: str, layer: nn.Module) -> dict[str, Target]:
        """One decoder layer's tensors: HF prefix ``hf``, ours ``me``."""
        assert isinstance(layer, Qwen3NextDecoderLayer)
        t: dict[str, Target] = {}
        for norm in ("input_layernorm", "post_attention_layernorm"):
            t[f"{hf}.{norm}.weight"] = Target(f"{me}.{norm}.weight")
        if layer.self_attn is not None:
            t.update(self._attention_targets(f"{hf}.self_attn", f"{me}.self_attn"))
        else:
            t.update(self._linear_targets(f"{hf}.linear_attn", f"{me}.linear_attn"))
        if isinstance(layer.mlp, SharedExpertMoE):
            t.update(self._moe_targets(f"{hf}.mlp", f"{me}.mlp"))
        else:
            t.update(_mlp_targets(f"{hf}.mlp", f"{me}.mlp", self.config.intermediate_size))
        return t

    def _attention_targets(self, hf: str, me: str) -> dict[str, Target]:
        cfg = self.config
        q2, kv = 2 * cfg.q_size, cfg.kv_size
        rows = {"q_proj": slice(0, q2), "k_proj": slice(q2, q2 + kv), "v_proj": slice(q2 + kv, q2 + 2 * kv)}
        t: dict[str, Target] = {}
        for name, sl in rows.items():
            for kind in ["weight"] + (["bias"] if cfg.qkv_bias else []):
                t[f"{hf}.{name}.{kind}"] = Target(f"{me}.qkv_proj.{kind}", (sl,))
        for kind in ["weight"] + (["bias"] if cfg.o_bias else []):
            t[f"{hf}.o_proj.{kind}"] = Target(f"{me}.o_proj.{kind}")
        t[f"{hf}.q_norm.weight"] = Target(f"{me}.q_norm.weight")
        t[f"{hf}.k_norm.weight"] = Target(f"{me}.k_norm.weight")
        return t

    def _linear_targets(self, hf: str, me: str) -> dict[str, Target]:
        la = self.config.linear_attn
        assert la is not None
        qkvz = 2 * la.key_dim + 2 * la.value_dim
        return {
            f"{hf}.in_proj_qkvz.weight": Target(f"{me}.in_proj.weight", (slice(0, qkvz),)),
            f"{hf}.in_proj_ba.weight": Target(f"{me}.in_proj.weight", (slice(qkvz, qkvz + 2 * la.num_value_heads),)),
            f"{hf}.conv1d.weight": Target(f"{me}.conv1d_weight"),
            f"{hf}.A_log": Target(f"{me}.A_log"),
            f"{hf}.dt_bias": Target(f"{me}.dt_bias"),
            f"{hf}.norm.weight": Target(f"{me}.norm.weight"),
            f"{hf}.out_proj.weight": Target(f"{me}.out_proj.weight"),
        }

    def _moe_targets(self, hf: str, me: str) -> dict[str, Target]:
        cfg = self.config
        inter = cfg.moe_intermediate_size
        t = {f"{hf}.gate.weight": Target(f"{me}.gate.weight"),
             f"{hf}.shared_expert_gate.weight": Target(f"{me}.shared_expert_gate.weight")}
        t.update(_mlp_targets(f"{hf}.shared_expert", f"{me}.shared_expert", cfg.shared_expert_intermediate_size))
        for e in range(cfg.num_experts):
            ex = f"{hf}.experts.{e}"
            t[f"{ex}.gate_proj.weight"] = Target(f"{me}.w13", (e, slice(0, inter)))
            t[f"{ex}.up_proj.weight"] = Target(f"{me}.w13", (e, slice(inter, 2 * inter)))
            t[f"{ex}.down_proj.weight"] = Target(f"{me}.w2", (e,))
        return t


class Qwen3NextMTP(MTPHead):
    """Qwen3-Next's MTP layers: zero-centered norms, and full-attention decoder
    layers with the shared-expert MoE block; the attention of MTP layer j is KV
    pool layer len(kv_layers) + j."""

    def __init__(self, cfg: ModelConfig, num_layers: int, dtype: torch.dtype) -> None:
        n = cfg.num_layers
        ext = dataclasses.replace(
            cfg, num_layers=n + num_layers, layer_types=cfg.layer_types + (FULL_ATTENTION,) * num_layers,
            sparse_layers=cfg.sparse_layers + (cfg.num_experts > 0,) * num_layers)
        layers = [Qwen3NextDecoderLayer(ext, n + j, dtype) for j in range(num_layers)]
        super().__init__(cfg.hidden_size, layers,
                         lambda: ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype), dtype)

    def normalize(self, norm: nn.Module, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return norm(x, batch.kernels)  # type: ignore[no-any-return]

    def block(self, layer: nn.Module, x: torch.Tensor, batch: ForwardBatch,
              cos_sin: torch.Tensor) -> torch.Tensor:
        assert isinstance(self.norm, ZeroCenteredRMSNorm)
        out, residual = layer(LayerOut(x), None, batch, cos_sin)
        return self.norm.forward_add(out, residual, batch.kernels)[0]


def _mlp_targets(hf: str, me: str, inter: int) -> dict[str, Target]:
    """A gated MLP (DenseMLP: gate and up fused)."""
    return {
        f"{hf}.gate_proj.weight": Target(f"{me}.gate_up_proj.weight", (slice(0, inter),)),
        f"{hf}.up_proj.weight": Target(f"{me}.gate_up_proj.weight", (slice(inter, 2 * inter),)),
        f"{hf}.down_proj.weight": Target(f"{me}.down_proj.weight"),
    }

