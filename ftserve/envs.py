"""Every FTSERVE_* environment variable, typed, in one place.

Operational settings only, read once at start-up (engine/setup.py), never on
the step path. Kernel choices are not here: they are a KernelConfig
(ftserve_kernels/config.py) built from the flags (``--kernels``,
``--disable-pdl``) and the two table files below.

    FTSERVE_CACHE_DIR         where the embedded demo checkpoint is written
    FTSERVE_GEMV_CONFIG_FILE  a decode GEMV launch table instead of the packaged one
    FTSERVE_MOE_CONFIG_FILE   a MoE tile table instead of the packaged one
    FTSERVE_API_KEY           the API key when no flag gives one (not shown by ps)
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """FTSERVE_CACHE_DIR: where the embedded demo checkpoint is written and models
    fetched by name are kept, under models/ (default ~/.cache/ftserve)."""
    return Path(os.environ.get("FTSERVE_CACHE_DIR", Path.home() / ".cache" / "ftserve"))


def gemv_config_file() -> Path | None:
    """FTSERVE_GEMV_CONFIG_FILE: a decode GEMV launch table (tools/tune/gemv.py
    output) used instead of the packaged ftserve_kernels/configs/gemv_<device>.json."""
    value = os.environ.get("FTSERVE_GEMV_CONFIG_FILE")
    return Path(value) if value else None


def moe_config_file() -> Path | None:
    """FTSERVE_MOE_CONFIG_FILE: a MoE tile table (tools/tune/moe.py output) used
    instead of the packaged ftserve_kernels/configs/moe_<device>.json."""
    value = os.environ.get("FTSERVE_MOE_CONFIG_FILE")
    return Path(value) if value else None


def api_key() -> str | None:
    """FTSERVE_API_KEY: the server's API key when neither --api-key nor --api-key-file
    gives one (an environment variable does not show in ps as a flag does). None
    when unset; set but empty is a start-up error (cli.py), never "no auth"."""
    return os.environ.get("FTSERVE_API_KEY")
