"""The engine every engine benchmark measures (dummy weights, 16-token pages, CUDA
graphs up to the largest decode batch), stepped with ftserve.engine.driver's
EngineDriver; tools/bench/engine_measure.py holds what is timed with it.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from ftserve.config import EngineConfig
from ftserve.engine.engine import Engine


def build(args: argparse.Namespace, model_dir: str, device: torch.device, **overrides: Any) -> Engine:
    """The benchmarked engine. ``args`` carries dtype, kv_tokens, chunk (the
    prefill chunk), batches (decode batch sizes) and max_len, as
    tools/bench/engine.parse_args sets them; ``overrides``: other EngineConfig
    fields, or these replaced (tools/bench/hybrid.py: the state checkpoints;
    tools/bench/spec_trace.py: a GGUF's load format, speculation)."""
    from ftserve.engine.setup import build_engine

    fields: dict[str, Any] = dict(
        model=model_dir, load_format="dummy", dtype=args.dtype, device=str(device),
        page_size=16, kv_cache_tokens=args.kv_tokens, max_prefill_length=args.chunk,
        max_running_requests=max(args.batches), cuda_graph_max_bs=max(args.batches),
        attention_backend="auto", status_log_interval=0.0, max_model_len=args.max_len,
    )
    return build_engine(EngineConfig(**{**fields, **overrides}))

