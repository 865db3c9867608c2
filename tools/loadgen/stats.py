"""Summary statistics with vLLM benchmark field names (``mean_ttft_ms``, ``p99_itl_ms``, ...).

Which records feed which metric:
- TTFT and ITL: every measured request that produced text, aborted ones included (a user who
  interrupts still waited for the first token).
- TPOT and E2EL: completed ("ok") requests only; an aborted stream's length is the client's choice.
- Throughput: completed requests and all output tokens received, over the measured duration.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from tools.loadgen.client import RequestRecord

PERCENTILES: tuple[int, ...] = (50, 90, 99)
_METRICS: tuple[tuple[str, str], ...] = (
    ("ttft", "Time to first token"),
    ("tpot", "Time per output token (excl. 1st)"),
    ("itl", "Inter-token latency"),
    ("e2el", "End-to-end latency"),
)


def _dist(name: str, values_s: Sequence[float], out: dict[str, Any]) -> None:
    a = np.asarray(values_s, dtype=np.float64) * 1000.0  # ms
    if a.size == 0:
        for key in ("mean", "median", "std", "max", *(f"p{p}" for p in PERCENTILES)):
            out[f"{key}_{name}_ms"] = None
        return
    out[f"mean_{name}_ms"] = float(a.mean())
    out[f"median_{name}_ms"] = float(np.median(a))
    out[f"std_{name}_ms"] = float(a.std())
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = float(np.percentile(a, p))
    out[f"max_{name}_ms"] = float(a.max())


def summarize(records: Iterable[RequestRecord], duration_s: float) -> dict[str, Any]:
    """Summary of the measured phase. ``duration_s`` is measure start to drain end."""
    recs = [r for r in records if r.phase == "measure"]
    ok = [r for r in recs if r.status == "ok"]
    aborted = [r for r in recs if r.status == "aborted"]
    errors = Counter(r.error_kind or "unknown" for r in recs if r.status == "error")
    cancelled = sum(1 for r in recs if r.status == "cancelled")
    with_usage = [r for r in recs if r.prompt_tokens is not None]
    total_in = sum(r.prompt_tokens or 0 for r in with_usage)
    total_cached = sum(r.cached_tokens or 0 for r in with_usage)
    total_out = sum(r.output_tokens for r in recs if r.status in ("ok", "aborted"))
    dur = max(duration_s, 1e-9)
    s: dict[str, Any] = {
        "duration": duration_s,
        "num_requests": len(recs),
        "completed": len(ok),
        "aborted": len(aborted),
        "failed": sum(errors.values()),
        "cancelled": cancelled,
        "errors": dict(sorted(errors.items())),
        "total_input_tokens": total_in,
        "total_cached_tokens": total_cached,
        "total_output_tokens": total_out,
        "cache_hit_ratio": (total_cached / total_in) if total_in else None,
        "request_throughput": len(ok) / dur,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        "max_prompt_tokens": max((r.prompt_tokens or 0 for r in with_usage), default=0),
    }
    replicas = Counter(r.replica for r in recs if r.replica)
    if replicas:  # the server named the replica that answered (behind a router)
        s["replicas"] = dict(sorted(replicas.items()))
        s["session_affinity"] = session_affinity(recs)
    timed = [r for r in recs if r.status in ("ok", "aborted") and r.ttft is not None]
    _dist("ttft", [r.ttft for r in timed if r.ttft is not None], s)
    _dist("tpot", [t for r in ok if (t := r.tpot) is not None], s)
    _dist("itl", [x for r in timed for x in r.itl], s)
    _dist("e2el", [r.e2e for r in ok if r.e2e is not None], s)
    return s


def session_affinity(records: Iterable[RequestRecord]) -> float | None:
    """Of the turns that continue a conversation (turn > 0), the share served by the
    replica that served the turn before: 1.0 when a router keeps every session where its
    prefix is cached. None without replica names or continued turns."""
    last: dict[int, str | None] = {}
    same = total = 0
    for r in sorted((r for r in records if r.session >= 0), key=lambda r: (r.session, r.start)):
        prev = last.get(r.session) if r.turn > 0 else None
        if prev is not None and r.replica is not None:
            total += 1
            same += r.replica == prev
        last[r.session] = r.replica
    return same / total if total else None


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def format_table(s: dict[str, Any], title: str = "Serving Benchmark Result") -> str:
    """Fixed-width text table in the layout of vLLM's ``benchmark_serving`` printout."""
    w = 50
    lines = [f"{' ' + title + ' ':=^{w}}"]

    def row(label: str, value: Any) -> None:
        lines.append(f"{label:<36}{_fmt(value):>{w - 36}}")

    row("Successful requests:", s["completed"])
    row("Aborted requests (client):", s["aborted"])
    row("Failed requests:", s["failed"])
    for kind, n in s["errors"].items():
        row(f"  {kind}:", n)
    if s["cancelled"]:
        row("Cancelled at drain/interrupt:", s["cancelled"])
    row("Benchmark duration (s):", s["duration"])
    row("Total input tokens:", s["total_input_tokens"])
    row("Total cached input tokens:", s["total_cached_tokens"])
    row("Cache hit ratio:", s["cache_hit_ratio"])
    row("Max prompt tokens:", s["max_prompt_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", s["request_throughput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Total Token throughput (tok/s):", s["total_token_throughput"])
    if s.get("replicas"):
        for name, n in s["replicas"].items():
            row(f"  served by {name}:", n)
        row("Session affinity (same replica):", s["session_affinity"])
    for key, label in _METRICS:
        lines.append(f"{' ' + label + ' ':-^{w}}")
        row(f"Mean {key.upper()} (ms):", s[f"mean_{key}_ms"])
        row(f"Median {key.upper()} (ms):", s[f"median_{key}_ms"])
        for p in PERCENTILES:
            if p != 50:  # P50 is the median row
                row(f"P{p} {key.upper()} (ms):", s[f"p{p}_{key}_ms"])
        row(f"Max {key.upper()} (ms):", s[f"max_{key}_ms"])
    lines.append("=" * w)
    return "\n".join(lines)
