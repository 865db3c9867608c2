"""Engine benchmarks at a real model shape with dummy weights (issue 5 item 5).

    python -m tools.bench_engine --out bench_engine.json          # H200, ~4 min
    python -m tools.bench_engine --smoke --out /tmp/smoke.json    # CPU, tiny-moe

Sections (each one recorded, or its error recorded, in the JSON; the run goes on):
    limits   bf16 matmul TFLOP/s, device copy GB/s, pinned H2D GB/s
    engine   start-up summary (CUDA graphs must be on)
    cold     cold prefill of one 4,096-token prompt
    cached   one 4,096-token chunk over 0 / 8k / 32k / 100k cached tokens:
             FLOPs, TFLOP/s, attention TFLOP/s, GPU-busy fraction (profiler)
    decode   tokens/s at batch 1/8/32/64 x context 2k/32k vs the HBM roofline
    hf       the same config through transformers (random weights, sdpa)

The Scheduler and ModelRunner are driven directly on this thread, so every
measured region is exactly one runner.step (or N decode steps, overlapped as
the engine thread runs them, and again without overlap for reference),
bracketed by torch.cuda.synchronize and CUDA events. The rope table is stretched to 131,072
positions (max_position_embeddings) so a 100k prefix fits; that changes no
FLOP or byte count.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch

from ftserve.config import EngineConfig
from ftserve.engine.engine import Engine
from ftserve.engine.request import Req, ReqState
from ftserve.engine.runner import Launched
from ftserve.engine.sampling_params import SamplingParams
from ftserve.engine.scheduler import ScheduledBatch
from tools.bench_common import (
    decode_step_bytes,
    gpu_kernel_seconds,
    physical_limits,
    prefill_flops,
    run_section,
    say,
    start_run,
    timed,
    write_json,
)
from tools.bench_engine_report import check_targets, render_markdown

SECTIONS = ("limits", "cold", "cached", "decode", "hf")


class EngineDriver:
    """Drives Scheduler + ModelRunner on this thread, one step per call.

    ``step`` is the engine's overlapped step (EngineCore._step): plan and
    launch step N+1, then read back and commit step N. ``sync_step`` is
    launch + read-back + commit of one step with nothing in flight.
    """

    def __init__(self, engine: Engine, seed: int = 0) -> None:
        self.engine = engine
        self.sched = engine.scheduler
        self.runner = engine.runner
        self.rng = random.Random(seed)
        self.vocab = int(engine.model_config.vocab_size)
        self.inflight: Launched | None = None
        self.host_s = 0.0  # time spent planning, launching and committing (not waiting)
        self._n = 0

    def tokens(self, n: int) -> list[int]:
        """Random prompt ids away from the special ids at the start of the vocab."""
        return [self.rng.randrange(100, self.vocab - 1) for _ in range(n)]

    def add(self, prompt: list[int], max_tokens: int) -> Req:
        self._n += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        req = Req(f"bench-{self._n}", list(prompt), params, time.monotonic())
        why = self.sched.validate(req)
        if why is not None:
            raise ValueError(why)
        self.sched.add(req)
        return req

    def step(self) -> ScheduledBatch | None:
        t0 = time.perf_counter()
        batch = self.sched.schedule()
        launched = self.runner.launch(batch) if batch is not None else None
        self.host_s += time.perf_counter() - t0
        prev, self.inflight = self.inflight, None
        if prev is not None:
            self.finish(prev)
        if launched is not None:
            if launched.out is None:
                self.finish(launched)  # a non-final chunk: nothing to wait for
            else:
                self.inflight = launched
        return batch

    def finish(self, launched: Launched) -> None:
        """Read back (the step's one deliberate sync) and commit."""
        token_ids, logprobs = self.runner.collect(launched)
        t0 = time.perf_counter()
        self.sched.commit(launched.batch, token_ids, logprobs)
        self.sched.finished_reqs.clear()
        self.host_s += time.perf_counter() - t0

    def flush(self) -> None:
        prev, self.inflight = self.inflight, None
        if prev is not None:
            self.finish(prev)

    def sync_step(self, batch: ScheduledBatch | None = None) -> ScheduledBatch | None:
        self.flush()
        batch = batch if batch is not None else self.sched.schedule()
        if batch is not None:
            self.finish(self.runner.launch(batch))
        return batch

    @property
    def idle(self) -> bool:
        return self.inflight is None and not self.sched.has_work

    def run_all(self, max_steps: int = 1_000_000) -> None:
        for _ in range(max_steps):
            if self.step() is None and self.idle:
                return
        raise RuntimeError(f"work left after {max_steps} steps")

    def abort_all(self) -> None:
        self.flush()
        for req in list(self.sched.by_id.values()):
            self.sched.finish(req, "abort")
        self.sched.finished_reqs.clear()


# ----------------------------------------------------------------- prefill


def prefill_chunk(drv: EngineDriver, prompt: list[int], prefix: int, chunk: int,
                  device: torch.device, profile: bool = False) -> dict[str, Any]:
    """Time the single prefill chunk of ``prompt`` that follows ``prefix``
    cached tokens (the prompt must end right after the chunk)."""
    drv.flush()
    req = drv.add(prompt, max_tokens=1)
    t0 = time.perf_counter()
    batch = drv.sched.schedule()
    sched_s = time.perf_counter() - t0
    assert batch is not None and batch.reqs == [req], "the chunk must run alone"
    got_prefix, got_new = batch.prefix_lens[0], len(batch.new_tokens[0])
    if (got_prefix, got_new) != (prefix, chunk):
        drv.sync_step(batch)
        drv.run_all()
        raise RuntimeError(f"expected a {chunk}-token chunk over {prefix} cached tokens, "
                           f"the scheduler planned {got_new} over {got_prefix} (prefix evicted?)")
    out: dict[str, Any] = {"schedule_s": sched_s}
    if profile:
        res: list[Any] = []
        out["profile"] = gpu_kernel_seconds(lambda: res.append(drv.runner.step(batch)), device,
                                            ("extend", "attention"))
        token_ids = res[0][0]
    else:
        out["wall_s"], out["gpu_s"], (token_ids, _) = timed(lambda: drv.runner.step(batch), device)
    drv.sched.commit(batch, token_ids, None)
    drv.sched.finished_reqs.clear()
    assert req.finished, "a one-token request ends with its final chunk"
    return out


def bench_prefill(drv: EngineDriver, device: torch.device, mcfg: Any, limits: dict[str, Any],
                  chunk: int, prefix: int, base: list[int], reps: int) -> dict[str, Any]:
    """Median over ``reps`` chunks (after one warm-up) plus one profiled chunk."""
    runs = []
    for i in range(reps + 2):
        prompt = base[:prefix] + drv.tokens(chunk)
        runs.append(prefill_chunk(drv, prompt, prefix, chunk, device, profile=i == reps + 1))
    timed_runs = runs[1:reps + 1]
    wall = statistics.median(r["wall_s"] for r in timed_runs)
    gpu = statistics.median(r["gpu_s"] for r in timed_runs)
    sched = statistics.median(r["schedule_s"] for r in timed_runs)
    fl = prefill_flops(mcfg, chunk, prefix)
    prof = runs[-1]["profile"]
    out: dict[str, Any] = {
        "prefix": prefix, "chunk": chunk, "wall_s": wall, "gpu_event_s": gpu, "schedule_s": sched,
        "tokens_per_s": chunk / wall, **fl,
        "tflops": fl["total_flops"] / wall / 1e12,
        "matmul_tflops": fl["matmul_flops"] / wall / 1e12,
        "walls_s": [r["wall_s"] for r in timed_runs],
        "kernel_s": prof["kernel_s"], "top_kernels": prof["top"],
    }
    mm = (limits or {}).get("matmul", {}).get("tflops")
    if mm:
        out["matmul_frac_of_peak"] = out["matmul_tflops"] / mm
        out["total_frac_of_peak"] = out["tflops"] / mm
    if prof["kernel_s"] is not None:
        out["gpu_busy"] = prof["kernel_s"] / wall
        out["gpu_busy_incl_schedule"] = prof["kernel_s"] / (wall + sched)
        attn_s = prof["by_filter"].get("extend") or 0.0
        if attn_s > 0:
            out["attention_kernel_s"] = attn_s
            out["attention_tflops"] = fl["attention_flops"] / attn_s / 1e12
            if mm:
                out["attention_frac_of_peak"] = out["attention_tflops"] * 1e12 / (mm * 1e12)
    return out


def prefill_base(drv: EngineDriver, base: list[int], device: torch.device) -> dict[str, Any]:
    """Prefill the shared base prompt chunk by chunk (timing each), then leave
    it in the prefix cache for the cached-prefix and decode sections."""
    drv.flush()
    req = drv.add(base, max_tokens=1)
    curve: list[tuple[int, int, float]] = []
    while not req.finished:
        batch = drv.sched.schedule()
        assert batch is not None
        wall, _, _ = timed(lambda b=batch: drv.sync_step(b), device)
        curve.append((batch.prefix_lens[0], len(batch.new_tokens[0]), wall))
        if len(curve) % 8 == 0:
            say(f"  base prefill: {batch.prefix_lens[0] + len(batch.new_tokens[0])} / {len(base)} "
                f"tokens, last chunk {wall:.3f} s")
    return {"tokens": len(base), "chunks": [{"prefix": p, "new": n, "wall_s": w} for p, n, w in curve],
            "total_s": sum(w for _, _, w in curve)}


# ----------------------------------------------------------------- decode


def count_routed_experts(drv: EngineDriver, batch: ScheduledBatch) -> float | None:
    """Mean distinct experts per MoE layer for this decode batch, from one
    eager forward with hooks on the routers (outside any timed region; it
    writes the KV this batch would write anyway)."""
    from ftserve.models.layers import MoEBlock

    blocks = [m for m in drv.runner.model.modules() if isinstance(m, MoEBlock)]
    if not blocks:
        return None
    counts: list[int] = []

    def hook(mod: torch.nn.Module, _inp: Any, out: torch.Tensor) -> None:
        ids = out.float().topk(mod.top_k, dim=-1).indices  # [B, k]
        counts.append(int(torch.unique(ids).numel()))

    handles = [b.gate.register_forward_hook(
        lambda m, i, o, blk=b: hook(blk, i, o)) for b in blocks]
    try:
        drv.runner.prepare_slots(batch.reqs)
        fb, _, _, _ = drv.runner.build(batch)
        with torch.inference_mode():
            drv.runner.model(fb)
    finally:
        for h in handles:
            h.remove()
    # No router call seen (the fused decode route of T <= 8 bypasses the gate
    # module): fall back to the expectation instead of failing the section.
    return sum(counts) / len(counts) if counts else None


def profile_host(fn: Any, top: int = 25) -> list[tuple[str, int, float, float]]:
    """cProfile of the host side of fn: (function, calls, tottime ms, cumtime ms)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    try:
        fn()
    finally:
        prof.disable()
    st = pstats.Stats(prof)
    rows = []
    for (file, line, name), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        rows.append((f"{file.rsplit('/', 1)[-1]}:{line}({name})", nc, tt * 1e3, ct * 1e3))
    rows.sort(key=lambda r: -r[2])
    return rows[:top]


def time_decode_device(drv: EngineDriver, batch: ScheduledBatch, device: torch.device,
                       reps: int = 50) -> dict[str, Any]:
    """Device time of one decode step alone: replay its CUDA graph back to back
    (no host work between replays), plus the eager step's heaviest kernels."""
    out: dict[str, Any] = {}
    if device.type != "cuda":
        return out
    with torch.inference_mode():
        return _time_decode_device(drv, batch, device, reps, out)


def _time_decode_device(drv: EngineDriver, batch: ScheduledBatch, device: torch.device,
                        reps: int, out: dict[str, Any]) -> dict[str, Any]:
    runner = drv.runner
    graphs = runner.graphs
    if graphs is not None and graphs.can_run(len(batch.reqs)):
        runner.prepare_slots(batch.reqs)
        graphs.replay(batch)  # fills the static inputs for this batch
        key = next(k for k in graphs.graphs if k[0] == graphs._padded(len(batch.reqs)))
        g = graphs.graphs[key]
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        out["graph_replay_ms"] = start.elapsed_time(end) / reps
    saved, runner.graphs = runner.graphs, None
    try:
        prof = gpu_kernel_seconds(lambda: runner.launch(batch), device)
    finally:
        runner.graphs = saved
    out["eager_kernel_ms"] = (prof.get("kernel_s") or 0.0) * 1e3
    out["eager_top_kernels"] = [(n, round(t * 1e3, 4)) for n, t in prof.get("top", [])]
    return out


def bench_decode(drv: EngineDriver, device: torch.device, mcfg: Any, limits: dict[str, Any],
                 base: list[int], context: int, batch_size: int, warmup: int, steps: int,
                 tail: int) -> dict[str, Any]:
    reqs = [drv.add(base[:context - tail] + drv.tokens(tail), max_tokens=warmup + 4 * steps + 8)
            for _ in range(batch_size)]
    prefill_steps = 0
    while any(r.state is not ReqState.DECODE for r in reqs):
        drv.step()
        prefill_steps += 1
        if prefill_steps > 10 * batch_size + 100:
            raise RuntimeError("requests never reached decode")
    for _ in range(warmup):
        drv.step()
    drv.flush()
    ctx_before = sum(r.computed_len for r in reqs)

    def run(step: Any) -> None:
        for _ in range(steps):
            batch = step()
            assert batch is not None and batch.is_decode and len(batch.reqs) == batch_size
        drv.flush()  # the last step's tokens must reach the host too

    drv.host_s = 0.0
    wall, gpu, _ = timed(lambda: run(drv.step), device)  # overlapped, as the engine runs
    host_s = drv.host_s
    ctx_after = sum(r.computed_len for r in reqs)
    mean_ctx = (ctx_before + ctx_after) / 2 / batch_size
    wall_sync, _, _ = timed(lambda: run(drv.sync_step), device)  # no overlap, for reference
    host_profile = profile_host(lambda: run(drv.step)) if batch_size == 1 else None
    batch = drv.sched.schedule()
    measured_experts = None
    replay: dict[str, Any] = {}
    if batch is not None and batch.is_decode:
        measured_experts = count_routed_experts(drv, batch)
        replay = time_decode_device(drv, batch, device)
    drv.abort_all()
    elem = torch.empty((), dtype=next(drv.runner.model.parameters()).dtype).element_size()
    nbytes = decode_step_bytes(mcfg, elem, batch_size, [int(mean_ctx)] * batch_size, measured_experts)
    expected = decode_step_bytes(mcfg, elem, batch_size, [int(mean_ctx)] * batch_size)
    out: dict[str, Any] = {
        "context": context, "batch": batch_size, "steps": steps, "wall_s": wall, "gpu_event_s": gpu,
        "step_ms": wall / steps * 1e3, "tokens_per_s": batch_size * steps / wall,
        "tokens_per_s_no_overlap": batch_size * steps / wall_sync,
        "host_ms_per_step": host_s / steps * 1e3, "host_frac": host_s / wall, "mean_context": mean_ctx,
        "experts_per_layer_measured": measured_experts,
        "experts_per_layer_expected": expected["experts_per_layer"],
        "experts_source": "measured routing" if measured_experts is not None else "expectation",
        **{k: v for k, v in nbytes.items() if k != "experts_per_layer"},
        "graph": drv.runner.graphs is not None and drv.runner.graphs.can_run(batch_size),
        **replay,
    }
    if host_profile is not None:
        out["host_profile_top"] = host_profile
    bw = (limits or {}).get("copy", {}).get("gbps_read_plus_write")
    if bw:
        t_roof = nbytes["total_bytes"] / (bw * 1e9)
        out["roofline_tokens_per_s"] = batch_size / t_roof
        out["frac_of_roofline"] = out["tokens_per_s"] / out["roofline_tokens_per_s"]
    return out


# ----------------------------------------------------------------- transformers peer


def bench_hf(model_dir: str, device: torch.device, dtype: torch.dtype, prefill_len: int,
             decode_ctx: int, decode_steps: int, reps: int) -> dict[str, Any]:
    import transformers

    hf_cfg = transformers.AutoConfig.from_pretrained(model_dir)
    cls = getattr(transformers, hf_cfg.architectures[0])
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls._from_config(hf_cfg, attn_implementation="sdpa")
    finally:
        torch.set_default_dtype(old)
    model = model.to(device=device, dtype=dtype).eval()
    with torch.no_grad():
        # Same scales as ftserve's dummy fill: HF's init (router std 0.02)
        # gives near-tied router logits, every token would pick the same
        # experts and the expert loop would look cheaper than real routing.
        for name, p in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                p.normal_(0.0, 1.0)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, hf_cfg.hidden_size ** -0.5)
    gen = torch.Generator(device="cpu").manual_seed(0)
    vocab = hf_cfg.vocab_size
    out: dict[str, Any] = {"transformers": transformers.__version__, "attn_implementation": "sdpa",
                           "experts_implementation": getattr(model.config, "_experts_implementation", None)}

    def fwd(ids: torch.Tensor, **kw: Any) -> Any:
        try:
            return model(input_ids=ids, logits_to_keep=1, **kw)
        except TypeError:
            return model(input_ids=ids, **kw)

    with torch.inference_mode():
        times = []
        for i in range(reps + 1):
            ids = torch.randint(100, vocab - 1, (1, prefill_len), generator=gen).to(device)
            wall, _, _ = timed(lambda ids=ids: fwd(ids, use_cache=False), device)
            if i:
                times.append(wall)
        out["prefill_tokens"] = prefill_len
        out["prefill_s"] = statistics.median(times)
        out["prefill_tokens_per_s"] = prefill_len / out["prefill_s"]
        ids = torch.randint(100, vocab - 1, (1, decode_ctx), generator=gen).to(device)
        res = fwd(ids, use_cache=True)
        past, nxt = res.past_key_values, res.logits[:, -1:].argmax(-1)
        for _ in range(2):  # warm-up steps
            res = fwd(nxt, past_key_values=past, use_cache=True)
            past, nxt = res.past_key_values, res.logits[:, -1:].argmax(-1)

        def run() -> None:
            nonlocal past, nxt
            for _ in range(decode_steps):
                r = fwd(nxt, past_key_values=past, use_cache=True)
                past, nxt = r.past_key_values, r.logits[:, -1:].argmax(-1)

        wall, _, _ = timed(run, device)
    out.update(decode_context=decode_ctx, decode_steps=decode_steps, decode_b1_tokens_per_s=decode_steps / wall)
    return out


