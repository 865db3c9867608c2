"""Incremental tokenizer cache: tokenize only the text a new prompt adds.

Agentic clients resend the whole conversation every turn. We keep the body ids of
recent prompts (LRU, bounded by bytes) and, for a new text, splice:

    old text  T : |================ common prefix ===========|-- old tail --|
    new text  T': |================ common prefix ===========|---- new text ----|
                                          c            c2   lcp
                  |<- old ids[:j] reused ->|<- encode_continuation(T'[c:]) ->|

c and c2 are safe cuts (a space or newline after a non-whitespace character, where no
ordinary token spans the two: checked over the vocabulary once) before the
common-prefix end `lcp`. The splice is
accepted only when all three checks pass:
  1. the old ids end with encode_continuation(T[c:])   -> c is a token boundary of T and
     j = len(old ids) - len(that) tokens cover T[:c];
  2. encode_continuation(T[c:c2]) starts both the old tail ids and the new tail ids ->
     the window resynchronizes: the new text did not change tokens before c2;
  3. j >= 1 when T[:c] is non-empty.
Otherwise we try an earlier cut, and after `max_attempts` fall back to a full encode.
The result always equals `tokenizer.encode(text, add_special_tokens)` (property-tested).

Thread safety: the entry table is guarded by a lock; tokenization runs outside it, so
`encode_async` can run long encodes in a worker thread while the event loop serves
other streams (both backends release the GIL while they encode).
"""

from __future__ import annotations

import asyncio
import sys
import threading
from array import array
from collections import OrderedDict
from concurrent.futures import Executor
from dataclasses import dataclass

from ftserve.tokenizer.base import Tokenizer


@dataclass
class IncrementalStats:
    requests: int = 0
    exact_hits: int = 0
    prefix_hits: int = 0  # spliced onto a cached entry
    misses: int = 0  # no useful cached entry: full encode
    fallbacks: int = 0  # a cached entry was found but no splice verified: full encode
    verify_failures: int = 0  # candidate cuts rejected by the checks (each costs a retry)
    tokens_reused: int = 0
    chars_encoded: int = 0  # characters actually run through the tokenizer
    evictions: int = 0


# Host bytes one entry costs beyond its text and ids: the _Entry object plus its slot in
# the OrderedDict (hash table entry + linked-list node); measured with tracemalloc on
# CPython 3.11 (test_memory_bounds.py checks the accounting against tracemalloc).
_ENTRY_OVERHEAD = 160


@dataclass(slots=True)
class _Entry:
    text: str  # also the OrderedDict key (the same object, counted once)
    ids: array  # body ids (no added special tokens), array('i'): 4 bytes each

    @property
    def nbytes(self) -> int:
        """What this entry really holds: the str (1, 2 or 4 bytes a character, as
        CPython stores it) and the array (header + buffer), plus the table overhead."""
        return sys.getsizeof(self.text) + sys.getsizeof(self.ids) + _ENTRY_OVERHEAD


