"""``ftserve fleet``: N ``ftserve serve`` replicas and a cache-aware router in front, as one
command (docs/scaling.md).

          clients
             │  http://HOST:PORT (the router: sglang-router, policy cache_aware)
             ▼
    ┌──── router ────┐   keeps a session on the replica holding its prefix; health
    │                │   checks, retries and a circuit breaker route around a dead one
    ▼                ▼
  replica-0 ...  replica-N-1   ftserve serve on 127.0.0.1:PORT+1+i, one GPU each
                               (CUDA_VISIBLE_DEVICES) or N CPU replicas

The fleet process starts the replicas, waits until each answers /health, starts the
router, waits until it counts every replica healthy, prints one banner, then watches:
a replica that exits is reported (its log's last lines), never restarted; the router
routes around it. SIGINT/SIGTERM go to every process at once, so the router stops
taking requests while replicas finish theirs (--drain-timeout), and the fleet exits
when all have. Each child asks the kernel for SIGTERM if the fleet process dies
(PR_SET_PDEATHSIG), so a killed fleet leaves nothing running. The router is an optional
extra (``pip install -e ".[fleet]"``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ftserve.config import ConfigError, EngineConfig, ServerConfig

ROUTER_MODULE = "sglang_router"
INSTALL_HINT = ('ftserve fleet needs the router: pip install -e ".[fleet]" (from a checkout; '
                'else pip install "ftserve[fleet]"), which installs sglang-router')

# Fleet-owned flags of `ftserve serve`: set per replica, never passed through.
_PER_REPLICA = frozenset({"host", "port", "device", "replica_id", "api_key", "api_key_file"})

# Router settings for replicas on one box, before --router-args (the router's argparse
# keeps the last value of a repeated flag, so the user's come last and win).
# - Spreading sessions: agentic sessions share their system prompt (tool definitions and
#   all), so by text every new session matches the replica that served the first one
#   best, and with the router's defaults (rebalance past 64 requests in flight) every
#   session lands on one replica while the others idle. Rebalancing once the busiest
#   replica has 2 more requests in flight than the idlest spreads new sessions; a session
#   then stays where its conversation is cached (its next turn matches there best).
# - A replica that dies must leave the rotation before the next request is lost to it:
#   the cache-aware policy keeps choosing the replica that holds a session's prefix,
#   retries included, until its circuit opens; two failed attempts open it, so the third
#   goes to a live replica. Health checks every 2 s (2 failures) then keep it out until
#   it answers again.
ROUTER_DEFAULTS: tuple[str, ...] = (
    "--policy", "cache_aware",
    "--balance-abs-threshold", "1", "--balance-rel-threshold", "1.2",
    "--health-check-interval-secs", "2", "--health-failure-threshold", "2",
    "--cb-failure-threshold", "2", "--cb-timeout-duration-secs", "10",
    "--log-level", "warn",
)


@dataclass(frozen=True)
class Replica:
    index: int
    port: int
    device: str  # "cpu", or a CUDA device as the machine numbers it
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]  # set on top of the fleet's environment

    @property
    def name(self) -> str:
        return f"replica-{self.index}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass(frozen=True)
class FleetPlan:
    host: str
    port: int  # the router's
    metrics_port: int  # the router's Prometheus exporter
    replicas: tuple[Replica, ...]
    router_argv: tuple[str, ...]
    log_dir: str
    startup_timeout_s: float
    drain_timeout_s: float
    api_key: str | None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def local_url(self) -> str:
        """The router as this machine reaches it (a wildcard --host is not an address)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"


def add_fleet_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("fleet")
    g.add_argument("--replicas", type=int, default=None,
                   help="replicas to start (default: one per --devices entry)")
    g.add_argument("--devices", default=None,
                   help="comma-separated CUDA devices, one replica each (default: 0..N-1 when "
                        "CUDA is there, else N CPU replicas; --device cpu forces CPU replicas)")
    g.add_argument("--replica-base-port", type=int, default=None,
                   help="replica i listens on 127.0.0.1:(this + i) (default: --port + 1); the "
                        "router's Prometheus metrics on the port after the last replica")
    g.add_argument("--router-args", default="",
                   help="more sglang-router flags, one string (e.g. '--cache-threshold 0.5'); "
                        "they override the fleet's router defaults")
    g.add_argument("--log-dir", default=None,
                   help="where each process writes its log (default: a new temporary directory)")
    g.add_argument("--startup-timeout", type=float, default=900.0,
                   help="seconds to wait for every replica and the router to be healthy")


