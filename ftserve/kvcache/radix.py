"""Radix prefix cache over token ids, in whole KV pages, over two tiers.

The tree shares FULL pages only. Each node holds a run of whole pages and the
tokens they cache (``len(key) == len(pages) * page_size``); children are keyed
by the bytes of their first page-sized chunk of tokens, so a lookup costs one
dict probe per node plus one memcmp of the node's tokens::

    root ──(t0..t15)── A: pages [7, 3]  ──(t32..t47)── B: pages [9]
                                        └─(u32..u47)── C: host pages [4, 12, 5]

Memory: the tree lives for hours and holds millions of tokens, so keys and
page lists are ``array('i')`` (4 bytes an entry) rather than lists of Python
ints (8-byte pointer + 32-byte int object each): about 4.5 host bytes per cached
token instead of ~40 (numbers in test_memory_bounds.py). Each public call
converts its token list to an array once; slices then compare at C speed.
Match results (``PrefixMatch.pages``) are plain lists for the caller.

A partial trailing page stays private to its request and is freed when the
request ends; it never enters the tree.

Tiers: a node's pages are all device pages (``PageAllocator``) or, with a host
tier, all host pages (``HostKVTier``, ``node.on_host``). A device node's parent
is a device node or the root, so the device part of the tree is a top subtree
and host nodes hang below it. Device eviction takes the least recently used
unlocked device node with no device children and, when a host tier exists,
moves its KV to host pages (an offload) instead of dropping it; the host tier
drops its own least recently used unlocked leaves when it needs room. A match
that runs into host nodes is brought back by ``restore`` (a load), which turns
them into device nodes again. Page moves are only planned here; the host tier
performs them in planning order before the next step (see host_tier.py).
Device eviction (``evict`` and the drops it makes) lives in radix_evict.py.

Ownership: every page in the tree is owned by the tree. A request that matched
a prefix reads those pages while it holds ``lock(node)``, which ref-counts the
whole path root..node, so ``evict`` never frees or moves them.
Invariant: a node's ref count >= each child's, hence an unlocked node's subtree
is unlocked and every unlocked page is reachable by repeated leaf eviction.

How the engine uses it (chunked prefill and finish alike)::

    m = cache.restore(cache.match_prefix(tokens))  # bring host pages back
    cache.lock(m.node)                                      # reuse m.pages
    ... allocate private pages, run forward over tokens[m.num_tokens:] ...
    cache.insert(tokens, pages)       # tree takes the full pages, frees duplicates
    m2 = cache.match_prefix(tokens)   # the tree's pages for those full pages
    cache.lock(m2.node); cache.unlock(m.node)
    pages = m2.pages + pages[len(m2.pages):]                 # keep the private tail

After ``insert`` the caller must not use its own copies of the full pages any
more: where the tree already held a page for a chunk, the caller's duplicate
page went back to the allocator.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ftserve.kvcache.allocator import PageAllocator
from ftserve.kvcache.radix_evict import DeviceEviction
from ftserve.kvcache.radix_tiers import TierMoves

if TYPE_CHECKING:
    from ftserve.kvcache.host_tier import HostKVTier


def as_token_array(tokens: Sequence[int]) -> array:
    """``tokens`` as an ``array('i')`` (shared, not copied, if it already is one)."""
    if isinstance(tokens, array) and tokens.typecode == "i":
        return tokens
    return array("i", tokens)


class RadixNode:
    """A run of whole pages under one parent (the root holds none)."""

    __slots__ = ("key", "pages", "children", "parent", "ref", "last_access", "uid", "detached",
                 "on_host")

    def __init__(
        self, key: array, pages: array, parent: RadixNode | None, uid: int,
        on_host: bool = False,
    ) -> None:
        self.key = key  # array('i'): tokens cached by `pages`, len == len(pages) * page_size
        self.pages = pages  # array('i'): device page ids, or host page ids when on_host
        # keyed by child.key[:page_size].tobytes() (see RadixCache._first)
        self.children: dict[bytes, RadixNode] = {}
        self.parent = parent
        self.ref = 0  # live locks whose path runs through this node
        self.last_access = 0  # logical clock of the last match/insert through it
        self.uid = uid  # stable tie-break for the eviction heap
        self.detached = False  # evicted or dropped by reset: must not be locked again
        self.on_host = on_host

    def __repr__(self) -> str:
        tier = "host" if self.on_host else "device"
        return (f"RadixNode(uid={self.uid}, {tier} pages={self.pages.tolist()}, ref={self.ref}, "
                f"children={len(self.children)})")


@dataclass(frozen=True)
class PrefixMatch:
    """Longest cached prefix of a query, in whole pages.

    ``pages``/``num_tokens``/``node`` cover the device-resident part; a match
    that continues into host-tier nodes says so in ``host_tokens`` (extra
    tokens cached on the host) and ``host_node`` (deepest matched node), for
    ``RadixCache.restore``.
    """

    pages: list[int]  # device pages of tokens[:num_tokens], in order
    num_tokens: int  # multiple of page_size
    node: RadixNode  # lock/unlock this to pin exactly `pages`
    host_tokens: int = 0
    host_node: RadixNode | None = None


class RadixCache(TierMoves, DeviceEviction):
    def __init__(
        self, page_size: int, allocator: PageAllocator, host: HostKVTier | None = None
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if host is not None and host.page_size != page_size:
            raise ValueError(f"host tier page size {host.page_size} != {page_size}")
        self.page_size = page_size
        self.allocator = allocator
        self.host = host
        self._uids = itertools.count()
        self.root = RadixNode(array("i"), array("i"), None, next(self._uids))
        self._clock = 0
        # Device pages in nodes with ref == 0 / ref > 0, and host pages in the
        # tree; kept incrementally so stats are O(1).
        self._evictable_pages = 0
        self._locked_pages = 0
        self._host_pages = 0
        self.hit_tokens_total = 0
        self.query_tokens_total = 0
        self.host_hit_tokens_total = 0  # tokens brought back from the host tier
        self.host_dropped_pages_total = 0  # host pages dropped (host LRU or reset)

    # ---------------------------------------------------------------- stats
    @property
    def cached_pages(self) -> int:
        """Device pages held by the tree."""
        return self._evictable_pages + self._locked_pages

    @property
    def evictable_pages(self) -> int:
        return self._evictable_pages

    @property
    def locked_pages(self) -> int:
        return self._locked_pages

    @property
    def host_cached_pages(self) -> int:
        """Host pages held by the tree."""
        return self._host_pages

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens_total / self.query_tokens_total if self.query_tokens_total else 0.0

    # ---------------------------------------------------------------- match
    def match_prefix(self, tokens: Sequence[int], *, count_stats: bool = True) -> PrefixMatch:
        """Longest cached full-page prefix of ``tokens``; refreshes the path's LRU time.

        Returns the true match (possibly all of ``tokens``); the caller caps it
        if it needs a token left to compute logits. A match ending inside a
        node splits that node so ``node`` pins exactly the matched pages.
        ``count_stats=False`` for re-matches that are not new queries. A list
        costs one conversion to ``array('i')`` (~20 ns a token); an ``array('i')``
        is used as is.
        """
        toks = as_token_array(tokens)
        ps = self.page_size
        limit = len(toks) // ps * ps
        self._clock += 1
        node = self.root
        node.last_access = self._clock
        pages: list[int] = []
        pos = 0
        dev: tuple[int, RadixNode] | None = None  # (tokens, node) where the device part ends
        while pos < limit:
            child = node.children.get(toks[pos : pos + ps].tobytes())
            if child is None:
                break
            n_pages = self._common_pages(child.key, toks, pos, limit)
            if n_pages < len(child.pages):
                child = self._split(child, n_pages)
            child.last_access = self._clock
            if child.on_host and dev is None:
                dev = (pos, node)
            if dev is None:
                pages.extend(child.pages)
            pos += len(child.key)
            node = child
        dev_tokens, dev_node = dev if dev is not None else (pos, node)
        if count_stats:
            self.query_tokens_total += len(toks)
            self.hit_tokens_total += dev_tokens
        if dev is None:
            return PrefixMatch(pages=pages, num_tokens=pos, node=node)
        return PrefixMatch(pages=pages, num_tokens=dev_tokens, node=dev_node,
                           host_tokens=pos - dev_tokens, host_node=node)

    # ---------------------------------------------------------------- locks
    def lock(self, node: RadixNode) -> None:
        """Pin every page on root..node against eviction (counted; pair with unlock).

        Lock a match before anything can evict: until then ``evict`` may trim
        or drop the matched node and the match's page list goes stale.
        """
        if node.detached:
            raise ValueError(f"cannot lock {node!r}: it was evicted or reset out of the tree")
        n: RadixNode | None = node
        while n is not None:
            if n.ref == 0 and not n.on_host:
                self._evictable_pages -= len(n.pages)
                self._locked_pages += len(n.pages)
            n.ref += 1
            n = n.parent

    def unlock(self, node: RadixNode) -> None:
        # Ancestors' counts are >= node's, so checking node alone keeps all >= 0.
        if node.ref <= 0:
            raise ValueError(f"unlock of {node!r} without a matching lock")
        n: RadixNode | None = node
        while n is not None:
            n.ref -= 1
            if n.ref == 0 and not n.on_host:
                self._locked_pages -= len(n.pages)
                self._evictable_pages += len(n.pages)
            n = n.parent

    # ---------------------------------------------------------------- insert
    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> int:
        """Give the tree the full pages of ``tokens``; returns tokens already cached.

        ``pages[i]`` holds tokens[i*page_size:(i+1)*page_size]; pages past the
        last full page are not touched (the caller keeps its partial page).
        Where the tree already has a device page for a chunk, the caller's page
        (if a different one) is freed back to the allocator. Where it has a
        host page, the caller's fresh device page replaces it (no copy needed).
        """
        toks = as_token_array(tokens)
        ps = self.page_size
        n_full = len(toks) // ps
        if len(pages) < n_full:
            raise ValueError(
                f"insert of {n_full} full pages of tokens with only {len(pages)} pages"
            )
        limit = n_full * ps
        self._clock += 1
        node = self.root
        node.last_access = self._clock
        pos = 0
        duplicates: list[int] = []
        while pos < limit:
            first = toks[pos : pos + ps].tobytes()
            child = node.children.get(first)
            if child is None:
                p0 = pos // ps
                leaf = RadixNode(toks[pos:limit], array("i", pages[p0:n_full]), node,
                                 next(self._uids))
                leaf.last_access = self._clock
                node.children[first] = leaf
                self._evictable_pages += len(leaf.pages)
                break
            n_pages = self._common_pages(child.key, toks, pos, limit)
            if n_pages < len(child.pages):
                child = self._split(child, n_pages)
            p0 = pos // ps
            own = array("i", pages[p0 : p0 + n_pages])
            if child.on_host:
                # Walking top-down, `node` is the root or a device node, so the
                # tier invariant holds after this node turns device.
                self._to_device(child, own)
            else:
                duplicates.extend(o for t, o in zip(child.pages, own) if o != t)
            child.last_access = self._clock
            pos += len(child.key)
            node = child
        if duplicates:
            self.allocator.free(duplicates)
        return pos

    # ---------------------------------------------------------------- reset
    def reset(self) -> bool:
        """Drop the whole tree (both tiers), freeing its pages; False (and no
        change) if any page is locked.

        Lifetime hit counters survive a reset. The root stays the same object,
        so a request that holds a lock on the root (an empty match) stays valid.
        """
        if self._locked_pages:
            return False
        for child in list(self.root.children.values()):
            self._drop_subtree(child)
        return True

    # ---------------------------------------------------------------- helpers
    def _first(self, node: RadixNode) -> bytes:
        """The key ``node`` is filed under in its parent's ``children``."""
        return node.key[: self.page_size].tobytes()

    def _common_pages(self, key: array, toks: array, pos: int, limit: int) -> int:
        """Whole pages of ``key`` equal to toks[pos:limit] from the start (>= 1 here,
        since the caller found the child by its first chunk)."""
        n = len(key)
        if pos + n <= limit and toks[pos : pos + n] == key:
            return n // self.page_size  # the common case: the whole node matches
        ps = self.page_size
        avail = min(n, limit - pos)
        k = ps  # first chunk matched via the dict key
        while k < avail and toks[pos + k : pos + k + ps] == key[k : k + ps]:
            k += ps
        return k // ps

    def _split(self, node: RadixNode, n_pages: int) -> RadixNode:
        """Cut ``node`` after n_pages pages; returns the new upper node.

        The lower part keeps the original object, so a holder of ``node`` (a
        lock) still pins the same pages, and its path now runs through the new
        upper node, which inherits the ref count, access time and tier.
        """
        ps = self.page_size
        cut = n_pages * ps
        parent = node.parent
        assert parent is not None and 0 < n_pages < len(node.pages)
        upper = RadixNode(node.key[:cut], node.pages[:n_pages], parent, next(self._uids),
                          on_host=node.on_host)
        upper.ref = node.ref
        upper.last_access = node.last_access
        parent.children[self._first(node)] = upper
        node.key = node.key[cut:]
        node.pages = node.pages[n_pages:]
        node.parent = upper
        upper.children[self._first(node)] = node
        return upper

    # ---------------------------------------------------------------- checks
    def check_integrity(self, live_pages: Iterable[int] = ()) -> None:
        """Assert the page partition of both tiers and the tree's invariants.

        Every usable device page is in exactly one of: the allocator's free
        list, ``live_pages`` (held privately by live requests), a device node.
        Every usable host page is in exactly one of: the host free list, a host node.
        """
        from ftserve.kvcache.radix_check import check_radix

        check_radix(self, live_pages)
