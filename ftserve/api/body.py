"""A request's body: read within its time and size limits, decoded, parsed as JSON
and checked for depth, before any protocol looks at it."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

from ftserve.api import workers
from ftserve.api.errors import APIError
from ftserve.api.state import STATE_KEY
from ftserve.chat import limits
from ftserve.chat.errors import bad_request


async def read_json(request: web.Request) -> Any:
    """The body as JSON. It must arrive within --request-read-timeout (408), decode
    as its Content-Encoding says (gzip / deflate that does not: 400) and stay within
    --max-body-bytes (aiohttp's 413). A body past workers.HEAVY_BODY_BYTES moves the
    request's blocking work to the heavy lane, its JSON parsing included."""
    timeout = request.app[STATE_KEY].cfg.request_read_timeout
    try:
        async with asyncio.timeout(timeout):
            raw = await request.read()
    except TimeoutError:
        _abandon_body(request)
        raise APIError(408, f"the request body did not arrive within {timeout:g} s "
                       "(the server's --request-read-timeout)", code="request_timeout",
                       close=True) from None
    except web.RequestPayloadError as err:
        _abandon_body(request)
        cause = err.args[0] if err.args else err
        raise APIError(400, "the request body could not be read: "
                       f"{getattr(cause, 'message', cause)}", code="invalid_body",
                       close=True) from None
    try:
        if workers.mark_heavy(len(raw)):
            # Megabytes of JSON take tens of milliseconds to parse and walk: not on the loop.
            return await asyncio.get_running_loop().run_in_executor(None, _parse_checked, raw)
        return _parse_checked(raw)
    except orjson.JSONDecodeError as err:
        raise bad_request(f"invalid JSON body: {err}") from None


def _parse_checked(raw: bytes) -> Any:
    body = orjson.loads(raw)
    limits.check_body(body)  # a 400 naming the field that nests too deep
    return body


def _abandon_body(request: web.Request) -> None:
    """The rest of the body will not be read: aiohttp would otherwise read on after
    the answer (and, for a body that failed to decode, log the failure again as an
    unhandled exception and reset the connection before the client reads the answer).
    The answer closes the connection instead (APIError ``close``)."""
    request.content.feed_eof()
