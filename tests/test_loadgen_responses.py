"""tools.loadgen --endpoint responses: the chat-to-Responses conversion, the stream's events,
and runs over a real ftserve server's /v1/responses on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from tests.test_loadgen import REAL
from tests.test_loadgen import ftserve_server as ftserve_server  # the demo-server fixture
from tests.test_loadgen_messages import READ_FILE_TOOL, TOOL_CONVERSATION
from tools.loadgen import main, openai_responses
from tools.loadgen.anthropic import StreamError, Usage
from tools.loadgen.client import RequestRecord, RequestSpec, send


def test_responses_body_converts_tool_conversation() -> None:
    body = {"model": "m", "temperature": 0.5, "messages": TOOL_CONVERSATION, "max_tokens": 9,
            "tools": [READ_FILE_TOOL], "tool_choice": {"type": "function", "function": {"name": "read_file"}},
            "stream_options": {"include_usage": True}}
    assert openai_responses.responses_body(body) == {
        "model": "m", "temperature": 0.5, "max_output_tokens": 9,
        "tool_choice": {"type": "function", "name": "read_file"},
        "instructions": "You are a coding agent.",
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is in main.py?"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
            {"type": "function_call", "call_id": "call_1", "name": "read_file", "arguments": '{"path": "main.py"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "print('hello')"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Summarize it."}]},
        ],
        "store": False,
        "tools": [{"type": "function", "name": "read_file", "description": "Read a file",
                   "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}],
    }
    with pytest.raises(ValueError, match="chat body"):
        openai_responses.responses_body({"prompt": "x"})


def test_responses_stream_events() -> None:
    st = openai_responses.StreamState()
    assert st.feed({"type": "response.created", "response": {}}) is None
    assert st.feed({"type": "response.reasoning_text.delta", "delta": "hm"}) == ("hm", "")
    assert st.feed({"type": "response.output_text.delta", "delta": "hi"}) == ("hi", "hi")
    assert st.feed({"type": "response.function_call_arguments.delta", "delta": "{"}) == ("{", "")
    assert st.feed({"type": "response.output_text.delta", "delta": ""}) is None
    assert not st.done and st.usage is None
    st.feed({"type": "response.incomplete", "response": {
        "incomplete_details": {"reason": "max_output_tokens"},
        "usage": {"input_tokens": 42, "input_tokens_details": {"cached_tokens": 32}, "output_tokens": 3}}})
    assert st.done and st.finish_reason == "max_output_tokens"
    assert st.usage == Usage(prompt_tokens=42, cached_tokens=32, output_tokens=3)
    with pytest.raises(StreamError, match="busy"):
        st.feed({"type": "error", "code": "overloaded", "message": "busy"})


def test_real_server_over_responses(ftserve_server: tuple[str, int], tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    url, pid = ftserve_server
    rc = main(["--url", url, "--profile", "agentic", "--endpoint", "responses", "--server-pid",
               str(pid), "--out", str(tmp_path), *REAL, "--duration", "2", "--sessions", "2",
               "--system-tokens", "200", "--turn-tokens", "120"])
    out = capsys.readouterr()
    assert rc == 0, out.out + out.err
    s = json.loads((tmp_path / "summary.json").read_text())["summary"]
    assert s["completed"] >= 3 and s["failed"] == 0, s
    recs = [json.loads(x) for x in (tmp_path / "requests.jsonl").read_text().splitlines()]
    later = [r for r in recs if r["kind"] == "agentic" and r["status"] == "ok" and r["turn"] >= 1]
    assert later and all(r["cached_tokens"] > 0 for r in later), [(r["turn"], r["cached_tokens"]) for r in recs]

    model = json.loads(urllib.request.urlopen(url + "/v1/models").read())["data"][0]["id"]
    body = {"model": model, "messages": TOOL_CONVERSATION, "tools": [READ_FILE_TOOL], "max_tokens": 12,
            "ignore_eos": True, "temperature": 0.0}

    async def go() -> list[RequestRecord]:
        async with aiohttp.ClientSession() as http:
            return [await send(http, url, RequestSpec("responses", b, "test", abort_after_chunks=abort),
                               time.perf_counter(), "measure", 30.0)
                    for abort, b in ((0, body), (3, {**body, "max_tokens": 64}),
                                     (0, {**body, "model": "no-such-model"}))]

    whole, cut, wrong = asyncio.run(go())
    assert whole.status == "ok" and whole.output_tokens == 12 and whole.finish_reason == "max_output_tokens"
    assert whole.ttft is not None and len(whole.itl) == len(whole.chunk_times) - 1 > 0
    assert cut.status == "aborted" and len(cut.chunk_times) == 3, cut
    assert wrong.status == "error" and wrong.error_kind == "http_404", wrong
