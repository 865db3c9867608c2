"""Speculative decoding (--speculative ngram, or mtp) against plain decoding on the
code-edit replay (loadgen's ``edit`` profile: rewrite a ~2k-token file with one small
change).

For each mode (off, then the speculative one; with ``--ks 4,8`` one speculative
server per draft length, all against the one plain run) it starts one ``ftserve
serve`` and, for each batch size, runs the same loadgen workload (same seed, so the same files
and changes in the same order) with that many closed loops, greedy; reports output
tokens/s, the ratio to plain decoding, and from /metrics the drafts' acceptance
(kept / proposed tokens, kept per verify) and the decode steps the speculation
gate held drafting off in (it drafts only where it measures speculation faster;
``-- --disable-speculative-gate`` measures speculation at every step). Targets (BENCHMARKS.md): with the real
small model at batch 1, >= 2x plain decoding's tokens/s on the H200; with random
weights (nothing to copy: drafts are rare and rejected, and back off) at most 3%
slower.

``--budget-s S`` bounds the whole invocation: each run stops sending requests when
its share of what is left is spent (``--duration``; what is in flight finishes and
counts), a server that is not up in time ends the run, and runs with no time left
are reported as skipped. The servers get ``--max-running-requests`` and
``--cuda-graph-max-bs`` = the largest batch (fewer graphs to capture at start-up;
flags after ``--`` override them).

    # on the H200 (no network there: the real model's GGUF by path), then the
    # 8-layer qwen3-30b-a3b shape with random weights; about 150 s in all
    python -m tools.bench.spec --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out OUT/smollm2 --budget-s 90
    python -m tools.bench.spec --preset qwen3-30b-a3b --layers 8 --out OUT/qwen3 \
        --loadgen-args=--ignore-eos --budget-s 60
    # draft lengths side by side: one plain server, then one speculative server per k
    python -m tools.bench.spec --gguf SmolLM2-135M-Instruct.Q4_1.gguf --ks 4,8 --out OUT/ks --budget-s 200
    # on the CPU, to check the script (small files, batch 1 and 2)
    python -m tools.bench.spec --model smollm2-135m --batches 1,2 --requests 2 \
        --file-tokens 300 --out OUT -- --device cpu --cuda-graph-max-bs 0

Flags after ``--`` go to every server. OUT gets each server's log, each run's
loadgen output, bench_spec.json and bench_spec.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from typing import Any

from tools.bench.common import markdown_table

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC_COUNTERS = ("ftserve_spec_verifies_total", "ftserve_spec_proposed_tokens_total",
                 "ftserve_spec_accepted_tokens_total", "ftserve_spec_gated_steps_total")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A ``python -m ftserve serve`` subprocess, its output in ``log``; ready once
    /health answers 200."""

    def __init__(self, argv: list[str], log: str) -> None:
        from ftserve.fleet import die_with_parent

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "ftserve", "serve", "--port", str(self.port), *argv], cwd=REPO,
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.popen.poll() is not None:
                raise RuntimeError(f"ftserve serve exited with {self.popen.returncode}; see {self._log.name}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass  # not listening yet, or 503 while loading
            if time.monotonic() > deadline:
                raise RuntimeError(f"ftserve serve not ready after {timeout:.0f} s; see {self._log.name}")
            time.sleep(0.5)

    def metrics(self) -> dict[str, float]:
        from tools.loadgen.soak import parse_metrics

        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return parse_metrics(r.read().decode())

    def stop(self, timeout: float = 60.0) -> int:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._log.close()
        return int(self.popen.returncode)


def loadgen(url: str, out: str, args: list[str]) -> dict[str, Any]:
    """One loadgen run (in this process): its summary."""
    from tools.loadgen import main as loadgen_main

    rc = loadgen_main(["--url", url, "--out", out, "--no-progress", *args])
    with open(os.path.join(out, "summary.json")) as f:
        summary = dict(json.load(f)["summary"])
    summary["exit_code"] = rc
    return summary


class Budget:
    """--budget-s: the wall-clock time left to the invocation, and each run's share
    (None: unbounded). Server start-ups still to come are reserved at the measured
    length of the first one."""

    STOP_S = 5.0  # a server's shutdown
    MIN_RUN_S = 3.0  # less than this left for a run: it is skipped

    def __init__(self, seconds: float | None, runs: int, servers: int) -> None:
        self.deadline = None if seconds is None else time.monotonic() + seconds
        self.runs_left, self.servers_left = runs, servers
        self.startup_s: float | None = None

    def left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def startup_timeout(self, default: float) -> float:
        left = self.left()
        return default if left is None else max(1.0, min(default, left - self.STOP_S))

    def started(self, seconds: float) -> None:
        self.servers_left -= 1
        if self.startup_s is None:
            self.startup_s = seconds

    def run_share(self) -> float | None:
        """Seconds this run may send requests for (None: unbounded; <= 0: skip it).
        A closed loop's last requests finish after that, so the share keeps a third
        of the slice back for them."""
        left = self.left()
        if left is None:
            return None
        reserve = self.servers_left * ((self.startup_s or 0.0) + self.STOP_S) + self.STOP_S
        slice_s = (left - reserve) / max(1, self.runs_left)
        return slice_s * 2 / 3 if slice_s >= self.MIN_RUN_S else 0.0


def run_mode(mode: str, serve: list[str], a: argparse.Namespace, budget: Budget, label: str | None = None,
             extra: Sequence[str] = ()) -> dict[str, Any]:
    """One server in ``mode`` (with ``extra`` flags; its logs and runs named
    ``label``, default the mode); a loadgen run per batch size; each run's summary
    and the speculation counters it moved."""
    label = label or mode
    server = Server([*serve, "--speculative", mode, *extra], os.path.join(a.out, f"serve_{label}.log"))
    runs: dict[str, Any] = {}
    try:
        t0 = time.monotonic()
        try:
            server.wait_ready(budget.startup_timeout(a.startup_timeout))
        except RuntimeError as err:  # not up in time, or exited: this mode's runs are skipped
            runs["error"] = str(err)
            budget.started(time.monotonic() - t0)
            budget.runs_left -= len(a.batch_sizes)
            runs.update({str(bs): {"skipped": "the server did not start"} for bs in a.batch_sizes})
            return runs
        runs["startup_s"] = time.monotonic() - t0
        budget.started(runs["startup_s"])
        for bs in a.batch_sizes:
            share = budget.run_share()
            budget.runs_left -= 1
            if share is not None and share <= 0:
                runs[str(bs)] = {"skipped": "no time left (--budget-s)"}
                continue
            left = budget.left()
            drain = a.request_timeout if left is None else max(1.0, min(a.request_timeout, left - 2 * Budget.STOP_S))
            # Every run sends the same files: request i of each is the same edit.
            load = ["--profile", "edit", "--seed", str(a.seed), "--file-tokens", str(a.file_tokens),
                    "--concurrency", str(bs), "--max-requests", str(a.requests * bs),
                    "--temperature", "0", "--max-context", str(a.max_context),
                    "--warmup", str(a.warmup), "--drain-timeout", str(drain),
                    "--request-timeout", str(a.request_timeout), *a.loadgen_args.split()]
            if share is not None:
                load += ["--duration", f"{share:.1f}"]
            before = server.metrics()
            summary = loadgen(server.url, os.path.join(a.out, f"{label}_bs{bs}"), load)
            after = server.metrics()
            moved = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC_COUNTERS}
            verifies, proposed, kept, gated = (moved[k] for k in SPEC_COUNTERS)
            summary["spec"] = {
                "verifies": verifies, "proposed_tokens": proposed, "accepted_tokens": kept,
                "gated_steps": gated,  # decode steps the gate held drafting off in
                "acceptance_rate": kept / proposed if proposed else None,
                "kept_per_verify": kept / verifies if verifies else None,
            }
            summary["send_window_s"] = share
            runs[str(bs)] = summary
    finally:
        runs["exit_code"] = server.stop()
    return runs


