"""Replicas behind the router against one replica, on the agentic profile.

Starts ``ftserve fleet`` (N replicas and sglang-router), then runs the same loadgen
workload (same seed, sessions, duration) twice: against replica-0 alone, directly (what a
one-GPU box serves), and, after flushing replica-0's prefix cache, through the router
(all N). Reports requests/s and cache hits of both and their ratios; the target for two
H200s is >= 1.8x the requests/s with the cache-hit ratio within 5% (docs/scaling.md).

    # on a 2-GPU machine: qwen3-30b-a3b shape cut to 8 layers, dummy weights
    python -m tools.bench.fleet --devices 0,1 --preset qwen3-30b-a3b --layers 8 \\
        --duration 120 --sessions 16 --out OUT
    # on the CPU (the embedded demo model), to check the script
    python -m tools.bench.fleet --replicas 2 --duration 10 --sessions 4 --out OUT \\
        -- --device cpu --max-model-len 2048 --cuda-graph-max-bs 0

Flags after ``--`` go to ``ftserve fleet`` (serve flags: every replica's). Everything
listens on 127.0.0.1 and stops by itself. OUT gets fleet logs, each phase's loadgen
output (requests.jsonl with the replica of every request, summary.json, plots),
bench_fleet.json and bench_fleet.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from tools.bench.common import markdown_table

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_REPLICA_LINE = re.compile(r"^\s+(replica-\d+)\s+(http://\S+)\s.*\bpid (\d+)")
_ROUTER_LINE = re.compile(r"^\s+router\s+(http://\S+)\s.*\bpid (\d+)")


@dataclass
class FleetProcess:
    """A running ``python -m ftserve fleet``: its stderr lines, and once ready the
    replicas (name -> (url, pid)) and the router (url, pid) from its banner."""

    popen: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    replicas: dict[str, tuple[str, int]] = field(default_factory=dict)
    router: tuple[str, int] | None = None

    @classmethod
    def start(cls, argv: list[str], env: dict[str, str] | None = None) -> FleetProcess:
        from ftserve.fleet import die_with_parent

        # die_with_parent: a killed test or benchmark takes the fleet (and so its
        # replicas and router) with it.
        popen = subprocess.Popen([sys.executable, "-m", "ftserve", "fleet", *argv], cwd=REPO,
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True,
                                 env={**os.environ, **(env or {})}, preexec_fn=die_with_parent)
        proc = cls(popen)
        assert popen.stderr is not None
        stream = popen.stderr
        threading.Thread(target=lambda: proc.lines.extend(iter(stream.readline, "")),
                         daemon=True).start()
        return proc

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any("ftserve fleet ready" in ln for ln in self.lines):
            if self.popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ftserve fleet did not get ready:\n{self.text}")
            time.sleep(0.1)
        time.sleep(0.1)  # the banner's other lines follow in the same write
        for ln in self.lines:
            if m := _REPLICA_LINE.match(ln):
                self.replicas[m.group(1)] = (m.group(2), int(m.group(3)))
            elif m := _ROUTER_LINE.match(ln):
                self.router = (m.group(1), int(m.group(2)))
        if not self.replicas or self.router is None:
            raise RuntimeError(f"no replicas or router in the banner:\n{self.text}")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (the fleet forwards it to everything); SIGKILL after ``timeout``."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode


def post(url: str) -> Any:
    req = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def loadgen(url: str, out: str, args: list[str]) -> dict[str, Any]:
    """One loadgen run (in this process); its summary.json."""
    from tools.loadgen import main as loadgen_main

    rc = loadgen_main(["--url", url, "--out", out, "--no-progress", *args])
    with open(os.path.join(out, "summary.json")) as f:
        doc = json.load(f)
    doc["summary"]["exit_code"] = rc
    return dict(doc["summary"])


def write_model(preset: str, layers: int, out: str) -> str:
    from ftserve.models.checkpoint import write_checkpoint

    path = os.path.join(out, "model")
    write_checkpoint(preset, path, layers=layers, config_only=True)
    return path


def render_markdown(res: dict[str, Any]) -> str:
    one, many = res["one"], res["fleet"]
    n = res["replicas"]
    rows = [["1 replica (direct)", one["completed"], one["failed"], one["request_throughput"],
             one["output_throughput"], one["cache_hit_ratio"], one["median_ttft_ms"], "-"],
            [f"{n} replicas + router", many["completed"], many["failed"],
             many["request_throughput"], many["output_throughput"], many["cache_hit_ratio"],
             many["median_ttft_ms"], many.get("session_affinity")]]
    r = res["ratios"]
    return "\n".join([
        f"### {n} replicas behind sglang-router vs one replica -- {res['where']}, {res['date_utc']}",
        f"reproduce: `python -m tools.bench.fleet {shlex.join(res['argv'])}`", "",
        markdown_table(["setup", "requests", "failed", "req/s", "output tok/s", "cache hit",
                        "median TTFT ms", "session affinity"], rows), "",
        f"requests/s {r['request_throughput']:.2f}x one replica (target >= 1.8x for 2); cache-hit "
        f"ratio {r['cache_hit_ratio']:.3f} of one replica's (target >= 0.95).", ""])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    fleet_extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, fleet_extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="python -m tools.bench.fleet", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=None)
    p.add_argument("--devices", default=None, help="CUDA devices, one replica each")
    p.add_argument("--preset", default=None,
                   help="serve a tools/make_model preset with dummy weights (else the demo model, "
                        "or --model in the fleet flags)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--port", type=int, default=8400)
    p.add_argument("--out", required=True)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loadgen-args", default="",
                   help="more loadgen flags for both phases (e.g. '--turn-tokens 2000')")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    fleet_argv = ["--port", str(a.port), "--log-dir", os.path.join(a.out, "fleet_logs")]
    if a.replicas is not None:
        fleet_argv += ["--replicas", str(a.replicas)]
    if a.devices is not None:
        fleet_argv += ["--devices", a.devices]
    if a.preset is not None:
        fleet_argv += ["--model", write_model(a.preset, a.layers, a.out), "--load-format", "dummy"]
    fleet_argv += fleet_extra
    load = ["--profile", "agentic", "--seed", str(a.seed), "--sessions", str(a.sessions),
            "--duration", str(a.duration), "--warmup", str(a.warmup),
            *a.loadgen_args.split()]
    fleet = FleetProcess.start(fleet_argv)
    try:
        fleet.wait_ready(a.startup_timeout)
        first_url = fleet.replicas["replica-0"][0]
        assert fleet.router is not None
        one = loadgen(first_url, os.path.join(a.out, "one"), load)
        for url, _ in fleet.replicas.values():  # both phases start cold
            post(url + "/flush_cache")
        many = loadgen(fleet.router[0], os.path.join(a.out, "fleet"), load)
    finally:
        code = fleet.stop()
    res: dict[str, Any] = {
        "argv": argv + (["--", *fleet_extra] if fleet_extra else []),
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "where": (f"CUDA devices {a.devices}" if a.devices else
                  "the CPU" if "cpu" in fleet_extra else "the fleet's default devices"),
        "replicas": len(fleet.replicas), "one": one, "fleet": many, "fleet_exit_code": code,
        "ratios": {k: (many[k] / one[k]) if one.get(k) else None
                   for k in ("request_throughput", "output_throughput", "cache_hit_ratio")},
    }
    with open(os.path.join(a.out, "bench_fleet.json"), "w") as f:
        json.dump(res, f, indent=2)
    md = render_markdown(res)
    with open(os.path.join(a.out, "bench_fleet.md"), "w") as f:
        f.write(md)
    print(md)
    return 0 if one["failed"] == 0 and many["failed"] == 0 and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
