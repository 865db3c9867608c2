"""Launch configs of the decode GEMV kernels (gemv_triton, moe_gemv_triton):
the dataclass, today's defaults, and per-device tables written by tools/tune/gemv.py.

A table is JSON, one file per device (``configs/gemv_<device name>.json``, the
name slugged as moe_configs does), or the file KernelConfig.gemv_table names
(FTSERVE_GEMV_CONFIG_FILE at start-up)::

    {"configs": {"moe_gate_up:E=128,H=2048,I=768,k=8": {"1": {"block_n": 32, "block_k": 256,
                                                              "num_warps": 4, "num_stages": 2},
                                                        "2": {...}},
                 "dense:N=5120,K=2048": {"1": {...}}}}

A key is ``<kind>:<shape>``; the kinds and the kernel each one launches:

    moe_gate_up      _gemv_gate_up_kernel           shape E,H,I,k; T = tokens
    moe_down         _gemv_down_combine3d_kernel    shape E,H,I,k; T = tokens
    dense            _gemv_kernel                   shape N,K; T = the row block 1, 2 or 4
    dense_fp8        _gemv_kernel (FP8: e4m3 W)     shape N,K; T = the row block 1, 2 or 4

An entry applies only to the T it was tuned at (for the dense kernel the row
block next_power_of_2(T), which is what the kernel specializes on): these
kernels' registers and grid scale with T, so a neighbour's entry is no safe
guess; any other T, shape or kind takes the kernel's default (``default``,
exactly the launch used before tables existed). KernelConfig.gemv_entries lays single
entries over the table (``parse_entries``: a tuning run's variants, in the
step itself rather than alone as tools/tune/gemv times them). Tables are read on CUDA only;
the interpreter keeps its small tiles. A table that exists but does not parse,
names an unknown kind or holds unknown fields is an error naming the file
(same policy as moe_configs: a silently ignored table hides the slow default).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch

from ftserve_kernels import config_tables as tables
from ftserve_kernels.config import DEFAULT_KERNELS, KernelConfig
from ftserve_kernels.config_tables import CONFIG_DIR  # noqa: F401 - re-exported
from ftserve_kernels.moe_configs import shape_key as moe_shape_key

MOE_KINDS = ("moe_gate_up", "moe_down")
FP8_MOE_KINDS = ("moe_fp8_gate_up", "moe_fp8_down")  # fp8_moe_gemv_triton's pair
DENSE_KINDS = ("dense", "dense_fp8")
KINDS = MOE_KINDS + FP8_MOE_KINDS + DENSE_KINDS


@dataclass(frozen=True)
class GemvConfig:
    """One GEMV kernel's launch parameters: output columns (rows of W) per
    program, K elements per step, warps, and software-pipeline stages (only the
    kernel with a runtime K loop, moe_gate_up, pipelines)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"GemvConfig.{f.name} must be a positive int, got {v!r}")
        for name in ("block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if v & (v - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two, got {v}")

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> GemvConfig:
        return tables.from_dict(GemvConfig, d)


def default(kind: str, cuda: bool, n: int = 0, tokens: int = 1, k: int = 0) -> GemvConfig:
    """The launch each kernel used before tables existed (keep it so: no table
    must mean no change). ``n``/``tokens`` (and ``k``, dense_fp8) matter for the
    dense kinds only.
    num_stages 3 where the launch passed none: Triton's CUDA default."""
    if kind not in KINDS:
        raise ValueError(f"unknown GEMV kernel kind {kind!r}; known: {KINDS}")
    if not cuda:  # the interpreter: small tiles are fast, warps and stages are ignored
        if kind in DENSE_KINDS:
            return GemvConfig(8, 16, 1, 3)
        if kind in FP8_MOE_KINDS:  # a scale group's columns (fp8_quant.GROUP) a step
            return GemvConfig(16, 128, 4, 1)
        return GemvConfig(16, 16, 4, 1)
    if kind in FP8_MOE_KINDS:
        # fp8_moe_gemv_triton: a gate/up program streams 2 x 8 rows in steps of 512
        # codes a row (a lane's 16-byte load, one scale a lane); a down program 8
        # choices x 4 rows in steps of one scale group (128 codes). No stages: the
        # K loops are unrolled.
        return GemvConfig(8, 512, 8, 1) if kind == "moe_fp8_gate_up" else GemvConfig(4, 128, 4, 1)
    if kind == "dense_fp8":
        # 512 codes a row step (a lane's 16-byte load, one scale a lane), 4 warps;
        # at one row 4 weight rows a program at K 2048 (qkv: 1280 programs of
        # 8 KB), 8 at K >= 4096 (o_proj: 256 of 32 KB, the tuned bf16 o_proj's
        # grid); past one row 4 (an accumulator tile per row: <= 140 registers
        # at 4 rows, no spills; tests/test_kernels_fp8_sm90_compile.py).
        return GemvConfig(8 if k >= 4096 and tokens == 1 else 4, 512, 4, 1)
    if kind in DENSE_KINDS:
        # gemv_triton's reasoning: 16 rows of 256 per program at qkv's N, 8 where
        # 4 rows of 16 would spill.
        return GemvConfig(16 if n >= 4096 and tokens <= 2 else 8, 256, 8, 3)
    return {"moe_gate_up": GemvConfig(16, 512, 8, 2),
            "moe_down": GemvConfig(8, 256, 8, 2)}[kind]


