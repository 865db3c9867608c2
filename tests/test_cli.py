"""`ftserve serve` as a real subprocess (health while loading, SIGTERM drain) and
`ftserve chat` against it; flag parsing in-process."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import re
import resource
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ftserve.cli import build_parser, configs_from_args, main
from ftserve.cli_chat import ChatClient, chat_loop
from ftserve.config import ConfigError, EngineConfig, ServerConfig


def test_every_engine_field_has_a_flag(tmp_path: Path) -> None:
    args = build_parser().parse_args([
        "serve", "--model", str(tmp_path), "--load-format", "dummy", "--dtype", "float32",
        "--device", "cpu", "--page-size", "32", "--num-pages", "100",
        "--memory-ratio", "0.5", "--max-prefill-length", "64", "--max-running-requests", "3",
        "--max-model-len", "77", "--attention-backend", "torch", "--cuda-graph-max-bs", "0",
        "--disable-prefix-cache", "--seed", "9", "--status-log-interval", "0",
        "--disable-overlap-schedule", "--moe-cache-size", "4",
        "--host", "0.0.0.0", "--port", "1234", "--served-model-name", "x", "--api-key", "k",
        "--max-queued-requests", "5",
    ])
    engine, server = configs_from_args(args)
    assert engine == EngineConfig(model=str(tmp_path), load_format="dummy", dtype="float32", device="cpu",
                                  page_size=32, num_pages=100,
                                  memory_ratio=0.5, max_prefill_length=64,
                                  max_running_requests=3, max_model_len=77,
                                  attention_backend="torch", cuda_graph_max_bs=0,
                                  enable_prefix_cache=False, seed=9, status_log_interval=0.0,
                                  overlap_schedule=False, moe_cache_size=4)
    defaults, _ = configs_from_args(build_parser().parse_args(["serve"]))
    assert defaults == EngineConfig()  # no flag = the config's own default
    assert (server.host, server.port, server.served_model_name, server.api_key,
            server.max_queued_requests) == ("0.0.0.0", 1234, "x", "k", 5)


def test_server_hardening_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The key from a file or the environment (a flag shows in ps), /metrics behind
    it, and the connection timeouts."""
    monkeypatch.delenv("FTSERVE_API_KEY", raising=False)
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\nignored\n")
    _, server = configs_from_args(build_parser().parse_args([
        "serve", "--api-key-file", str(key_file), "--metrics-require-key",
        "--http-keepalive-timeout", "5", "--request-read-timeout", "7.5"]))
    assert (server.api_key, server.metrics_require_key, server.http_keepalive_timeout,
            server.request_read_timeout) == ("s3cret", True, 5.0, 7.5)
    monkeypatch.setenv("FTSERVE_API_KEY", " from-env ")
    _, server = configs_from_args(build_parser().parse_args(["serve"]))
    assert server.api_key == "from-env"
    _, server = configs_from_args(build_parser().parse_args(["serve", "--api-key", "flag"]))
    assert server.api_key == "flag"  # the flag, where given, wins
    monkeypatch.delenv("FTSERVE_API_KEY")
    _, server = configs_from_args(build_parser().parse_args(["serve"]))
    assert server.api_key is None and not server.metrics_require_key
    assert server.max_body_bytes == 16 << 20


