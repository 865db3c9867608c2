"""Tile configs of the grouped-GEMM fused MoE (moe_triton): the dataclass, the
built-in heuristic, and per-device tables written by tools/tune/moe.py.

A table is JSON, one file per device (``configs/moe_<device name>.json``, the
name from ``torch.cuda.get_device_name`` with every non-alphanumeric character
turned into ``_``), or the file KernelConfig.moe_table names
(FTSERVE_MOE_CONFIG_FILE at start-up)::

    {"device": "NVIDIA H200",
     "configs": {"E=128,H=2048,I=768,k=8": {"4096": {"block_m": 128, "block_n": 128, ...},
                                             "8192": {...}}}}

Keys under a shape are token counts T (pairs / k) the tuner measured. A batch
of T tokens takes the entry of the tuned T nearest in log scale if it is within
a factor of 2, the largest entry past the largest tuned T, else the heuristic
(a prefill-tuned tile is wrong for decode). A table that exists but does not
parse or holds unknown fields is an error that names the file: a silently
ignored table would leave the slow default in place unnoticed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from ftserve_kernels import config_tables as tables
from ftserve_kernels.config import DEFAULT_KERNELS, KernelConfig
from ftserve_kernels.config_tables import CONFIG_DIR, device_slug  # noqa: F401 - re-exported

NEAREST_RATIO = 2.0  # a tuned T serves batches within this factor of it


@dataclass(frozen=True)
class MoeConfig:
    """Tiles of the two grouped GEMMs. They share ``block_m`` (one alignment
    feeds both); the ``down_*`` fields tune the down GEMM on its own, 0 means
    "same as gate/up"."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    down_block_n: int = 0
    down_block_k: int = 0
    down_num_warps: int = 0
    down_num_stages: int = 0
    down_group_m: int = 0
    align_chunk: int = 0  # pairs per moe_align program; 0: moe_align's default

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"MoeConfig.{f.name} must be a non-negative int, got {v!r}")
        for name in ("block_m", "block_n", "block_k", "down_block_n", "down_block_k", "align_chunk"):
            v = getattr(self, name)
            if v and v & (v - 1):
                raise ValueError(f"MoeConfig.{name} must be a power of two, got {v}")
        if min(self.block_m, self.block_n, self.block_k, self.group_m,
               self.num_warps, self.num_stages) == 0:
            raise ValueError(f"MoeConfig gate/up fields must be positive: {self}")

    @property
    def down(self) -> tuple[int, int, int, int, int]:
        """(block_n, block_k, group_m, num_warps, num_stages) of the down GEMM,
        defaults resolved."""
        return (self.down_block_n or self.block_n, self.down_block_k or self.block_k,
                self.down_group_m or self.group_m, self.down_num_warps or self.num_warps,
                self.down_num_stages or self.num_stages)

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> MoeConfig:
        return tables.from_dict(MoeConfig, d)

    @staticmethod
    def pick(num_pairs: int, num_experts: int, device: torch.device,
             hidden: int = 0, inter: int = 0, top_k: int = 0,
             kernels: KernelConfig = DEFAULT_KERNELS) -> MoeConfig:
        """The entry of the table ``kernels`` names (else the device's packaged
        one) for this shape and batch if there is one, else the heuristic from
        the average rows per expert (host shapes, never data). Without
        ``hidden``/``inter``/``top_k`` only the heuristic applies."""
        if device.type != "cuda" or not (hidden and inter and top_k):
            return heuristic(num_pairs, num_experts, device.type)
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _pick(num_pairs, num_experts, index, hidden, inter, top_k, kernels.moe_table)


def heuristic(num_pairs: int, num_experts: int, device_type: str) -> MoeConfig:
    """The untuned choice: tiles grow with the average rows per expert."""
    if device_type != "cuda":
        return MoeConfig(16, 16, 16, 2, 4, 1)  # the interpreter: small tiles are fast
    avg = num_pairs / num_experts
    if avg <= 8:  # decode: weight-bandwidth bound, many narrow column blocks
        return MoeConfig(16, 32, 128, 1, 4, 4)
    if avg <= 32:
        return MoeConfig(32, 64, 64, 4, 4, 4)
    if avg <= 96:
        return MoeConfig(64, 64, 64, 8, 4, 4)
    return MoeConfig(128, 64, 64, 8, 8, 3)


def shape_key(num_experts: int, hidden: int, inter: int, top_k: int) -> str:
    return f"E={num_experts},H={hidden},I={inter},k={top_k}"


def parse_shape_key(key: str) -> tuple[int, int, int, int]:
    """shape_key's inverse: "E=..,H=..,I=..,k=.." -> (E, H, I, k)."""
    parts = dict(p.split("=") for p in key.split(","))
    return int(parts["E"]), int(parts["H"]), int(parts["I"]), int(parts["k"])


def table_file_name(device_name: str) -> str:
    return tables.file_name("moe", device_name)


Table = dict[str, dict[int, MoeConfig]]  # shape key -> tuned T -> config
_WHAT = "MoE config table (regenerate it with tools/tune/moe.py or unset FTSERVE_MOE_CONFIG_FILE)"


def _entry(key: str, raw: Any) -> MoeConfig | None:
    if raw is None:
        parse_shape_key(key)  # a key that is no shape is a bad table
        return None
    return MoeConfig.from_dict(raw)


def load_table(path: str) -> Table:
    """Parse and validate a table (config_tables.load); the runtime asks once
    per batch shape, so a table changed under a running server is seen only by
    shapes it has not met yet."""
    return tables.load(path, _WHAT, _entry)


def lookup(table: Table, shape: str, tokens: int) -> MoeConfig | None:
    """The entry for ``tokens`` under ``shape`` (rule in the module docstring)."""
    by_t = table.get(shape)
    if not by_t or tokens <= 0:
        return None
    largest = max(by_t)
    if tokens >= largest:
        return by_t[largest]
    nearest = min(by_t, key=lambda t: (abs(math.log(tokens / t)), t))
    if abs(math.log(tokens / nearest)) <= math.log(NEAREST_RATIO) + 1e-9:
        return by_t[nearest]
    return None


def table_for(device_index: int, override: str | None) -> Table:
    """The override file if given (it must exist), else the packaged table of
    this device, else an empty table."""
    return tables.table_for(device_index, override, "moe", _WHAT, _entry)


@functools.lru_cache(maxsize=512)
def _pick(num_pairs: int, num_experts: int, device_index: int, hidden: int, inter: int,
          top_k: int, override: str | None) -> MoeConfig:
    # Cached: asked once per MoE layer per step.
    cfg = lookup(table_for(device_index, override),
                 shape_key(num_experts, hidden, inter, top_k), num_pairs // top_k)
    return cfg if cfg is not None else heuristic(num_pairs, num_experts, "cuda")
