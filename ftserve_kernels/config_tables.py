"""Per-device JSON tables of kernel launch configs, shared by moe_configs (the
grouped-GEMM MoE tiles) and gemv_configs (the decode GEMV launches).

A table is ``configs/<prefix>_<device>.json`` (the device name from
``torch.cuda.get_device_name`` with every non-alphanumeric character turned
into ``_``) or the file an environment variable names; only its ``configs``
object is read: ``{key: {token count: entry}}``. A table that exists but does
not parse is an error naming the file: a silently ignored table would leave
the slow default in place unnoticed.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

CONFIG_DIR = Path(__file__).parent / "configs"

C = TypeVar("C")
# (key, the entry's JSON object) -> the parsed entry; raises on a bad one. Also
# called as (key, None) once per key, entries or not: a bad key raises there.
EntryParser = Callable[[str, Any], Any]


@functools.lru_cache(maxsize=8)
def device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_slug(name: str) -> str:
    return re.sub(r"[^0-9A-Za-z]", "_", name)


def file_name(prefix: str, device: str) -> str:
    return f"{prefix}_{device_slug(device)}.json"


def from_dict(cls: type[C], d: dict[str, Any]) -> C:
    """A config dataclass from a table entry; unknown fields are an error."""
    unknown = set(d) - {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields {sorted(unknown)}")
    return cls(**d)


def load(path: str, what: str, parse_entry: EntryParser) -> dict[str, dict[int, Any]]:
    """Parse and validate a table; a bad file raises ValueError naming it and
    ``what`` (e.g. "MoE config table (tools/tune/moe.py, FTSERVE_MOE_CONFIG_FILE)").
    Parsed once per file version: a rewritten file is read again."""
    try:
        st = Path(path).stat()
    except OSError as exc:
        raise _bad(path, what, exc) from exc
    return _parse(path, st.st_mtime_ns, st.st_size, what, parse_entry)


def _bad(path: str, what: str, exc: Exception) -> ValueError:
    return ValueError(f"bad {what} {path}: {type(exc).__name__}: {exc}")


@functools.lru_cache(maxsize=32)
def _parse(path: str, mtime_ns: int, size: int, what: str,
           parse_entry: EntryParser) -> dict[str, dict[int, Any]]:
    try:
        configs = json.loads(Path(path).read_text())["configs"]
        if not isinstance(configs, dict):
            raise TypeError("'configs' is not an object")
        out: dict[str, dict[int, Any]] = {}
        for key, by_t in configs.items():
            parse_entry(key, None)
            out[key] = {int(t): parse_entry(key, c) for t, c in by_t.items()}
        return out
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise _bad(path, what, exc) from exc


def table_for(device_index: int, override: str | None, prefix: str, what: str,
              parse_entry: EntryParser) -> dict[str, dict[int, Any]]:
    """The override file if given (it must exist), else the packaged table of
    this device, else an empty table."""
    if override is not None:
        return load(override, what, parse_entry)
    path = CONFIG_DIR / file_name(prefix, device_name(device_index))
    return load(str(path), what, parse_entry) if path.is_file() else {}
