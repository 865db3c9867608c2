"""Device eviction of the radix prefix cache.

``RadixCache`` (radix.py) inherits these, as it inherits the tier moves of
radix_tiers.py. Tree invariants are radix.py's (see its docstring); what this
file adds:

- ``evict``: frees device pages from the least recently used unlocked device
  nodes with no device children, offloading their KV to the host tier when
  there is one (``TierMoves._offload``) and dropping it otherwise;
- ``_drop_subtree``: drops an unlocked node and everything below it, freeing
  both tiers' pages (also what ``RadixCache.reset`` uses);
- ``_detach``: unhooks a node from its parent (also used by the host tier's
  own eviction).
"""

from __future__ import annotations

import heapq
from array import array
from typing import TYPE_CHECKING

from ftserve.kvcache.allocator import PageAllocator

if TYPE_CHECKING:
    from ftserve.kvcache.host_tier import HostKVTier
    from ftserve.kvcache.radix import RadixNode


class DeviceEviction:
    """Mixin of RadixCache: the state below is RadixCache's."""

    page_size: int
    allocator: PageAllocator
    host: HostKVTier | None
    root: RadixNode
    _evictable_pages: int
    _locked_pages: int
    _host_pages: int
    host_dropped_pages_total: int

    if TYPE_CHECKING:  # RadixCache's tree operations and TierMoves' offload, used below
        def _first(self, node: RadixNode) -> bytes: ...
        def _split(self, node: RadixNode, n_pages: int) -> RadixNode: ...
        def _offload(self, node: RadixNode) -> bool: ...

    # ---------------------------------------------------------------- evict
    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` device pages from the least recently used
        unlocked device nodes that have no device children. With a host tier
        their KV moves to host pages (dropped only when the host tier has no
        room even after its own LRU eviction); without one it is dropped."""
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
            if self.host is None:
                self._drop_device_leaf(leaf, take)
            else:
                if take < len(leaf.pages):
                    # Cut off the deepest `take` pages; they keep `leaf`'s
                    # identity and its (host) children.
                    parent = self._split(leaf, len(leaf.pages) - take)
                if not self._offload(leaf):
                    self._drop_subtree(leaf)
            freed += take
            if (parent is not self.root and parent.ref == 0 and not parent.on_host
                    and all(c.on_host for c in parent.children.values())):
                heapq.heappush(heap, (parent.last_access, parent.uid, parent))
        return freed

    def _drop_device_leaf(self, leaf: RadixNode, take: int) -> None:
        """No host tier: free the leaf's deepest ``take`` pages (all: drop it)."""
        ps = self.page_size
        if take < len(leaf.pages):
            victims = leaf.pages[-take:]
            del leaf.pages[-take:]
            del leaf.key[-take * ps :]
        else:
            victims = leaf.pages
            self._detach(leaf)
        self.allocator.free(victims)
        self._evictable_pages -= len(victims)

    def _drop_subtree(self, node: RadixNode) -> None:
        """Drop an unlocked node and everything below it, freeing both tiers' pages."""
        self._detach(node)
        stack = [node]
        while stack:
            n = stack.pop()
            assert n.ref == 0
            stack.extend(n.children.values())
            self._free_node_pages(n)
            n.detached, n.parent, n.children = True, None, {}

    def _free_node_pages(self, n: RadixNode) -> None:
        if n.on_host:
            assert self.host is not None
            self.host.free(n.pages)
            self._host_pages -= len(n.pages)
            self.host_dropped_pages_total += len(n.pages)
        else:
            self.allocator.free(n.pages)
            if n.ref:
                self._locked_pages -= len(n.pages)
            else:
                self._evictable_pages -= len(n.pages)
        n.pages, n.key = array("i"), array("i")

    def _detach(self, leaf: RadixNode) -> None:
        parent = leaf.parent
        assert parent is not None
        del parent.children[self._first(leaf)]
        leaf.parent = None
        leaf.detached = True
