"""RadixCache under random operation sequences (hypothesis state machine).

Requests match, lock, grow private pages, insert (after each prefill chunk and
at the end), finish or abort; evictions and resets interleave. After every
step the page partition and tree invariants are checked, and every match is
compared with a naive twin that maps each cached full-page prefix to its page.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ftserve.kvcache.allocator import PageAllocator
from ftserve.kvcache.radix import RadixCache, RadixNode


class NaivePrefixCache:
    """Oracle: every cached full-page prefix (as a tuple) -> the page holding its last chunk."""

    def __init__(self, page_size: int) -> None:
        self.ps = page_size
        self.prefix_page: dict[tuple[int, ...], int] = {}
        # LRU model: one tick per match/insert, stamped on every cached prefix it walked.
        self.clock = 0
        self.last_use: dict[tuple[int, ...], int] = {}

    def touch(self, tokens: Sequence[int], n_pages: int) -> None:
        self.clock += 1
        for j in range(1, n_pages + 1):
            self.last_use[tuple(tokens[: j * self.ps])] = self.clock

    def page_last_use(self) -> dict[int, int]:
        return {p: self.last_use[k] for k, p in self.prefix_page.items()}

    def match(self, tokens: Sequence[int]) -> list[int]:
        pages: list[int] = []
        for end in range(self.ps, len(tokens) + 1, self.ps):
            page = self.prefix_page.get(tuple(tokens[:end]))
            if page is None:
                break
            pages.append(page)
        return pages

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> int:
        """Records new prefixes; returns how many tokens were already cached."""
        present = 0
        for j in range(len(tokens) // self.ps):
            key = tuple(tokens[: (j + 1) * self.ps])
            if key in self.prefix_page:
                assert present == j * self.ps, "oracle is not prefix-closed"
                present += self.ps
            else:
                self.prefix_page[key] = pages[j]
        return present

    def drop_freed(self, alloc: PageAllocator) -> None:
        self.prefix_page = {k: p for k, p in self.prefix_page.items() if not alloc.is_free(p)}

    def assert_prefix_closed(self) -> None:
        for key in self.prefix_page:
            if len(key) > self.ps:
                assert key[: -self.ps] in self.prefix_page, f"{key} cached without its parent"


def tree_pages(cache: RadixCache) -> list[int]:
    out: list[int] = []
    stack = [cache.root]
    while stack:
        n = stack.pop()
        out.extend(n.pages)
        stack.extend(n.children.values())
    return out


NUM_PAGES = 24
token_lists = st.lists(st.integers(0, 2), max_size=12)


@dataclass
class Req:
    tokens: list[int]
    node: RadixNode
    shared: int  # pages[:shared] belong to the tree (pinned by node), the rest are private
    pages: list[int]


class RadixMachine(RuleBasedStateMachine):
    """Requests that match, lock, grow private pages, insert (per chunk and at
    the end), abort; evictions and resets; integrity checked after every step."""

    page_size = 2

    def __init__(self) -> None:
        super().__init__()
        self.a = PageAllocator(NUM_PAGES)
        self.c = RadixCache(self.page_size, self.a)
        self.oracle = NaivePrefixCache(self.page_size)
        self.reqs: dict[int, Req] = {}
        self.next_id = 0
        self.history: list[list[int]] = [[]]

    # -- helpers
    def _alloc(self, n: int) -> list[int] | None:
        got = self.a.alloc(n)
        if got is not None:
            return got
        short = n - self.a.num_free
        evictable = self.c.evictable_pages
        self._evict(short)
        got = self.a.alloc(n)
        assert (got is None) == (evictable < short)
        return got

    def _evict(self, n: int) -> None:
        """Evict, then check the count, LRU order and that only whole suffixes went."""
        leaves: list[tuple[int, list[int]]] = []
        last_use = self.oracle.page_last_use()
        stack = [self.c.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.children and node is not self.c.root and node.ref == 0:
                # Every access that reached a leaf's first page walked all of it
                # (a partial walk splits the node), so any of its pages has the leaf's time.
                leaves.append((last_use[node.pages[0]], list(node.pages)))
        evictable = self.c.evictable_pages
        assert self.c.evict(n) == min(n, evictable)
        touched = [t for t, pages in leaves if any(self.a.is_free(p) for p in pages)]
        kept = [t for t, pages in leaves if not any(self.a.is_free(p) for p in pages)]
        if touched and kept:
            assert max(touched) <= min(kept), "evicted a leaf used more recently than a kept one"
        self.oracle.drop_freed(self.a)
        self.oracle.assert_prefix_closed()

    def _pick(self, i: int) -> tuple[int, Req]:
        rid = sorted(self.reqs)[i % len(self.reqs)]
        return rid, self.reqs[rid]

    def _insert(self, r: Req) -> int:
        n_full = len(r.tokens) // self.page_size
        expect_present = self.oracle.insert(r.tokens, r.pages)
        self.oracle.touch(r.tokens, n_full)
        tree_before = self.oracle.match(r.tokens)
        dups = [
            p for p, t in zip(r.pages, tree_before[: expect_present // self.page_size]) if p != t
        ]
        assert self.c.insert(r.tokens, r.pages) == expect_present
        assert all(self.a.is_free(p) for p in dups), "duplicate pages must be freed"
        return n_full

    # -- rules
    # A few live requests at a time, so finished ones build a tree worth evicting.
    @precondition(lambda self: len(self.reqs) < 4)
    @rule(base=st.integers(0, 1000), suffix=token_lists)
    def start_request(self, base: int, suffix: list[int]) -> None:
        tokens = self.history[-1 - base % len(self.history)] + suffix
        m = self.c.match_prefix(tokens)
        assert m.pages == self.oracle.match(tokens)
        self.oracle.touch(tokens, len(m.pages))
        assert m.num_tokens == len(m.pages) * self.page_size
        self.c.lock(m.node)
        priv = self._alloc(-(-len(tokens) // self.page_size) - len(m.pages))
        if priv is None:
            self.c.unlock(m.node)
            return
        self.reqs[self.next_id] = Req(tokens, m.node, len(m.pages), m.pages + priv)
        self.next_id += 1

    @precondition(lambda self: bool(self.reqs))
    @rule(i=st.integers(0, 1000), new=st.lists(st.integers(0, 2), min_size=1, max_size=5))
    def generate(self, i: int, new: list[int]) -> None:
        _, r = self._pick(i)
        tokens = r.tokens + new
        more = self._alloc(-(-len(tokens) // self.page_size) - len(r.pages))
        if more is not None:
            r.tokens = tokens
            r.pages += more

    @precondition(lambda self: bool(self.reqs))
    @rule(i=st.integers(0, 1000))
    def cache_progress(self, i: int) -> None:
        _, r = self._pick(i)
        n_full = self._insert(r)
        m = self.c.match_prefix(r.tokens, count_stats=False)
        self.oracle.touch(r.tokens, len(m.pages))
        assert m.num_tokens == n_full * self.page_size, "what was just inserted must match"
        self.c.lock(m.node)
        self.c.unlock(r.node)
        r.node, r.shared, r.pages = m.node, n_full, m.pages + r.pages[n_full:]

    @precondition(lambda self: bool(self.reqs))
    @rule(i=st.integers(0, 1000))
    def finish(self, i: int) -> None:
        rid, r = self._pick(i)
        n_full = self._insert(r)
        self.a.free(r.pages[n_full:])
        self.c.unlock(r.node)
        del self.reqs[rid]
        self.history.append(r.tokens)

    @precondition(lambda self: bool(self.reqs))
    @rule(i=st.integers(0, 1000))
    def abort(self, i: int) -> None:
        rid, r = self._pick(i)
        self.a.free(r.pages[r.shared :])
        self.c.unlock(r.node)
        del self.reqs[rid]

    @rule(n=st.integers(0, 3))
    def evict(self, n: int) -> None:
        self._evict(n)

    @rule(roll=st.integers(0, 9))
    def reset(self, roll: int) -> None:
        # A reset wipes everything: keep it rare so trees grow between resets
        # (hypothesis favours boundary values, so the trigger is an inner one).
        if roll != 7:
            return
        locked = self.c.locked_pages > 0
        assert self.c.reset() == (not locked)
        if not locked:
            assert all(r.shared == 0 for r in self.reqs.values())
            self.oracle.prefix_page.clear()
            self.oracle.last_use.clear()

    @rule(base=st.integers(0, 1000), suffix=token_lists)
    def query(self, base: int, suffix: list[int]) -> None:
        tokens = self.history[-1 - base % len(self.history)] + suffix
        m = self.c.match_prefix(tokens)
        assert m.pages == self.oracle.match(tokens)
        self.oracle.touch(tokens, len(m.pages))

    # -- after every step
    @invariant()
    def consistent(self) -> None:
        live = [p for r in self.reqs.values() for p in r.pages[r.shared :]]
        self.c.check_integrity(live)
        in_tree = tree_pages(self.c)
        assert sorted(in_tree) == sorted(self.oracle.prefix_page.values())
        pinned: set[int] = set()
        for r in self.reqs.values():
            assert len(r.pages) == -(-len(r.tokens) // self.page_size)
            assert self.oracle.match(r.tokens)[: r.shared] == r.pages[: r.shared]
            pinned.update(r.pages[: r.shared])
        assert self.c.locked_pages == len(pinned), "locked pages are exactly the pinned matches"
        assert self.c.root.ref == len(self.reqs), "every live request holds one lock"


class RadixMachinePage3(RadixMachine):
    page_size = 3


TestRadixMachine = RadixMachine.TestCase
TestRadixMachine.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)
TestRadixMachinePage3 = RadixMachinePage3.TestCase
TestRadixMachinePage3.settings = settings(max_examples=30, stateful_step_count=50, deadline=None)
