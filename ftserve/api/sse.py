"""Server-sent events: ``data: <json>\\n\\n`` frames, ``: keep-alive`` comments, ``[DONE]``
(OpenAI's streams); named ``event: <name>`` frames and ``ping`` events (Anthropic's)."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

KEEPALIVE = b": keep-alive\n\n"
DONE = b"data: [DONE]\n\n"


def frame(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def event(obj: dict[str, Any]) -> bytes:
    """An Anthropic stream event: named by its ``type``, which its data repeats."""
    return b"event: " + obj["type"].encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


PING = event({"type": "ping"})


async def open_stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(
        status=200,
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            # Tell reverse proxies not to buffer, or keep-alives and tokens arrive in bursts.
            "X-Accel-Buffering": "no",
        },
    )
    await resp.prepare(request)
    return resp
