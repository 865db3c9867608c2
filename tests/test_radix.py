"""RadixCache: unit tests of every method and error (random operation
sequences live in test_radix_stateful.py)."""

from __future__ import annotations

import time

import pytest

from ftserve.kvcache.allocator import PageAllocator
from ftserve.kvcache.radix import RadixCache


def tree_pages(cache: RadixCache) -> list[int]:
    out: list[int] = []
    stack = [cache.root]
    while stack:
        n = stack.pop()
        out.extend(n.pages)
        stack.extend(n.children.values())
    return out


def num_nodes(cache: RadixCache) -> int:
    count, stack = 0, [cache.root]
    while stack:
        n = stack.pop()
        count += 1
        stack.extend(n.children.values())
    return count


def make(num_pages: int = 32, page_size: int = 2) -> tuple[PageAllocator, RadixCache]:
    a = PageAllocator(num_pages)
    return a, RadixCache(page_size, a)


def put(a: PageAllocator, c: RadixCache, tokens: list[int]) -> list[int]:
    """Cache `tokens` as a finished request would; returns the tree's pages for them."""
    n = -(-len(tokens) // c.page_size)
    pages = a.alloc(n)
    assert pages is not None
    n_full = len(tokens) // c.page_size
    c.insert(tokens, pages)
    a.free(pages[n_full:])  # the private partial page
    return pages[:n_full]


# ------------------------------------------------------------------ unit tests
def test_empty_match_and_stats() -> None:
    a, c = make()
    m = c.match_prefix([1, 2, 3])
    assert m.pages == [] and m.num_tokens == 0 and m.node is c.root
    assert c.cached_pages == 0 and c.query_tokens_total == 3 and c.hit_tokens_total == 0
    c.check_integrity()


def test_insert_then_match_full_pages_only() -> None:
    a, c = make(page_size=4)
    pages = put(a, c, list(range(10)))  # 2 full pages + 2 tokens that stay private
    assert c.cached_pages == 2 and c.evictable_pages == 2 and c.locked_pages == 0
    m = c.match_prefix(list(range(10)))
    assert m.pages == pages and m.num_tokens == 8
    m = c.match_prefix(list(range(7)))  # 1 full page of the query
    assert m.pages == pages[:1] and m.num_tokens == 4
    assert c.match_prefix([0, 1, 2]).num_tokens == 0  # less than a page
    assert c.match_prefix([0, 1, 2, 9]).num_tokens == 0  # first page differs in its last token
    assert c.match_prefix((0, 1, 2, 3, 4, 5, 6, 7)).pages == pages  # any sequence type
    assert c.hit_tokens_total == 8 + 4 + 8 and c.query_tokens_total == 10 + 7 + 3 + 4 + 8
    c.match_prefix(list(range(8)), count_stats=False)
    assert c.query_tokens_total == 32
    c.check_integrity()
    assert c.insert([1, 2, 3], []) == 0, "less than a page inserts nothing"


def test_insert_frees_duplicates_and_keeps_shared_pages() -> None:
    a, c = make(page_size=2)
    first = put(a, c, [1, 2, 3, 4])
    # A second request computed the same 2 pages itself plus one more.
    own = a.alloc(3)
    assert own is not None
    assert c.insert([1, 2, 3, 4, 5, 6], own) == 4
    assert a.is_free(own[0]) and a.is_free(own[1]), "duplicates go back to the allocator"
    assert not a.is_free(own[2])
    assert c.match_prefix([1, 2, 3, 4, 5, 6]).pages == [*first, own[2]]
    # A request that reused the tree's pages passes them back: nothing is freed.
    free_before = a.num_free
    assert c.insert([1, 2, 3, 4, 5, 6], [*first, own[2]]) == 6
    assert a.num_free == free_before
    c.check_integrity()
    with pytest.raises(ValueError, match="only 1 pages"):
        c.insert([1, 2, 3, 4], [first[0]])


def test_match_inside_a_node_splits_it_and_lock_pins_exactly_the_match() -> None:
    a, c = make(page_size=2)
    pages = put(a, c, [1, 2, 3, 4, 5, 6, 7, 8])  # one node of 4 pages
    assert num_nodes(c) == 2
    m = c.match_prefix([1, 2, 3, 4, 0, 0])
    assert m.pages == pages[:2] and num_nodes(c) == 3
    c.lock(m.node)
    assert c.locked_pages == 2 and c.evictable_pages == 2
    c.check_integrity()
    assert c.evict(100) == 2
    assert sorted(tree_pages(c)) == sorted(pages[:2])
    assert c.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).pages == pages[:2]
    c.unlock(m.node)
    assert c.locked_pages == 0 and c.evictable_pages == 2
    c.check_integrity()


