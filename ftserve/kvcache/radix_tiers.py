"""Moves between the device and host tiers of the radix prefix cache.

``RadixCache`` (radix.py) inherits these; they are kept apart because they are
the one concern radix.py does not otherwise have: which tier a node's pages
live in. Tree invariants are radix.py's (see its docstring); what this file
adds:

- ``restore``: a match that runs into host nodes gets device pages again
  (top-down, as many whole pages as the device can free) and plans the loads;
- ``_offload``: device eviction moves an unlocked node's KV to host pages
  (plans the copy) instead of dropping it;
- ``_evict_host``: the host tier's own LRU over unlocked host leaves, which
  drops pages for good;
- ``_to_device``: a host node takes fresh device pages a request computed
  for the same tokens (no copy).

Every copy is only planned here (``HostKVTier.queue_*``); the host tier runs
them in planning order before the next step, so a page freed here may be
handed out again at once.
"""

from __future__ import annotations

import dataclasses
import heapq
from array import array
from typing import TYPE_CHECKING

from ftserve.kvcache.allocator import PageAllocator

if TYPE_CHECKING:
    from ftserve.kvcache.host_tier import HostKVTier
    from ftserve.kvcache.radix import PrefixMatch, RadixNode


class TierMoves:
    """Mixin of RadixCache: the state below is RadixCache's."""

    page_size: int
    allocator: PageAllocator
    host: HostKVTier | None
    root: RadixNode
    _evictable_pages: int
    _locked_pages: int
    _host_pages: int
    hit_tokens_total: int
    host_hit_tokens_total: int
    host_dropped_pages_total: int

    if TYPE_CHECKING:  # RadixCache's tree operations, used below
        def lock(self, node: RadixNode) -> None: ...
        def unlock(self, node: RadixNode) -> None: ...
        def evict(self, num_pages: int) -> int: ...
        def _split(self, node: RadixNode, n_pages: int) -> RadixNode: ...
        def _detach(self, leaf: RadixNode) -> None: ...

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
                self.host.free(h.pages)
                self._host_pages -= len(dev)
                self._locked_pages += len(dev)  # h.ref > 0 here: it is on the locked path
                h.pages, h.on_host = array("i", dev), False  # compact, like every node
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

    def _to_device(self, node: RadixNode, device_pages: array) -> None:
        """A host node takes the caller's device pages holding the same KV."""
        assert self.host is not None and len(device_pages) == len(node.pages)
        self.host.free(node.pages)
        self._host_pages -= len(device_pages)
        if node.ref:
            self._locked_pages += len(device_pages)
        else:
            self._evictable_pages += len(device_pages)
        node.pages, node.on_host = device_pages, False

    def _offload(self, node: RadixNode) -> bool:
        """Move an unlocked device node's KV to host pages (planned copy)."""
        assert self.host is not None and not node.on_host and node.ref == 0
        got = self._host_alloc(len(node.pages))
        if got is None:
            return False
        host_pages = array("i", got)
        self.host.queue_offload(node.pages, host_pages)
        # Safe to reuse at once: the next step waits for this copy (HostKVTier.flush).
        self.allocator.free(node.pages)
        self._evictable_pages -= len(node.pages)
        self._host_pages += len(host_pages)
        node.pages, node.on_host = host_pages, True
        return True

    def _host_alloc(self, n: int) -> list[int] | None:
        host = self.host
        assert host is not None
        if n > host.num_total:
            return None
        if host.num_free < n:
            self._evict_host(n - host.num_free)
        return host.alloc(n)

    def _evict_host(self, num_pages: int) -> int:
        """Drop up to ``num_pages`` host pages from LRU unlocked host leaves."""
        assert self.host is not None
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
        ps = self.page_size
        while heap and freed < num_pages:
            _, _, leaf = heapq.heappop(heap)
            take = min(num_pages - freed, len(leaf.pages))
            parent = leaf.parent
            assert parent is not None
            if take < len(leaf.pages):
                victims = leaf.pages[-take:]
                del leaf.pages[-take:]
                del leaf.key[-take * ps :]
            else:
                victims = leaf.pages
                self._detach(leaf)
                if parent.on_host and not parent.children and parent.ref == 0:
                    heapq.heappush(heap, (parent.last_access, parent.uid, parent))
            self.host.free(victims)
            self._host_pages -= len(victims)
            self.host_dropped_pages_total += len(victims)
            freed += len(victims)
        return freed
