"""Host time of a speculative verify step on the engine thread, on the CPU.

A verify step cannot overlap the host with the device the way plain decode
does: the next drafts continue the tokens this step keeps, so the engine reads
it back at once (engine._step), and every microsecond of planning, packing,
launching, reading back and committing is a microsecond the GPU idles. This
measures that host work per step, at the batch sizes asked, with k-token
n-gram drafts that are always accepted.

    python -m tools.bench.host_verify                       # batch 1, 16; k = 4
    python -m tools.bench.host_verify --batches 16 --profile 16

A tiny-moe engine (``--vocab`` tokens, so the eager CPU sampler costs about
what its launches cost on a GPU) with ``--speculative ngram`` runs
EngineCore._step itself, the loop body of the engine thread. The model is
stood in by ``NextTokenModel``: every logits row is one-hot at next(t) of the
row's input token t, next cycling each group of 8 ids, so the text repeats
with period 8, the n-gram index proposes the cycle and the model accepts every
draft (k + 1 tokens per request per step). The verify graphs are
``HostOnlyVerifyGraphs``: PrefillGraphs whose replay packs the step into the
staging buffer for real (``fill``) and whose "graph" writes the one-hot logits
from the static inputs (``graph``, not host time on a GPU: reported, not
counted). Per step, in us (the best of ``--repeats`` means of ``--steps``):

    schedule   Scheduler.schedule (the drafts: n-gram index update and lookup)
    fill       PrefillGraphs._fill (token layout into the pinned staging copy)
    launch     the rest of ModelRunner.launch (page mirror, sampler inputs,
               the read-back copy), less the sampler:
    sample     Sampler.sample: on the CPU the reference stages' compute, on a
               GPU one greedy Triton launch (reported, not counted)
    read       ModelRunner.collect_verified (read back, tokens per request)
    commit     Scheduler.commit_verified (acceptance, stop checks, page trim)
    engine     the rest of EngineCore._step (outputs, stats, the drafts'
               n-grams indexed ahead)
    total      the sum of the six

and how much of the total runs while the step's device work is queued,
between the verify graph's replay call and the read-back (the sampler's
launches, the copy-out, the last step's outputs and stats, the n-grams
indexed ahead):

    overlap    host time in that window (less the CPU sampler's compute)
    critical   total - overlap: the host time on the device's critical path,
               from the read-back of one verify step to the next replay

On a GPU each torch call of ``launch`` is also a kernel launch (and the
pinned copies, events and Triton launches add their own); this counts the
Python around them. ``overlap`` is hidden only while the device is busier
than the host in that window (a forward of more than a few hundred us).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from typing import Any

import torch

from ftserve.config import EngineConfig
from ftserve.engine.engine import Engine
from ftserve.engine.prefill_graph import PrefillGraphs, verify_buckets
from ftserve.engine.request import Req, ReqState
from ftserve.engine.sampling_params import SamplingParams
from ftserve.engine.setup import build_engine
from ftserve.models.forward_batch import ForwardBatch
from tools.bench.common import say, write_json

PARTS = ("schedule", "fill", "launch", "read", "commit", "engine")
PERIOD = 8  # next(t) cycles each aligned group of PERIOD ids


def next_token(ids: torch.Tensor) -> torch.Tensor:
    return (ids // PERIOD) * PERIOD + (ids + 1) % PERIOD


class NextTokenModel(torch.nn.Module):
    """Logits one-hot at next(t) of each logits row's input token t."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        ids = fb.input_ids if fb.logits_indices is None else fb.input_ids.index_select(0, fb.logits_indices)
        return one_hot(ids, self.vocab)


