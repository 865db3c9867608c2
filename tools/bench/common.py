"""Shared benchmark helpers: timing, physical limits measured in the same run,
FLOP / byte accounting for a ModelConfig, robust sections, JSON + markdown.

Every number a benchmark reports is meant to be read against a limit measured
by the same process on the same device (DESIGN.md rule 6), so the limits live
here and every bench script calls them first.

Conventions:
    copy GB/s   = 2 * bytes / time  (each byte is read once and written once);
                  this is the HBM traffic rate used for every roofline.
    H2D GB/s    = bytes / time, pinned host memory -> device.
    matmul      = 2 * n^3 FLOPs for an n x n x n product.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ftserve.models.checkpoint import write_config

# ----------------------------------------------------------------- progress / sections


def say(msg: str) -> None:
    """Progress line on stderr (stdout is kept for the markdown report)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_section(results: dict[str, Any], name: str, fn: Callable[[], Any],
                deadline: float | None = None) -> Any:
    """Run one benchmark section; an exception is recorded under
    results["errors"][name] and the run moves on (a long GPU run must not be
    lost to one failing section). Past ``deadline`` (time.perf_counter()) the
    section is skipped and listed in results["skipped"]."""
    if deadline is not None and time.perf_counter() > deadline:
        results.setdefault("skipped", []).append(name)
        say(f"section {name} skipped: time budget spent")
        return None
    say(f"section {name} ...")
    t0 = time.perf_counter()
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 - recorded in the output, then continue
        results.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"
        say(f"section {name} FAILED after {time.perf_counter() - t0:.1f} s: {type(exc).__name__}: {exc}")
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # drain so the next section starts clean
        return None
    results[name] = out
    results.setdefault("section_seconds", {})[name] = round(time.perf_counter() - t0, 2)
    say(f"section {name} done in {time.perf_counter() - t0:.1f} s")
    return out


def machine_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "date_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(device),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=torch.cuda.get_device_name(device), gpu_mem_gib=round(props.total_memory / 2**30, 1),
                    sms=props.multi_processor_count, cuda=torch.version.cuda)
    else:
        info["gpu"] = f"none (CPU: {platform.processor() or platform.machine()})"
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


# ----------------------------------------------------------------- timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, float, Any]:
    """(wall seconds, device seconds, fn's result) of one call. The device is
    drained before and after, so nothing outside fn is measured; device time
    comes from CUDA events (equal to wall on the CPU)."""
    sync(device)
    if device.type != "cuda":
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        return dt, dt, out
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    out = fn()
    end.record()
    torch.cuda.synchronize(device)
    wall = time.perf_counter() - t0
    return wall, start.elapsed_time(end) / 1e3, out


