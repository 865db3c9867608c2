"""The harness the kernel tuners share (tools/tune/moe, tools/tune/gemv).

A run has a deadline and a progress log, and owns one per-device JSON table
({"configs", "timings", "meta"}) that it rewrites whole after every result, so
a run cut by its budget still leaves a valid table. A sweep times candidate
configs in order until the deadline, each one checked against the reference
before it is timed and skipped (with its reason) if it fails to compile or to
match. What to sweep, how to launch, check and time a kernel, and how an entry
merges into the table stay in each tuner.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Hashable, Iterable
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
import triton

SMEM_LIMIT = 227 * 1024  # H100/H200 dynamic shared memory per block
REL_TOL = 2e-2  # bf16 output vs the fp32-accumulated reference

C = TypeVar("C", bound=Hashable)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))


def check_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Raise if a candidate's output is not the reference at bf16 tolerance:
    a fast config that computes something else must never be timed."""
    err = rel_err(out, ref)
    if not err < REL_TOL:
        raise ValueError(f"rel err {err:.2e} vs reference")


def us(s: float | None) -> float | None:
    return None if s is None else round(s * 1e6, 2)


def round_robin(groups: list[list[C]], cap: int) -> list[C]:
    """At most ``cap`` configs: the first of every group, then the second of
    every group, ... so a small cap still covers every group (tile shape)
    before it tries a second variant of any."""
    out: list[C] = []
    for rank in range(max((len(g) for g in groups), default=0)):
        for g in groups:
            if rank < len(g) and len(out) < cap:
                out.append(g[rank])
    return out


class Sweep(Generic[C]):
    """Seconds per call of one kernel under each config tried, each config
    measured at most once. ``measure`` checks the output before it times and
    raises on a config that fails; ``label`` prefixes its skip line."""

    def __init__(self, measure: Callable[[C], float], log: Callable[[str], None], label: str = "") -> None:
        self.measure, self.log, self.label = measure, log, label
        self.times: dict[C, float] = {}
        self.skipped = 0

    def attempt(self, cfg: C) -> None:
        if cfg in self.times:
            return
        try:
            self.times[cfg] = self.measure(cfg)
        except Exception as exc:  # out of resources, compile error, mismatch: skip it
            self.skipped += 1
            self.log(f"  skip {self.label}{cfg}: {type(exc).__name__}: {str(exc)[:120]}")


def attempt_until(deadline: float, jobs: Iterable[tuple[Sweep[C], C]]) -> bool:
    """Attempt each (sweep, config) in order while the clock is before
    ``deadline`` (checked before every config, as one may take seconds to
    compile); True if the deadline cut the list short. ``jobs`` may be a
    generator: later configs can depend on the times of earlier ones."""
    for sweep, cfg in jobs:
        if time.monotonic() > deadline:
            return True
        sweep.attempt(cfg)
    return False


class TuneRun:
    """One tuner run: its deadline, the progress log (stderr, seconds since
    the start), and the table file ``table_file_name(device name)`` in
    ``out_dir``, loaded if it exists so that a run merges into the last one."""

    def __init__(self, out_dir: Path, budget_s: float, device: torch.device,
                 table_file_name: Callable[[str], str]) -> None:
        self.t0 = time.monotonic()
        self.deadline = self.t0 + budget_s
        self.out_dir = out_dir
        self.device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / table_file_name(self.device_name)
        self.table: dict[str, Any] = json.loads(self.path.read_text()) if self.path.is_file() else {}
        self.table.setdefault("configs", {})  # a valid (empty) table even if the budget allows nothing

    def log(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    def stamp(self, **measured: Any) -> None:
        """Write the table with this run's meta: device, versions, and the
        reference rates measured in the same run (``measured``, in order)."""
        self.table["meta"] = {"device": self.device_name, "torch": torch.__version__,
                              "triton": triton.__version__, **measured,
                              "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self.save(self.table)

    def save(self, table: dict[str, Any]) -> None:
        self.table = table
        self.path.write_text(json.dumps(table, indent=1))

    def finish(self, report_name: str, md: str) -> Path:
        """The markdown report to stdout and ``out_dir/report_name``; returns the table path."""
        (self.out_dir / report_name).write_text(md + "\n")
        print(md)
        self.log(f"wrote {self.path}")
        return self.path
