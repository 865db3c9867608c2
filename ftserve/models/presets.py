"""Checkpoint presets for tools/make_model.py: HF config.json contents.

Tiny presets (hidden 64, vocab 32768 = the bundled Mistral v3 tokenizer) are
for tests and the demo model; ``num_nextn_predict_layers`` (set on
tiny-qwen3-next, or as an override / ``make_model.py --mtp`` on any preset)
makes a checkpoint ship that many MTP layers (models/mtp.py). Real-shape presets copy the published configs'
layer shapes exactly; cut depth with ``layers=``.
"""

from __future__ import annotations

from typing import Any

TOKENIZER_V3 = "mistral_instruct_tokenizer_240323.model.v3"  # vocab 32768
TOKENIZER_V1 = "tokenizer.model.v1"  # vocab 32000, the Mistral/Mixtral v0.1 tokenizer

_TINY_COMMON: dict[str, Any] = {
    "vocab_size": 32768,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "initializer_range": 0.02,
    "torch_dtype": "float32",
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny-dense": {
        **_TINY_COMMON,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "mlp_bias": False,
    },
    "tiny-mistral": {
        **_TINY_COMMON,
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "sliding_window": None,
    },
    "tiny-qwen2": {
        **_TINY_COMMON,
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "rope_theta": 1000000.0,
    },
    "tiny-qwen3": {
        **_TINY_COMMON,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "head_dim": 32,  # explicit, != hidden / heads, as in the real Qwen3 configs
        "attention_bias": False,
        "use_sliding_window": False,
        "rope_theta": 1000000.0,
    },
    "tiny-moe": {
        **_TINY_COMMON,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "head_dim": 32,
        "moe_intermediate_size": 32,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "attention_bias": False,
        "use_sliding_window": False,
        "rope_theta": 1000000.0,
    },
    "tiny-mixtral": {
        **_TINY_COMMON,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "sliding_window": None,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-5,
    },
    # Hybrid: linear (Gated DeltaNet) and full-attention layers alternate, so both
    # kinds (and the KV and state pools) appear at any depth of 2 or more; two key
    # heads serve four value heads (grouped, as in the real 16 / 32).
    "tiny-qwen3-next": {
        **_TINY_COMMON,
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "num_hidden_layers": 4,
        "head_dim": 32,
        "partial_rotary_factor": 0.25,
        "full_attention_interval": 2,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "attention_bias": False,
        "rope_theta": 10000000.0,
        # One MTP layer (mtp.*), as the published checkpoints ship.
        "num_nextn_predict_layers": 1,
    },
    # https://huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct/blob/main/config.json
    "qwen3-next-80b-a3b": {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 5120,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "partial_rotary_factor": 0.25,
        "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000000,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "initializer_range": 0.02,
        "router_aux_loss_coef": 0.001,
        "torch_dtype": "bfloat16",
    },
    # https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 48,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "initializer_range": 0.02,
        "torch_dtype": "bfloat16",
    },
    # https://huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json
    "qwen3-235b-a22b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "num_hidden_layers": 94,
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 94,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "initializer_range": 0.02,
        "torch_dtype": "bfloat16",
    },
    # https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct/blob/main/config.json
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "initializer_range": 0.041666666666666664,
        "torch_dtype": "bfloat16",
    },
    # https://huggingface.co/mistralai/Mistral-7B-Instruct-v0.3/blob/main/config.json: a
    # 7B-class dense model (the decode GEMVs at 4096 x 14336; vocab = the v3 tokenizer's)
    "mistral-7b-v0.3": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "vocab_size": 32768,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "initializer_range": 0.02,
        "torch_dtype": "bfloat16",
    },
    # https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "router_aux_loss_coef": 0.02,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "initializer_range": 0.02,
        "torch_dtype": "bfloat16",
    },
}

# HF's fp8 releases (Qwen/Qwen3-30B-A3B-FP8 ...): e4m3 weights, fp32 scales per 128 x 128
# block. write_checkpoint lists modules_to_not_convert (lm_head, the routers) for the
# depth it writes, as those releases list them.
FP8_BLOCK_QUANT: dict[str, Any] = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "weight_block_size": [128, 128],
}

# Tiny fp8 presets: hidden 128 so the 128-column blocks are whole; q (4 x 32 rows) and
# k / v (2 x 32) fuse with part boundaries off the 128-row grid, and down_proj spans
# two column blocks. Every dimension is a multiple of 128 or below it: transformers'
# CPU dequantization derives the block from the scale grid's shape (192 rows in 2
# scale rows would be blocks of 96), which is right only then.
PRESETS["tiny-qwen3-fp8"] = {
    **PRESETS["tiny-qwen3"], "hidden_size": 128, "intermediate_size": 256,
    "quantization_config": FP8_BLOCK_QUANT,
}
PRESETS["tiny-moe-fp8"] = {
    **PRESETS["tiny-moe"], "hidden_size": 128, "moe_intermediate_size": 256,
    "quantization_config": FP8_BLOCK_QUANT,
}
# The published fp8 checkpoints' shapes.
PRESETS["qwen3-30b-a3b-fp8"] = {**PRESETS["qwen3-30b-a3b"], "quantization_config": FP8_BLOCK_QUANT}
PRESETS["qwen3-235b-a22b-fp8"] = {**PRESETS["qwen3-235b-a22b"], "quantization_config": FP8_BLOCK_QUANT}

# The tokenizer each preset ships with (vocab must not exceed the model's).
TOKENIZER_FOR: dict[str, str] = {"mixtral-8x7b": TOKENIZER_V1}
