"""Radix prefix cache over token ids, in whole KV pages.

The tree shares FULL pages only. Each node holds a run of whole pages and the
tokens they cache (``len(key) == len(pages) * page_size``); children are keyed
by their first page-sized chunk of tokens, so a lookup costs one dict probe per
node plus one C-level list comparison of the node's tokens::

    root ──(t0..t15)── A: pages [7, 3]  ──(t32..t47)── B: pages [9]
                                        └─(u32..u47)── C: pages [4, 12, 5]

A partial trailing page stays private to its request and is freed when the
request ends; it never enters the tree.

Ownership: every page in the tree is owned by the tree. A request that matched
a prefix reads those pages while it holds ``lock(node)``, which ref-counts the
whole path root..node, so ``evict`` (LRU over unlocked leaves) never frees them.
Invariant: a node's ref count >= each child's, hence an unlocked node's subtree
is unlocked and every unlocked page is reachable by repeated leaf eviction.

How the engine uses it (chunked prefill and finish alike)::

    m = cache.match_prefix(tokens); cache.lock(m.node)      # reuse m.pages
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

import heapq
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ftserve.kvcache.allocator import PageAllocator


class RadixNode:
    """A run of whole pages under one parent (the root holds none)."""

    __slots__ = ("key", "pages", "children", "parent", "ref", "last_access", "uid", "detached")

    def __init__(
        self, key: list[int], pages: list[int], parent: RadixNode | None, uid: int
    ) -> None:
        self.key = key  # tokens cached by `pages`, len == len(pages) * page_size
        self.pages = pages
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.parent = parent
        self.ref = 0  # live locks whose path runs through this node
        self.last_access = 0  # logical clock of the last match/insert through it
        self.uid = uid  # stable tie-break for the eviction heap
        self.detached = False  # evicted or dropped by reset: must not be locked again

    def __repr__(self) -> str:
        return f"RadixNode(uid={self.uid}, pages={self.pages}, ref={self.ref}, children={len(self.children)})"


@dataclass(frozen=True)
class PrefixMatch:
    """Longest cached prefix of a query, in whole pages."""

    pages: list[int]  # tree pages of tokens[:num_tokens], in order
    num_tokens: int  # multiple of page_size
    node: RadixNode  # lock/unlock this to pin exactly `pages`


class RadixCache:
    def __init__(self, page_size: int, allocator: PageAllocator) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.allocator = allocator
        self._uids = itertools.count()
        self.root = RadixNode([], [], None, next(self._uids))
        self._clock = 0
        # Pages in nodes with ref == 0 / ref > 0; kept incrementally so stats are O(1).
        self._evictable_pages = 0
        self._locked_pages = 0
        self.hit_tokens_total = 0
        self.query_tokens_total = 0

    # ---------------------------------------------------------------- stats
    @property
    def cached_pages(self) -> int:
        return self._evictable_pages + self._locked_pages

    @property
    def evictable_pages(self) -> int:
        return self._evictable_pages

    @property
    def locked_pages(self) -> int:
        return self._locked_pages

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens_total / self.query_tokens_total if self.query_tokens_total else 0.0

    # ---------------------------------------------------------------- match
    def match_prefix(self, tokens: Sequence[int], *, count_stats: bool = True) -> PrefixMatch:
        """Longest cached full-page prefix of ``tokens``; refreshes the path's LRU time.

        Returns the true match (possibly all of ``tokens``); the caller caps it
        if it needs a token left to compute logits. A match ending inside a
        node splits that node so ``node`` pins exactly the matched pages.
        ``count_stats=False`` for re-matches that are not new queries.
        """
        toks = tokens if isinstance(tokens, list) else list(tokens)
        ps = self.page_size
        limit = len(toks) // ps * ps
        self._clock += 1
        node = self.root
        node.last_access = self._clock
        pages: list[int] = []
        pos = 0
        while pos < limit:
            child = node.children.get(tuple(toks[pos : pos + ps]))
            if child is None:
                break
            n_pages = self._common_pages(child.key, toks, pos, limit)
            if n_pages < len(child.pages):
                child = self._split(child, n_pages)
            child.last_access = self._clock
            pages.extend(child.pages)
            pos += len(child.key)
            node = child
        if count_stats:
            self.query_tokens_total += len(toks)
            self.hit_tokens_total += pos
        return PrefixMatch(pages=pages, num_tokens=pos, node=node)

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
            if n.ref == 0:
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
            if n.ref == 0:
                self._locked_pages -= len(n.pages)
                self._evictable_pages += len(n.pages)
            n = n.parent

    # ---------------------------------------------------------------- insert
    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> int:
        """Give the tree the full pages of ``tokens``; returns tokens already cached.

        ``pages[i]`` holds tokens[i*page_size:(i+1)*page_size]; pages past the
        last full page are not touched (the caller keeps its partial page).
        Where the tree already has a page for a chunk, the caller's page (if a
        different one) is freed back to the allocator.
        """
        toks = tokens if isinstance(tokens, list) else list(tokens)
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
            first = tuple(toks[pos : pos + ps])
            child = node.children.get(first)
            if child is None:
                p0 = pos // ps
                leaf = RadixNode(toks[pos:limit], list(pages[p0:n_full]), node, next(self._uids))
                leaf.last_access = self._clock
                node.children[first] = leaf
                self._evictable_pages += len(leaf.pages)
                break
            n_pages = self._common_pages(child.key, toks, pos, limit)
            if n_pages < len(child.pages):
                child = self._split(child, n_pages)
            p0 = pos // ps
            for tree_page, own_page in zip(child.pages, pages[p0 : p0 + n_pages]):
                if own_page != tree_page:
                    duplicates.append(own_page)
            child.last_access = self._clock
            pos += len(child.key)
            node = child
        if duplicates:
            self.allocator.free(duplicates)
        return pos

    # ---------------------------------------------------------------- evict
    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` pages from least-recently-used unlocked leaves."""
        if num_pages <= 0:
            return 0
        heap: list[tuple[int, int, RadixNode]] = []
        stack = [self.root]
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            elif n is not self.root and n.ref == 0:
                heap.append((n.last_access, n.uid, n))
        heapq.heapify(heap)
        freed = 0
        ps = self.page_size
        while heap and freed < num_pages:
            _, _, leaf = heapq.heappop(heap)
            take = min(num_pages - freed, len(leaf.pages))
            if take < len(leaf.pages):
                # Trim the leaf's tail: its deepest pages go first, the rest stay cached.
                victims = leaf.pages[-take:]
                del leaf.pages[-take:]
                del leaf.key[-take * ps :]
            else:
                victims = leaf.pages
                parent = leaf.parent
                assert parent is not None
                del parent.children[tuple(leaf.key[:ps])]
                leaf.parent = None
                leaf.detached = True
                leaf.pages = []
                leaf.key = []
                if parent is not self.root and not parent.children and parent.ref == 0:
                    heapq.heappush(heap, (parent.last_access, parent.uid, parent))
            self.allocator.free(victims)
            self._evictable_pages -= len(victims)
            freed += len(victims)
        return freed

    def reset(self) -> bool:
        """Drop the whole tree, freeing its pages; False (and no change) if any page is locked.

        Lifetime hit counters survive a reset. The root stays the same object,
        so a request that holds a lock on the root (an empty match) stays valid.
        """
        if self._locked_pages:
            return False
        stack = list(self.root.children.values())
        freed: list[int] = []
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            freed.extend(n.pages)
            n.detached = True
            n.parent = None
        self.root.children = {}
        self.allocator.free(freed)
        self._evictable_pages = 0
        return True

    # ---------------------------------------------------------------- helpers
    def _common_pages(self, key: list[int], toks: list[int], pos: int, limit: int) -> int:
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
        upper node, which inherits the ref count and access time.
        """
        ps = self.page_size
        cut = n_pages * ps
        parent = node.parent
        assert parent is not None and 0 < n_pages < len(node.pages)
        upper = RadixNode(node.key[:cut], node.pages[:n_pages], parent, next(self._uids))
        upper.ref = node.ref
        upper.last_access = node.last_access
        parent.children[tuple(node.key[:ps])] = upper
        node.key = node.key[cut:]
        node.pages = node.pages[n_pages:]
        node.parent = upper
        upper.children[tuple(node.key[:ps])] = node
        return upper

    # ---------------------------------------------------------------- checks
    def check_integrity(self, live_pages: Iterable[int] = ()) -> None:
        """Assert the page partition and the tree's structural invariants.

        Every usable page is in exactly one of: the allocator's free list,
        ``live_pages`` (held privately by live requests), the tree.
        """
        ps = self.page_size
        alloc = self.allocator
        alloc.check_integrity()
        owner: dict[int, str] = {}

        def claim(page: int, where: str) -> None:
            assert 0 < page < alloc.num_pages, (
                f"{where} holds page {page}, outside 1..{alloc.num_pages - 1}"
            )
            prev = owner.get(page)
            assert prev is None, f"page {page} is owned twice: by {prev} and by {where}"
            owner[page] = where

        for p in alloc.free_pages():
            claim(p, "the free list")
        for p in live_pages:
            claim(p, "a live request")
        root = self.root
        assert not root.pages and not root.key and root.parent is None, (
            "the root must hold no pages"
        )
        evictable = locked = 0
        stack = [root]
        while stack:
            n = stack.pop()
            assert n.ref >= 0, f"{n!r} has a negative ref count"
            assert not n.detached, f"{n!r} is in the tree but marked detached"
            if n is not root:
                assert n.pages, f"{n!r} holds no pages"
                assert len(n.key) == len(n.pages) * ps, (
                    f"{n!r}: {len(n.key)} tokens for {len(n.pages)} pages of {ps}"
                )
                for p in n.pages:
                    claim(p, f"tree node {n.uid}")
                if n.ref:
                    locked += len(n.pages)
                else:
                    evictable += len(n.pages)
            for first, c in n.children.items():
                assert c.parent is n, f"{c!r} is under {n!r} but points to another parent"
                assert len(first) == ps and tuple(c.key[:ps]) == first, (
                    f"{c!r} is filed under key {first} but starts with {c.key[:ps]}"
                )
                assert c.ref <= n.ref, f"child {c!r} has more locks than its parent {n!r}"
                assert c.last_access <= n.last_access, (
                    f"child {c!r} accessed after its parent {n!r}"
                )
                stack.append(c)
        assert evictable == self._evictable_pages, (
            f"evictable_pages counter {self._evictable_pages} != {evictable} counted in the tree"
        )
        assert locked == self._locked_pages, (
            f"locked_pages counter {self._locked_pages} != {locked} counted in the tree"
        )
        missing = alloc.num_total - len(owner)
        assert missing == 0, (
            f"{missing} usable pages are owned by nobody (leaked), e.g. "
            f"{sorted(set(range(1, alloc.num_pages)) - owner.keys())[:8]}"
        )
        assert 0 <= self.hit_tokens_total <= self.query_tokens_total, "hit counters inconsistent"
