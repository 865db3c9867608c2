"""What the streamed tool-call scanners share (tool_calls.ToolStream for the JSON
syntaxes, tool_calls_xml.XmlToolStream for Qwen3-Coder's): content passes through
until the call marker, holding back only a tail that could start it; from the
marker on, the subclass's ``_scan`` turns the text into content and call deltas;
``finish`` gives back what is still held (tool_calls.py states the contract)."""

from __future__ import annotations

from typing import Any

Deltas = list[dict[str, Any]]


def held(text: str, literals: tuple[str, ...]) -> int:
    """The length of the longest tail of ``text`` that could start one of ``literals``."""
    longest = max(len(lit) for lit in literals) - 1
    return next((n for n in range(min(longest, len(text)), 0, -1)
                 if any(lit.startswith(text[-n:]) for lit in literals)), 0)


class MarkedStream:
    """One streamed choice. ``push`` and ``finish`` return (content to send now,
    tool-call deltas to send after it); ``parallel=False`` sends the first call only.

    States: "content" (before the marker), "plain" (everything is content from
    here on), and the subclass's own from "open" (the marker seen) on; ``DONE``
    are those in which the output may end cleanly."""

    DONE: tuple[str, ...] = ("next",)

    def __init__(self, marker: str, parallel: bool) -> None:
        self.parallel = parallel
        self._marker = marker
        self._pre = ""  # before the marker: a held tail that could start it
        self._buf = ""  # the text from the marker on
        self._pos = 0  # how far _buf is scanned
        self._state = "content"
        self._from: int | None = 0  # where unsent, not-yet-call text starts (None: inside a sent call)
        self._clean = True
        self.calls: list[dict[str, Any]] = []  # the calls sent, arguments as sent so far

    @property
    def called(self) -> bool:
        """Whether any call was sent."""
        return bool(self.calls)

    @property
    def clean(self) -> bool:
        """After ``finish``: every call parsed whole, nothing but calls after the marker."""
        return self._clean and bool(self.calls) and self._state in self.DONE

    def push(self, delta: str) -> tuple[str, Deltas]:
        if self._state == "plain":
            return delta, []
        head = ""
        if self._state == "content":
            text = self._pre + delta
            found = self._start(text)
            if found is None:
                keep = self._hold(text) if self._state == "content" else 0
                self._pre = text[len(text) - keep:]
                return text[:len(text) - keep], []
            at, body = found
            self._pre, self._buf, self._pos, self._state = "", text[at:], body - at, "open"
            head, delta = text[:at], ""
        self._buf += delta
        content, deltas = self._scan()
        return head + content, self._only_first(deltas)

    def finish(self) -> tuple[str, Deltas]:
        """Whatever is still held: an unsent call's text as content, a sent call cut
        off as far as it arrived (``_flush``)."""
        if self._state == "content":
            self._state, pre, self._pre = "plain", self._pre, ""
            return pre, []
        if self._state == "plain":
            return "", []
        deltas: Deltas = []
        self._flush(deltas)
        rest = self._buf[self._from:] if self._from is not None else ""
        if self._state not in self.DONE:
            self._clean = False
        if rest.strip() or self._unsent_call_open():
            self._clean, self._state = False, "plain"
            return rest, self._only_first(deltas)
        return "", self._only_first(deltas)

    def _send_args(self, deltas: Deltas, frag: str) -> None:
        """Send ``frag`` of the last call's arguments, joined to this push's last
        delta when that is the same call's arguments."""
        if not frag:
            return
        j = len(self.calls) - 1
        self.calls[j]["function"]["arguments"] += frag
        last = deltas[-1] if deltas else None
        if last is not None and last["index"] == j and "id" not in last:
            last["function"]["arguments"] += frag
        else:
            deltas.append({"index": j, "function": {"arguments": frag}})

    def _only_first(self, deltas: Deltas) -> Deltas:
        return deltas if self.parallel else [d for d in deltas if d["index"] == 0]

    def _start(self, text: str) -> tuple[int, int] | None:
        """Where the call syntax starts in the content held so far, ``text``: (where
        the scanned buffer begins, where scanning begins), or None while it has not.
        A subclass may decide here that all of the output is content (state "plain")."""
        at = text.find(self._marker)
        return None if at < 0 else (at, at + len(self._marker))

    def _hold(self, text: str) -> int:
        """How long a tail of ``text`` (no call start in it) to hold back."""
        return held(text, (self._marker,))

    def _scan(self) -> tuple[str, Deltas]:
        raise NotImplementedError

    def _flush(self, deltas: Deltas) -> None:
        """At ``finish``: the deltas of what arrived of a sent call that was cut off."""

    def _unsent_call_open(self) -> bool:
        """At ``finish``: an unsent call was still open (its text is content)."""
        return False
