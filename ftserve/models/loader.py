"""load_model: build on the meta device, materialize once on the target device,
then fill every parameter from memory-mapped safetensors shards, a GGUF file
(dequantized one tensor at a time: ftserve/models/gguf.py) or random dummy
values. Each checkpoint tensor is copied exactly once, straight into its
(possibly fused) destination slice, so peak memory is the model itself (plus one
dequantized tensor for a GGUF).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from ftserve.models import fp8
from ftserve.models.config import ModelConfig
from ftserve.models.decoder import DecoderForCausalLM
from ftserve.models.registry import model_class
from ftserve_kernels.fp8_quant import FP8, Fp8Weight

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Buffers some exporters save that we recompute instead.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint does not match the model its config.json describes."""


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir} (use load_format='dummy' to run without weights)")
    return files


def checkpoint_names(files: list[Path]) -> set[str]:
    """Every tensor name in the shards (headers only)."""
    names: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as h:
            names.update(h.keys())
    return names


def stored_names(cfg: ModelConfig, path: Path, load_format: str) -> set[str] | None:
    """An fp8 config's safetensors tensor names (which weights it holds in fp8 is
    read off them: fp8.convert); None otherwise (dummy weights follow the config,
    a GGUF has no fp8 config)."""
    from ftserve.models import gguf

    if cfg.quant is None or load_format not in ("safetensors", "auto") or gguf.is_gguf(path):
        return None
    return checkpoint_names(checkpoint_files(path))


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                mtp_layers: int = 0, stored: set[str] | None = None) -> DecoderForCausalLM:
    """Construct on the meta device (no memory, no init), then allocate once on ``device``.
    Parameter values are uninitialized until the caller fills them. ``mtp_layers``:
    also build that many MTP layers (models/mtp.py). An fp8 checkpoint's weights
    then become fp8 parameters (fp8.convert; ``stored``: the checkpoint's tensor
    names, None for dummy weights)."""
    cls = model_class(cfg.architecture)
    with torch.device("meta"):
        model = cls(cfg, dtype)
        if mtp_layers:
            model.attach_mtp(mtp_layers)
        if cfg.quant is not None:
            fp8.convert(model, cfg.quant, stored)
    model.to_empty(device=device)
    model.init_buffers()
    model.eval()
    return model


def load_model(
    model_dir: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    load_format: str = "safetensors",
    *,
    max_model_len: int | None = None,
    seed: int = 0,
    mtp: bool = False,
) -> tuple[DecoderForCausalLM, ModelConfig]:
    """Returns (model, config). ``max_model_len`` shortens the rope table (and the
    single-request limit) below what the checkpoint supports. ``mtp``: with the
    checkpoint's MTP layers (a CheckpointError if it has none)."""
    model_dir = Path(model_dir)
    device = torch.device(device)
    cfg = ModelConfig.from_pretrained(model_dir)
    if max_model_len is not None:
        cfg = cfg.with_max_len(max_model_len)
    torch_dtype = resolve_dtype(dtype, device)
    n_mtp = 0
    if mtp:
        n_mtp = mtp_layers(model_dir, cfg, load_format)
        if n_mtp == 0:
            raise CheckpointError(f"{model_dir} has no MTP layers (no mtp.* tensors)")
    model = build_model(cfg, torch_dtype, device, n_mtp, stored_names(cfg, model_dir, load_format))
    if load_format in ("safetensors", "gguf", "auto"):
        fill_from_checkpoint(model, model_dir)
    elif load_format == "dummy":
        fill_dummy(model, seed)
    else:
        raise ValueError(f"load_format must be safetensors, gguf or dummy, got {load_format!r}")
    model.refresh_derived()
    return model, cfg


def mtp_layers(model_dir: str | Path, cfg: ModelConfig, load_format: str = "safetensors") -> int:
    """The MTP layers a checkpoint ships: its ``mtp.layers.<j>`` tensors (dummy
    weights: the config's num_nextn_predict_layers; a GGUF: none)."""
    from ftserve.models import gguf
    from ftserve.models.mtp import count_layers

    model_dir = Path(model_dir)
    if load_format == "dummy":
        return cfg.num_mtp_layers
    if gguf.is_gguf(model_dir):
        return 0
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return count_layers(set(json.loads(index.read_text())["weight_map"]))
    names: set[str] = set()
    for f in checkpoint_files(model_dir):
        with safe_open(str(f), framework="pt", device="cpu") as h:
            names.update(h.keys())
    return count_layers(names)


def fill_from_checkpoint(model: DecoderForCausalLM, path: Path) -> None:
    """The checkpoint's weights, whichever format holds them (safetensors or GGUF)."""
    from ftserve.models import gguf

    if gguf.is_gguf(path):
        gguf.fill_from_gguf(model, path)
    else:
        fill_from_safetensors(model, checkpoint_files(path))


