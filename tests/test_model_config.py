"""ModelConfig normalization, rope tables against transformers, real-shape presets."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from ftserve.models.checkpoint import preset_config, tensor_shapes
from ftserve.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModelError
from ftserve.models.registry import model_class


def test_families_normalize() -> None:
    llama = ModelConfig.from_hf(preset_config("tiny-dense"))
    assert (llama.head_dim, llama.num_heads, llama.num_kv_heads) == (16, 4, 2)
    assert not llama.qkv_bias and not llama.qk_norm and not llama.is_moe
    qwen2 = ModelConfig.from_hf(preset_config("tiny-qwen2"))
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.tie_word_embeddings
    qwen3 = ModelConfig.from_hf(preset_config("tiny-qwen3"))
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.q_size == 128  # explicit head_dim
    moe = ModelConfig.from_hf(preset_config("tiny-moe"))
    assert moe.is_moe and moe.num_experts == 16 and moe.num_experts_per_tok >= 2 and moe.norm_topk_prob
    mixtral = ModelConfig.from_hf(preset_config("tiny-mixtral", overrides={"norm_topk_prob": False}))
    assert mixtral.norm_topk_prob  # Mixtral always renormalizes
    assert mixtral.moe_intermediate_size == mixtral.intermediate_size == 128
    assert mixtral.sparse_layers == (True, True)


def test_qwen3_moe_sparse_layer_placement() -> None:
    hf = preset_config("tiny-moe", layers=6, overrides={"decoder_sparse_step": 2, "mlp_only_layers": [3]})
    cfg = ModelConfig.from_hf(hf)
    # sparse where (i + 1) % step == 0 and i not in mlp_only_layers
    assert cfg.sparse_layers == (False, True, False, False, False, True)


def test_unknown_architecture_names_supported_ones() -> None:
    hf = preset_config("tiny-dense", overrides={"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(UnsupportedModelError) as e:
        ModelConfig.from_hf(hf)
    assert "GPT2LMHeadModel" in str(e.value)
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(e.value)
    with pytest.raises(UnsupportedModelError, match="MixtralForCausalLM"):
        model_class("FalconForCausalLM")
    with pytest.raises(ValueError, match="longrope"):
        ModelConfig.from_hf(preset_config("tiny-dense", overrides={"rope_scaling": {"rope_type": "longrope"}}))


def test_legacy_and_v5_rope_keys_agree() -> None:
    legacy = preset_config("tiny-dense", overrides={"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2}})
    v5 = preset_config("tiny-dense", overrides={"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}})
    v5.pop("rope_theta")
    a, b = ModelConfig.from_hf(legacy), ModelConfig.from_hf(v5)
    assert a.rope_theta == b.rope_theta == 5e5
    assert a.rope_scaling == b.rope_scaling and a.rope_scaling.rope_type == "linear"


def test_context_limits() -> None:
    dense = ModelConfig.from_hf(preset_config("tiny-dense"))
    assert dense.max_context_len == 4096 and dense.rope_cos_sin().shape == (4096, 16)
    dyn = ModelConfig.from_hf(preset_config("tiny-dense", overrides={"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}))
    assert dyn.max_context_len == 8192
    assert dyn.with_max_len(100).max_context_len == 100
    with pytest.raises(ValueError, match="max_model_len"):
        dense.with_max_len(5000)
    windowed = ModelConfig.from_hf(preset_config("tiny-mistral", overrides={"sliding_window": 1024}))
    assert windowed.max_context_len == 1024  # full attention is exact only within the window
    # Mistral's HF default window applies when the key is absent
    hf = preset_config("tiny-mistral")
    del hf["sliding_window"]
    assert ModelConfig.from_hf(hf).sliding_window == 4096


ROPE = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    "yarn_attention_factor": {"rope_type": "yarn", "factor": 2.0, "attention_factor": 0.8,
                              "original_max_position_embeddings": 1024, "truncate": False},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024},
}


@pytest.mark.parametrize("kind", list(ROPE))
def test_rope_table_matches_transformers(kind: str) -> None:
    """Within max_position_embeddings (dynamic: the original context) the table equals HF's cos/sin."""
    mpe, head_dim = 2048, 64
    hf_cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=mpe,
                         rope_theta=500000.0, rope_scaling=ROPE[kind])
    rotary = LlamaRotaryEmbedding(hf_cfg)
    pos = torch.arange(mpe)[None]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), pos)  # [1, L, D]
    ours = ModelConfig.from_hf(preset_config("tiny-dense", overrides={
        "hidden_size": 256, "head_dim": head_dim, "max_position_embeddings": mpe, "rope_theta": 500000.0,
        "rope_scaling": ROPE[kind]}))
    if kind == "dynamic":
        ours = ours.with_max_len(mpe)
    table = ours.rope_cos_sin()  # [L, D]
    half = head_dim // 2
    assert table.shape == (mpe, head_dim)
    torch.testing.assert_close(table[:, :half], cos[0, :, :half], rtol=0, atol=1e-6)
    torch.testing.assert_close(table[:, half:], sin[0, :, :half], rtol=0, atol=1e-6)
    if kind != "default":
        plain = ModelConfig.from_hf(preset_config("tiny-dense", overrides={
            "hidden_size": 256, "head_dim": head_dim, "max_position_embeddings": mpe, "rope_theta": 500000.0}))
        differs = (plain.rope_cos_sin() - table).abs().max().item() > 1e-3
        assert differs == (kind != "dynamic")  # dynamic within the original context is unscaled


def test_dynamic_table_scales_for_its_length() -> None:
    """A dynamic table longer than the original context uses the NTK base for that length."""
    cfg = ModelConfig.from_hf(preset_config("tiny-dense", overrides={
        "max_position_embeddings": 1024, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}))
    table = cfg.rope_cos_sin()  # [4096, 16]
    base = 10000.0 * (4.0 * 4096 / 1024 - 3.0) ** (16 / 14)
    inv = 1.0 / (base ** (torch.arange(0, 16, 2).float() / 16))
    torch.testing.assert_close(table[4095, :8], torch.cos(4095.0 * inv), rtol=0, atol=1e-5)


# Published totals: Qwen3-30B-A3B 30.5B (3.3B active), Qwen3-235B-A22B 235B (22B active), Mixtral 8x7B
# 46.7B (12.9B active), SmolLM2-135M 134.5M (dense, tied embeddings), Mistral-7B-v0.3 7.25B (dense)
REAL = {"qwen3-30b-a3b": (30.5e9, 3.3e9), "qwen3-235b-a22b": (235e9, 22e9), "mixtral-8x7b": (46.7e9, 12.9e9),
        "smollm2-135m": (134.5e6, 134.5e6), "mistral-7b-v0.3": (7.25e9, 7.25e9)}


@pytest.mark.parametrize("preset", list(REAL))
def test_real_shape_presets_have_published_sizes(preset: str) -> None:
    hf = preset_config(preset)
    cfg = ModelConfig.from_hf(hf)
    shapes = tensor_shapes(hf)  # built on the meta device: no memory
    total = sum(math.prod(s) for s in shapes.values())
    expert = sum(math.prod(s) for n, s in shapes.items() if ".experts." in n)
    active = total - expert + (expert * cfg.num_experts_per_tok / cfg.num_experts if expert else 0)
    want_total, want_active = REAL[preset]
    assert abs(total - want_total) / want_total < 0.01, total
    assert abs(active - want_active) / want_active < 0.03, active
    cut = ModelConfig.from_hf(preset_config(preset, layers=2))
    assert cut.num_layers == 2 and cut.hidden_size == cfg.hidden_size and cut.num_experts == cfg.num_experts
