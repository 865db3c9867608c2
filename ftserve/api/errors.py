"""OpenAI-style error objects and the middleware that guarantees every failure is one.

Every non-2xx answer has the body ``{"error": {"message", "type", "param", "code"}}``;
on Anthropic's routes (under ``ANTHROPIC_PREFIX``) it is Anthropic's
``{"type": "error", "error": {"type", "message"}}`` instead (``anthropic_type``).
Bad input must never become a 500: handlers raise ``APIError`` (or the chat core's
``RequestError``, which it extends) for anything the client did wrong, and the
middleware turns stray aiohttp HTTP exceptions (404 route, 405 method, 413 body) into
the same shape.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

from ftserve.chat.errors import RequestError

log = logging.getLogger("ftserve.api")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# The Anthropic Messages API's routes (anthropic/messages.py): their errors take its shape.
ANTHROPIC_PREFIX = "/v1/messages"


class APIError(RequestError):
    """A request failed; maps 1:1 onto an OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        err_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        close: bool = False,
    ) -> None:
        """``close``: the connection closes after this answer (its request's body
        was not read to the end, so the next bytes are no request)."""
        super().__init__(message, param, code, status)
        self.err_type = err_type
        self.headers = headers or {}
        self.close = close

    @classmethod
    def of(cls, err: RequestError) -> APIError:
        """The chat core's error as the HTTP layer answers it."""
        if isinstance(err, APIError):
            return err
        return cls(err.status, err.message, param=err.param, code=err.code,
                   err_type="server_error" if err.status >= 500 else "invalid_request_error")

    def to_dict(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_type(self) -> str:
        """Anthropic's error type for this error. A full queue is its 529
        "overloaded_error" (anthropic_status); a server that cannot serve at all
        (loading, draining, engine stopped) stays a 503 "api_error"."""
        if self.code == "overloaded":
            return "overloaded_error"
        return {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error"}.get(
            self.status, "api_error" if self.status >= 500 else "invalid_request_error")

    def anthropic_status(self) -> int:
        return 529 if self.code == "overloaded" else self.status

    def to_anthropic(self) -> dict[str, object]:
        return {"type": "error", "error": {"type": self.anthropic_type(), "message": self.message}}

    def response(self, anthropic: bool = False) -> web.Response:
        resp = web.Response(
            status=self.anthropic_status() if anthropic else self.status,
            body=orjson.dumps(self.to_anthropic() if anthropic else self.to_dict()),
            content_type="application/json",
            headers=self.headers,
        )
        if self.close:
            resp.force_close()
        return resp


def overloaded(message: str, retry_after: int = 1) -> APIError:
    return APIError(
        503,
        message,
        err_type="server_error",
        code="overloaded",
        headers={"Retry-After": str(retry_after)},
    )


def _from_http_exception(exc: web.HTTPException) -> APIError:
    status = exc.status
    if status == 413:
        return APIError(413, "request body too large", code="request_too_large")
    if status == 404:
        return APIError(404, "not found", code="not_found")
    if status == 405:
        return APIError(405, "method not allowed", code="method_not_allowed")
    err_type = "server_error" if status >= 500 else "invalid_request_error"
    return APIError(status, exc.reason or "error", err_type=err_type)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    anthropic = request.path.startswith(ANTHROPIC_PREFIX)
    try:
        return await handler(request)
    except RequestError as err:
        return APIError.of(err).response(anthropic)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _from_http_exception(exc).response(anthropic)
    except ConnectionError as exc:
        # The client left before the response's headers went out (a cancelled handler
        # is the usual way out; this is the race where the transport closed first).
        # Nothing to answer and nothing wrong here: one line, no traceback.
        log.info("client gone before the response started: %s %s (%s)", request.method,
                 request.path, exc)
        return web.Response(status=499)  # never sent; nginx's "client closed request"
    except Exception:
        # A bug on our side; the client still gets an error object of its API, and
        # the traceback goes to the log where it can be fixed.
        log.exception("unhandled error in %s %s", request.method, request.path)
        return APIError(500, "internal server error", err_type="server_error").response(anthropic)
