"""Where a speculative verify step's time goes: the GPU timeline of the engine's
own step loop, per step kind, against plain decoding on the same engine.

    # on the GPU, one bounded run (no network there: the real model's GGUF by path);
    # the engine build (not bounded) is most of it with a cold Triton cache
    python -m tools.bench.spec_trace --gguf /tmp/smollm2.gguf --out OUT/trace --budget-s 120
    # no model file to carry: SmolLM2's shape with random weights (every step still
    # verifies a draft; the kernels are the same, only fewer draft tokens are kept)
    python -m tools.bench.spec_trace --preset smollm2-135m --out OUT/trace --budget-s 120
    # on the CPU, to check the script (tiny-dense, no graphs, CPU ops stand in for kernels)
    python -m tools.bench.spec_trace --smoke --out /tmp/spec_trace

The engine is built as tools/bench/spec.py's server builds it: --speculative
ngram with 4 draft tokens, CUDA graphs for decode, prefill and verify steps
sized for --max-running requests (16: spec.py's largest default batch; the
verify graph a step replays is the smallest token bucket >= its tokens, one
request's k + 1 a bucket of its own: prefill_graph.verify_buckets), the
model's dtype; but with the speculation gate off, so every step may verify,
and decode graphs captured only up to the size the server pads --batch to
(the same graph replays; a cold build compiles less).
--batch requests each get a prompt of --prompt-tokens that repeats one random
block of --period tokens (a text the model can copy: n-gram drafts find their
continuation in it). Three phases run on that one engine, in this order:

    verify       speculation on, a draft at every step: the n-gram draft where
                 the text has one, else the request's last k tokens (no
                 back-off; --drafts ngram: the engine's own speculator). Each
                 step replays the verify graph, samples its rows eagerly and is
                 read back before the next is planned.
    decode       speculation off: plain decode graph replays, overlapped as the
                 engine runs them (step N+1 planned and launched while step N runs).
    decode_sync  speculation on but no draft ever found: the same decode graph,
                 read back before the next step is planned (a drafting request's
                 steps lose overlap; this isolates that from the verify graph).

Each phase: warm-up steps (the prompts' prefill included), --steps timed steps
without the profiler (wall time per step, tokens per step, tokens/s), then
--trace-steps steps under torch.profiler (CPU + CUDA activity), each inside a
record_function window. Every CUDA op is assigned to the step whose window
issued it: by the profiler's correlation id, which ties a kernel or copy to the
runtime call that launched it (every kernel of a CUDA graph to its
cudaGraphLaunch), else by the torch op its launch ran inside, else by its
start time (the JSON's "assigned" counts each way). Per step: its period (first GPU op of
the step to the first of the next), the time inside its graph replay (first to
last graph kernel), the time between graphs (period - graph: eager kernels,
copies and the GPU idle while the host reads back, commits, drafts, plans and
launches), the GPU idle time alone, and its ops. Per step kind (decode,
verify, prefill): the medians, and every kernel's count and device time per
step (the top ones in the summary). Then decode vs verify kernel by kernel:
which kernels the verify step runs that decode does not, and the reverse.

--host-calls runs each phase's timed steps once more with a perf_counter
around each of the step's main host calls (HOST_CALLS: planning, packing,
the graph launch, sampling, the read-back and its wait, committing): their
calls and median microseconds per step, without cProfile's slow-down
(--host-profile: every engine function, under cProfile).

The run stops itself within --budget-s: phases that would start past it are
skipped, and a phase's step loops end at its share of what is left (the
engine build is not bounded). Output: --out/spec_trace.json (or --out itself
where it ends in .json) and the markdown summary, printed and written beside it.

On the CPU (--smoke) there are no graphs and no CUDA ops: each step's
top-level torch ops stand in for its kernels (CPU activity), which exercises
the same step windows, classification and tables.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import importlib
import pstats
import random
import statistics
import time
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ftserve.engine.cuda_graph import graph_batch_sizes
from ftserve.engine.driver import EngineDriver
from ftserve.engine.request import Req, ReqState
from ftserve.engine.scheduler import ScheduledBatch
from ftserve.engine.spec.speculator import SpecState, Speculator
from tools.bench.common import (
    DeviceOp,
    LaunchCall,
    cuda_ops,
    launch_calls,
    markdown_table,
    merged,
    run_section,
    say,
    start_run,
    sync,
    write_json,
)
from tools.bench.engine_driver import build

PHASES = ("verify", "decode", "decode_sync")
# The speculator each phase runs with (None: speculation off).
PHASE_DRAFTS = {"verify": "always", "decode": None, "decode_sync": "never"}
WINDOW = "spec_trace.step"  # record_function name prefix of a traced step
TOP_KERNELS = 14
HOST_TOP = 24  # host functions listed per phase (--host-profile)
# (module, class, method) timed per call by --host-calls: a step's host path.
HOST_CALLS = (
    ("ftserve.engine.scheduler", "Scheduler", "schedule"),
    ("ftserve.engine.spec.speculator", "Speculator", "propose"),
    ("ftserve.engine.runner", "ModelRunner", "launch"),
    ("ftserve.engine.prefill_graph", "PrefillGraphs", "_fill"),
    ("ftserve.engine.prefill_graph", "PrefillGraphs", "replay"),
    ("ftserve.engine.cuda_graph", "DecodeGraphs", "replay"),
    ("torch.cuda", "CUDAGraph", "replay"),
    ("ftserve.engine.sampler", "Sampler", "sample"),
    ("ftserve.engine.runner", "ModelRunner", "_copy_out"),
    ("ftserve.engine.scheduler", "Scheduler", "plan_ahead"),
    ("ftserve.engine.runner", "ModelRunner", "collect"),
    ("ftserve.engine.runner", "ModelRunner", "collect_verified"),
    ("torch.cuda", "Event", "synchronize"),
    ("ftserve.engine.scheduler", "Scheduler", "commit"),
    ("ftserve.engine.scheduler", "Scheduler", "commit_verified"),
    ("ftserve.engine.driver", "EngineDriver", "step"),
)
NAME_CHARS = 90  # kernel names in the markdown (cuBLAS names run to hundreds)
MAX_OUTSIDE = 48  # ops outside the graph listed per step (the CPU smoke has hundreds)


# ----------------------------------------------------------------- drafting


class TraceSpeculator(Speculator):
    """The engine's n-gram speculator with a fixed drafting policy, so a phase
    holds one step kind. ``mode``: "ngram" drafts as the engine does (back-off
    included); "always" drafts at every step, the n-gram draft or else the
    request's last k tokens, and never backs off; "never" finds no draft and
    never backs off, so every step is read back before the next is planned,
    as for a request about to draft."""

    def __init__(self, mode: str, like: Speculator) -> None:
        super().__init__(like.num_tokens, like.min_match, like.max_match, like.max_model_len)
        assert mode in ("ngram", "always", "never"), mode
        self.mode = mode

    def _draft(self, req: Req, st: SpecState, k: int) -> list[int] | None:
        if self.mode == "never":
            return []
        draft = super()._draft(req, st, k)
        if draft is None or draft or self.mode == "ngram":
            return draft
        return list(req.tokens[-k:])

    def _miss(self, req: Req, st: SpecState) -> None:
        if self.mode == "ngram":
            super()._miss(req, st)


def kind_of(batch: ScheduledBatch | None) -> str:
    if batch is None:
        return "idle"
    if batch.verifies:
        return "verify"
    return "decode" if batch.is_decode else "prefill"


def copy_prompt(drv: EngineDriver, n: int, period: int, seed: int) -> list[int]:
    """n tokens: one random block of ``period`` tokens, repeated."""
    block = drv.tokens(period, random.Random(seed))
    return (block * -(-n // period))[:n]


# ----------------------------------------------------------------- the timeline


@dataclass
class StepLog:
    """What the host knows of one traced step (one EngineDriver.step call)."""

    index: int
    kind: str  # kind_of the batch it launched
    overlapped: bool  # left in flight: read back during the next call
    rows: int  # requests in the batch


@dataclass
class Timeline:
    """A traced run's parts, in the profiler's clock (us): each window's host
    interval (index i = StepLog i; one more for the closing flush), the
    device ops, and the launch calls by correlation id."""

    windows: list[tuple[float, float]]
    ops: list[DeviceOp]
    launches: dict[int, LaunchCall]
    device_ops: bool  # ops are CUDA ops (else top-level CPU torch ops)
    # CPU torch ops and record_function ranges by id: their host start (an op's
    # ``linked`` names the one its launch ran inside).
    frontend: dict[int, float] = field(default_factory=dict)


def timeline(prof: Any, n_windows: int, cuda: bool) -> Timeline:
    """Pull the step windows, ops and launch calls out of a profiler run.
    Without CUDA the ops are each window's top-level torch ops (CPU activity)."""
    spans: dict[int, tuple[float, float]] = {}
    cpu_ops: list[DeviceOp] = []
    frontend: dict[int, float] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue
        if e.id and not e.name.startswith("cu"):  # not a runtime / driver call
            frontend.setdefault(int(e.id), float(e.time_range.start))
        if e.name.startswith(WINDOW + "."):
            i = int(e.name.rsplit(".", 1)[1])
            spans.setdefault(i, (float(e.time_range.start), float(e.time_range.end)))
        elif not cuda and e.name.startswith("aten::"):
            parent = e.cpu_parent
            if parent is None or not parent.name.startswith("aten::"):
                cpu_ops.append(DeviceOp(float(e.time_range.start), float(e.time_range.end), e.name, 0))
    missing = [i for i in range(n_windows) if i not in spans]
    if missing:
        raise RuntimeError(f"the profiler recorded no window for steps {missing[:8]}")
    windows = [spans[i] for i in range(n_windows)]
    if cuda:
        return Timeline(windows, cuda_ops(prof), launch_calls(prof), True, frontend)
    return Timeline(windows, sorted(cpu_ops), {}, False)


