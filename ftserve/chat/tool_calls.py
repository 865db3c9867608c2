"""Tool calls in model output: find them, strip them from the content, return
them as OpenAI ``tool_calls``, whole or streamed.

Which syntax a model writes is read off its chat template (the template renders
earlier calls the same way the model was trained to write them)::

    hermes       (Qwen2.5 / Qwen3, Hermes):  text <tool_call>{"name": ..., "arguments": {...}}</tool_call> ...
    mistral      (Mistral / Mixtral v3+):    text [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
    qwen3_coder  (Qwen3-Coder):              text <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE
                                             \\n</parameter>\\n</function>\\n</tool_call> ...
    llama3       (Llama 3.1 / 3.2 / 3.3):    <|python_tag|>{"name": ..., "parameters": {...}}; {...}

A qwen3_coder template also holds ``<tool_call>``; its ``<function=`` and
``<parameter=`` markers decide. That format writes no JSON: its scanner,
``XmlToolStream``, and how it types values by the tools' schemas are in
tool_calls_xml.py. llama3 has no marker: a call is there only when the output
starts with one (tool_calls_llama.py says how a stream decides). What follows
on ``arguments`` and on how a stream sends them is about the JSON formats
(tool_calls_xml.py says what it means there); the contract for unclean
output, whole and streamed, holds for all four.

A call's ``arguments`` string is the model's own text of the arguments value
(an object or array as written, whitespace and escapes kept; a JSON string
value decoded; ``"{}"`` when there is none; ``"parameters"`` is accepted for
``"arguments"``, the first of the two counts). Whole (``parse``) and streamed
(``ToolStream``) output use the same scanner, so the fragments of a streamed
call put together are exactly the ``arguments`` of the whole response.

Whole output (``parse``) whose calls are not all clean (bad JSON, no name, cut
off by max_tokens, prose after the calls) is returned as plain content: nothing
the model wrote is lost.

Streaming (``ToolStream``): content is passed through as it arrives, except the
tail that could be the start of the call marker. From the marker on, text is
held until a call's name is complete; then the call goes out as a first delta
(index, id, type, name, arguments ""), followed by argument fragments as the
arguments arrive (an object or array char by char; a string or scalar value in
one piece once it closed). What happens to output that turns out unclean:

- a call whose name was not sent yet (bad JSON, no name, cut off) and
  everything after it is sent as content; for the first call that is all the
  text from the marker on, as if there were no calls (today's whole behaviour);
- a call whose name was sent stays a call: it is finished with what was sent
  (cut off by max_tokens: the arguments as far as the model wrote them, maybe
  not valid JSON; a string arguments value that never closed: none); from a
  syntax error between its keys on, the rest of the output is content;
- text after the sent calls that is not the call syntax is content.

So a streamed choice may send both calls and content where the whole response
would send content only; it never drops text outside a sent call.

A forced ``tool_choice`` puts the start of a call in the prompt (tool_choice.py,
``FORCED_CALL``); the parser is fed that text and then the model's, so a call
parses as if the model had written all of it.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from ftserve.chat.tool_calls_llama import is_llama3, opening
from ftserve.chat.tool_calls_xml import ParamTypes, XmlToolStream, param_types
from ftserve.chat.tool_stream_base import MarkedStream

Format = Literal["hermes", "mistral", "qwen3_coder", "llama3"]

# The XML format's names are re-exported: callers deal with tool calls through this module.
__all__ = ["CallStream", "Format", "ParamTypes", "Parsed",
           "ToolStream", "format_of", "new_call_id", "param_types", "parse", "tool_stream"]

_MARKERS: dict[str, str] = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]",
                            "qwen3_coder": "<tool_call>"}  # llama3 has none
_HERMES_CLOSE = "</tool_call>"
_ALNUM = string.ascii_letters + string.digits
_WS = " \t\r\n"
_ARG_KEYS = ("arguments", "parameters")
_BAD = object()


def format_of(template_source: str) -> Format | None:
    """The call syntax a chat template renders, or None (no tool support)."""
    if "<function=" in template_source and "<parameter=" in template_source:
        return "qwen3_coder"  # before hermes: these templates hold <tool_call> too
    for fmt, marker in _MARKERS.items():
        if marker in template_source:
            return fmt  # type: ignore[return-value]
    return "llama3" if is_llama3(template_source) else None


def new_call_id(fmt: Format) -> str:
    # Mistral templates check that a tool_call_id is 9 alphanumerics.
    if fmt == "mistral":
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return "call_" + secrets.token_hex(12)


@dataclass
class Parsed:
    content: str | None  # text outside the calls; None when there is none and calls exist
    tool_calls: list[dict[str, Any]]


class CallStream(Protocol):
    """One streamed choice's tool-call filter: ToolStream or XmlToolStream."""

    calls: list[dict[str, Any]]

    @property
    def called(self) -> bool: ...

    @property
    def clean(self) -> bool: ...

    def push(self, delta: str) -> tuple[str, list[dict[str, Any]]]: ...

    def finish(self) -> tuple[str, list[dict[str, Any]]]: ...


