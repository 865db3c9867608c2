"""Qwen3-Coder's XML-style tool calls (format "qwen3_coder" in tool_calls.py)::

    text <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call> <tool_call>...</tool_call> ...

The model writes no JSON: a parameter's value is the raw text between
``<parameter=NAME>`` and ``</parameter>``, less one leading and one trailing
newline, and may span lines. It is typed by that parameter's JSON schema in the
request's ``tools`` (``param_types``): "string" keeps the text; "integer" and
"number" make a JSON number of it if it is one; "boolean" true/false from
"true"/"false" in any case; "null" None from "null"; "object" and "array" the
parsed JSON if it parses as that kind. Anything else stays the text: a schema
whose type list includes "string" (the text is always a valid string, and it
is what the model wrote), a parameter the schema does not name, a function the
request did not offer, and a value that does not convert. A call's
``arguments`` is then ``json.dumps`` of the typed parameters in the order
written (duplicates kept as written).

``XmlToolStream`` keeps tool_calls.py's contract (see its docstring) with the
same public face as ``ToolStream``; ``tool_calls.parse`` runs it over a whole
response, so streamed fragments put together are the whole ``arguments``.
What the contract's terms mean here:

- a call's name is complete at the ``>`` of ``<function=NAME>``; then its
  first delta goes out;
- arguments go out as the parameters arrive: a string value's key with its
  opening quote once the value starts, then its text (JSON-escaped) as it
  arrives, except a held tail that could start ``\\n</parameter>``; any other
  value with its key in one piece once ``</parameter>`` came; the closing
  ``}`` (``{}`` when there were none) at ``</function>``;
- a call cut off (max_tokens) keeps what was sent, plus what arrived of a
  string value (its held tail included); a typed value that never closed is
  not sent;
- anything other than the syntax above (a missing ``</function>`` or
  ``</tool_call>``, a name holding ``<`` or a newline, an empty name, prose
  between or after calls) is a syntax error: whole output is all content, and
  a stream turns it and the rest into content per tool_calls.py.
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Callable, Mapping
from typing import Any

from ftserve.chat.tool_stream_base import MarkedStream, held

MARKER = "<tool_call>"
_CLOSE = "</tool_call>"
_FUNC, _FUNC_END = "<function=", "</function>"
_PARAM, _PARAM_END = "<parameter=", "</parameter>"
_VALUE_ENDS = ("\n" + _PARAM_END, _PARAM_END)  # a value's end, with its newline or without
_WS = " \t\r\n"
_BAD = object()

# function name -> parameter name -> the JSON schema types it may take (in schema order)
ParamTypes = Mapping[str, Mapping[str, tuple[str, ...]]]


def schema_types(schema: Any) -> tuple[str, ...]:
    """The JSON types a parameter's schema names (its "type", or its anyOf / oneOf's)."""
    if not isinstance(schema, Mapping):
        return ()
    kind = schema.get("type")
    if isinstance(kind, str):
        return (kind,)
    if isinstance(kind, list):
        return tuple(k for k in kind if isinstance(k, str))
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return tuple(k for sub in schema[key] for k in schema_types(sub))
    return ()


def param_types(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, tuple[str, ...]]]:
    """The parameter types of each offered function, from validated ``tools``
    (as the request offers them): what ``typed`` converts a raw value by."""
    out: dict[str, dict[str, tuple[str, ...]]] = {}
    for tool in tools or []:
        fn = tool["function"]
        props = (fn.get("parameters") or {}).get("properties")
        out[fn["name"]] = ({k: schema_types(v) for k, v in props.items()}
                           if isinstance(props, Mapping) else {})
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(name)  # NaN / Infinity: not JSON, whatever Python's json accepts


def _json(raw: str) -> Any:
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return _BAD


def _number(raw: str) -> Any:
    v = _json(raw)
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return v if ok else _BAD


def _of_kind(kind: type) -> Callable[[str], Any]:
    def convert(raw: str) -> Any:
        v = _json(raw)
        return v if isinstance(v, kind) else _BAD
    return convert


_CONVERT: dict[str, Callable[[str], Any]] = {
    "integer": _number,  # a model writing 3.0 for an integer still meant a number
    "number": _number,
    "boolean": lambda raw: {"true": True, "false": False}.get(raw.lower(), _BAD),
    "null": lambda raw: None if raw == "null" else _BAD,
    "object": _of_kind(dict),
    "array": _of_kind(list),
}


def stays_text(types: tuple[str, ...]) -> bool:
    """Whether a parameter of these schema types keeps its raw text (``typed``)."""
    return not types or "string" in types


def typed(raw: str, types: tuple[str, ...]) -> Any:
    """A parameter's raw text as the value its schema types make of it (the text
    itself when none applies)."""
    if stays_text(types):
        return raw
    for kind in types:
        value = _CONVERT.get(kind, lambda _: _BAD)(raw.strip())
        if value is not _BAD:
            return value
    return raw


def _escaped(text: str) -> str:
    """``text`` as it sits inside a JSON string; escaping is per character, so the
    pieces of a value escaped one by one join into the whole value escaped."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class XmlToolStream(MarkedStream):
    """One streamed choice of a qwen3_coder model; ``types`` (param_types) types the values."""

    def __init__(self, parallel: bool = True, types: ParamTypes | None = None) -> None:
        super().__init__(MARKER, parallel)
        self._types: ParamTypes = types or {}
        self._name_at = 0  # where the function or parameter name being read starts
        self._param = ""  # the parameter whose value is being read
        self._val_at = 0  # where its value starts
        self._val_sent = 0  # how far into _buf a string value's text went out
        self._params = 0  # how many parameters the current call has sent

    def _flush(self, deltas: list[dict[str, Any]]) -> None:
        if self._state == "value" and self._is_string():  # a string value as far as it arrived
            self._send_args(deltas, _escaped(self._buf[self._val_sent:]))

    def _fail(self, at: int) -> str:
        """Unclean from ``at``: all unsent text is content, and so is the rest of the output."""
        self._clean, self._state = False, "plain"
        return self._buf[self._from if self._from is not None else at:]

    def _expect(self, *literals: str) -> str | None:
        """The literal _buf holds at _pos (consumed); "" while it may still become
        one; None when it cannot."""
        got = self._buf[self._pos:self._pos + max(map(len, literals))]
        for lit in literals:
            if got.startswith(lit):
                self._pos += len(lit)
                return lit
        return "" if any(lit.startswith(got) for lit in literals) else None

    def _scan(self) -> tuple[str, list[dict[str, Any]]]:
        buf, deltas = self._buf, []
        while self._pos < len(buf):
            state, c = self._state, buf[self._pos]
            if state in ("name", "pname"):  # up to ">"
                if c in "<\n":
                    return self._fail(self._pos), deltas
                self._pos += 1
                if c == ">":
                    name = buf[self._name_at:self._pos - 1]
                    if not name:
                        return self._fail(self._pos - 1), deltas
                    if state == "name":
                        self._start_call(name, deltas)
                    else:
                        self._param, self._state = name, "vstart"
                continue
            if state == "vstart":  # the value's own leading newline is markup
                if c == "\n":
                    self._pos += 1
                self._val_at = self._val_sent = self._pos
                self._state = "value"
                if self._is_string():
                    self._send_args(deltas, self._key() + '"')
                continue
            if state == "value":
                if not self._value(deltas):
                    break
                continue
            if c in _WS:
                self._pos += 1
                continue
            options = {"open": (_FUNC,), "params": (_PARAM, _FUNC_END),
                       "close": (_CLOSE,), "next": (MARKER,)}[state]
            lit = self._expect(*options)
            if lit is None:
                return self._fail(self._pos), deltas
            if lit == "":
                break
            if lit in (_FUNC, _PARAM):
                self._name_at, self._state = self._pos, "name" if lit == _FUNC else "pname"
            elif lit == _FUNC_END:
                self._send_args(deltas, "}" if self._params else "{}")
                self._state = "close"
            elif lit == _CLOSE:
                self._state, self._from = "next", self._pos
            else:
                self._state = "open"
        return "", deltas

    def _start_call(self, name: str, deltas: list[dict[str, Any]]) -> None:
        self._from, self._params, self._state = None, 0, "params"
        # The id tool_calls.new_call_id gives hermes (that module imports this one).
        self.calls.append({"id": "call_" + secrets.token_hex(12), "type": "function",
                           "function": {"name": name, "arguments": ""}})
        deltas.append({"index": len(self.calls) - 1, **self.calls[-1],
                       "function": {"name": name, "arguments": ""}})

    def _is_string(self) -> bool:
        types = self._types.get(self.calls[-1]["function"]["name"], {}).get(self._param, ())
        return stays_text(types)

    def _key(self) -> str:
        self._params += 1
        return ("{" if self._params == 1 else ", ") + json.dumps(self._param, ensure_ascii=False) + ": "

    def _value(self, deltas: list[dict[str, Any]]) -> bool:
        """Read the current value as far as _buf goes; whether it ended."""
        buf = self._buf
        end = buf.find(_PARAM_END, self._pos)
        if end < 0:  # next time, search only where the end tag may begin
            self._pos = max(self._val_at, len(buf) - len(_PARAM_END) + 1)
            if self._is_string():
                safe = len(buf) - held(buf[self._val_sent:], _VALUE_ENDS)
                self._send_args(deltas, _escaped(buf[self._val_sent:safe]))
                self._val_sent = safe
            return False
        raw = buf[self._val_at:end]
        raw = raw[:-1] if raw.endswith("\n") else raw
        if self._is_string():
            self._send_args(deltas, _escaped(raw[self._val_sent - self._val_at:]) + '"')
        else:
            types = self._types[self.calls[-1]["function"]["name"]][self._param]
            self._send_args(deltas, self._key() + json.dumps(typed(raw, types), ensure_ascii=False))
        self._pos, self._state = end + len(_PARAM_END), "params"
        return True