def is_graph_op(op: DeviceOp, launches: dict[int, LaunchCall]) -> bool:
    call = launches.get(op.corr) if op.corr else None
    return call is not None and "GraphLaunch" in call.name


def is_copy(name: str) -> bool:
    return name.startswith(("Memcpy", "Memset"))


def assign(tl: Timeline) -> tuple[list[list[DeviceOp]], dict[str, int]]:
    """Each op to the window that issued it, at the host time of its launch call
    where the correlation id names one, else of the torch op or range its launch
    ran inside, else at its own start (right in sync mode only, where a step's
    ops start after its window opens and before the next one does).
    -> (ops per window, how many were placed each way)."""
    starts = [s for s, _ in tl.windows]
    per: list[list[DeviceOp]] = [[] for _ in starts]
    how = {"correlation": 0, "linked_op": 0, "start_time": 0, "before_first_window": 0}
    for op in tl.ops:
        call = tl.launches.get(op.corr) if op.corr else None
        if call is not None:
            t, way = call.start, "correlation"
        elif op.linked and op.linked in tl.frontend:
            t, way = tl.frontend[op.linked], "linked_op"
        else:
            t, way = op.start, "start_time"
        i = bisect_right(starts, t) - 1
        if i < 0:
            how["before_first_window"] += 1
            continue
        per[i].append(op)
        how[way] += 1
    return per, how


