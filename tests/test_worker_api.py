"""What a cache-aware router asks of a worker (server/worker_api.py), over real HTTP on the
demo server. tests/test_fleet.py drives the same endpoints through the real router."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import time
from typing import Any

import aiohttp
import orjson
import pytest

from tests.server_harness import TEST_SERVER, Live

CHAT = {"model": "ftserve-demo", "messages": [{"role": "user", "content": "Tell me a story."}]}


def _get(url: str, method: str = "GET", body: Any = None) -> tuple[int, Any, Any]:
    async def go() -> tuple[int, Any, Any]:
        async with aiohttp.ClientSession() as s, s.request(method, url, json=body) as resp:
            return resp.status, await resp.json(), resp.headers

    return asyncio.run(go())


async def _first_token(resp: aiohttp.ClientResponse) -> None:
    """Read the stream until a chunk carries text: the request runs (300 tokens on the CPU
    take a while; the first chunk, the role, comes before the engine ran)."""
    while True:
        line = await resp.content.readline()
        assert line, "the stream ended before a token"
        line = line.strip()
        if line.startswith(b"data: {") and orjson.loads(line[6:])["choices"][0]["delta"].get("content"):
            return


def test_server_and_model_info_name_the_model_the_router_routes(live: Live) -> None:
    status, info, _ = _get(live.url + "/get_server_info")
    assert status == 200
    # sglang-router asks /server_info first and /get_server_info after a 404: both answer.
    assert _get(live.url + "/server_info")[1] == info
    _, models, _ = _get(live.url + "/v1/models")
    # served_model_name becomes the router's model id (its own /v1/models lists it).
    assert info["served_model_name"] == models["data"][0]["id"] == "ftserve-demo"
    assert info["dp_size"] == 1 and info["context_length"] == live.engine.max_model_len
    assert info["max_total_tokens"] == live.engine.summary["kv_tokens"] > 0
    assert info["max_running_requests"] == live.engine.max_running_requests
    status, model, _ = _get(live.url + "/get_model_info")
    assert status == 200 and _get(live.url + "/model_info")[1] == model
    assert model["model_type"] == live.engine.model_config.model_type
    assert model["architectures"] == [live.engine.model_config.architecture]
    assert model["is_generation"] is True and model["model_path"] == live.engine.model_dir


def test_get_load_counts_a_running_request(live: Live) -> None:
    async def go() -> tuple[list[Any], list[Any]]:
        body = {**CHAT, "stream": True, "max_tokens": 300, "ignore_eos": True}
        async with aiohttp.ClientSession() as s:
            async with s.post(live.url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                await _first_token(resp)
                async with s.get(live.url + "/get_load") as r:
                    during = await r.json()
                await resp.read()
            live.wait_idle()
            async with s.get(live.url + "/get_load") as r:
                after = await r.json()
        return during, after

    during, after = asyncio.run(go())
    # sglang's shape: one entry per data-parallel rank; a replica is one rank.
    assert len(during) == 1 and during[0]["dp_rank"] == 0
    assert during[0]["num_running_reqs"] == during[0]["num_reqs"] == 1
    assert during[0]["num_tokens"] >= live.engine.summary["page_size"]
    assert after == [{"dp_rank": 0, "num_reqs": 0, "num_running_reqs": 0, "num_waiting_reqs": 0,
                      "num_tokens": 0, "kv_cache_usage": 0.0}]


def test_flush_cache_empties_the_prefix_cache_and_refuses_while_in_use(live: Live) -> None:
    status, _, _ = _get(live.url + "/v1/chat/completions", "POST", {**CHAT, "max_tokens": 4})
    assert status == 200
    live.wait_idle()
    assert live.engine.stats().kv_pages_cached > 0
    status, body, _ = _get(live.url + "/flush_cache", "POST")
    assert status == 200 and body["success"] is True
    assert live.engine.stats().kv_pages_cached == 0

    async def while_streaming() -> tuple[int, Any]:
        # A prompt of several pages: a running request locks its full prompt pages.
        long = [{"role": "user", "content": "Tell me a long story about dragons. " * 20}]
        body = {**CHAT, "messages": long, "stream": True, "max_tokens": 300, "ignore_eos": True}
        async with aiohttp.ClientSession() as s:
            async with s.post(live.url + "/v1/chat/completions", json=body) as resp:
                await _first_token(resp)
                async with s.post(live.url + "/flush_cache") as r:
                    out = r.status, await r.json()
                await resp.read()
        return out

    status, err = asyncio.run(while_streaming())
    assert status == 409 and err["error"]["code"] == "cache_in_use"


def test_health_generate_runs_a_token_through_the_engine(live: Live) -> None:
    before = live.engine.stats().generation_tokens_total
    status, body, _ = _get(live.url + "/health_generate")
    assert status == 200 and body == {"status": "ok"}
    assert live.engine.stats().generation_tokens_total > before


def test_every_response_names_its_replica(live: Live) -> None:
    port = live.server.port
    default = f"{socket.gethostname()}:{port}"
    for method, path, body in (("GET", "/health", None), ("GET", "/v1/models", None),
                               ("GET", "/no-such-route", None),
                               ("POST", "/v1/chat/completions", {**CHAT, "max_tokens": 2})):
        _, _, headers = _get(live.url + path, method, body)
        assert headers["X-Ftserve-Replica"] == default, path

    async def stream(url: str) -> str:
        body = {**CHAT, "stream": True, "max_tokens": 2}
        async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json=body) as r:
            await r.read()
            return r.headers["X-Ftserve-Replica"]

    assert asyncio.run(stream(live.url)) == default
    named = live.listen(dataclasses.replace(TEST_SERVER, replica_id="replica-7"))
    assert asyncio.run(stream(named)) == "replica-7"


def test_http2_preface_is_closed_with_one_info_line(live: Live,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    # sglang-router probes each worker for gRPC when it registers it: HTTP/2's preface.
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")
    with caplog.at_level(logging.INFO, logger="ftserve.api"):
        with socket.create_connection(("127.0.0.1", live.server.port), timeout=5) as sock:
            sock.sendall(preface)
            got = b""
            while chunk := sock.recv(4096):  # the server closes the connection
                got += chunk
        deadline = time.monotonic() + 5
        while not any("HTTP/2" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.02)
    assert got == b""  # closed: an HTTP/1.1 answer means nothing to an HTTP/2 client
    mine = [r for r in caplog.records if r.name == "ftserve.api"]
    assert [r.levelname for r in mine] == ["INFO"], caplog.text
