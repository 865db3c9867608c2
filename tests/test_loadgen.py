"""tools.loadgen: statistics, text generation, and whole runs over real HTTP on 127.0.0.1.

Two servers: a real ``python -m ftserve serve`` subprocess (tiny demo model) that every profile and
the soak checks must pass against, and a small in-test aiohttp server that speaks the same
streaming protocol and can be told to misbehave (leak KV pages, drift canary outputs) to prove the
soak checks can fail.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from tools.loadgen import main, textgen
from tools.loadgen.client import RequestRecord
from tools.loadgen.soak import parse_metrics
from tools.loadgen.stats import format_table, summarize

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------- pure parts


def _rec(ttft: float, itl: list[float], e2e: float, out: int, status: str = "ok") -> RequestRecord:
    return RequestRecord("random", 0, 0, "measure", 0.0, status=status, ttft=ttft, itl=itl,
                         e2e=e2e, prompt_tokens=100, cached_tokens=40, output_tokens=out)


def test_summary_matches_numpy_and_vllm_names() -> None:
    rng = random.Random(1)
    recs = [_rec(rng.random(), [rng.random() * 0.1 for _ in range(5)], 2.0 + rng.random(), 6)
            for _ in range(50)]
    recs.append(_rec(0.5, [0.01], 0.6, 2, status="aborted"))
    recs.append(RequestRecord("random", 0, 0, "measure", 0.0, status="error", error_kind="http_503"))
    recs.append(_rec(9.0, [], 9.0, 1))
    recs[-1].phase = "warmup"  # must not count
    s = summarize(recs, duration_s=10.0)
    ttft = np.array([r.ttft for r in recs[:51]]) * 1000
    assert s["mean_ttft_ms"] == pytest.approx(ttft.mean())
    assert s["p99_ttft_ms"] == pytest.approx(np.percentile(ttft, 99))
    assert s["median_ttft_ms"] == pytest.approx(np.median(ttft))
    tpot = np.array([(r.e2e - r.ttft) / 5 for r in recs[:50]]) * 1000
    assert s["mean_tpot_ms"] == pytest.approx(tpot.mean())
    itl = np.array([x for r in recs[:51] for x in r.itl]) * 1000
    assert s["p90_itl_ms"] == pytest.approx(np.percentile(itl, 90))
    assert s["max_e2el_ms"] == pytest.approx(max(r.e2e for r in recs[:50]) * 1000)
    assert (s["completed"], s["aborted"], s["failed"]) == (50, 1, 1)
    assert s["errors"] == {"http_503": 1}
    assert s["request_throughput"] == pytest.approx(5.0)
    assert s["output_throughput"] == pytest.approx((50 * 6 + 2) / 10.0)
    assert s["cache_hit_ratio"] == pytest.approx(0.4)
    table = format_table(s)
    assert "P99 TTFT (ms):" in table and "http_503:" in table


def test_session_affinity_counts_continued_turns_on_the_same_replica() -> None:
    def rec(session: int, turn: int, start: float, replica: str | None) -> RequestRecord:
        return RequestRecord("agentic", session, turn, "measure", start, replica=replica)

    recs = [rec(0, 0, 0.0, "a"), rec(0, 1, 1.0, "a"), rec(0, 2, 2.0, "b"), rec(0, 3, 3.0, "b"),
            rec(0, 0, 4.0, "a"),  # a restarted conversation: no previous turn to follow
            rec(1, 0, 0.5, "b"), rec(1, 1, 1.5, None), rec(1, 2, 2.5, "b"),  # no name: skipped
            rec(-1, 0, 0.1, "a")]  # a canary is no session
    s = summarize(recs, duration_s=5.0)
    assert s["replicas"] == {"a": 4, "b": 4}
    # session 0: a->a same, a->b moved, b->b same; session 1: the unnamed turn breaks the chain
    assert s["session_affinity"] == pytest.approx(2 / 3)
    assert "served by a:" in format_table(s) and "Session affinity" in format_table(s)
    assert "replicas" not in summarize([rec(0, 1, 0.0, None)], 1.0)  # a server that names none


def test_text_is_deterministic_and_heavy_tailed() -> None:
    a, b = random.Random("s"), random.Random("s")
    assert textgen.tool_output(a, 300) == textgen.tool_output(b, 300)
    rng = random.Random(7)
    xs = np.array([textgen.draw_length(rng, 200, "lognormal", 1.0, 10**9) for _ in range(20000)])
    assert xs.mean() == pytest.approx(200, rel=0.1)
    assert np.percentile(xs, 99) > 4 * np.median(xs)  # a heavy right tail
    ps = np.array([textgen.draw_length(rng, 200, "pareto", 0.5, 10**9) for _ in range(20000)])
    assert ps.mean() == pytest.approx(200, rel=0.15) and ps.max() > 20 * np.median(ps)
    words = len(textgen.prose(random.Random(3), 1300).split())
    assert words == pytest.approx(1000, abs=2)
    json.loads(textgen.json_blob(random.Random(4), 200))


def test_edit_profile_asks_for_a_small_change_to_valid_source() -> None:
    """The edit profile's requests: deterministic per (seed, index), a Python file of
    about --file-tokens tokens that parses, a change that touches a few lines of it
    and leaves it parsing, and max_tokens for the whole file within --max-context."""
    import ast
    import difflib

    from tools.loadgen.profiles import WorkloadConfig, _edit_spec

    cfg = WorkloadConfig(profile="edit", file_tokens=2000, max_context=8192, temperature=0.0)
    a, b = _edit_spec(cfg, 3), _edit_spec(cfg, 3)
    assert a.body == b.body and a.body != _edit_spec(cfg, 4).body
    kinds = set()
    for i in range(12):
        rng = random.Random(f"0:edit:{i}")
        source = textgen.source_file(rng, 2000)
        instruction, edited = textgen.small_edit(rng, source)
        kinds.add(instruction.split()[0])
        ast.parse(source)
        ast.parse(edited)
        assert textgen.approx_tokens(source) == pytest.approx(2000, rel=0.1)
        diff = difflib.ndiff(source.splitlines(), edited.splitlines())
        changed = sum(line[:1] in "+-" for line in diff)
        assert edited != source and changed <= 0.1 * len(source.splitlines()), instruction
        spec = _edit_spec(cfg, i)
        user = spec.body["messages"][1]["content"]
        assert source in user and instruction in user
        assert spec.body["messages"][2] == {"role": "assistant", "content": "```python\n"}
        assert spec.body["continue_final_message"] is True  # the reply opens inside the block
        assert 2000 < spec.body["max_tokens"] < 8192 - 2000
    assert kinds == {"Rename", "Change", "In"}  # all three kinds of change occur


def test_token_estimate_treats_prose_and_tool_output_alike() -> None:
    """The agentic ceiling rescales the estimate by the server's count for the
    whole prompt, then sizes the next message with it, inside a 0.8 margin: so
    real / estimate must agree between prose and tool output (code, JSON) to
    about 25%. Checked with the demo model's real sentencepiece vocabulary."""
    import sentencepiece as spm

    from ftserve.models.checkpoint import tokenizer_data_dir
    from ftserve.models.presets import TOKENIZER_V1

    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_data_dir() / TOKENIZER_V1))
    ratios: dict[str, list[float]] = {}
    for kind in ("user_turn", "tool_output", "system_prompt"):
        rng = random.Random(1)
        texts = [getattr(textgen, kind)(rng, rng.choice([40, 150, 400])) for _ in range(60)]
        ratios[kind] = [len(sp.encode(t)) / textgen.approx_tokens(t) for t in texts]
    prose = sum(ratios["user_turn"]) / len(ratios["user_turn"])
    for kind, rs in ratios.items():
        assert 0.75 * prose <= min(rs) and max(rs) <= 1.3 * prose, (kind, prose, min(rs), max(rs))