def tool_stream(fmt: Format, parallel: bool = True, types: ParamTypes | None = None) -> CallStream:
    """The filter for one streamed choice in syntax ``fmt``; ``types`` (param_types
    of the request's tools) types qwen3_coder values, which the model writes untyped."""
    if fmt == "qwen3_coder":
        return XmlToolStream(parallel, types)
    return ToolStream(fmt, parallel)


def parse(text: str, fmt: Format, types: ParamTypes | None = None) -> Parsed:
    """Split ``text`` into content and tool calls; unless all calls are clean, it
    all stays content."""
    ts = tool_stream(fmt, types=types)
    ts.push(text)
    ts.finish()
    if not ts.clean:
        return Parsed(text, [])
    if fmt == "llama3":  # the calls are the whole output: before them only whitespace / the tag
        return Parsed(None, ts.calls)
    content = text[:text.find(_MARKERS[fmt])].strip()
    return Parsed(content or None, ts.calls)


def _loads(raw: str) -> Any:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, RecursionError):  # nested past Python's limit: not a call
        return _BAD


class _Call:
    """One call object ``{...}`` scanned a character at a time: its name and
    where its arguments value lies in the buffer. Keys and values of the top
    level are checked as they come; nested values only once the object closed."""

    def __init__(self, start: int) -> None:
        self.start = start  # index of "{" in the buffer
        self.end: int | None = None  # index after the closing "}"
        self.depth = 0
        self.in_str = self.esc = self.in_args = self.bad = False
        self.phase = "key"
        self.key: Any = None
        self.key_at = self.val_at = 0
        self.name: str | None = None
        self.args_at: int | None = None  # where the arguments value starts
        self.args_raw: str | None = None  # its whole text, once it ended

    def feed(self, buf: str, i: int) -> None:
        c = buf[i]
        if self.in_str:
            if self.esc:
                self.esc = False
            elif c == "\\":
                self.esc = True
            elif c == '"':
                self.in_str = False
                if self.depth == 1 and self.phase == "inkey":
                    self.key, self.phase = _loads(buf[self.key_at:i + 1]), "colon"
                elif self.depth == 1:
                    self._value(buf, i + 1)
            return
        if self.depth == 0:  # the opening brace
            self.depth = 1
            return
        if self.depth > 1:
            if c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 1:
                    self._value(buf, i + 1)
            return
        if self.phase == "scalar":
            if c not in _WS and c not in ",}":
                return
            self._value(buf, i)
        if c in _WS:
            return
        phase = self.phase
        if phase == "key" and c == '"':
            self.in_str, self.key_at, self.phase = True, i, "inkey"
        elif phase == "colon" and c == ":":
            self.phase = "value"
        elif phase == "value":
            self.val_at = i
            self.in_args = self.key in _ARG_KEYS and self.args_at is None
            if self.in_args:
                self.args_at = i
            if c == '"':
                self.in_str, self.phase = True, "string"
            elif c in "{[":
                self.depth, self.phase = 2, "nested"
            else:
                self.phase = "scalar"
        elif phase == "comma" and c == ",":
            self.phase = "key"
        elif phase in ("key", "comma") and c == "}":
            self.depth, self.end = 0, i + 1
        else:
            self.bad = True

    def _value(self, buf: str, end: int) -> None:
        raw = buf[self.val_at:end]
        if self.key == "name" and self.name is None:
            name = _loads(raw)
            self.name = name if isinstance(name, str) and name else None
        if self.in_args:
            self.args_raw, self.in_args = raw, False
        self.phase = "comma"

    def arguments(self, buf: str, pos: int) -> str:
        """The arguments as far as they can be sent with ``buf[:pos]`` scanned;
        only ever grows."""
        if self.args_raw is not None:
            if self.args_raw.startswith('"'):
                text = _loads(self.args_raw)
                return text if isinstance(text, str) else ""
            return self.args_raw
        if self.args_at is not None:
            return buf[self.args_at:pos] if buf[self.args_at] in "{[" else ""
        return "{}" if self.end is not None else ""

    def valid(self, buf: str) -> bool:
        if self.bad or self.end is None or self.name is None:
            return False
        if not isinstance(_loads(buf[self.start:self.end]), dict):
            return False
        raw = self.args_raw
        return raw is None or not raw.startswith('"') or _loads(_loads(raw)) is not _BAD


