"""Where the host time of one cold 4,096-token prefill chunk goes (the GPU
idles until the first kernel is queued and after the last one while the token
is read back). Times each host phase of ModelRunner.launch/collect with
perf_counter (no sync inside), on the bench_engine model.

    python -m tools.probe_prefill_host [--out probe.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from tools import bench_engine
from tools.bench_common import start_run
from tools.engine_driver import EngineDriver, build


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="")
    p.add_argument("--reps", type=int, default=8)
    a = p.parse_args()
    args = bench_engine.parse_args(["--sections", "cached"])
    run = start_run(args, "ftserve-probe-")
    eng = build(args, run.model_dir, run.device)
    drv = EngineDriver(eng)
    r = drv.runner
    phases: dict[str, list[float]] = {}

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*xs: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*xs, **kw)
            phases.setdefault(name, []).append(time.perf_counter() - t0)
            return out
        return wrapper

    pg = r.prefill_graphs
    assert pg is not None
    r.mirror_pages = timed("mirror_pages", r.mirror_pages)
    r.admit_slots = timed("admit_slots (after the forward is queued)", r.admit_slots)
    pg._fill = timed("prefill_graph._fill", pg._fill)
    for b, g in pg.graphs.items():
        g.replay = timed(f"graph.replay[{b}]", g.replay)
    r.sampler.sample = timed("sampler.sample", r.sampler.sample)
    r.sampler.update = timed("sampler.update", r.sampler.update)
    r._copy_out = timed("_copy_out", r._copy_out)
    r.launch = timed("launch (all)", r.launch)
    r.collect = timed("collect (incl. the wait)", r.collect)
    walls = []
    for i in range(a.reps + 1):
        drv.flush()
        drv.add(drv.tokens(args.chunk), max_tokens=1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        batch = drv.sched.schedule()
        t1 = time.perf_counter()
        toks, _ = r.step(batch)
        t2 = time.perf_counter()
        drv.sched.commit(batch, toks, None)
        drv.sched.finished_reqs.clear()
        if i:
            walls.append((t1 - t0, t2 - t1))
        else:
            phases.clear()
    out = {"schedule_ms": 1e3 * statistics.median(w[0] for w in walls),
           "step_wall_ms": 1e3 * statistics.median(w[1] for w in walls),
           "phases_ms": {k: 1e3 * statistics.median(v) for k, v in phases.items()}}
    print(json.dumps(out, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
