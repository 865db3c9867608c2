"""PageAllocator: free list of KV pages, page 0 never handed out."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ftserve.kvcache.allocator import PageAllocator
from ftserve.kvcache.pool import DUMMY_PAGE


def test_fresh_allocator_hands_out_every_usable_page_once() -> None:
    a = PageAllocator(9)
    assert a.num_total == 8 and a.num_free == 8 and a.num_used == 0 and a.num_pages == 9
    pages = a.alloc(8)
    assert pages is not None
    assert sorted(pages) == list(range(1, 9)), "page 0 must never be handed out"
    assert pages == [1, 2, 3, 4, 5, 6, 7, 8], "a fresh allocator hands out pages in order"
    assert a.num_free == 0 and a.num_used == 8
    assert a.alloc(1) is None
    a.check_integrity()


def test_alloc_is_never_partial() -> None:
    a = PageAllocator(5)
    assert a.alloc(5) is None, "only 4 usable pages"
    assert a.num_free == 4, "a failed alloc must take nothing"
    first = a.alloc(3)
    assert first is not None and len(first) == 3
    assert a.alloc(2) is None
    assert a.num_free == 1
    assert a.alloc(0) == []
    last = a.alloc(1)
    assert last is not None and set(first).isdisjoint(last)
    with pytest.raises(ValueError, match="negative"):
        a.alloc(-1)


def test_free_then_realloc() -> None:
    a = PageAllocator(6)
    p = a.alloc(5)
    assert p is not None
    a.free(p[1:3])
    assert a.num_free == 2
    assert not a.is_free(p[0]) and a.is_free(p[1]) and a.is_free(p[2])
    again = a.alloc(2)
    assert again is not None and sorted(again) == sorted(p[1:3])
    a.check_integrity()


@pytest.mark.parametrize("bad", [DUMMY_PAGE, -1, 6, 100])
def test_free_rejects_dummy_and_foreign_pages(bad: int) -> None:
    a = PageAllocator(6)
    p = a.alloc(2)
    assert p is not None
    with pytest.raises(ValueError):
        a.free([p[0], bad])
    # All-or-nothing: the good page in the same call was not freed either.
    assert a.num_free == 3 and not a.is_free(p[0])
    a.check_integrity()


def test_free_rejects_non_int() -> None:
    a = PageAllocator(4)
    a.alloc(2)
    with pytest.raises(TypeError):
        a.free([1.0])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        a.free([True])  # type: ignore[list-item]
    assert a.num_free == 1


def test_double_free_raises_and_changes_nothing() -> None:
    a = PageAllocator(6)
    p = a.alloc(3)
    assert p is not None
    a.free([p[0]])
    with pytest.raises(ValueError, match="double free"):
        a.free([p[1], p[0]])
    assert a.num_free == 3 and not a.is_free(p[1])
    with pytest.raises(ValueError, match="double free"):
        a.free([p[2], p[2]])  # repeated within one call
    assert a.num_free == 3 and not a.is_free(p[2])
    with pytest.raises(ValueError, match="double free"):
        a.free([4])  # never allocated: still on the free list
    a.check_integrity()


def test_too_small_pool_rejected() -> None:
    with pytest.raises(ValueError, match="dummy"):
        PageAllocator(1)
    assert PageAllocator(2).alloc(1) == [1]


def test_is_free_rejects_dummy() -> None:
    with pytest.raises(ValueError):
        PageAllocator(4).is_free(0)


class AllocatorMachine(RuleBasedStateMachine):
    """Random alloc/free sequences against a set model of who holds what."""

    def __init__(self) -> None:
        super().__init__()
        self.a = PageAllocator(17)
        self.held: list[list[int]] = []

    @rule(n=st.integers(0, 20))
    def alloc(self, n: int) -> None:
        free_before = self.a.num_free
        got = self.a.alloc(n)
        if n > free_before:
            assert got is None and self.a.num_free == free_before
            return
        assert got is not None and len(got) == n
        in_use = {p for h in self.held for p in h}
        assert in_use.isdisjoint(got), "handed out a page that is in use"
        assert DUMMY_PAGE not in got
        self.held.append(got)

    @precondition(lambda self: bool(self.held))
    @rule(i=st.integers(0, 1000), cut=st.integers(0, 20))
    def free_some(self, i: int, cut: int) -> None:
        h = self.held[i % len(self.held)]
        self.a.free(h[:cut])
        del h[:cut]

    @precondition(lambda self: any(self.held))
    @rule(i=st.integers(0, 1000))
    def double_free(self, i: int) -> None:
        h = [p for h in self.held for p in h]
        page = h[i % len(h)]
        self.a.free([page])
        with pytest.raises(ValueError):
            self.a.free([page])
        for hh in self.held:
            if page in hh:
                hh.remove(page)

    @invariant()
    def partition(self) -> None:
        self.a.check_integrity()
        in_use = [p for h in self.held for p in h]
        assert len(in_use) == len(set(in_use))
        assert sorted(in_use + self.a.free_pages()) == list(range(1, 17))
        assert self.a.num_used == len(in_use)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