def test_parse_metrics_sums_labels() -> None:
    text = ('# TYPE ftserve_num_requests_running gauge\n'
            'ftserve_num_requests_running{model="a"} 2\nftserve_num_requests_running{model="b"} 1\n'
            '# TYPE ftserve_prompt_tokens counter\nftserve_prompt_tokens_total 17\n')
    m = parse_metrics(text)
    assert m["ftserve_num_requests_running"] == 3 and m["ftserve_prompt_tokens_total"] == 17


# ---------------------------------------------------------------- in-test protocol server


class FakeServer:
    """Streams ``max_tokens`` word chunks; ``mode`` = healthy | leak | drift."""

    def __init__(self, mode: str = "healthy") -> None:
        self.mode = mode
        self.running = 0
        self.leaked = 0
        self.disconnects = 0
        self.canaries = 0
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        chat = "messages" in body
        prompt = " ".join(m["content"] for m in body["messages"]) if chat else body["prompt"]
        n = int(body.get("max_tokens", 16))
        canary = body.get("temperature") == 0.0
        if canary:
            self.canaries += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.running += 1
        finished = False
        try:
            for i in range(n):
                word = f"w{i}" + (f"x{self.canaries}" if canary and self.mode == "drift" else "")
                delta = {"delta": {"content": word + " "}} if chat else {"text": word + " "}
                await resp.write(f"data: {json.dumps({'choices': [{'index': 0, **delta}]})}\n\n".encode())
                await asyncio.sleep(0.003)
            usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n,
                     "prompt_tokens_details": {"cached_tokens": len(prompt.split()) // 2}}
            done = {"choices": [{"index": 0, "finish_reason": "length", **({"delta": {}} if chat else {"text": ""})}]}
            await resp.write(f"data: {json.dumps(done)}\n\n".encode())
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
            finished = True
        except (ConnectionResetError, asyncio.CancelledError):
            self.disconnects += 1
            raise
        finally:
            self.running -= 1
            if self.mode == "leak" and not canary:
                self.leaked += 1
        return resp if finished else resp

    async def _metrics(self, request: web.Request) -> web.Response:
        kv = min(1.0, 0.05 * self.running + 0.01 * self.leaked)
        text = (f"# TYPE ftserve_num_requests_running gauge\nftserve_num_requests_running {self.running}\n"
                "# TYPE ftserve_num_requests_waiting gauge\nftserve_num_requests_waiting 0\n"
                f"# TYPE ftserve_kv_cache_usage_ratio gauge\nftserve_kv_cache_usage_ratio {kv}\n"
                "# TYPE process_resident_memory_bytes gauge\nprocess_resident_memory_bytes 1e8\n")
        return web.Response(text=text, content_type="text/plain")

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/health", lambda r: self._ok(web.Response(text="ok")))
        app.router.add_get("/v1/models", lambda r: self._ok(web.json_response({"data": [{"id": "fake"}]})))
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/chat/completions", self._stream)
        app.router.add_post("/v1/completions", self._stream)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    @staticmethod
    async def _ok(resp: web.Response) -> web.Response:
        return resp

    def __enter__(self) -> FakeServer:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


FAST = ["--no-progress", "--output-tokens", "8", "--max-output-tokens", "16", "--settle-timeout",
        "1", "--scrape-interval", "0.2", "--canary-interval", "0.3", "--drain-timeout", "5"]


def test_fake_healthy_soak_passes_and_writes_outputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with FakeServer() as srv:
        rc = main(["--url", srv.url, "--profile", "agentic", "--sessions", "3", "--duration", "1.2",
                   "--warmup", "0.2", "--soak", "--abort-rate", "0.3", "--out", str(tmp_path), *FAST])
        out = capsys.readouterr()
        assert rc == 0, out.err
        assert srv.disconnects > 0  # aborts really closed the stream mid-way
    assert "soak: all checks passed" in out.out and "Mean TTFT (ms):" in out.out
    lines = [json.loads(x) for x in (tmp_path / "requests.jsonl").read_text().splitlines()]
    phases = {r["phase"] for r in lines}
    assert {"warmup", "measure", "canary"} <= phases
    measured = [r for r in lines if r["phase"] == "measure"]
    assert any(r["status"] == "aborted" for r in measured) and any(r["status"] == "ok" for r in measured)
    assert max(r["turn"] for r in measured) >= 2  # sessions carried on for several turns
    doc = json.loads((tmp_path / "summary.json").read_text())
    assert doc["summary"]["completed"] > 0 and doc["violations"] == []
    assert doc["soak"]["num_scrapes"] >= 3
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "ttft_vs_prompt_tokens.png").stat().st_size > 1000
    assert (tmp_path / "server_metrics.png").exists()


