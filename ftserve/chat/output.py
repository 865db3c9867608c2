"""One chat choice's output split into reasoning, content and tool calls, the
same way for every API the server speaks (completions.py for OpenAI's,
anthropic_api.py for Anthropic's).

Reasoning is split off first, where the template marks it (reasoning.py); tool
calls are looked for in what remains, where the request gave tools
(tool_calls.py). A forced tool_choice's start of a call (tool_choice.py) is
prompt, but the parser reads it before the output, so a call parses as if the
model had written all of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ftserve.chat import reasoning, tool_calls


class ChatOutputFilter:
    """A streamed choice: ``push`` a step's text, get (reasoning, content safe to
    send, tool-call deltas); ``finish`` gives what was held back. ``opening``:
    the deltas of the forced text, ready before any token (a named call's start)."""

    def __init__(self, fmt: tool_calls.Format | None, parallel: bool,
                 types: tool_calls.ParamTypes | None, think: bool | None,
                 forced: str = "") -> None:
        self.tools = tool_calls.tool_stream(fmt, parallel, types) if fmt else None
        self.reasoning = reasoning.ReasoningStream(think) if think is not None else None
        # The forced text is never content (it opens a call in the syntax of fmt).
        self.opening = self.tools.push(forced)[1] if self.tools is not None and forced else []

    def push(self, delta: str) -> tuple[str, str, list[dict[str, Any]]]:
        thought, content = self.reasoning.push(delta) if self.reasoning is not None else ("", delta)
        if self.tools is None:
            return thought, content, []
        return (thought, *self.tools.push(content))

    def finish(self) -> tuple[str, str, list[dict[str, Any]]]:
        thought, content = self.reasoning.finish() if self.reasoning is not None else ("", "")
        if self.tools is None:
            return thought, content, []
        content, deltas = self.tools.push(content) if content else ("", [])
        tail, more = self.tools.finish()
        return thought, content + tail, deltas + more


@dataclass
class WholeOutput:
    thought: str | None  # None: the output had no reasoning block (or reasoning is off)
    content: str | None  # None: calls and no text besides them
    calls: list[dict[str, Any]]  # OpenAI tool_calls: {id, type, function: {name, arguments}}


def split_whole(text: str, fmt: tool_calls.Format | None, parallel: bool,
                types: tool_calls.ParamTypes | None, think: bool | None,
                forced: str = "") -> WholeOutput:
    """A whole output: calls only when all of them parse clean, else all of the text
    (the forced text in front) is content (tool_calls.py's contract)."""
    content = forced + text
    thought = None
    if think is not None:
        thought, content = reasoning.split(content, think)
    if fmt is None:
        return WholeOutput(thought, content, [])
    parsed = tool_calls.parse(content, fmt, types)
    if not parsed.tool_calls:
        return WholeOutput(thought, content, [])
    calls = parsed.tool_calls if parallel else parsed.tool_calls[:1]
    return WholeOutput(thought, parsed.content, calls)