@torch.no_grad()
def fill_from_safetensors(model: DecoderForCausalLM, files: list[Path]) -> None:
    targets = fp8.checkpoint_targets(model)  # model.checkpoint_targets() (+ an fp8 checkpoint's scales)
    params = dict(model.named_parameters())
    ignorable = model.ignorable_checkpoint_names()
    seen: set[str] = set()
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    where = {name: h for h in handles for name in h.keys()}
    total = len(where)

    def read(name: str) -> torch.Tensor:  # another tensor, for a conversion (fp8 scales)
        if name not in where:
            raise CheckpointError(f"checkpoint is missing tensor {name}")
        seen.add(name)
        return where[name].get_tensor(name)

    with tqdm(total=total, desc="loading weights", unit="tensor", disable=None) as bar:
        for path, handle in zip(files, handles):
            for name in handle.keys():
                bar.update(1)
                target = targets.get(name)
                if target is None:
                    if (name in ignorable or name.endswith(_IGNORED_SUFFIXES)
                            or name.startswith(model.ignorable_prefixes) or fp8.ignorable(model, name)):
                        continue
                    raise CheckpointError(f"unexpected tensor {name!r} in {path.name}: this model has no such weight")
                if name in seen and not getattr(target, "consumed", False):
                    raise CheckpointError(f"tensor {name!r} appears twice (again in {path.name})")
                shape = tuple(handle.get_slice(name).get_shape())
                conv = target if isinstance(target, fp8.ConvertTarget) else None
                if conv is not None and conv.consumed:
                    if shape not in conv.stored:
                        raise CheckpointError(f"tensor {name!r} in {path.name} has shape {list(shape)}, "
                                              f"expected {list(conv.stored[0])}")
                    seen.add(name)
                    continue
                dest = params[target.param][target.index]
                expected = conv.stored if conv is not None and conv.stored else (tuple(dest.shape),)
                if shape not in expected:
                    raise CheckpointError(
                        f"tensor {name!r} in {path.name} has shape {list(shape)}, expected {list(expected[0])}"
                    )
                value = handle.get_tensor(name)  # mmap read
                if conv is not None and conv.convert is not None:
                    try:
                        value = conv.convert(value, read)
                    except ValueError as err:
                        raise CheckpointError(f"tensor {name!r} in {path.name}: {err}") from None
                elif value.dtype == FP8 and dest.dtype != FP8:
                    raise CheckpointError(f"tensor {name!r} in {path.name} is fp8 without a scale beside it")
                dest.copy_(value)  # one copy (+ dtype cast) into place
                seen.add(name)
    missing = sorted(set(targets) - seen)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"checkpoint is missing tensor(s) {', '.join(missing[:5])}{more}")


@torch.no_grad()
def fill_dummy(model: DecoderForCausalLM, seed: int = 0) -> None:
    """Random weights for benchmarks at real shapes, scaled so activations stay O(1).

    Routing must follow the token: with tiny embeddings (or tiny router
    weights) router logits collapse to near-ties, which in bf16 round to exact
    ties, and top-k then picks the same experts for every token, making any
    expert cache look perfect. Embeddings are N(0, 1) (hidden states O(1);
    N(0, 1/H) when tied, as they are also the LM head) and
    the router N(0, 1/H), so router logits are ~N(0, 1) and differ per token.

    An fp8 config's weights are the model dtype's draw (the same generator
    stream, so every other parameter matches the unquantized config's too),
    block-quantized on the layer's scale grid: the fp8 dummy model is its bf16
    twin quantized, as a published fp8 checkpoint is, and routes like it.
    """
    cfg = model.config
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    dtype = next(p.dtype for p in model.parameters() if p.dtype.is_floating_point and p.dtype != FP8)
    for name, p in model.named_parameters():
        if p.dtype == FP8:
            path, _, attr = name.rpartition(".")
            mod = model.get_submodule(path)
            block = mod.fp8_block if attr == "weight" else mod.fp8_blocks[attr]
            draw = torch.empty(p.shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)
            fp8.quantize_into(Fp8Weight(p, getattr(mod, f"{attr}_scale"), *block), draw)
            del draw
        elif name.endswith("_scale"):
            continue  # an fp8 weight's scales: filled with its codes
        elif name.endswith("norm.weight") or ".pre_fc_norm_" in name:
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        elif name == "embed_tokens.weight":
            # Tied: the embedding is also the LM head; keep logits O(1).
            p.normal_(0.0, cfg.hidden_size**-0.5 if cfg.tie_word_embeddings else 1.0, generator=gen)
        elif name.endswith("mlp.gate.weight"):
            p.normal_(0.0, cfg.hidden_size**-0.5, generator=gen)
        else:
            p.normal_(0.0, 0.02, generator=gen)
