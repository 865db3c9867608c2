"""RadixCache under random operation sequences (hypothesis state machine),
with and without a host tier.

Requests match (and restore what the match found on the host tier), lock, grow
private pages, insert (after each prefill chunk and at the end), finish or
abort; evictions (offloads to the host tier, which drops its own LRU leaves
when full) and resets interleave. After every step:

- the page partition and tree invariants (``check_integrity``, both tiers);
- a naive twin that maps every cached full-page prefix to its tier and page
  (device or host; a prefix it no longer holds was dropped) agrees with the
  tree, and every match is compared with it, device part and host part;
- the KV in every page is the KV of the tokens it caches, on both tiers: the
  planned page moves ran (``HostKVTier.flush``, on the CPU) and moved the
  right pages.

The twin learns where an evicted prefix went from the moves the cache planned
(``pending_moves``), checks that they only move pages it holds, and each
eviction is checked for LRU order on both tiers.

A stateful cache (hybrid models' state checkpoints) has its own machine
(``StatefulRadixMachine``): its twin also maps each checkpointed prefix to its
slot, and it checks the deepest usable checkpoint of every match, that every
cached prefix has a checkpoint at or below it, that checkpoints and pages are
evicted together (whole LRU leaves), and the state-slot partition.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ftserve.kvcache.allocator import PageAllocator
from ftserve.kvcache.host_tier import HostKVTier
from ftserve.kvcache.pool import KVPool
from ftserve.kvcache.radix import PrefixMatch, RadixCache, RadixNode
from ftserve.kvcache.state_pool import StateLayout, StatePool

Prefix = tuple[int, ...]
Loc = tuple[bool, int]  # (on_host, page)


class NaiveTieredCache:
    """Oracle: every cached full-page prefix (as a tuple) -> the tier and page
    holding its last chunk. A prefix missing here is not cached (never was, or
    was dropped)."""

    def __init__(self, page_size: int) -> None:
        self.ps = page_size
        self.where: dict[Prefix, Loc] = {}
        # LRU model: one tick per match/insert, stamped on every cached prefix it walked.
        self.clock = 0
        self.last_use: dict[Prefix, int] = {}

    def prefixes(self, tokens: Sequence[int]) -> list[Prefix]:
        return [tuple(tokens[:end]) for end in range(self.ps, len(tokens) + 1, self.ps)]

    def touch(self, tokens: Sequence[int], n_pages: int) -> None:
        self.clock += 1
        for key in self.prefixes(tokens)[:n_pages]:
            self.last_use[key] = self.clock

    def match(self, tokens: Sequence[int]) -> tuple[list[int], list[int]]:
        """(device pages, host pages) of the longest cached prefix, in order."""
        dev: list[int] = []
        host: list[int] = []
        for key in self.prefixes(tokens):
            loc = self.where.get(key)
            if loc is None:
                break
            on_host, page = loc
            if on_host:
                host.append(page)
            else:
                assert not host, f"{key} is on the device below a host prefix"
                dev.append(page)
        return dev, host

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> tuple[int, list[int], list[int]]:
        """Records the full pages; returns (tokens already cached, the caller's
        duplicate device pages, host pages superseded by the caller's)."""
        present, dups, superseded = 0, [], []
        for j, key in enumerate(self.prefixes(tokens)):
            loc = self.where.get(key)
            if loc is None:
                self.where[key] = (False, pages[j])
                continue
            assert present == j * self.ps, "oracle is not prefix-closed"
            present += self.ps
            on_host, page = loc
            if on_host:
                superseded.append(page)
                self.where[key] = (False, pages[j])
            elif page != pages[j]:
                dups.append(pages[j])
        return present, dups, superseded

    def apply_moves(self, moves: list[tuple[bool, list[int], list[int]]]) -> None:
        """Replays planned page moves in order: the prefix on page src now sits
        on page dst of the other tier. A destination some prefix still claims
        was freed by a drop earlier in the same plan: that prefix is gone."""
        at: dict[Loc, Prefix] = {loc: key for key, loc in self.where.items()}
        for to_host, src, dst in moves:
            for s, d in zip(src, dst):
                key = at.pop((not to_host, s), None)
                assert key is not None, (
                    f"planned a move of {'device' if to_host else 'host'} page {s}, "
                    "which holds no cached prefix")
                gone = at.pop((to_host, d), None)
                if gone is not None:
                    del self.where[gone]
                at[(to_host, d)] = key
                self.where[key] = (to_host, d)

    def drop_freed(self, dev: PageAllocator, host: PageAllocator | None) -> set[Prefix]:
        """Forgets the prefixes whose page went back to its tier's free list."""
        gone = {k for k, (on_host, p) in self.where.items()
                if (host.is_free(p) if on_host else dev.is_free(p))}
        for k in gone:
            del self.where[k]
        return gone

    def assert_shape(self) -> None:
        for key, (on_host, _) in self.where.items():
            if len(key) > self.ps:
                parent = self.where.get(key[: -self.ps])
                assert parent is not None, f"{key} cached without its parent"
                assert on_host or not parent[0], f"{key} on the device below a host prefix"

    def pages(self, on_host: bool) -> list[int]:
        return sorted(p for h, p in self.where.values() if h == on_host)

    def clear(self) -> None:
        self.where.clear()
        self.last_use.clear()


def tree_pages(cache: RadixCache, on_host: bool) -> list[int]:
    out: list[int] = []
    stack = [cache.root]
    while stack:
        n = stack.pop()
        if n.on_host == on_host:
            out.extend(n.pages)
        stack.extend(n.children.values())
    return sorted(out)


def nodes(cache: RadixCache) -> list[RadixNode]:
    out, stack = [], list(cache.root.children.values())
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children.values())
    return out


