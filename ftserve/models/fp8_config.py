"""An fp8 checkpoint's ``quantization_config``, normalized into ``Fp8Config``
(ModelConfig.quant), and which of its modules it quantizes.

Served (weights stay e4m3 on the device, see ftserve/models/fp8.py):

- ``quant_method: "fp8"`` (transformers' FineGrainedFP8Config, the Qwen3 /
  DeepSeek FP8 releases): ``weight_block_size`` [128, 128], dynamic
  activations, e4m3 ``*.weight`` with fp32 ``*.weight_scale_inv`` per block;
  modules named by ``modules_to_not_convert`` stay as stored.
- ``quant_method: "compressed-tensors"``, ``format: "float-quantized"``: 8-bit
  float weights per tensor, per channel or in 128 x 128 blocks (``*.weight_scale``);
  input activations dynamic or static (static ``*.input_scale`` are not read:
  the GEMMs quantize activations per token and 128 columns, which is finer);
  ``ignore`` names (or ``re:`` patterns) stay as stored.

Anything else is a ``ValueError`` naming the field, raised when the config is
read, so a checkpoint ftserve cannot serve fails at start-up in one line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

BLOCK = (128, 128)


class UnsupportedQuantization(ValueError):
    pass


@dataclass(frozen=True)
class Fp8Config:
    method: str  # "fp8" | "compressed-tensors"
    strategy: str  # "block" | "channel" | "tensor": how weight scales are laid out
    scale_suffix: str  # the scale tensor beside each quantized "<module>.weight"
    skip: tuple[str, ...] = ()  # modules left unquantized, matched as the method does
    block: tuple[int, int] = BLOCK  # (rows, columns) per scale, block strategy

    def quantizes(self, module: str) -> bool:
        """Whether the checkpoint stores ``module`` (an HF module name such as
        "model.layers.0.self_attn.q_proj") in fp8. lm_head never is here."""
        if module == "lm_head" or module.endswith(".lm_head"):
            return False
        if self.method == "fp8":
            return not any(_hf_skip_match(module, p) for p in self.skip)
        return not any(_ct_match(module, p) for p in self.skip)

    def scale_name(self, module: str) -> str:
        return f"{module}.{self.scale_suffix}"


def _hf_skip_match(name: str, pattern: str) -> bool:
    """transformers' should_convert_module: the pattern (a regex) from the start
    up to a module boundary, or the name ends with it."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    try:
        if re.match(rf"(?:{pattern}){boundary}", name):
            return True
    except re.error:
        pass
    return name.endswith(pattern)


def _ct_match(name: str, pattern: str) -> bool:
    """compressed-tensors: an exact module name, or ``re:<regex>`` matched from the start."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern


def _bad(field: str, value: Any, why: str) -> UnsupportedQuantization:
    return UnsupportedQuantization(f"quantization_config.{field} {value!r} is not supported: {why}")


def parse_quantization(hf: dict[str, Any]) -> Fp8Config | None:
    """config.json's ``quantization_config`` -> Fp8Config, None when absent."""
    q = hf.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise _bad("", q, "expected an object")
    method = q.get("quant_method")
    if method == "fp8":
        return _parse_fp8(q)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(q)
    raise _bad("quant_method", method,
               "ftserve serves fp8 checkpoints (quant_method fp8, or compressed-tensors float-quantized)")


def _parse_fp8(q: dict[str, Any]) -> Fp8Config:
    block = q.get("weight_block_size", list(BLOCK))
    if block is None or list(block) != list(BLOCK):
        raise _bad("weight_block_size", block, "ftserve's fp8 kernels take blocks of [128, 128]")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise _bad("activation_scheme", scheme, "only dynamic activation scales")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _bad("fmt", fmt, "weights must be float8 e4m3")
    scale_fmt = q.get("scale_fmt")
    if scale_fmt not in (None, "ue8m0", "float32"):
        raise _bad("scale_fmt", scale_fmt, "scales must be fp32")
    skip = list(q.get("modules_to_not_convert") or []) + list(q.get("ignored_layers") or [])
    return Fp8Config("fp8", "block", "weight_scale_inv", tuple(str(s) for s in skip))


def _parse_compressed_tensors(q: dict[str, Any]) -> Fp8Config:
    if q.get("kv_cache_scheme") is not None:
        raise _bad("kv_cache_scheme", q["kv_cache_scheme"], "use --kv-cache-dtype fp8_e4m3 instead")
    if q.get("sparsity_config"):
        raise _bad("sparsity_config", q["sparsity_config"], "sparse checkpoints are not served")
    groups = q.get("config_groups") or {}
    if not groups:
        raise _bad("config_groups", groups, "expected one quantization scheme for the Linear layers")
    strategies = set()
    for name, g in groups.items():
        field = f"config_groups.{name}"
        fmt = g.get("format") or q.get("format")
        if fmt != "float-quantized":
            raise _bad(f"{field}.format" if g.get("format") else "format", fmt,
                       "only float-quantized (fp8) weights")
        targets = g.get("targets") or []
        if "Linear" not in targets:
            raise _bad(f"{field}.targets", targets, "the scheme must target Linear layers")
        w = g.get("weights") or {}
        if w.get("num_bits") != 8 or w.get("type") != "float":
            raise _bad(f"{field}.weights", {k: w.get(k) for k in ("num_bits", "type")},
                       "weights must be 8-bit float (e4m3)")
        if w.get("symmetric", True) is not True or w.get("group_size") is not None:
            raise _bad(f"{field}.weights", {k: w.get(k) for k in ("symmetric", "group_size")},
                       "weights must be symmetric, without groups")
        strategy = w.get("strategy")
        if strategy not in ("tensor", "channel", "block"):
            raise _bad(f"{field}.weights.strategy", strategy, "tensor, channel or block")
        if strategy == "block" and list(w.get("block_structure") or []) != list(BLOCK):
            raise _bad(f"{field}.weights.block_structure", w.get("block_structure"),
                       "ftserve's fp8 kernels take blocks of [128, 128]")
        a = g.get("input_activations")
        if a is not None and (a.get("num_bits") != 8 or a.get("type") != "float"):
            raise _bad(f"{field}.input_activations", {k: a.get(k) for k in ("num_bits", "type")},
                       "activations, when quantized, must be 8-bit float")
        strategies.add(strategy)
    if len(strategies) != 1:
        raise _bad("config_groups", sorted(strategies), "all groups must scale weights the same way")
    return Fp8Config("compressed-tensors", strategies.pop(), "weight_scale",
                     tuple(str(s) for s in q.get("ignore") or []))
