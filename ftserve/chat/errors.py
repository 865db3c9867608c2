"""A request the chat core cannot serve as given: what the client must change.

The core knows no protocol: it says what is wrong and which field the client sent it
in (``param``, as that client named it); the HTTP layer (ftserve/api/errors.py) gives
it its protocol's error shape and status.
"""

from __future__ import annotations


class RequestError(Exception):
    """A bad request (400 unless ``status`` says otherwise), naming the field at fault."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int = 400) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def bad_request(message: str, param: str | None = None, code: str | None = None) -> RequestError:
    return RequestError(message, param, code)


def unsupported(param: str, why: str = "is not supported") -> RequestError:
    """A field the server understands but cannot honour (code ``unsupported_parameter``)."""
    return RequestError(f"'{param}' {why}", param, "unsupported_parameter")
