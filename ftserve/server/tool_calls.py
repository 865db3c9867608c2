"""Tool calls in model output: find them, strip them from the content, return
them as OpenAI ``tool_calls``.

Which syntax a model writes is read off its chat template (the template renders
earlier calls the same way the model was trained to write them)::

    hermes   (Qwen2.5 / Qwen3, Hermes):  text <tool_call>{"name": ..., "arguments": {...}}</tool_call> ...
    mistral  (Mistral / Mixtral v3+):    text [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]

Output whose calls do not parse (bad JSON, no name, cut off by max_tokens) is
returned as plain content: nothing the model wrote is lost.

Streaming (``ToolStream``): content is passed through as it arrives, except the
tail that could be the start of a call marker; from the marker on, everything is
held back and parsed when the choice finishes, then sent as one ``tool_calls``
delta (arguments complete, never a partial JSON string).
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any, Literal

Format = Literal["hermes", "mistral"]

_MARKERS: dict[str, str] = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_ALNUM = string.ascii_letters + string.digits


def format_of(template_source: str) -> Format | None:
    """The call syntax a chat template renders, or None (no tool support)."""
    for fmt, marker in _MARKERS.items():
        if marker in template_source:
            return fmt  # type: ignore[return-value]
    return None


def new_call_id(fmt: Format) -> str:
    # Mistral templates check that a tool_call_id is 9 alphanumerics.
    if fmt == "mistral":
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return "call_" + secrets.token_hex(12)


@dataclass
class Parsed:
    content: str | None  # text outside the calls; None when there is none and calls exist
    tool_calls: list[dict[str, Any]]


def _call(obj: Any, fmt: Format) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except json.JSONDecodeError:
            return None
        arguments = args
    else:
        arguments = json.dumps(args, ensure_ascii=False)
    return {"id": new_call_id(fmt), "type": "function",
            "function": {"name": obj["name"], "arguments": arguments}}


def parse(text: str, fmt: Format) -> Parsed:
    """Split ``text`` into content and tool calls; unparseable calls stay content."""
    marker = _MARKERS[fmt]
    start = text.find(marker)
    if start < 0:
        return Parsed(text, [])
    calls: list[dict[str, Any]] = []
    if fmt == "hermes":
        rest = text[start:]
        bodies = _HERMES_CALL.findall(rest)
        leftover = _HERMES_CALL.sub("", rest).strip()
        if not bodies or leftover:  # an unclosed or stray marker: not a clean call list
            return Parsed(text, [])
        for body in bodies:
            try:
                call = _call(json.loads(body), fmt)
            except json.JSONDecodeError:
                call = None
            if call is None:
                return Parsed(text, [])
            calls.append(call)
    else:
        try:
            objs = json.loads(text[start + len(marker):])
        except json.JSONDecodeError:
            return Parsed(text, [])
        for obj in objs if isinstance(objs, list) else [objs]:
            call = _call(obj, fmt)
            if call is None:
                return Parsed(text, [])
            calls.append(call)
    content = text[:start].strip()
    return Parsed(content or None, calls)


class ToolStream:
    """One streamed choice: ``push`` returns the content safe to send now,
    ``finish`` parses what was held back."""

    def __init__(self, fmt: Format) -> None:
        self.fmt = fmt
        self._marker = _MARKERS[fmt]
        self._sent = ""  # content already sent
        self._held = ""  # a possible marker start, or everything from the marker on
        self._in_call = False

    def push(self, delta: str) -> str:
        if self._in_call:
            self._held += delta
            return ""
        text = self._held + delta
        at = text.find(self._marker)
        if at >= 0:
            self._in_call = True
            self._held = text[at:]
            return self._emit(text[:at])
        # Hold back the longest tail that is a prefix of the marker.
        keep = 0
        for n in range(min(len(self._marker) - 1, len(text)), 0, -1):
            if self._marker.startswith(text[-n:]):
                keep = n
                break
        self._held = text[len(text) - keep:] if keep else ""
        return self._emit(text[:len(text) - keep])

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(content still to send, tool calls). Without valid calls the held text
        is content after all."""
        held, self._held = self._held, ""
        if not self._in_call:
            return self._emit(held), []
        parsed = parse(held, self.fmt)
        if not parsed.tool_calls:
            return self._emit(held), []
        return "", parsed.tool_calls

    def _emit(self, text: str) -> str:
        self._sent += text
        return text