@pytest.mark.parametrize("argv, env, named", [
    (["--http-keepalive-timeout", "0"], None, "--http-keepalive-timeout"),
    (["--request-read-timeout", "-1"], None, "--request-read-timeout"),
    (["--api-key", "k", "--api-key-file", "f"], None, "--api-key-file"),
    (["--api-key-file", "/nonexistent/key"], None, "--api-key-file"),
    (["--api-key-file", "EMPTY"], None, "--api-key-file"),
    (["--metrics-require-key"], None, "--metrics-require-key"),
    ([], "  ", "FTSERVE_API_KEY"),  # set but empty: never "no auth" by accident
])
def test_bad_hardening_values(argv: list[str], env: str | None, named: str, tmp_path: Path,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    argv = [str(empty) if a == "EMPTY" else a for a in argv]
    if env is None:
        monkeypatch.delenv("FTSERVE_API_KEY", raising=False)
    else:
        monkeypatch.setenv("FTSERVE_API_KEY", env)
    with pytest.raises(ConfigError, match=re.escape(named)):
        configs_from_args(build_parser().parse_args(["serve", *argv]))


def test_bad_flag_names_itself(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--page-size", "3"]) == 2
    assert "--page-size" in capsys.readouterr().err


@pytest.mark.parametrize("argv, named", [
    (["--max-model-len", "0"], "--max-model-len"),  # 0 used to mean "the model's limit"
    (["--kv-cache-tokens", "0"], "--kv-cache-tokens"),
    (["--num-pages", "64", "--kv-cache-tokens", "1000"], "--kv-cache-tokens"),  # which one wins?
    (["--cuda-graph-max-bs", "-1"], "--cuda-graph-max-bs"),
    (["--status-log-interval", "-1"], "--status-log-interval"),
    (["--device", "tpu"], "--device"),
    (["--device", "cuda:x"], "--device"),
    (["--drain-timeout", "-1"], "--drain-timeout"),
    (["--api-key", ""], "--api-key"),  # an unset $KEY must not serve without auth silently
    (["--api-key", "  "], "--api-key"),
    (["--served-model-name", ""], "--served-model-name"),
    (["--model", "Qwen/Qwen3-30B-A3B"], "smollm2-135m"),  # a hub id: no such folder; names the known names
])
def test_bad_values_fail_before_loading(argv: list[str], named: str) -> None:
    """Rejected when the flags are read, before any model load, with the flag to change
    (main prints the message and exits 2: test_bad_flag_names_itself)."""
    with pytest.raises(ConfigError, match=re.escape(named)):
        configs_from_args(build_parser().parse_args(["serve", *argv]))


def test_good_edge_values_pass() -> None:
    args = build_parser().parse_args(["serve", "--device", "cuda:1", "--cuda-graph-max-bs", "0",
                                      "--status-log-interval", "0", "--drain-timeout", "0"])
    engine, server = configs_from_args(args)
    assert (engine.device, engine.cuda_graph_max_bs, server.drain_timeout) == ("cuda:1", 0, 0.0)


def test_every_flag_explains_itself() -> None:
    """Each flag's help is its own sentence (from the config field), with the default."""
    parser = build_parser()
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    flags = [a for a in serve._actions if a.option_strings and a.dest != "help"]
    assert len(flags) == len(dataclasses.fields(EngineConfig)) + len(dataclasses.fields(ServerConfig))
    for a in flags:
        assert a.help and not a.help.startswith("default:"), a.option_strings
        if a.default not in (None, False):
            assert str(a.default) in a.help, (a.option_strings, a.help)


@dataclass
class Proc:
    popen: subprocess.Popen[str]
    port: int
    health_codes: list[int]
    lines: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _health(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code
    except urllib.error.URLError:  # not accepting yet (a loaded machine can lag the log line)
        return 0


def _low_fd_limit() -> None:
    """The child starts with the common soft limit of 1,024 open files."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 1024), hard))


def _fd_limits(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/limits") as f:
        line = next(x for x in f if x.startswith("Max open files"))
    soft, hard = line.split()[3:5]
    return int(soft), (1 << 62 if hard == "unlimited" else int(hard))


def offline_env(tmp: Path) -> dict[str, str]:
    """pip with no index and no config (links to an empty folder), and an empty model
    cache: what a machine without network access sees on its first start."""
    (tmp / "links").mkdir(exist_ok=True)
    return {"FTSERVE_CACHE_DIR": str(tmp / "cache"), "PIP_CONFIG_FILE": os.devnull,
            "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp / "links")}


@pytest.fixture(scope="module")
def proc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    # No --model and no index: the default real model cannot be fetched, so this
    # serves the demo model (the fallback under test in test_health_503...).
    env = {**os.environ, "OMP_NUM_THREADS": "1", **offline_env(tmp_path_factory.mktemp("offline"))}
    env.pop("FTSERVE_API_KEY", None)
    popen = subprocess.Popen(
        [sys.executable, "-m", "ftserve", "serve", "--port", "0", "--device", "cpu",
         "--max-model-len", "512", "--num-pages", "128", "--max-running-requests", "2",
         "--cuda-graph-max-bs", "0", "--drain-timeout", "20", "--status-log-interval", "0"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env,
        preexec_fn=_low_fd_limit,
    )
    assert popen.stderr is not None
    lines: list[str] = []
    port: int | None = None
    deadline = time.monotonic() + 60
    while port is None:
        line = popen.stderr.readline()
        assert line and time.monotonic() < deadline, "".join(lines)
        lines.append(line)
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        if m:
            port = int(m.group(1))
    p = Proc(popen, port, [], lines)
    threading.Thread(target=lambda: lines.extend(iter(popen.stderr.readline, "")),
                     daemon=True).start()
    while True:  # 503 while the model loads, then 200
        code = _health(p.url)
        p.health_codes.append(code)
        if code == 200:
            break
        assert time.monotonic() < deadline and popen.poll() is None, "".join(lines)
        time.sleep(0.05)
    yield p
    if popen.poll() is None:
        popen.kill()
        popen.wait()


def test_health_503_while_loading_then_banner(proc: Proc) -> None:
    codes = [c for c in proc.health_codes if c != 0]
    assert codes[0] == 503 and codes[-1] == 200
    deadline = time.monotonic() + 10
    while not any("RANDOM DEMO WEIGHTS" in line for line in proc.lines):
        assert time.monotonic() < deadline, "".join(proc.lines)
        time.sleep(0.05)
    text = "".join(proc.lines)
    assert f"http://127.0.0.1:{proc.port}" in text and "/v1/chat/completions" in text
    # the default real model was tried first, and the log says why it is not served
    assert "default real model is unavailable: could not fetch model 'smollm2-135m'" in text
    assert "--model smollm2-135m" in text


@pytest.mark.skipif(not os.path.exists("/proc/self/limits"), reason="Linux /proc")
def test_serve_raises_the_open_file_limit(proc: Proc) -> None:
    """Every connection is a file descriptor: a soft limit of 1,024 ran out at 1,100
    idle clients. The server raises it to the hard limit."""
    soft, hard = _fd_limits(proc.popen.pid)
    if hard <= 1024:
        pytest.skip("the hard limit leaves nothing to raise")
    assert soft == (65536 if hard == 1 << 62 else hard), (soft, hard)


class RecordingClient(ChatClient):
    """The real client; also keeps what each turn sent."""

    sent: list[list[dict[str, str]]]

    def stream(self, messages: list[dict[str, str]]) -> Iterator[str]:
        self.sent.append([dict(m) for m in messages])
        return super().stream(messages)


def test_chat_client_streams_and_keeps_history(proc: Proc) -> None:
    client = RecordingClient(proc.url, max_tokens=6)
    client.sent = []
    out = io.StringIO()
    history: list[dict[str, str]] = []
    rc = chat_loop(client, "be brief", io.StringIO("hello there\nand again\n/exit\n"), out,
                   history)
    assert rc == 0
    assert [m["role"] for m in history] == ["system", "user", "assistant", "user", "assistant"]
    assert client.sent[1] == history[:4]  # turn 2 resent turn 1 in full
    for reply in (history[2]["content"], history[4]["content"]):
        assert reply in out.getvalue()
    assert "ftserve-demo" in out.getvalue()


def test_ftserve_chat_command(proc: Proc, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n/reset\n/exit\n"))
    assert main(["chat", "--url", proc.url, "--max-tokens", "3", "--system", "terse"]) == 0
    out = capsys.readouterr().out
    assert "ftserve chat with 'ftserve-demo'" in out and "(history cleared)" in out


def test_chat_commands_stay_local(proc: Proc) -> None:
    """/help and an unknown /command answer locally; only real text (and //text, one slash
    off) reaches the model."""
    client = RecordingClient(proc.url, max_tokens=3)
    client.sent = []
    out = io.StringIO()
    history: list[dict[str, str]] = []
    rc = chat_loop(client, None, io.StringIO("/help\n/nonsense now\n//etc/hosts please\n/exit\n"),
                   out, history)
    assert rc == 0
    text = out.getvalue()
    assert "/reset" in text and "/exit" in text  # the help listing
    assert "unknown command '/nonsense'" in text and "nothing was sent" in text
    assert [[m["content"] for m in turn] for turn in client.sent] == [["/etc/hosts please"]]


def test_chat_line_editing_on_a_terminal(proc: Proc) -> None:
    """On a terminal the prompt has readline editing: "/hep", cursor left, "l" is "/help"."""
    import pty

    pid, fd = pty.fork()
    if pid == 0:  # the child: `ftserve chat` on the pty
        os.execvpe(sys.executable, [sys.executable, "-m", "ftserve", "chat", "--url", proc.url],
                   {**os.environ, "TERM": "xterm"})
    seen = b""

    def read_until(needle: bytes, timeout: float = 30.0) -> None:
        nonlocal seen
        deadline = time.monotonic() + timeout
        while needle not in seen:
            assert time.monotonic() < deadline, seen.decode(errors="replace")
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                try:
                    seen += os.read(fd, 4096)
                except OSError:  # the child closed the pty
                    break

    try:
        read_until(b"> ")
        os.write(fd, b"/hep\x1b[Dl\r")  # ESC [ D: cursor left
        read_until(b"clear the conversation")
        assert b"unknown command" not in seen
        os.write(fd, b"/exit\r")
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)


def test_port_in_use_is_one_line(proc: Proc) -> None:
    """A second server on a port that is taken: one error line naming the port and the flag,
    exit status 1, no traceback."""
    run = subprocess.run(
        [sys.executable, "-m", "ftserve", "serve", "--model", "demo", "--port", str(proc.port),
         "--device", "cpu"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    errors = [line for line in run.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and str(proc.port) in errors[0] and "--port" in errors[0], run.stderr


def test_sigterm_drains_in_flight_then_exits(proc: Proc) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
                       "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(proc.url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    events: list[Any] = []
    with urllib.request.urlopen(req, timeout=60) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                events.append("[DONE]")
                continue
            events.append(json.loads(line[6:]))
            if len(events) == 2:  # the stream is live: now ask the server to stop
                proc.popen.send_signal(signal.SIGTERM)
                time.sleep(0.3)
                with pytest.raises((urllib.error.URLError, ConnectionError)):
                    urllib.request.urlopen(proc.url + "/health", timeout=5)
    assert events[-1] == "[DONE]"
    finish = [e for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"]]
    assert finish[0]["choices"][0]["finish_reason"] == "length"
    assert proc.popen.wait(timeout=30) == 0
    assert any("shut down cleanly" in line for line in proc.lines)

