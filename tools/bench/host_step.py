"""Host time of a decode step on the engine thread, on the CPU: what bounds
throughput once the device step is short (large batches, speculative or
eager steps), and what overlap scheduling has to hide.

    python -m tools.bench.host_step                       # batch 1, 8, 64
    python -m tools.bench.host_step --batches 64 --profile 64

A tiny-moe engine on the CPU decodes ``batch`` requests of ``--context``
tokens, overlapped as the engine thread runs steps (plan and launch step N+1,
then read back and commit step N). Its decode graphs are stood in by
``HostOnlyGraphs``: ``DecodeGraphs.replay`` runs its whole host side (the
step's rows packed into the staging row, the sampler variant and length
bound picked, the graph looked up) and the graph launches nothing. Per step:

    schedule   Scheduler.schedule
    pack       DecodeGraphs.step_rows (pack_decode_rows into the staging row)
    launch     the rest of ModelRunner.launch (page-table mirror, sampler
               slots, graph pick, read-back setup)
    commit     Scheduler.commit (token bookkeeping, stop checks)

Each is the best of ``--repeats`` means over ``--steps`` steps, in us. The
same parts are what tools/bench/engine.py's decode section sums into
"host ms/step" on a GPU, where the graph launch itself, pinned buffers and
events add their own (not measured here).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import sys
import tempfile
import time
from typing import Any

import torch

from ftserve.config import EngineConfig
from ftserve.engine.cuda_graph import DecodeGraphIO, DecodeGraphs, graph_batch_sizes
from ftserve.engine.driver import EngineDriver
from ftserve.engine.request import ReqState
from ftserve.engine.runner import Launched, ModelRunner
from ftserve.engine.sampler import SampleOutput
from ftserve.engine.sampling_params import SamplingParams
from ftserve.engine.scheduler import ScheduledBatch
from ftserve.engine.setup import build_engine
from ftserve_kernels.decode_inputs import WORDS
from tools.bench.common import say, write_json

PARTS = ("schedule", "pack", "launch", "commit")
TOKEN = 500  # what the stand-in graphs "sample" (greedy, ignore_eos: never a stop)


class _NoGraphs(dict):  # type: ignore[type-arg]
    """Every (padded batch size, sampler stages, bound) key: a graph that
    launches nothing but counts its replays."""

    def __init__(self) -> None:
        super().__init__()
        self.replays = 0

    def __missing__(self, key: Any) -> Any:
        self[key] = graph = _NoGraph(self)
        return graph


class _NoGraph:
    def __init__(self, owner: _NoGraphs) -> None:
        self.owner = owner

    def replay(self) -> None:
        self.owner.replays += 1


class _Outputs(dict):  # type: ignore[type-arg]
    def __missing__(self, key: Any) -> SampleOutput:
        self[key] = out = SampleOutput(torch.full((key[0],), TOKEN, dtype=torch.int64))
        return out


class HostOnlyGraphs(DecodeGraphs):
    """DecodeGraphs with nothing captured: every key finds a graph that
    launches nothing, the buffers are plain CPU tensors, and the graph "reads"
    the staging row itself (in-graph I/O, as on a GPU). Times step_rows, the
    packing, on its own."""

    def __init__(self, runner: ModelRunner, max_bs: int) -> None:  # no super(): no CUDA
        self.runner, self.device, self.max_bs = runner, runner.device, max_bs
        self.sizes = graph_batch_sizes(max_bs)
        self.io = DecodeGraphIO(
            rows=torch.zeros(max_bs, WORDS, dtype=torch.int64),
            host_rows=torch.zeros(2, max_bs * WORDS, dtype=torch.int64),
            host_tokens=torch.full((2, max_bs), TOKEN, dtype=torch.int64),
            parity=torch.zeros(1, dtype=torch.int32),
            qo_indptr=torch.arange(max_bs + 1, dtype=torch.int32),
            logits_indices=torch.arange(max_bs, dtype=torch.int64),
        )
        self.in_graph_io = True
        self.with_mtp = False  # the bench runs without speculation
        self._flip = 0
        self.full_bound = runner.max_pages * runner.page_size
        self.bounds = {bs: [self.full_bound] for bs in self.sizes}
        self.graphs = _NoGraphs()  # type: ignore[assignment]
        self.outputs = _Outputs()
        self.pack_s = 0.0

    @property
    def replays(self) -> int:
        return self.graphs.replays  # type: ignore[attr-defined,no-any-return]

    def step_rows(self, batch: ScheduledBatch, out: torch.Tensor | None = None) -> tuple[int, torch.Tensor]:
        t0 = time.perf_counter()
        res = super().step_rows(batch, out)
        self.pack_s += time.perf_counter() - t0
        return res


def build(max_bs: int, context: int, decode_steps: int, model_dir: str) -> Any:
    ps = 16
    cfg = EngineConfig(model=model_dir, load_format="dummy", device="cpu", dtype="float32", page_size=ps,
                       num_pages=max_bs * -(-(context + decode_steps + 2 * ps) // ps) + 64,
                       max_prefill_length=4096, max_running_requests=max_bs, status_log_interval=0.0,
                       max_model_len=context + decode_steps + 2 * ps)
    return build_engine(cfg)


def bench_batch(drv: EngineDriver, base: list[int], bs: int, max_bs: int, steps: int, repeats: int,
                warmup: int, profile: bool) -> dict[str, Any]:
    """Decode ``bs`` requests over ``base`` (+ 16 tokens each) and time their
    steps through HostOnlyGraphs of the engine's ``max_bs``."""
    sched, runner = drv.sched, drv.runner
    ctx = len(base)
    total_steps = warmup + steps * repeats
    reqs = [drv.add(base[:ctx - 16] + drv.tokens(16), max_tokens=total_steps + 8,
                    params=SamplingParams(temperature=0.0)) for _ in range(bs)]
    runner.graphs = None  # prefill (and the first decode steps) eagerly, for real
    while any(r.state is not ReqState.DECODE for r in reqs):
        drv.step()
    drv.flush()
    graphs = HostOnlyGraphs(runner, max_bs)
    runner.graphs = graphs
    t = dict.fromkeys(PARTS, 0.0)
    inflight: Launched | None = None

    def step() -> None:
        nonlocal inflight
        t0 = time.perf_counter()
        batch = sched.schedule()
        t1 = time.perf_counter()
        assert batch is not None and batch.is_decode and len(batch.reqs) == bs
        launched = runner.launch(batch)
        t["schedule"] += t1 - t0
        t["launch"] += time.perf_counter() - t1
        prev, inflight = inflight, launched
        if prev is not None:
            token_ids, logprobs = runner.collect(prev)
            t2 = time.perf_counter()
            sched.commit(prev.batch, token_ids, logprobs)
            sched.finished_reqs.clear()
            t["commit"] += time.perf_counter() - t2

    for _ in range(warmup):
        step()
    best = dict.fromkeys(PARTS, float("inf"))
    prof = cProfile.Profile() if profile else None
    for _ in range(repeats):
        for k in t:
            t[k] = 0.0
        graphs.pack_s, replays = 0.0, graphs.replays
        if prof is not None:
            prof.enable()
        for _ in range(steps):
            step()
        if prof is not None:
            prof.disable()
        assert graphs.replays - replays == steps, "every timed step must take the decode graph path"
        t["launch"] -= graphs.pack_s
        t["pack"] = graphs.pack_s
        for k in PARTS:
            best[k] = min(best[k], t[k] / steps * 1e6)
    if prof is not None:
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(25)
    if inflight is not None:
        sched.commit(inflight.batch, *runner.collect(inflight))
    # The tokens came back through the graph path's staging row.
    assert all(r.output_ids[-steps:] == [TOKEN] * steps for r in reqs)
    for r in reqs:
        sched.finish(r, "abort")
    sched.finished_reqs.clear()
    runner.graphs = None
    assert not sched.running
    return {"batch": bs, **{f"{k}_us": round(v, 2) for k, v in best.items()},
            "total_us": round(sum(best.values()), 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,64", help="comma-separated decode batch sizes")
    ap.add_argument("--context", type=int, default=1024, help="tokens per request before decoding")
    ap.add_argument("--steps", type=int, default=200, help="timed steps per repeat")
    ap.add_argument("--repeats", type=int, default=3, help="best mean of this many runs of --steps")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--profile", type=int, default=0, metavar="B", help="print a cProfile of batch B's steps")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    from ftserve.models.checkpoint import write_checkpoint

    torch.set_num_threads(1)  # the eager prefill only; the timed steps run no model
    with tempfile.TemporaryDirectory() as d:
        write_checkpoint("tiny-moe", d, config_only=True)
        decode_steps = args.warmup + args.steps * args.repeats + 8
        eng = build(max(batches), args.context, decode_steps, d)
        try:
            drv = EngineDriver(eng)
            base = drv.tokens(args.context, random.Random(0))
            rows = []
            for bs in batches:
                say(f"batch {bs}")
                rows.append(bench_batch(drv, base, bs, max(batches), args.steps, args.repeats, args.warmup,
                                        args.profile == bs))
        finally:
            eng.shutdown()
    print(f"host us per decode step (CPU; best of {args.repeats} x {args.steps} steps, context {args.context})")
    print(f"{'batch':>5} " + " ".join(f"{p:>9}" for p in PARTS) + f" {'total':>9}")
    for r in rows:
        print(f"{r['batch']:>5} " + " ".join(f"{r[p + '_us']:9.1f}" for p in PARTS) + f" {r['total_us']:9.1f}")
    if args.json:
        write_json(args.json, {"context": args.context, "steps": args.steps, "repeats": args.repeats,
                               "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
