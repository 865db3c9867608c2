"""The generic pre-norm decoder shared by every supported family.

Family differences are flags on ModelConfig (biases, q/k norm, which layers
are MoE) plus the checkpoint names of the MoE block, which the thin family
classes in registry.py set. The checkpoint map below is the single place that
knows how HF tensor names land in our (fused) parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ftserve.models.config import ModelConfig
from ftserve.models.forward_batch import ForwardBatch
from ftserve.models.layers import Attention, DenseMLP, Embedding, Linear, MoEBlock, RMSNorm
from ftserve_kernels import ops
from ftserve_kernels.config import KernelConfig
from ftserve_kernels.decode_inputs import InputNorm
from ftserve_kernels.oproj_route_triton import FoldedRouter, fold_router, fold_versions

Index = tuple[int | slice, ...]


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: ``param[index]`` (a view of a fused param)."""

    param: str
    index: Index = ()


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(
            layer_idx, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.qkv_bias, cfg.o_bias, cfg.qk_norm, cfg.rms_norm_eps, dtype,
        )
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.mlp: DenseMLP | MoEBlock
        if cfg.sparse_layers[layer_idx]:
            self.mlp = MoEBlock(
                layer_idx, h, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                cfg.norm_topk_prob, dtype,
            )
        else:
            self.mlp = DenseMLP(h, cfg.intermediate_size, cfg.mlp_bias, dtype)
        self._folded: FoldedRouter | None = None  # folded_router()

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, cos_sin: torch.Tensor,
        normed: bool | ops.PendingNorm = False, next_norm: RMSNorm | None = None, defer: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, bool | ops.PendingNorm]:
        """-> (x, residual, normed): the block's output and the running sum; with
        ``normed`` (in or out) x is already ``norm(x' + residual)``, the norm
        after the layer (``next_norm``: the next layer's input norm or the final
        one) having been folded into the layer before's last launch. ``defer``
        (next_norm is a layer's, whose qkv can apply it): the norm may come out
        pending instead, an ops.PendingNorm with x = residual = the sum."""
        kernels = batch.kernels
        if isinstance(self.mlp, DenseMLP):
            return self._dense(x, residual, batch, cos_sin, normed, next_norm, defer)
        if next_norm is not None and self._routes_in_oproj(x, kernels):
            # One decode row: o_proj also routes, the experts weigh (no route launch).
            a, summed = self.self_attn.forward_norm(x, residual, self.input_layernorm, batch, cos_sin,
                                                    normed=normed, project=False)
            folded = self.folded_router()
            if folded is not None:
                assert isinstance(self.mlp, MoEBlock)
                o_proj, post = self.self_attn.o_proj, self.post_attention_layernorm
                route = ops.oproj_route(kernels, a, o_proj.w, o_proj.bias, summed, post.weight, folded,
                                        self.mlp.top_k, self.mlp._counter(a))
                out, summed = self.mlp.compute_experts_routed(route, post.eps, next_norm, kernels, defer)
                if isinstance(out, ops.PendingNorm):
                    return summed, summed, out
                return out, summed, True
            x, residual = ops.linear(kernels, a, self.self_attn.o_proj.w, self.self_attn.o_proj.bias), summed
        else:
            # The residual stream is carried separately so each norm fuses the add (and,
            # at decode sizes, folds into the next GEMV: see ops.add_rms_norm_linear).
            x, residual = self.self_attn.forward_norm(x, residual, self.input_layernorm, batch, cos_sin,
                                                      normed=normed)
        assert isinstance(self.mlp, MoEBlock)
        # Norm, router and top-k in one launch at decode sizes (see MoEBlock.norm_route).
        x, summed, weights, ids = self.mlp.norm_route(x, residual, self.post_attention_layernorm, kernels)
        assert summed is not None
        if next_norm is not None and self.mlp.folds_next_norm(x, kernels):
            out, summed = self.mlp.compute_experts_norm(x, weights, ids, summed, next_norm, kernels, defer)
            if isinstance(out, ops.PendingNorm):
                return summed, summed, out
            return out, summed, True
        return self.mlp.compute_experts(x, weights, ids, kernels, batch.valid_tokens), summed, False

    def _dense(
        self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, cos_sin: torch.Tensor,
        normed: bool | ops.PendingNorm, next_norm: RMSNorm | None, defer: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, bool | ops.PendingNorm]:
        """forward for a dense MLP. At decode sizes (ops.dense_folds_norm) each norm
        is left pending by the GEMV before it and applied by the GEMV after it::

            qkv GEMV (input norm) -> attention -> o_proj GEMV + residual (post norm
            pending) -> gate/up GEMV (post norm, SiLU * up) -> down GEMV + residual
            (with ``defer``: next_norm pending, for the next layer's qkv)

        elsewhere the unfused composition with the same results."""
        kernels, attn, post = batch.kernels, self.self_attn, self.post_attention_layernorm
        a, summed = attn.forward_norm(x, residual, self.input_layernorm, batch, cos_sin, normed=normed,
                                      project=False)  # [T, q]
        h, residual = ops.linear_add_rms_norm(kernels, a, attn.o_proj.w, attn.o_proj.bias, summed, post.weight,
                                              post.eps)
        assert isinstance(self.mlp, DenseMLP)
        if next_norm is not None and defer and ops.dense_folds_norm(kernels, a):
            out, summed = self.mlp.forward_add_norm(h, residual, next_norm, kernels, post.eps)
            if isinstance(out, ops.PendingNorm):
                return summed, summed, out
            return out, summed, True
        return self.mlp(h, kernels, post.eps), residual, False

    def router_foldable(self) -> bool:
        """A resident MoE layer whose expert weights are the softmax of the chosen
        logits: its o_proj can route (folded_router), in bf16 or fp8 (o_proj,
        experts, or both)."""
        mlp = self.mlp
        return isinstance(mlp, MoEBlock) and mlp.renormalize and mlp.expert_compute is None

    def _routes_in_oproj(self, x: torch.Tensor, kernels: KernelConfig) -> bool:
        return (self.router_foldable() and not self.mlp.observed()  # type: ignore[union-attr]
                and ops.oproj_route_applies(kernels, x))

    def folded_router(self) -> FoldedRouter | None:
        """The router folded through o_proj and the post-attention norm
        (oproj_route_triton.fold_router), folded again when a weight changed;
        None while a CUDA graph is being captured and there is none yet (the
        capture's warm-up runs fold it first)."""
        assert isinstance(self.mlp, MoEBlock)
        # An fp8 o_proj folds dequantized (its codes and scales both versioned).
        ws = (self.mlp.gate.weight, self.post_attention_layernorm.weight, self.self_attn.o_proj.w)
        bias = self.self_attn.o_proj.bias
        f = self._folded
        if f is None or f.versions != fold_versions(*ws, bias):
            if ws[0].is_cuda and torch.cuda.is_current_stream_capturing():
                return None
            with torch.no_grad():
                new = fold_router(*ws, bias)
                if f is not None:  # in place: captured graphs read these tensors
                    f.r_o.copy_(new.r_o)
                    f.r_r.copy_(new.r_r)
                    if f.r_b is not None:  # o_proj has a bias (then both have one)
                        f.r_b.copy_(new.r_b)
                    new = FoldedRouter(f.r_o, f.r_r, f.r_b, new.versions)
                f = self._folded = new
        return f


