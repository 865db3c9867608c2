"""Architecture name (config.json "architectures") -> model class.

The families share one decoder (decoder.py); these classes only name what
differs in the checkpoint. Layer-level differences (q/k/v bias, q/k norm,
MoE placement, top-k renormalization) come from ModelConfig flags.
"""

from __future__ import annotations

from ftserve.models.config import SUPPORTED_ARCHITECTURES, UnsupportedModelError
from ftserve.models.decoder import DecoderForCausalLM
from ftserve.models.qwen3_next import Qwen3NextForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama and Mistral (Mistral's sliding window caps the context, see ModelConfig)."""


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Llama layout with q/k/v bias (ModelConfig.qkv_bias)."""


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Llama layout with per-head RMSNorm on q and k before rope (ModelConfig.qk_norm)."""


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    """Qwen3 attention; MoE on the layers ModelConfig.sparse_layers marks, router
    renormalized when norm_topk_prob. Experts: mlp.experts.<e>.{gate,up,down}_proj."""


class MixtralForCausalLM(DecoderForCausalLM):
    """Every layer MoE, top-k always renormalized. Experts:
    block_sparse_moe.experts.<e>.{w1 (gate), w3 (up), w2 (down)}."""

    moe_prefix = "block_sparse_moe"
    expert_names = ("w1", "w3", "w2")


# Hybrids are their own module classes with DecoderForCausalLM's interface
# (forward(batch), checkpoint_targets, init_buffers, refresh_derived).
CausalLM = DecoderForCausalLM | Qwen3NextForCausalLM

_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
}
assert tuple(_REGISTRY) == SUPPORTED_ARCHITECTURES


def model_class(architecture: str) -> type[CausalLM]:
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise UnsupportedModelError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(_REGISTRY)}"
        ) from None
