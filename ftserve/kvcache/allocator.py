"""Host-side allocator of KV pool pages.

Usable pages are 1..num_pages-1; page 0 is the dummy page of the pool (see
``ftserve.kvcache.pool``) and is never handed out or accepted back. Every usable
page is, at any moment, in exactly one place: this allocator's free list, a live
request's private page list, or the radix prefix cache. ``RadixCache.check_integrity``
verifies that partition; this class keeps its own half of it honest by rejecting
double frees and foreign pages instead of silently corrupting the free list.

All operations are O(pages touched); nothing here touches a device tensor.
"""

from __future__ import annotations

from collections.abc import Iterable

from ftserve.kvcache.pool import DUMMY_PAGE


class PageAllocator:
    """Free list of page ids with an O(1) "is this page free" table."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(
                f"num_pages={num_pages}: the pool needs at least 2 pages (page 0 is the dummy page)"
            )
        self._num_pages = num_pages
        # A stack popped from the end; reversed so a fresh allocator hands out
        # 1, 2, 3, ... which makes logs and test failures easy to read.
        self._free: list[int] = list(range(num_pages - 1, DUMMY_PAGE, -1))
        # _is_free[p] == 1 iff p is on the free list; the dummy page is never free.
        self._is_free = bytearray(b"\x01") * num_pages
        self._is_free[DUMMY_PAGE] = 0

    @property
    def num_pages(self) -> int:
        """Pages of the pool, the dummy page included."""
        return self._num_pages

    @property
    def num_total(self) -> int:
        """Usable pages (all but the dummy page)."""
        return self._num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_total - len(self._free)

    def is_free(self, page: int) -> bool:
        self._check_usable(page)
        return bool(self._is_free[page])

    def free_pages(self) -> list[int]:
        """A copy of the free list (for integrity checks and tests)."""
        return list(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """Take ``n`` pages, or None (and take nothing) when fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > len(self._free):
            return None
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        pages.reverse()
        is_free = self._is_free
        for p in pages:
            is_free[p] = 0
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages. All-or-nothing: a bad page leaves the allocator unchanged."""
        pages = list(pages)
        is_free = self._is_free
        marked = 0
        try:
            for p in pages:
                self._check_usable(p)
                if is_free[p]:
                    raise ValueError(f"double free of page {p}")
                # Mark as we go so a page repeated within this call is caught too.
                is_free[p] = 1
                marked += 1
        except (ValueError, TypeError):
            for p in pages[:marked]:
                is_free[p] = 0
            raise
        self._free.extend(pages)

    def _check_usable(self, page: int) -> None:
        if not isinstance(page, int) or isinstance(page, bool):
            raise TypeError(f"page ids are ints, got {type(page).__name__}")
        if page == DUMMY_PAGE:
            raise ValueError("page 0 is the dummy page; it is never allocated or freed")
        if not 0 < page < self._num_pages:
            raise ValueError(
                f"page {page} is outside the pool (usable pages 1..{self._num_pages - 1})"
            )

    def check_integrity(self) -> None:
        """The free list and the free table agree, and hold no duplicates."""
        assert len(set(self._free)) == len(self._free), "free list holds a page twice"
        assert sum(self._is_free) == len(self._free), (
            f"free table marks {sum(self._is_free)} pages but the free list holds {len(self._free)}"
        )
        for p in self._free:
            assert 0 < p < self._num_pages, (
                f"free list holds page {p} outside 1..{self._num_pages - 1}"
            )
            assert self._is_free[p], f"page {p} is on the free list but not marked free"
