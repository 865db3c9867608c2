"""Every FTSERVE_* environment variable, typed, in one place.

Read at call time (not import time) so tests and benchmarks can flip them per
run. Kernel switches that are off by default exist until the H200 numbers say
which variant wins; see BENCHMARKS.md.
"""

from __future__ import annotations

import os
from pathlib import Path


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value not in ("0", "false", "False", "no")


def cache_dir() -> Path:
    """FTSERVE_CACHE_DIR: where the embedded demo checkpoint is written
    (default ~/.cache/ftserve)."""
    return Path(os.environ.get("FTSERVE_CACHE_DIR", Path.home() / ".cache" / "ftserve"))


def kernels() -> str:
    """FTSERVE_KERNELS: auto (Triton on CUDA tensors, torch elsewhere) | triton | torch."""
    return os.environ.get("FTSERVE_KERNELS", "auto")


def gemv_entries() -> str:
    """FTSERVE_GEMV_ENTRY: GEMV launch entries laid over the device table, for
    in-context tuning runs (tools.bench_decode_variants): ``KEY@T=BN.BK.W.S``
    joined by ";", KEY the table key with "+" for its commas, e.g.
    "dense:N=2048+K=4096@1=4.512.8.3" (gemv_configs.parse_entries)."""
    return os.environ.get("FTSERVE_GEMV_ENTRY", "")


def moe_config_file() -> Path | None:
    """FTSERVE_MOE_CONFIG_FILE: a MoE tile table (tools/tune_moe.py output) used
    instead of the packaged ftserve_kernels/configs/moe_<device>.json."""
    value = os.environ.get("FTSERVE_MOE_CONFIG_FILE")
    return Path(value) if value else None


def gemv_config_file() -> Path | None:
    """FTSERVE_GEMV_CONFIG_FILE: a decode GEMV launch table (tools/tune_gemv.py
    output) used instead of the packaged ftserve_kernels/configs/gemv_<device>.json."""
    value = os.environ.get("FTSERVE_GEMV_CONFIG_FILE")
    return Path(value) if value else None


def pdl() -> bool:
    """FTSERVE_PDL (default on): decode-path Triton kernels launch with
    programmatic dependent launch on sm_90+ (ftserve_kernels/pdl.py); 0: off."""
    return _flag("FTSERVE_PDL", True)