def median_time(fn: Callable[[], Any], device: torch.device, iters: int, warmup: int = 1) -> float:
    """Median device seconds of ``iters`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    return statistics.median(timed(fn, device)[1] for _ in range(iters))


def merged(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Intervals (start, end) as their sorted, disjoint union."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def overlap_seconds(spans: Sequence[tuple[float, float, str]], key: str) -> dict[str, float]:
    """Of the spans (start, end, name; microseconds) whose name contains ``key``:
    their merged time, and how much of it some other span ran at the same time
    (a copy kernel on a side stream hidden under compute, or not)."""
    mine = merged([(s, e) for s, e, n in spans if key in n])
    rest = merged([(s, e) for s, e, n in spans if key not in n])
    both, j = 0.0, 0
    for s, e in mine:  # both lists sorted and disjoint: one sweep
        while j < len(rest) and rest[j][1] <= s:
            j += 1
        k = j
        while k < len(rest) and rest[k][0] < e:
            both += min(e, rest[k][1]) - max(s, rest[k][0])
            k += 1
    return {"key_s": sum(e - s for s, e in mine) / 1e6, "overlapped_s": both / 1e6}


def gpu_kernel_seconds(fn: Callable[[], Any], device: torch.device,
                       name_filters: Sequence[str] = (), top: int = 8,
                       overlap_of: str | None = None) -> dict[str, Any]:
    """Run fn once under torch.profiler; sum the device time of every CUDA
    kernel / memcpy / memset it launched. ``by_filter[f]`` sums the kernels
    whose name contains f (e.g. the attention kernel), ``top`` lists the
    heaviest kernel names. Intervals are merged, so overlapping kernels on two
    streams are not counted twice. ``overlap_of``: also report how much of the
    kernels with that in their name ran beside other kernels (overlap_seconds)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=acts) as prof:
        fn()
        sync(device)
    spans: list[tuple[float, float]] = []  # microseconds
    named: list[tuple[float, float, str]] = []
    by_name: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue  # CPU ops; on a CPU-only run nothing is device time
        kind = str(getattr(ev, "activity_type", "") or "").lower()
        if getattr(ev, "is_user_annotation", False) or "annotation" in kind:
            continue  # GPU ranges of record_function scopes span idle gaps too
        s, e = float(ev.time_range.start), float(ev.time_range.end)
        spans.append((s, e))
        named.append((s, e, ev.name))
        by_name[ev.name] = by_name.get(ev.name, 0.0) + (e - s) / 1e6
    busy = sum(e - s for s, e in merged(spans))  # overlapping kernels count once
    if not spans and device.type == "cuda":
        # Some profiler builds expose device time only through the averages
        # (durations without intervals: summed, not merged).
        for avg in prof.key_averages():
            t = float(getattr(avg, "self_device_time_total", 0.0) or 0.0)
            if t > 0:
                busy += t
                by_name[avg.key] = t / 1e6
    heaviest = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    out = {
        "kernel_s": busy / 1e6 if device.type == "cuda" else None,
        "num_kernels": len(spans),
        "by_filter": {f: sum(t for n, t in by_name.items() if f in n) for f in name_filters},
        "top": [(n[:80], round(t * 1e3, 3)) for n, t in heaviest],  # (name, ms)
    }
    if overlap_of is not None:
        out["overlap"] = overlap_seconds(named, overlap_of)
        out["spans"] = named  # for further overlap_seconds questions
    return out


class DeviceOp(NamedTuple):
    """One CUDA op (kernel, memcpy, memset) a profiler recorded."""

    start: float  # us, the profiler's clock (shared with its CPU events)
    end: float
    name: str
    # The profiler's correlation id: that of the runtime / driver call that
    # launched the op (launch_calls); every kernel of a CUDA graph carries its
    # cudaGraphLaunch's. 0: none recorded.
    corr: int
    # The id of the torch op or record_function range the launch ran inside
    # (FunctionEvent.id of that CPU event); 0: none recorded.
    linked: int = 0


def cuda_ops(prof: Any) -> list[DeviceOp]:
    """Every CUDA op a profiler recorded, in start order (the GPU ranges of
    record_function scopes left out: they span idle gaps too)."""
    return sorted(DeviceOp(float(e.time_range.start), float(e.time_range.end), e.name, int(e.id or 0),
                           int(getattr(e, "linked_correlation_id", 0) or 0))
                  for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA
                  and not getattr(e, "is_user_annotation", False)
                  and "annotation" not in str(getattr(e, "activity_type", "") or "").lower())


