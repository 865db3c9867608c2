"""Tiny GGUF files for tests, written with ggml's own writer (gguf.GGUFWriter) from a
tiny safetensors checkpoint (ftserve.models.checkpoint.write_checkpoint), the way
llama.cpp's converter lays them out: GGUF tensor names, llama q/k rows permuted,
experts stacked into one tensor per layer, the sentencepiece vocabulary as
tokenizer.ggml.* metadata."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import sentencepiece as spm
import torch
from safetensors.torch import load_file

from ftserve.models.config import ModelConfig
from ftserve.models.gguf import _GLOBAL_NAMES, _LAYER_NAMES

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2",
             "qwen3": "qwen3", "qwen3_moe": "qwen3moe"}
_TO_GGUF_LAYER = {v: k for k, v in _LAYER_NAMES.items()}
_TO_GGUF_GLOBAL = {v: k for k, v in _GLOBAL_NAMES.items()}
_EXPERT_PART = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate",
                "w3": "up", "w2": "down"}

# (gguf name, float32 numpy array in HF layout) -> (array or raw bytes, raw dtype or None)
Encoder = Callable[[str, np.ndarray], tuple[np.ndarray, Any]]


def permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation of q/k rows (halves -> pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(ckpt: Path, per_expert: bool = False) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array (GGUF layout) for a safetensors checkpoint dir."""
    hf = json.loads((ckpt / "config.json").read_text())
    cfg = ModelConfig.from_hf(hf)
    arch = GGUF_ARCH[cfg.model_type]
    state: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        state.update(load_file(f))
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, t in state.items():
        w = t.float().numpy()
        if name in _TO_GGUF_GLOBAL:
            out[_TO_GGUF_GLOBAL[name]] = w
            continue
        parts = name.split(".")  # model.layers.N.<rest>
        layer, rest = int(parts[2]), ".".join(parts[3:])
        if rest in _TO_GGUF_LAYER:
            g = _TO_GGUF_LAYER[rest]
            if arch == "llama" and g.startswith("attn_q."):
                w = permute(w, cfg.num_heads)
            elif arch == "llama" and g.startswith("attn_k."):
                w = permute(w, cfg.num_kv_heads)
            out[f"blk.{layer}.{g}"] = w
        elif rest.endswith(".gate.weight"):
            out[f"blk.{layer}.ffn_gate_inp.weight"] = w
        else:  # <prefix>.experts.E.<part>.weight
            e, part = int(parts[-3]), _EXPERT_PART[parts[-2]]
            if per_expert:
                out[f"blk.{layer}.ffn_{part}.{e}.weight"] = w
            else:
                experts.setdefault((layer, part), {})[e] = w
    for (layer, part), ws in experts.items():
        out[f"blk.{layer}.ffn_{part}_exps.weight"] = np.stack([ws[e] for e in sorted(ws)])
    return out


def write_gguf(ckpt: Path, out: Path, *, encode: Encoder | None = None, per_expert: bool = False,
               split_max_tensors: int = 0, tokenizer: bool = True, arch: str | None = None,
               extra: dict[str, np.ndarray] | None = None) -> Path:
    """A GGUF of the checkpoint at ``ckpt``. ``encode`` picks each tensor's type (default
    F32); ``arch`` overrides general.architecture (to test an unknown one)."""
    hf = json.loads((ckpt / "config.json").read_text())
    cfg = ModelConfig.from_hf(hf)
    name = arch or GGUF_ARCH[cfg.model_type]
    w = gguf.GGUFWriter(out, name, split_max_tensors=split_max_tensors)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.rotary_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    if cfg.num_experts:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if cfg.model_type == "qwen3_moe":
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if tokenizer:
        add_sentencepiece_vocab(w, ckpt / "tokenizer.model")
        w.add_chat_template(json.loads((ckpt / "tokenizer_config.json").read_text())["chat_template"])
    tensors = gguf_tensors(ckpt, per_expert)
    tensors.update(extra or {})
    for tname, arr in tensors.items():
        data, raw = (encode or (lambda n, a: (a, None)))(tname, arr)
        if raw is None:
            w.add_tensor(tname, np.ascontiguousarray(data))
        else:
            w.add_tensor(tname, data, raw_shape=data.shape, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def sentencepiece_vocab(model_file: Path) -> tuple[list[str], list[float], list[int]]:
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    types = []
    for i in range(sp.get_piece_size()):
        kind = 2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else (
            5 if sp.is_unused(i) else 1)
        types.append(kind)
    return ([sp.id_to_piece(i) for i in range(sp.get_piece_size())],
            [sp.get_score(i) for i in range(sp.get_piece_size())], types)


def add_sentencepiece_vocab(w: gguf.GGUFWriter, model_file: Path) -> None:
    tokens, scores, types = sentencepiece_vocab(model_file)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
