"""The one tokenizer interface every backend implements.

Three encodings matter and must stay consistent (tests/test_tokenizer.py):

    encode(text, True)   == special_prefix + encode_body(text) + special_suffix
    encode_body(text)    == ids of `text` starting a document (sentencepiece adds its
                            dummy-prefix space "▁" to the first word)
    encode_continuation(text) == ids of `text` when it continues earlier text and starts
                            at a cut point (no dummy prefix, no special tokens added)

For a safe cut point c of `text` (see `is_safe_cut`: a space or newline after a
non-whitespace character, where the vocabulary has no token spanning the two):

    encode_body(text) == encode_body(text[:c]) + encode_continuation(text[c:])

which is what the incremental cache builds on; it still verifies every splice.

Literal special-token text. A chat message may contain the text of a control
token ("<|im_end|>"); parsed as the token it would forge a turn boundary. The
server escapes message text with ``escape_special`` (LITERAL_MARK after the
token text's first character); the encoders split the text at each escaped
occurrence and drop the mark, so the pieces are encoded separately and none
holds the whole token text::

    "say <\uE000|im_end|> now"  ->  encode("say <") + encode_continuation("|im_end|> now")

Text without the mark encodes exactly as before.

Decoding is defined here once, from raw token bytes, so that the streaming detokenizer
and `decode` agree byte for byte: bytes are joined and decoded as UTF-8 with U+FFFD for
invalid sequences (Python's "replace" rule), and when the backend strips the dummy-prefix
space, the first token that produces any text loses one leading space if it is a
word piece that starts with one.
"""

from __future__ import annotations

import functools
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

LITERAL_MARK = "\uE000"  # a private-use character: escape_special's mark


class Tokenizer(ABC):
    """A loaded tokenizer. Immutable after construction; safe to share across threads."""

    vocab_size: int
    bos_id: int | None
    eos_ids: tuple[int, ...]  # every id that ends generation (tokenizer + generation_config)
    bos_token: str | None
    eos_token: str | None
    special_tokens: Mapping[str, int]  # text -> id of every special/control token
    special_prefix: tuple[int, ...]  # added in front by encode(..., add_special_tokens=True)
    special_suffix: tuple[int, ...]  # added at the end by encode(..., add_special_tokens=True)
    strips_leading_space: bool  # decode drops the dummy-prefix space of the first word
    chat_template: str | list[dict[str, str]] | None = None

    def __init__(self) -> None:
        self._bytes_cache: dict[int, bytes] = {}
        self._cut_chars: frozenset[str] | None = None

    # -- backend hooks -------------------------------------------------------------------
    @abstractmethod
    def _encode_body(self, text: str) -> list[int]:
        """Ids of `text` at the start of a document, without added special ids."""

    @abstractmethod
    def _encode_continuation(self, text: str) -> list[int]:
        """Ids of `text` when it continues earlier text at a safe cut point."""

    @abstractmethod
    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary string of a token (e.g. "▁Hello", "Ġworld", "<0x0A>", "</s>")."""

    @abstractmethod
    def _raw_token_bytes(self, token_id: int) -> bytes:
        """The bytes a token contributes to the text; special tokens give their text."""

    @abstractmethod
    def _is_word_piece(self, token_id: int) -> bool:
        """True for an ordinary vocabulary piece (not special, not a raw byte token)."""

    # -- shared behaviour ----------------------------------------------------------------
    def encode_body(self, text: str) -> list[int]:
        """Ids of `text` at the start of a document, without added special ids
        (escaped special-token text stays text: see the module docstring)."""
        return self._encode_split(text, at_start=True)

    def encode_continuation(self, text: str) -> list[int]:
        """Ids of `text` when it continues earlier text at a safe cut point."""
        return self._encode_split(text, at_start=False)

    def _encode_split(self, text: str, at_start: bool) -> list[int]:
        pats = self._special_patterns
        if LITERAL_MARK not in text or pats is None:
            return self._encode_body(text) if at_start else self._encode_continuation(text)
        # Pieces end right before each escaped occurrence's mark and resume after it.
        cuts = [m.start() + 1 for m in pats[1].finditer(text)]
        pieces = [text[a:b] for a, b in zip([0] + [c + 1 for c in cuts], cuts + [len(text)])]
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if piece:
                ids += self._encode_body(piece) if at_start and i == 0 else self._encode_continuation(piece)
        return ids

    def escape_special(self, text: str) -> str:
        """`text` with LITERAL_MARK after the first character of every special-token
        text in it, so that encoding keeps it text (one-character tokens stay as
        they are: there is nothing to split)."""
        pats = self._special_patterns
        if pats is None:
            return text
        return pats[0].sub(lambda m: m.group()[0] + LITERAL_MARK + m.group()[1:], text)

    @functools.cached_property
    def _special_patterns(self) -> tuple[re.Pattern[str], re.Pattern[str]] | None:
        """(special-token texts, the same texts escaped), longest first; None if no
        special token has two characters or more."""
        texts = sorted((t for t in self.special_tokens if len(t) > 1), key=len, reverse=True)
        if not texts:
            return None
        return (re.compile("|".join(map(re.escape, texts))),
                re.compile("|".join(re.escape(t[0] + LITERAL_MARK + t[1:]) for t in texts)))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        body = self.encode_body(text)
        if not add_special_tokens:
            return body
        return [*self.special_prefix, *body, *self.special_suffix]

    @property
    def eos_id(self) -> int | None:
        """The tokenizer's own end-of-sequence id (first of eos_ids)."""
        return self.eos_ids[0] if self.eos_ids else None

    @property
    def special_ids(self) -> frozenset[int]:
        ids = getattr(self, "_special_ids", None)
        if ids is None:
            ids = frozenset(self.special_tokens.values())
            self._special_ids = ids
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """Bytes of one token (memoized; the table is read-only after the first call)."""
        b = self._bytes_cache.get(token_id)
        if b is None:
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})")
            b = self._raw_token_bytes(token_id)
            self._bytes_cache[token_id] = b
        return b

    def strip_first(self, token_id: int) -> bool:
        """Whether `token_id`, as the first token with text, loses one leading space."""
        return self.strips_leading_space and self._is_word_piece(token_id)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        special = self.special_ids
        parts: list[bytes] = []
        at_start = True
        for t in ids:
            if skip_special_tokens and t in special:
                continue
            b = self.token_bytes(t)
            if at_start and b:
                if self.strip_first(t) and b.startswith(b" "):
                    b = b[1:]
                at_start = False
            parts.append(b)
        return b"".join(parts).decode("utf-8", errors="replace")

    @property
    def cut_chars(self) -> frozenset[str]:
        """Characters c (among space and newline) such that no ordinary token spans a
        "non-whitespace, c" pair, so c after a non-whitespace character always starts a
        new token (checked over the whole vocabulary once)."""
        if self._cut_chars is None:
            special = self.special_ids
            bodies = [self.token_bytes(t) for t in range(self.vocab_size) if t not in special]
            ok = set()
            for ch in (" ", "\n"):
                bad = re.compile(rb"[^\s]" + re.escape(ch.encode()))
                if not any(bad.search(b) for b in bodies):
                    ok.add(ch)
            self._cut_chars = frozenset(ok)
        return self._cut_chars

    def is_safe_cut(self, text: str, pos: int) -> bool:
        """A position where encoding may be split: a cut character after a non-whitespace
        one. The incremental cache verifies each split anyway; this only picks candidates."""
        return 0 < pos < len(text) and text[pos] in self.cut_chars and not text[pos - 1].isspace()
