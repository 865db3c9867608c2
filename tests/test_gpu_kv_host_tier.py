"""KV host tier on the GPU (issue 7 items 2-3): page moves through pinned host
memory with the fixed-shape copy kernel on the copy stream, no hidden sync in
the steps that offload and restore pages, and greedy output after a host-tier
restore identical (bit-for-bit KV) to the same turn served from the device cache.

Same engine shape and driver as tests/test_gpu_engine.py (scaled tiny-moe,
dummy bf16 weights, Triton attention, CUDA-graph decode).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ftserve.config import EngineConfig
from ftserve.engine.engine import Engine
from ftserve.kvcache.host_tier import HostKVTier
from ftserve.kvcache.pool import KVPool
from ftserve.models.checkpoint import write_config
from tests.engine_util import make_context_sensitive
from tests.test_gpu_engine import CHUNK, SCALE, CheckedDriver, sync_is_error

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    from ftserve.engine.setup import build_engine

    model_dir = write_config("tiny-moe", Path(tmp_path_factory.mktemp("gpu-host")), layers=2,
                                   **SCALE)
    cfg = EngineConfig(
        model=model_dir, load_format="dummy", device="cuda", dtype="bfloat16",
        attention_backend="triton", page_size=16, num_pages=257, max_prefill_length=CHUNK,
        max_running_requests=8, cuda_graph_max_bs=8, status_log_interval=0.0,
        kv_host_pages=512,
    )
    eng = build_engine(cfg)
    assert eng.runner.graphs is not None and eng.runner.kv_host is not None
    make_context_sensitive(eng.runner.model)  # else greedy tokens cannot see wrong KV
    yield eng
    eng.shutdown()


def test_page_moves_round_trip_without_sync() -> None:
    dev = torch.device("cuda")
    pool = KVPool(3, 16, 16, 2, 64, torch.bfloat16, dev)
    pool.k.normal_()
    pool.v.normal_()
    host = HostKVTier(pool, 8)
    assert host.k.is_pinned() and host.v.is_pinned()
    want_k = pool.k.clone()
    want_v = pool.v.clone()
    src, mid, dst = [3, 5, 7], [8, 2, 6], [9, 10, 11]  # 3 moves: padded to 4 (one -1 pair)
    host.queue_offload(src, mid)
    host.flush()  # compile the kernel for both directions outside the checked region
    host.queue_load(mid, dst)
    host.flush()
    torch.cuda.synchronize()
    pool.k.zero_()
    pool.v.zero_()
    with sync_is_error(True):
        host.queue_offload([1, 2], [1, 3])  # a run of each direction, in planning order
        host.queue_load(mid, dst)
        host.flush()
    torch.cuda.synchronize()
    ps = 16
    for s, d in zip(src, dst):
        rows_s, rows_d = slice(s * ps, (s + 1) * ps), slice(d * ps, (d + 1) * ps)
        assert torch.equal(pool.k[:, rows_d], want_k[:, rows_s])
        assert torch.equal(pool.v[:, rows_d], want_v[:, rows_s])
    assert torch.equal(host.k[:, 3 * ps:4 * ps], torch.zeros_like(host.k[:, :ps]))
    untouched = [p for p in range(1, 16) if p not in dst]
    for p in untouched:
        assert not pool.k[:, p * ps:(p + 1) * ps].any(), f"page {p} was written"


def test_layered_restore_waits_per_layer_without_sync() -> None:
    """flush(layered=True): one event per layer, each layer's pages moved once its
    event has fired, no host sync, correct while the compute stream is busy."""
    dev = torch.device("cuda")
    pool = KVPool(4, 64, 16, 2, 64, torch.bfloat16, dev)
    pool.k.normal_()
    pool.v.normal_()
    host = HostKVTier(pool, 32)
    src, mid, dst = list(range(1, 21)), list(range(5, 25)), list(range(40, 60))
    host.queue_offload(src, mid)
    host.flush()
    host.queue_load(mid, dst)
    assert host.has_pending_loads
    host.flush(layered=True)  # compile outside the checked region
    torch.cuda.synchronize()
    want_k, want_v = pool.k.clone(), pool.v.clone()
    pool.k[:, 40 * 16:60 * 16].zero_()  # the restore's destination pages, 40..59
    pool.v[:, 40 * 16:60 * 16].zero_()
    a = torch.randn(4096, 4096, device=dev)
    with sync_is_error(True):
        busy = a @ a  # the compute stream is busy when the copies are queued
        host.queue_load(mid, dst)
        events = host.flush(layered=True)
        assert events is not None and len(events) == pool.num_layers
        assert not host.has_pending_loads
        got = []
        for layer, ev in enumerate(events):
            torch.cuda.current_stream().wait_event(ev)
            got.append((pool.k[layer].clone(), pool.v[layer].clone()))
    torch.cuda.synchronize()
    del busy
    for layer, (k, v) in enumerate(got):
        assert torch.equal(k, want_k[layer]) and torch.equal(v, want_v[layer]), f"layer {layer}"


def host_scenario(engine: Engine, seed: int, check: bool, to_host: bool) -> tuple[CheckedDriver, list[int], int]:
    """Turn 1 (3 chunks) -> optionally push the whole prefix cache to the host
    tier -> turn 2 over it. Returns the driver, turn 2's output and its cached length."""
    sched = engine.scheduler
    radix = sched.radix
    assert radix.reset()
    drv = CheckedDriver(engine, seed, check)
    first = drv.add(drv.tokens(3 * CHUNK - 10), max_tokens=2)
    drv.until(lambda: first.finished)
    if to_host:
        radix.evict(radix.evictable_pages)  # offloads run in the next (checked) launch
        assert radix.cached_pages == 0 and radix.host_cached_pages > 0
    hits = radix.host_hit_tokens_total
    second = drv.add(first.tokens + drv.tokens(CHUNK + 50), max_tokens=4)
    drv.until(lambda: second.finished)
    full = (len(first.tokens) - 1) // 16 * 16
    assert second.cached_len >= full, (second.cached_len, full)
    if to_host:
        assert radix.host_hit_tokens_total - hits >= full
    sched.check_integrity()
    return drv, list(second.output_ids), second.cached_len


