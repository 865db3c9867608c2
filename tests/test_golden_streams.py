"""Byte-level goldens of what each protocol sends: SSE streams, whole replies and error
bodies, for OpenAI chat and completions, Anthropic Messages and OpenAI Responses.

The contract for refactors of the API layer: the bytes a client receives stay exactly
as recorded in tests/golden/ (ids and timestamps, which change every call, are masked).
Greedy decoding on the demo model with an empty prefix cache before each request, so
the tokens are fixed. ``FTSERVE_GOLDEN_RECORD=1`` rewrites the files (review the diff).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.server_harness import TEST_SERVER, Live, script_generations, start_live, stop_live

GOLDEN = Path(__file__).parent / "golden"
RECORD = os.environ.get("FTSERVE_GOLDEN_RECORD") == "1"

# Values that differ on every call: response/message/item/call ids and creation times.
_MASKS = [
    (re.compile(rb'"(id|call_id|item_id|response_id|tool_use_id)":"[^"]*"'), rb'"\1":"<id>"'),
    (re.compile(rb'"(created|created_at)":\d+'), rb'"\1":0'),
]
# Long floats (logprobs) to 3 decimals: the last bits of a float sum may differ between
# CPU kernels.
_FLOAT = re.compile(rb'-?[0-9]+\.[0-9]{4,}(?:e-?[0-9]+)?')

MSGS = [{"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Name three colours and say why the sky looks blue."}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather for a city",
                    "input_schema": TOOLS[0]["function"]["parameters"]}]

# name -> (path, body). Every body is greedy, so the demo model's tokens are fixed.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat_stream": ("/v1/chat/completions", {
        "messages": MSGS, "max_tokens": 12, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2}),
    "chat_whole": ("/v1/chat/completions", {
        "messages": MSGS, "max_tokens": 12, "temperature": 0, "stop": ["\n\n"]}),
    "chat_n2_stream": ("/v1/chat/completions", {
        "messages": MSGS, "max_tokens": 6, "temperature": 0, "n": 2, "stream": True}),
    "completions_stream": ("/v1/completions", {
        "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0, "stream": True,
        "logprobs": 2, "echo": True, "stream_options": {"include_usage": True}}),
    "completions_whole": ("/v1/completions", {
        "prompt": ["One", "Two"], "max_tokens": 5, "temperature": 0}),
    "messages_stream": ("/v1/messages", {
        "model": "ftserve-demo", "max_tokens": 12, "temperature": 0, "stream": True,
        "system": "Answer briefly.", "messages": [MSGS[1]]}),
    "messages_whole": ("/v1/messages", {
        "model": "ftserve-demo", "max_tokens": 12, "temperature": 0,
        "messages": [MSGS[1]], "stop_sequences": ["\n"]}),
    "responses_stream": ("/v1/responses", {
        "input": MSGS[1]["content"], "instructions": "Answer briefly.",
        "max_output_tokens": 12, "temperature": 0, "stream": True}),
    "responses_whole": ("/v1/responses", {
        "input": [{"role": "user", "content": MSGS[1]["content"]}],
        "max_output_tokens": 12, "temperature": 0}),
    # Error bodies, one or two per protocol.
    "chat_error_field": ("/v1/chat/completions", {"messages": MSGS, "temperature": "hot"}),
    "chat_error_context": ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 100000}),
    "chat_error_messages": ("/v1/chat/completions", {"messages": []}),
    "completions_error_field": ("/v1/completions", {"prompt": "x", "logprobs": 99}),
    "messages_error_field": ("/v1/messages", {"model": "m", "messages": [MSGS[1]]}),
    "messages_error_stream": ("/v1/messages", {
        "model": "m", "max_tokens": 4, "stream": True, "messages": [{"role": "robot", "content": "x"}]}),
    "responses_error_field": ("/v1/responses", {"input": "x", "max_output_tokens": -3}),
}

# Streams of several choices: compared choice by choice (by_choice).
INTERLEAVED = {"chat_n2_stream"}

# Tool calls parsed out of model text: the demo model never writes one, so these replay
# a scripted output through the real parser and shapers.
SCRIPTED_CALL = ['[TOOL_CALLS] [{"name": "get_weather", ', '"arguments": {"city": ',
                 '"Paris"}}]']
SCRIPTED: dict[str, tuple[str, dict[str, Any]]] = {
    "chat_tools_stream": ("/v1/chat/completions", {
        "messages": [MSGS[1]], "tools": TOOLS, "max_tokens": 12, "temperature": 0,
        "stream": True}),
    "chat_tools_whole": ("/v1/chat/completions", {
        "messages": [MSGS[1]], "tools": TOOLS, "max_tokens": 12, "temperature": 0}),
    "messages_tools_stream": ("/v1/messages", {
        "model": "ftserve-demo", "max_tokens": 12, "temperature": 0, "stream": True,
        "messages": [MSGS[1]], "tools": ANTHROPIC_TOOLS}),
    "responses_tools_stream": ("/v1/responses", {
        "input": MSGS[1]["content"], "tools": [{"type": "function", **TOOLS[0]["function"]}],
        "max_output_tokens": 12, "temperature": 0, "stream": True}),
}


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    # No keep-alive comments: they would land in a stream wherever a step runs long.
    server = start_live(server_cfg=dataclasses.replace(TEST_SERVER, keepalive_interval=3600.0))
    yield server
    stop_live(server)


def _masked(raw: bytes) -> bytes:
    for pattern, repl in _MASKS:
        raw = pattern.sub(repl, raw)
    return _FLOAT.sub(lambda m: b"%.3f" % float(m.group(0)), raw)


def _exchange(live: Live, path: str, body: dict[str, Any]) -> bytes:
    """Status, content type and body bytes of one request, as the client saw them."""
    assert live.engine.reset_prefix_cache()  # greedy tokens must not depend on cache hits

    async def go() -> bytes:
        async with aiohttp.ClientSession() as s, s.post(live.url + path, json=body) as resp:
            data = await resp.read()
            kind = resp.headers.get("Content-Type", "").split(";")[0]
            return f"{resp.status} {kind}\n".encode() + data

    return _masked(asyncio.run(go()))


def by_choice(raw: bytes) -> bytes:
    """A stream of several choices with each choice's frames together, in choice
    order: the bytes of each choice are the contract; how the choices interleave
    depends on when the event loop reads the engine's steps."""
    head, _, body = raw.partition(b"\n")
    frames = [f for f in body.split(b"\n\n") if f]
    index = re.compile(rb'"index":(\d+)')

    def choice(frame: bytes) -> int:
        m = index.search(frame)
        return int(m.group(1)) if m else 1 << 30  # [DONE] and usage last
    return head + b"\n" + b"".join(f + b"\n\n" for f in sorted(frames, key=choice))


def _check(name: str, got: bytes) -> None:
    if name in INTERLEAVED:
        got = by_choice(got)
    path = GOLDEN / f"{name}.txt"
    if RECORD:
        path.write_bytes(got)
        return
    assert path.exists(), f"no golden for {name}: run with FTSERVE_GOLDEN_RECORD=1"
    want = path.read_bytes()
    assert got == want, f"{name} changed:\n--- want\n{want.decode()}\n--- got\n{got.decode()}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(live: Live, name: str) -> None:
    path, body = CASES[name]
    _check(name, _exchange(live, path, body))


@pytest.mark.parametrize("name", sorted(SCRIPTED))
def test_golden_scripted_tool_call(live: Live, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    script_generations(monkeypatch, SCRIPTED_CALL)
    path, body = SCRIPTED[name]
    _check(name, _exchange(live, path, body))