def config_argv(cls: type, args: argparse.Namespace, skip: frozenset[str]) -> list[str]:
    """The `ftserve serve` flags that reproduce the non-default fields of ``cls`` in ``args``
    (the inverse of cli._config_from), fields in ``skip`` left out."""
    from ftserve.cli import _flag_dest

    argv: list[str] = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag, dest = _flag_dest(f)
        value = getattr(args, dest)
        if f.type == "bool":
            if value:
                argv.append(flag)
        elif value is not None and value != f.default:
            argv += [flag, str(value)]
    return argv


def _cuda_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def replica_devices(n: int | None, devices: str | None, device_flag: str) -> list[str]:
    """One entry per replica: "cpu" or a CUDA device index as the machine numbers it."""
    if devices is not None:
        listed = [d.strip() for d in devices.split(",") if d.strip()]
        if not listed or not all(d.isdigit() for d in listed):
            raise ConfigError(f"--devices must list CUDA device indices, e.g. 0,1; got {devices!r}")
        if len(set(listed)) != len(listed):
            raise ConfigError(f"--devices lists a device twice: {devices!r} (one replica per GPU)")
        if n is not None and n != len(listed):
            raise ConfigError(f"--replicas {n} but --devices lists {len(listed)}: give one device "
                              "per replica, or leave --replicas out")
        if device_flag == "cpu":
            raise ConfigError("--devices picks GPUs: drop --device cpu, or --devices for CPU replicas")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible:  # the indices count the devices this environment already sees
            seen = [v.strip() for v in visible.split(",")]
            bad = [d for d in listed if int(d) >= len(seen)]
            if bad:
                raise ConfigError(f"--devices {devices}: CUDA_VISIBLE_DEVICES={visible} shows "
                                  f"{len(seen)} devices")
            listed = [seen[int(d)] for d in listed]
        return listed
    if n is None:
        raise ConfigError("give --replicas N (or --devices 0,1,... for one replica per GPU)")
    if n < 1:
        raise ConfigError("--replicas must be at least 1")
    if device_flag == "cpu":
        return ["cpu"] * n
    if device_flag.startswith("cuda:"):
        raise ConfigError(f"--device {device_flag} names one GPU: give --devices for a fleet's GPUs")
    count = _cuda_count()
    if count == 0:
        if device_flag == "cuda":
            raise ConfigError("--device cuda but no CUDA device is visible")
        return ["cpu"] * n
    if count < n:
        raise ConfigError(f"--replicas {n} needs {n} GPUs and {count} are visible: one replica "
                          "per GPU (give --devices, fewer replicas, or --device cpu)")
    return replica_devices(n, ",".join(str(i) for i in range(n)), device_flag)


