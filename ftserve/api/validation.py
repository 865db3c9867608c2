"""Request bodies as declared pydantic models, and the one translation of a
validation error into the 400 a client reads.

Each protocol declares its bodies in its own ``models.py``. What they share:

- ``Body``: strict types (a bool is not a number, a string is not a list, 1.0 is
  not an integer), no infinities, unknown fields ignored; JSON null is "not given"
  wherever a field's type allows None, which most do.
- The client sees the first error, in field order, worded by ``request_error``:
  each pydantic error type has its sentence ("'temperature' must be a number");
  a field whose wording is special says it itself (``reject``, ``worded``,
  ``refused``, ``member``).

A wording is a template; these marks are filled from where the error is, spelled
as the client spells the path::

    {at}   the failing value's path        messages[0].content
    {up}   its parent's path               messages[0]
    {upN}  N levels up (N = 2, 3)          {up3} of messages[0].tool_calls[1].function.arguments
                                           is messages[0].tool_calls
    {key}  the last component              content
    {value} the value the client sent

``param`` is a template too (None: the error names no field).

Most wordings are checked natively (``Worded``, ``Int``): a valid value costs no
Python call; a wording that depends on what sits inside the value runs in Python.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Annotated, Any, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    GetCoreSchemaHandler,
    ValidationError,
    ValidationInfo,
    WrapValidator,
)
from pydantic_core import CoreSchema, PydanticCustomError, core_schema

from ftserve.chat.errors import RequestError, bad_request

M = TypeVar("M", bound=BaseModel)

_OURS = "ftserve"  # the error type of wordings given here
_GENERIC = {
    "missing": "'{at}' is required",
    "bool_type": "'{at}' must be a boolean",
    "int_type": "'{at}' must be an integer",
    "float_type": "'{at}' must be a number",
    "finite_number": "'{at}' must be a number",
    "string_type": "'{at}' must be a string",
    "dict_type": "'{at}' must be an object",
    "model_type": "'{at}' must be an object",
    "list_type": "'{at}' must be a list",
}


class Body(BaseModel):
    """A request body or a part of one (see the module docstring)."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


def parse(model: type[M], raw: Any) -> M:
    """``raw`` (a parsed JSON body) validated as ``model``; a RequestError otherwise."""
    if not isinstance(raw, dict):
        raise bad_request("request body must be a JSON object")
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        raise request_error(err) from None


def request_error(err: ValidationError) -> RequestError:
    """The client's 400 for a validation error: its first error, worded."""
    first = err.errors(include_url=False)[0]
    loc = tuple(first["loc"])
    ctx = first.get("ctx") or {}
    if first["type"] == _OURS:
        say, param, code = ctx["say"], ctx["param"], ctx["code"]
    else:
        say, param, code = _GENERIC.get(first["type"], "'{at}' is invalid"), "{at}", None
    value = first.get("input")
    return RequestError(_fill(say, loc, value),
                        None if param is None else _fill(param, loc, value), code)


