"""N-gram proposals from a request's own tokens (prompt lookup), from an index
kept up to date as tokens arrive, never a rescan.

The proposal for a sequence s[0..L-1] continues the most recent earlier
occurrence of its longest suffix of n tokens, n in [min_n, max_n]:

    s:  ... a b c d e f ........ x a b c | ?      suffix "a b c": n = 3
                  ^ j: that occurrence's last token, j <= L - 2
    proposal:   d e f ...                         s[j + 1], s[j + 2], ...

An occurrence that overlaps the suffix (a repeating run) continues the copy
into the proposal itself, as an LZ77 match does: with period p = L - 1 - j,
token m of the proposal is s[j + 1 + m], or proposal[j + 1 + m - L] once the
index passes L. So "x y x y x" proposes "y x y ...".

Index: one dict from an n-gram (a tuple; n-grams of different n never compare
equal) to the end position of its latest occurrence, n in [min_n, max_n].
Position j's n-grams go in once the next token exists (a query must not find
the suffix itself), in bulk: a prompt's are built by dict.update over zipped
slices, in C, not a Python loop per token, and ``catch_up(limit)`` lets a
caller spread a long prompt's over several steps (a 100k-token one is a
quarter second of dict inserts on a slow core); a step's one or few tokens
the same way. A query is max_n - min_n + 1 lookups, whatever the length.

Indexing ahead (``index_ahead``): while a verify step runs, the caller may
index the positions the step will most likely add (its last token's and its
draft's, as if every draft token were kept), logging what each insert
overwrote; ``sync`` with the real tokens later keeps the inserts they confirm
and undoes the rest in reverse order, so the index is exactly the one plain
``extend`` + ``catch_up`` would have built:

    tokens  ... t | d1 d2 d3 d4        indexed ahead: positions of t, d1 .. d4
    kept        t | d1 d2 y2           y2 != d3: t, d1 stay (their next token
                                       exists and matches); d2 .. d4 undone
"""

from __future__ import annotations

from collections.abc import Iterable

_FEW = 16  # positions up to which catch_up inserts one n-gram at a time


class NgramIndex:
    """The n-gram index of one growing token sequence (a request's prompt + output)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        # _latest[n-gram]: end position of its latest indexed occurrence.
        self._latest: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending at positions < _indexed are in the dict
        # index_ahead's first position (-1: none pending) and its inserts in order:
        # (position, n-gram, the end position it replaced or -1 for none).
        self._ahead_from = -1
        self._ahead_log: list[tuple[int, tuple[int, ...], int]] = []

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        assert self._ahead_from < 0, "sync() what was indexed ahead first"
        self.tokens.extend(tokens)

    @property
    def behind(self) -> int:
        """Positions not indexed yet (a query answers only once this is 0)."""
        return max(0, len(self.tokens) - 1 - self._indexed)

    def catch_up(self, limit: int | None = None) -> int:
        """Index the n-grams ending at up to ``limit`` more positions (None: all) of
        _indexed .. L - 2, the positions before the last token; returns how many."""
        s = self.tokens
        start = self._indexed
        stop = len(s) - 1 if limit is None else min(len(s) - 1, start + limit)
        if stop <= start:
            return 0
        if stop - start <= _FEW:  # a step's tokens: plain inserts beat building zips
            self._insert(start, stop, None)
        else:
            latest = self._latest
            for n in range(self.min_n, self.max_n + 1):
                first = max(start, n - 1)  # end position of the first new n-gram
                if first < stop:
                    lo, hi = first - n + 1, stop - n + 1  # their start positions
                    grams = zip(*(s[lo + i:hi + i] for i in range(n)))
                    latest.update(zip(grams, range(first, stop)))
        self._indexed = stop
        return stop - start

    def _insert(self, start: int, stop: int, log: list[tuple[int, tuple[int, ...], int]] | None) -> None:
        """The n-grams ending at positions start .. stop - 1, one at a time (and
        what each replaced, into ``log``)."""
        s, latest, lo, hi = self.tokens, self._latest, self.min_n, self.max_n
        for j in range(start, stop):
            w = s[max(0, j - hi + 1):j + 1]  # the longest n-gram ending at j
            for i in range(len(w) - lo + 1):  # n = len(w) - i, down to min_n
                key = tuple(w[i:])
                if log is not None:
                    log.append((j, key, latest.get(key, -1)))
                latest[key] = j

    def index_ahead(self, draft: list[int]) -> bool:
        """Index the last token's position and the draft's as if a verify step kept
        every draft token (module docstring); ``sync`` settles it. Only on an index
        that is caught up; returns whether it indexed."""
        p = len(self.tokens) - 1
        if p < 0 or self._indexed != p or self._ahead_from >= 0:
            return False
        self._ahead_from = p
        self.tokens.extend(draft)
        self._insert(p, p + len(draft) + 1, self._ahead_log)
        self._indexed = p + len(draft) + 1
        return True

    def sync(self, tokens: list[int]) -> None:
        """Catch up with ``tokens``, the whole sequence (which extends the one
        indexed before any ``index_ahead``): keep each position indexed ahead
        whose token and next token ``tokens`` confirm, undo the rest, then
        extend with what is new."""
        s = self.tokens
        if self._ahead_from >= 0:
            j, n, m = self._ahead_from, len(s), len(tokens)
            while j < n and j + 1 < m and s[j] == tokens[j]:
                j += 1  # position j - 1 is confirmed
            latest, log = self._latest, self._ahead_log
            while log and log[-1][0] >= j:
                _, key, prev = log.pop()
                if prev < 0:
                    del latest[key]
                else:
                    latest[key] = prev
            log.clear()
            del s[j:]
            self._indexed = j
            self._ahead_from = -1
        if len(tokens) > len(s):
            s.extend(tokens[len(s):])

    def match(self) -> tuple[int, int]:
        """(n, j): the longest suffix length with an earlier occurrence and that
        occurrence's end position (the latest), or (0, -1) when none. Indexes what
        is left first (see catch_up for doing that in bounded pieces)."""
        assert self._ahead_from < 0, "sync() what was indexed ahead first"
        s = self.tokens
        L = len(s)
        if L < self.min_n + 1:
            return 0, -1
        if self._indexed < L - 1:
            self.catch_up()
        top = min(self.max_n, L - 1)
        tail = s[L - top:]
        get = self._latest.get
        for i in range(top - self.min_n + 1):  # n = top - i, longest first
            j = get(tuple(tail[i:]))
            if j is not None:
                return top - i, j
        return 0, -1

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens continuing the match (empty: no match, or k <= 0)."""
        if k <= 0:
            return []
        n, j = self.match()
        if n == 0:
            return []
        s, L = self.tokens, len(self.tokens)
        if j + k < L:  # the occurrence's continuation is all behind the suffix
            return s[j + 1:j + 1 + k]
        out: list[int] = []
        for m in range(k):
            i = j + 1 + m
            out.append(s[i] if i < L else out[i - L])
        return out
