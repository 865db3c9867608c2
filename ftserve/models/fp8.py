"""fp8 checkpoints in the model: which parameters hold e4m3 codes, and how the
checkpoint's tensors land in them.

``convert`` runs on the meta device right after a model is constructed (before
anything is allocated). A weight parameter becomes fp8 (Linear.to_fp8,
MoEBlock.to_fp8) when the checkpoint stores every tensor that feeds it in fp8
and the layer runs fp8 kernels: attention and MLP projections, the experts
(gate/up and down of a MoE block together), Qwen3-Next's linear-attention and
shared-expert projections. The lm_head, embeddings and routers stay in the
model dtype; a checkpoint that quantizes one of those, or only part of a fused
projection, has it dequantized at load (exactly as transformers dequantizes).

What is stored in fp8 is read off the checkpoint itself (a weight with its
scale tensor beside it), or from the quantization_config without a checkpoint
(``--load-format dummy``, make_model).

Scales as the kernels take them (Fp8Weight): one fp32 per (bn rows, bk columns).
Fused projections (q/k/v, gate/up) keep one scale grid, so where a part's rows
are not a multiple of 128 the grid's rows shrink to the gcd of the part
boundaries and 128 and each stored scale row is repeated (exact)::

    q_proj 128 rows | k_proj 64 | v_proj 64     (hidden 128, 4 x 32 / 2 x 32 heads)
    stored scales:  [1, 1]   |  [1, 1] |  [1, 1]
    fused grid (bn = 64):  q q | k | v          -> qkv_proj.weight_scale [4, 1]

Per-channel scales are bn = 1, bk >= K; per-tensor scales are expanded to one
per row (then fused projections simply stack them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ftserve.models.decoder import Target
from ftserve.models.fp8_config import Fp8Config
from ftserve.models.layers import Linear, MoEBlock
from ftserve_kernels.fp8_quant import FP8, Fp8Weight, dequantize, quantize_weight

Reader = Callable[[str], torch.Tensor]  # another checkpoint tensor by name (any shard)

@dataclass(frozen=True)
class ConvertTarget(Target):
    """A checkpoint tensor that needs work on its way in: a shape other than the
    destination's (``stored``: the accepted ones), a conversion (``convert``,
    given the tensor and a reader of the others), or nothing to copy at all
    (``consumed``: another target's conversion reads it)."""

    stored: tuple[tuple[int, ...], ...] = ()
    convert: Callable[[torch.Tensor, Reader], torch.Tensor] | None = None
    consumed: bool = False


@dataclass
class Fp8Plan:
    """What convert decided: ``stored`` the HF modules the checkpoint holds in
    fp8; ``params`` each fp8 parameter -> (bn, bk)."""

    quant: Fp8Config
    stored: set[str]
    params: dict[str, tuple[int, int]] = field(default_factory=dict)


# ------------------------------------------------------------------ the plan


def _row_slice(index: tuple[Any, ...]) -> slice | None:
    return index[-1] if index and isinstance(index[-1], slice) else None


def fp8_capable(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Parameter name -> (module, attribute) for every weight that may run in fp8."""
    routers = {id(b.gate) for b in model.modules() if isinstance(b, MoEBlock)}
    out: dict[str, tuple[nn.Module, str]] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, Linear) and id(mod) not in routers and not name.endswith("lm_head"):
            out[f"{name}.weight"] = (mod, "weight")
        elif isinstance(mod, MoEBlock):
            out[f"{name}.w13"] = (mod, "w13")
            out[f"{name}.w2"] = (mod, "w2")
    return out


def linear_weights(model: nn.Module) -> dict[str, Target]:
    """The checkpoint's ``<module>.weight`` tensors that feed a Linear or the
    experts (the ones a checkpoint may store in fp8), name -> target."""
    linears = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, Linear)}
    linears |= {f"{n}.{a}" for n, m in model.named_modules() if isinstance(m, MoEBlock) for a in ("w13", "w2")}
    return {n: t for n, t in model.checkpoint_targets().items()
            if n.endswith(".weight") and t.param in linears}


def stored_fp8(model: nn.Module, quant: Fp8Config, names: Iterable[str] | None) -> set[str]:
    """HF modules the checkpoint holds in fp8: those whose scale tensor is in
    ``names`` (the checkpoint's tensors), or, without a checkpoint, the ones the
    quantization_config quantizes."""
    modules = [n.removesuffix(".weight") for n in linear_weights(model)]
    if names is None:
        return {m for m in modules if quant.quantizes(m)}
    present = set(names)
    return {m for m in modules if quant.scale_name(m) in present}


@torch.no_grad()
def convert(model: nn.Module, quant: Fp8Config, names: Iterable[str] | None = None) -> Fp8Plan:
    """Turn the weights the checkpoint stores in fp8 into fp8 parameters (on the
    meta device, before materialization) and record the plan on ``model``."""
    plan = Fp8Plan(quant, stored_fp8(model, quant, names))
    capable = fp8_capable(model)
    params = dict(model.named_parameters())
    feeds: dict[str, list[tuple[str, Target]]] = {}
    for name, t in linear_weights(model).items():
        feeds.setdefault(t.param, []).append((name, t))
    for pname, parts in feeds.items():
        if pname not in capable or not all(n.removesuffix(".weight") in plan.stored for n, _ in parts):
            continue
        n_rows, k = params[pname].shape[-2:]
        if quant.strategy == "block":
            bn, bk = quant.block
            for _, t in parts:  # fused parts: the grid's rows must meet every part boundary
                rows = _row_slice(t.index)
                if rows is not None:
                    bn = math.gcd(bn, rows.start or 0)
                    if rows.stop is not None and rows.stop < n_rows:
                        bn = math.gcd(bn, rows.stop)
        else:
            bn, bk = 1, max(k, 1)  # one scale per row (per-tensor scales expanded)
        plan.params[pname] = (bn, bk)
    # An MoE block runs fp8 experts only with both gate/up and down in fp8.
    for pname, (mod, attr) in capable.items():
        if isinstance(mod, MoEBlock) and attr == "w13":
            base = pname.removesuffix(".w13")
            if (f"{base}.w13" in plan.params) != (f"{base}.w2" in plan.params):
                plan.params.pop(f"{base}.w13", None)
                plan.params.pop(f"{base}.w2", None)
    for pname, (bn, bk) in plan.params.items():
        mod, attr = capable[pname]
        if isinstance(mod, MoEBlock):
            mod.to_fp8(attr, bn, bk)
        else:
            assert isinstance(mod, Linear)
            mod.to_fp8(bn, bk)
    model.fp8_plan = plan  # type: ignore[assignment]
    return plan


def plan_of(model: nn.Module) -> Fp8Plan | None:
    return getattr(model, "fp8_plan", None)


# ------------------------------------------------------------------ checkpoint targets


def checkpoint_targets(model: nn.Module) -> dict[str, Target]:
    """model.checkpoint_targets(), with the fp8 checkpoint's scale tensors: each
    fp8 parameter's scales land in its scale grid, and a weight stored in fp8
    for a parameter that is not is dequantized on its way in."""
    targets = model.checkpoint_targets()
    plan = plan_of(model)
    if plan is None:
        return targets
    out = dict(targets)
    params = dict(model.named_parameters())
    for name, t in linear_weights(model).items():
        module = name.removesuffix(".weight")
        if module not in plan.stored:
            continue
        scale_name = plan.quant.scale_name(module)
        dest = params[t.param][t.index]
        n, k = dest.shape[-2:]
        stored = _stored_scale_shapes(plan.quant, n, k)
        if t.param in plan.params:
            bn, bk = plan.params[t.param]
            out[name] = ConvertTarget(t.param, t.index, convert=_check_e4m3)
            out[scale_name] = ConvertTarget(f"{_scale_param(t.param)}", _scale_index(t.index, bn),
                                            stored=stored, convert=_scale_rows(plan.quant, n, bn))
        else:
            out[name] = ConvertTarget(t.param, t.index, convert=_dequantizer(plan.quant, scale_name, n, k, stored))
            out[scale_name] = ConvertTarget("", (), stored=stored, consumed=True)
    return out


def ignorable(model: nn.Module, name: str) -> bool:
    """Checkpoint tensors of a quantized model that are not read: compressed-tensors'
    static activation scales (the GEMMs quantize activations per token and group)."""
    plan = plan_of(model)
    return plan is not None and plan.quant.method == "compressed-tensors" and name.endswith(".input_scale")


def _scale_param(param: str) -> str:
    return f"{param}_scale"  # "...weight" -> "...weight_scale", "...w13" -> "...w13_scale"


def _scale_index(index: tuple[Any, ...], bn: int) -> tuple[Any, ...]:
    rows = _row_slice(index)
    if rows is None:
        return index
    return (*index[:-1], slice((rows.start or 0) // bn, -(-rows.stop // bn)))


def _stored_scale_shapes(quant: Fp8Config, n: int, k: int) -> tuple[tuple[int, ...], ...]:
    if quant.strategy == "block":
        return ((-(-n // quant.block[0]), -(-k // quant.block[1])),)
    if quant.strategy == "channel":
        return ((n, 1), (n,))
    return ((1,), (), (1, 1))


def _scale_rows(quant: Fp8Config, n: int, bn: int) -> Callable[[torch.Tensor, Reader], torch.Tensor]:
    """Stored scales of one part -> its rows of the parameter's scale grid."""
    def conv(s: torch.Tensor, read: Reader) -> torch.Tensor:
        s = _check_scale(s)
        if quant.strategy == "block":
            return s.repeat_interleave(quant.block[0] // bn, dim=0)[: -(-n // bn)]
        return s.reshape(-1, 1).expand(n, 1)  # per channel [n, 1]; per tensor broadcast to every row
    return conv


def _dequantizer(quant: Fp8Config, scale_name: str, n: int, k: int,
                 stored: tuple[tuple[int, ...], ...]) -> Callable[[torch.Tensor, Reader], torch.Tensor]:
    def conv(codes: torch.Tensor, read: Reader) -> torch.Tensor:
        s = _check_scale(read(scale_name))
        if tuple(s.shape) not in stored:
            raise ValueError(f"tensor {scale_name!r} has shape {list(s.shape)}, expected {list(stored[0])}")
        if quant.strategy == "block":
            w = Fp8Weight(_check_e4m3(codes, read), s, *quant.block)
        else:
            w = Fp8Weight(_check_e4m3(codes, read), s.reshape(-1, 1).expand(n, 1).contiguous(), 1, max(k, 1))
        return dequantize(w)  # fp32; the copy casts to the model dtype
    return conv


def _check_e4m3(t: torch.Tensor, read: Reader) -> torch.Tensor:
    if t.dtype != FP8:
        raise ValueError(f"an fp8 weight is stored as {t.dtype}, expected float8_e4m3fn")
    return t


def _check_scale(s: torch.Tensor) -> torch.Tensor:
    if not s.dtype.is_floating_point or s.dtype == FP8:
        raise ValueError(f"an fp8 weight's scale is stored as {s.dtype}, expected float32")
    return s.float()


# ------------------------------------------------------------------ dummy weights


@torch.no_grad()
def quantize_into(dst: Fp8Weight, w: torch.Tensor) -> None:
    """Block-quantize w [..., N, K] into ``dst``'s codes and scale grid, one leading
    slice at a time (the quantization's fp32 temporaries are 4x a slice): dummy
    weights (loader.fill_dummy, moe/banks)."""
    codes, scale = dst.codes, dst.scale
    for c, s, part in (zip(codes.unbind(0), scale.unbind(0), w.unbind(0)) if w.dim() == 3
                       else ((codes, scale, w),)):
        q = quantize_weight(part, dst.block_n, dst.block_k)
        c.copy_(q.codes)
        s.copy_(q.scale)
