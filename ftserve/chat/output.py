"""One chat choice's output split into reasoning, content and tool calls, the
same way for every protocol the server speaks, step by step as the output arrives
(the stream driver, ftserve/api/driver.py, feeds each step through it once).

Reasoning is split off first, where the template marks it (reasoning.py); tool
calls are looked for in what remains, where the request gave tools
(tool_calls.py). A forced tool_choice's start of a call (tool_choice.py) is
prompt, but the parser reads it before the output, so a call parses as if the
model had written all of it. The reasoning split also counts the output tokens
that were reasoning (usage's reasoning_tokens).

A streamed choice (``StreamSplit``) gives its pieces as they become safe to send;
a whole one (``WholeSplit``) gives the whole output at its end, with calls only
when all of them parse clean (tool_calls.py's contract for whole output).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ftserve.chat import reasoning, tool_calls

# (reasoning, content safe to send, tool-call deltas) of a piece of output.
Piece = tuple[str, str, list[dict[str, Any]]]


@dataclass(frozen=True)
class OutputSpec:
    """How a request's choices are split: its call syntax (None: no tools offered),
    whether more than one call is returned, the tools' parameter types (qwen3_coder
    values are typed by them), the reasoning split (None: off, else whether the
    prompt opened the reasoning) and the forced start of a call."""

    fmt: tool_calls.Format | None = None
    parallel: bool = True
    types: tool_calls.ParamTypes | None = None
    think: bool | None = None
    forced: str = ""

    def stream(self) -> StreamSplit:
        return StreamSplit(self.fmt, self.parallel, self.types, self.think, self.forced)

    def whole(self) -> WholeSplit:
        return WholeSplit(self.fmt, self.parallel, self.types, self.think, self.forced)


class _Reasoning:
    """The reasoning split of one choice, and its count of reasoning tokens."""

    def __init__(self, think: bool | None) -> None:
        self.reasoning = reasoning.ReasoningStream(think) if think is not None else None

    @property
    def tracks_reasoning(self) -> bool:
        """The template marks reasoning: usage reports reasoning_tokens."""
        return self.reasoning is not None

    @property
    def reasoning_tokens(self) -> int:
        """Output tokens so far inside the reasoning block (its tags included)."""
        return self.reasoning.tokens if self.reasoning is not None else 0

    def _split(self, delta: str, num_tokens: int) -> tuple[str, str]:
        if self.reasoning is None:
            return "", delta
        return self.reasoning.push(delta, num_tokens)

    def _held(self) -> tuple[str, str]:
        return self.reasoning.finish() if self.reasoning is not None else ("", "")


class StreamSplit(_Reasoning):
    """A streamed choice: ``push`` a step's text (and its token count), get the
    pieces safe to send; ``finish`` gives what was held back. ``opening``: the
    call deltas of the forced text, ready before any token (a named call's start)."""

    def __init__(self, fmt: tool_calls.Format | None, parallel: bool,
                 types: tool_calls.ParamTypes | None, think: bool | None,
                 forced: str = "") -> None:
        super().__init__(think)
        self.tools = tool_calls.tool_stream(fmt, parallel, types) if fmt else None
        # The forced text is never content (it opens a call in the syntax of fmt).
        self.opening = self.tools.push(forced)[1] if self.tools is not None and forced else []

    @property
    def called(self) -> bool:
        """A call was sent."""
        return self.tools is not None and self.tools.called

    @property
    def clean(self) -> bool:
        """Every call sent parsed whole."""
        return self.tools is not None and self.tools.clean

    def push(self, delta: str, num_tokens: int = 0) -> Piece:
        thought, content = self._split(delta, num_tokens)
        if self.tools is None:
            return thought, content, []
        return (thought, *self.tools.push(content))

    def finish(self) -> Piece:
        thought, content = self._held()
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


class WholeSplit(_Reasoning):
    """A whole choice: ``push`` each step's text (the reasoning is split and counted
    as it arrives), ``finish`` splits off the calls: only when all of them parse
    clean, else all of the text (the forced text in front) is content."""

    def __init__(self, fmt: tool_calls.Format | None, parallel: bool,
                 types: tool_calls.ParamTypes | None, think: bool | None,
                 forced: str = "") -> None:
        super().__init__(think)
        self._fmt, self._parallel, self._types = fmt, parallel, types
        self._thought: list[str] = []
        self._content: list[str] = []
        if forced:
            self.push(forced)  # as if the model had written it: the parser reads it first

    def push(self, delta: str, num_tokens: int = 0) -> None:
        thought, content = self._split(delta, num_tokens)
        self._thought.append(thought)
        self._content.append(content)

    def finish(self) -> WholeOutput:
        thought, content = self._held()
        self._thought.append(thought)
        self._content.append(content)
        text = "".join(self._content)
        said = "".join(self._thought) if self.reasoning is not None and self.reasoning.reasoned \
            else None
        if self._fmt is None:
            return WholeOutput(said, text, [])
        parsed = tool_calls.parse(text, self._fmt, self._types)
        if not parsed.tool_calls:
            return WholeOutput(said, text, [])
        calls = parsed.tool_calls if self._parallel else parsed.tool_calls[:1]
        return WholeOutput(said, parsed.content, calls)


def split_whole(text: str, fmt: tool_calls.Format | None, parallel: bool,
                types: tool_calls.ParamTypes | None, think: bool | None,
                forced: str = "") -> WholeOutput:
    """A whole output at once (WholeSplit fed one piece)."""
    split = WholeSplit(fmt, parallel, types, think, forced)
    split.push(text)
    return split.finish()
