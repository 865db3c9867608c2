"""The n-gram proposer's incremental index against a brute-force scan."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftserve.engine.spec.ngram import NgramIndex


def brute_force(s: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Rescan: the longest suffix (n in [min_n, max_n]) with an earlier occurrence
    ending at j <= L - 2, the latest such j; its continuation, copying on into
    the proposal itself where the occurrence overlaps the suffix."""
    L = len(s)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        for j in range(L - 2, n - 2, -1):
            if s[j - n + 1:j + 1] == s[L - n:]:
                seq = list(s)
                for m in range(k):
                    seq.append(seq[j + 1 + m])
                return seq[L:]
    return []


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), max_size=60),
       cuts=st.lists(st.integers(1, 7), max_size=20),
       min_n=st.integers(1, 3), extra=st.integers(0, 3), k=st.integers(0, 6),
       big=st.booleans())
def test_incremental_index_equals_rescan(tokens: list[int], cuts: list[int], min_n: int,
                                         extra: int, k: int, big: bool) -> None:
    """Tokens arrive in uneven pieces (prompt, then one or several per step) and a
    query after each piece proposes exactly what a rescan of everything so far does.
    A small alphabet makes repeats (and overlapping, periodic matches) common;
    ``big`` shifts ids past 2^31 to check the packed keys stay exact."""
    if big:
        tokens = [t + (1 << 31) - 2 for t in tokens]
    idx = NgramIndex(min_n, min_n + extra)
    pos = 0
    pieces = cuts or [len(tokens)]
    i = 0
    while pos < len(tokens):
        step = pieces[i % len(pieces)]
        i += 1
        idx.extend(tokens[pos:pos + step])
        pos += step
        if step % 3 == 0:  # sometimes index in bounded pieces first, as a caller may
            while idx.behind:
                assert idx.catch_up(2) <= 2
        seen = tokens[:pos]
        assert idx.propose(k) == brute_force(seen, min_n, min_n + extra, k), (seen, k)


def test_examples() -> None:
    idx = NgramIndex(2, 3)
    idx.extend([1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert idx.match() == (3, 2)  # "1 2 3" ends at 2
    assert idx.propose(3) == [4, 5, 9]
    idx.extend([7])  # "3 7" never occurred
    assert idx.propose(3) == []
    periodic = NgramIndex(1, 4)
    periodic.extend([5, 8, 5, 8, 5])
    assert periodic.propose(5) == [8, 5, 8, 5, 8]  # the copy runs on into itself
    latest = NgramIndex(1, 1)
    latest.extend([1, 2, 1, 3, 1])
    assert latest.propose(1) == [3]  # the most recent occurrence wins
    with pytest.raises(ValueError):
        NgramIndex(3, 2)


@settings(max_examples=300, deadline=None)
@given(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=30),
       steps=st.lists(st.tuples(st.lists(st.integers(0, 3), max_size=5), st.integers(0, 6),
                                st.integers(0, 3), st.booleans()), max_size=12),
       min_n=st.integers(1, 2), extra=st.integers(0, 2))
def test_indexing_ahead_then_sync_equals_plain_indexing(
        prompt: list[int], steps: list[tuple[list[int], int, int, bool]], min_n: int, extra: int) -> None:
    """A verify step's positions indexed ahead (as if all of its draft were kept),
    then synced with the tokens it really kept (some prefix of the draft and a
    token of its own, sometimes nothing, sometimes more), leave the index exactly
    as plain indexing of those tokens does: same dict, same proposals."""
    idx = NgramIndex(min_n, min_n + extra)
    seq = list(prompt)
    idx.sync(seq)
    for draft, keep, bonus, ahead in steps:
        if ahead:
            idx.catch_up()
            assert idx.index_ahead(draft)
        new = draft[:keep] + ([bonus] if keep <= len(draft) else [bonus, bonus])
        seq += new if keep < 6 else []  # keep 6: the step added nothing
        idx.sync(seq)
        ref = NgramIndex(min_n, min_n + extra)
        ref.extend(seq)
        ref.catch_up()
        idx.catch_up()
        assert idx.tokens == seq and idx._latest == ref._latest
        assert idx.propose(4) == brute_force(seq, min_n, min_n + extra, 4)
