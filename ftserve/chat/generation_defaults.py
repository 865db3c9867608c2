"""Sampling defaults from the checkpoint's generation_config.json (--generation-config auto).

Model makers publish the sampling they recommend there (Qwen3: temperature 0.6,
top_p 0.95, top_k 20); a request that leaves a field out gets that value instead of
the neutral one (temperature 1, no filters), as vLLM does. A field the request sets
always wins. ``do_sample: false`` means greedy decoding in transformers, so its
sampling fields are not applied then (nothing is: the neutral defaults stay).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from ftserve.engine.sampling_params import SamplingParams, SamplingParamsError

log = logging.getLogger(__name__)

# The generation_config.json keys read, each the SamplingParams field of that name
# and read as this type.
_FIELDS: dict[str, type] = {"temperature": float, "top_p": float, "top_k": int, "min_p": float,
                            "repetition_penalty": float}


def sampling_defaults(model_dir: str) -> dict[str, Any]:
    """The SamplingParams kwargs the checkpoint recommends; {} if none (or unreadable)."""
    path = Path(model_dir) / "generation_config.json"
    try:
        cfg = json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError):  # none, or a GGUF file (no side files)
        return {}
    except (OSError, ValueError) as err:
        log.warning("ignoring %s: %s", path, err)
        return {}
    if not isinstance(cfg, dict) or cfg.get("do_sample") is False:
        return {}
    out: dict[str, Any] = {}
    for key, kind in _FIELDS.items():
        value = cfg.get(key)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if kind is int and value != int(value):
            continue
        candidate = {**out, key: kind(value)}
        try:
            SamplingParams(**candidate).validate()
        except SamplingParamsError as err:
            log.warning("ignoring %s's %s=%r: %s", path.name, key, value, err)
            continue
        out = candidate
    return out