def step_rows(steps: Sequence[StepLog], tl: Timeline) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """One row per traced step with ops: times in us (module docstring). A
    step's period needs the next step's first op, so the last one has none."""
    per, how = assign(tl)
    firsts = [min(o.start for o in ops) if ops else None for ops in per]
    rows: list[dict[str, Any]] = []
    for log in steps:
        ops = sorted(per[log.index])
        host_s, host_e = tl.windows[log.index]
        if not ops:
            rows.append({"index": log.index, "kind": log.kind, "overlapped": log.overlapped, "rows": log.rows,
                         "host_us": round(host_e - host_s, 1), "ops": 0})
            continue
        first = ops[0].start
        # The next step's first op (not the closing read-back window's).
        nxt = next((f for f in firsts[log.index + 1:len(steps)] if f is not None), None)
        end = nxt if nxt is not None else max(o.end for o in ops)
        busy = sum(e - s for s, e in merged((o.start, min(o.end, end)) for o in ops if o.start < end))
        graph = [o for o in ops if is_graph_op(o, tl.launches)]
        eager = [o for o in ops if not is_graph_op(o, tl.launches)]
        row: dict[str, Any] = {
            "index": log.index, "kind": log.kind, "overlapped": log.overlapped, "rows": log.rows,
            "host_us": round(host_e - host_s, 1),
            "host_to_first_op_us": round(first - host_s, 1),
            "period_us": round(nxt - first, 1) if nxt is not None else None,
            "busy_us": round(busy, 1),
            "idle_us": round(nxt - first - busy, 1) if nxt is not None else None,
            "ops": len(ops),
            "kernels": sum(not is_copy(o.name) for o in ops),
            "copies": sum(is_copy(o.name) for o in ops),
            "graph_kernels": len(graph),
            "graph_us": round(max(o.end for o in graph) - graph[0].start, 1) if graph else None,
            "eager_us": round(sum(e - s for s, e in merged((o.start, o.end) for o in eager)), 1),
        }
        row["between_us"] = (round(row["period_us"] - row["graph_us"], 1)
                             if row["period_us"] is not None and row["graph_us"] is not None else None)
        # What runs outside the graph, in order, each with the gap since the
        # step's previous op (graph kernels included) ended.
        prev = first
        outside = []
        for o in ops + ([DeviceOp(nxt, nxt, "(next step)", 0)] if nxt is not None else []):
            if not is_graph_op(o, tl.launches):
                outside.append((o.name[:NAME_CHARS], round(o.end - o.start, 2), round(o.start - prev, 2)))
            prev = max(prev, o.end)
        row["outside"] = outside[:MAX_OUTSIDE]
        row["outside_ops"] = len(outside)
        row["kernel_table"] = kernel_table([ops], tl.launches)
        rows.append(row)
    return rows, how


def kernel_table(per_step: Sequence[Sequence[DeviceOp]], launches: dict[int, LaunchCall]) -> dict[str, Any]:
    """name -> count and device us per step (means over the steps given), and
    whether it ran inside a graph."""
    n = max(1, len(per_step))
    acc: dict[str, list[float]] = {}
    for ops in per_step:
        for o in ops:
            a = acc.setdefault(o.name, [0.0, 0.0, 0.0])
            a[0] += 1
            a[1] += o.end - o.start
            a[2] += is_graph_op(o, launches)
    return {name: {"per_step": round(c / n, 2), "us_per_step": round(us / n, 2), "in_graph": g == c}
            for name, (c, us, g) in sorted(acc.items(), key=lambda kv: -kv[1][1])}


