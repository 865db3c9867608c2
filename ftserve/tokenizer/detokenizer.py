"""Streaming detokenizer: token ids in, text deltas out, one per request.

Per step the work is O(new tokens + longest stop string):
  ids -> token bytes (memoized table) -> incremental UTF-8 decoder (holds an incomplete
  multi-byte character until its last byte arrives; invalid bytes become U+FFFD exactly
  as a one-shot decode would) -> stop-string filter.

Stop strings: text that could still become a stop string stays held back. Any stop
match must start inside the held text or the new text (the emitted text never ends
with a proper prefix of a stop string), so each step searches only held + new.

Invariant (property-tested): with no stop strings, the concatenation of every delta
plus `finish()` equals `tokenizer.decode(all ids)`.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass

from ftserve.tokenizer.base import Tokenizer


@dataclass(frozen=True)
class DetokenizerDelta:
    text: str  # new text that is safe to send now
    stop: str | None = None  # the stop string that just matched (trimmed from text)

    @property
    def stopped(self) -> bool:
        return self.stop is not None


class StreamingDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        *,
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        continues_text: bool = False,
    ) -> None:
        self.tok = tokenizer
        self.stop_strings = tuple(s for s in stop if s)
        self.skip_special_tokens = skip_special_tokens
        self.include_stop = include_stop_str_in_output
        self._special = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # No token has produced bytes yet. ``continues_text``: the ids follow text (a
        # prompt ending in text), so the first token keeps the word-start space a
        # one-shot decode of these ids alone would strip ("is" + " Paris", not "isParis").
        self._at_start = not continues_text
        self._held = ""  # decoded text withheld: it may begin a stop string
        self.stop: str | None = None  # set once a stop string matched
        self.num_tokens = 0

    @property
    def stopped(self) -> bool:
        return self.stop is not None

    def feed(self, ids: Sequence[int]) -> DetokenizerDelta:
        """Add newly generated ids. After a stop string matched, further ids are ignored."""
        if self.stop is not None:
            return DetokenizerDelta("")
        self.num_tokens += len(ids)
        parts: list[bytes] = []
        vocab = self.tok.vocab_size
        for t in ids:
            # Ids past the tokenizer's vocabulary (a model's padded embedding rows) have
            # no text; a stream must not die on one.
            if t in self._special or not 0 <= t < vocab:
                continue
            b = self.tok.token_bytes(t)
            if self._at_start and b:
                if self.tok.strip_first(t) and b.startswith(b" "):
                    b = b[1:]
                self._at_start = False
            parts.append(b)
        return self._filter(self._utf8.decode(b"".join(parts)))

    def finish(self) -> str:
        """End of stream: flush an incomplete character (as U+FFFD) and the held text."""
        if self.stop is not None:
            return ""
        delta = self._filter(self._utf8.decode(b"", final=True))
        rest, self._held = self._held, ""
        return delta.text + rest

    def _filter(self, new: str) -> DetokenizerDelta:
        if not self.stop_strings:
            return DetokenizerDelta(new)
        buf = self._held + new
        first: tuple[int, str] | None = None
        for s in self.stop_strings:
            i = buf.find(s)
            if i >= 0 and (first is None or i < first[0] or (i == first[0] and len(s) > len(first[1]))):
                first = (i, s)
        if first is not None:
            i, s = first
            self.stop, self._held = s, ""
            return DetokenizerDelta(buf[: i + len(s)] if self.include_stop else buf[:i], stop=s)
        hold = 0
        for s in self.stop_strings:  # longest suffix of buf that is a proper prefix of s
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self._held = buf[len(buf) - hold :] if hold else ""
        return DetokenizerDelta(buf[: len(buf) - hold])