def path(loc: Iterable[int | str]) -> str:
    """('messages', 0, 'content') -> "messages[0].content"."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _fill(template: str, loc: tuple[int | str, ...], value: Any) -> str:
    marks = {"{at}": loc, "{up}": loc[:-1], "{up2}": loc[:-2], "{up3}": loc[:-3]}
    for mark, where in marks.items():
        if mark in template:
            template = template.replace(mark, path(where))
    if "{key}" in template:
        template = template.replace("{key}", str(loc[-1]) if loc else "")
    return template.replace("{value}", str(value)) if "{value}" in template else template


# --- wordings a field gives itself --------------------------------------------------


def reject(say: str, param: str | None = "{at}", code: str | None = None) -> PydanticCustomError:
    """An error worded ``say`` (a template: see the module docstring)."""
    return PydanticCustomError(_OURS, "{say}", {"say": say, "param": param, "code": code})


class Worded:
    """Any error of the value's validation, its parts' included, is worded ``say``
    (checked natively: no Python call for a valid value)."""

    def __init__(self, say: str, param: str | None = "{at}", code: str | None = None) -> None:
        self._ctx = {"say": say, "param": param, "code": code}

    def __get_pydantic_core_schema__(self, source: Any,
                                     handler: GetCoreSchemaHandler) -> CoreSchema:
        return _custom(handler(source), self._ctx)


def _custom(schema: CoreSchema, ctx: dict[str, Any]) -> CoreSchema:
    return core_schema.custom_error_schema(schema, custom_error_type=_OURS,
                                           custom_error_message="{say}", custom_error_context=ctx)


def worded(say: str, param: str | None = "{at}", code: str | None = None,
           deep: bool = False) -> WrapValidator:
    """An error of the value's own type check is worded ``say``; ``deep``: so is any
    error inside it (one sentence for a value that is not of its shape), except one
    a part of it worded itself (which needs a Python call: ``Worded`` where no part
    words its own errors)."""
    def wrap(value: Any, handler: Callable[[Any], Any]) -> Any:
        try:
            return handler(value)
        except ValidationError as err:
            first = err.errors(include_url=False, include_input=False)[0]
            if first["type"] == _OURS or (not deep and first["loc"]):
                raise
            raise reject(say, param, code) from None

    return WrapValidator(wrap)


def refused(why: str = "is not supported") -> AfterValidator:
    """A field the server understands and cannot honour: given (not null), a 400
    with code ``unsupported_parameter``."""
    def check(value: Any) -> Any:
        if value is not None:
            raise reject("'{at}' " + why, code="unsupported_parameter")
        return value

    return AfterValidator(check)


def member(choices: tuple[Any, ...], say: str, param: str | None = "{at}",
           code: str | None = None) -> AfterValidator:
    """The value must be one of ``choices`` (compared as given: 1 is not "1")."""
    allowed = {(type(c), c) for c in choices}

    def check(value: Any) -> Any:
        try:
            ok = (type(value), value) in allowed
        except TypeError:  # unhashable: a list or an object
            ok = False
        if not ok:
            raise reject(say, param, code)
        return value

    return AfterValidator(check)


def lenient(kind: type) -> BeforeValidator:
    """A value not of ``kind`` counts as not given (fields OpenAI-compatible servers
    read when they are of their type and ignore otherwise)."""
    return BeforeValidator(lambda value: value if isinstance(value, kind) else None)


def falsy_is_absent() -> BeforeValidator:
    """An empty or false value counts as not given."""
    return BeforeValidator(lambda value: value or None)


def non_empty(say: str, param: str | None = "{at}") -> AfterValidator:
    """An empty string (or list) is worded ``say``."""
    def check(value: Any) -> Any:
        if not value:
            raise reject(say, param)
        return value

    return AfterValidator(check)


class _IntIn:
    def __init__(self, lo: int | None, hi: int | None) -> None:
        self.lo, self.hi = lo, hi

    def __get_pydantic_core_schema__(self, source: Any,
                                     handler: GetCoreSchemaHandler) -> CoreSchema:
        bounds = f"[{'-inf' if self.lo is None else self.lo}, {'inf' if self.hi is None else self.hi}]"
        return core_schema.chain_schema([
            _custom(core_schema.int_schema(strict=True),
                    {"say": "'{at}' must be an integer", "param": "{at}", "code": None}),
            _custom(core_schema.int_schema(ge=self.lo, le=self.hi),
                    {"say": f"'{{at}}' must be in {bounds}, got {{value}}", "param": "{at}",
                     "code": None}),
        ])


def Int(lo: int | None, hi: int | None) -> Any:  # noqa: N802 (a type, as pydantic's are)
    """A strict integer in [lo, hi] (None: unbounded that side), checked natively."""
    return Annotated[int, _IntIn(lo, hi)]


def unless_given(other: str) -> WrapValidator:
    """The field is read only when ``other`` (declared before it) was not given."""
    def wrap(value: Any, handler: Callable[[Any], Any], info: ValidationInfo) -> Any:
        return None if info.data.get(other) is not None else handler(value)

    return WrapValidator(wrap)


def _text_passes(value: Any, handler: Callable[[Any], Any]) -> Any:
    return value if isinstance(value, str) else handler(value)


def text_parts(kinds: tuple[str, ...], media: tuple[str, ...]) -> Any:
    """A string, or a list of text parts (``type`` one of ``kinds``, each with
    ``text``) joined by newlines; a part of a type in ``media`` is a 400 saying the
    model reads text only (Anthropic's and the Responses API's content)."""
    def part(value: Any) -> str:
        kind = value.get("type") if isinstance(value, dict) else None
        if kind in media:
            raise reject(f"'{{at}}.type' {kind!r} is not supported: this server's model reads "
                         "text only", "{at}.type", "unsupported_parameter")
        if kind not in kinds:
            raise reject(f"'{{at}}.type' must be one of {', '.join(kinds)}; got {kind!r}",
                         "{at}.type")
        text = value.get("text")
        if not isinstance(text, str):
            raise reject("'{at}.text' must be a string", "{at}.text")
        return text

    return Annotated[list[Annotated[Any, AfterValidator(part)]],
                     worded("'{at}' must be a string or a list of text parts"),
                     AfterValidator("\n".join), WrapValidator(_text_passes)]
