"""The server against hostile or careless traffic, over real HTTP (issue 29): bursts
past the queue limit, huge bodies and /tokenize calls starving small requests,
bodies that do not decode, oversized headers, idle and slow connections, clients
that leave early, a drain that times out, and /metrics behind the key."""

from __future__ import annotations

import asyncio
import dataclasses
import gzip
import logging
import socket
import threading
import time
import zlib
from collections.abc import Iterator
from typing import Any

import aiohttp
import orjson
import pytest

from ftserve.api import sse
from ftserve.api.serve import drain
from ftserve.config import ServerConfig
from tests.server_harness import TEST_ENGINE, TEST_SERVER, Live, start_live, stop_live

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]
LONG_STREAM = {"messages": MSGS, "max_tokens": 400, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    server = start_live()
    yield server
    stop_live(server)


async def _post(s: aiohttp.ClientSession, url: str, body: Any,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with s.post(url, data=data, headers=headers) as resp:
        raw = await resp.read()
        return resp.status, dict(resp.headers), orjson.loads(raw) if raw else None


def _finished(live: Live, reason: str) -> float:
    """ftserve_requests_finished_total{reason=...} from the live server's registry."""
    text = live.state.metrics.render().decode()
    line = next(x for x in text.splitlines()
                if x.startswith(f'ftserve_requests_finished_total{{reason="{reason}"}}'))
    return float(line.split(" ")[1])


# --- 4: the queue limit holds against a burst ----------------------------------------


def test_burst_gets_503_past_running_plus_queued(live: Live) -> None:
    """200 requests at once against 2 running + 2 queued: 4 get in, the rest 503 +
    Retry-After (the engine's waiting count lags, so it let a burst through); while
    those 4 run, Anthropic's route answers 529 overloaded_error."""
    live.wait_idle()
    limit = TEST_ENGINE.max_running_requests + TEST_SERVER.max_queued_requests
    done_before = _finished(live, "length")

    async def go() -> None:
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as s:
            async def one() -> tuple[int, dict[str, str], Any, aiohttp.ClientResponse]:
                resp = await s.post(live.url + CHAT, json=LONG_STREAM)
                body = None if resp.status == 200 else await resp.json()
                return resp.status, dict(resp.headers), body, resp

            results = await asyncio.gather(*[one() for _ in range(200)])
            # A stream that ended during the burst freed its place for a later arrival.
            ended = _finished(live, "length") - done_before
            oks = [r for r in results if r[0] == 200]
            assert limit <= len(oks) <= limit + ended, (len(oks), ended)
            for status, headers, body, _ in results:
                if status != 200:
                    assert status == 503 and int(headers["Retry-After"]) >= 1, (status, body)
                    assert body["error"]["code"] == "overloaded", body
            assert live.state.door.count == limit
            msg = {"model": "ftserve-demo", "max_tokens": 4, "messages": MSGS}
            for _ in range(3):
                status, headers, body = await _post(s, live.url + "/v1/messages", msg)
                assert status == 529 and int(headers["Retry-After"]) >= 1, (status, body)
                assert body["type"] == "error" and body["error"]["type"] == "overloaded_error"
            for *_, resp in results:
                resp.close()

    asyncio.run(go())
    live.wait_idle(timeout=10)
    deadline = time.monotonic() + 5
    while live.state.door.count:  # every place given back as its handler ends
        assert time.monotonic() < deadline, live.state.door.count
        time.sleep(0.02)


# --- 5: amplification ----------------------------------------------------------------


def test_huge_tokenize_calls_do_not_starve_a_small_request(live: Live) -> None:
    """Four /tokenize calls of ~1 MB each (more than the context: a 400, the reply
    capped) keep tokenizer threads busy for a second or more; a small chat request
    sent meanwhile finishes before any of them, as it does not wait for their threads."""
    lorem = "lorem ipsum dolor sit amet, " * 38000  # 1.06 MB (a heavy body), ~380k tokens
    limit = live.engine.max_model_len

    async def go() -> tuple[float, list[float]]:
        async with aiohttp.ClientSession() as s:
            async def big(i: int) -> float:
                status, _, body = await _post(s, live.url + "/tokenize", {"prompt": f"{i} {lorem}"})
                assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
                assert str(limit) in body["error"]["message"]
                return time.monotonic()

            async def small() -> float:
                await asyncio.sleep(0.3)  # the big ones are in their threads by now
                status, _, body = await _post(s, live.url + CHAT, {"messages": MSGS, "max_tokens": 1})
                assert status == 200, body
                return time.monotonic()

            *bigs, hi = await asyncio.gather(*[big(i) for i in range(4)], small())
            return hi, bigs

    hi, bigs = asyncio.run(go())
    assert hi < min(bigs), (hi, bigs)
    live.wait_idle()


def test_tokenize_and_detokenize_replies_are_bounded(live: Live) -> None:
    limit = live.engine.max_model_len

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            status, _, ok = await _post(s, live.url + "/tokenize", {"prompt": "hello " * 50})
            assert status == 200 and ok["count"] == len(ok["tokens"]) <= limit
            status, _, err = await _post(s, live.url + "/tokenize", {"prompt": "hello " * 2000})
            assert status == 400 and err["error"]["param"] == "prompt", err
            assert str(limit) in err["error"]["message"]
            status, _, err = await _post(s, live.url + "/detokenize", {"tokens": [5] * (limit + 1)})
            assert status == 400 and err["error"]["param"] == "tokens", err

    asyncio.run(go())


def test_default_body_limit_refuses_17_mib(live: Live) -> None:
    """The default --max-body-bytes holds a 1M-token conversation (about 4 MB of
    text), not 32 MiB: a 17 MiB body is a 413 before anything parses it."""
    base = live.listen(dataclasses.replace(TEST_SERVER, max_body_bytes=ServerConfig().max_body_bytes))
    big = b'{"prompt": "' + b"a" * (17 << 20) + b'"}'

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            status, _, body = await _post(s, base + "/v1/completions", big)
            assert status == 413 and body["error"]["code"] == "request_too_large", body

    asyncio.run(go())


# --- 6: bodies that do not decode, headers aiohttp refuses --------------------------


def test_content_encoding_that_does_not_decode_is_a_400(live: Live) -> None:
    body = orjson.dumps({"messages": MSGS, "max_tokens": 1})

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            for enc, data in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body))):
                status, _, ok = await _post(s, live.url + CHAT, data, {"Content-Encoding": enc})
                assert status == 200, ok  # a body that does decode still works
                status, _, err = await _post(s, live.url + CHAT, b"not compressed at all",
                                             {"Content-Encoding": enc})
                assert status == 400 and err["error"]["code"] == "invalid_body", err
                assert enc in err["error"]["message"]
            status, _, err = await _post(s, live.url + "/v1/messages", b"\x00garbage",
                                         {"Content-Encoding": "gzip"})
            assert status == 400 and err["error"]["type"] == "invalid_request_error", err

    asyncio.run(go())