def test_split_under_a_lock_keeps_the_lock_on_the_same_pages() -> None:
    a, c = make(page_size=2)
    pages = put(a, c, [1, 2, 3, 4, 5, 6])
    m = c.match_prefix([1, 2, 3, 4, 5, 6])
    c.lock(m.node)
    put(a, c, [1, 2, 9, 9])  # splits the locked node after its first page
    c.check_integrity()
    assert c.locked_pages == 3 and c.evictable_pages == 1
    assert c.evict(100) == 1
    c.unlock(m.node)
    assert c.locked_pages == 0 and c.evictable_pages == 3
    assert c.match_prefix([1, 2, 3, 4, 5, 6]).pages == pages
    c.check_integrity()


def test_lock_counts_and_errors() -> None:
    a, c = make(page_size=2)
    put(a, c, [1, 2, 3, 4])
    m = c.match_prefix([1, 2, 3, 4])
    c.lock(m.node)
    c.lock(m.node)
    c.unlock(m.node)
    assert c.locked_pages == 2
    c.unlock(m.node)
    with pytest.raises(ValueError, match="without a matching lock"):
        c.unlock(m.node)
    c.check_integrity()
    c.lock(c.root)  # an empty match locks the root: no pages pinned
    assert c.locked_pages == 0
    c.unlock(c.root)
    with pytest.raises(ValueError):
        c.unlock(c.root)
    assert c.evict(2) == 2
    with pytest.raises(ValueError, match="evicted"):
        c.lock(m.node)
    c.check_integrity()


def test_evict_is_lru_over_leaves_and_cascades() -> None:
    a, c = make(page_size=2)
    p_a = put(a, c, [1, 1, 2, 2])
    p_b = put(a, c, [1, 1, 3, 3])
    p_c = put(a, c, [5, 5])
    c.match_prefix([1, 1, 2, 2])  # A is now the most recent; B the oldest leaf
    assert c.evict(1) == 1
    assert a.is_free(p_b[1]) and not a.is_free(p_a[1]) and not a.is_free(p_c[0])
    assert c.evict(1) == 1
    assert a.is_free(p_c[0]), "C is older than A's leaf"
    # The shared parent [1, 1] becomes a leaf only after A's leaf goes.
    assert c.evict(5) == 2
    assert c.cached_pages == 0 and a.num_free == a.num_total
    assert c.evict(0) == 0 and c.evict(3) == 0
    c.check_integrity()


def test_evict_trims_a_long_leaf_from_its_tail() -> None:
    a, c = make(page_size=2)
    pages = put(a, c, [1, 2, 3, 4, 5, 6, 7, 8])
    assert c.evict(3) == 3
    assert c.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).pages == pages[:1]
    assert all(a.is_free(p) for p in pages[1:])
    c.check_integrity()


def test_reset() -> None:
    a, c = make(page_size=2)
    put(a, c, [1, 2, 3, 4])
    put(a, c, [7, 7])
    m = c.match_prefix([1, 2])
    c.lock(m.node)
    assert c.reset() is False and c.cached_pages == 3
    c.unlock(m.node)
    c.lock(c.root)  # a request with an empty match does not block a reset
    assert c.reset() is True
    assert c.cached_pages == 0 and a.num_free == a.num_total
    c.unlock(c.root)
    with pytest.raises(ValueError):
        c.lock(m.node)
    assert c.match_prefix([1, 2]).num_tokens == 0
    assert c.hit_tokens_total == 2, "lifetime counters survive a reset"
    c.check_integrity()