token_lists = st.lists(st.integers(0, 2), max_size=12)


@dataclass
class Req:
    tokens: list[int]
    node: RadixNode
    shared: int  # pages[:shared] belong to the tree (pinned by node), the rest are private
    pages: list[int]


class RadixMachine(RuleBasedStateMachine):
    """Requests that match (+ restore), lock, grow private pages, insert (per
    chunk and at the end), abort; evictions and resets; everything checked
    after every step (module docstring)."""

    page_size = 2
    device_pages = 24  # the dummy page included
    host_pages: int | None = None  # usable host-tier pages; None: no host tier
    max_live = 4  # live requests at most

    def __init__(self) -> None:
        super().__init__()
        ps = self.page_size
        self.a = PageAllocator(self.device_pages)
        # One layer, one head of one float: a slot holds the id of the token
        # sequence whose last token it caches (self._kv_id).
        self.pool = KVPool(1, self.device_pages, ps, 1, 1, torch.float32, "cpu")
        self.host = HostKVTier(self.pool, self.host_pages) if self.host_pages else None
        self.c = RadixCache(ps, self.a, host=self.host)
        self.oracle = NaiveTieredCache(ps)
        self.reqs: dict[int, Req] = {}
        self.next_id = 0
        self.history: list[list[int]] = [[]]
        self.kv_ids: dict[Prefix, int] = {}

    # -- helpers
    def _sync(self) -> set[Prefix]:
        """After a cache call: replay its planned moves in the oracle, run them
        (the engine flushes before the next step), forget what was dropped.
        Returns the prefixes dropped."""
        before = set(self.oracle.where)
        if self.host is not None:
            self.oracle.apply_moves(self.host.pending_moves())
            self.host.flush()
            assert self.host.num_pending == 0
        self.oracle.drop_freed(self.a, self.host.allocator if self.host else None)
        self.oracle.assert_shape()
        return before - set(self.oracle.where)

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
        """Evict, then check the count and LRU order on both tiers. A node's LRU
        time is its first page's in the oracle: every access that reached that
        page walked the whole node (a partial walk splits it)."""
        at = {loc: key for key, loc in self.oracle.where.items()}
        dev_leaves: list[tuple[int, list[int]]] = []
        host_leaves: list[tuple[int, list[Prefix]]] = []
        dev_nodes = [list(node.pages) for node in nodes(self.c) if not node.on_host]
        for node in nodes(self.c):
            if node.ref:
                continue
            t = self.oracle.last_use[at[(node.on_host, node.pages[0])]]
            if not node.on_host and all(c.on_host for c in node.children.values()):
                dev_leaves.append((t, list(node.pages)))
            elif node.on_host and not node.children:
                host_leaves.append((t, [at[(True, p)] for p in node.pages]))
        evictable = self.c.evictable_pages
        assert self.c.evict(n) == min(n, evictable)
        # Device: a freed page was offloaded or dropped; nothing is allocated in between.
        touched = [t for t, pages in dev_leaves if any(self.a.is_free(p) for p in pages)]
        kept = [t for t, pages in dev_leaves if not any(self.a.is_free(p) for p in pages)]
        if touched and kept:
            assert max(touched) <= min(kept), "evicted a device leaf used more recently than a kept one"
        moves = self.host.pending_moves() if self.host else []
        offloaded = {at[(False, s)] for to_host, src, _ in moves if to_host for s in src}
        dropped = self._sync()
        # Host: its LRU drops leaves oldest first, except below a device node
        # the host tier had no room for (dropped at once with its subtree).
        was_dev = {key for (on_host, _), key in at.items() if not on_host}
        no_room = (dropped & was_dev) - offloaded
        if self.host is not None:
            # Nothing is locked on the host here: only a run of pages longer
            # than the whole host tier is dropped rather than offloaded.
            for node_pages in dev_nodes:
                n_dropped = sum(at[(False, p)] in no_room for p in node_pages)
                assert n_dropped == 0 or n_dropped > self.host.num_total, (
                    f"dropped {n_dropped} device pages a host tier of {self.host.num_total} could hold")
        ps = self.page_size
        touched = [t for t, keys in host_leaves if any(k in dropped for k in keys)
                   and not any(keys[0][:j] in no_room for j in range(ps, len(keys[0]), ps))]
        kept = [t for t, keys in host_leaves if not any(k in dropped for k in keys)]
        if touched and kept:
            assert max(touched) <= min(kept), "host LRU dropped a leaf used more recently than a kept one"

    def _pick(self, i: int) -> tuple[int, Req]:
        rid = sorted(self.reqs)[i % len(self.reqs)]
        return rid, self.reqs[rid]

    def _insert(self, r: Req) -> int:
        n_full = len(r.tokens) // self.page_size
        expect_present, dups, superseded = self.oracle.insert(r.tokens, r.pages)
        self.oracle.touch(r.tokens, n_full)
        assert self.c.insert(r.tokens, r.pages) == expect_present
        assert all(self.a.is_free(p) for p in dups), "duplicate pages must be freed"
        if superseded:
            assert self.host is not None
            assert all(self.host.allocator.is_free(p) for p in superseded), (
                "host pages of chunks the caller recomputed must be freed")
        self._sync()
        return n_full

    def _kv_id(self, seq: Sequence[int]) -> int:
        return self.kv_ids.setdefault(tuple(seq), len(self.kv_ids) + 1)

    def _write_private_kv(self, r: Req) -> None:
        """The request computes the KV of its private pages."""
        ps = self.page_size
        pos = list(range(r.shared * ps, len(r.tokens)))
        if pos:
            slots = torch.tensor([r.pages[i // ps] * ps + i % ps for i in pos])
            self.pool.k[0, slots, 0, 0] = torch.tensor(
                [float(self._kv_id(r.tokens[: i + 1])) for i in pos])

    def _pinned(self) -> set[Prefix]:
        return {k for r in self.reqs.values() for k in self.oracle.prefixes(r.tokens)[: r.shared]}

    def _match(self, tokens: list[int]) -> tuple[RadixNode, list[int], int]:
        """match_prefix (+ restore when the match reaches the host tier),
        checked against the oracle; returns (node, pages, num_tokens)."""
        ps = self.page_size
        m = self.c.match_prefix(tokens)
        dev, host = self.oracle.match(tokens)
        assert m.pages == dev and m.num_tokens == len(dev) * ps
        assert m.host_tokens == len(host) * ps
        if host:
            path: list[int] = []
            n: RadixNode | None = m.host_node
            while n is not None and n.on_host:
                path[:0] = n.pages
                n = n.parent
            assert path == host and n is m.node
        else:
            assert m.host_node is None
        self.oracle.touch(tokens, len(dev) + len(host))
        if not host:
            return m.node, m.pages, m.num_tokens
        # restore locks the match's path and evicts what else it must.
        path_unlocked = set(self.oracle.prefixes(tokens)[: len(dev)]) - self._pinned()
        evictable = self.c.evictable_pages - len(path_unlocked)
        expect = min(len(host), self.a.num_free + evictable)
        hits = self.c.host_hit_tokens_total
        r = self.c.restore(m)
        self._sync()
        assert r.host_tokens == 0 and r.host_node is None
        assert r.num_tokens == (len(dev) + expect) * ps, "restore brought back the wrong amount"
        assert self.c.host_hit_tokens_total - hits == expect * ps
        dev2, host2 = self.oracle.match(tokens)
        assert r.pages == dev2 and r.pages[: len(dev)] == dev and len(host2) == len(host) - expect
        return r.node, r.pages, r.num_tokens

    # -- rules
    # A few live requests at a time, so finished ones build a tree worth evicting.
    @precondition(lambda self: len(self.reqs) < self.max_live)
    @rule(base=st.integers(0, 1000), suffix=token_lists)
    def start_request(self, base: int, suffix: list[int]) -> None:
        tokens = self.history[-1 - base % len(self.history)] + suffix
        node, pages, _ = self._match(tokens)
        self.c.lock(node)
        priv = self._alloc(-(-len(tokens) // self.page_size) - len(pages))
        if priv is None:
            self.c.unlock(node)
            return
        r = Req(tokens, node, len(pages), pages + priv)
        self._write_private_kv(r)
        self.reqs[self.next_id] = r
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
            self._write_private_kv(r)

    @precondition(lambda self: bool(self.reqs))
    @rule(i=st.integers(0, 1000))
    def cache_progress(self, i: int) -> None:
        _, r = self._pick(i)
        n_full = self._insert(r)
        m = self.c.match_prefix(r.tokens, count_stats=False)
        self.oracle.touch(r.tokens, n_full)
        assert m.num_tokens == n_full * self.page_size, "what was just inserted must match"
        assert m.host_node is None, "an insert leaves its pages on the device"
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
            assert self.c.host_cached_pages == 0 and self.c.cached_pages == 0
            self._sync()
            assert not self.oracle.where
            self.oracle.clear()

    @rule(base=st.integers(0, 1000), suffix=token_lists)
    def query(self, base: int, suffix: list[int]) -> None:
        """A match alone (as prefix sharing makes): no restore, no lock."""
        tokens = self.history[-1 - base % len(self.history)] + suffix
        m = self.c.match_prefix(tokens)
        dev, host = self.oracle.match(tokens)
        assert m.pages == dev and m.host_tokens == len(host) * self.page_size
        self.oracle.touch(tokens, len(dev) + len(host))

    # -- after every step
    @invariant()
    def consistent(self) -> None:
        live = [p for r in self.reqs.values() for p in r.pages[r.shared :]]
        self.c.check_integrity(live)
        assert tree_pages(self.c, False) == self.oracle.pages(False)
        assert tree_pages(self.c, True) == self.oracle.pages(True)
        for r in self.reqs.values():
            assert len(r.pages) == -(-len(r.tokens) // self.page_size)
            assert self.oracle.match(r.tokens)[0][: r.shared] == r.pages[: r.shared]
        pinned = self._pinned()
        assert self.c.locked_pages == len(pinned), "locked pages are exactly the pinned matches"
        n_dev = len(self.oracle.pages(False))
        assert self.c.evictable_pages == n_dev - len(pinned)
        assert self.c.root.ref == len(self.reqs), "every live request holds one lock"
        self._check_kv()

    def _check_kv(self) -> None:
        """Every cached page (either tier) and every live request's private
        token holds the KV of the sequence it ends."""
        ps = self.page_size
        slots: dict[bool, list[int]] = {False: [], True: []}
        want: dict[bool, list[float]] = {False: [], True: []}
        for key, (on_host, page) in self.oracle.where.items():
            for t in range(ps):
                slots[on_host].append(page * ps + t)
                want[on_host].append(float(self._kv_id(key[: len(key) - ps + t + 1])))
        for r in self.reqs.values():
            for i in range(r.shared * ps, len(r.tokens)):
                slots[False].append(r.pages[i // ps] * ps + i % ps)
                want[False].append(float(self._kv_id(r.tokens[: i + 1])))
        for on_host, kv in ((False, self.pool.k), (True, self.host.k if self.host else None)):
            if slots[on_host]:
                assert kv is not None
                got = kv[0, torch.tensor(slots[on_host]), 0, 0]
                bad = (got != torch.tensor(want[on_host])).nonzero().flatten().tolist()
                assert not bad, (f"{'host' if on_host else 'device'} slots "
                                 f"{[slots[on_host][b] for b in bad[:4]]} hold the wrong KV")


class RadixMachinePage3(RadixMachine):
    page_size = 3


class HostTierMachine(RadixMachine):
    """A small device pool over a host tier that fills: offloads, restores
    (whole and partial), host LRU drops."""

    device_pages = 10
    host_pages = 6


class HostTierMachinePage3(RadixMachine):
    """A host tier of two pages, smaller than many evicted nodes (those are
    dropped with their host subtree instead), and more live requests, so more
    restores find the device short."""

    page_size = 3
    device_pages = 10
    host_pages = 2
    max_live = 6


def _settings(n: int) -> settings:
    return settings(max_examples=n, stateful_step_count=50, deadline=None)


TestRadixMachine = RadixMachine.TestCase
TestRadixMachine.settings = _settings(60)
TestRadixMachinePage3 = RadixMachinePage3.TestCase
TestRadixMachinePage3.settings = _settings(25)
TestHostTierMachine = HostTierMachine.TestCase
TestHostTierMachine.settings = _settings(150)
TestHostTierMachinePage3 = HostTierMachinePage3.TestCase
TestHostTierMachinePage3.settings = _settings(80)


# ---------------------------------------------------------------- state checkpoints

@dataclass
class StatefulReq:
    tokens: list[int]
    node: RadixNode
    shared: int  # pages[:shared] belong to the tree (pinned by node, which holds a checkpoint)
    pages: list[int]
    slot: int  # the request's own state slot
    checkpoints: list[tuple[int, int]]  # saved (tokens, slot), not yet given to the tree


class StatefulRadixMachine(RuleBasedStateMachine):
    """A stateful cache (hybrid models), with or without a host tier: requests
    resume at the deepest checkpoint they match (restoring what the match found
    on the host), save checkpoints at page boundaries of what they computed
    (``alloc_state``, which evicts the LRU leaf at the cap), hand them to the
    tree with their pages (mid-way, as a published prompt, and at the end) or
    give them back (abort). A naive twin maps every cached prefix to its tier
    and page and knows which prefixes hold a checkpoint; after every step the
    tree, the twin and the slot partitions (device and host states) agree,
    every cached prefix has a checkpoint at or below it, evictions took the
    least recently used device leaves whole (pages and checkpoint), and every
    checkpoint slot (either tier) and page holds the state / KV of the prefix it
    ends: the planned moves ran and moved the right slots."""

    page_size = 2
    device_pages = 24
    max_states = 4
    max_live = 3
    host_pages: int | None = None
    host_states = 0

    def __init__(self) -> None:
        super().__init__()
        ps = self.page_size
        self.a = PageAllocator(self.device_pages)
        self.kv = KVPool(1, self.device_pages, ps, 1, 1, torch.float32, "cpu")
        self.pool = StatePool(StateLayout(1, 1, 1, 1, 1, 1), self.max_live + self.max_states, torch.float32)
        self.host = (HostKVTier(self.kv, self.host_pages, states=self.pool, state_slots=self.host_states)
                     if self.host_pages else None)
        self.c = RadixCache(ps, self.a, host=self.host, states=self.pool, max_states=self.max_states)
        self.oracle = NaiveTieredCache(ps)
        self.ckpts: set[Prefix] = set()  # prefixes holding a checkpoint (on their last page's tier)
        self.reqs: dict[int, StatefulReq] = {}
        self.next_id = 0
        self.history: list[list[int]] = [[]]
        self.ids: dict[Prefix, int] = {}

    # -- helpers
    def _id(self, seq: Sequence[int]) -> float:
        """The KV of a prefix's last token, and the state after a prefix, are its id."""
        return float(self.ids.setdefault(tuple(seq), len(self.ids) + 1))

    def _pick(self, i: int) -> StatefulReq:
        return self.reqs[sorted(self.reqs)[i % len(self.reqs)]]

    def _sync(self) -> None:
        """After a cache call: replay its planned page moves in the twin, run all
        moves (the engine flushes before the next step), forget the prefixes whose
        page was freed and their checkpoints."""
        if self.host is not None:
            self.oracle.apply_moves(self.host.pending_moves())
            self.host.flush()
        self.oracle.drop_freed(self.a, self.host.allocator if self.host else None)
        self.oracle.assert_shape()
        self.ckpts &= set(self.oracle.where)

    def _state_match(self, tokens: Sequence[int]) -> int:
        """Tokens of the deepest checkpointed prefix of the device match."""
        dev, _ = self.oracle.match(tokens)
        return max([j * self.page_size for j in range(1, len(dev) + 1)
                    if tuple(tokens[: j * self.page_size]) in self.ckpts], default=0)

    def _check_state_match(self, m: PrefixMatch, tokens: Sequence[int]) -> None:
        assert m.state_tokens == self._state_match(tokens), "the deepest device checkpoint of the match"
        assert m.state_node is not None and m.state_node.state == m.state_slot
        assert (m.state_slot >= 0) == (m.state_tokens > 0)
        if m.state_slot >= 0:
            assert float(self.pool.recurrent[0, m.state_slot]) == self._id(tokens[: m.state_tokens])

    def _match(self, tokens: Sequence[int]) -> PrefixMatch:
        m = self.c.match_prefix(tokens)
        dev, host = self.oracle.match(tokens)
        assert m.pages == dev and m.host_tokens == len(host) * self.page_size
        self._check_state_match(m, tokens)
        self.oracle.touch(tokens, len(dev) + len(host))
        return m

    def _leaves(self) -> list[tuple[int, list[int]]]:
        """(LRU time, pages) of every device eviction candidate: unlocked, no device child."""
        at = {loc: key for key, loc in self.oracle.where.items()}
        return [(self.oracle.last_use[at[(False, n.pages[0])]], list(n.pages)) for n in nodes(self.c)
                if not n.on_host and n.ref == 0 and all(ch.on_host for ch in n.children.values())]

    def _check_lru(self, before: list[tuple[int, list[int]]]) -> None:
        """The candidates that left the device (offloaded or dropped) were the least
        recently used ones, whole; then _sync."""
        gone = [t for t, pages in before if all(self.a.is_free(p) for p in pages)]
        kept = [t for t, pages in before if not any(self.a.is_free(p) for p in pages)]
        assert len(gone) + len(kept) == len(before), "a leaf was evicted in part"
        if gone and kept:
            assert max(gone) <= min(kept), "evicted a leaf used more recently than a kept one"
        self._sync()

    def _write_kv(self, r: StatefulReq) -> None:
        ps = self.page_size
        pos = list(range(r.shared * ps, len(r.tokens)))
        if pos:
            slots = torch.tensor([r.pages[i // ps] * ps + i % ps for i in pos])
            self.kv.k[0, slots, 0, 0] = torch.tensor([self._id(r.tokens[: i + 1]) for i in pos])

    def _insert(self, r: StatefulReq, end: int, give: list[tuple[int, int]]) -> None:
        """The tree takes r's pages up to ``end`` (a checkpoint: given, or r's match)
        with the checkpoints ``give``; r then locks the node ending at ``end``."""
        ps = self.page_size
        toks = r.tokens[:end]
        present, dups, superseded = self.oracle.insert(toks, r.pages[: end // ps])
        self.oracle.touch(toks, end // ps)
        assert self.c.insert(toks, r.pages[: end // ps], give) == present
        assert all(self.a.is_free(p) for p in dups), "duplicate pages must be freed"
        assert self.host is not None or not superseded
        # A checkpoint of a prefix the insert took back from the host tier comes back
        # to the device, or is dropped where no device slot is free.
        held = self._tree_checkpoints()
        dropped = {k for k in self.ckpts if k not in held}
        assert all(self.oracle.where[k][0] and len(k) <= end for k in dropped), (
            "only checkpoints of host prefixes the insert took back may go")
        self.ckpts -= dropped
        for n_tok, slot in give:
            key = tuple(toks[:n_tok])
            if held.get(key) == slot:
                self.ckpts.add(key)
            else:
                assert key in held and slot in self.pool.free_slots(), "a second checkpoint of one prefix is freed"
        self._sync()
        m = self._match(toks)
        assert m.num_tokens == end and m.state_tokens == end, "what was just inserted must match"
        self.c.lock(m.state_node)  # type: ignore[arg-type]
        self.c.unlock(r.node)
        r.node, r.shared, r.pages = m.state_node, end // ps, m.pages + r.pages[end // ps:]  # type: ignore[assignment]
        r.checkpoints = [(n, s) for n, s in r.checkpoints if n > end]

    def _tree_checkpoints(self) -> dict[Prefix, int]:
        held: dict[Prefix, int] = {}
        stack: list[tuple[RadixNode, Prefix]] = [(self.c.root, ())]
        while stack:
            n, key = stack.pop()
            if n.state >= 0:
                held[key] = n.state
            stack.extend((ch, key + tuple(ch.key)) for ch in n.children.values())
        return held

    def _save(self, r: StatefulReq, end: int) -> None:
        """alloc_state for a checkpoint of r at ``end`` tokens, checked: at the cap
        it evicts the LRU leaf (whole); it refuses only when every leaf is locked.
        The state is then written as the engine's save copies it: after the
        step's planned moves (a just-offloaded slot may come back at once)."""
        full = self.c.cached_states + self.c.states_out >= self.max_states
        before, cached = self._leaves(), self.c.cached_states
        slot = self.c.alloc_state()
        self._check_lru(before)
        if full and before:
            assert self.c.cached_states == cached - 1, "saving at the cap evicts one leaf (and its checkpoint)"
        assert (slot is None) == (full and not before), "a checkpoint is refused only if all are locked"
        if slot is not None:
            self.pool.recurrent[0, slot] = self._id(r.tokens[:end])
            r.checkpoints.append((end, slot))

    # -- rules
    @precondition(lambda self: len(self.reqs) < self.max_live)
    @rule(base=st.integers(0, 1000), suffix=token_lists)
    def start_request(self, base: int, suffix: list[int]) -> None:
        tokens = self.history[-1 - base % len(self.history)] + suffix
        m = self._match(tokens)
        if m.host_node is not None:
            # (Its evictions are not checked for LRU order: the loads reuse the freed pages.)
            m = self.c.restore(m)
            self._sync()
            assert m.host_node is None and m.pages == self.oracle.match(tokens)[0][: len(m.pages)]
            self._check_state_match(m, tokens)
        node = m.state_node
        assert node is not None
        self.c.lock(node)
        shared = m.state_tokens // self.page_size
        need = -(-len(tokens) // self.page_size) - shared
        priv = self.a.alloc(need)
        if priv is None:
            before = self._leaves()
            self.c.evict(need - self.a.num_free)
            self._check_lru(before)
            priv = self.a.alloc(need)
        if priv is None:
            self.c.unlock(node)
            return
        r = StatefulReq(tokens, node, shared, m.pages[:shared] + priv, self.pool.alloc(), [])
        self._write_kv(r)
        self.reqs[self.next_id] = r
        self.next_id += 1

    @precondition(lambda self: bool(self.reqs))
    @rule(i=st.integers(0, 1000), new=st.lists(st.integers(0, 2), min_size=1, max_size=5))
    def generate(self, i: int, new: list[int]) -> None:
        r = self._pick(i)
        tokens = r.tokens + new
        more = self.a.alloc(-(-len(tokens) // self.page_size) - len(r.pages))
        if more is not None:
            r.tokens, r.pages = tokens, r.pages + more
            self._write_kv(r)

    @precondition(lambda self: bool(self.reqs))
    @rule(i=st.integers(0, 1000), at=st.integers(0, 1000))
    def save_checkpoint(self, i: int, at: int) -> None:
        """A chunk ended on a page boundary past the request's match: its state is saved."""
        r = self._pick(i)
        ps = self.page_size
        taken = {n for n, _ in r.checkpoints}
        ends = [e for e in range(r.shared * ps + ps, len(r.tokens) // ps * ps + 1, ps) if e not in taken]
        if ends and not r.checkpoints:
            self._save(r, ends[at % len(ends)])

    @precondition(lambda self: bool(self.reqs))
    @rule(i=st.integers(0, 1000))
    def publish(self, i: int) -> None:
        """The pages up to the deepest checkpoint saved go to the tree, with it."""
        r = self._pick(i)
        if r.checkpoints:
            end = max(n for n, _ in r.checkpoints)
            self._insert(r, end, [(n, s) for n, s in r.checkpoints if n <= end])

    @precondition(lambda self: bool(self.reqs))
    @rule(i=st.integers(0, 1000))
    def finish(self, i: int) -> None:
        """As a prompt's end does in the engine, the last whole page gets a
        checkpoint (when a slot is free), then the pages go up to the deepest."""
        r = self._pick(i)
        last = len(r.tokens) // self.page_size * self.page_size
        if last > max([n for n, _ in r.checkpoints] + [r.shared * self.page_size]):
            self._save(r, last)
        end = max([n for n, _ in r.checkpoints] + [r.shared * self.page_size])
        self._insert(r, end, list(r.checkpoints))
        self.a.free(r.pages[r.shared:])
        self.c.unlock(r.node)
        self.pool.free(r.slot)
        del self.reqs[next(k for k, v in self.reqs.items() if v is r)]
        self.history.append(r.tokens)

    @precondition(lambda self: bool(self.reqs))
    @rule(i=st.integers(0, 1000))
    def abort(self, i: int) -> None:
        r = self._pick(i)
        for _, slot in r.checkpoints:
            self.c.free_state(slot)
        self.a.free(r.pages[r.shared:])
        self.c.unlock(r.node)
        self.pool.free(r.slot)
        del self.reqs[next(k for k, v in self.reqs.items() if v is r)]

    @rule(n=st.integers(0, 3), roll=st.integers(0, 3))
    def evict(self, n: int, roll: int) -> None:
        # One call in four: evictions (at the cap, by alloc_state, too) must not
        # keep the tree from growing.
        if roll != 2:
            return
        before = self._leaves()
        evictable = self.c.evictable_pages
        free = self.a.num_free
        freed = self.c.evict(n)
        assert self.a.num_free - free >= freed >= min(n, evictable)
        self._check_lru(before)

    @rule(roll=st.integers(0, 9))
    def reset(self, roll: int) -> None:
        if roll != 7:
            return
        locked = self.c.locked_pages > 0
        assert self.c.reset() == (not locked)
        if not locked:
            assert self.c.cached_pages == 0 and self.c.cached_states == 0 and self.c.host_cached_states == 0
            self._sync()
            assert not self.oracle.where and not self.ckpts
            self.oracle.clear()

    @rule(base=st.integers(0, 1000), suffix=token_lists)
    def query(self, base: int, suffix: list[int]) -> None:
        self._match(self.history[-1 - base % len(self.history)] + suffix)

    # -- after every step
    @invariant()
    def consistent(self) -> None:
        live = [p for r in self.reqs.values() for p in r.pages[r.shared:]]
        live_states = [r.slot for r in self.reqs.values()] + [s for r in self.reqs.values() for _, s in r.checkpoints]
        self.c.check_integrity(live, live_states)
        assert tree_pages(self.c, False) == self.oracle.pages(False)
        assert tree_pages(self.c, True) == self.oracle.pages(True)
        assert self.c.states_out == sum(len(r.checkpoints) for r in self.reqs.values())
        held = self._tree_checkpoints()
        assert set(held) == self.ckpts, "the tree's checkpoints are the twin's"
        host = self.host
        for key, slot in held.items():  # each checkpoint holds the state after its prefix
            on_host = self.oracle.where[key][0]
            value = (host.state_recurrent[slot, 0] if on_host and host is not None and host.state_recurrent is not None
                     else self.pool.recurrent[0, slot])
            assert float(value) == self._id(key), f"{'host' if on_host else 'device'} checkpoint {slot} of {key}"
        for key, (on_host, page) in self.oracle.where.items():  # and each page the KV of its prefix
            kv = host.k if on_host and host is not None else self.kv.k
            assert float(kv[0, page * self.page_size + self.page_size - 1, 0, 0]) == self._id(key), key
            assert any(k[: len(key)] == key for k in self.ckpts), f"cached prefix {key} has no checkpoint below"
        pinned = {k for r in self.reqs.values() for k in self.oracle.prefixes(r.tokens)[: r.shared]}
        assert self.c.locked_pages == len(pinned)
        for r in self.reqs.values():
            assert r.shared == 0 or tuple(r.tokens[: r.shared * self.page_size]) in self.ckpts, "locks a checkpoint"


class StatefulHostTierMachine(StatefulRadixMachine):
    """The same over a host tier that fills: checkpoints offloaded with their
    pages (dropped with them where the host has no state slot left), restored
    into device slots within the cap, taken back by inserts."""

    device_pages = 12
    host_pages = 8
    host_states = 3


class StatefulHostTierMachinePage3(StatefulRadixMachine):
    """Pages of 3 over a host tier of two pages and one state slot: most offloads
    find no room and drop the node, pages and checkpoint, with its host subtree."""

    page_size = 3
    device_pages = 12
    host_pages = 2
    host_states = 1


TestStatefulRadixMachine = StatefulRadixMachine.TestCase
TestStatefulRadixMachine.settings = _settings(80)
TestStatefulHostTierMachine = StatefulHostTierMachine.TestCase
TestStatefulHostTierMachine.settings = _settings(100)
TestStatefulHostTierMachinePage3 = StatefulHostTierMachinePage3.TestCase
TestStatefulHostTierMachinePage3.settings = _settings(60)


def test_restore_drops_a_host_node_left_without_its_checkpoint() -> None:
    """restore pins its host path while it makes device room; the device eviction's
    offload can make host room by dropping the LRU host leaf, which may be the
    checkpointed part below the pinned target (a match ending inside a host node
    splits it there). The target is then a host leaf without a checkpoint: restore
    drops it once unpinned, and the tree stays consistent."""
    ps = 1
    a = PageAllocator(4)  # 3 pages (page 0 is the dummy)
    kv = KVPool(1, 4, ps, 1, 1, torch.float32, "cpu")
    pool = StatePool(StateLayout(1, 1, 1, 1, 1, 1), 4, torch.float32)
    host = HostKVTier(kv, 5, states=pool, state_slots=2)
    assert a.num_free == 3
    c = RadixCache(ps, a, host=host, states=pool, max_states=2)

    def insert(tokens: list[int], cuts: list[int]) -> None:
        pages = a.alloc(len(tokens))
        assert pages is not None
        c.insert(tokens, pages, [(n, c.alloc_state()) for n in cuts])  # type: ignore[misc]
        host.flush()

    insert([1, 2, 3], [1, 3])  # X = [1] (checkpoint), W = [2, 3] (checkpoint)
    assert c.evict(3) == 3 and c.host_cached_pages == 3  # both to the host tier
    host.flush()
    insert([9, 8, 7], [3])  # D fills the device
    m = c.match_prefix([1, 2, 7])  # host [1] and half of W: split into Y = [2] | Z = [3]
    assert m.host_tokens == 2 and m.state_tokens == 0
    got = c.restore(m)  # X back to the device; making room offloads D, which drops Z (the host LRU leaf)
    host.flush()
    assert got.state_tokens == 1
    c.check_integrity()
    assert c.match_prefix([1, 2], count_stats=False).host_tokens == 0  # Y went with Z's checkpoint