class ToolStream(MarkedStream):
    """One streamed choice of a JSON call syntax (hermes, mistral, llama3)."""

    DONE = ("next", "done")

    def __init__(self, fmt: Format, parallel: bool = True) -> None:
        assert fmt != "qwen3_coder", "XmlToolStream scans that format (tool_stream)"
        super().__init__(_MARKERS.get(fmt, ""), parallel)
        self.fmt = fmt
        self._call: _Call | None = None  # the call being scanned
        self._sent_args = 0  # how much of the current sent call's arguments went out
        self._list = False  # mistral: the calls are in a list (else one bare object)

    def _start(self, text: str) -> tuple[int, int] | None:
        if self.fmt != "llama3":
            return super()._start(text)
        at = opening(text)
        if at == "content":
            self._state = "plain"
        # The buffer keeps the held prefix: an unclean first call gives it back as content.
        return (0, at) if isinstance(at, int) else None

    def _hold(self, text: str) -> int:
        return len(text) if self.fmt == "llama3" else super()._hold(text)  # all of it: undecided

    def _flush(self, deltas: list[dict[str, Any]]) -> None:
        if self._call is not None and self._from is None:
            self._args(deltas)  # a sent call cut off: what arrived of it

    def _unsent_call_open(self) -> bool:
        return self._from is not None and self._state == "obj"

    def _fail(self, at: int) -> str:
        """Unclean from ``at``: all unsent text is content, and so is the rest of the output."""
        self._clean, self._state = False, "plain"
        start = self._from if self._from is not None else at
        self._call = None
        return self._buf[start:]

    def _literal(self, lit: str) -> bool | None:
        """Whether _buf at _pos is ``lit`` (consumed); None while it may still be."""
        got = self._buf[self._pos:self._pos + len(lit)]
        if got == lit:
            self._pos += len(lit)
            return True
        return None if lit.startswith(got) and len(got) < len(lit) else False

    def _scan(self) -> tuple[str, list[dict[str, Any]]]:
        buf, deltas = self._buf, []
        while self._pos < len(buf):
            c, state = buf[self._pos], self._state
            if state == "obj":
                call = self._call
                assert call is not None
                call.feed(buf, self._pos)
                self._pos += 1
                if call.bad:
                    return self._fail(self._pos - 1), deltas
                if call.name is not None and self._from is not None:  # the name is complete: send
                    self._from = None
                    self._sent_args = 0
                    self.calls.append({"id": new_call_id(self.fmt), "type": "function",
                                       "function": {"name": call.name, "arguments": ""}})
                    deltas.append({"index": len(self.calls) - 1, **self.calls[-1],
                                   "function": {"name": call.name, "arguments": ""}})
                if call.end is not None:
                    if self._from is not None:  # closed without a name
                        return self._fail(self._pos), deltas
                    self._args(deltas)
                    self._clean = self._clean and call.valid(buf)
                    self._call, self._from = None, self._pos
                    self._state = "close" if self.fmt == "hermes" else (
                        "sep" if self._list else "done")
                continue
            if c in _WS:
                self._pos += 1
                continue
            if state in ("open", "list") and c == "{":
                self._call, self._state = _Call(self._pos), "obj"
                continue
            if state == "open" and c == "[" and self.fmt == "mistral":
                self._pos, self._state, self._list = self._pos + 1, "list", True
                continue
            if state == "done" and c == ";" and self.fmt == "llama3":
                # _from stays before the ";": if no call follows, it is content.
                self._pos, self._state = self._pos + 1, "open"
                continue
            if state == "sep" and c in ",]":
                self._pos += 1
                self._state, self._from = ("list" if c == "," else "done"), self._pos
                continue
            if state in ("close", "next"):
                lit = _HERMES_CLOSE if state == "close" else self._marker
                ok = self._literal(lit)
                if ok is None:
                    break
                if ok:
                    self._state = "next" if state == "close" else "open"
                    if state == "close":
                        self._from = self._pos
                    continue
            return self._fail(self._pos), deltas
        if self._call is not None and self._from is None:
            self._args(deltas)
        return "", deltas

    def _args(self, deltas: list[dict[str, Any]]) -> None:
        """Send what is new of the current sent call's arguments."""
        assert self._call is not None
        text = self._call.arguments(self._buf, self._pos)
        frag, self._sent_args = text[self._sent_args:], len(text)
        self._send_args(deltas, frag)