def plan(args: argparse.Namespace) -> FleetPlan:
    """Validate the flags as `ftserve serve` would, then lay out the processes."""
    from ftserve.cli import configs_from_args

    engine_cfg, server_cfg = configs_from_args(args)
    if server_cfg.replica_id is not None:
        raise ConfigError("--replica-id: the fleet names its replicas (replica-0, replica-1, ...)")
    if server_cfg.port == 0:
        raise ConfigError("--port 0: a fleet's router needs a fixed port")
    devices = replica_devices(args.replicas, args.devices, engine_cfg.device)
    base = args.replica_base_port if args.replica_base_port is not None else server_cfg.port + 1
    ports = [base + i for i in range(len(devices))]
    metrics_port = ports[-1] + 1
    for p in (*ports, metrics_port):
        if not 0 < p < 65536:
            raise ConfigError(f"port {p} is out of range: lower --port or --replica-base-port")
    if server_cfg.port in ports or server_cfg.port == metrics_port:
        raise ConfigError(f"--replica-base-port {base} puts a replica on the router's --port")
    try:
        extra = shlex.split(args.router_args)
    except ValueError as err:
        raise ConfigError(f"--router-args: {err}") from None
    common = (config_argv(EngineConfig, args, _PER_REPLICA)
              + config_argv(ServerConfig, args, _PER_REPLICA))
    replicas = []
    for i, (dev, port) in enumerate(zip(devices, ports)):
        env: list[tuple[str, str]] = []
        if dev == "cpu":
            where = ["--device", "cpu"]
        else:
            where = ["--device", "cuda"]
            env.append(("CUDA_VISIBLE_DEVICES", dev))
        if server_cfg.api_key is not None:  # not in argv: ps shows argv
            env.append(("FTSERVE_API_KEY", server_cfg.api_key))
        argv = (sys.executable, "-m", "ftserve", "serve", "--host", "127.0.0.1", "--port",
                str(port), *where, "--replica-id", f"replica-{i}", *common)
        replicas.append(Replica(i, port, dev, argv, tuple(env)))
    urls = [r.url for r in replicas]
    router_argv = (sys.executable, "-m", f"{ROUTER_MODULE}.launch_router",
                   "--host", server_cfg.host, "--port", str(server_cfg.port),
                   "--worker-urls", *urls, *ROUTER_DEFAULTS,
                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
                   "--shutdown-grace-period-secs", str(max(1, round(server_cfg.drain_timeout))),
                   # The router asks clients for the key and sends it to the replicas; it
                   # takes it on its command line only.
                   *(("--api-key", server_cfg.api_key) if server_cfg.api_key else ()),
                   *extra)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="ftserve-fleet-")
    return FleetPlan(server_cfg.host, server_cfg.port, metrics_port, tuple(replicas),
                     router_argv, log_dir, args.startup_timeout, server_cfg.drain_timeout,
                     server_cfg.api_key)