def test_host_tier_hit_has_no_hidden_syncs(engine: Engine) -> None:
    host_scenario(engine, seed=0, check=False, to_host=True)  # compile every shape once
    loads = engine.runner.kv_host.counters.pages_loaded_total  # type: ignore[union-attr]
    drv, _, _ = host_scenario(engine, seed=1, check=True, to_host=True)
    assert engine.runner.kv_host.counters.pages_loaded_total > loads  # type: ignore[union-attr]
    for kind, bs, n in drv.log:
        want = 0 if kind == "prefill_chunk" else 1
        assert n == want, f"a {kind} step of batch {bs} made {n} read-backs, expected {want}"


def test_host_restore_equals_device_hit(engine: Engine) -> None:
    """An eager step's restore streams in layer by layer and decodes what a
    device hit decodes."""
    _, on_device, cached_dev = host_scenario(engine, seed=5, check=False, to_host=False)
    counters = engine.runner.kv_host.counters  # type: ignore[union-attr]
    before = counters.layered_flushes_total
    _, via_host, cached_host = host_scenario(engine, seed=5, check=False, to_host=True)
    assert counters.layered_flushes_total > before, "restore path not taken"
    assert cached_dev == cached_host
    assert via_host == on_device, f"after a host restore {via_host} != device hit {on_device}"


def test_natural_eviction_under_pressure_keeps_outputs(engine: Engine) -> None:
    """Fill the 256-page pool past capacity so the scheduler's own evictions
    offload; a conversation brought back from the host must match its device-hit twin."""
    sched = engine.scheduler
    _, ref, _ = host_scenario(engine, seed=9, check=False, to_host=False)
    assert sched.radix.reset()
    drv = CheckedDriver(engine, 9, False)
    first = drv.add(drv.tokens(3 * CHUNK - 10), max_tokens=2)
    drv.until(lambda: first.finished)
    tail = drv.tokens(CHUNK + 50)  # the same draw host_scenario made for turn 2
    offloaded = engine.runner.kv_host.counters.pages_offloaded_total  # type: ignore[union-attr]
    for _ in range(4):  # 4 x 75 pages + turn 1's 48 > the 256-page pool
        filler = drv.add(drv.tokens(1200), max_tokens=1)
        drv.until(lambda f=filler: f.finished)
    assert engine.runner.kv_host.counters.pages_offloaded_total > offloaded  # type: ignore[union-attr]
    hits = sched.radix.host_hit_tokens_total
    second = drv.add(first.tokens + tail, max_tokens=4)
    drv.until(lambda: second.finished)
    assert sched.radix.host_hit_tokens_total > hits, "turn 1 should have come back from the host"
    assert list(second.output_ids) == ref
    sched.check_integrity()