def _ran(run: dict[str, Any] | None) -> bool:
    return run is not None and "skipped" not in run


def render_markdown(res: dict[str, Any]) -> str:
    mode = res["mode"]
    labels = res["spec_labels"]
    rows = []
    for label in labels:
        for bs in res["batch_sizes"]:
            off, on = res["off"].get(str(bs)), res[label].get(str(bs))
            if not (_ran(off) and _ran(on)):
                why = next((r["skipped"] for r in (off, on) if r is not None and "skipped" in r), "not run")
                rows.append([label, bs, f"skipped: {why}", "", "", "", "", "", "", "", ""])
                continue
            assert off is not None and on is not None
            sp = on["spec"]
            rows.append([label, bs, off["output_throughput"], on["output_throughput"],
                         f"{res['ratios'][label][str(bs)]:.3f}", sp["acceptance_rate"], sp["kept_per_verify"],
                         sp["verifies"], sp.get("gated_steps"), off["completed"] + on["completed"],
                         off["failed"] + on["failed"]])
    starts = ", ".join(f"{m} {res[m]['startup_s']:.0f} s" for m in ("off", *labels) if "startup_s" in res[m])
    return "\n".join([
        f"### Speculative decoding ({mode}) vs plain on the edit replay -- {res['model']}, "
        f"{res['where']}, {res['date_utc']}",
        f"reproduce: `python -m tools.bench.spec {shlex.join(res['argv'])}`", "",
        markdown_table(["speculation", "batch", "plain tok/s", "spec tok/s", "ratio", "acceptance",
                        "kept per verify", "verifies", "gated steps", "requests", "failed"], rows), "",
        "acceptance: draft tokens kept / proposed; kept per verify: the mean accept length; "
        "gated steps: decode steps in which the gate (ftserve/engine/spec/gate.py) held drafting off; "
        f"server start-up: {starts or 'n/a'}; whole run {res['wall_s']:.0f} s.", ""])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    serve_extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, serve_extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="python -m tools.bench.spec", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a checkpoint or model name (e.g. smollm2-135m)")
    p.add_argument("--gguf", default=None,
                   help="instead of --model: a .gguf file by path (the real small model where "
                        "nothing can be fetched)")
    p.add_argument("--preset", default=None,
                   help="instead of --model: a tools/make_model preset with dummy weights")
    p.add_argument("--speculative", choices=("ngram", "mtp"), default="ngram",
                   help="the mode compared with plain decoding (mtp: a --preset checkpoint gets "
                        "one MTP layer)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-clock seconds for the whole invocation (module docstring)")
    p.add_argument("--layers", type=int, default=8, help="--preset: layers kept")
    p.add_argument("--out", required=True)
    p.add_argument("--batches", default="1,16", help="batch sizes (closed loops), comma-separated")
    p.add_argument("--ks", default="",
                   help="draft lengths to compare, comma-separated: one speculative server each "
                        "(--num-speculative-tokens K) against the one plain run; default: one "
                        "server with the flags after --")
    p.add_argument("--requests", type=int, default=4, help="measured requests per closed loop")
    p.add_argument("--file-tokens", type=int, default=2000)
    p.add_argument("--max-context", type=int, default=8192)
    p.add_argument("--warmup", type=float, default=0.0, help="loadgen's unmeasured seconds first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loadgen-args", default="", help="more loadgen flags for every run")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--request-timeout", type=float, default=1800.0,
                   help="seconds a request may take (and the drain after the last is sent)")
    a = p.parse_args(argv)
    if sum(x is not None for x in (a.model, a.gguf, a.preset)) != 1:
        p.error("give one of --model, --gguf or --preset")
    if a.gguf is not None and not (os.path.isfile(a.gguf) and a.gguf.endswith(".gguf")):
        p.error(f"--gguf {a.gguf!r} is not a .gguf file")
    a.batch_sizes = [int(x) for x in a.batches.split(",")]
    ks = [int(x) for x in a.ks.split(",") if x]
    if ks and "--num-speculative-tokens" in serve_extra:
        p.error("--ks sets --num-speculative-tokens per server: not both")
    started = time.monotonic()
    os.makedirs(a.out, exist_ok=True)
    if a.preset is not None:
        from ftserve.models.checkpoint import write_checkpoint

        path = os.path.join(a.out, "model")
        mtp = {"num_nextn_predict_layers": 1} if a.speculative == "mtp" else None
        write_checkpoint(a.preset, path, layers=a.layers, config_only=True, overrides=mtp)
        serve = ["--model", path, "--load-format", "dummy"]
        name = f"{a.preset} ({a.layers} layers, random weights)"
    else:
        model = a.model if a.model is not None else os.path.abspath(a.gguf)
        serve = ["--model", model]
        name = a.model if a.model is not None else os.path.basename(a.gguf)
    top = str(max(a.batch_sizes))
    serve += ["--status-log-interval", "0", "--max-running-requests", top, "--cuda-graph-max-bs", top,
              *serve_extra]
    mode = a.speculative
    # The speculative servers: one per --ks draft length, else one with the flags given.
    spec_runs = [(f"{mode}_k{k}", ["--num-speculative-tokens", str(k)]) for k in ks] or [(mode, [])]
    labels = [label for label, _ in spec_runs]
    res: dict[str, Any] = {
        "argv": argv + (["--", *serve_extra] if serve_extra else []),
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": name, "batch_sizes": a.batch_sizes, "mode": mode, "spec_labels": labels,
        "budget_s": a.budget_s, "where": "the CPU" if "cpu" in serve_extra else "the server's default device",
    }
    servers = 1 + len(spec_runs)
    budget = Budget(a.budget_s, runs=servers * len(a.batch_sizes), servers=servers)
    res["off"] = run_mode("off", serve, a, budget)
    for label, extra in spec_runs:
        res[label] = run_mode(mode, serve, a, budget, label, extra)
    res["ratios"] = {label: {str(bs): (res[label][str(bs)]["output_throughput"]
                                       / res["off"][str(bs)]["output_throughput"])
                             if _ran(res["off"].get(str(bs))) and _ran(res[label].get(str(bs)))
                             and res["off"][str(bs)]["output_throughput"] else None
                             for bs in a.batch_sizes}
                     for label in labels}
    res["wall_s"] = time.monotonic() - started
    with open(os.path.join(a.out, "bench_spec.json"), "w") as f:
        json.dump(res, f, indent=2)
    md = render_markdown(res)
    with open(os.path.join(a.out, "bench_spec.md"), "w") as f:
        f.write(md)
    print(md)
    for m in ("off", *labels):
        if "error" in res[m]:
            print(f"{m}: {res[m]['error']}", file=sys.stderr)
    failed = any(res[m][str(bs)].get("failed", 0) for m in ("off", *labels) for bs in a.batch_sizes
                 if str(bs) in res[m])
    return 1 if failed or any(res[m]["exit_code"] for m in ("off", *labels)) else 0


if __name__ == "__main__":
    sys.exit(main())