def cuda_spans(prof: Any) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every CUDA op a profiler recorded, in start order."""
    return [(op.start, op.end, op.name) for op in cuda_ops(prof)]


class LaunchCall(NamedTuple):
    """A host-side CUDA runtime or driver call that puts work on a stream."""

    start: float  # us, the profiler's clock
    name: str  # cudaLaunchKernel, cuLaunchKernelEx, cudaGraphLaunch, cudaMemcpyAsync, ...


def launch_calls(prof: Any) -> dict[int, LaunchCall]:
    """Correlation id -> the runtime / driver call a profiler recorded under it
    (CPU events named cuda* / cu*: the ids of torch ops are another counter)."""
    out: dict[int, LaunchCall] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU or not e.id or not e.name.startswith("cu"):
            continue
        out.setdefault(int(e.id), LaunchCall(float(e.time_range.start), e.name))
    return out


# ----------------------------------------------------------------- physical limits


def measure_matmul_tflops(device: torch.device, n: int = 8192, iters: int = 10,
                          dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    t = median_time(lambda: torch.matmul(a, b, out=c), device, iters, warmup=3)
    return {"n": n, "dtype": str(dtype).removeprefix("torch."), "median_s": t, "tflops": 2 * n**3 / t / 1e12}


def measure_copy_gbps(device: torch.device, nbytes: int = 2 << 30, iters: int = 10) -> dict[str, Any]:
    src = torch.empty(nbytes // 2, device=device, dtype=torch.bfloat16).fill_(1.0)
    dst = torch.empty_like(src)
    t = median_time(lambda: dst.copy_(src), device, iters, warmup=2)
    return {"bytes": nbytes, "median_s": t, "gbps_read_plus_write": 2 * nbytes / t / 1e9}


def measure_h2d_gbps(device: torch.device, nbytes: int = 1 << 30, iters: int = 5) -> dict[str, Any]:
    if device.type != "cuda":
        return {"skipped": "no CUDA device"}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    t = median_time(lambda: dev.copy_(host, non_blocking=True), device, iters, warmup=1)
    t_back = median_time(lambda: host.copy_(dev, non_blocking=True), device, iters, warmup=1)
    return {"bytes": nbytes, "h2d_gbps": nbytes / t / 1e9, "d2h_gbps": nbytes / t_back / 1e9}


# Datasheet HBM bandwidth (GB/s) by a name in torch.cuda.get_device_name: the
# roofline a reader quotes. The copy rate measured in the same run is the one a
# kernel can reach; benches report against both.
HBM_SPEC_GBPS = {"H200": 4800.0}


def hbm_spec_gbps(gpu_name: str) -> float | None:
    return next((v for k, v in HBM_SPEC_GBPS.items() if k in gpu_name), None)


def physical_limits(device: torch.device, smoke: bool) -> dict[str, Any]:
    if smoke:
        return {"matmul": measure_matmul_tflops(device, 512, 3, torch.float32),
                "copy": measure_copy_gbps(device, 64 << 20, 3),
                "h2d": measure_h2d_gbps(device, 64 << 20, 3)}
    return {"matmul": measure_matmul_tflops(device), "copy": measure_copy_gbps(device),
            "h2d": measure_h2d_gbps(device)}


# ----------------------------------------------------------------- model accounting


def param_bytes(cfg: Any, elem: int) -> dict[str, int]:
    """Weight bytes by kind for a ModelConfig (ftserve.models.config). An fp8
    checkpoint's projections and experts: one byte per weight plus an fp32 scale
    per 128 x 128 block (per row for per-channel scales); the router, lm_head and
    embeddings stay ``elem``."""
    h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    quant = getattr(cfg, "quant", None)
    welem: float = elem
    if quant is not None:
        welem = 1 + 4 / (quant.block[0] * quant.block[1]) if quant.strategy == "block" else 1 + 4 / h
    attn = int((h * (q + 2 * kv) + q * h) * welem)  # qkv + o, per layer
    sparse = sum(cfg.sparse_layers)
    dense_layers = cfg.num_layers - sparse
    expert = int(3 * h * cfg.moe_intermediate_size * welem)  # gate + up + down of one expert
    return {
        "attn_per_layer": attn,
        "router_per_layer": h * cfg.num_experts * elem,
        "expert": expert,
        "dense_mlp_per_layer": int(3 * h * cfg.intermediate_size * welem),
        "lm_head": cfg.vocab_size * h * elem,
        "sparse_layers": sparse,
        "dense_layers": dense_layers,
    }


def expected_distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """E * (1 - (1 - k/E)^B): distinct experts B tokens touch when each picks
    k of E uniformly (an approximation of real top-k routing); 0 for a dense model."""
    if num_experts == 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def decode_step_bytes(cfg: Any, elem: int, batch: int, context_lens: Sequence[int],
                      experts_per_layer: float | None = None) -> dict[str, float]:
    """HBM bytes one decode step must read: every attention / router / dense
    weight, the experts the batch is routed to, the lm_head, the batch's
    embedding rows, and the KV of every sequence."""
    pb = param_bytes(cfg, elem)
    if experts_per_layer is None:
        experts_per_layer = expected_distinct_experts(cfg.num_experts, cfg.num_experts_per_tok, batch)
    layers = cfg.num_layers
    weights = (layers * pb["attn_per_layer"] + pb["sparse_layers"] * (
        pb["router_per_layer"] + experts_per_layer * pb["expert"])
        + pb["dense_layers"] * pb["dense_mlp_per_layer"] + pb["lm_head"]
        + batch * cfg.hidden_size * elem)
    kv = sum(context_lens) * 2 * layers * cfg.num_kv_heads * cfg.head_dim * elem
    return {"weight_bytes": float(weights), "kv_bytes": float(kv), "total_bytes": float(weights + kv),
            "experts_per_layer": float(experts_per_layer)}


def prefill_flops(cfg: Any, new_tokens: int, prefix: int) -> dict[str, float]:
    """FLOPs of one prefill chunk of ``new_tokens`` over ``prefix`` cached
    tokens, one sequence. matmul: projections, router, the k experts each
    token is routed to (3 GEMMs), dense MLPs; the lm_head for the one sampled
    row. attention: QK^T and PV over causal new x new plus new x prefix pairs,
    4 * D FLOPs per (query head, key) pair. attention_square_flops: the same
    with new x new counted as a full square, the count issue 5's reference
    implies (its comparable engine: 0.040 s for a cold 4,096-token chunk of
    this model = "about 19%" of 790 TFLOP/s, i.e. ~6.0 TFLOP = matmul + square)."""
    h, t = cfg.hidden_size, new_tokens
    per_tok_layer = 2 * h * (cfg.q_size + 2 * cfg.kv_size) + 2 * cfg.q_size * h
    moe = 2 * h * cfg.num_experts + cfg.num_experts_per_tok * 3 * 2 * h * cfg.moe_intermediate_size
    dense = 3 * 2 * h * cfg.intermediate_size
    sparse = sum(cfg.sparse_layers)
    matmul = t * (cfg.num_layers * per_tok_layer + sparse * moe + (cfg.num_layers - sparse) * dense)
    matmul += 2 * h * cfg.vocab_size
    pairs = t * prefix + t * (t + 1) / 2
    per_pair = cfg.num_layers * cfg.num_heads * 4 * cfg.head_dim
    attention = per_pair * pairs
    return {"matmul_flops": float(matmul), "attention_flops": float(attention),
            "total_flops": float(matmul + attention),
            "attention_square_flops": float(per_pair * t * (prefix + t))}


# ----------------------------------------------------------------- model files


# ----------------------------------------------------------------- output


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            if v == 0 or abs(v) >= 100:
                return f"{v:,.0f}"
            return f"{v:.3g}" if abs(v) < 1 else f"{v:.1f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def write_json(path: str | Path, obj: Any) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=2, default=str))


class BenchRun(NamedTuple):
    device: torch.device
    results: dict[str, Any]  # machine info and the plain-valued args so far
    t_start: float  # time.perf_counter() at the start
    deadline: float  # t_start + args.budget_s (inf without a budget)
    model_dir: str  # a config-only checkpoint of args.preset


def start_run(args: Any, prefix: str) -> BenchRun:
    """The opening every engine benchmark shares: the device (CUDA missing is an
    error naming --smoke), the results dict, the clock and the --budget-s
    deadline, and args.preset's config cut to args.layers layers with
    max_position_embeddings = args.max_len (model_dir "" where args.preset is
    None: the caller brings a checkpoint)."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here; `--smoke` runs the CPU version")
    results: dict[str, Any] = {"machine": machine_info(device), "args": {
        k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, list, bool))}}
    t_start = time.perf_counter()
    budget = getattr(args, "budget_s", None)
    deadline = t_start + budget if budget is not None else math.inf
    model_dir = ""
    if args.preset is not None:
        model_dir = write_config(args.preset, tempfile.mkdtemp(prefix=prefix),
                                 layers=args.layers, max_position_embeddings=args.max_len)
    return BenchRun(device, results, t_start, deadline, model_dir)