def moe_key(kind: str, num_experts: int, hidden: int, inter: int, top_k: int) -> str:
    assert kind in MOE_KINDS + FP8_MOE_KINDS, kind
    return f"{kind}:{moe_shape_key(num_experts, hidden, inter, top_k)}"


def dense_key(n: int, k: int, fp8: bool = False) -> str:
    return f"{'dense_fp8' if fp8 else 'dense'}:N={n},K={k}"


def parse_key(key: str) -> tuple[str, dict[str, int]]:
    """"kind:A=1,B=2" -> ("kind", {"A": 1, "B": 2}); ValueError on an unknown kind."""
    kind, _, shape = key.partition(":")
    if kind not in KINDS:
        raise ValueError(f"unknown GEMV kernel kind {kind!r} in key {key!r}; known: {KINDS}")
    parts = dict(p.split("=") for p in shape.split(",")) if shape else {}
    return kind, {name: int(v) for name, v in parts.items()}


def table_file_name(device_name: str) -> str:
    return tables.file_name("gemv", device_name)


Table = dict[str, dict[int, GemvConfig]]  # key -> tuned T -> config
_WHAT = "GEMV config table (regenerate it with tools/tune/gemv.py or unset FTSERVE_GEMV_CONFIG_FILE)"


def _entry(key: str, raw: Any) -> GemvConfig | None:
    if raw is None:
        parse_key(key)  # an unknown kernel kind is a bad table
        return None
    return GemvConfig.from_dict(raw)


def load_table(path: str) -> Table:
    """Parse and validate a table (config_tables.load)."""
    return tables.load(path, _WHAT, _entry)


def table_for(device_index: int, override: str | None) -> Table:
    """The override file if given (it must exist), else the packaged table of
    this device, else an empty table."""
    return tables.table_for(device_index, override, "gemv", _WHAT, _entry)


def parse_entries(text: str) -> Table:
    """KernelConfig.gemv_entries -> a table: ``KEY@T=BN.BK.W.S`` joined by
    ";", KEY a table key with "+" for its commas (a comma-free form, so a
    variant list can hold it). ValueError names the entry that does not parse."""
    out: Table = {}
    for item in filter(None, (p.strip() for p in text.split(";"))):
        key, at, rest = item.partition("@")
        t, eq, fields = rest.partition("=")
        try:
            if not (at and eq):
                raise ValueError("not KEY@T=BN.BK.W.S")
            key = key.replace("+", ",")
            parse_key(key)
            config = GemvConfig(*(int(v) for v in fields.split(".")))
            out.setdefault(key, {})[int(t)] = config
        except (TypeError, ValueError) as e:
            raise ValueError(f"GEMV entry {item!r}: {e}") from None
    return out


def pick(key: str, tokens: int, device: torch.device,
         kernels: KernelConfig = DEFAULT_KERNELS) -> GemvConfig | None:
    """The entry for ``key`` at ``tokens`` (host ints, never data) of the table
    ``kernels`` names (else the device's packaged one), or None: the caller
    launches its default. ``kernels.gemv_entries`` win over the table's. None
    off CUDA."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _pick(key, tokens, index, kernels.gemv_table, kernels.gemv_entries)


@functools.lru_cache(maxsize=512)
def _pick(key: str, tokens: int, device_index: int, override: str | None, entries: str) -> GemvConfig | None:
    # Cached: asked once per GEMV launch (several per layer per step).
    laid = parse_entries(entries).get(key, {}).get(tokens)
    return laid if laid is not None else table_for(device_index, override).get(key, {}).get(tokens)