def _raw(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """Send ``data`` on a fresh connection; everything the server sends until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
        return out


def _json_body(raw: bytes) -> tuple[int, Any]:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"application/json" in head, head
    return int(head.split(b" ")[1]), orjson.loads(body)


def test_oversized_header_is_an_error_object_and_one_log_line(
        live: Live, caplog: pytest.LogCaptureFixture) -> None:
    big = b"X-Big: " + b"a" * 9000 + b"\r\n"
    with caplog.at_level(logging.INFO):
        status, err = _json_body(_raw(live.server.port, b"POST " + CHAT.encode()
                                      + b" HTTP/1.1\r\nHost: x\r\n" + big + b"\r\n"))
        assert status == 400 and set(err["error"]) == {"message", "type", "param", "code"}, err
        status, err = _json_body(_raw(live.server.port, b"POST /v1/messages HTTP/1.1\r\n"
                                      b"Host: x\r\n" + big + b"\r\n"))
        assert status == 400 and err["type"] == "error", err
        assert err["error"]["type"] == "invalid_request_error"
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    assert b"aaaa" not in caplog.text.encode()  # the header's value stays out of the log


# --- 7: idle and slow connections, clients that leave, drains that time out ---------


def test_idle_and_slow_connections_are_closed(live: Live) -> None:
    cfg = dataclasses.replace(TEST_SERVER, http_keepalive_timeout=0.5, request_read_timeout=0.5)
    port = int(live.listen(cfg).rsplit(":", 1)[1])

    async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes:
        return await asyncio.wait_for(reader.read(), seconds)  # b"" + EOF once closed

    async def never_asks() -> None:
        reader, _ = await asyncio.open_connection("127.0.0.1", port)
        assert await closed_within(reader, 3) == b""

    async def idle_after_one() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await closed_within(reader, 3)).startswith(b"HTTP/1.1 200")

    async def trickles_headers() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        t0 = time.monotonic()
        try:  # a header every 0.2 s: never done, never quiet for the timeout
            while not reader.at_eof() and time.monotonic() < t0 + 3:
                await asyncio.sleep(0.2)
                writer.write(b"X-Slow: 1\r\n")
                await writer.drain()
                await asyncio.wait_for(reader.read(1), 0.01)
        except (ConnectionError, TimeoutError):
            pass
        assert time.monotonic() < t0 + 3, "a connection trickling headers stayed open"

    async def dribbles_body() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Length: 100\r\n\r\n{\"mess")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 3)
        assert head.startswith(b"HTTP/1.1 408"), head
        writer.close()

    async def go() -> None:
        await asyncio.gather(never_asks(), idle_after_one(), trickles_headers(), dribbles_body())

    asyncio.run(go())


def test_client_gone_before_headers_is_one_log_line(
        live: Live, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The race where the client's connection closes before a stream's headers go
    out (the transport is closing, the handler not yet cancelled): held open here
    until the client has gone, then the headers are written."""
    real = sse.open_stream
    waiting = threading.Event()

    async def late(request: Any) -> Any:
        waiting.set()
        while request.transport is not None and not request.transport.is_closing():
            await asyncio.sleep(0)
        return await real(request)

    monkeypatch.setattr(sse, "open_stream", late)
    body = orjson.dumps(LONG_STREAM)
    with caplog.at_level(logging.INFO, logger="ftserve.api"):
        with socket.create_connection(("127.0.0.1", live.server.port)) as sock:
            sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                         % (CHAT.encode(), len(body), body))
            assert waiting.wait(10)
        deadline = time.monotonic() + 5
        while "client gone" not in caplog.text:
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.02)
    assert not [r for r in caplog.records if r.exc_info], caplog.text
    live.wait_idle()


