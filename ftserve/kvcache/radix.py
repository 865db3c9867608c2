"""Radix prefix cache over token ids, in whole KV pages, on a device and a host tier.

Interface (the scheduler, ``engine/prefix_sharing.py`` and the engine's stats
are the only callers)::

    match_prefix(tokens, count_stats=True) -> PrefixMatch
        Longest cached full-page prefix of ``tokens``: its device part
        (``pages``, ``num_tokens``, ``node``) and how far it runs on into
        host-tier nodes (``host_tokens``, ``host_node``). Refreshes the LRU time
        of the whole walked path, both tiers. May split a node, so that ``node``
        pins exactly ``pages``; frees and moves nothing.
    restore(match) -> PrefixMatch
        Gives the host part of ``match`` device pages again, top-down, as many
        whole pages as the device has free or can evict, and plans their loads;
        returns the device match it grew to (``host_tokens == 0``).
    lock(node) / unlock(node)
        Ref-counts the path root..node. Lock a match before calling anything
        that can evict (insert, restore, evict): until then its nodes may be
        trimmed, moved or dropped and its page list goes stale.
    insert(tokens, pages) -> int
        The tree takes the full pages of ``tokens``; returns how many tokens it
        already held. For a chunk it holds on the device, the caller's page (if
        another) is freed; for a chunk it holds on the host, the caller's fresh
        device page replaces the host page (freed, no copy).
    evict(num_pages) -> int
        Frees up to ``num_pages`` device pages, LRU first; with a host tier
        their KV moves to host pages (planned offloads) instead of being dropped.
    reset() -> bool
        Drops both tiers, unless a device page is locked (then False, no change).
    check_integrity(live_pages)
        Asserts every invariant below (radix_check.py).
    cached_pages, evictable_pages, locked_pages, host_cached_pages,
    hit_tokens_total, query_tokens_total, host_hit_tokens_total,
    host_dropped_pages_total
        Counters, O(1); lifetime totals survive a reset.

The host tier (host_tier.py) is driven from here, never the other way round:
the cache owns the host page ids it holds (``HostKVTier.alloc`` / ``free``)
and plans every copy (``queue_offload``, ``queue_load``); the host tier runs
them in planning order before the next step, so a page this class frees (an
offload's device source, a load's host source) may be handed out at once.

How the engine uses it (chunked prefill and finish alike)::

    m = cache.restore(cache.match_prefix(tokens))  # bring host pages back
    cache.lock(m.node)                             # reuse m.pages
    ... allocate private pages, run forward over tokens[m.num_tokens:] ...
    cache.insert(tokens, pages)       # tree takes the full pages, frees duplicates
    m2 = cache.match_prefix(tokens)   # the tree's pages for those full pages
    cache.lock(m2.node); cache.unlock(m.node)
    pages = m2.pages + pages[len(m2.pages):]        # keep the private tail

After ``insert`` the caller must not use its own copies of the full pages any
more: where the tree already held a page for a chunk, the caller's duplicate
went back to the allocator.

The tree. It shares FULL pages only. Each node holds a run of whole pages and
the tokens they cache (``len(key) == len(pages) * page_size``); children are
keyed by the bytes of their first page-sized chunk of tokens, so a lookup costs
one dict probe per node plus one memcmp of the node's tokens. A partial
trailing page stays private to its request and never enters the tree. One
conversation of 80 tokens (page size 16) after an eviction, then a restore
with a single free device page::

    tokens   0               32       48                80
             |====== A ======|== B ===|======= C ========|
    A  device pages [7, 3]   ref 2: two live requests matched through A
    B  device page  [9]      ref 0: the next device victim (no device child)
    C  host pages   [4, 12]  ref 0: offloaded by an eviction; host LRU victim

    match_prefix(all 80) -> pages [7, 3, 9], num_tokens 48, node B,
                            host_tokens 32, host_node C
    restore(that match), one device page free: C is split, its top page loaded

             |====== A ======|== B ===|== C' ==|== C ===|
    C' device page  [11]     new node: load host 4 -> device 11 planned, host 4 freed
    C  host page    [12]     the same object as before, now C' 's child

Invariants of the state (``check_integrity`` asserts them after any call):

- Pages: every usable device page is in exactly one of the allocator's free
  list, a live request's private pages, or one device node; every usable host
  page in exactly one of the host free list or one host node.
- Tiers: a node's pages are all on the device or all on the host
  (``on_host``); a device node's parent is the root or a device node. So the
  device nodes form a top subtree, host nodes hang below it, and a match is
  device pages followed by host pages.
- Locks: ``node.ref`` counts the live locks whose path runs through it, so a
  parent's ref >= each child's and an unlocked node's subtree is unlocked:
  every unlocked page can be reached by repeated leaf eviction. Requests lock
  device nodes only (a match's ``node``); host nodes are locked only inside
  ``restore``, which pins its path against both evictions while it works.
- LRU: a node's ``last_access`` >= its children's (every match and insert
  walks from the root).
- Counters: ``evictable_pages`` (unlocked device), ``locked_pages`` (locked
  device) and ``host_cached_pages`` equal what the tree holds.

Eviction order (test_radix_stateful.py checks it against a naive twin):
device eviction takes the least recently used unlocked device node with no
device children, deepest pages first, and offloads them (dropping them, with
the host subtree below, only when the host tier cannot make room: they
outnumber it, or a restore has the rest pinned); host
eviction drops the least recently used unlocked host leaf, deepest pages
first. A split keeps the lower part in the original object, so a lock on it
still pins the same pages; a node taken out of the tree is marked
``detached`` and can never be locked again.

Memory: the tree lives for hours and holds millions of tokens, so keys and
page lists are ``array('i')`` (4 bytes an entry) rather than lists of Python
ints (8-byte pointer + 32-byte int object each): about 4.5 host bytes per cached
token instead of ~40 (numbers in test_memory_bounds.py). Each public call
converts its token list to an array once; slices then compare at C speed.
Match results (``PrefixMatch.pages``) are plain lists for the caller.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ftserve.kvcache.allocator import PageAllocator
from ftserve.kvcache.radix_check import check_radix

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
        self.uid = uid  # stable tie-break for the eviction heaps
        self.detached = False  # out of the tree (evicted or reset): must not be locked again
        self.on_host = on_host

    def __repr__(self) -> str:
        tier = "host" if self.on_host else "device"
        return (f"RadixNode(uid={self.uid}, {tier} pages={self.pages.tolist()}, ref={self.ref}, "
                f"children={len(self.children)})")


@dataclass(frozen=True)
class PrefixMatch:
    """Longest cached prefix of a query, in whole pages.

    ``pages``/``num_tokens``/``node`` cover the device part; a match that runs
    on into host-tier nodes says so in ``host_tokens`` (tokens cached on the
    host past ``num_tokens``) and ``host_node`` (the deepest matched node), for
    ``RadixCache.restore``.
    """

    pages: list[int]  # device pages of tokens[:num_tokens], in order
    num_tokens: int  # multiple of page_size
    node: RadixNode  # lock/unlock this to pin exactly `pages`
    host_tokens: int = 0
    host_node: RadixNode | None = None


class RadixCache:
    """The prefix tree over both tiers; see the module docstring for the contract."""

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
        # tree; kept incrementally (_account) so the stats are O(1).
        self._evictable_pages = 0
        self._locked_pages = 0
        self._host_pages = 0
        self.hit_tokens_total = 0  # query tokens served from device pages (restores included)
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

    def restore(self, match: PrefixMatch) -> PrefixMatch:
        """Bring the host-tier part of ``match`` back to device pages (as many
        whole pages as the device can free, top-down) and return the device
        match. Plans the loads; the host tier performs them before the next step."""
        target = match.host_node
        if target is None or self.host is None:
            return match
        self.lock(target)  # pins the whole path, both tiers, against both evictions
        try:
            host_nodes: list[RadixNode] = []
            n: RadixNode | None = target
            while n is not None and n.on_host:
                host_nodes.append(n)
                n = n.parent
            host_nodes.reverse()
            need = sum(len(h.pages) for h in host_nodes)
            if self.allocator.num_free < need:
                self.evict(need - self.allocator.num_free)
            avail = self.allocator.num_free
            pages, num_tokens, node = list(match.pages), match.num_tokens, match.node
            for h in host_nodes:
                if avail == 0:
                    break
                partial = len(h.pages) > avail
                if partial:
                    h = self._split(h, avail)  # load the upper part; the rest stays on host
                dev = self.allocator.alloc(len(h.pages))
                assert dev is not None
                self.host.queue_load(h.pages, dev)
                self._set_device_pages(h, array("i", dev))
                avail -= len(dev)
                pages += dev
                num_tokens += len(h.key)
                node = h
                if partial:
                    break
        finally:
            self.unlock(target)
        self.hit_tokens_total += num_tokens - match.num_tokens
        self.host_hit_tokens_total += num_tokens - match.num_tokens
        return dataclasses.replace(match, pages=pages, num_tokens=num_tokens, node=node,
                                   host_tokens=0, host_node=None)

    # ---------------------------------------------------------------- locks
    def lock(self, node: RadixNode) -> None:
        """Pin every page on root..node against eviction (counted; pair with unlock)."""
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
                self._account(leaf, 1)
                break
            n_pages = self._common_pages(child.key, toks, pos, limit)
            if n_pages < len(child.pages):
                child = self._split(child, n_pages)
            p0 = pos // ps
            own = array("i", pages[p0 : p0 + n_pages])
            if child.on_host:
                # Walking top-down, `node` is the root or a device node, so the
                # tier invariant holds after this node turns device.
                self._set_device_pages(child, own)
            else:
                duplicates.extend(o for t, o in zip(child.pages, own) if o != t)
            child.last_access = self._clock
            pos += len(child.key)
            node = child
        if duplicates:
            self.allocator.free(duplicates)
        return pos

    # ---------------------------------------------------------------- evict
    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` device pages from the least recently used
        unlocked device nodes that have no device children, deepest pages
        first. With a host tier their KV moves to host pages (dropped only when
        the host tier has no room even after its own LRU eviction); without one
        it is dropped."""
        if num_pages <= 0:
            return 0
        heap: list[tuple[int, int, RadixNode]] = []
        stack = [self.root]
        while stack:
            n = stack.pop()
            dev_children = [c for c in n.children.values() if not c.on_host]
            if dev_children:
                stack.extend(dev_children)  # host subtrees hold no device pages
            elif n is not self.root and n.ref == 0 and not n.on_host:
                heap.append((n.last_access, n.uid, n))
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            _, _, leaf = heapq.heappop(heap)
            take = min(num_pages - freed, len(leaf.pages))
            parent = leaf.parent
            assert parent is not None
            if take < len(leaf.pages):
                # The deepest `take` pages keep `leaf`'s identity and its (host) children.
                parent = self._split(leaf, len(leaf.pages) - take)
            if self.host is None or not self._offload(leaf):
                self._drop_subtree(leaf)
            freed += take
            if (parent is not self.root and parent.ref == 0 and not parent.on_host
                    and all(c.on_host for c in parent.children.values())):
                heapq.heappush(heap, (parent.last_access, parent.uid, parent))
        return freed

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

    # ---------------------------------------------------------------- checks
    def check_integrity(self, live_pages: Iterable[int] = ()) -> None:
        """Assert the page partition of both tiers and the tree's invariants
        (module docstring); ``live_pages``: the private pages of live requests."""
        check_radix(self, live_pages)

    # ---------------------------------------------------------------- tree helpers
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
        upper node, which inherits the ref count, access time and tier (so the
        counters do not change).
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

    def _drop_subtree(self, node: RadixNode) -> None:
        """Take an unlocked node and everything below it out of the tree,
        freeing both tiers' pages (device eviction without host room, host
        eviction, reset)."""
        parent = node.parent
        assert parent is not None
        del parent.children[self._first(node)]
        stack = [node]
        while stack:
            n = stack.pop()
            assert n.ref == 0
            stack.extend(n.children.values())
            self._account(n, -1)
            if n.on_host:
                assert self.host is not None
                self.host.free(n.pages)
                self.host_dropped_pages_total += len(n.pages)
            else:
                self.allocator.free(n.pages)
            n.pages, n.key = array("i"), array("i")
            n.detached, n.parent, n.children = True, None, {}

    def _account(self, node: RadixNode, sign: int) -> None:
        """Add (sign 1) or take out (-1) ``node``'s pages in the counter of its
        tier and lock state; bracket every change of a node's pages or tier."""
        n = sign * len(node.pages)
        if node.on_host:
            self._host_pages += n
        elif node.ref:
            self._locked_pages += n
        else:
            self._evictable_pages += n

    # ---------------------------------------------------------------- tier moves
    def _set_device_pages(self, node: RadixNode, device_pages: array) -> None:
        """A host node takes device pages holding (or, for a restore, about to
        be loaded with) the same KV; its host pages are freed."""
        assert self.host is not None and node.on_host and len(device_pages) == len(node.pages)
        self.host.free(node.pages)
        self._account(node, -1)
        node.pages, node.on_host = device_pages, False
        self._account(node, 1)

    def _offload(self, node: RadixNode) -> bool:
        """Move an unlocked device node's KV to host pages (a planned copy);
        False when the host tier cannot make room."""
        assert self.host is not None and not node.on_host and node.ref == 0
        got = self._host_alloc(len(node.pages))
        if got is None:
            return False
        host_pages = array("i", got)
        self.host.queue_offload(node.pages, host_pages)
        # Safe to reuse at once: the next step waits for this copy (HostKVTier.flush).
        self.allocator.free(node.pages)
        self._account(node, -1)
        node.pages, node.on_host = host_pages, True
        self._account(node, 1)
        return True

    def _host_alloc(self, n: int) -> list[int] | None:
        host = self.host
        assert host is not None
        if n > host.num_total:
            return None
        if host.num_free < n:
            self._evict_host(n - host.num_free)
        return host.alloc(n)

    def _evict_host(self, num_pages: int) -> None:
        """Drop up to ``num_pages`` host pages from the least recently used
        unlocked host leaves, deepest pages first."""
        heap: list[tuple[int, int, RadixNode]] = []
        stack = [self.root]
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            elif n.on_host and n.ref == 0:
                heap.append((n.last_access, n.uid, n))
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            _, _, leaf = heapq.heappop(heap)
            take = min(num_pages - freed, len(leaf.pages))
            parent = leaf.parent
            assert parent is not None
            if take < len(leaf.pages):
                parent = self._split(leaf, len(leaf.pages) - take)
            self._drop_subtree(leaf)
            freed += take
            if parent.on_host and not parent.children and parent.ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.uid, parent))
