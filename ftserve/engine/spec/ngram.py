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

Index: one dict per n, from an n-gram (a tuple) to the end position of its
latest occurrence. Position j's n-grams go in once the next token exists (a
query must not find the suffix itself), in bulk: a prompt's are built by
dict.update over zipped slices, in C, not a Python loop per token, and
``catch_up(limit)`` lets a caller spread a long prompt's over several steps
(a 100k-token one is a quarter second of dict inserts on a slow core); a
step's one or few tokens the same way. A query is max_n - min_n + 1 lookups,
whatever the length.
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
        # _latest[n - min_n][n-gram]: end position of the latest indexed occurrence.
        self._latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_n, max_n + 1)]
        self._indexed = 0  # n-grams ending at positions < _indexed are in the dicts

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        self.tokens.extend(tokens)

    @property
    def behind(self) -> int:
        """Positions not indexed yet (a query answers only once this is 0)."""
        return max(0, len(self.tokens) - 1 - self._indexed)

    def catch_up(self, limit: int | None = None) -> int:
        """Index the n-grams ending at up to ``limit`` more positions (None: all) of
        _indexed .. L - 2, the positions before the last token; returns how many."""
        s = self.tokens
        stop = len(s) - 1 if limit is None else min(len(s) - 1, self._indexed + limit)
        if stop <= self._indexed:
            return 0
        if stop - self._indexed <= _FEW:  # a step's tokens: plain inserts beat building zips
            for n, latest in enumerate(self._latest, self.min_n):
                for j in range(max(self._indexed, n - 1), stop):
                    latest[tuple(s[j - n + 1:j + 1])] = j
        else:
            for n, latest in enumerate(self._latest, self.min_n):
                first = max(self._indexed, n - 1)  # end position of the first new n-gram
                if first < stop:
                    lo, hi = first - n + 1, stop - n + 1  # their start positions
                    grams = zip(*(s[lo + i:hi + i] for i in range(n)))
                    latest.update(zip(grams, range(first, stop)))
        done = max(0, stop - self._indexed)
        self._indexed = max(self._indexed, stop)
        return done

    def match(self) -> tuple[int, int]:
        """(n, j): the longest suffix length with an earlier occurrence and that
        occurrence's end position (the latest), or (0, -1) when none. Indexes what
        is left first (see catch_up for doing that in bounded pieces)."""
        L = len(self.tokens)
        if L < self.min_n + 1:
            return 0, -1
        self.catch_up()
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            j = self._latest[n - self.min_n].get(tuple(self.tokens[L - n:]))
            if j is not None:
                return n, j
        return 0, -1

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens continuing the match (empty: no match, or k <= 0)."""
        if k <= 0:
            return []
        n, j = self.match()
        if n == 0:
            return []
        s, L = self.tokens, len(self.tokens)
        out: list[int] = []
        for m in range(k):
            i = j + 1 + m
            out.append(s[i] if i < L else out[i - L])
        return out
