"""write_checkpoint: a complete HF-format checkpoint directory from a preset.

config.json (loadable by transformers), sharded safetensors + index (HF hub
tensor names, per-expert MoE tensors), generation_config.json, the real
Mistral sentencepiece tokenizer from mistral-common, and tokenizer_config.json
with a Mistral-style chat template. Used by tools/make_model.py, by tests and by
the server's embedded demo model.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ftserve.models import fp8
from ftserve.models.config import ModelConfig
from ftserve.models.presets import FP8_BLOCK_QUANT, PRESETS, TOKENIZER_FOR, TOKENIZER_V3
from ftserve.models.registry import model_class
from ftserve_kernels.fp8_quant import quantize_weight

QUANTS = ("fp8",)  # write_checkpoint(quant=...): fp8 = HF's block-scaled e4m3 layout

# Mistral v3 instruct format. The rendering of a conversation is a prefix of the
# rendering of any continuation of it (system text joins the first user turn),
# which the incremental tokenizer cache relies on. As in Mistral's own
# templates, the prompt already ends in [/INST] (or [/TOOL_RESULTS]), so
# add_generation_prompt adds no text.
CHAT_TEMPLATE = (
    "{%- macro text(c) -%}{%- if c is string -%}{{ c }}{%- elif c -%}"
    "{%- for p in c -%}{{ p['text'] if p['text'] is defined else '' }}{%- endfor -%}{%- endif -%}{%- endmacro -%}"
    "{%- set ns = namespace(system='', first=true) -%}"
    "{%- for m in messages if m['role'] == 'system' -%}{%- set ns.system = ns.system + text(m['content']) + '\n\n' -%}{%- endfor -%}"
    "{{ bos_token }}"
    "{%- if tools -%}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}"
    "[INST] {% if ns.first %}{{ ns.system }}{% set ns.first = false %}{% endif %}{{ text(m['content']) }}[/INST]"
    "{%- elif m['role'] == 'assistant' -%}"
    "{%- if m['tool_calls'] is defined and m['tool_calls'] -%}[TOOL_CALLS] ["
    "{%- for tc in m['tool_calls'] -%}{%- set f = tc['function'] if tc['function'] is defined else tc -%}"
    "{\"name\": {{ f['name'] | tojson }}, \"arguments\": "
    "{%- if f['arguments'] is string %} {{ f['arguments'] }}{% else %} {{ f['arguments'] | tojson }}{% endif -%}"
    "{%- if tc['id'] is defined and tc['id'] %}, \"id\": {{ tc['id'] | tojson }}{% endif %}}"
    "{%- if not loop.last %}, {% endif -%}{%- endfor -%}]{{ eos_token }}"
    "{%- else %} {{ text(m['content']) }}{{ eos_token }}{%- endif -%}"
    "{%- elif m['role'] == 'tool' -%}"
    "[TOOL_RESULTS] {\"call_id\": {{ (m['tool_call_id'] if m['tool_call_id'] is defined else '') | tojson }}, "
    "\"content\": {{ text(m['content']) | tojson }}}[/TOOL_RESULTS]"
    "{%- elif m['role'] != 'system' -%}{{ raise_exception('unknown role: ' + m['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def tokenizer_data_dir() -> Path:
    import mistral_common

    return Path(os.path.dirname(mistral_common.__file__)) / "data"


def preset_config(
    preset: str | dict[str, Any], layers: int | None = None, dtype: str | None = None,
    overrides: dict[str, Any] | None = None, quant: str | None = None,
) -> dict[str, Any]:
    """The config.json dict of a preset (name or dict), with depth / dtype /
    overrides applied; ``quant="fp8"``: HF's fp8 quantization_config (e4m3
    weights, 128 x 128 blocks), its modules_to_not_convert listing the layers
    ftserve keeps in the model dtype (lm_head, the routers) unless given."""
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
        hf = dict(PRESETS[preset])
    else:
        hf = dict(preset)
    if layers is not None:
        hf["num_hidden_layers"] = int(layers)
        if hf.get("max_window_layers") is not None:
            hf["max_window_layers"] = min(int(hf["max_window_layers"]), int(layers))
    if dtype is not None:
        hf["torch_dtype"] = dtype
    if quant is not None:
        if quant not in QUANTS:
            raise ValueError(f"quant must be one of {', '.join(QUANTS)}, got {quant!r}")
        hf["quantization_config"] = dict(FP8_BLOCK_QUANT)
    hf.update(overrides or {})
    q = hf.get("quantization_config")
    if q is not None and q.get("quant_method") == "fp8" and "modules_to_not_convert" not in q:
        hf["quantization_config"] = {**q, "modules_to_not_convert": _not_converted(hf)}
    return hf


def _meta_model(hf_config: dict[str, Any]) -> torch.nn.Module:
    """The model a checkpoint of this config fills, on the meta device (its MTP
    layers too when the config declares them: the checkpoint ships them)."""
    cfg = ModelConfig.from_hf(hf_config)
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg, torch.float32)
        if cfg.num_mtp_layers:
            model.attach_mtp(cfg.num_mtp_layers)
        return model


def _not_converted(hf_config: dict[str, Any]) -> list[str]:
    """The HF Linear modules ftserve runs in the model dtype (lm_head, routers), in order."""
    model = _meta_model({**hf_config, "quantization_config": None})
    capable = fp8.fp8_capable(model)
    return [n.removesuffix(".weight") for n, t in fp8.linear_weights(model).items() if t.param not in capable]


def quantized_modules(hf_config: dict[str, Any]) -> set[str]:
    """The HF modules an fp8 checkpoint of this config stores in e4m3 (none without quantization)."""
    cfg = ModelConfig.from_hf(hf_config)
    if cfg.quant is None:
        return set()
    return fp8.stored_fp8(_meta_model(hf_config), cfg.quant, None)


def _init_tensor(
    name: str, shape: tuple[int, ...], hidden: int, tied: bool, gen: torch.Generator
) -> torch.Tensor:
    """Random values that keep activations and logits O(1) and make routing depend
    on the token. Tied embeddings double as the LM head, so they get its scale."""
    if name.endswith("norm.weight") or ".pre_fc_norm_" in name:
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith(".bias"):
        return 0.1 * torch.randn(shape, generator=gen)
    if name == "model.embed_tokens.weight":
        return torch.randn(shape, generator=gen) * (hidden**-0.5 if tied else 1.0)
    if name.endswith(".A_log"):
        # Gated DeltaNet decay rates A in [0.01, 0.3]: the recurrent state outlives
        # a few dozen tokens, so a test that loses or leaks it sees the difference.
        return (0.01 + 0.29 * torch.rand(shape, generator=gen)).log()
    if name.endswith(".dt_bias"):
        return 0.1 * torch.randn(shape, generator=gen)
    if name.endswith(".gate.weight") or name == "lm_head.weight":
        return torch.randn(shape, generator=gen) * hidden**-0.5
    return torch.randn(shape, generator=gen) * shape[-1] ** -0.5  # [out, in]: std 1/sqrt(in)


def tensor_shapes(hf_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for every tensor the checkpoint holds, in file order."""
    model = _meta_model(hf_config)  # model-dtype shapes (an fp8 checkpoint's codes have the same)
    params = dict(model.named_parameters())
    return {n: tuple(params[t.param][t.index].shape) for n, t in model.checkpoint_targets().items()}


