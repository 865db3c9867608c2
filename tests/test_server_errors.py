"""Errors, limits, disconnects, queueing and the event loop staying responsive,
against a real server (real engine, demo model) with raw aiohttp requests."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server_harness import TEST_SERVER, Live, start_live, stop_live

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    server = start_live()
    yield server
    stop_live(server)


async def _request(url: str, data: bytes | None = None, method: str = "POST",
                   headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    async with aiohttp.ClientSession() as s, s.request(method, url, data=data,
                                                       headers=headers) as resp:
        raw = await resp.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = raw
        return resp.status, dict(resp.headers), body


def call(live: Live, path: str, body: Any = None, raw: bytes | None = None,
         base: str | None = None, **kw: Any) -> tuple[int, dict[str, str], Any]:
    data = raw if raw is not None else orjson.dumps(body)
    return asyncio.run(_request((base or live.url) + path, data, **kw))


def assert_error(resp: tuple[int, dict[str, str], Any], status: int,
                 param: str | None = None, code: str | None = None) -> dict[str, Any]:
    got, _, body = resp
    assert got == status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": "hi"}, "messages"),
    ({}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0]"),
    ({"messages": MSGS, "temperature": "hot"}, "temperature"),
    ({"messages": MSGS, "temperature": 7}, "temperature"),
    ({"messages": MSGS, "top_p": 0}, "top_p"),
    ({"messages": MSGS, "max_tokens": 0}, "max_tokens"),
    ({"messages": MSGS, "max_tokens": True}, "max_tokens"),
    ({"messages": MSGS, "stream": "yes"}, "stream"),
    ({"messages": MSGS, "stop": [1, 2]}, "stop"),
    ({"messages": MSGS, "top_logprobs": 50, "logprobs": True}, "top_logprobs"),
    ({"messages": MSGS, "stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"messages": MSGS, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": MSGS, "n": 0}, "n"),
    ({"messages": MSGS, "n": 17}, "n"),
    ({"messages": MSGS, "n": "2"}, "n"),
    ({"messages": MSGS, "tools": [{"type": "function"}]}, "tools"),
    ({"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
     "tools"),
    ({"messages": MSGS, "tools": {"f": 1}}, "tools"),
    ({"messages": MSGS, "tool_choice": "required"}, "tool_choice"),
    ({"messages": MSGS, "functions": [{"name": "f"}]}, "functions"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]},
     "messages[0]"),
    ({"messages": [{"role": "assistant", "content": None,
                    "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}]},
     "messages[0].tool_calls"),
    ({"messages": MSGS, "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": MSGS, "modalities": ["text", "audio"]}, "modalities"),
    ({"messages": MSGS, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"messages": MSGS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
])
def test_bad_fields_name_the_param(live: Live, body: dict[str, Any], param: str) -> None:
    assert_error(call(live, CHAT, {"max_tokens": 1, **body}), 400, param=param)


def test_bad_json_and_shapes(live: Live) -> None:
    assert_error(call(live, CHAT, raw=b"{not json"), 400)
    assert_error(call(live, CHAT, raw=b"[1, 2]"), 400)
    assert_error(call(live, "/v1/completions", {"prompt": [1, "a"]}), 400, param="prompt")
    assert_error(call(live, "/v1/completions", {"prompt": [live.engine.vocab_size]}), 400,
                 param="prompt")
    # vLLM's prompt_logprobs: in range, and not streamed (echo + logprobs streams them).
    assert_error(call(live, "/v1/completions", {"prompt": "x", "prompt_logprobs": 21}), 400,
                 param="prompt_logprobs")
    assert_error(call(live, CHAT, {"messages": [{"role": "user", "content": "x"}], "stream": True,
                                   "prompt_logprobs": 1}), 400, param="prompt_logprobs")
    assert_error(call(live, "/v1/completions", {"prompt": [[1], [1, "a"]]}), 400, param="prompt")


def test_unknown_fields_are_ignored(live: Live) -> None:
    status, _, body = call(live, CHAT, {"messages": MSGS, "max_tokens": 1, "user": "u1",
                                        "metadata": {"k": 1}, "some_future_field": [1]})
    assert status == 200, body


def test_context_length_exceeded_names_both_numbers(live: Live) -> None:
    limit = live.engine.max_model_len
    err = assert_error(call(live, "/v1/completions", {"prompt": [5] * 100, "max_tokens": limit}),
                       400, param="prompt", code="context_length_exceeded")
    assert str(limit) in err["message"] and str(100 + limit) in err["message"]
    err = assert_error(call(live, "/v1/completions", {"prompt": [5] * (limit + 3)}), 400,
                       code="context_length_exceeded")
    assert str(limit + 3) in err["message"]


def test_unknown_model_route_method_and_body_size(live: Live) -> None:
    assert_error(call(live, CHAT, {"model": "gpt-4", "messages": MSGS}), 404, param="model",
                 code="model_not_found")
    assert_error(call(live, "/v1/nothing", {}), 404)
    assert_error(call(live, "/v1/models", {}, method="DELETE"), 405)
    big = b'{"prompt": "' + b"a" * (TEST_SERVER.max_body_bytes + 10) + b'"}'
    assert_error(call(live, "/v1/completions", raw=big), 413)


def test_api_key(live: Live) -> None:
    base = live.listen(dataclasses.replace(TEST_SERVER, api_key="sekret"))
    assert_error(call(live, "/v1/models", method="GET", base=base, raw=b""), 401,
                 code="invalid_api_key")
    assert_error(call(live, "/v1/models", method="GET", base=base, raw=b"",
                      headers={"Authorization": "Bearer wrong"}), 401)
    ok = call(live, "/v1/models", method="GET", base=base, raw=b"",
              headers={"Authorization": "Bearer sekret"})
    assert ok[0] == 200
    # The auth scheme is case-insensitive (RFC 7235): "bearer" was a 401.
    assert call(live, "/v1/models", method="GET", base=base, raw=b"",
                headers={"Authorization": "bearer sekret"})[0] == 200
    assert call(live, "/health", method="GET", base=base, raw=b"")[0] == 200


async def _open_stream(session: aiohttp.ClientSession, url: str,
                       max_tokens: int) -> aiohttp.ClientResponse:
    body = {"messages": MSGS, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    resp = await session.post(url + CHAT, json=body)
    assert resp.status == 200
    return resp


def test_queue_full_503_keepalive_and_disconnect_abort(live: Live) -> None:
    """2 running + 2 waiting fill the queue; the next request gets 503 + Retry-After; the
    waiting streams see keep-alive comments; dropping every client frees every page."""
    baseline = live.wait_idle()

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            streams = [await _open_stream(s, live.url, 400) for _ in range(4)]
            deadline = time.monotonic() + 20
            while live.engine.stats().waiting < 2:
                assert time.monotonic() < deadline, live.engine.stats()
                await asyncio.sleep(0.02)
            status, headers, body = await _request(live.url + CHAT, orjson.dumps(
                {"messages": MSGS, "max_tokens": 1}))
            assert status == 503 and int(headers["Retry-After"]) >= 1, body
            # A waiting request's stream stays alive with comments before its first token.
            waiting_first = await asyncio.wait_for(streams[3].content.readuntil(b"\n\n"), 10)
            assert waiting_first.startswith(b"data: ")  # the role chunk
            nxt = await asyncio.wait_for(streams[3].content.readuntil(b"\n\n"), 10)
            assert nxt == b": keep-alive\n\n"
            # The running ones are streaming tokens.
            for _ in range(3):
                await asyncio.wait_for(streams[0].content.readuntil(b"\n\n"), 10)
            for r in streams:
                r.close()

    asyncio.run(go())
    after = live.wait_idle(timeout=5)  # abort within a step; pages back to baseline
    assert after.kv_pages_used == baseline.kv_pages_used == 0


def test_non_streaming_disconnect_aborts(live: Live) -> None:
    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            task = asyncio.ensure_future(s.post(live.url + CHAT, json={
                "messages": MSGS, "max_tokens": 400, "ignore_eos": True}))
            deadline = time.monotonic() + 10
            while live.engine.stats().running < 1:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            task.cancel()  # drops the connection mid-generation
            with pytest.raises(asyncio.CancelledError):
                await task

    aborted = _aborted(live)
    asyncio.run(go())
    live.wait_idle(timeout=5)
    assert _aborted(live) == aborted + 1  # not finished: 400 tokens would take longer


def _aborted(live: Live) -> float:
    """ftserve_requests_finished_total{reason="abort"} as /metrics shows it."""
    async def go() -> str:
        async with aiohttp.ClientSession() as s, s.get(live.url + "/metrics") as resp:
            return await resp.text()

    line = next(x for x in asyncio.run(go()).splitlines()
                if x.startswith('ftserve_requests_finished_total{reason="abort"}'))
    return float(line.split(" ")[1])


def test_n_choices_disconnect_aborts_every_choice(live: Live) -> None:
    """n = 3 is three engine requests: a client that leaves mid-stream, or before a
    non-streamed answer, frees all of them (and /metrics counts five aborts)."""
    baseline = live.wait_idle()
    aborted = _aborted(live)

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            resp = await s.post(live.url + CHAT, json={
                "messages": MSGS, "max_tokens": 400, "ignore_eos": True, "stream": True, "n": 3})
            assert resp.status == 200
            for _ in range(6):  # three role chunks, then tokens
                await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 10)
            st = live.engine.stats()
            assert st.running + st.waiting == 3, st  # this server runs 2 at a time
            resp.close()
        live.wait_idle(timeout=5)  # the stream's three are gone
        # Non-streamed, over a socket this test closes itself once both choices run
        # (a cancelled client request may close its connection before the server
        # has read it, and then there is nothing to abort).
        body = orjson.dumps({"messages": MSGS, "max_tokens": 400, "ignore_eos": True, "n": 2})
        reader, writer = await asyncio.open_connection("127.0.0.1", live.server.port)
        writer.write(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (CHAT.encode(), len(body), body))
        await writer.drain()
        deadline = time.monotonic() + 10
        while live.engine.stats().running < 2:
            assert time.monotonic() < deadline, live.engine.stats()
            await asyncio.sleep(0.01)
        writer.close()

    asyncio.run(go())
    after = live.wait_idle(timeout=5)
    assert after.kv_pages_used == baseline.kv_pages_used == 0
    assert _aborted(live) == aborted + 5


def test_stream_keeps_flowing_while_huge_prompts_tokenize(live: Live) -> None:
    """170k-token prompts are tokenized off the event loop: a running stream keeps
    receiving tokens meanwhile (the huge requests then fail on context length). Three
    distinct prompts at once make the window long enough to measure on a fast CPU."""
    lorem = "lorem ipsum dolor sit amet, " * 17000  # 170k tokens (10 per repeat)
    huge = [f"{i} {lorem}" for i in range(3)]  # distinct starts: no tokenizer-cache reuse
    limit = live.engine.max_model_len

    async def go() -> tuple[list[float], float, float]:
        async with aiohttp.ClientSession() as s:
            stream = await _open_stream(s, live.url, 400)
            await stream.content.readuntil(b"\n\n")
            arrivals: list[float] = []

            async def read() -> None:
                while True:
                    line = await stream.content.readuntil(b"\n\n")
                    arrivals.append(time.monotonic())
                    if line.startswith(b"data: [DONE]"):
                        return

            reader = asyncio.ensure_future(read())
            await asyncio.sleep(0.3)
            t0 = time.monotonic()
            results = await asyncio.gather(*[
                _request(live.url + "/v1/completions",
                         orjson.dumps({"prompt": text, "max_tokens": 1})) for text in huge])
            t1 = time.monotonic()
            for status, _, body in results:
                assert status == 400 and body["error"]["code"] == "context_length_exceeded"
                assert str(limit) in body["error"]["message"]
            reader.cancel()
            stream.close()
            return arrivals, t0, t1

    arrivals, t0, t1 = asyncio.run(go())
    assert t1 - t0 > 0.15, "tokenizing 3 x 170k tokens was too quick to prove anything"
    # Had tokenization blocked the loop, no chunk could arrive in the window's first half.
    early = [t for t in arrivals if t0 + 0.02 < t < t0 + (t1 - t0) / 2]
    assert len(early) >= 2, (len(arrivals), t1 - t0)
    live.wait_idle(timeout=5)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=3),
    max_leaves=8,
)
FIELDS = st.sampled_from([
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logprobs", "top_logprobs", "ignore_eos",
    "min_tokens", "n", "stream", "stream_options", "tools", "response_format",
    "return_token_ids", "echo", "best_of", "suffix", "add_generation_prompt", "prompt_logprobs",
])
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "bot", 3]),
                                  "content": JSON | st.text(max_size=10)})
BODY = st.dictionaries(FIELDS, JSON | st.lists(MESSAGE, max_size=2) | st.integers(-3, 4),
                       max_size=6)


@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from([CHAT, "/v1/completions", "/tokenize", "/detokenize"]),
       body=BODY | JSON | BODY.map(lambda d: {"messages": MSGS, "prompt": "hi", "max_tokens": 2,
                                               **d}),
       junk=st.binary(max_size=20))
def test_fuzz_never_500(live: Live, path: str, body: Any, junk: bytes) -> None:
    async def go() -> None:
        timeout = aiohttp.ClientTimeout(total=1.5)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            for data in (json.dumps(body).encode(), junk):  # json: ints beyond 64 bits too
                try:
                    async with s.post(live.url + path, data=data) as resp:
                        raw = await resp.read()
                        assert resp.status < 500, raw
                        if resp.status >= 400:
                            assert "error" in orjson.loads(raw)
                except TimeoutError:
                    pass  # a valid long generation; the disconnect aborts it

    asyncio.run(go())
    assert live.state.health_problem() is None