def common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix; galloping blocks, then bisection, so the
    cost is a few memcmp passes rather than a Python loop per character."""
    n = min(len(a), len(b))
    if a.startswith(b[:n]) if len(b) <= len(a) else b.startswith(a):
        return n
    lo, step = 0, 256
    while lo < n:  # invariant: a[:lo] == b[:lo]
        hi = min(n, lo + step)
        if a.startswith(b[lo:hi], lo):
            lo, step = hi, step * 2
            continue
        while hi - lo > 1:  # the first mismatch lies in [lo, hi)
            mid = (lo + hi) // 2
            if a.startswith(b[lo:mid], lo):
                lo = mid
            else:
                hi = mid
        return lo
    return n


class IncrementalTokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        # 64 MiB holds ~64 live 128k-token conversations (~1 MiB each: text + ids); the
        # old 256 MiB default was half of the soak's whole RSS budget (issue 8 item 6).
        max_bytes: int = 64 << 20,
        max_entries: int = 512,
        min_reuse_chars: int = 256,
        window_chars: int = 32,
        max_backoff_chars: int = 8192,
        max_attempts: int = 3,
        inline_chars: int = 8192,
        executor: Executor | None = None,
    ) -> None:
        self.tok = tokenizer
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.min_reuse_chars = min_reuse_chars
        self.window_chars = window_chars
        self.max_backoff_chars = max_backoff_chars
        self.max_attempts = max_attempts
        self.inline_chars = inline_chars
        self.executor = executor
        self.stats = IncrementalStats()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._cut_chars = tuple(tokenizer.cut_chars)  # one vocabulary scan now, not per request

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    # -- public API ----------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Same ids as tokenizer.encode(text, add_special_tokens), reusing cached work."""
        body = self._encode_body(text)
        if not add_special_tokens:
            return body
        return [*self.tok.special_prefix, *body, *self.tok.special_suffix]

    async def encode_async(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Short texts are encoded inline; long ones in a worker thread so the event loop
        keeps streaming other requests while a 170k-token first turn is tokenized."""
        if len(text) <= self.inline_chars:
            return self.encode(text, add_special_tokens)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self.encode, text, add_special_tokens)

    # -- internals -----------------------------------------------------------------------
    def _lookup(self, text: str) -> tuple[_Entry | None, int]:
        with self._lock:
            self.stats.requests += 1
            hit = self._entries.get(text)
            if hit is not None:
                self._entries.move_to_end(text)
                self.stats.exact_hits += 1
                self.stats.tokens_reused += len(hit.ids)
                return hit, len(text)
            best: _Entry | None = None
            best_lcp = 0
            for e in self._entries.values():
                if e.text[:1] != text[:1]:
                    continue
                lcp = common_prefix_len(e.text, text)
                if lcp > best_lcp:
                    best, best_lcp = e, lcp
            if best is not None:
                self._entries.move_to_end(best.text)
            return best, best_lcp

    def _encode_body(self, text: str) -> list[int]:
        entry, lcp = self._lookup(text)
        if entry is not None and lcp == len(text) == len(entry.text):
            return entry.ids.tolist()
        ids: array | None = None
        if entry is not None and lcp >= self.min_reuse_chars:
            ids = self._splice(entry, text, lcp)
            with self._lock:
                if ids is None:
                    self.stats.fallbacks += 1
                else:
                    self.stats.prefix_hits += 1
        else:
            with self._lock:
                self.stats.misses += 1
        if ids is None:
            ids = array("i", self.tok.encode_body(text))
            with self._lock:
                self.stats.chars_encoded += len(text)
        # The new text strictly extends the entry: the entry is dominated (a resend of it
        # splices from the new one), so drop it and keep one entry per conversation.
        parent = entry.text if entry is not None and lcp == len(entry.text) < len(text) else None
        self._insert(text, ids, replaces=parent)
        return ids.tolist()

    def _cut_candidates(self, text: str, lcp: int) -> list[int]:
        """Safe cuts, nearest first, at least `window_chars` before lcp."""
        out: list[int] = []
        floor = max(1, lcp - self.max_backoff_chars)

        def prev(end: int) -> int:
            return max(text.rfind(ch, floor, end) for ch in self._cut_chars)

        pos = prev(lcp)
        while pos >= floor:
            if self.tok.is_safe_cut(text, pos):
                out.append(pos)
                if len(out) > self.max_attempts and lcp - out[-1] >= self.window_chars:
                    break
            pos = prev(pos)
        return out

    def _splice(self, entry: _Entry, text: str, lcp: int) -> array | None:
        tok = self.tok
        if not self._cut_chars:
            return None
        old_text, old_ids = entry.text, entry.ids
        cuts = self._cut_candidates(text, lcp)
        attempts = 0
        # Pair each cut c with the nearest later cut c2 that is still before lcp.
        for k in range(1, len(cuts)):
            c, c2 = cuts[k], cuts[k - 1]
            if lcp - c < self.window_chars:
                continue
            # Re-encoding the old tail costs len(T) - c: not worth it past half a full encode.
            if (len(old_text) - c) + (len(text) - c) > len(text) // 2 + self.inline_chars:
                return None
            attempts += 1
            if attempts > self.max_attempts:
                return None
            old_tail = tok.encode_continuation(old_text[c:])
            j = len(old_ids) - len(old_tail)
            if j < 1 or old_ids[j:] != array("i", old_tail):
                self._count_verify_failure()
                continue
            window = tok.encode_continuation(text[c:c2])
            new_tail = tok.encode_continuation(text[c:])
            w = len(window)
            if old_tail[:w] != window or new_tail[:w] != window:
                self._count_verify_failure()
                continue
            with self._lock:
                self.stats.tokens_reused += j
                self.stats.chars_encoded += (len(old_text) - c) + (len(text) - c) + (c2 - c)
            return old_ids[:j] + array("i", new_tail)  # C-level copies, no int boxing
        return None

    def _count_verify_failure(self) -> None:
        with self._lock:
            self.stats.verify_failures += 1

    def _insert(self, text: str, ids: array, replaces: str | None = None) -> None:
        entry = _Entry(text, ids)  # never mutated after this point
        if entry.nbytes > self.max_bytes:
            return
        with self._lock:
            if replaces is not None:
                dominated = self._entries.pop(replaces, None)
                if dominated is not None:
                    self._bytes -= dominated.nbytes
            old = self._entries.pop(text, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._entries[text] = entry
            self._bytes += entry.nbytes
            while self._bytes > self.max_bytes or len(self._entries) > self.max_entries:
                _, victim = self._entries.popitem(last=False)
                self._bytes -= victim.nbytes
                self.stats.evictions += 1