def one_hot(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    out = torch.zeros(ids.shape[0], vocab)
    out.scatter_(1, next_token(ids.clamp(min=0))[:, None], 1.0)
    return out


class HostOnlyVerifyGraphs(PrefillGraphs):
    """Verify graphs with nothing captured: replay packs the step for real and
    "runs" the graph by computing NextTokenModel's logits from the static inputs
    (its time kept apart in graph_s)."""

    def __init__(self, runner: Any, max_seqs: int, k: int) -> None:
        buckets = verify_buckets(max_seqs, k)
        super().__init__(runner, buckets[-1], max_seqs, buckets=buckets, all_rows=True)
        self.graph_s = self.fill_s = 0.0
        self.replays = 0
        self.replayed_at = 0.0  # perf_counter when the last replay returned
        self.on_replay: Any = None

    def _fill(self, batch: Any, bucket: int) -> None:
        t0 = time.perf_counter()
        super()._fill(batch, bucket)
        self.fill_s += time.perf_counter() - t0

    def _run(self, bucket: int) -> torch.Tensor:
        t0 = time.perf_counter()
        self.replays += 1
        p = self.inputs
        logits = one_hot(p.ids.index_select(0, p.logits_rows[:bucket]), self.runner.sampler.vocab_size)
        self.replayed_at = time.perf_counter()
        if self.on_replay is not None:
            self.on_replay()
        self.graph_s += self.replayed_at - t0
        return logits


def build(max_bs: int, context: int, tokens: int, k: int, vocab: int, model_dir: str) -> Engine:
    ps = 16
    max_len = context + tokens + 2 * ps + k
    cfg = EngineConfig(model=model_dir, load_format="dummy", device="cpu", dtype="float32", page_size=ps,
                       num_pages=max_bs * -(-max_len // ps) + 64, max_prefill_length=4096,
                       max_running_requests=max_bs, status_log_interval=0.0, max_model_len=max_len,
                       speculative="ngram", num_speculative_tokens=k,
                       speculative_gate=False)  # every step verifies, whatever it costs here
    eng = build_engine(cfg)
    eng.runner.model = NextTokenModel(vocab)
    return eng


class _Timed:
    """Wraps obj.name to add its wall time to acc[part] (``at_start``: called
    first instead, not timed)."""

    def __init__(self, acc: dict[str, float], part: str, obj: Any, name: str,
                 at_start: Any = None) -> None:
        fn = getattr(obj, name)

        def timed(*a: Any, **kw: Any) -> Any:
            if at_start is not None:
                at_start()
                return fn(*a, **kw)
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                acc[part] += time.perf_counter() - t0

        setattr(obj, name, timed)


def overlap_window(acc: dict[str, float], graphs: HostOnlyVerifyGraphs) -> None:
    """At a read-back: add the host time since the step's replay returned, less
    the CPU sampler's compute in it, to acc["overlap"]."""
    acc["overlap"] += time.perf_counter() - graphs.replayed_at - (acc["sample"] - acc["sample_at_replay"])


def bench_batch(eng: Engine, bs: int, k: int, context: int, steps: int, repeats: int, warmup: int,
                profile: bool) -> dict[str, Any]:
    sched, runner = eng.scheduler, eng.runner
    total = warmup + steps * repeats
    # Each prompt: random-ish ids in its own PERIOD-aligned group, so its text
    # (prompt and output) is that group's cycle.
    reqs = []
    for i in range(bs):
        g = 128 + PERIOD * i
        prompt = [g + j % PERIOD for j in range(context)]
        r = Req(f"hv{bs}-{i}", prompt, SamplingParams(temperature=0.0, ignore_eos=True,
                                                      max_tokens=(total + 16) * (k + 1)), time.monotonic())
        sched.add(r)
        reqs.append(r)
    graphs = HostOnlyVerifyGraphs(runner, min(sched.max_running, 16), k)
    runner.verify_graphs = graphs

    def replayed() -> None:
        acc["sample_at_replay"] = acc["sample"]

    while any(r.state is not ReqState.DECODE or r.num_outputs < 2 for r in reqs):
        eng._step()
    acc = dict.fromkeys(PARTS + ("step", "sample", "overlap", "sample_at_replay"), 0.0)
    _Timed(acc, "schedule", sched, "schedule")
    _Timed(acc, "launch", runner, "launch")
    _Timed(acc, "sample", runner.sampler, "sample")
    _Timed(acc, "read", runner, "collect_verified")
    _Timed(acc, "overlap", runner, "collect_verified", at_start=lambda: overlap_window(acc, graphs))
    _Timed(acc, "commit", sched, "commit_verified")
    graphs.on_replay = replayed
    spec = sched.spec
    assert spec is not None

    def step() -> None:
        v0, n0 = spec.counters.verifies_total, spec.counters.accepted_tokens_total
        t0 = time.perf_counter()
        eng._step()
        acc["step"] += time.perf_counter() - t0
        assert spec.counters.verifies_total - v0 == bs, "every timed step verifies every request"
        assert spec.counters.accepted_tokens_total - n0 == bs * k, "every draft is accepted"

    for _ in range(warmup):
        step()
    best = dict.fromkeys(PARTS + ("graph", "sample", "overlap", "critical"), float("inf"))
    prof = cProfile.Profile() if profile else None
    for _ in range(repeats):
        for key in acc:
            acc[key] = 0.0
        graphs.fill_s = graphs.graph_s = 0.0
        replays = graphs.replays
        if prof is not None:
            prof.enable()
        for _ in range(steps):
            step()
        if prof is not None:
            prof.disable()
        assert graphs.replays - replays == steps, "every timed step replays a verify graph"
        t = {"schedule": acc["schedule"], "fill": graphs.fill_s,
             "launch": acc["launch"] - graphs.fill_s - graphs.graph_s - acc["sample"],
             "read": acc["read"], "commit": acc["commit"], "graph": graphs.graph_s, "sample": acc["sample"]}
        t["engine"] = acc["step"] - sum(acc[p] for p in ("schedule", "launch", "read", "commit"))
        t["overlap"] = acc["overlap"]
        t["critical"] = sum(t[p] for p in PARTS) - acc["overlap"]
        for key, v in t.items():
            best[key] = min(best[key], v / steps * 1e6)
    if prof is not None:
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(30)
    for r in reqs:
        c = r.output_ids
        assert all(int(next_token(torch.tensor(a))) == b for a, b in zip(c, c[1:])), "outputs follow the model"
        sched.finish(r, "abort")
    sched.finished_reqs.clear()
    for obj, name in ((sched, "schedule"), (runner, "launch"), (runner, "collect_verified"),
                      (sched, "commit_verified"), (runner.sampler, "sample")):
        delattr(obj, name)  # back to the class's method
    runner.verify_graphs = None
    assert not sched.running
    return {"batch": bs, **{f"{key}_us": round(v, 2) for key, v in best.items()},
            "total_us": round(sum(best[p] for p in PARTS), 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16", help="comma-separated batch sizes (at most 16: the verify graphs')")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per verify (--num-speculative-tokens)")
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens per request")
    ap.add_argument("--vocab", type=int, default=1024, help="the stand-in model's vocabulary")
    ap.add_argument("--steps", type=int, default=200, help="timed steps per repeat")
    ap.add_argument("--repeats", type=int, default=3, help="best mean of this many runs of --steps")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--profile", type=int, default=0, metavar="B", help="print a cProfile of batch B's steps")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if max(batches) > 16:
        ap.error("the verify graphs hold at most 16 sequences")
    from ftserve.models.checkpoint import write_checkpoint

    torch.set_num_threads(1)
    tokens = (args.warmup + args.steps * args.repeats + 16) * (args.k + 1)
    with tempfile.TemporaryDirectory() as d:
        write_checkpoint("tiny-moe", d, config_only=True,
                         overrides={"vocab_size": args.vocab, "max_position_embeddings": args.context + tokens + 64})
        eng = build(max(batches), args.context, tokens, args.k, args.vocab, d)
        try:
            rows = []
            for bs in batches:
                say(f"batch {bs}")
                rows.append(bench_batch(eng, bs, args.k, args.context, args.steps, args.repeats, args.warmup,
                                        args.profile == bs))
        finally:
            eng.shutdown()
    print(f"host us per verify step (CPU; k = {args.k}, every draft kept; best of {args.repeats} x "
          f"{args.steps} steps, context {args.context}; not counted: graph, the stand-in forward, "
          "and sample, the CPU sampler's compute)")
    extra = ("total", "overlap", "critical", "graph", "sample")
    print(f"{'batch':>5} " + " ".join(f"{p:>9}" for p in PARTS + extra))
    for r in rows:
        print(f"{r['batch']:>5} " + " ".join(f"{r[p + '_us']:9.1f}" for p in PARTS + extra))
    if args.json:
        write_json(args.json, {"k": args.k, "context": args.context, "steps": args.steps,
                               "repeats": args.repeats, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