def test_drain_timeout_ends_streams_with_a_standard_reason(
        live: Live, caplog: pytest.LogCaptureFixture) -> None:
    """A drain that times out ends what still runs: the chat stream finishes with
    "length" (not "abort", which no OpenAI client knows), the Anthropic one with
    stop_reason "max_tokens", and the log says so."""
    base = live.listen(dataclasses.replace(TEST_SERVER, drain_timeout=0.3))
    server = live.extra[-1]
    anthropic = {"model": "ftserve-demo", "max_tokens": 400, "messages": MSGS, "stream": True,
                 "ignore_eos": True}

    async def read_all(resp: aiohttp.ClientResponse) -> list[bytes]:
        frames = []
        while frame := await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 20):
            frames.append(frame)
            if frame == sse.DONE or b"message_stop" in frame:
                return frames
        return frames

    async def go() -> tuple[list[bytes], list[bytes]]:
        async with aiohttp.ClientSession() as s:
            chat = await s.post(base + CHAT, json=LONG_STREAM)
            msgs = await s.post(base + "/v1/messages", json=anthropic)
            assert chat.status == 200 and msgs.status == 200
            readers = [asyncio.ensure_future(read_all(r)) for r in (chat, msgs)]
            await asyncio.to_thread(live.call, drain(server, 0.3))
            chat_frames, msg_frames = await asyncio.gather(*readers)
            return chat_frames, msg_frames

    with caplog.at_level(logging.WARNING, logger="ftserve.api"):
        chat_frames, msg_frames = asyncio.run(go())
    live.extra.remove(server)  # drain cleaned it up
    assert chat_frames[-1] == sse.DONE
    reasons = [orjson.loads(f[6:])["choices"][0]["finish_reason"]
               for f in chat_frames[:-1] if f.startswith(b"data: ")]
    assert reasons[-1] == "length" and "abort" not in reasons, reasons
    delta = next(orjson.loads(f.split(b"data: ", 1)[1]) for f in msg_frames
                 if f.startswith(b"event: message_delta"))
    assert delta["delta"]["stop_reason"] == "max_tokens", delta
    assert "drain timeout" in caplog.text and "'length'" in caplog.text
    live.wait_idle()


# --- 8: /metrics behind the key ------------------------------------------------------


def test_metrics_require_key(live: Live) -> None:
    open_base = live.listen(dataclasses.replace(TEST_SERVER, api_key="k"))
    closed = live.listen(dataclasses.replace(TEST_SERVER, api_key="k", metrics_require_key=True))

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            async def get(url: str, key: str | None = None) -> int:
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                async with s.get(url, headers=headers) as resp:
                    return resp.status

            assert await get(open_base + "/metrics") == 200  # scrapers carry no key by default
            assert await get(closed + "/metrics") == 401
            assert await get(closed + "/metrics", "wrong") == 401
            assert await get(closed + "/metrics", "k") == 200
            assert await get(closed + "/health") == 200  # probes still need none

    asyncio.run(go())