def test_check_integrity_catches_corruption() -> None:
    a, c = make(num_pages=8, page_size=2)
    pages = put(a, c, [1, 2, 3, 4])
    live = a.alloc(1)
    assert live is not None
    c.check_integrity(live)
    with pytest.raises(AssertionError, match="leaked"):
        c.check_integrity()  # the live page is not declared
    with pytest.raises(AssertionError, match="owned twice"):
        c.check_integrity([*live, pages[0]])
    with pytest.raises(AssertionError, match="owned twice"):
        c.check_integrity([*live, a.free_pages()[0]])
    with pytest.raises(AssertionError, match="outside"):
        c.check_integrity([*live, 0])
    node = c.match_prefix([1, 2, 3, 4]).node
    node.ref = 1  # a lock that bypassed lock(): counters disagree, parent has fewer refs
    with pytest.raises(AssertionError):
        c.check_integrity(live)
    node.ref = 0
    node.key.append(9)
    with pytest.raises(AssertionError, match="tokens for"):
        c.check_integrity(live)
    node.key.pop()
    c.check_integrity(live)


def test_second_turn_reuses_prompt_and_generated_tokens() -> None:
    ps = 4
    a, c = make(num_pages=64, page_size=ps)
    prompt1 = list(range(100, 111))  # 11 tokens
    m1 = c.match_prefix(prompt1)
    c.lock(m1.node)
    pages = a.alloc(-(-len(prompt1) // ps))
    assert m1.num_tokens == 0 and pages is not None
    tokens = list(prompt1)
    for t in range(500, 509):  # decode 9 tokens, growing the page list as needed
        tokens.append(t)
        need = -(-len(tokens) // ps) - len(pages)
        more = a.alloc(need)
        assert more is not None
        pages += more
        c.check_integrity(pages)
    # Finish: the full pages go to the tree, the partial page is freed.
    n_full = len(tokens) // ps
    assert c.insert(tokens, pages) == 0
    a.free(pages[n_full:])
    c.unlock(m1.node)
    c.check_integrity()
    prompt2 = tokens + [7, 8, 9, 10, 11]  # turn 1 resent plus the new user text
    m2 = c.match_prefix(prompt2)
    assert m2.num_tokens == n_full * ps == 20
    assert m2.pages == pages[:n_full], "turn 2 must reuse every full page of turn 1"


def test_chunked_prefill_pattern_relocks_deeper() -> None:
    """Insert after each prefill chunk, re-match, move the lock down."""
    ps = 4
    a, c = make(num_pages=64, page_size=ps)
    put(a, c, list(range(8)))  # someone cached the first 2 pages already
    prompt = list(range(30))
    m = c.match_prefix(prompt)
    assert m.num_tokens == 8
    c.lock(m.node)
    pages = list(m.pages)
    for end in (13, 22, 30):  # chunk boundaries, not page aligned
        more = a.alloc(-(-end // ps) - len(pages))
        assert more is not None
        pages += more
        n_full = end // ps
        c.insert(prompt[:end], pages)
        m2 = c.match_prefix(prompt[:end], count_stats=False)
        assert m2.num_tokens == n_full * ps
        c.lock(m2.node)
        c.unlock(m.node)
        m = m2
        pages = m2.pages + pages[n_full:]
        c.check_integrity(pages[n_full:])
        assert c.locked_pages == n_full
    c.unlock(m.node)
    a.free(pages[len(prompt) // ps :])
    c.check_integrity()


def test_long_prefix_match_is_cheap() -> None:
    """A 100k-token conversation inserted chunk by chunk stays a handful of nodes."""
    ps, chunk = 16, 4096
    a, c = make(num_pages=7000, page_size=ps)
    tokens = [(i * 7919) % 32000 for i in range(100_000)]
    pages: list[int] = []
    for end in range(chunk, len(tokens) + chunk, chunk):
        end = min(end, len(tokens))
        more = a.alloc(-(-end // ps) - len(pages))
        assert more is not None
        pages += more
        c.insert(tokens[:end], pages)
    assert num_nodes(c) <= len(tokens) // chunk + 2
    t0 = time.perf_counter()
    m = c.match_prefix(tokens + [1, 2, 3])
    elapsed = time.perf_counter() - t0
    assert m.num_tokens == len(tokens) and m.pages == pages
    assert elapsed < 0.25, f"matching a 100k-token prefix took {elapsed:.3f}s"
