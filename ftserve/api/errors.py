"""OpenAI-style error objects and the middleware that guarantees every failure is one.

Every non-2xx answer has the body ``{"error": {"message", "type", "param", "code"}}``;
on Anthropic's routes (under ``ANTHROPIC_PREFIX``) it is Anthropic's
``{"type": "error", "error": {"type", "message"}}`` instead (``anthropic_type``).
Bad input must never become a 500: handlers raise ``APIError`` for anything the
client did wrong, and the middleware turns stray aiohttp HTTP exceptions (404 route,
405 method, 413 body) into the same shape.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

log = logging.getLogger("ftserve.api")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# The Anthropic Messages API's routes (anthropic_api.py): their errors take its shape.
ANTHROPIC_PREFIX = "/v1/messages"


class APIError(Exception):
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
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.close = close

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


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, why: str = "is not supported") -> APIError:
    return APIError(400, f"'{param}' {why}", param=param, code="unsupported_parameter")


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
    except APIError as err:
        return err.response(anthropic)
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


def renamed(err: APIError, names: dict[str, str]) -> APIError:
    """An error the chat path raised about a field another API spells otherwise
    (``names``: chat field -> the client's), naming it as the client sent it."""
    name = names.get(err.param or "")
    if name is None:
        return err
    message = err.message.replace(f"'{err.param}'", f"'{name}'")
    return APIError(err.status, message, err_type=err.err_type, param=name, code=err.code,
                    headers=err.headers, close=err.close)
