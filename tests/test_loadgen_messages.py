"""tools.loadgen --endpoint messages: the OpenAI-to-Anthropic conversion, the stream's events,
and agentic runs over a real ftserve server's /v1/messages on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.test_loadgen import REAL
from tests.test_loadgen import ftserve_server as ftserve_server  # the demo-server fixture
from tools.loadgen import anthropic, main
from tools.loadgen.client import RequestRecord, RequestSpec, send
from tools.loadgen.soak import parse_metrics

# An agent's turn that called a tool, the tool's result, and the user's follow-up: OpenAI form.
TOOL_CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "What is in main.py?"},
    {"role": "assistant", "content": "Let me look.",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "read_file", "arguments": '{"path": "main.py"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "print('hello')"},
    {"role": "user", "content": "Summarize it."},
]
READ_FILE_TOOL = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}


def test_messages_body_converts_tool_conversation() -> None:
    body = {"model": "m", "temperature": 0.5, "messages": TOOL_CONVERSATION,
            "tools": [READ_FILE_TOOL], "tool_choice": "required", "stop": "END",
            "stream_options": {"include_usage": True}}
    assert anthropic.messages_body(body) == {
        "model": "m", "temperature": 0.5, "max_tokens": anthropic.DEFAULT_MAX_TOKENS,
        "system": "You are a coding agent.",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "What is in main.py?"}]},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "call_1", "name": "read_file",
                 "input": {"path": "main.py"}}]},
            # The tool's result and the next user text: one user turn, as Anthropic alternates.
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "call_1", "content": "print('hello')"},
                {"type": "text", "text": "Summarize it."}]},
        ],
        "tools": [{"name": "read_file", "description": "Read a file",
                   "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}],
        "tool_choice": {"type": "any"},
        "stop_sequences": ["END"],
    }
    assert anthropic.messages_body({"messages": [{"role": "user", "content": "x"}],
                                    "max_tokens": 7})["max_tokens"] == 7
    assert anthropic.headers("k")["x-api-key"] == "k" and "x-api-key" not in anthropic.headers(None)


def test_messages_stream_events() -> None:
    st = anthropic.StreamState()
    assert st.feed({"type": "message_start", "message": {"usage": {
        "input_tokens": 10, "cache_read_input_tokens": 32, "output_tokens": 0}}}) is None
    assert st.feed({"type": "ping"}) is None
    assert st.feed({"type": "content_block_delta", "index": 0,
                    "delta": {"type": "thinking_delta", "thinking": "hm"}}) == ("hm", "")
    assert st.feed({"type": "content_block_delta", "index": 1,
                    "delta": {"type": "text_delta", "text": "hi"}}) == ("hi", "hi")
    assert st.feed({"type": "content_block_delta", "index": 2,
                    "delta": {"type": "input_json_delta", "partial_json": "{"}}) == ("{", "")
    assert st.usage is None  # only message_delta's usage is final
    st.feed({"type": "message_delta", "delta": {"stop_reason": "tool_use"},
             "usage": {"output_tokens": 3}})
    st.feed({"type": "message_stop"})
    assert st.done and st.finish_reason == "tool_use"
    assert st.usage == anthropic.Usage(prompt_tokens=42, cached_tokens=32, output_tokens=3)
    with pytest.raises(anthropic.StreamError, match="overloaded_error"):
        st.feed({"type": "error", "error": {"type": "overloaded_error", "message": "busy"}})


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        return parse_metrics(r.read().decode())[name]


def test_real_server_agentic_over_messages(ftserve_server: tuple[str, int], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    url, pid = ftserve_server
    rc = main(["--url", url, "--profile", "agentic", "--endpoint", "messages", "--server-pid",
               str(pid), "--out", str(tmp_path), *REAL, "--duration", "2", "--sessions", "2",
               "--system-tokens", "200", "--turn-tokens", "120"])
    out = capsys.readouterr()
    assert rc == 0, out.out + out.err
    s = json.loads((tmp_path / "summary.json").read_text())["summary"]
    assert s["completed"] >= 3 and s["failed"] == 0 and s["aborted"] >= 1, s
    assert s["mean_ttft_ms"] > 0 and s["mean_itl_ms"] > 0 and s["total_input_tokens"] > 0
    recs = [json.loads(x) for x in (tmp_path / "requests.jsonl").read_text().splitlines()]
    later = [r for r in recs if r["kind"] == "agentic" and r["status"] == "ok" and r["turn"] >= 1]
    assert len(later) >= 2, [(r["turn"], r["status"]) for r in recs]
    # The conversation so far is in the prefix cache: usage.cache_read_input_tokens.
    assert all(r["cached_tokens"] > 0 and r["prompt_tokens"] > r["cached_tokens"] for r in later), \
        [(r["prompt_tokens"], r["cached_tokens"]) for r in later]

    # One tool-call conversation over /v1/messages, whole, then aborted after 3 deltas, then
    # whole again: the abort is recorded as such and gives its pages back.
    body = {"model": json.loads(urllib.request.urlopen(url + "/v1/models").read())["data"][0]["id"],
            "messages": TOOL_CONVERSATION, "tools": [READ_FILE_TOOL], "max_tokens": 12,
            "ignore_eos": True, "temperature": 0.0}

    async def go() -> list[RequestRecord]:
        async with aiohttp.ClientSession() as http:
            recs = []
            for abort, b in ((0, body), (3, {**body, "max_tokens": 64}), (0, body),
                             (0, {**body, "model": "no-such-model"})):
                spec = RequestSpec("messages", b, "test", abort_after_chunks=abort)
                recs.append(await send(http, url, spec, time.perf_counter(), "measure", 30.0,
                                       anthropic.headers(None)))
            return recs

    pages = _metric(url, "ftserve_kv_pages_used")
    whole, cut, again, wrong = asyncio.run(go())
    assert whole.status == "ok" and whole.output_tokens == 12 and whole.finish_reason == "max_tokens"
    assert whole.ttft is not None and len(whole.itl) == len(whole.chunk_times) - 1 > 0
    assert cut.status == "aborted" and len(cut.chunk_times) == 3 and len(cut.itl) == 2, cut
    assert again.status == "ok" and again.cached_tokens and again.cached_tokens > 0, again
    assert wrong.status == "error" and wrong.error_kind == "http_404", wrong
    deadline = time.monotonic() + 5
    while (_metric(url, "ftserve_kv_pages_used"), _metric(url, "ftserve_num_requests_running")) \
            != (pages, 0):
        assert time.monotonic() < deadline, "the aborted request's pages did not come back"
        time.sleep(0.1)
