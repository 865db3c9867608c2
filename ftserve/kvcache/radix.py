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
    alloc_state() -> int | None / free_state(slot)
        Stateful caches (hybrid models, below): a state-pool slot for the caller
        to save a checkpoint into, within ``max_states`` (evicting the LRU
        unlocked leaf, pages and checkpoint, when at the cap; None when nothing
        can go); or back unused. A slot handed out returns through ``insert``
        (``states``) or ``free_state``.
    check_integrity(live_pages, live_states)
        Asserts every invariant below (radix_check.py).
    cached_pages, evictable_pages, locked_pages, host_cached_pages,
    cached_states, states_out, hit_tokens_total, query_tokens_total,
    host_hit_tokens_total, host_dropped_pages_total
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

State checkpoints (hybrid models: ``states``, a StatePool, given). A
linear-attention layer's state after token t is not in any page: a cached
prefix is usable only up to a length where a checkpoint of that state was
saved. A node may hold one (``node.state``: the state-pool slot with the
state after the node's last token), so checkpoints sit at node ends, and::

    tokens   0        16       32                64
             |== A ===|== B ===|======= C ========|
    A  state 5     B  no state (split off C by a match)     C  state 9

    match_prefix(tokens) -> pages as ever, and state_tokens 16 (A's end),
                            state_node A, state_slot 5: the hit is usable
                            up to 16; lock A, copy slot 5 into the request's

- Every leaf holds a checkpoint: pages with no checkpoint at or below them
  could never be used, so ``insert`` takes pages only up to a checkpoint (the
  caller's contract: its last page ends at one it gives or the tree holds)
  and eviction drops whole leaves, then any parent left a leaf without one.
- Checkpoints go with their pages and the other way round: evicting a leaf
  frees its checkpoint; a checkpoint is evicted (``alloc_state`` at the cap)
  only as the LRU unlocked leaf, with its pages.
- ``lock`` pins checkpoints with pages; requests lock checkpointed nodes (or
  the root) only.
- With a host tier (its own state slots, ``HostKVTier.states``) a node's
  checkpoint moves with its pages: an offload plans a state move beside the
  page moves (and drops the node, pages and checkpoint, where the host has no
  slot left even after its LRU); ``restore`` brings back whole host nodes down
  to the deepest checkpoint that fits, each checkpoint into a device slot
  within ``max_states``; ``insert`` over a host node with a checkpoint loads
  it back where a device slot is free without evicting, else drops it (the
  caller's pages then end at a checkpoint of its own). A host node's
  ``state`` is a host state slot.

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
    from ftserve.kvcache.state_pool import StatePool


def as_token_array(tokens: Sequence[int]) -> array:
    """``tokens`` as an ``array('i')`` (shared, not copied, if it already is one)."""
    if isinstance(tokens, array) and tokens.typecode == "i":
        return tokens
    return array("i", tokens)


class RadixNode:
    """A run of whole pages under one parent (the root holds none)."""

    __slots__ = ("key", "pages", "children", "parent", "ref", "last_access", "uid", "detached",
                 "on_host", "state")

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
        # Stateful caches: the state-pool slot holding the recurrent state after
        # this node's last token (-1: none).
        self.state = -1

    def __repr__(self) -> str:
        tier = "host" if self.on_host else "device"
        state = f", state={self.state}" if self.state >= 0 else ""
        return (f"RadixNode(uid={self.uid}, {tier} pages={self.pages.tolist()}, ref={self.ref}{state}, "
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
    # Stateful caches: the deepest matched node holding a state checkpoint (the
    # root, 0 tokens, slot -1 when none): the part of the match a hybrid model
    # can use. Always within the device part.
    state_tokens: int = 0
    state_node: RadixNode | None = None
    state_slot: int = -1


class RadixCache:
    """The prefix tree over both tiers; see the module docstring for the contract."""

    def __init__(
        self, page_size: int, allocator: PageAllocator, host: HostKVTier | None = None,
        states: StatePool | None = None, max_states: int = 0,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if host is not None and host.page_size != page_size:
            raise ValueError(f"host tier page size {host.page_size} != {page_size}")
        if states is not None and host is not None and host.states is not states:
            raise ValueError("a stateful prefix cache's host tier must hold state slots of its pool")
        if states is not None and not 0 < max_states <= states.num_slots:
            raise ValueError(f"max_states must be in 1..{states.num_slots}, got {max_states}")
        self.page_size = page_size
        self.allocator = allocator
        self.host = host
        # Stateful (hybrid models): checkpoint slots come from this pool, at most
        # max_states of them in the tree or handed out at once.
        self.states = states
        self.max_states = max_states if states is not None else 0
        self._cached_states = 0  # checkpoints held by device nodes
        self._host_states = 0  # ... by host nodes
        self._states_out = 0  # handed out by alloc_state, not back yet
        self._uids = itertools.count()
        self.root = RadixNode(array("i"), array("i"), None, next(self._uids))
        self._clock = 0
        # Device pages in nodes with ref == 0 / ref > 0, and host pages in the
        # tree; kept incrementally (_account) so the stats are O(1).
        self._evictable_pages = 0
        self._locked_pages = 0
        self._host_pages = 0
        # Query tokens served from device pages (restores included; a stateful
        # cache's: up to the deepest checkpoint, what a hit can use).
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
    def stateful(self) -> bool:
        return self.states is not None

    @property
    def cached_states(self) -> int:
        """State checkpoints held by the tree."""
        return self._cached_states

    @property
    def host_cached_states(self) -> int:
        """State checkpoints held by host nodes (host state slots)."""
        return self._host_states

    @property
    def states_out(self) -> int:
        """Checkpoint slots handed out by alloc_state and not back yet."""
        return self._states_out

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
        state_end, state_node = 0, self.root  # the deepest checkpoint passed (stateful)
        while pos < limit:
            child = node.children.get(toks[pos : pos + ps].tobytes())
            if child is None:
                break
            n_pages = self._common_pages(child.key, toks, pos, limit)
            if n_pages < len(child.pages):
                child = self._split(child, n_pages)  # the upper part: no checkpoint at its end
            child.last_access = self._clock
            if child.on_host and dev is None:
                dev = (pos, node)
            pos += len(child.key)
            if dev is None:
                pages.extend(child.pages)
                if child.state >= 0:
                    state_end, state_node = pos, child
            node = child
        dev_tokens, dev_node = dev if dev is not None else (pos, node)
        if count_stats:
            self.query_tokens_total += len(toks)
            self.hit_tokens_total += state_end if self.stateful else dev_tokens
        st = {} if not self.stateful else dict(
            state_tokens=state_end, state_node=state_node, state_slot=state_node.state)
        if dev is None:
            return PrefixMatch(pages=pages, num_tokens=pos, node=node, **st)
        return PrefixMatch(pages=pages, num_tokens=dev_tokens, node=dev_node,
                           host_tokens=pos - dev_tokens, host_node=node, **st)

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
            if self.states is not None:
                return self._restore_with_states(match, host_nodes)
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
            if self.states is not None:
                self._drop_useless_host(target)
        self.hit_tokens_total += num_tokens - match.num_tokens
        self.host_hit_tokens_total += num_tokens - match.num_tokens
        return dataclasses.replace(match, pages=pages, num_tokens=num_tokens, node=node,
                                   host_tokens=0, host_node=None)

    def _restore_with_states(self, match: PrefixMatch, host_nodes: list[RadixNode]) -> PrefixMatch:
        """restore of a stateful cache (the caller holds the lock on the path):
        whole host nodes, top-down, down to the deepest checkpoint whose pages and
        device state slots the device can make room for; the checkpoints go to
        device slots with planned loads."""
        assert self.host is not None
        deepest = max((i for i, h in enumerate(host_nodes) if h.state >= 0), default=-1)
        host_nodes = host_nodes[:deepest + 1]  # pages below the last checkpoint are of no use
        need = sum(len(h.pages) for h in host_nodes)
        if self.allocator.num_free < need:
            self.evict(need - self.allocator.num_free)
        pages, num_tokens, node = list(match.pages), match.num_tokens, match.node
        state_end, state_node = match.state_tokens, match.state_node
        for h in host_nodes:
            if len(h.pages) > self.allocator.num_free:
                break
            slot = -1
            if h.state >= 0:
                slot = self._device_state_slot(evict=True)
                if slot < 0:
                    break
            dev = self.allocator.alloc(len(h.pages))
            assert dev is not None
            self.host.queue_load(h.pages, dev)
            self._set_device_pages(h, array("i", dev))
            if slot >= 0:
                self._state_to_device(h, slot)
                state_end, state_node = num_tokens + len(h.key), h
            pages += dev
            num_tokens += len(h.key)
            node = h
        self.hit_tokens_total += state_end - match.state_tokens
        self.host_hit_tokens_total += state_end - match.state_tokens
        assert state_node is not None
        return dataclasses.replace(match, pages=pages, num_tokens=num_tokens, node=node,
                                   host_tokens=0, host_node=None, state_tokens=state_end,
                                   state_node=state_node, state_slot=state_node.state)

    def _device_state_slot(self, evict: bool) -> int:
        """A device state slot for a checkpoint coming back from the host, within
        max_states (evicting the LRU unlocked leaf at the cap when ``evict``); -1
        when there is none."""
        assert self.states is not None
        if not self._room_for_state(evict):
            return -1
        self._cached_states += 1  # counted here: the caller gives it to a node at once
        return self.states.alloc()

    def _room_for_state(self, evict: bool = True) -> bool:
        """Below max_states, after evicting LRU leaves (offloading them, with a
        host tier) while at the cap, when ``evict``."""
        while evict and self._cached_states + self._states_out >= self.max_states and self._cached_states:
            if not self.evict(1):  # the LRU leaf, whole (with a host tier it may hold none: go on)
                break
        return self._cached_states + self._states_out < self.max_states

    def _state_to_device(self, node: RadixNode, slot: int) -> None:
        """A node (now on the device) gets its host checkpoint back in device
        ``slot`` (from _device_state_slot, already counted): a planned load."""
        assert self.host is not None and node.state >= 0
        self.host.queue_state_load(node.state, slot)
        self.host.free_state(node.state)
        self._host_states -= 1
        node.state = slot

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
    def insert(self, tokens: Sequence[int], pages: Sequence[int],
               states: Iterable[tuple[int, int]] = ()) -> int:
        """Give the tree the full pages of ``tokens``; returns tokens already cached.

        ``pages[i]`` holds tokens[i*page_size:(i+1)*page_size]; pages past the
        last full page are not touched (the caller keeps its partial page).
        Where the tree already has a device page for a chunk, the caller's page
        (if a different one) is freed back to the allocator. Where it has a
        host page, the caller's fresh device page replaces it (no copy needed).

        Stateful caches: ``states`` are checkpoints (length in tokens, slot from
        alloc_state) of these tokens; the tree takes each at the node ending at
        that length (splitting one), frees the caller's slot where it has one
        there already or where the length is not a whole page inside the
        inserted pages. The inserted pages must end at a checkpoint, given or
        held (module docstring).
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
                if child.state >= 0:
                    # Its checkpoint back to the device if a slot is free (no eviction:
                    # this walk's nodes are not locked), else dropped.
                    slot = self._device_state_slot(evict=False)
                    if slot >= 0:
                        self._state_to_device(child, slot)
                    else:
                        self._drop_host_state(child)
            else:
                duplicates.extend(o for t, o in zip(child.pages, own) if o != t)
            child.last_access = self._clock
            pos += len(child.key)
            node = child
        if duplicates:
            self.allocator.free(duplicates)
        if self.states is not None:
            self._take_states(toks, limit, states)
        return pos

    def _take_states(self, toks: array, limit: int, states: Iterable[tuple[int, int]]) -> None:
        """insert's checkpoints: at node ends, one per node; the rest freed."""
        assert self.states is not None
        for n_tok, slot in states:
            self._states_out -= 1
            if n_tok <= 0 or n_tok > limit or n_tok % self.page_size:
                self.states.free(slot)
                continue
            node = self._node_ending_at(toks, n_tok)
            if node.state >= 0:
                self.states.free(slot)  # saved twice (two requests over one prefix)
            else:
                node.state = slot
                self._cached_states += 1
        if limit:
            end = self._node_ending_at(toks, limit)
            assert end.children or end.state >= 0, (
                f"a stateful insert of {limit} tokens ends at a leaf without a checkpoint: {end!r}")

    def _node_ending_at(self, toks: array, n_tok: int) -> RadixNode:
        """The device node on toks' path that ends at n_tok tokens (the tree holds
        toks[:n_tok]), split off where n_tok falls inside a node."""
        ps = self.page_size
        node, pos = self.root, 0
        while pos < n_tok:
            child = node.children[toks[pos : pos + ps].tobytes()]
            if pos + len(child.key) > n_tok:
                child = self._split(child, (n_tok - pos) // ps)
            pos += len(child.key)
            node = child
        return node

    # ---------------------------------------------------------------- states
    def alloc_state(self) -> int | None:
        """A state-pool slot to save a checkpoint into (stateful caches); at the
        cap, the least recently used unlocked leaf goes first (its pages and its
        checkpoint). None when every checkpoint is locked."""
        assert self.states is not None, "alloc_state on a cache without states"
        if not self._room_for_state():
            return None
        self._states_out += 1
        return self.states.alloc()

    def free_state(self, slot: int) -> None:
        """Give back a slot from alloc_state that the tree will not take."""
        assert self.states is not None and self._states_out > 0
        self._states_out -= 1
        self.states.free(slot)

    # ---------------------------------------------------------------- evict
    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` device pages from the least recently used
        unlocked device nodes that have no device children, deepest pages
        first. With a host tier their KV moves to host pages (dropped only when
        the host tier has no room even after its own LRU eviction); without one
        it is dropped. A stateful cache drops whole leaves (a leaf's upper
        pages without its checkpoint could not be used), and then each parent
        left a leaf without a checkpoint: it may free more than asked."""
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
            if leaf.detached:
                continue  # a stateful cache's host eviction dropped it meanwhile (_drop_useless)
            take = min(num_pages - freed, len(leaf.pages))
            if self.states is not None:
                take = len(leaf.pages)
            parent = leaf.parent
            assert parent is not None
            if take < len(leaf.pages):
                # The deepest `take` pages keep `leaf`'s identity and its (host) children.
                parent = self._split(leaf, len(leaf.pages) - take)
            if self.host is None or not self._offload(leaf):
                self._drop_subtree(leaf)
            freed += take
            parent, dropped = self._drop_useless(parent)
            freed += dropped
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
    def check_integrity(self, live_pages: Iterable[int] = (), live_states: Iterable[int] = ()) -> None:
        """Assert the page partition of both tiers and the tree's invariants
        (module docstring); ``live_pages``: the private pages of live requests;
        ``live_states`` (stateful): the state slots held outside the tree
        (running requests' own, checkpoints handed out)."""
        check_radix(self, live_pages, live_states)

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
            if n.state >= 0 and n.on_host:
                self._drop_host_state(n)
            elif n.state >= 0:
                assert self.states is not None
                self.states.free(n.state)
                self._cached_states -= 1
                n.state = -1
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
        # Pinned while the host makes room: a stateful cache's host eviction drops
        # device nodes it leaves without children or checkpoint (_drop_useless).
        self.lock(node)
        try:
            got = self._host_alloc(len(node.pages))
            host_state = -1
            if got is not None and node.state >= 0:
                host_state = self._host_state_alloc()
                if host_state < 0:
                    self.host.free(got)
                    got = None
        finally:
            self.unlock(node)
        if got is None:
            return False
        if self.states is not None and not node.children and node.state < 0:
            self.host.free(got)  # its host children went to make room: nothing below to keep
            return False
        host_pages = array("i", got)
        self.host.queue_offload(node.pages, host_pages)
        if host_state >= 0:
            assert self.states is not None
            self.host.queue_state_offload(node.state, host_state)
            self.states.free(node.state)
            self._cached_states -= 1
            self._host_states += 1
            node.state = host_state
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

    def _host_state_alloc(self) -> int:
        """A host state slot (dropping LRU host leaves, whole, while none is free),
        or -1."""
        host = self.host
        assert host is not None
        while True:
            slot = host.alloc_state()
            if slot is not None:
                return slot
            if not self._evict_host(1):
                return -1

    def _drop_host_state(self, node: RadixNode) -> None:
        assert self.host is not None and node.state >= 0
        self.host.free_state(node.state)
        self._host_states -= 1
        node.state = -1

    def _evict_host(self, num_pages: int) -> int:
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
            if self.states is not None:
                take = len(leaf.pages)  # whole leaves, as on the device
            parent = leaf.parent
            assert parent is not None
            if take < len(leaf.pages):
                parent = self._split(leaf, len(leaf.pages) - take)
            self._drop_subtree(leaf)
            freed += take
            parent, _ = self._drop_useless(parent)
            if parent.on_host and not parent.children and parent.ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.uid, parent))
        return freed

    def _drop_useless_host(self, node: RadixNode) -> None:
        """After restore: the host part of its path may have lost, to the host
        eviction that made room while it was pinned, the checkpoint below it;
        host nodes left as leaves without one go (device nodes stay: the match
        returned holds them)."""
        while (not node.detached and node.on_host and not node.children and node.state < 0
               and node.ref == 0):
            up = node.parent
            assert up is not None
            self._drop_subtree(node)
            node = up

    def _drop_useless(self, node: RadixNode) -> tuple[RadixNode, int]:
        """Stateful caches: drop ``node`` and up while it is a leaf without a
        checkpoint (its pages can no longer be used); returns the first kept
        ancestor (or node itself) and the device pages dropped."""
        dropped = 0
        while (self.states is not None and node is not self.root and not node.children
               and node.state < 0 and node.ref == 0):  # (pinned by _offload while it works)
            up = node.parent
            assert up is not None
            dropped += 0 if node.on_host else len(node.pages)
            self._drop_subtree(node)
            node = up
        return node, dropped
