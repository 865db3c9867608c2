"""Reasoning ("thinking") text in model output: split it from the content and
return it as ``reasoning_content``, the field OpenAI-compatible servers use.

Chat templates that render ``<think> ... </think>`` (Qwen3, QwQ, DeepSeek-R1)
mark a model's reasoning so. Where the reasoning starts::

    the model writes it:        prompt "...<|im_start|>assistant\\n"  output "<think>\\nA\\n</think>\\n\\nB"
    the prompt opens it:        prompt "...assistant\\n<think>\\n"     output "A\\n</think>\\n\\nB"
    thinking off (Qwen3's       prompt "...<think>\\n\\n</think>\\n\\n" output "B"
    enable_thinking=false):

Each gives reasoning "A" and content "B" (the newlines after ``</think>`` are
dropped). Output that never closes its reasoning (cut off by max_tokens) is all
reasoning: nothing the model wrote is lost, it is only labelled. Tool calls are
looked for in the content only (output.py runs this split first).
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def supported(template_source: str) -> bool:
    """Whether a chat template marks reasoning with the think tags."""
    return CLOSE in template_source


def opens_in_prompt(prompt: str) -> bool:
    """The rendered prompt ends inside an open <think>: the output starts as reasoning."""
    at = prompt.rfind(OPEN)
    return at >= 0 and prompt.find(CLOSE, at) < 0


def _tail_prefix(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """One choice's text, pushed as it arrives: ``push`` returns the (reasoning,
    content) safe to send now, holding back what could be the start of a tag;
    ``finish`` flushes the rest. ``tokens``: the output tokens that were
    reasoning, given per push (a push that ends inside the reasoning, or
    closes it, counts its tokens: the tags' own tokens are reasoning too)."""

    def __init__(self, open_at_start: bool) -> None:
        # start: may still open with <think>; think: inside reasoning;
        # after: just closed (dropping newlines); content: plain text from here on.
        self._state = "think" if open_at_start else "start"
        self._held = ""
        self.reasoned = open_at_start  # any reasoning at all (else reasoning_content is null)
        self.tokens = 0

    def push(self, delta: str, num_tokens: int = 0) -> tuple[str, str]:
        before = self._state
        thought, content = self._push(delta)
        closed_now = before in ("start", "think") and self._state in ("after", "content") and self.reasoned
        if self._state == "think" or closed_now:
            self.tokens += num_tokens
        return thought, content

    def _push(self, delta: str) -> tuple[str, str]:
        text = self._held + delta
        self._held = ""
        reasoning = ""
        if self._state == "start":
            body = text.lstrip()
            if body.startswith(OPEN):
                self._state, self.reasoned = "think", True
                text = body[len(OPEN):]
            elif body and not OPEN.startswith(body):
                self._state = "content"
            else:  # only whitespace or a prefix of <think> so far
                self._held = text
                return "", ""
        if self._state == "think":
            at = text.find(CLOSE)
            if at < 0:
                keep = _tail_prefix(text, CLOSE)
                self._held = text[len(text) - keep:] if keep else ""
                return text[:len(text) - keep], ""
            reasoning, text = text[:at], text[at + len(CLOSE):]
            self._state = "after"
        if self._state == "after":
            text = text.lstrip("\n")
            if not text:
                return reasoning, ""
            self._state = "content"
        return reasoning, text

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self._state == "think":
            return held, ""
        return "", held if self._state in ("start", "content") else ""


def split(text: str, open_at_start: bool) -> tuple[str | None, str]:
    """(reasoning or None when there is none, content) of a whole output."""
    stream = ReasoningStream(open_at_start)
    r1, c1 = stream.push(text)
    r2, c2 = stream.finish()
    return (r1 + r2 if stream.reasoned else None), c1 + c2
