"""Integrity check of a RadixCache over both tiers: a function of its public
state (the tree from ``root``, the allocators, the counters), so it shares no
code with what it checks. Tests run it after every operation; the engine after
every step when asked (``RadixCache.check_integrity``). The invariants are
listed in radix.py's docstring:

Device pages: each usable page is in exactly one of the allocator's free list,
a live request's private pages, or a device node of the tree.
Host pages: each usable page is in exactly one of the host free list or a host
node. Tiers: a device node's parent is the root or a device node; no host node
is locked between calls (only ``restore`` locks host nodes, while it runs).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ftserve.kvcache.radix import RadixCache


class _Owners:
    """Who holds each page of one tier; a second claim is an assertion."""

    def __init__(self, tier: str, num_pages: int) -> None:
        self.tier = tier
        self.num_pages = num_pages
        self.owner: dict[int, str] = {}

    def claim(self, page: int, where: str) -> None:
        assert 0 < page < self.num_pages, (
            f"{where} holds {self.tier} page {page}, outside 1..{self.num_pages - 1}"
        )
        prev = self.owner.get(page)
        assert prev is None, f"{self.tier} page {page} is owned twice: by {prev} and by {where}"
        self.owner[page] = where

    def assert_complete(self) -> None:
        missing = self.num_pages - 1 - len(self.owner)
        assert missing == 0, (
            f"{missing} usable {self.tier} pages are owned by nobody (leaked), e.g. "
            f"{sorted(set(range(1, self.num_pages)) - self.owner.keys())[:8]}"
        )


def check_radix(cache: RadixCache, live_pages: Iterable[int] = ()) -> None:
    ps = cache.page_size
    alloc = cache.allocator
    alloc.check_integrity()
    dev = _Owners("device", alloc.num_pages)
    for p in alloc.free_pages():
        dev.claim(p, "the free list")
    for p in live_pages:
        dev.claim(p, "a live request")
    host = None
    if cache.host is not None:
        cache.host.allocator.check_integrity()
        host = _Owners("host", cache.host.allocator.num_pages)
        for p in cache.host.allocator.free_pages():
            host.claim(p, "the host free list")
    root = cache.root
    assert not root.pages and not root.key and root.parent is None and not root.on_host, (
        "the root must hold no pages"
    )
    evictable = locked = host_pages = 0
    stack = [root]
    while stack:
        n = stack.pop()
        assert n.ref >= 0, f"{n!r} has a negative ref count"
        assert not n.detached, f"{n!r} is in the tree but marked detached"
        if n is not root:
            assert n.pages, f"{n!r} holds no pages"
            # Compact storage is part of the contract (host memory per cached token).
            assert all(isinstance(x, array) and x.typecode == "i" for x in (n.key, n.pages)), (
                f"{n!r} stores its key/pages as {type(n.key)}/{type(n.pages)}, not array('i')"
            )
            assert len(n.key) == len(n.pages) * ps, (
                f"{n!r}: {len(n.key)} tokens for {len(n.pages)} pages of {ps}"
            )
            if n.on_host:
                assert host is not None, f"{n!r} is on the host but there is no host tier"
                assert n.ref == 0, f"host node {n!r} is locked"
                for p in n.pages:
                    host.claim(p, f"host node {n.uid}")
                host_pages += len(n.pages)
            else:
                assert n.parent is root or (n.parent is not None and not n.parent.on_host), (
                    f"device node {n!r} hangs below a host node"
                )
                for p in n.pages:
                    dev.claim(p, f"tree node {n.uid}")
                if n.ref:
                    locked += len(n.pages)
                else:
                    evictable += len(n.pages)
        for first, c in n.children.items():
            assert c.parent is n, f"{c!r} is under {n!r} but points to another parent"
            assert len(first) == ps * c.key.itemsize and c.key[:ps].tobytes() == first, (
                f"{c!r} is filed under key {first!r} but starts with {c.key[:ps].tolist()}"
            )
            assert c.ref <= n.ref, f"child {c!r} has more locks than its parent {n!r}"
            assert c.last_access <= n.last_access, f"child {c!r} accessed after its parent {n!r}"
            stack.append(c)
    assert evictable == cache.evictable_pages, (
        f"evictable_pages counter {cache.evictable_pages} != {evictable} counted in the tree"
    )
    assert locked == cache.locked_pages, (
        f"locked_pages counter {cache.locked_pages} != {locked} counted in the tree"
    )
    assert host_pages == cache.host_cached_pages, (
        f"host_cached_pages counter {cache.host_cached_pages} != {host_pages} counted in the tree"
    )
    dev.assert_complete()
    if host is not None:
        host.assert_complete()
    assert 0 <= cache.hit_tokens_total <= cache.query_tokens_total, "hit counters inconsistent"