@pytest.mark.parametrize("mode,needle,extra", [
    ("leak", "KV pages leaked", []),
    ("drift", "greedy output changed", []),
    # Idle-only comparison still catches drift: the post-drain canary runs on an idle server.
    ("drift", "greedy output changed", ["--canary-compare", "idle"]),
])
def test_soak_fails_on_misbehaving_server(mode: str, needle: str, extra: list[str],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    with FakeServer(mode) as srv:
        rc = main(["--url", srv.url, "--profile", "random", "--concurrency", "2", "--duration", "0.8",
                   "--soak", *FAST, *extra])
    err = capsys.readouterr().err
    assert rc == 1 and "SOAK FAILED" in err and needle in err, err


def test_max_requests_bound_and_poisson(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with FakeServer() as srv:
        rc = main(["--url", srv.url, "--profile", "shared-prefix", "--request-rate", "50",
                   "--max-requests", "12", "--endpoint", "completions", "--out", str(tmp_path), *FAST])
    assert rc == 0, capsys.readouterr().err
    s = json.loads((tmp_path / "summary.json").read_text())["summary"]
    assert s["num_requests"] == 12 and s["completed"] == 12


def test_edit_profile_runs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with FakeServer() as srv:
        rc = main(["--url", srv.url, "--profile", "edit", "--file-tokens", "60", "--concurrency", "2",
                   "--max-requests", "4", "--out", str(tmp_path), *FAST])
    assert rc == 0, capsys.readouterr().err
    s = json.loads((tmp_path / "summary.json").read_text())["summary"]
    assert s["num_requests"] == 4 and s["completed"] == 4 and s["total_output_tokens"] > 4 * 60


def test_unreachable_server_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--url", f"http://127.0.0.1:{free_port()}", "--duration", "1"]) == 2


def test_ctrl_c_prints_what_was_measured() -> None:
    with FakeServer() as srv:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tools.loadgen", "--url", srv.url, "--profile", "random",
             "--duration", "60", *FAST], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        time.sleep(2.5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
    assert proc.returncode == 130, err
    assert "INTERRUPTED" in out and "Successful requests:" in out
    done = int(next(x for x in out.splitlines() if x.startswith("Successful requests:")).split()[-1])
    assert done > 0


# ---------------------------------------------------------------- the real server


@pytest.fixture(scope="module")
def ftserve_server() -> Iterator[tuple[str, int]]:
    """``python -m ftserve serve`` (tiny random demo model) on a free port, until the module ends."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftserve", "serve", "--model", "demo", "--port", str(port),
         "--status-log-interval", "0"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"ftserve exited with {proc.returncode}:\n{proc.stdout.read() if proc.stdout else ''}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass  # not listening yet, or 503 while the model loads
            assert time.monotonic() < deadline, "ftserve did not become healthy in 90 s"
            time.sleep(0.2)
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


REAL = ["--no-progress", "--duration", "3", "--soak", "--abort-rate", "0.3", "--ignore-eos",
        "--output-tokens", "8", "--max-output-tokens", "16", "--max-context", "1024",
        "--scrape-interval", "0.5", "--canary-interval", "1", "--settle-timeout", "5"]


@pytest.mark.parametrize("profile,extra", [
    ("agentic", ["--sessions", "3", "--system-tokens", "200", "--turn-tokens", "120"]),
    ("agentic", ["--sessions", "2", "--system-tokens", "200", "--turn-tokens", "120",
                 "--subagents", "3", "--fanout-fraction", "0.6"]),
    ("shared-prefix", ["--groups", "2", "--prefix-tokens", "300", "--input-tokens", "40",
                       "--concurrency", "3"]),
    ("random", ["--request-rate", "15", "--input-tokens", "80", "--endpoint", "completions"]),
])
def test_real_server_profile_soak_passes(ftserve_server: tuple[str, int], profile: str,
                                         extra: list[str], tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    url, pid = ftserve_server
    rc = main(["--url", url, "--profile", profile, "--server-pid", str(pid), "--out", str(tmp_path),
               *REAL, *extra])
    out = capsys.readouterr()
    assert rc == 0, out.out + out.err
    doc = json.loads((tmp_path / "summary.json").read_text())
    s = doc["summary"]
    assert s["completed"] >= 3 and s["failed"] == 0, s
    assert s["aborted"] >= 1  # mid-stream aborts happened, and the soak checks saw no leak
    assert s["mean_ttft_ms"] > 0 and s["mean_itl_ms"] > 0 and s["total_input_tokens"] > 0
    if profile != "random":
        assert s["cache_hit_ratio"] > 0.2  # shared prompts and growing conversations hit the cache
    # The ceiling is approximate: the client has no tokenizer and re-anchors on usage each turn.
    assert s["max_prompt_tokens"] <= 1.1 * 1024
    canaries = doc["canaries"]
    assert len(canaries) >= 3 and len({c["text"] for c in canaries}) == 1 and canaries[0]["text"]
    final = doc["soak"]["final"]
    assert final["ftserve_num_requests_running"] == 0 and final["rss"] > 0
    # ftserve names itself in every response (X-Ftserve-Replica): one replica, every turn on it.
    assert list(s["replicas"]) == [f"{socket.gethostname()}:{url.rsplit(':', 1)[1]}"]
    if profile == "agentic":
        assert s["session_affinity"] == 1.0
        assert (tmp_path / "replica_per_session.png").stat().st_size > 0
    if "--subagents" in extra:
        # Sub-agents sent at once over one conversation: the server prefilled it once,
        # so each fan-out request found all but its own sub-task cached.
        recs = [json.loads(x) for x in (tmp_path / "requests.jsonl").read_text().splitlines()]
        fan = [r for r in recs if r["kind"] == "agentic-fanout" and r["status"] == "ok"
               and r["prompt_tokens"]]
        assert len(fan) >= 3, [r["kind"] for r in recs]
        assert all(r["cached_tokens"] > 0 for r in fan), [(r["prompt_tokens"], r["cached_tokens"]) for r in fan]
        # The first of a fan-out finds the conversation cached up to the last turn; the
        # others also find the new turn, which it prefilled for them: a page (16) or more.
        gains = [b["cached_tokens"] - a["cached_tokens"] for a in fan for b in fan
                 if (a["session"], a["turn"]) == (b["session"], b["turn"])
                 and abs(a["prompt_tokens"] - b["prompt_tokens"]) <= 8]
        assert max(gains) >= 16, [(r["session"], r["turn"], r["prompt_tokens"], r["cached_tokens"]) for r in fan]


def test_help_names_each_default_once_and_every_flag_has_help() -> None:
    from tools.loadgen.cli import build_parser

    parser = build_parser()
    text = parser.format_help()
    assert "(default: None)" not in text
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"{action.option_strings} has no help"
            assert (action.help or "").count("default") <= 1


def test_real_server_defaults_soak_restarts_sessions_before_the_server_limit(
        ftserve_server: tuple[str, int], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """loadgen with its defaults against ftserve with its defaults: no --max-context, so
    the ceiling comes from the server's card (the demo serves 4,096 tokens), and long turns
    reach it within seconds. Sessions must restart before a prompt passes it: no 400s."""
    url, pid = ftserve_server
    with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
        limit = json.loads(r.read())["data"][0]["max_model_len"]
    assert limit < 8192  # the old assumed ceiling would overrun this server
    rc = main(["--url", url, "--server-pid", str(pid), "--out", str(tmp_path), "--no-progress",
               "--duration", "6", "--soak", "--sessions", "2", "--system-tokens", "600",
               "--turn-tokens", "900", "--output-tokens", "8", "--max-output-tokens", "16",
               "--ignore-eos", "--scrape-interval", "0.5", "--canary-interval", "2",
               "--settle-timeout", "5"])
    out = capsys.readouterr()
    assert rc == 0, out.out + out.err
    s = json.loads((tmp_path / "summary.json").read_text())["summary"]
    assert s["failed"] == 0 and s["completed"] >= 4, s
    assert limit // 2 < s["max_prompt_tokens"] <= limit, s  # it got near the limit, not past
