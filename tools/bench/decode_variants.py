"""Which batch-1 decode kernel variants win, measured in one bounded run.

    python -m tools.bench.decode_variants --out decode_variants.json          # H200, <= --budget-s (120)
    python -m tools.bench.decode_variants --smoke --out /tmp/variants.json    # CPU, tiny-moe
    python -m tools.bench.decode_variants --preset smollm2-135m --layers 30 \
        --only "kernels dense_gemv=0" --out dense.json                        # a dense model: GEMV vs cuBLAS

The engine is built once (qwen3-30b-a3b cut to --layers, dummy bf16 weights, as
tools/bench/engine builds it) and one --context-token prompt (2,048 by default) is
prefilled into the prefix cache. Then, for each variant (fields of the engine's
KernelConfig, or of the Triton attention backend's AttnKernelConfig):

    1. install the variant's KernelConfig (the build's with the variant's
       fields) in the runner and its sampler, and its attention config;
    2. re-capture the decode CUDA graphs: kernels are chosen while a graph is
       captured, so a config installed after the build changes nothing until then;
    3. greedy-decode 16 tokens after the prompt and compare them to
       the baseline's (a mismatch is reported, the variant is still timed);
    4. time the batch-1 graph alone (back-to-back replays, one CUDA event per
       replay, median), profile the kernels of one eager step, and measure the
       engine's full step rate at batch 1 and 8 (tools.bench.engine_measure.bench_decode).

Last, the fastest token-exact option of each knob (replay at least --min-gain
faster than the baseline) is combined into one variant and measured too. The
run stops itself within --budget-s (variants that would not fit are listed as
skipped); a failing variant is recorded and the run goes on. The build's
KernelConfig and backend are installed again at the end. On the CPU (--smoke) there are no graphs: the rows
hold the eager step rates only, and attention-config variants fail (the torch
backend has no kernel config).

The variant list, ranking, combination and table are tools/bench/variants.py;
this file measures them.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ftserve.engine.driver import EngineDriver
from ftserve.engine.request import ReqState
from ftserve_kernels.attention_common import AttnKernelConfig
from ftserve_kernels.config import KernelConfig
from tools.bench.common import (
    cuda_spans,
    decode_step_bytes,
    gpu_kernel_seconds,
    measure_copy_gbps,
    run_section,
    say,
    start_run,
    write_json,
)
from tools.bench.engine_driver import build
from tools.bench.engine_measure import bench_decode, prefill_base, prime_graph
from tools.bench.variants import (
    Variant,
    backend_for,
    combine_best,
    default_variants,
    render_table,
    score_ms,
    select_variants,
    should_skip,
)

TOP_KERNELS = 12
# A batch-1 greedy decode graph starts with the inputs launch and ends with
# the greedy sampler's (trace_engine cuts the engine's timeline at them).
FIRST_GRAPH_KERNEL = "_decode_inputs_kernel"
LAST_GRAPH_KERNELS = ("_greedy_kernel",)


@dataclass
class Bench:
    """What every variant run needs."""

    args: argparse.Namespace
    drv: EngineDriver
    device: torch.device
    mcfg: Any
    limits: dict[str, Any]
    # The prefilled prompt: the token check decodes after all of it (every
    # variant then recomputes the same last token over the same cached KV);
    # bench_decode reuses its prefix.
    base: list[int]
    base_attn: AttnKernelConfig  # what the build's backend runs with
    backend: Any  # the build's attention backend
    base_kernels: KernelConfig  # the build's kernel choices
    max_bs: int
    roofline_ms: float | None  # one batch-1 step's bytes at the copy bandwidth
    baseline_tokens: list[int] | None = None



def install(runner: Any, kernels: KernelConfig, backend: Any) -> None:
    """Make ``kernels`` and ``backend`` the ones the runner's steps (and its
    sampler) run: the next eager step, or the next graphs captured."""
    runner.kernels = kernels
    runner.sampler.kernels = kernels
    runner.attn_backend = backend


def recapture(b: Bench, kernels: KernelConfig, backend: Any) -> float | None:
    """Install ``kernels`` and ``backend`` and capture fresh decode graphs with
    them; seconds taken (None: no graphs on this device)."""
    runner = b.drv.runner
    b.drv.abort_all()  # nothing in flight may still read the old graphs' outputs
    install(runner, kernels, backend)
    if b.device.type != "cuda":
        return None
    from ftserve.engine.cuda_graph import DecodeGraphs

    runner.graphs = None  # the old graphs and their memory pool go first
    gc.collect()
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    graphs = DecodeGraphs(runner, b.max_bs)
    graphs.capture()
    runner.graphs = graphs
    return time.perf_counter() - t0


def greedy_tokens(b: Bench, n: int) -> list[int]:
    """The first n greedy tokens after the base prompt; the request is left
    in decode (it asked for more), so the caller can schedule one more step."""
    req = b.drv.add(b.base, max_tokens=n + 8)
    for _ in range(10 * n + 100):
        if len(req.output_ids) >= n:
            break
        b.drv.step()
    b.drv.flush()
    if len(req.output_ids) < n:
        raise RuntimeError(f"only {len(req.output_ids)} of {n} check tokens came out")
    return list(req.output_ids[:n])


def time_replay(b: Bench, batch: Any, reps: int) -> dict[str, Any]:
    """The batch's greedy graph replayed back to back, an event after each
    replay: per-replay device ms (median, min, max)."""
    from ftserve.engine.sampler import SamplerFeatures

    runner = b.drv.runner
    graphs = runner.graphs
    runner.prepare_slots(batch.reqs)
    g = prime_graph(graphs, batch, SamplerFeatures())  # the batch's words in both staging rows
    for _ in range(5):
        g.replay()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    torch.cuda.synchronize()
    events[0].record()
    for ev in events[1:]:
        g.replay()
        ev.record()
    torch.cuda.synchronize()
    graphs.reset_parity()
    ms = [a.elapsed_time(e) for a, e in zip(events, events[1:])]
    return {"replay_ms": statistics.median(ms), "replay_ms_min": min(ms), "replay_ms_max": max(ms),
            "replay_reps": reps}


def trace_replay(b: Bench, batch: Any, replays: int = 3) -> dict[str, Any]:
    """The kernel timeline of the batch's graph replay (profiler, ``replays``
    back to back; the last one is kept): per kernel its name, device us and the
    gap since the previous kernel ended (negative: they overlapped, as PDL lets
    them), so launch gaps and kernel times can be told apart."""
    from torch.profiler import ProfilerActivity, profile

    from ftserve.engine.sampler import SamplerFeatures

    runner = b.drv.runner
    graphs = runner.graphs
    runner.prepare_slots(batch.reqs)
    g = prime_graph(graphs, batch, SamplerFeatures())
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
    graphs.reset_parity()
    spans = cuda_spans(prof)
    per = len(spans) // replays
    last = spans[-per:] if per else []
    rows, prev_end = [], None
    for s, e, name in last:
        rows.append((name[:70], round(e - s, 2), None if prev_end is None else round(s - prev_end, 2)))
        prev_end = e if prev_end is None else max(prev_end, e)
    wall = (last[-1][1] - last[0][0]) if last else 0.0
    busy = sum(r[1] for r in rows)
    return {"kernels": rows, "num_kernels": len(rows), "span_us": round(wall, 1),
            "kernel_us": round(busy, 1), "gap_us": round(sum(r[2] or 0.0 for r in rows), 1)}


def trace_engine(b: Bench, steps: int = 8, warmup: int = 4) -> dict[str, Any]:
    """The GPU timeline of the engine's own batch-1 decode loop (overlapped,
    as it serves): every CUDA op of ``steps`` steps under the profiler, cut
    into steps at each graph's first kernel. Per step: its period, the time
    inside its graph (first to last kernel), and what lies between two graphs
    (the copies and kernels outside them, and the idle gaps), so the engine's
    cost over a bare replay can be told apart. Medians over the whole steps."""
    from torch.profiler import ProfilerActivity, profile

    drv = b.drv
    req = drv.add(b.base, max_tokens=warmup + steps + 16)
    for _ in range(10 * (warmup + steps) + 100):
        if req.state is ReqState.DECODE and len(req.output_ids) >= warmup:
            break
        drv.step()
    drv.flush()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            drv.step()
        drv.flush()
        torch.cuda.synchronize()
    drv.abort_all()
    ops = cuda_spans(prof)
    starts = [i for i, (_, _, name) in enumerate(ops) if name.startswith(FIRST_GRAPH_KERNEL)]
    periods, inside, between = [], [], []
    for i, j in zip(starts, starts[1:]):
        step = ops[i:j]
        ends = [k for k, (_, _, name) in enumerate(step) if name.startswith(LAST_GRAPH_KERNELS)]
        last_in = ends[-1] if ends else len(step) - 1
        periods.append(ops[j][0] - step[0][0])
        inside.append(step[last_in][1] - step[0][0])
        rows, prev_end = [], step[last_in][1]
        for s, e, name in step[last_in + 1:] + [ops[j]]:
            rows.append((name[:70], round(e - s, 2), round(s - prev_end, 2)))
            prev_end = max(prev_end, e)
        between.append(rows)
    if not periods:
        return {"error": f"no two graph steps found ({len(ops)} CUDA ops)"}
    return {"steps": len(periods), "period_us": round(statistics.median(periods), 1),
            "graph_us": round(statistics.median(inside), 1),
            "between_us": round(statistics.median(p - g for p, g in zip(periods, inside)), 1),
            "between_last": between[-1]}


def eager_kernels(b: Bench, batch: Any) -> dict[str, Any]:
    """Kernels of one eager (graph-less) launch of the batch."""
    runner = b.drv.runner
    # bench_common.gpu_kernel_seconds lists its top 8; ask for more once it can.
    kw = {"top": TOP_KERNELS} if "top" in inspect.signature(gpu_kernel_seconds).parameters else {}
    saved, runner.graphs = runner.graphs, None
    try:
        prof = gpu_kernel_seconds(lambda: runner.launch(batch), b.device, **kw)
    finally:
        runner.graphs = saved
    kernel_s = prof.get("kernel_s")
    return {"eager_kernel_ms": kernel_s * 1e3 if kernel_s is not None else None,
            "eager_num_kernels": prof.get("num_kernels"), "eager_top_kernels": prof.get("top")}


def run_variant(b: Bench, v: Variant) -> dict[str, Any]:
    args, drv = b.args, b.drv
    row: dict[str, Any] = {"name": v.name, "group": v.group, "kernels": dict(v.kernels), "attn": dict(v.attn)}
    kernels = v.kernel_config(b.base_kernels)
    row["kernels_run"] = kernels.summary()
    row["capture_s"] = recapture(b, kernels, backend_for(b.backend, b.base_attn, v))
    backend = b.drv.runner.attn_backend
    if hasattr(backend, "num_splits"):  # the Triton backend: split-K programs per (seq, KV head)
        # At the measured context (plus the steps decoded over it).
        longest = args.context + args.check_steps + 1
        row["attn_splits"] = {bs: backend.num_splits(bs, b.mcfg.num_kv_heads, b.device, longest)
                              for bs in args.batches}
    row["tokens"] = tokens = greedy_tokens(b, args.check_steps)
    if b.baseline_tokens is None:
        row["tokens_ok"] = True if v.name == "baseline" else None
    else:
        bad = [i for i, (x, y) in enumerate(zip(tokens, b.baseline_tokens)) if x != y]
        row["tokens_ok"] = not bad
        row["mismatch_at"] = bad[0] if bad else None
    batch = drv.sched.schedule()  # one more decode step of the check request
    if batch is not None and batch.is_decode:
        with torch.inference_mode():
            if drv.runner.graphs is not None and drv.runner.graphs.can_run(len(batch.reqs)):
                row.update(time_replay(b, batch, args.replay_reps))
                if args.trace:
                    row["replay_trace"] = trace_replay(b, batch)
            row.update(eager_kernels(b, batch))
    drv.abort_all()
    if args.trace and b.device.type == "cuda" and drv.runner.graphs is not None:
        try:
            row["engine_trace"] = et = trace_engine(b)
        except Exception as exc:  # noqa: BLE001 - a diagnostic; the variant's numbers stand
            row["engine_trace"] = et = {"error": f"{type(exc).__name__}: {exc}"}
            drv.abort_all()
        say(f"  engine loop: period {et.get('period_us')} us, in the graph {et.get('graph_us')}, "
            f"between graphs {et.get('between_us')}")
    if row.get("replay_ms") and b.roofline_ms:
        row["replay_frac_of_roofline"] = b.roofline_ms / row["replay_ms"]
    for bs in args.batches:
        row[f"decode_b{bs}"] = bench_decode(drv, b.device, b.mcfg, b.limits, b.base, args.context, bs,
                                            args.decode_warmup, args.decode_steps, args.tail)
        drv.abort_all()
    return row


def measure(b: Bench, variants: Sequence[Variant], results: dict[str, Any], deadline: float) -> None:
    """Run the variants in order, then the best-of-each combination; rows go
    to results["variants"] as they finish (the JSON is rewritten each time)."""
    rows: list[dict[str, Any]] = results.setdefault("variants", [])
    skipped: list[str] = results.setdefault("skipped", [])
    durations: list[float] = []

    def one(v: Variant, reserve: int) -> None:
        if v.name != "baseline" and should_skip(time.perf_counter(), deadline, durations, reserve):
            skipped.append(v.name)
            say(f"variant {v.name} skipped: {deadline - time.perf_counter():.0f} s left, "
                f"a variant takes up to {max(durations):.0f} s")
            return
        t0 = time.perf_counter()
        out = run_section(results, f"variant {v.name}", lambda: run_variant(b, v))
        results.pop(f"variant {v.name}", None)
        durations.append(time.perf_counter() - t0)
        if out is None:  # run_section recorded the error
            out = {"name": v.name, "group": v.group, "kernels": dict(v.kernels), "attn": dict(v.attn),
                   "error": results["errors"][f"variant {v.name}"]}
            try:
                b.drv.abort_all()
            except Exception as exc:  # noqa: BLE001 - the next variant starts over anyway
                say(f"  abort after a failed variant failed too: {exc}")
        out["seconds"] = durations[-1]
        rows.append(out)
        if v.name == "baseline" and not out.get("error"):
            b.baseline_tokens = out["tokens"]
        say(f"  {v.name}: replay {out.get('replay_ms')} ms, tokens ok {out.get('tokens_ok')}")
        write_json(b.args.out, results)

    for v in variants:
        one(v, reserve=2)  # keep room for the combination
    combo, winners = combine_best(rows, variants, b.args.min_gain)
    results["winners"] = winners
    if combo is not None:
        one(combo, reserve=1)
    scored = [r for r in rows if not r.get("error") and r.get("tokens_ok") and score_ms(r) is not None]
    if scored:
        best = min(scored, key=lambda r: score_ms(r) or 0.0)
        results["best"] = {k: best.get(k) for k in ("name", "kernels", "attn", "replay_ms")}


def b1_roofline(mcfg: Any, elem: int, context: int, limits: dict[str, Any]) -> dict[str, Any]:
    """HBM bytes of one batch-1 step at ``context`` and the time the measured
    copy bandwidth needs for them (one token routes to exactly top_k experts)."""
    nbytes = decode_step_bytes(mcfg, elem, 1, [context])
    out: dict[str, Any] = {"context": context, **nbytes}
    bw = limits.get("copy", {}).get("gbps_read_plus_write")
    if bw:
        out["ms"] = nbytes["total_bytes"] / (bw * 1e9) * 1e3
        out["tokens_per_s"] = 1e3 / out["ms"]
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_decode_variants.json", help="JSON results path")
    p.add_argument("--smoke", action="store_true", help="tiny-moe on the CPU, no graphs (<60 s)")
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--budget-s", type=float, default=None, help="whole-run limit (default 120; smoke 60)")
    p.add_argument("--only", default="", help="comma-separated variants (baseline always runs): names from "
                   "tools/bench/variants.default_variants, or ad hoc 'attn decode_block_n=128 decode_warps=8' "
                   "(AttnKernelConfig fields) / 'kernels gemv_entries=KEY@T=BN.BK.W.S' (KernelConfig fields)")
    p.add_argument("--min-gain", type=float, default=0.01,
                   help="a knob joins the combination when its replay beats the baseline by this fraction")
    p.add_argument("--trace", action="store_true",
                   help="record each variant's kernel timeline of one batch-1 graph replay")
    p.add_argument("--context", type=int, default=2048,
                   help="tokens of the cached prompt the decode steps attend over (H200 runs)")
    args = p.parse_args(argv)
    if args.context < 16:
        raise SystemExit(f"--context {args.context}: at least 16 tokens")
    args.dtype, args.device, args.batches = "bfloat16", "cuda", [1, 8]
    args.check_steps, args.replay_reps = 16, 200
    args.decode_warmup, args.decode_steps, args.tail = 4, 64, 16
    # Room for the prompt and the decode steps after it; KV for the batch-8 rows
    # (they share the prompt's pages through the prefix cache).
    args.chunk, args.max_len = 2048, max(4096, args.context + 2048)
    args.kv_tokens = max(1 << 17, 2 * args.max_len)
    if args.smoke:
        args.preset, args.layers, args.dtype, args.device = "tiny-moe", 2, "float32", "cpu"
        args.context, args.batches, args.chunk, args.max_len, args.kv_tokens = 160, [1, 3], 64, 1024, 8192
        args.check_steps, args.decode_steps = 6, 3
    if args.budget_s is None:
        args.budget_s = 60.0 if args.smoke else 120.0
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device, results, t_start, deadline, model_dir = start_run(args, "ftserve-variants-")
    copy = run_section(results, "copy", lambda: measure_copy_gbps(
        device, (64 << 20) if args.smoke else (2 << 30), 3 if args.smoke else 10))
    limits: dict[str, Any] = {"copy": copy} if copy else {}
    results["limits"] = results.pop("copy", None)
    engine = run_section(results, "engine_build", lambda: build(args, model_dir, device))
    if engine is None:
        write_json(args.out, results)
        return results
    results["engine_build"] = dict(engine.summary)
    runner = engine.runner
    drv = EngineDriver(engine)
    mcfg = engine.model_config
    elem = torch.empty((), dtype=next(runner.model.parameters()).dtype).element_size()
    roof = b1_roofline(mcfg, elem, args.context, limits)
    results["roofline_b1"] = roof
    backend = runner.attn_backend
    base_attn = getattr(backend, "cfg", None) or AttnKernelConfig.for_device(device, mcfg.head_dim)
    base = drv.tokens(args.context)
    max_bs = runner.graphs.max_bs if runner.graphs is not None else max(args.batches)
    kernels = runner.kernels  # the build's: its prefill graphs and the prefix every variant reads
    b = Bench(args, drv, device, mcfg, limits, base, base_attn, backend, kernels, max_bs, roof.get("ms"))
    try:
        if run_section(results, "base_prefill", lambda: prefill_base(drv, base, device)) is not None:
            variants = default_variants(base_attn)
            if args.only:
                try:
                    variants = select_variants(variants, args.only, base_attn)
                except ValueError as err:
                    raise SystemExit(f"{err}; named variants: {', '.join(v.name for v in variants)}") from None
            measure(b, variants, results, deadline)
    finally:
        install(runner, kernels, backend)
        engine.shutdown()
    results["total_s"] = time.perf_counter() - t_start
    results["table"] = render_table(results.get("variants", []), args.batches, results.get("skipped", []))
    write_json(args.out, results)
    print(results["table"], flush=True)
    say(f"wrote {args.out} in {results['total_s']:.0f} s")
    return results


if __name__ == "__main__":
    main()
