"""KV host tier on the CPU: page moves carry the right KV both ways, host LRU,
randomized operation sequences with integrity and content checks after every
operation (both tiers), and the real engine resuming a conversation whose
prefix was pushed out to the host tier with identical greedy output. The
engine's model is made context-sensitive (engine_util.make_context_sensitive):
on plain dummy weights the greedy token depends on the last input token alone,
so restored pages holding the wrong KV (or none) would not change the tokens."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from ftserve.config import ConfigError, EngineConfig
from ftserve.engine.engine import Engine
from ftserve.engine.setup import build_engine
from ftserve.kvcache.allocator import PageAllocator
from ftserve.kvcache.host_tier import HostKVTier
from ftserve.kvcache.pool import KVPool
from ftserve.kvcache.radix import RadixCache
from tests.engine_util import collect, greedy, make_context_sensitive, reference_greedy, tokens_of

PS = 2  # page size of the radix-level tests


def make(dev_pages: int = 9, host_pages: int = 6) -> tuple[KVPool, HostKVTier, RadixCache]:
    pool = KVPool(2, dev_pages, PS, 1, 2, torch.float32, "cpu")
    host = HostKVTier(pool, host_pages)
    return pool, host, RadixCache(PS, PageAllocator(dev_pages), host=host)


def write_kv(pool: KVPool, tokens: list[int], pages: list[int]) -> None:
    """Fake KV that identifies its token: k = token (+ layer offset), v = -k."""
    for i, t in enumerate(tokens[: len(pages) * PS]):
        slot = pages[i // PS] * PS + i % PS
        for layer in range(pool.num_layers):
            pool.k[layer, slot] = t + 1000 * layer
            pool.v[layer, slot] = -(t + 1000 * layer)


def assert_kv(pool: KVPool | HostKVTier, tokens: list[int], pages: list[int]) -> None:
    for i, t in enumerate(tokens[: len(pages) * PS]):
        slot = pages[i // PS] * PS + i % PS
        for layer in range(pool.k.shape[0]):
            assert pool.k[layer, slot, 0, 0].item() == t + 1000 * layer, (i, t, layer)
            assert pool.v[layer, slot, 0, 1].item() == -(t + 1000 * layer), (i, t, layer)


def put(pool: KVPool, c: RadixCache, tokens: list[int]) -> None:
    """Cache tokens as a finished request would (its KV written first)."""
    pages = c.allocator.alloc(-(-len(tokens) // PS))
    if pages is None:
        c.evict(-(-len(tokens) // PS) - c.allocator.num_free)
        pages = c.allocator.alloc(-(-len(tokens) // PS))
    assert pages is not None
    assert c.host is not None
    c.host.flush()  # offloads planned by that evict read the old KV before we overwrite it
    write_kv(pool, tokens, pages)
    c.insert(tokens, pages)
    c.allocator.free(pages[len(tokens) // PS:])


def test_offload_then_restore_moves_the_kv() -> None:
    pool, host, c = make(dev_pages=5, host_pages=6)  # 4 usable device pages
    a = list(range(100, 108))  # 4 pages
    put(pool, c, a)
    c.check_integrity()
    assert c.evict(4) == 4
    assert c.cached_pages == 0 and c.host_cached_pages == 4 and host.num_pending == 4
    host.flush()
    assert host.num_pending == 0 and host.counters.pages_offloaded_total == 4
    pool.k.zero_()
    pool.v.zero_()  # device copies gone: only the host tier has the KV now
    m = c.match_prefix(a)
    assert m.num_tokens == 0 and m.host_tokens == 8 and m.host_node is not None
    assert_kv(host, a, m.host_node.pages)  # type: ignore[arg-type]
    r = c.restore(m)
    assert r.num_tokens == 8 and len(r.pages) == 4 and c.host_cached_pages == 0
    c.check_integrity()
    assert host.has_pending_loads
    assert host.flush(layered=True) is None  # the CPU copies at once: no events to wait for
    assert not host.has_pending_loads and host.flush(layered=True) is None
    assert_kv(pool, a, r.pages)
    assert c.host_hit_tokens_total == 8 and c.hit_tokens_total == 8


def test_restore_partial_when_device_is_short() -> None:
    pool, host, c = make(dev_pages=4, host_pages=8)  # 3 usable device pages
    a = [1, 2, 3, 4, 5, 6]
    put(pool, c, a)
    c.evict(3)
    host.flush()
    c.lock(c.root)
    live = c.allocator.alloc(2)  # a live request holds 2 of the 3 device pages
    assert live is not None
    r = c.restore(c.match_prefix(a))
    assert r.num_tokens == 2 and len(r.pages) == 1  # the top page came back, the rest stays
    assert c.host_cached_pages == 2
    c.check_integrity(live)
    host.flush()
    assert_kv(pool, a, r.pages)
    m = c.match_prefix(a)
    assert m.num_tokens == 2 and m.host_tokens == 4
    c.unlock(c.root)


def test_insert_over_host_pages_takes_the_fresh_device_pages() -> None:
    pool, host, c = make()
    a = [5, 6, 7, 8]
    put(pool, c, a)
    c.evict(2)
    assert c.host_cached_pages == 2
    put(pool, c, a + [9, 10])  # recomputed privately: the host copy is superseded
    assert c.host_cached_pages == 0 and c.cached_pages == 3
    c.check_integrity()
    host.flush()
    m = c.match_prefix(a + [9, 10])
    assert m.host_node is None and m.num_tokens == 6
    assert_kv(pool, a + [9, 10], m.pages)


def test_host_lru_drops_the_oldest_prefix_when_full() -> None:
    pool, host, c = make(dev_pages=5, host_pages=4)  # 4 device pages, 4 host pages
    convs = [[10 * k + i for i in range(4)] for k in range(1, 6)]  # 2 pages each
    for conv in convs:
        put(pool, c, conv)  # each insert pushes the least recent ones down a tier
        c.check_integrity()
    host.flush()
    # Device: the two newest; host: the two before; the first was dropped.
    assert c.match_prefix(convs[4]).num_tokens == 4
    assert c.match_prefix(convs[3]).num_tokens == 4
    m1 = c.match_prefix(convs[1])
    assert m1.num_tokens == 0 and m1.host_tokens == 4
    assert c.match_prefix(convs[2]).host_tokens == 4
    m0 = c.match_prefix(convs[0])
    assert m0.num_tokens == 0 and m0.host_tokens == 0
    assert c.host_dropped_pages_total == 2 and c.host_cached_pages == 4
    # convs[2] was touched after convs[1]; touching convs[1] again makes
    # convs[2] the host tier's LRU victim when convs[4] (device LRU) comes down.
    assert c.match_prefix(convs[1]).host_tokens == 4
    put(pool, c, [99, 98, 97, 96])
    host.flush()
    assert c.match_prefix(convs[1]).host_tokens == 4
    assert c.match_prefix(convs[4]).host_tokens == 4
    assert c.match_prefix(convs[3]).num_tokens == 4
    assert c.match_prefix(convs[2]).host_tokens == 0
    c.check_integrity()


def test_reset_frees_both_tiers() -> None:
    pool, host, c = make()
    put(pool, c, list(range(12)))
    c.evict(3)
    assert c.host_cached_pages == 3
    assert c.reset()
    c.check_integrity()
    assert c.host_cached_pages == 0 and host.num_free == host.num_total


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_both_tiers_sound(seed: int) -> None:
    """Random insert / match+restore+lock / unlock / evict / reset; after every
    operation the integrity check (both tiers) and, for every locked match,
    the KV content of its pages are verified."""
    rng = random.Random(seed)
    pool, host, c = make(dev_pages=rng.randint(6, 14), host_pages=rng.randint(1, 10))
    stems = [[rng.randrange(5) for _ in range(rng.randint(2, 8))] for _ in range(4)]
    locks: list[tuple[list[int], list[int], object]] = []  # (tokens, pages, node)
    for _ in range(150):
        op = rng.random()
        toks = rng.choice(stems) + [rng.randrange(5) for _ in range(rng.randint(0, 8))]
        if op < 0.35:
            n = -(-len(toks) // PS)
            if c.allocator.num_free < n:
                c.evict(n - c.allocator.num_free)
            pages = c.allocator.alloc(n)
            if pages is not None:
                host.flush()
                write_kv(pool, toks, pages)
                c.insert(toks, pages)
                c.allocator.free(pages[len(toks) // PS:])
        elif op < 0.65:
            m = c.restore(c.match_prefix(toks))
            c.lock(m.node)
            locks.append((toks[: m.num_tokens], m.pages, m.node))
        elif op < 0.8 and locks:
            _, _, node = locks.pop(rng.randrange(len(locks)))
            c.unlock(node)  # type: ignore[arg-type]
        elif op < 0.95:
            c.evict(rng.randint(1, 6))
        elif c.reset():
            assert all(not pages for _, pages, _ in locks)  # only empty matches (the root)
        c.check_integrity()
        host.flush()
        for t, pages, _ in locks:
            assert_kv(pool, t, pages)
    for _, _, node in locks:
        c.unlock(node)  # type: ignore[arg-type]
    c.check_integrity()
    assert c.reset()
    c.check_integrity()


# ---------------------------------------------------------------- config


def test_config_validation_names_the_flag() -> None:
    with pytest.raises(ConfigError, match="--kv-host-pages"):
        EngineConfig(kv_host_pages=0).validate()
    with pytest.raises(ConfigError, match="--kv-host-gib"):
        EngineConfig(kv_host_gib=-1.0).validate()
    with pytest.raises(ConfigError, match="not both"):
        EngineConfig(kv_host_pages=4, kv_host_gib=1.0).validate()
    with pytest.raises(ConfigError, match="--disable-prefix-cache"):
        EngineConfig(kv_host_pages=4, enable_prefix_cache=False).validate()


def test_cli_flags_reach_the_config() -> None:
    from ftserve.cli import build_parser, configs_from_args

    eng, _ = configs_from_args(build_parser().parse_args(["serve", "--kv-host-pages", "128"]))
    assert eng.kv_host_pages == 128 and eng.kv_host_gib is None
    eng, _ = configs_from_args(build_parser().parse_args(["serve", "--kv-host-gib", "1.5"]))
    assert eng.kv_host_gib == 1.5


# ---------------------------------------------------------------- engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from ftserve.models.checkpoint import write_checkpoint

    out = tmp_path_factory.mktemp("tiny-moe-host")
    write_checkpoint("tiny-moe", out, config_only=True)
    return str(out)


def make_engine(model_dir: str, **kw: object) -> Engine:
    base = dict(model=model_dir, load_format="dummy", device="cpu", dtype="float32",
                page_size=4, num_pages=41, max_prefill_length=32, max_running_requests=4,
                status_log_interval=0.0, kv_host_pages=64)
    base.update(kw)
    eng = build_engine(EngineConfig(**base))  # type: ignore[arg-type]
    eng.check_integrity = True
    make_context_sensitive(eng.runner.model)  # else greedy tokens cannot see wrong KV
    return eng


def test_conversation_resumes_from_the_host_tier(model_dir: str) -> None:
    rng = random.Random(7)
    eng = make_engine(model_dir)
    try:
        s = eng.scheduler
        turn1 = [rng.randrange(10, 32000) for _ in range(45)]
        out1 = tokens_of(collect(eng, [("t1", turn1, greedy(6))])["t1"])
        # Fill the 40-page device pool with other conversations: turn 1's pages
        # are the least recently used, so they move to the host tier.
        for k in range(3):
            filler = [rng.randrange(10, 32000) for _ in range(60)]
            collect(eng, [(f"f{k}", filler, greedy(2))])
        turn2 = turn1 + out1 + [rng.randrange(10, 32000) for _ in range(9)]
        m = s.radix.match_prefix(turn2, count_stats=False)
        assert m.host_tokens >= 40, "turn 1's prefix should sit in the host tier now"
        hits_before = s.radix.host_hit_tokens_total
        outs = collect(eng, [("t2", turn2, greedy(8))])["t2"]
        restored = s.radix.host_hit_tokens_total - hits_before
        assert restored == m.host_tokens
        assert outs[-1].cached_tokens == m.num_tokens + m.host_tokens >= 48
        assert tokens_of(outs) == reference_greedy(eng.runner.model, eng.model_config, turn2, 8)
        st = eng.stats()
        assert st.kv_host_pages_total == 64 and st.kv_host_hit_tokens_total >= restored
        s.check_integrity()
    finally:
        eng.shutdown()
    # The same conversation on an engine that never evicts: same tokens.
    big = make_engine(model_dir, num_pages=512, kv_host_pages=None)
    try:
        collect(big, [("t1", turn1, greedy(6))])
        assert tokens_of(collect(big, [("t2", turn2, greedy(8))])["t2"]) == tokens_of(outs)
    finally:
        big.shutdown()


def test_engine_host_tier_full_drops_the_oldest(model_dir: str) -> None:
    rng = random.Random(3)
    eng = make_engine(model_dir, kv_host_pages=12)
    try:
        convs = [[rng.randrange(10, 32000) for _ in range(48)] for _ in range(5)]
        for i, conv in enumerate(convs):
            collect(eng, [(f"c{i}", conv, greedy(1))])
        # 5 x 12 full pages for 40 device + 12 host pages: the 8 least recently
        # used (the tail of the first conversation) were dropped from the host.
        r = eng.scheduler.radix
        assert r.host_cached_pages == 12 and r.host_dropped_pages_total == 8
        first = r.match_prefix(convs[0], count_stats=False)
        assert first.num_tokens == 0 and first.host_tokens == 16
        for conv in convs[1:]:
            m = r.match_prefix(conv, count_stats=False)
            assert m.num_tokens + m.host_tokens == 48
        outs = collect(eng, [("again", convs[0] + [11, 12], greedy(3))])["again"]
        assert outs[-1].cached_tokens == 16
        assert tokens_of(outs) == reference_greedy(
            eng.runner.model, eng.model_config, convs[0] + [11, 12], 3)
        eng.scheduler.check_integrity()
    finally:
        eng.shutdown()


@pytest.mark.parametrize("seed", [0, 1])
def test_engine_random_shared_prefixes_under_both_evictions(model_dir: str, seed: int) -> None:
    """Requests over a few shared stems, in small concurrent waves, through a
    40-page device pool and a 20-page host tier: device eviction offloads,
    host LRU drops, admissions restore; integrity (both tiers) is checked after
    every engine step and every output equals a full recompute."""
    rng = random.Random(seed)
    eng = make_engine(model_dir, kv_host_pages=20)
    try:
        stems = [[rng.randrange(10, 32000) for _ in range(rng.randint(20, 44))] for _ in range(4)]
        for wave in range(8):
            reqs = []
            for i in range(rng.randint(1, 3)):
                p = rng.choice(stems)[: rng.randint(12, 44)] + [
                    rng.randrange(10, 32000) for _ in range(rng.randint(1, 24))]
                reqs.append((f"w{wave}r{i}", p, greedy(rng.randint(1, 3))))
            outs = collect(eng, reqs)
            for rid, p, params in reqs:
                assert tokens_of(outs[rid]) == reference_greedy(
                    eng.runner.model, eng.model_config, p, params.max_tokens), rid
        r = eng.scheduler.radix
        assert eng.runner.kv_host is not None
        assert eng.runner.kv_host.counters.pages_offloaded_total > 0
        assert r.host_hit_tokens_total > 0 and r.host_dropped_pages_total > 0
        eng.scheduler.check_integrity()
    finally:
        eng.shutdown()


def test_startup_reports_limit_and_both_capacities(
        model_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="ftserve.engine.setup"):
        eng = make_engine(model_dir, kv_host_pages=None, kv_host_gib=0.001)
    try:
        sm = eng.summary
        assert sm["kv_tokens"] == 40 * 4 and eng.max_model_len == 160
        per_page = KVPool.bytes_per_token(
            eng.model_config.num_layers, eng.model_config.num_kv_heads,
            eng.model_config.head_dim, torch.float32) * 4
        assert sm["kv_host_pages"] == int(0.001 * 2**30) // per_page
        assert sm["kv_host_tokens"] == sm["kv_host_pages"] * 4
        text = caplog.text
        assert "single-request limit 160 tokens" in text
        assert f"host tier {sm['kv_host_tokens']} tokens" in text
        assert "device 41 pages x 4 = 160 tokens" in text
    finally:
        eng.shutdown()


def test_bench_kv_tiers_smoke(tmp_path: object) -> None:
    """tools/bench/kv_tiers.py end to end on the CPU: each TTFT case really is
    the case it names (cached tokens), and every section ran."""
    from tools.bench.kv_tiers import main

    out = main(["--smoke", "--out", str(tmp_path) + "/kv.json"])  # type: ignore[operator]
    assert not out.get("errors"), out.get("errors")
    t = out["ttft"]
    prefix = t["prefix_tokens"]
    assert t["device"]["cached_tokens"] == prefix and t["host"]["cached_tokens"] == prefix
    assert t["recompute"]["cached_tokens"] == 0
    assert all(r["host_tokens_before"] == prefix for r in t["host"]["runs"])
    bw = out["bandwidth"]
    assert bw["restore_pages"] == bw["offload_pages"] == prefix // 16
    assert len(out["conversation"]["turns"]) == 7


def test_models_endpoint_reports_limit_and_capacities() -> None:
    """/v1/models over real HTTP: the single-request limit and the KV capacity
    of each tier are separate numbers; the banner says the same."""
    import asyncio
    import dataclasses

    import aiohttp

    from ftserve.api.serve import banner
    from tests.server_harness import TEST_ENGINE, start_live, stop_live

    live = start_live(dataclasses.replace(TEST_ENGINE, kv_host_pages=100))
    try:
        async def get() -> dict:  # type: ignore[type-arg]
            async with aiohttp.ClientSession() as s, s.get(live.url + "/v1/models") as resp:
                assert resp.status == 200
                return await resp.json()  # type: ignore[no-any-return]

        card = asyncio.run(get())["data"][0]
        assert card["max_model_len"] == 512  # TEST_ENGINE's --max-model-len
        assert card["kv_capacity_tokens"] == {"device": 191 * 16, "host": 100 * 16}
        async def metrics() -> str:
            async with aiohttp.ClientSession() as s, s.get(live.url + "/metrics") as resp:
                return await resp.text()

        body = asyncio.run(metrics())
        assert "ftserve_kv_host_pages_total 100.0" in body
        assert "ftserve_kv_host_hit_tokens_total" in body
        text = banner(live.state, "127.0.0.1", live.server.port)
        assert "max context 512 tokens per request" in text
        assert f"KV capacity {191 * 16} tokens on the device, {100 * 16} in the host tier" in text
    finally:
        stop_live(live)