MEDIAN_FIELDS = ("period_us", "graph_us", "between_us", "idle_us", "busy_us", "eager_us", "host_us",
                 "host_to_first_op_us", "ops", "kernels", "copies", "graph_kernels")


def _median(vals: Sequence[float | None]) -> float | None:
    got = [v for v in vals if v is not None]
    return round(statistics.median(got), 1) if got else None


def by_kind(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per step kind: medians over its steps with a period, the merged kernel
    table (per step), and the last such step's ops outside the graph."""
    out: dict[str, dict[str, Any]] = {}
    for kind in sorted({r["kind"] for r in rows}):
        mine = [r for r in rows if r["kind"] == kind and r.get("period_us") is not None]
        if not mine:
            out[kind] = {"steps": 0}
            continue
        summary: dict[str, Any] = {"steps": len(mine),
                                   "overlapped_share": round(sum(r["overlapped"] for r in mine) / len(mine), 2)}
        summary.update({f: _median([r.get(f) for r in mine]) for f in MEDIAN_FIELDS})
        table: dict[str, list[float]] = {}
        for r in mine:
            for name, k in r["kernel_table"].items():
                a = table.setdefault(name, [0.0, 0.0, 1.0])
                a[0] += k["per_step"]
                a[1] += k["us_per_step"]
                a[2] = min(a[2], float(k["in_graph"]))
        n = len(mine)
        summary["kernel_table"] = {name: {"per_step": round(c / n, 2), "us_per_step": round(us / n, 2),
                                          "in_graph": bool(g)}
                                   for name, (c, us, g) in sorted(table.items(), key=lambda kv: -kv[1][1])}
        summary["outside_last"] = mine[-1]["outside"]
        out[kind] = summary
    return out


def compare(base: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Kernel by kernel, ``other``'s step against ``base``'s (two by_kind
    entries): the medians' ratios and differences, the kernels only one of
    them runs, and those both run a different number of times per step."""
    a, b = base.get("kernel_table", {}), other.get("kernel_table", {})

    def ratio(f: str) -> float | None:
        x, y = base.get(f), other.get(f)
        return round(y / x, 3) if x and y is not None else None

    def diff(f: str) -> float | None:
        x, y = base.get(f), other.get(f)
        return round(y - x, 1) if x is not None and y is not None else None

    both = [n for n in a if n in b]
    return {
        "ratios": {f: ratio(f) for f in ("period_us", "graph_us", "between_us", "busy_us", "kernels")},
        "deltas": {f: diff(f) for f in ("period_us", "graph_us", "between_us", "idle_us", "kernels",
                                        "graph_kernels", "copies")},
        "only_other": {n: b[n] for n in b if n not in a},
        "only_base": {n: a[n] for n in a if n not in b},
        "count_changed": {n: {"base": a[n]["per_step"], "other": b[n]["per_step"],
                              "base_us": a[n]["us_per_step"], "other_us": b[n]["us_per_step"]}
                          for n in both if a[n]["per_step"] != b[n]["per_step"]},
        "time_changed": {n: {"base_us": a[n]["us_per_step"], "other_us": b[n]["us_per_step"]}
                         for n in both if a[n]["per_step"] == b[n]["per_step"]
                         and abs(b[n]["us_per_step"] - a[n]["us_per_step"]) > 0.1 * max(1.0, a[n]["us_per_step"])},
    }


# ----------------------------------------------------------------- stepping


def warm_up(drv: EngineDriver, reqs: Sequence[Req], outputs: int, deadline: float) -> int:
    """Step until every request decodes with ``outputs`` tokens out (its prompt's
    prefill included); -> steps taken."""
    n = 0
    while not all(r.state is ReqState.DECODE and len(r.output_ids) >= outputs for r in reqs):
        if time.perf_counter() > deadline or all(r.finished for r in reqs):
            break
        drv.step()
        n += 1
    return n


def host_profile(prof: cProfile.Profile, steps: int, top: int = HOST_TOP) -> list[list[Any]]:
    """The engine's own functions (ftserve/, ftserve_kernels/) by cumulative time:
    [function, calls per step, cumulative us per step, own us per step]."""
    rows = []
    for (path, line, name), (_, calls, own, cum, _) in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
        for root in ("/ftserve/", "/ftserve_kernels/"):
            if root in path:
                short = root.strip("/") + "/" + path.split(root, 1)[1]
                rows.append([f"{short}:{line}({name})", round(calls / steps, 2),
                             round(cum / steps * 1e6, 1), round(own / steps * 1e6, 1)])
                break
    rows.sort(key=lambda r: -r[2])
    return rows[:top]


@contextlib.contextmanager
def timed_calls(calls: Sequence[tuple[str, str, str]] = HOST_CALLS) -> Iterator[dict[str, list[float]]]:
    """Each ``calls`` method wrapped to append its wall microseconds to the
    yielded dict (key "Class.method"), restored on exit."""
    times: dict[str, list[float]] = {}
    saved = []
    for mod, cls_name, name in calls:
        cls = getattr(importlib.import_module(mod), cls_name)
        orig = cls.__dict__[name]
        key = f"{cls_name}.{name}"
        times[key] = []

        def timed(*a: Any, _orig: Any = orig, _out: list[float] = times[key], **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _orig(*a, **kw)
            finally:
                _out.append((time.perf_counter() - t0) * 1e6)

        saved.append((cls, name, orig))
        setattr(cls, name, functools.wraps(orig)(timed))
    try:
        yield times
    finally:
        for cls, name, orig in reversed(saved):
            setattr(cls, name, orig)


def call_rows(times: dict[str, list[float]], steps: int) -> list[list[Any]]:
    """[call, calls per step, median us, p90 us] for the calls the steps made."""
    rows = []
    for key, v in times.items():
        if v:
            v = sorted(v)
            rows.append([key, round(len(v) / max(steps, 1), 2), round(statistics.median(v), 1),
                         round(v[min(len(v) - 1, 9 * len(v) // 10)], 1)])
    return rows


def time_steps(drv: EngineDriver, reqs: Sequence[Req], steps: int, deadline: float,
               profile_host: bool = False) -> dict[str, Any]:
    """``steps`` engine steps without the profiler (fewer past ``deadline``):
    wall time per step by kind, and the tokens they committed. ``profile_host``:
    under cProfile instead (the host's functions per step, host_profile; the
    profiler slows Python, so the walls are not the untraced ones)."""
    before = sum(len(r.output_ids) for r in reqs)
    walls: dict[str, list[float]] = {}
    prof = cProfile.Profile() if profile_host else None
    if prof is not None:
        prof.enable()
    t0 = time.perf_counter()
    n, stopped = 0, False
    for _ in range(steps):
        if time.perf_counter() > deadline:
            stopped = True
            break
        s = time.perf_counter()
        kind = kind_of(drv.step())
        walls.setdefault(kind, []).append((time.perf_counter() - s) * 1e6)
        n += 1
    drv.flush()  # the last step's tokens (overlapped: still in flight)
    elapsed = time.perf_counter() - t0
    if prof is not None:
        prof.disable()
        return {"steps": n, "host_profile": host_profile(prof, max(n, 1))}
    tokens = sum(len(r.output_ids) for r in reqs) - before
    return {"steps": n, "stopped_by_budget": stopped, "elapsed_s": round(elapsed, 4), "tokens": tokens,
            "tokens_per_step": round(tokens / n, 3) if n else None,
            "tok_per_s": round(tokens / elapsed, 1) if n and elapsed > 0 else None,
            "step_counts": {k: len(v) for k, v in walls.items()},
            "wall_us_median": {k: round(statistics.median(v), 1) for k, v in walls.items()}}


def trace_steps(drv: EngineDriver, steps: int, device: torch.device, deadline: float) -> dict[str, Any]:
    """``steps`` engine steps under torch.profiler (fewer past ``deadline``),
    each in its own record_function window, then the closing read-back in one
    more; -> the per-step rows and per-kind summary."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    logs: list[StepLog] = []
    stopped = False
    sync(device)
    with profile(activities=acts) as prof:
        for i in range(steps):
            if time.perf_counter() > deadline:
                stopped = True
                break
            with record_function(f"{WINDOW}.{i}"):
                batch = drv.step()
            logs.append(StepLog(i, kind_of(batch), drv.inflight is not None,
                                len(batch.reqs) if batch is not None else 0))
        with record_function(f"{WINDOW}.{len(logs)}"):
            drv.flush()
        sync(device)
    t0 = time.perf_counter()
    tl = timeline(prof, len(logs) + 1, cuda)
    rows, how = step_rows(logs, tl)
    placed = how["correlation"] + how["linked_op"] + how["start_time"]
    if cuda and placed and how["start_time"] > 0.1 * placed:
        say(f"  {how['start_time']} of {placed} CUDA ops placed by their start time (no launch call or "
            "enclosing op recorded): wrong for overlapped steps, and no graph time without launch calls")
    return {"steps": len(logs), "stopped_by_budget": stopped, "assigned": how,
            "ops_source": "cuda" if tl.device_ops else "cpu torch ops",
            "parse_s": round(time.perf_counter() - t0, 2), "by_kind": by_kind(rows), "rows": rows}


def run_phase(drv: EngineDriver, phase: str, args: argparse.Namespace, device: torch.device,
              prompts: Sequence[list[int]], max_tokens: int, base_spec: Speculator,
              deadline: float) -> dict[str, Any]:
    """One phase (module docstring): its requests from warm-up to abort."""
    mode = PHASE_DRAFTS[phase]
    if mode == "always" and args.drafts == "ngram":
        mode = "ngram"
    spec = None if mode is None else TraceSpeculator(mode, base_spec)
    drv.sched.spec = spec
    reqs = [drv.add(p, max_tokens=max_tokens) for p in prompts]
    try:
        out: dict[str, Any] = {"drafts": mode or "off"}
        out["warmup_steps"] = warm_up(drv, reqs, args.warmup, deadline)
        left = deadline - time.perf_counter()
        share = left / (2 + args.host_profile + args.host_calls)  # the rest: the traced steps
        out["timed"] = time_steps(drv, reqs, args.steps, time.perf_counter() + share)
        if args.host_profile:
            out["host"] = time_steps(drv, reqs, args.steps, time.perf_counter() + share, profile_host=True)
        if args.host_calls:
            with timed_calls() as times:
                timed = time_steps(drv, reqs, args.steps, time.perf_counter() + share)
            out["host_calls"] = {"steps": timed["steps"], "wall_us_median": timed["wall_us_median"],
                                 "calls": call_rows(times, timed["steps"])}
        out["trace"] = trace_steps(drv, args.trace_steps, device, deadline)
        if spec is not None:
            c = spec.counters
            out["spec"] = {"verifies": c.verifies_total, "proposed": c.proposed_tokens_total,
                           "accepted": c.accepted_tokens_total, "accept_lengths": list(c.accept_lengths),
                           "kept_per_verify": (round(c.accepted_tokens_total / c.verifies_total, 3)
                                               if c.verifies_total else None)}
        if any(r.finished for r in reqs):
            out["note"] = "a request finished during the phase (max_tokens or the context)"
        return out
    finally:
        drv.abort_all()
        drv.sched.spec = base_spec


# ----------------------------------------------------------------- report


def _fmt_table(table: dict[str, Any], top: int) -> list[list[Any]]:
    return [[n[:NAME_CHARS], k["per_step"], k["us_per_step"], "yes" if k["in_graph"] else ""]
            for n, k in list(table.items())[:top]]


def render(res: dict[str, Any]) -> str:
    lines = [f"### Verify step timeline -- {res['model']}, {res['machine'].get('gpu')}, "
             f"{res['machine']['date_utc']}", "",
             f"batch {res['args']['batch']}, prompt {res['args']['prompt_tokens']} tokens "
             f"(a {res['args']['period']}-token block repeated), {res['num_speculative_tokens']} draft tokens, "
             f"verify graph rows {res.get('verify_graph_rows')}, max running {res['args']['max_running']}", ""]
    rows = []
    for phase in PHASES:
        ph = res.get("phases", {}).get(phase)
        if not ph:
            continue
        timed = ph.get("timed", {})
        for kind, k in ph.get("trace", {}).get("by_kind", {}).items():
            if not k.get("steps"):
                continue
            rows.append([phase, kind, k["steps"], timed.get("wall_us_median", {}).get(kind), k["period_us"],
                         k["graph_us"], k["between_us"], k["idle_us"], k["kernels"], k["graph_kernels"],
                         k["copies"], timed.get("tokens_per_step"), timed.get("tok_per_s")])
    lines.append(markdown_table(["phase", "step kind", "traced steps", "wall us (untraced)", "period us",
                                 "in graph us", "between graphs us", "GPU idle us", "kernels", "graph kernels",
                                 "copies", "tokens/step", "tok/s (untraced)"], rows))
    lines += ["", "period: first GPU op of a step to the next step's; between graphs: period - graph "
              "(eager kernels, copies, host gaps); medians over the traced steps. tokens/step and tok/s: "
              "the phase's untraced steps, all requests together.", ""]
    cmp = res.get("comparison", {})
    for title, key in (("verify vs decode", "verify_vs_decode"), ("decode_sync vs decode", "sync_vs_decode")):
        c = cmp.get(key)
        if not c:
            continue
        lines.append(f"**{title}**: period x{c['ratios']['period_us']}, in graph x{c['ratios']['graph_us']}, "
                     f"between graphs {c['deltas']['between_us']:+} us, kernels {c['deltas']['kernels']:+}"
                     if c["deltas"]["between_us"] is not None and c["deltas"]["kernels"] is not None
                     else f"**{title}**: {c['ratios']}")
        if key == "verify_vs_decode":
            only = [[n[:NAME_CHARS], k["per_step"], k["us_per_step"]] for n, k in c["only_other"].items()]
            if only:
                lines += ["", "kernels only the verify step runs:", "",
                          markdown_table(["kernel", "per step", "us per step"], only[:TOP_KERNELS])]
            only = [[n[:NAME_CHARS], k["per_step"], k["us_per_step"]] for n, k in c["only_base"].items()]
            if only:
                lines += ["", "kernels only the decode step runs:", "",
                          markdown_table(["kernel", "per step", "us per step"], only[:TOP_KERNELS])]
            changed = [[n[:NAME_CHARS], v["base"], v["other"], v["base_us"], v["other_us"]]
                       for n, v in c["count_changed"].items()]
            if changed:
                lines += ["", "kernels both run, a different number of times:", "",
                          markdown_table(["kernel", "decode per step", "verify per step", "decode us",
                                          "verify us"], changed[:TOP_KERNELS])]
        lines.append("")
    for phase, kind in (("decode", "decode"), ("verify", "verify")):
        k = res.get("phases", {}).get(phase, {}).get("trace", {}).get("by_kind", {}).get(kind)
        if k and k.get("steps"):
            lines += [f"top kernels of a {kind} step ({phase} phase):", "",
                      markdown_table(["kernel", "per step", "us per step", "in graph"],
                                     _fmt_table(k["kernel_table"], TOP_KERNELS)), "",
                      f"outside the graph, last {kind} step (name, us, gap before us): "
                      + "; ".join(f"{n} {d} (+{g})" for n, d, g in k["outside_last"][:24])
                      + (" ..." if len(k["outside_last"]) > 24 else ""), ""]
    for phase in PHASES:
        host = res.get("phases", {}).get(phase, {}).get("host")
        if host and host.get("host_profile"):
            lines += [f"host functions of the {phase} phase (cProfile over {host['steps']} steps, which "
                      "slows Python; us per step):", "",
                      markdown_table(["function", "calls", "cumulative us", "own us"], host["host_profile"]), ""]
    for phase in PHASES:
        calls = res.get("phases", {}).get(phase, {}).get("host_calls")
        if calls and calls.get("calls"):
            lines += [f"host calls of the {phase} phase ({calls['steps']} steps, a perf_counter around "
                      f"each; step walls {calls['wall_us_median']} us):", "",
                      markdown_table(["call", "calls per step", "median us", "p90 us"], calls["calls"]), ""]
    for what in ("errors", "skipped"):
        if res.get(what):
            lines.append(f"{what}: {res[what] if what == 'skipped' else list(res[what])}")
    return "\n".join(lines)


# ----------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.bench.spec_trace", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--gguf", default=None, help="the model as a .gguf file (SmolLM2, as tools/bench/spec.py)")
    src.add_argument("--preset", default=None, help="instead: a preset's shape with dummy weights")
    p.add_argument("--layers", type=int, default=None, help="--preset: layers kept (default: all)")
    p.add_argument("--smoke", action="store_true", help="CPU check: tiny-dense, 2 layers, a few steps")
    p.add_argument("--out", required=True, help="a directory, or a .json file")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-clock seconds for the whole run (default 120; smoke 60)")
    p.add_argument("--batch", type=int, default=1, help="requests decoding together")
    p.add_argument("--max-running", type=int, default=16,
                   help="max running requests = largest decode graph (sizes the verify graphs' buckets)")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--drafts", choices=("always", "ngram"), default="always",
                   help="the verify phase's drafting: a draft every step, or the engine's n-gram speculator")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--period", type=int, default=256, help="the repeated block's length")
    p.add_argument("--warmup", type=int, default=16, help="output tokens per request before timing")
    p.add_argument("--steps", type=int, default=64, help="timed steps per phase (no profiler)")
    p.add_argument("--trace-steps", type=int, default=24, help="profiled steps per phase")
    p.add_argument("--phases", default=",".join(PHASES), help=f"subset of {','.join(PHASES)}")
    p.add_argument("--host-profile", action="store_true",
                   help="also run each phase's timed steps again under cProfile: the engine's host functions")
    p.add_argument("--host-calls", action="store_true",
                   help="also run each phase's timed steps again timing the step's main host calls (HOST_CALLS)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.smoke:
        args.gguf, args.preset, args.layers = None, "tiny-dense", 2
        args.device, args.dtype = "cpu", "float32"
        args.prompt_tokens, args.period = 96, 24
        args.warmup, args.steps, args.trace_steps = 2, 4, 4
    elif args.gguf is None and args.preset is None:
        p.error("give --gguf PATH or --preset NAME (or --smoke)")
    if args.gguf is not None and not (Path(args.gguf).is_file() and args.gguf.endswith(".gguf")):
        p.error(f"--gguf {args.gguf!r} is not a .gguf file")
    if args.budget_s is None:
        args.budget_s = 60.0 if args.smoke else 120.0
    args.phase_list = [x for x in args.phases.split(",") if x]
    if not args.phase_list or set(args.phase_list) - set(PHASES):
        p.error(f"--phases: a subset of {','.join(PHASES)}")
    if not 1 <= args.batch <= args.max_running:
        p.error("--batch must be in [1, --max-running]")
    k = args.num_speculative_tokens
    # Room for every step to commit a whole draft (the profiled steps are a second
    # set of timed ones), and a margin.
    steps = args.warmup + args.steps * (1 + args.host_profile + args.host_calls) + args.trace_steps
    args.max_tokens = (steps + 8) * (k + 1) + 16
    # engine_driver.build's fields: the engine as spec.py's server runs it.
    args.batches = [args.max_running]
    # Decode graphs up to the size the server pads --batch to, not every size up to
    # --max-running: the step replays the same graph, and a cold build compiles less.
    args.graph_max_bs = next(b for b in graph_batch_sizes(args.max_running) if b >= args.batch)
    args.chunk = 256 if args.smoke else 4096
    args.kv_tokens = max(8192, 4 * args.batch * (args.prompt_tokens + args.max_tokens))
    args.max_len = 1024 if args.smoke else (8192 if args.preset is not None else None)
    return args


def output_paths(out: str) -> tuple[Path, Path]:
    p = Path(out)
    if p.suffix == ".json":
        return p, p.with_suffix(".md")
    return p / "spec_trace.json", p / "spec_trace.md"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    json_path, md_path = output_paths(args.out)
    device, results, t_start, deadline, model_dir = start_run(args, "ftserve-spec-trace-")
    results["model"] = (Path(args.gguf).name if args.gguf is not None
                        else f"{args.preset} ({args.layers or 'all'} layers, random weights)")
    results["num_speculative_tokens"] = args.num_speculative_tokens
    engine = run_section(results, "engine_build", lambda: build(
        args, args.gguf if args.gguf is not None else model_dir, device,
        load_format="auto" if args.gguf is not None else "dummy", speculative="ngram",
        speculative_gate=False, num_speculative_tokens=args.num_speculative_tokens,
        cuda_graph_max_bs=args.graph_max_bs))
    if engine is None:
        write_json(json_path, results)
        raise SystemExit(f"engine build failed: {results['errors']['engine_build']}")
    try:
        results["engine_build"] = dict(engine.summary)
        runner, base_spec = engine.runner, engine.scheduler.spec
        assert isinstance(base_spec, Speculator), "built with --speculative ngram"
        if device.type == "cuda" and (runner.graphs is None or runner.verify_graphs is None):
            results.setdefault("errors", {})["cuda_graphs"] = "decode or verify graphs are OFF"
        if runner.verify_graphs is not None:
            n = args.batch * (args.num_speculative_tokens + 1)
            results["verify_graph_rows"] = next(b for b in runner.verify_graphs.buckets if b >= n)
        room = engine.max_model_len - args.prompt_tokens - 1
        if args.max_tokens > room:
            raise SystemExit(f"{args.max_tokens} output tokens do not fit after a {args.prompt_tokens}-token "
                             f"prompt in {engine.max_model_len}: fewer --steps / --trace-steps or a shorter prompt")
        if device.type == "cuda":
            # CUPTI starts with the first profiled region: not inside the first phase's.
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
                torch.cuda.synchronize()
        drv = EngineDriver(engine, seed=args.seed)
        prompts = [copy_prompt(drv, args.prompt_tokens, args.period, args.seed + i) for i in range(args.batch)]
        phases: dict[str, Any] = results.setdefault("phases", {})
        for i, phase in enumerate(args.phase_list):
            left = deadline - time.perf_counter()
            share = time.perf_counter() + left / (len(args.phase_list) - i)
            out = run_section(results, f"phase {phase}", lambda ph=phase, d=share: run_phase(
                drv, ph, args, device, prompts, args.max_tokens, base_spec, d), deadline)
            results.pop(f"phase {phase}", None)
            if out is not None:
                phases[phase] = out
                k = out["trace"]["by_kind"].get("verify" if phase == "verify" else "decode", {})
                say(f"  {phase}: period {k.get('period_us')} us, in graph {k.get('graph_us')}, "
                    f"between {k.get('between_us')}, kernels {k.get('kernels')}; "
                    f"{out['timed'].get('tok_per_s')} tok/s untraced")
            write_json(json_path, results)  # a run cut short still leaves what it measured
        kinds = {ph: phases.get(ph, {}).get("trace", {}).get("by_kind", {}) for ph in PHASES}
        cmp: dict[str, Any] = {}
        if kinds["decode"].get("decode", {}).get("steps") and kinds["verify"].get("verify", {}).get("steps"):
            cmp["verify_vs_decode"] = compare(kinds["decode"]["decode"], kinds["verify"]["verify"])
        if kinds["decode"].get("decode", {}).get("steps") and kinds["decode_sync"].get("decode", {}).get("steps"):
            cmp["sync_vs_decode"] = compare(kinds["decode"]["decode"], kinds["decode_sync"]["decode"])
        results["comparison"] = cmp
    finally:
        engine.shutdown()
    results["total_s"] = round(time.perf_counter() - t_start, 1)
    write_json(json_path, results)
    md = render(results)
    md_path.write_text(md + "\n")
    print(md, flush=True)
    say(f"wrote {json_path} and {md_path} in {results['total_s']:.0f} s")
    return results


if __name__ == "__main__":
    main()
