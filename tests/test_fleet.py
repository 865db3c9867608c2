"""``ftserve fleet``: two CPU replicas of the demo model behind the real sglang-router
(its Rust binary, from the package index), driven by loadgen's agentic profile.

The module starts one fleet (about 20 s on two cores) and runs, in order: what the
router learned from the workers, the agentic profile through the router against one
replica alone, a replica killed mid-run, and SIGTERM stopping every process. Everything
listens on 127.0.0.1; the fleet is stopped (and checked gone) whatever happens.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ftserve import fleet as fleet_mod
from ftserve.cli import build_parser, configs_from_args, main
from tools.bench.fleet import FleetProcess, loadgen, post

# Small on purpose: two engines, the router and loadgen share the CI machine's two cores.
SERVE = ["--model", "demo", "--max-model-len", "1024", "--num-pages", "200", "--max-running-requests", "4",
         "--cuda-graph-max-bs", "0", "--status-log-interval", "0", "--drain-timeout", "5"]
LOAD = ["--profile", "agentic", "--seed", "3", "--sessions", "3", "--system-tokens", "200",
        "--turn-tokens", "120", "--output-tokens", "8", "--max-output-tokens", "16",
        "--max-context", "900", "--ignore-eos", "--drain-timeout", "20"]


def _free_block(n: int) -> int:
    """A port P with P .. P+n-1 free on 127.0.0.1 (the router and its replicas)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + n >= 65536:
            continue
        try:
            socks = []
            for p in range(base, base + n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no block of free ports")


def _get(url: str) -> tuple[int, Any]:
    """(status, JSON body or None); status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, None
    except OSError:
        return 0, None
    try:
        return status, json.loads(raw)
    except ValueError:  # the router's /health says "OK" as text
        return status, None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not reaped by its parent yet) is gone too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# ------------------------------------------------------------ without processes


def test_fleet_without_the_router_says_what_to_install(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(fleet_mod, "ROUTER_MODULE", "no_such_router_module")
    assert main(["fleet", "--replicas", "2", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and 'pip install -e ".[fleet]"' in err[0], err


def test_serve_flags_go_to_every_replica_and_router_flags_last() -> None:
    argv = ["fleet", "--replicas", "2", "--device", "cpu", "--port", "9100", "--host", "0.0.0.0",
            "--max-model-len", "1024", "--disable-prefix-cache", "--served-model-name", "m",
            "--drain-timeout", "7.5", "--router-args", "--cache-threshold 0.5 --policy round_robin"]
    args = build_parser().parse_args(argv)
    p = fleet_mod.plan(args)
    assert [r.url for r in p.replicas] == ["http://127.0.0.1:9101", "http://127.0.0.1:9102"]
    engine, server = configs_from_args(args)
    for r in p.replicas:
        assert r.argv[1:4] == ("-m", "ftserve", "serve")
        again = build_parser().parse_args(list(r.argv[3:]))
        e2, s2 = configs_from_args(again)
        # Every flag but where it listens and its name reaches the replica unchanged.
        assert e2 == engine
        assert (s2.host, s2.port, s2.replica_id) == ("127.0.0.1", r.port, r.name)
        assert s2 == type(server)(**{**server.__dict__, "host": "127.0.0.1", "port": r.port,
                                     "replica_id": r.name})
    router = list(p.router_argv)
    assert router[router.index("--port") + 1] == "9100" and router[router.index("--host") + 1] == "0.0.0.0"
    assert router[router.index("--worker-urls") + 1:][:2] == [r.url for r in p.replicas]
    assert router[router.index("--shutdown-grace-period-secs") + 1] == "8"
    # The user's router flags come after the fleet's defaults: the router keeps the last.
    assert router[-4:] == ["--cache-threshold", "0.5", "--policy", "round_robin"]
    assert router.index("cache_aware") < router.index("round_robin")


def test_the_api_key_reaches_router_and_replicas_not_replica_command_lines(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTSERVE_API_KEY", "s3cret")
    p = fleet_mod.plan(build_parser().parse_args(["fleet", "--replicas", "2", "--device", "cpu"]))
    for r in p.replicas:
        assert "s3cret" not in r.argv and dict(r.env)["FTSERVE_API_KEY"] == "s3cret"
    router = list(p.router_argv)
    assert router[router.index("--api-key") + 1] == "s3cret"  # it asks clients, tells replicas


@pytest.mark.parametrize("flags,message", [
    (["--devices", "0,0"], "lists a device twice"),
    (["--replicas", "3", "--devices", "0,1"], "one device per replica"),
    (["--replicas", "2", "--device", "cpu", "--port", "0"], "fixed port"),
    (["--replicas", "2", "--device", "cpu", "--replica-id", "x"], "names its replicas"),
    (["--replicas", "2", "--device", "cuda:1"], "give --devices"),
    (["--device", "cpu"], "give --replicas"),
    (["--replicas", "2", "--device", "cpu", "--max-running-requests", "0"], "--max-running-requests"),
])
def test_bad_fleet_flags_are_one_error_line(flags: list[str], message: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fleet", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ftserve: error:") and message in err and "\n" not in err, err


# ------------------------------------------------------------ one real fleet


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetProcess]:
    port = _free_block(4)  # router, two replicas, the router's metrics
    logs = tmp_path_factory.mktemp("fleet_logs")
    proc = FleetProcess.start(["--replicas", "2", "--device", "cpu", "--port", str(port),
                               "--log-dir", str(logs), *SERVE], env={"OMP_NUM_THREADS": "1"})
    pids: list[int] = []
    try:
        proc.wait_ready(240)
        assert proc.router is not None
        pids = [pid for _, pid in proc.replicas.values()] + [proc.router[1]]
        yield proc
    finally:
        proc.stop(60)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in pids if _alive(pid)], "the fleet left processes running"


def test_the_router_knows_ftserve_as_its_worker(fleet: FleetProcess) -> None:
    assert fleet.router is not None
    router = fleet.router[0]
    status, workers = _get(router + "/workers")
    assert status == 200 and workers["total"] == 2
    urls = {url for url, _ in fleet.replicas.values()}
    for w in workers["workers"]:
        # model id from /get_server_info's served_model_name; labels from /get_model_info
        assert w["url"] in urls and w["is_healthy"] and w["model_id"] == "ftserve-demo", w
        assert w["metadata"]["model_type"] == "qwen3_moe", w
    assert _get(router + "/v1/models")[1]["data"][0]["id"] == "ftserve-demo"
    status, loads = _get(router + "/get_loads")  # the router reads each worker's /get_load
    assert status == 200 and sorted(x["load"] for x in loads["workers"]) == [0, 0], loads
    flushed = post(router + "/flush_cache")  # fanned out to every worker's /flush_cache
    assert flushed["workers_flushed"] == 2, flushed


def _chat(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return dict(json.loads(r.read()))


def test_sglang_constraint_names_survive_the_router(fleet: FleetProcess) -> None:
    """sglang-router rebuilds chat bodies from the fields it knows: vLLM's
    ``structured_outputs`` does not reach the worker, SGLang's ``regex`` and ``ebnf`` do,
    and ftserve takes them."""
    assert fleet.router is not None
    base = {"model": "ftserve-demo", "messages": [{"role": "user", "content": "Yes or no?"}],
            "max_tokens": 8, "temperature": 0}
    for extra, allowed in (({"regex": "(yes|no)"}, {"yes", "no"}),
                           ({"ebnf": 'root ::= "maybe" | "never"'}, {"maybe", "never"})):
        out = _chat(fleet.router[0], {**base, **extra})
        assert out["choices"][0]["message"]["content"] in allowed, out
        assert out["choices"][0]["finish_reason"] == "stop", out


def test_agentic_through_the_router_keeps_one_replicas_cache_hits(
        fleet: FleetProcess, tmp_path: Path) -> None:
    alone = loadgen(fleet.replicas["replica-0"][0], str(tmp_path / "one"), [*LOAD, "--duration", "6"])
    for url, _ in fleet.replicas.values():
        post(url + "/flush_cache")  # the routed run starts as cold as the lone one did
    assert fleet.router is not None
    routed = loadgen(fleet.router[0], str(tmp_path / "routed"), [*LOAD, "--duration", "6"])
    assert alone["failed"] == 0 and routed["failed"] == 0, (alone["errors"], routed["errors"])
    assert alone["completed"] >= 10 and routed["completed"] >= 10
    assert routed["cache_hit_ratio"] >= 0.9 * alone["cache_hit_ratio"] > 0, (alone, routed)
    # Sessions spread over both replicas, each staying where its conversation is cached.
    assert set(routed["replicas"]) == {"replica-0", "replica-1"}, routed["replicas"]
    assert routed["session_affinity"] >= 0.9, routed["session_affinity"]


def test_a_killed_replica_fails_only_its_in_flight_requests(fleet: FleetProcess,
                                                           tmp_path: Path) -> None:
    assert fleet.router is not None
    router = fleet.router[0]
    health: list[int] = []
    done = threading.Event()

    def watch_health() -> None:
        while not done.is_set():
            health.append(_get(router + "/health")[0])
            time.sleep(0.2)

    result: dict[str, Any] = {}
    t_start = time.perf_counter()
    runner = threading.Thread(target=lambda: result.update(
        loadgen(router, str(tmp_path), [*LOAD, "--duration", "9"])))
    watcher = threading.Thread(target=watch_health)
    runner.start()
    watcher.start()
    recs_path = tmp_path / "requests.jsonl"
    try:
        time.sleep(3.5)  # sessions on both replicas, requests in flight
        victim = fleet.replicas["replica-1"][1]
        t_kill = time.perf_counter() - t_start
        os.kill(victim, signal.SIGKILL)
        runner.join(120)
    finally:
        done.set()
        watcher.join(10)
    assert not runner.is_alive() and result, "loadgen did not finish"
    recs = [json.loads(line) for line in recs_path.read_text().splitlines()]
    recs = [r for r in recs if r["phase"] == "measure"]
    failed = [r for r in recs if r["status"] == "error"]
    # Only requests that were on replica-1 when it died may fail (loadgen's clock starts
    # a moment after t_start: a request's start reads no later than the pytest clock).
    for r in failed:
        assert r["replica"] == "replica-1" and r["start"] <= t_kill, r
    after = [r for r in recs if r["start"] > t_kill]
    assert len(after) >= 5 and all(r["status"] == "ok" for r in after), after
    assert {r["replica"] for r in after} == {"replica-0"}
    assert health and set(health) == {200}, health  # the router stayed up throughout
    deadline = time.monotonic() + 5
    while "routes around replica-1" not in fleet.text and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "replica-1 (pid" in fleet.text and "killed by signal 9" in fleet.text, fleet.text
    assert "routes around replica-1: 1 of 2 replicas serve" in fleet.text, fleet.text


def test_sigterm_stops_the_router_and_every_replica(fleet: FleetProcess) -> None:
    assert fleet.router is not None
    pids = [fleet.router[1], fleet.replicas["replica-0"][1]]
    assert all(_alive(pid) for pid in pids)
    assert fleet.stop(60) == 0, fleet.text
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if _alive(pid)], fleet.text
    assert "ftserve fleet: stopped" in fleet.text, fleet.text
