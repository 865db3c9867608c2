"""ModelConfig: the HF ``config.json`` of a supported family, normalized once.

Everything the layers need is resolved here (head_dim, GQA, biases, q/k norm,
which layers are MoE, the rope table's length) so no model code reads the raw
HF dict. Family defaults are those of the transformers config classes, used
only when a key is absent from config.json.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ftserve.models.fp8_config import Fp8Config, parse_quantization
from ftserve.models.rope import RopeScaling, build_cos_sin

# architecture -> (model_type, per-family defaults for keys config.json may omit)
_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "LlamaForCausalLM": ("llama", {"rope_theta": 10000.0, "rms_norm_eps": 1e-6}),
    "MistralForCausalLM": ("mistral", {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "sliding_window": 4096}),
    "Qwen2ForCausalLM": ("qwen2", {"rope_theta": 10000.0, "rms_norm_eps": 1e-6}),
    "Qwen3ForCausalLM": ("qwen3", {"rope_theta": 10000.0, "rms_norm_eps": 1e-6}),
    "Qwen3MoeForCausalLM": ("qwen3_moe", {"rope_theta": 10000.0, "rms_norm_eps": 1e-6}),
    "MixtralForCausalLM": ("mixtral", {"rope_theta": 1e6, "rms_norm_eps": 1e-5}),
    # Hybrid: Gated DeltaNet (linear attention) layers among gated full-attention layers.
    "Qwen3NextForCausalLM": ("qwen3_next", {"rope_theta": 10000.0, "rms_norm_eps": 1e-6,
                                            "partial_rotary_factor": 0.25}),
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_FAMILIES)


class UnsupportedModelError(ValueError):
    pass


FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"


@dataclass(frozen=True)
class LinearAttentionConfig:
    """The Gated DeltaNet layers of a hybrid model (Qwen3-Next's ``linear_*`` keys).

    Each value head h reads key head h // (num_value_heads // num_key_heads). The
    short causal conv runs over the concatenated q | k | v channels (conv_dim).
    """

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @staticmethod
    def from_hf(hf: dict[str, Any]) -> LinearAttentionConfig:
        # Defaults: those of transformers' Qwen3NextConfig.
        la = LinearAttentionConfig(
            num_key_heads=int(hf.get("linear_num_key_heads", 16)),
            num_value_heads=int(hf.get("linear_num_value_heads", 32)),
            key_head_dim=int(hf.get("linear_key_head_dim", 128)),
            value_head_dim=int(hf.get("linear_value_head_dim", 128)),
            conv_kernel=int(hf.get("linear_conv_kernel_dim", 4)),
        )
        if la.num_value_heads % la.num_key_heads:
            raise ValueError(f"linear_num_value_heads {la.num_value_heads} is not a multiple of "
                             f"linear_num_key_heads {la.num_key_heads}")
        if la.conv_kernel < 2:
            raise ValueError(f"linear_conv_kernel_dim must be at least 2, got {la.conv_kernel}")
        return la


def _layer_types(hf: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """Explicit ``layer_types``, else every ``full_attention_interval``-th layer is
    full attention (transformers' rule, interval 4 by default)."""
    types = hf.get("layer_types")
    if types is None:
        interval = int(hf.get("full_attention_interval", 4))
        types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)]
    types = tuple(str(t) for t in types)
    if len(types) != num_layers or not set(types) <= {FULL_ATTENTION, LINEAR_ATTENTION}:
        raise ValueError(f"layer_types must list {num_layers} entries of {FULL_ATTENTION!r} / "
                         f"{LINEAR_ATTENTION!r}, got {list(types)}")
    return types


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP width (dense layers of an MoE model too)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: RopeScaling
    rotary_dim: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before rope
    # Full attention equals sliding-window attention while a sequence fits the
    # window, so a windowed model is served up to its window (see max_context_len).
    sliding_window: int | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    sparse_layers: tuple[bool, ...] = ()  # per layer: MoE block (True) or dense MLP
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    checkpoint_dtype: str | None = None
    max_len_override: int | None = None  # set through with_max_len()
    # Hybrids: per layer FULL_ATTENTION or LINEAR_ATTENTION; () = every layer full attention.
    layer_types: tuple[str, ...] = ()
    linear_attn: LinearAttentionConfig | None = None
    shared_expert_intermediate_size: int = 0  # MoE layers' always-on expert (0: none)
    quant: Fp8Config | None = None  # an fp8 checkpoint's quantization_config (fp8_config.py)
    # Multi-token-prediction layers the config declares (num_nextn_predict_layers);
    # the checkpoint's mtp.* tensors are what counts (loader.mtp_layers).
    num_mtp_layers: int = 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return any(self.sparse_layers)

    @property
    def is_hybrid(self) -> bool:
        return LINEAR_ATTENTION in self.layer_types

    def is_full_attention(self, layer: int) -> bool:
        return not self.layer_types or self.layer_types[layer] == FULL_ATTENTION

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that keep K/V in the paged pool; pool layer j is kv_layers[j]."""
        return tuple(i for i in range(self.num_layers) if self.is_full_attention(i))

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The layers that keep a recurrent state; state-pool layer j is linear_layers[j]."""
        return tuple(i for i in range(self.num_layers) if not self.is_full_attention(i))

    @property
    def natural_max_len(self) -> int:
        """The longest single request the checkpoint supports."""
        limit = self.max_position_embeddings
        if self.rope_scaling.rope_type == "dynamic":
            assert self.rope_scaling.factor is not None
            limit = int(self.max_position_embeddings * self.rope_scaling.factor)
        if self.sliding_window is not None:
            limit = min(limit, self.sliding_window)
        return limit

    @property
    def max_context_len(self) -> int:
        """Single-request limit = rope table length. Positions past it would read
        outside the table, so the engine must refuse longer requests."""
        return self.max_len_override or self.natural_max_len

    def with_max_len(self, max_len: int) -> ModelConfig:
        if not 0 < max_len <= self.natural_max_len:
            raise ValueError(
                f"max_model_len {max_len} must be in [1, {self.natural_max_len}] for this checkpoint"
            )
        return dataclasses.replace(self, max_len_override=max_len)

    def rope_cos_sin(self) -> torch.Tensor:
        """[max_context_len, rotary_dim] fp32 on the CPU (cos | sin halves)."""
        return build_cos_sin(
            self.rope_scaling, self.rope_theta, self.rotary_dim,
            self.max_position_embeddings, self.max_context_len,
        )

    @staticmethod
    def from_hf(hf: dict[str, Any]) -> ModelConfig:
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in _FAMILIES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or hf.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        model_type, defaults = _FAMILIES[arch]
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only silu)")

        hidden = int(hf["hidden_size"])
        heads = int(hf["num_attention_heads"])
        kv_heads = int(hf.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        head_dim = int(hf.get("head_dim") or hidden // heads)
        mpe = int(hf.get("max_position_embeddings", 2048))
        rope_params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = float(rope_params.get("rope_theta", hf.get("rope_theta", defaults["rope_theta"])))
        partial = float(rope_params.get("partial_rotary_factor",
                                        hf.get("partial_rotary_factor", defaults.get("partial_rotary_factor", 1.0))))
        num_layers = int(hf["num_hidden_layers"])

        attn_bias = bool(hf.get("attention_bias", False))
        qkv_bias, o_bias = attn_bias, attn_bias
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False  # Qwen2 always has q/k/v bias, never o bias

        window: int | None = None
        if model_type in ("mistral", "mixtral"):
            window = hf.get("sliding_window", defaults.get("sliding_window"))
        elif model_type.startswith("qwen") and hf.get("use_sliding_window", False):
            window = hf.get("sliding_window")

        moe: dict[str, Any] = {}
        if model_type in ("qwen3_moe", "qwen3_next"):
            num_experts = int(hf.get("num_experts", 0))
            step = int(hf.get("decoder_sparse_step", 1))
            dense_only = set(hf.get("mlp_only_layers") or [])
            sparse = tuple(
                i not in dense_only and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers)
            )
            moe = dict(
                num_experts=num_experts,
                num_experts_per_tok=int(hf["num_experts_per_tok"]),
                moe_intermediate_size=int(hf["moe_intermediate_size"]),
                norm_topk_prob=bool(hf.get("norm_topk_prob", model_type == "qwen3_next")),  # HF defaults
                sparse_layers=sparse,
            )
        elif model_type == "mixtral":
            moe = dict(
                num_experts=int(hf["num_local_experts"]),
                num_experts_per_tok=int(hf["num_experts_per_tok"]),
                moe_intermediate_size=int(hf["intermediate_size"]),
                norm_topk_prob=True,  # Mixtral always renormalizes the top-k weights
                sparse_layers=(True,) * num_layers,
            )
        else:
            moe = dict(sparse_layers=(False,) * num_layers)
        hybrid: dict[str, Any] = {}
        if model_type == "qwen3_next":
            hybrid = dict(
                layer_types=_layer_types(hf, num_layers),
                linear_attn=LinearAttentionConfig.from_hf(hf),
                shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size", 0)),
            )

        eos = hf.get("eos_token_id")
        eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return ModelConfig(
            architecture=arch,
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf.get("intermediate_size", 0)),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", defaults["rms_norm_eps"])),
            max_position_embeddings=mpe,
            rope_theta=theta,
            rope_scaling=RopeScaling.from_hf(rope_params, mpe),
            rotary_dim=int(head_dim * partial),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            sliding_window=None if window is None else int(window),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            checkpoint_dtype=hf.get("torch_dtype") or hf.get("dtype"),
            quant=parse_quantization(hf),
            num_mtp_layers=int(hf.get("num_nextn_predict_layers") or 0),
            **moe,
            **hybrid,
        )

    @staticmethod
    def from_pretrained(model_dir: str | Path) -> ModelConfig:
        """From an HF checkpoint directory's config.json, or a GGUF's metadata."""
        from ftserve.models import gguf

        if gguf.is_gguf(model_dir):
            return gguf.model_config(model_dir)
        path = Path(model_dir) / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: a model directory needs an HF config.json "
                                    "(or pass a .gguf file)")
        return ModelConfig.from_hf(json.loads(path.read_text()))
