"""HTTP connections: how long one may sit idle, and what a request gets that
aiohttp's parser refuses.

- An idle connection closes after --http-keepalive-timeout: before its first
  request, between requests, and while a request's headers trickle in (aiohttp's
  keep-alive timer covers the last two; ``_Protocol`` arms the first itself,
  which aiohttp only does from 3.14 on). A request's body has
  --request-read-timeout (``body.read_json``: 408).
- A request the parser refuses (a header line over 8,190 bytes, a malformed
  request line) is answered 400 with an error object, Anthropic's shape when the
  request line named a /v1/messages route, and one log line: aiohttp's own answer
  is plain text and its log a traceback. An HTTP/2 connection preface (sglang-router
  probes each worker for gRPC beside HTTP/1.1 when it registers it) is an info line.

aiohttp has no public hook for either, so ``Runner`` builds the same ``web.Server``
an AppRunner builds, with a protocol factory returning ``_Protocol``.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

from aiohttp import web, web_protocol
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.web_request import BaseRequest

from ftserve.api.errors import ANTHROPIC_PREFIX, APIError

log = logging.getLogger("ftserve.api")

# The start of a request's first segment: method, path, version.
_REQUEST_LINE = re.compile(rb"[A-Z]{3,7} (/[^ \r\n]{0,200})")


class _Protocol(web_protocol.RequestHandler):
    _path = "/"  # the last request line's path seen on this connection
    _served = False  # a request's headers arrived (the request factory ran)
    _first: asyncio.TimerHandle | None = None
    _http2 = False  # the connection opened with HTTP/2's preface

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        loop = asyncio.get_running_loop()
        self._first = loop.call_later(self.keepalive_timeout, self._close_if_unused)

    def _close_if_unused(self) -> None:
        if not self._served:
            self.force_close()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._first is not None:
            self._first.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # Which API's error shape a refused request gets: a client writes a request's
        # head in one go, so a segment that starts a request holds its path.
        match = _REQUEST_LINE.match(data)
        if match is not None:
            self._path = match.group(1).decode("latin-1")
        elif data.startswith(b"PRI * HTTP/2.0"):
            self._http2 = True
        super().data_received(data)

    def handle_error(self, request: BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)
        if self._http2:
            log.info("closed an HTTP/2 connection from %s (a router probing for gRPC?): this "
                     "server speaks HTTP/1.1", request.remote)
            self.force_close()
            return web.Response(status=400)
        if isinstance(exc, LineTooLong):
            # Its message quotes the line, which may be a credential: not in the log.
            reason = "a request header or the request line is longer than the server's limit"
        else:
            reason = (exc.message or type(exc).__name__).strip().split("\n")[0][:200]
        log.warning("refused an HTTP request from %s that did not parse: %s",
                    request.remote, reason)
        err = APIError(status, f"malformed HTTP request: {reason}", code="bad_http_request")
        resp = err.response(anthropic=self._path.startswith(ANTHROPIC_PREFIX))
        resp.force_close()
        return resp


class _Server(web.Server):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        make = self.request_factory

        def factory(message: Any, payload: Any, protocol: Any, writer: Any,
                    task: Any) -> BaseRequest:
            protocol._served = True  # headers complete: the body has its own timeout
            return make(message, payload, protocol, writer, task)

        self.request_factory = factory

    def __call__(self) -> web_protocol.RequestHandler:
        return _Protocol(self, loop=self._loop, **self._kwargs)


class Runner(web.AppRunner):
    """An AppRunner whose connections are ``_Protocol``s."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        return _Server(server.request_handler, request_factory=server.request_factory,
                       handler_cancellation=server.handler_cancellation,
                       loop=asyncio.get_running_loop(), **server._kwargs)
