"""Shared test set-up: CPU-friendly threading and the `gpu` marker."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
if not torch.cuda.is_available():
    # Triton kernels run on the CPU through the interpreter. Set before any
    # kernel module is imported: @triton.jit reads it when a kernel is defined.
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("FTSERVE_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".pytest_ftserve_cache"))

# The `live` (demo server, one per module) and `client` (openai) fixtures; a
# module that needs another server defines its own `live`, which wins. The real
# small model's fixtures (fetched once per run): tests/real_model.py.
pytest_plugins = ["tests.server_harness", "tests.real_model"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With FTSERVE_LIVE_REPORT=PATH, each failure's traceback and each test's
    duration are appended to PATH as they happen: a run killed at a device call's
    time limit still says what failed and why (pytest's summary comes only at the end)."""
    path = os.environ.get("FTSERVE_LIVE_REPORT")
    if not path or (report.when != "call" and not report.failed):
        return
    with open(path, "a") as f:
        f.write(f"{report.outcome.upper()} {report.nodeid} ({report.when}, {report.duration:.1f} s)\n")
        if report.failed:
            f.write(report.longreprtext[-6000:] + "\n\n")