def write_checkpoint(
    preset: str | dict[str, Any],
    out: str | Path,
    *,
    layers: int | None = None,
    seed: int = 0,
    dtype: str | None = None,
    shard_size_mb: float = 1024.0,
    config_only: bool = False,
    overrides: dict[str, Any] | None = None,
    quant: str | None = None,
) -> Path:
    """Write a checkpoint directory and return its path. ``config_only`` skips the
    weights (for --load-format dummy at real shapes). ``quant="fp8"`` (or an fp8
    preset) writes HF's fp8 layout: each quantized ``<module>.weight`` as e4m3
    codes with its fp32 ``<module>.weight_scale_inv`` per 128 x 128 block, from
    the same random weights block-quantized; other tensors in ``dtype``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    hf = preset_config(preset, layers, dtype, overrides, quant)
    tok_name = TOKENIZER_FOR.get(preset, TOKENIZER_V3) if isinstance(preset, str) else TOKENIZER_V3
    # The special ids must be the shipped tokenizer's (the real Qwen3 ids do not
    # exist in the Mistral tokenizer); both bundled tokenizers use <s>=1, </s>=2.
    hf["bos_token_id"], hf["eos_token_id"] = 1, 2
    cfg = ModelConfig.from_hf(hf)  # validates before anything is written
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    gen_cfg = {"bos_token_id": 1, "eos_token_id": 2, "_from_model_config": True}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    shutil.copyfile(tokenizer_data_dir() / tok_name, out / "tokenizer.model")
    tok_cfg = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "legacy": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg.max_context_len,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    if not config_only:
        _write_weights(hf, cfg, out, seed, shard_size_mb)
    return out


def _write_weights(hf: dict[str, Any], cfg: ModelConfig, out: Path, seed: int, shard_size_mb: float) -> None:
    store_dtype = getattr(torch, str(hf.get("torch_dtype") or "float32"))
    elem = torch.empty((), dtype=store_dtype).element_size()
    shapes = tensor_shapes(hf)
    fp8_names = {f"{m}.weight" for m in quantized_modules(hf)}
    # Plan shards from the shapes first, so names can say "-of-N" while each
    # shard is generated and written on its own (peak memory: one shard).
    limit = max(1, int(shard_size_mb * 2**20))
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * (1 if name in fp8_names else elem)
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    total = 0
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for n in names:
            value = _init_tensor(n, shapes[n], cfg.hidden_size, cfg.tie_word_embeddings, gen)
            if n in fp8_names:  # HF's fp8 layout: codes, and the block scales beside them
                q = quantize_weight(value, 128, 128)
                tensors[n] = q.codes
                tensors[f"{n}_scale_inv"] = q.scale
            else:
                tensors[n] = value.to(store_dtype).contiguous()
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        for n, t in tensors.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_config(preset: str, out_dir: str | Path, layers: int | None = None,
                       **overrides: Any) -> str:
    """A config-only checkpoint (config.json from a preset) for
    ``--load-format dummy``; ``overrides`` replace config keys."""
    cfg = preset_config(preset, layers, overrides=overrides)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return str(out)