class DecoderForCausalLM(nn.Module):
    """model(batch) -> logits [rows, vocab] fp32: rows = batch.logits_indices, or every token."""

    # HF names of the MoE block: "<prefix>.gate.weight", "<prefix>.experts.<e>.<name>.weight"
    moe_prefix = "mlp"
    expert_names = ("gate_proj", "up_proj", "down_proj")  # gate, up, down
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, False, dtype)
        self.mtp: nn.Module | None = None  # attach_mtp (--speculative mtp)
        # Filled by init_buffers() after materialization; fp32 whatever the model dtype.
        self.register_buffer(
            "cos_sin", torch.empty(cfg.max_context_len, cfg.rotary_dim, dtype=torch.float32), persistent=False
        )

    def attach_mtp(self, num_layers: int) -> None:
        """Build the checkpoint's MTP layers (models/mtp.py) beside the model, before
        it is materialized: they load from its ``mtp.*`` tensors."""
        from ftserve.models.mtp import DecoderMTP

        self.mtp = DecoderMTP(self.config, num_layers, self.embed_tokens.weight.dtype)

    @property
    def ignorable_prefixes(self) -> tuple[str, ...]:
        """Checkpoint tensors under these name prefixes are skipped at load: MTP
        layers the model was built without."""
        return () if self.mtp is not None else ("mtp.",)

    def lm_head_weight(self) -> torch.Tensor:
        """[V, H]: the lm_head's weight (the embedding's when tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.no_grad()
    def init_buffers(self) -> None:
        self.cos_sin.copy_(self.config.rope_cos_sin())
        # Weights loaded into the model afterwards refresh what is derived from them.
        self.register_load_state_dict_post_hook(lambda module, keys: module.refresh_derived())

    def refresh_derived(self) -> None:
        """Derive again, in place, the tensors computed from the weights (the
        routers folded through o_proj), for the layers that route so; and fold them first where none is yet (at load,
        so memory planning counts them). Call after changing weights in place
        once CUDA graphs are captured: the graphs read these tensors, and only
        an eager step would notice the change by itself."""
        for layer in self.layers:
            if layer.router_foldable():
                layer.folded_router()

    def decode_input_norm(self) -> InputNorm | None:
        """The first layer's input norm, for a decode step to apply where it
        gathers the embedding rows (ops.decode_inputs in the graph, embed_rms_norm
        eagerly): layer 0 then starts from a normed x, as the later layers do at
        decode sizes, and its qkv is a plain GEMV. None without layers."""
        if not len(self.layers):
            return None
        norm = self.layers[0].input_layernorm
        return InputNorm(norm.weight, norm.eps)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x, normed_in = batch.input_embeds, batch.input_normed  # [T, H] each, or None
        if x is None:
            first = self.decode_input_norm() if batch.is_decode else None
            if first is not None:
                x, normed_in = ops.embed_rms_norm(batch.kernels, batch.input_ids, self.embed_tokens.weight,
                                                  first)
            else:
                x = self.embed_tokens(batch.input_ids)
        residual: torch.Tensor | None = None
        normed = False
        if normed_in is not None:  # layer 0's input norm is applied: x is the residual stream
            x, residual, normed = normed_in, x, True
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            # Where the layer can, it applies the norm after it (the next layer's, or
            # the final one) in its last launch: x then arrives normed.
            after = self.layers[i + 1].input_layernorm if i + 1 < n else self.norm
            x, residual, normed = layer(x, residual, batch, self.cos_sin, normed, after, defer=i + 1 < n)
        assert residual is not None
        rows = batch.logits_indices
        if batch.keep_hidden:  # every token's normed hidden state, for MTP drafting
            if not normed:
                x, _ = self.norm.forward_add(x, residual, batch.kernels)
                normed = True
            batch.hidden = x  # [T, H]
        if rows is not None and not (batch.is_decode and rows.shape[0] == x.shape[0]):
            # Norm is per row, so selecting first skips the norm of unused rows. A decode
            # batch whose every token is a logits row selects all of them in order (the
            # last token of each one-token sequence): skip the two gathers.
            x = x.index_select(0, batch.logits_indices)  # [B, H]
            if not normed:
                residual = residual.index_select(0, batch.logits_indices)
        if not normed:
            x, _ = self.norm.forward_add(x, residual, batch.kernels)
        return ops.linear_fp32(batch.kernels, x, self.lm_head_weight())  # [B or T, V] fp32

    def ignorable_checkpoint_names(self) -> set[str]:
        """Tensors a checkpoint may carry that we do not load."""
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
            t.update(self.mtp.checkpoint_targets(self._layer_targets))  # type: ignore[operator]
        return t

    def _layer_targets(self, hf: str, me: str, layer: nn.Module) -> dict[str, Target]:
        """One decoder layer's tensors: HF prefix ``hf``, ours ``me``."""
        cfg = self.config
        q, kv = cfg.q_size, cfg.kv_size
        t: dict[str, Target] = {}
        t[f"{hf}.input_layernorm.weight"] = Target(f"{me}.input_layernorm.weight")
        t[f"{hf}.post_attention_layernorm.weight"] = Target(f"{me}.post_attention_layernorm.weight")
        parts = {"q_proj": slice(0, q), "k_proj": slice(q, q + kv), "v_proj": slice(q + kv, q + 2 * kv)}
        kinds = ["weight"] + (["bias"] if cfg.qkv_bias else [])
        for name, rows in parts.items():
            for kind in kinds:
                t[f"{hf}.self_attn.{name}.{kind}"] = Target(f"{me}.self_attn.qkv_proj.{kind}", (rows,))
        for kind in ["weight"] + (["bias"] if cfg.o_bias else []):
            t[f"{hf}.self_attn.o_proj.{kind}"] = Target(f"{me}.self_attn.o_proj.{kind}")
        if cfg.qk_norm:
            t[f"{hf}.self_attn.q_norm.weight"] = Target(f"{me}.self_attn.q_norm.weight")
            t[f"{hf}.self_attn.k_norm.weight"] = Target(f"{me}.self_attn.k_norm.weight")
        assert isinstance(layer, DecoderLayer)
        if isinstance(layer.mlp, MoEBlock):
            t.update(self._moe_targets(hf, me, cfg.num_experts, cfg.moe_intermediate_size))
        else:
            inter = cfg.intermediate_size
            for kind in ["weight"] + (["bias"] if cfg.mlp_bias else []):
                gu = f"{me}.mlp.gate_up_proj.{kind}"
                t[f"{hf}.mlp.gate_proj.{kind}"] = Target(gu, (slice(0, inter),))
                t[f"{hf}.mlp.up_proj.{kind}"] = Target(gu, (slice(inter, 2 * inter),))
                t[f"{hf}.mlp.down_proj.{kind}"] = Target(f"{me}.mlp.down_proj.{kind}")
        return t

    def _moe_targets(self, hf: str, me: str, num_experts: int, inter: int) -> dict[str, Target]:
        gate, up, down = self.expert_names
        base = f"{hf}.{self.moe_prefix}"
        t = {f"{base}.gate.weight": Target(f"{me}.mlp.gate.weight")}
        for e in range(num_experts):
            t[f"{base}.experts.{e}.{gate}.weight"] = Target(f"{me}.mlp.w13", (e, slice(0, inter)))
            t[f"{base}.experts.{e}.{up}.weight"] = Target(f"{me}.mlp.w13", (e, slice(inter, 2 * inter)))
            t[f"{base}.experts.{e}.{down}.weight"] = Target(f"{me}.mlp.w2", (e,))
        return t