# ----------------------------------------------------------------- main


def build(args: argparse.Namespace, model_dir: str, device: torch.device) -> Engine:
    from ftserve.engine.setup import build_engine

    cfg = EngineConfig(
        model=model_dir, load_format="dummy", dtype=args.dtype, device=str(device),
        page_size=16, kv_cache_tokens=args.kv_tokens, max_prefill_length=args.chunk,
        max_running_requests=max(args.batches), cuda_graph_max_bs=max(args.batches),
        attention_backend="auto", status_log_interval=0.0, max_model_len=args.max_len,
    )
    return build_engine(cfg)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_engine.json", help="JSON results path")
    p.add_argument("--smoke", action="store_true", help="tiny-moe on the CPU, tiny lengths (<60 s)")
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--load-format", default="dummy", choices=["dummy"])
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"subset of {','.join(SECTIONS)}")
    p.add_argument("--batches", dest="batches_arg", default=None, help="decode batch sizes, e.g. 1,8 (default 1,8,32,64)")
    p.add_argument("--contexts", dest="contexts_arg", default=None, help="decode contexts, e.g. 2048 (default 2048,32768)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="skip sections that would start after this many seconds (default 330; smoke 50)")
    args = p.parse_args(argv)
    args.chunk, args.reps, args.max_len = 4096, 3, 131072
    args.cached = [0, 8192, 32768, 102400]
    args.contexts, args.batches = [2048, 32768], [1, 8, 32, 64]
    args.decode_warmup, args.decode_steps, args.tail = 4, 32, 16
    args.kv_tokens = 1 << 19
    if args.smoke:
        args.preset, args.layers, args.dtype, args.device = "tiny-moe", 2, "float32", "cpu"
        args.chunk, args.reps, args.max_len = 64, 1, 1024
        args.cached = [0, 64, 256]
        args.contexts, args.batches = [48, 160], [1, 3]
        args.decode_warmup, args.decode_steps, args.tail = 1, 3, 16
        args.kv_tokens = 8192
    if args.batches_arg:
        args.batches = [int(x) for x in args.batches_arg.split(",")]
    if args.contexts_arg:
        args.contexts = [int(x) for x in args.contexts_arg.split(",")]
    if args.budget_s is None:
        args.budget_s = 50.0 if args.smoke else 330.0
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device, results, t_start, deadline, model_dir = start_run(args, "ftserve-bench-")
    wanted = set(args.sections.split(","))

    def section(name: str, fn: Any, budgeted: bool = True) -> Any:
        out = run_section(results, name, fn, deadline if budgeted else None)
        write_json(args.out, results)  # a run killed later still leaves what it measured
        return out

    limits = section("limits", lambda: physical_limits(device, args.smoke), False) or {}
    engine = section("engine_build", lambda: build(args, model_dir, device), False)
    if engine is not None:
        results["engine_build"] = dict(engine.summary)
        if device.type == "cuda" and engine.runner.graphs is None:
            results.setdefault("errors", {})["cuda_graphs"] = "CUDA graphs are OFF: numbers are not valid"
        drv = EngineDriver(engine)
        mcfg = engine.model_config
        base = drv.tokens(max(max(args.cached), max(args.contexts)))
        if "cold" in wanted:
            section("cold_prefill", lambda: bench_prefill(
                drv, device, mcfg, limits, args.chunk, 0, [], args.reps))
        if wanted & {"cached", "decode"}:
            section("base_prefill", lambda: prefill_base(drv, base, device))
        if "cached" in wanted:
            rows = []
            for prefix in args.cached:
                r = section(f"cached_{prefix}", lambda p=prefix: bench_prefill(
                    drv, device, mcfg, limits, args.chunk, p, base, args.reps))
                drv.abort_all()
                if r is not None:
                    rows.append(r)
                    results.pop(f"cached_{prefix}")
            results["cached_prefill"] = rows
        if "decode" in wanted:
            rows = []
            for ctx in args.contexts:
                for bs in args.batches:
                    r = section(f"decode_{ctx}_{bs}", lambda c=ctx, b=bs: bench_decode(
                        drv, device, mcfg, limits, base, c, b, args.decode_warmup, args.decode_steps,
                        args.tail))
                    drv.abort_all()
                    if r is not None:
                        rows.append(r)
                        results.pop(f"decode_{ctx}_{bs}")
            results["decode"] = rows
        engine.shutdown()
        del drv, engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "hf" in wanted:
        dtype = getattr(torch, args.dtype)
        section("hf", lambda: bench_hf(
            model_dir, device, dtype, args.chunk, args.contexts[0], args.decode_steps, args.reps))
    results["total_s"] = time.perf_counter() - t_start
    results["targets"] = check_targets(results)
    write_json(args.out, results)
    print(render_markdown(results), flush=True)
    say(f"wrote {args.out} in {results['total_s']:.0f} s")
    return results


if __name__ == "__main__":
    main()