def die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the fleet process dies (Linux), so a fleet
    killed with SIGKILL leaves no replica or router behind. Its own session: a Ctrl-C at
    the terminal reaches the fleet, which forwards it, not every child at once."""
    os.setsid()
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _get_json(url: str, timeout: float = 2.0, api_key: str | None = None) -> Any:
    req = urllib.request.Request(url)
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2.0) as r:
            return r.status == 200
    except (OSError, ValueError):
        return False


def _tail(path: str, lines: int = 8) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join("    " + ln for ln in text.splitlines()[-lines:])


class Fleet:
    """The running processes of one plan."""

    def __init__(self, plan: FleetPlan) -> None:
        self.plan = plan
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, str] = {}
        self.reported: set[str] = set()
        self.stop_signal: int | None = None

    def say(self, text: str) -> None:
        print(f"ftserve fleet: {text}", file=sys.stderr, flush=True)

    def _spawn(self, name: str, argv: Sequence[str], env: Sequence[tuple[str, str]] = ()) -> None:
        path = os.path.join(self.plan.log_dir, f"{name}.log")
        with open(path, "ab") as log:
            self.procs[name] = subprocess.Popen(
                list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, **dict(env)}, preexec_fn=die_with_parent)
        self.logs[name] = path

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.stop_signal = signum

    def _died(self, names: Sequence[str]) -> list[str]:
        return [n for n in names if n not in self.reported and self.procs[n].poll() is not None]

    def _report(self, name: str) -> None:
        proc = self.procs[name]
        self.reported.add(name)
        code = proc.returncode
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        self.say(f"{name} (pid {proc.pid}) {how}; not restarted. Last lines of {self.logs[name]}:"
                 f"\n{_tail(self.logs[name])}")

    def _wait(self, what: str, ready: Any, watch: Sequence[str], deadline: float) -> bool:
        """Poll ``ready()`` until true; False if a watched process exits, a signal comes
        or the deadline passes (each said)."""
        while not ready():
            if self.stop_signal is not None:
                return False
            dead = self._died(watch)
            if dead:
                for name in dead:
                    self._report(name)
                self.say(f"stopping: {', '.join(dead)} exited while waiting for {what}")
                return False
            if time.monotonic() > deadline:
                self.say(f"stopping: {what} not ready after {self.plan.startup_timeout_s:.0f}s "
                         f"(--startup-timeout); logs in {self.plan.log_dir}")
                return False
            time.sleep(0.2)
        return True

    def _router_sees_all(self) -> bool:
        try:
            workers = _get_json(self.plan.local_url + "/workers", api_key=self.plan.api_key)
        except (OSError, ValueError):
            return False
        healthy = {w.get("url") for w in workers.get("workers", []) if w.get("is_healthy")}
        return all(r.url in healthy for r in self.plan.replicas)

    def start(self) -> bool:
        p = self.plan
        os.makedirs(p.log_dir, exist_ok=True)
        for r in p.replicas:
            self._spawn(r.name, r.argv, r.env)
        deadline = time.monotonic() + p.startup_timeout_s
        names = [r.name for r in p.replicas]
        if not self._wait("the replicas", lambda: all(_healthy(r.url) for r in p.replicas),
                          names, deadline):
            return False
        self._spawn("router", p.router_argv)
        return self._wait("the router", self._router_sees_all, [*names, "router"], deadline)

    def banner(self) -> str:
        p = self.plan
        try:
            info = _get_json(p.replicas[0].url + "/get_server_info", api_key=p.api_key)
            model = f"'{info['served_model_name']}'"
        except (OSError, ValueError, KeyError, TypeError):
            model = "the model"
        lines = [f"ftserve fleet ready: {len(p.replicas)} replicas of {model} behind "
                 f"sglang-router (cache-aware) at {p.url}"]
        for r in p.replicas:
            where = "cpu" if r.device == "cpu" else f"cuda device {r.device}"
            lines.append(f"  {r.name:<10} {r.url:<24} {where:<14} pid {self.procs[r.name].pid}")
        lines.append(f"  {'router':<10} {p.url:<24} {'':<14} pid {self.procs['router'].pid}  "
                     f"metrics http://127.0.0.1:{p.metrics_port}/metrics")
        lines.append(f"  logs: {p.log_dir}; Ctrl-C or SIGTERM drains and stops them all; a "
                     "replica that exits is reported, not restarted")
        return "\n".join(lines)

    def watch(self) -> int:
        """Until a signal: report replicas that exit; stop if the router or the last
        replica does. Returns the exit code."""
        names = [r.name for r in self.plan.replicas]
        while self.stop_signal is None:
            for name in self._died(names):
                self._report(name)
                left = sum(1 for n in names if n not in self.reported)
                if left:
                    self.say(f"the router routes around {name}: {left} of {len(names)} "
                             "replicas serve")
            if all(n in self.reported for n in names):
                self.say("stopping: no replica is left")
                return 1
            if self._died(["router"]):
                self._report("router")
                self.say("stopping: the router exited")
                return 1
            time.sleep(0.2)
        return 0

    def stop(self) -> None:
        """SIGTERM to every process still running, together; SIGKILL what outlives the drain."""
        live = {n: p for n, p in self.procs.items() if p.poll() is None}
        if not live:
            return
        self.say(f"stopping {len(live)} processes (drain up to {self.plan.drain_timeout_s:.0f}s)")
        for proc in live.values():
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.plan.drain_timeout_s + 15.0
        for name, proc in live.items():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.say(f"{name} (pid {proc.pid}) did not stop: killed")
                proc.kill()
                proc.wait()


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec(ROUTER_MODULE) is None:
        print(f"ftserve: error: {INSTALL_HINT}", file=sys.stderr)
        return 2
    try:
        fleet_plan = plan(args)
    except ConfigError as err:
        print(f"ftserve: error: {err}", file=sys.stderr)
        return 2
    fleet = Fleet(fleet_plan)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, fleet._on_signal)
    code = 1
    try:
        fleet.say(f"starting {len(fleet_plan.replicas)} replicas (logs in {fleet_plan.log_dir})")
        if fleet.start():
            print(fleet.banner(), file=sys.stderr, flush=True)
            code = fleet.watch()
        elif fleet.stop_signal is not None:
            code = 0
    finally:
        fleet.stop()
    if fleet.stop_signal is not None:
        fleet.say("stopped")
    return code
