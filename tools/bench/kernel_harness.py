"""The harness under tools/bench/kernels: shapes, the shared results dict, timing
(eager median and CUDA-graph replay), output checks, and the limits every kernel
is read against.

RESULTS is the one JSON summary of the run: the section modules write "limits",
"kernels" and "checks" into it through record/check, and bench_kernels.main adds
device, date, versions and wall time before dumping it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

HQ, HKV, D, PAGE = 32, 4, 128, 16
RESULTS: dict[str, Any] = {"limits": {}, "kernels": {}, "checks": {}}


def bench(fn: Callable[[], Any], iters: int = 10, warmup: int = 3) -> float:
    """Median seconds of ``fn`` over ``iters`` runs, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def bench_graph(fn: Callable[[], Any], replays: int = 50) -> float:
    """Device seconds per call of ``fn``: captured once in a CUDA graph, replayed
    back to back between two events, so host launch cost is not in the number
    (this is how the engine runs decode)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # compile and warm up outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / replays)
    del graph
    return min(times)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def check(name: str, ok: bool, detail: str) -> None:
    RESULTS["checks"][name] = {"ok": bool(ok), "detail": detail}
    print(f"  check {name}: {'ok' if ok else 'FAILED'} ({detail})")


def record(name: str, secs: float, **metrics: float) -> None:
    RESULTS["kernels"][name] = {"ms": secs * 1e3, **metrics}
    extra = ", ".join(f"{k}={v:.3g}" for k, v in metrics.items())
    print(f"{name:48s} {secs * 1e3:9.3f} ms  {extra}")


# ---------------------------------------------------------------- limits


def measure_limits() -> None:
    lim = RESULTS["limits"]
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    lim["matmul_tflops"] = 2 * n**3 / bench(lambda: a @ b) / 1e12
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    lim["copy_gbps"] = 2 * src.numel() / bench(lambda: dst.copy_(src)) / 1e9
    host = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
    dev = torch.empty(host.shape, dtype=torch.uint8, device="cuda")
    lim["h2d_gbps"] = host.numel() / bench(lambda: dev.copy_(host, non_blocking=True), 5) / 1e9
    print(f"limits: matmul {lim['matmul_tflops']:.0f} TFLOP/s, copy {lim['copy_gbps']:.0f} GB/s, "
          f"pinned h2d {lim['h2d_gbps']:.1f} GB/s")

