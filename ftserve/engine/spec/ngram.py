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

Index: one dict per n, from an n-gram (its tokens packed into one integer, 32
bits each: exact, no collisions) to the end position of its latest
occurrence. Position j's n-grams go in once the next token exists (a query
must not find the suffix itself), so each token costs max_n dict writes and
a query max_n - min_n + 1 lookups, whatever the length.
"""

from __future__ import annotations

from collections.abc import Iterable

_BITS = 32  # bits per token in a packed key; token ids are below 2^32


class NgramIndex:
    """The n-gram index of one growing token sequence (a request's prompt + output)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        # _latest[n - min_n][key]: end position of the latest indexed occurrence.
        self._latest: list[dict[int, int]] = [{} for _ in range(min_n, max_n + 1)]
        self._indexed = 0  # n-grams ending at positions < _indexed are in the dicts

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        self.tokens.extend(tokens)

    def _keys(self, end: int) -> list[int]:
        """Packed n-grams ending at ``end``, for n = 1 .. min(max_n, end + 1)."""
        s = self.tokens
        keys = []
        key = 0
        for n in range(1, min(self.max_n, end + 1) + 1):
            key |= s[end - n + 1] << (_BITS * (n - 1))
            keys.append(key)
        return keys

    def _catch_up(self) -> None:
        """Index the n-grams ending before the last token."""
        for end in range(self._indexed, len(self.tokens) - 1):
            keys = self._keys(end)
            for n in range(self.min_n, len(keys) + 1):
                self._latest[n - self.min_n][keys[n - 1]] = end
        self._indexed = max(self._indexed, len(self.tokens) - 1)

    def match(self) -> tuple[int, int]:
        """(n, j): the longest suffix length with an earlier occurrence and that
        occurrence's end position (the latest), or (0, -1) when none."""
        L = len(self.tokens)
        if L < self.min_n + 1:
            return 0, -1
        self._catch_up()
        keys = self._keys(L - 1)
        for n in range(len(keys), self.min_n - 1, -1):
            j = self._latest[n - self.min_n].get(keys[n - 1])
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
