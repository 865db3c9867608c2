"""GGUF checkpoints (llama.cpp / Ollama files): metadata -> ModelConfig, tensors -> weights.

A GGUF file holds everything a checkpoint directory does: the architecture's
hyper-parameters and the tokenizer as key/value metadata, then the tensors
(quantized or not). ``gguf`` (ggml's own reader) parses the file; this module
translates:

    general.architecture + <arch>.*   -> an HF config dict -> ModelConfig.from_hf
    tokenizer.ggml.*                  -> ftserve.tokenizer.gguf
    blk.N.attn_q.weight, ...          -> model.layers.N.self_attn.q_proj.weight, ...
                                         (the HF names DecoderForCausalLM.checkpoint_targets
                                         knows), dequantized to the serving dtype

so a GGUF enters the same registry, ModelConfig and fill path as a safetensors
checkpoint. A checkpoint is a ``.gguf`` file, a folder holding one, or the parts of
a split file (``name-00001-of-00003.gguf``: the first part holds the metadata,
every part some tensors).

llama.cpp rotates q/k with adjacent pairs (x0, x1), (x2, x3), ... where HF's Llama
rotates halves (x0, x[d/2]), ...; its converter permutes the rows of the llama
architecture's q and k weights to match. ``_unpermute`` undoes that, so the
weights are HF's again. Qwen2/Qwen3 GGUFs use the halves layout and are not permuted.

Parsing the metadata of a large vocabulary takes seconds, and the model loader,
the engine set-up and the tokenizer all need it: ``read_checkpoint`` keeps the
last few parses (keyed by path, size and mtime). The tensors themselves are read
through a fresh memory map while the weights are filled, and not kept.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import resource
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ftserve.models.config import ModelConfig, UnsupportedModelError

log = logging.getLogger(__name__)

_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

# general.architecture -> HF architecture (llama with experts is Mixtral, below)
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
# Architectures whose q/k rows llama.cpp's converter permuted (see the module docstring).
_PERMUTED = ("llama",)

# Control tokens llama.cpp also ends generation at, whatever the eos id says: an
# instruct model's end-of-turn token is often not the one the metadata names.
END_OF_GENERATION_TEXTS = frozenset({
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>", "<EOT>", "<|return|>", "<|call|>",
})


class GGUFError(ValueError):
    """A GGUF file cannot be served; the message is one line naming the file and the problem."""


@dataclass(frozen=True)
class TensorSpec:
    file: int  # index into GGUFCheckpoint.files
    qtype: int  # gguf.GGMLQuantizationType value
    shape: tuple[int, ...]  # logical, row-major (numpy order: rows first)
    offset: int  # absolute byte offset of the data in its file
    nbytes: int


@dataclass(frozen=True)
class GGUFCheckpoint:
    """What ``gguf.GGUFReader`` read: plain metadata values and where each tensor lies."""

    files: tuple[Path, ...]
    metadata: Mapping[str, Any]
    tensors: Mapping[str, TensorSpec]

    @property
    def name(self) -> str:
        return self.files[0].name

    @property
    def arch(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.name}: no general.architecture in the GGUF metadata")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        """``<arch>.key`` from the metadata."""
        return self.metadata.get(f"{self.arch}.{key}", default)


def is_gguf(path: str | os.PathLike[str]) -> bool:
    """A .gguf file, or a folder holding GGUF files and no HF config.json."""
    p = Path(path)
    if p.is_file():
        return p.suffix == ".gguf"
    return p.is_dir() and not (p / "config.json").exists() and any(p.glob("*.gguf"))


def gguf_files(path: str | os.PathLike[str]) -> list[Path]:
    """The file(s) of the GGUF checkpoint at ``path``, split parts in order."""
    p = Path(path)
    if p.is_dir():
        found = sorted(p.glob("*.gguf"))
        if not found:
            raise GGUFError(f"{p} holds no .gguf file")
        stems = {m.group("stem") if (m := _SPLIT.match(f.name)) else None for f in found}
        if len(found) > 1 and (len(stems) > 1 or None in stems):
            raise GGUFError(f"{p} holds several GGUF files ({', '.join(f.name for f in found[:4])}); "
                            "pass --model FILE.gguf")
        p = found[0]
    if not p.is_file():
        raise GGUFError(f"{p} does not exist")
    m = _SPLIT.match(p.name)
    if m is None:
        return [p]
    count = int(m.group("count"))
    parts = [p.with_name(f"{m.group('stem')}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [q.name for q in parts if not q.is_file()]
    if missing:
        raise GGUFError(f"split GGUF {p.name} is missing part(s) {', '.join(missing[:3])}")
    return parts


def read_checkpoint(path: str | os.PathLike[str]) -> GGUFCheckpoint:
    files = gguf_files(path)
    key = tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    return _read_cached(key)


@functools.lru_cache(maxsize=4)
def _read_cached(key: tuple[tuple[str, int, int], ...]) -> GGUFCheckpoint:
    from gguf import GGUFReader

    files = tuple(Path(k[0]) for k in key)
    metadata: dict[str, Any] = {}
    tensors: dict[str, TensorSpec] = {}
    started = time.perf_counter()
    for i, f in enumerate(files):
        try:
            reader = GGUFReader(f, "r")
            fields = {name: fld.contents() for name, fld in reader.fields.items()
                      if not name.startswith("GGUF.")}
            specs = [(t.name, int(t.tensor_type), tuple(int(d) for d in reversed(t.shape)),
                      int(t.data_offset), int(t.n_bytes)) for t in reader.tensors]
        except Exception as exc:  # the reader fails in many ways on a damaged file
            raise GGUFError(f"{f.name} is not a readable GGUF file (truncated or corrupt?): "
                            f"{type(exc).__name__}: {_one_line(exc)}") from None
        size = f.stat().st_size
        for name, qtype, shape, offset, nbytes in specs:
            if offset + nbytes > size:
                raise GGUFError(f"{f.name} is truncated: tensor {name!r} ends at byte "
                                f"{offset + nbytes:,} but the file has {size:,} bytes")
            if name in tensors:
                raise GGUFError(f"{f.name}: tensor {name!r} appears twice")
            tensors[name] = TensorSpec(i, qtype, shape, offset, nbytes)
        if i == 0:
            metadata = fields
        del reader
    log.info("read GGUF metadata of %s (%d tensors, %d file(s)) in %.1fs", files[0].name,
             len(tensors), len(files), time.perf_counter() - started)
    return GGUFCheckpoint(files, metadata, tensors)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]


# --- metadata -> ModelConfig ---------------------------------------------------------

def hf_config(ckpt: GGUFCheckpoint) -> dict[str, Any]:
    """The HF config.json equivalent of the GGUF's metadata."""
    arch = ckpt.arch
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"{ckpt.name}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(ARCHITECTURES)} (llama covers Llama, Mistral and Mixtral)")

    def need(key: str) -> Any:
        value = ckpt.get(key)
        if value is None:
            raise GGUFError(f"{ckpt.name}: metadata key {arch}.{key} is missing")
        return value

    embd = ckpt.tensors.get("token_embd.weight")
    if embd is None:
        raise GGUFError(f"{ckpt.name}: no token_embd.weight tensor")
    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = ckpt.get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer counts: only uniform ones are served
        if len(set(kv_heads)) != 1:
            raise GGUFError(f"{ckpt.name}: per-layer KV head counts are not supported")
        kv_heads = kv_heads[0]
    head_dim = int(ckpt.get("attention.key_length") or hidden // heads)
    n_experts = int(ckpt.get("expert_count") or 0)
    hf: dict[str, Any] = {
        "architectures": ["MixtralForCausalLM" if arch == "llama" and n_experts else ARCHITECTURES[arch]],
        "hidden_size": hidden,
        "intermediate_size": int(ckpt.get("feed_forward_length") or 0),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(ckpt.get("context_length") or 2048),
        "rope_theta": float(ckpt.get("rope.freq_base") or 10000.0),
        "vocab_size": int(embd.shape[0]),
        "tie_word_embeddings": "output.weight" not in ckpt.tensors,
        "attention_bias": "blk.0.attn_q.bias" in ckpt.tensors,
        "hidden_act": "silu",
    }
    rot = ckpt.get("rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        hf["partial_rotary_factor"] = int(rot) / head_dim
    window = ckpt.get("attention.sliding_window")
    if window:
        hf["sliding_window"] = int(window)
        hf["use_sliding_window"] = True
    if n_experts:
        used = int(need("expert_used_count"))
        if arch == "llama":
            hf.update(num_local_experts=n_experts, num_experts_per_tok=used)
        else:
            hf.update(num_experts=n_experts, num_experts_per_tok=used,
                      moe_intermediate_size=int(need("expert_feed_forward_length")),
                      norm_topk_prob=bool(ckpt.get("expert_weights_norm", True)))
    scaling = _rope_scaling(ckpt)
    if scaling:
        hf["rope_scaling"] = scaling
    meta = ckpt.metadata
    if meta.get("tokenizer.ggml.bos_token_id") is not None:
        hf["bos_token_id"] = int(meta["tokenizer.ggml.bos_token_id"])
    hf["eos_token_id"] = list(eos_token_ids(meta))
    return hf


def _rope_scaling(ckpt: GGUFCheckpoint) -> dict[str, Any] | None:
    kind = ckpt.get("rope.scaling.type")
    factor = ckpt.get("rope.scaling.factor")
    if kind is None and ckpt.get("rope.scale_linear") is not None:  # an older key
        kind, factor = "linear", ckpt.get("rope.scale_linear")
    if kind in (None, "none") or (factor is not None and float(factor) == 1.0 and kind == "linear"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        out: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
        orig = ckpt.get("rope.scaling.original_context_length")
        if orig is not None:
            out["original_max_position_embeddings"] = int(orig)
        for ours, theirs in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            value = ckpt.get(f"rope.scaling.{theirs}")
            if value:
                out[ours] = float(value)
        return out
    raise UnsupportedModelError(f"{ckpt.name}: rope scaling {kind!r} is not supported "
                                "(none, linear and yarn are)")


def eos_token_ids(meta: Mapping[str, Any]) -> tuple[int, ...]:
    """The eos id, then the end-of-turn ids (eot / eom) and the control tokens llama.cpp
    also stops at (END_OF_GENERATION_TEXTS)."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                "tokenizer.ggml.eom_token_id"):
        value = meta.get(key)
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    tokens = meta.get("tokenizer.ggml.tokens") or []
    types = meta.get("tokenizer.ggml.token_type") or []
    for i, (text, kind) in enumerate(zip(tokens, types)):
        if kind == 3 and text in END_OF_GENERATION_TEXTS and i not in ids:
            ids.append(i)
    return tuple(ids)


def check_types(ckpt: GGUFCheckpoint) -> None:
    """Every tensor type can be dequantized (tried on one block of zeros per type), so
    an unsupported one fails at start-up, before any memory is allocated."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from ftserve.models.gguf_quants import dequantize

    first: dict[int, str] = {}
    for name, spec in ckpt.tensors.items():
        first.setdefault(spec.qtype, name)
    for qtype, name in first.items():
        try:
            per, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
            dequantize(np.zeros(size, np.uint8), qtype, (per,), torch.device("cpu"))
        except (ValueError, KeyError, NotImplementedError):
            from ftserve.models.gguf_quants import type_name

            raise GGUFError(f"{ckpt.name}: tensor {name!r} has type {type_name(qtype)}, which "
                            "ftserve cannot dequantize") from None


def model_config(path: str | os.PathLike[str]) -> ModelConfig:
    ckpt = read_checkpoint(path)
    check_types(ckpt)
    cfg = ModelConfig.from_hf(hf_config(ckpt))
    freqs = ckpt.tensors.get("rope_freqs.weight")
    if freqs is not None:
        # Llama 3.1-style long-context rope: llama.cpp stores the per-frequency divisors
        # the converter computed instead of the rope_scaling parameters.
        factors = _read_tensor(ckpt, "rope_freqs.weight", freqs, torch.device("cpu"))
        if factors.numel() * 2 != cfg.rotary_dim:
            raise GGUFError(f"{ckpt.name}: rope_freqs.weight has {factors.numel()} values, "
                            f"expected {cfg.rotary_dim // 2}")
        scaling = dataclasses.replace(cfg.rope_scaling, freq_factors=tuple(factors.tolist()))
        cfg = dataclasses.replace(cfg, rope_scaling=scaling)
    return cfg


# --- tensors -------------------------------------------------------------------------

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_EXPERT_PARTS = {"gate": 0, "up": 1, "down": 2}  # index into the model's expert_names
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^ffn_(gate|up|down)(?:_exps|\.(\d+))\.weight$")


def hf_names(gguf_name: str, cfg: ModelConfig, moe_prefix: str,
             expert_names: tuple[str, str, str]) -> list[tuple[str, int | None]]:
    """(HF name, expert index or None) for one GGUF tensor; [] for a tensor with no
    HF counterpart (rope_freqs, read into the config instead). KeyError: unknown."""
    if gguf_name in _GLOBAL_NAMES:
        return [(_GLOBAL_NAMES[gguf_name], None)]
    if gguf_name == "rope_freqs.weight":
        return []
    m = _BLK.match(gguf_name)
    if m is None:
        raise KeyError(gguf_name)
    layer, rest = m.group(1), m.group(2)
    base = f"model.layers.{layer}"
    if rest in _LAYER_NAMES:
        return [(f"{base}.{_LAYER_NAMES[rest]}", None)]
    if rest == "ffn_gate_inp.weight":
        return [(f"{base}.{moe_prefix}.gate.weight", None)]
    e = _EXPERT.match(rest)
    if e is None or not cfg.num_experts:
        raise KeyError(gguf_name)
    name = expert_names[_EXPERT_PARTS[e.group(1)]]
    if e.group(2) is not None:  # older Mixtral GGUFs: one tensor per expert
        return [(f"{base}.{moe_prefix}.experts.{e.group(2)}.{name}.weight", None)]
    return [(f"{base}.{moe_prefix}.experts.{j}.{name}.weight", j) for j in range(cfg.num_experts)]


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (pairs -> halves within each head)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _read_tensor(ckpt: GGUFCheckpoint, name: str, spec: TensorSpec,
                 device: torch.device) -> torch.Tensor:
    """One tensor, dequantized to float32 on ``device``, in its logical shape."""
    from ftserve.models.gguf_quants import dequantize

    raw = np.memmap(ckpt.files[spec.file], dtype=np.uint8, mode="r", offset=spec.offset,
                    shape=(spec.nbytes,))
    try:
        return dequantize(raw, spec.qtype, spec.shape, device)
    except NotImplementedError as exc:
        raise GGUFError(f"{ckpt.name}: tensor {name!r} has type {exc}, which ftserve cannot "
                        "dequantize") from None
    finally:
        del raw


def iter_weights(ckpt: GGUFCheckpoint, cfg: ModelConfig, moe_prefix: str,
                 expert_names: tuple[str, str, str], device: torch.device,
                 ) -> Iterator[tuple[str, list[tuple[str, int | None]], torch.Tensor]]:
    """(GGUF name, its HF names, float32 tensor in HF layout) for every weight tensor."""
    permuted = ckpt.arch in _PERMUTED
    for name, spec in ckpt.tensors.items():
        try:
            targets = hf_names(name, cfg, moe_prefix, expert_names)
        except KeyError:
            raise GGUFError(f"{ckpt.name}: unexpected tensor {name!r} for a "
                            f"{cfg.architecture} model") from None
        if not targets:
            continue
        w = _read_tensor(ckpt, name, spec, device)
        if permuted and name.endswith(("attn_q.weight", "attn_q.bias")):
            w = _unpermute(w, cfg.num_heads)
        elif permuted and name.endswith(("attn_k.weight", "attn_k.bias")):
            w = _unpermute(w, cfg.num_kv_heads)
        yield name, targets, w


@torch.no_grad()
def fill_from_gguf(model: Any, path: str | os.PathLike[str]) -> None:
    """Fill every parameter of ``model`` (built from this checkpoint's ModelConfig)
    from the GGUF, dequantizing one tensor at a time on the parameters' device."""
    from tqdm import tqdm

    from ftserve.models.loader import CheckpointError

    ckpt = read_checkpoint(path)
    cfg: ModelConfig = model.config
    targets = model.checkpoint_targets()
    params = dict(model.named_parameters())
    device = next(iter(params.values())).device
    seen: set[str] = set()
    started = time.perf_counter()
    total = sum(s.nbytes for s in ckpt.tensors.values())
    with tqdm(total=total, desc=f"dequantizing {ckpt.name}", unit="B", unit_scale=True,
              disable=None) as bar:
        for name, hf, w in iter_weights(ckpt, cfg, model.moe_prefix, model.expert_names, device):
            bar.update(ckpt.tensors[name].nbytes)
            for hf_name, expert in hf:
                target = targets.get(hf_name)
                if target is None:
                    raise CheckpointError(f"{ckpt.name}: tensor {name!r} ({hf_name}) has no "
                                          f"place in this {cfg.architecture} model")
                src = w if expert is None else w[expert]
                dest = params[target.param][target.index]
                if tuple(src.shape) != tuple(dest.shape):
                    raise CheckpointError(f"{ckpt.name}: tensor {name!r} has shape "
                                          f"{list(src.shape)}, expected {list(dest.shape)}")
                dest.copy_(src)
                seen.add(hf_name)
            del w
    missing = sorted(set(targets) - seen)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CheckpointError(f"{ckpt.name} is missing tensor(s) for {', '.join(missing[:3])}{more}")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (Linux)
    log.info("loaded %s (%s) in %.1fs; peak host memory %.2f GiB", ckpt.name,
             quant_summary(ckpt), time.perf_counter() - started, peak)


def quant_summary(ckpt: GGUFCheckpoint) -> str:
    """The tensor types by count, e.g. 'Q4_1 x210, F32 x61, Q8_0 x1'."""
    from gguf import GGMLQuantizationType

    counts: dict[str, int] = {}
    for s in ckpt.tensors.values():
        name = GGMLQuantizationType(s.qtype).name
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))
