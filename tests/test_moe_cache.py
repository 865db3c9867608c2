"""MoE expert-slot cache (issue 6) on the CPU: offload mode through the real
engine gives exactly resident mode's greedy tokens in float32; the maps stay
consistent and the slots hold the right bank rows; the bookkeeping is
fixed-shape; start-up rejects a cache too small for one decode step; the Triton
kernels (interpreted) match their twins."""

from __future__ import annotations

import importlib
import os
import random
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

if not torch.cuda.is_available():
    # The interpreter is chosen when a kernel is decorated (see test_kernels_attention).
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in ("ftserve_kernels.attention_extend_triton", "ftserve_kernels.attention_triton",
                  "ftserve_kernels.moe_align_triton",
                  "ftserve_kernels.moe_triton", "ftserve_kernels.bookkeeping",
                  "ftserve.moe.kernels"):
        if _name in sys.modules:
            importlib.reload(sys.modules[_name])

from ftserve.config import ConfigError, EngineConfig  # noqa: E402
from ftserve.engine.driver import EngineDriver  # noqa: E402
from ftserve.engine.engine import Engine  # noqa: E402
from ftserve.models.checkpoint import write_config  # noqa: E402
from ftserve.moe.cache import ExpertCache  # noqa: E402
from tests.engine_util import make_context_sensitive  # noqa: E402

LAYERS, E, K = 3, 16, 4  # tiny-moe: 16 experts, top-4
TOTAL = LAYERS * E
EXPERT_GAIN = 100.0  # see make_experts_matter


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_config("tiny-moe", Path(tmp_path_factory.mktemp("moe-cache")), layers=LAYERS)


def make_engine(model_dir: str, load_format: str = "dummy", **kw: Any) -> Engine:
    from ftserve.engine.setup import build_engine

    cfg = EngineConfig(model=model_dir, load_format=load_format, device="cpu", dtype="float32",
                       page_size=16, num_pages=256, max_prefill_length=64, max_running_requests=4,
                       cuda_graph_max_bs=0, status_log_interval=0.0, **kw)
    eng = build_engine(cfg)
    if load_format == "dummy":  # else greedy tokens cannot see wrong experts on prompt tokens
        make_context_sensitive(eng.runner.model)
        make_experts_matter(eng.runner.model)
    return eng


def make_experts_matter(model: torch.nn.Module, gain: float = EXPERT_GAIN) -> None:
    """Scale every expert's down projection (resident: the parameter; offload:
    the bank, which the block's w2 views), then refill the expert cache.

    Dummy experts (N(0, 0.02)) add a tiny term to the residual (MoE output
    ~0.006 per token against a residual of ~8): with the wrong experts for every
    token of every streamed prefill, all greedy tokens of
    test_offload_equals_resident stayed the same. With the gain (MoE output ~7%
    of the residual) and the attention gain of make_context_sensitive (so prompt
    tokens reach the output through their KV), wrong experts on the prompt
    tokens before a chunk's last one change the tokens."""
    from ftserve.moe.banks import moe_blocks

    with torch.no_grad():
        for block in moe_blocks(model):
            (block.w2_scale if block.w2_scale is not None else block.w2).mul_(gain)  # fp8: the scales
    cache = getattr(model, "expert_cache", None)
    if cache is not None:
        cache.reset()  # the slots hold copies of the old bank rows


def cache_of(engine: Engine) -> ExpertCache:
    cache = engine.runner.model.expert_cache
    assert isinstance(cache, ExpertCache)
    return cache


def run_greedy(engine: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    drv = EngineDriver(engine)
    reqs = [drv.add(p, n) for p in prompts]
    drv.run_all()
    assert all(r.finished for r in reqs)
    return [list(r.output_ids) for r in reqs]


def prompts(seed: int, count: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 32000) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def check_cache(cache: ExpertCache) -> None:
    """Maps are inverse to each other and every mapped slot holds its bank row."""
    sid, ios = cache.slot_of_id[:-1].tolist(), cache.id_of_slot.tolist()
    assert cache.slot_of_id[-1] == -1, "the sink must stay unmapped"
    for s, i in enumerate(ios):
        if i >= 0:
            assert sid[i] == s
            assert torch.equal(cache.slots[s], cache.bank.data[i]), f"slot {s} does not hold id {i}"
    for i, s in enumerate(sid):
        if s >= 0:
            assert ios[s] == i


@pytest.fixture(scope="module")
def resident_tokens(model_dir: str) -> dict[str, list[list[int]]]:
    eng = make_engine(model_dir)
    try:
        return {
            # 4 prompts, 2 of them longer than a 64-token chunk: chunked prefill streams.
            "mixed": run_greedy(eng, prompts(0, 4, 5, 150), 10),
            "short": run_greedy(eng, prompts(1, 3, 3, 12), 12),  # short prefills take the admit path
        }
    finally:
        eng.shutdown()


@pytest.mark.parametrize("slots", [16, 24, TOTAL, 2 * TOTAL])  # exceed, part, exactly all, more
def test_offload_equals_resident(model_dir: str, resident_tokens: dict[str, list[list[int]]],
                                 slots: int) -> None:
    eng = make_engine(model_dir, moe_cache_size=slots)
    try:
        cache = cache_of(eng)
        assert cache.full == (slots >= TOTAL)
        for name, seed, lo, hi, n in (("mixed", 0, 5, 150, 10), ("short", 1, 3, 12, 12)):
            got = run_greedy(eng, prompts(seed, *(3 if name == "short" else 4, lo, hi)), n)
            assert got == resident_tokens[name], f"{name}: offload with {slots} slots differs"
            check_cache(cache)
        st = cache.stats()
        if cache.full:
            # Item 8: a cache of every expert never streams or misses.
            assert st["experts_streamed"] == 0 and st["lookups"] == 0
        else:
            assert st["experts_streamed"] > 0, "the long prompts must have streamed layers"
            assert 0 < st["misses"] < st["lookups"]
            # A fresh snapshot streams exactly the uncached experts, a stale one at worst more.
            assert st["experts_streamed"] >= st["experts_uncached"] > 0, st
    finally:
        eng.shutdown()


def test_repeated_experts_hit(model_dir: str) -> None:
    """The same short request twice: the second run's experts mostly hit and
    copy (almost) nothing."""
    eng = make_engine(model_dir, moe_cache_size=TOTAL - 1)
    try:
        cache = cache_of(eng)
        p = prompts(5, 1, 4, 4)
        first = run_greedy(eng, p, 6)
        cold = cache.stats()
        cache.reset_stats()
        assert run_greedy(eng, p, 6) == first
        warm = cache.stats()
        assert warm["lookups"] == cold["lookups"]
        assert warm["misses"] <= 0.1 * warm["lookups"] < cold["misses"], (cold, warm)
        assert warm["hit_rate"] > 0.9, warm
        assert cold["hit_rate"] < 0.9, cold
        check_cache(cache)
    finally:
        eng.shutdown()


def test_stream_invalidates_old_buffer_mappings(model_dir: str) -> None:
    """After a streamed prefill only the last two layers stay mapped in the
    prefill map, and each of their entries points at its expert's weights."""
    eng = make_engine(model_dir, moe_cache_size=16)
    try:
        cache = cache_of(eng)
        run_greedy(eng, prompts(3, 1, 64, 64), 1)  # one 64-token chunk: 256 pairs >= E, streams
        mapped = cache.streamer.pslot_of_id[:-1].view(LAYERS, E) >= 0  # [Lm, E]
        assert mapped.tolist() == [[False] * E] + [[True] * E] * 2
        for i, s in enumerate(cache.streamer.pslot_of_id[:-1].tolist()):
            if s >= 0:
                assert torch.equal(cache.slots[s], cache.bank.data[i])
        assert cache.streamer.pslot_of_id[-1] == -1
    finally:
        eng.shutdown()


def test_stale_host_view_falls_back_on_the_device(model_dir: str,
                                                 resident_tokens: dict[str, list[list[int]]]) -> None:
    """The host plans prefill DMA from a snapshot of the LRU map; a wrong one
    (every expert "cached" in slot 0, or nothing cached) must still leave every
    prefill mapping pointing at its expert's weights (the device plan fills
    what the host skipped) and give the right tokens."""
    for claim in (0, -1):
        eng = make_engine(model_dir, moe_cache_size=24)
        try:
            cache = cache_of(eng)
            cache.slots.zero_()  # no leftovers of start-up forwards can stand in for a copy
            cache.streamer.snap.fill_(claim)
            cache.streamer.snap_pending = True  # the next streamed forward adopts the poisoned view
            run_greedy(eng, prompts(3, 1, 64, 64), 1)  # one 64-token chunk: streams every layer
            mapped = 0
            for i, s in enumerate(cache.streamer.pslot_of_id[:-1].tolist()):
                if s >= 0:
                    mapped += 1
                    assert torch.equal(cache.slots[s], cache.bank.data[i]), (claim, i, s)
            assert mapped == 2 * E
            st = cache.stats()
            assert st["experts_streamed"] >= st["experts_uncached"] > 0, st
            assert run_greedy(eng, prompts(0, 4, 5, 150), 10) == resident_tokens["mixed"]
            check_cache(cache)
        finally:
            eng.shutdown()


def test_too_small_cache_is_a_startup_error(model_dir: str) -> None:
    # 4 running requests x top-4 = 16 distinct experts per layer at most.
    with pytest.raises(ConfigError, match="--moe-cache-size.*at least 16"):
        make_engine(model_dir, moe_cache_size=15)
    with pytest.raises(ConfigError, match="not both"):
        make_engine(model_dir, moe_cache_size=20, moe_cache_auto=True)


def test_cli_flags_reach_the_config() -> None:
    from ftserve.cli import build_parser, configs_from_args

    eng, _ = configs_from_args(build_parser().parse_args(["serve", "--moe-cache-size", "64"]))
    assert eng.moe_cache_size == 64 and not eng.moe_cache_auto
    eng, _ = configs_from_args(build_parser().parse_args(["serve", "--moe-cache-auto"]))
    assert eng.moe_cache_size is None and eng.moe_cache_auto


def test_auto_on_cpu_caches_everything(model_dir: str) -> None:
    eng = make_engine(model_dir, moe_cache_auto=True)
    try:
        assert cache_of(eng).full
        assert eng.summary["moe_cache"]["slots"] == TOTAL
    finally:
        eng.shutdown()


class ForbidDataDependent(TorchDispatchMode):
    """Fails on ops whose output shape depends on device data, or that read a
    device value back (the hidden-sync patterns of the field report)."""

    BANNED = ("nonzero", "unique", "masked_select", "_local_scalar_dense", "masked_scatter")

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.__name__
        if any(b in name for b in self.BANNED):
            raise AssertionError(f"data-dependent op {name} in the bookkeeping path")
        if name.startswith(("index.", "index_put")):
            idx = args[1]
            if any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in idx):
                raise AssertionError(f"boolean-mask indexing ({name}) in the bookkeeping path")
        return func(*args, **(kwargs or {}))


def test_bookkeeping_is_fixed_shape(model_dir: str) -> None:
    eng = make_engine(model_dir, moe_cache_size=20)
    try:
        cache = cache_of(eng)
        g = torch.Generator().manual_seed(0)
        with torch.inference_mode(), ForbidDataDependent():
            for t in (1, 3, 7):  # list form (t*k <= E) and mask form
                for j in range(LAYERS):
                    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]).int()
                    cache._admit(j, ids)
            cache.mode = "stream"
            for j in range(LAYERS):
                cache.streamer.stream_layer(j)
        check_cache(cache)
    finally:
        eng.shutdown()


def test_dummy_weights_route_by_token(model_dir: str) -> None:
    """Item 7: with dummy weights, different tokens pick different experts."""
    eng = make_engine(model_dir)
    try:
        model = eng.runner.model
        ids = torch.tensor(prompts(9, 1, 64, 64)[0])
        with torch.inference_mode():
            x = model.embed_tokens(ids)  # [64, H]
            kernels = eng.runner.kernels
            _, top = model.layers[0].mlp.route(model.layers[0].post_attention_layernorm(x, kernels), kernels)
        distinct_sets = {tuple(sorted(r)) for r in top.tolist()}
        assert len(set(top.reshape(-1).tolist())) == E, "every expert should be used by some token"
        assert len(distinct_sets) > 48, f"only {len(distinct_sets)} distinct expert sets for 64 tokens"
    finally:
        eng.shutdown()


# ----------------------------------------------------------------- Triton kernels, interpreted


@pytest.fixture(scope="module")
def triton_mods() -> Any:
    if torch.cuda.is_available():
        pytest.skip("covered by the gpu tests")
    for name in ("ftserve.moe.kernels", "ftserve_kernels.moe_triton"):
        importlib.import_module(name)
    return sys.modules["ftserve.moe.kernels"], sys.modules["ftserve_kernels.moe_triton"]


def test_fill_rows_and_plan_match_twins(triton_mods: Any) -> None:
    mk, _ = triton_mods
    g = torch.Generator().manual_seed(0)
    bank = torch.randn(12, 40, generator=g)  # 12 ids, rows of 40 fp32
    src = torch.tensor([3, -1, 7, 11, 0, -1], dtype=torch.int32)
    dst = torch.tensor([0, 2, 5, -1, 1, 4], dtype=torch.int32)
    a, b = torch.zeros(7, 40), torch.zeros(7, 40)  # last row: the twin's trash row
    mk.fill_rows(bank, a, src, dst)
    mk.fill_rows_ref(bank, b, src, dst)
    assert torch.equal(a[:-1], b[:-1])
    assert torch.equal(a[5], bank[7]) and torch.equal(a[2], torch.zeros(40))
    wide = torch.randn(12, 3 * 8192 + 5, generator=g)  # rows of 3 chunks, the last one partial
    c, d = torch.zeros(7, wide.shape[1]), torch.zeros(7, wide.shape[1])
    mk.fill_rows(wide, c, src, dst)
    mk.fill_rows_ref(wide, d, src, dst)
    assert torch.equal(c[:-1], d[:-1])
    slot_of_id = torch.full((13,), -1, dtype=torch.int32)
    slot_of_id[[4, 6]] = torch.tensor([1, 0], dtype=torch.int32)
    dma = torch.tensor([1, 0, 0, 1], dtype=torch.int32)  # host copies experts 0 and 3 of the layer
    outs = []
    for fn in (mk.plan_layer, mk.plan_layer_ref):
        maps = [torch.full((13,), -1, dtype=torch.int32), torch.full((8,), -1, dtype=torch.int32),
                torch.empty(4, dtype=torch.int32), torch.empty(4, dtype=torch.int32)]
        counters = torch.zeros(4, dtype=torch.int64)
        fn(slot_of_id, *maps, dma, counters, 1, 1, 2)  # layer 1 (ids 4..7) into buffer 1, buffers from slot 2
        outs.append([*maps, counters])
    for x, y in zip(*outs):
        assert torch.equal(x, y)
    pslot, pid, psrc, pdst, counters = outs[0]
    # id 4 cached (slot 1), id 6 cached (slot 0); id 5 uncached and not copied by the
    # host -> the fallback fills it; id 7 uncached, copied by the host -> no fallback.
    assert pslot[4:8].tolist() == [1, 7, 0, 9] and psrc.tolist() == [-1, 5, -1, -1]
    assert pid[4:].tolist() == [4, 5, 6, 7] and pdst.tolist() == [6, 7, 8, 9]
    assert counters.tolist() == [0, 0, 1, 2]  # 1 fallback copy, 2 experts not cached


def test_admission_lists_match_twins(triton_mods: Any) -> None:
    mk, _ = triton_mods
    g = torch.Generator().manual_seed(2)
    e = 16
    for t, k in ((1, 4), (3, 4), (4, 4), (7, 4)):  # list form (t*k <= E) and mask form
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).int()  # [T, k]
        m = min(t * k, e)
        outs = []
        for fn in (mk.needed_ids, mk.needed_ids_ref):
            needed = torch.full((m,), -7, dtype=torch.int32)
            counters = torch.zeros(5, dtype=torch.int64)
            fn(ids, needed, counters, 2, e, 0)
            outs.append((needed, counters))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
        needed, counters = outs[0]
        distinct = set(ids.reshape(-1).tolist())
        assert int(counters[0]) == len(distinct)
        assert set(needed.tolist()) - {-1} == {2 * e + x for x in distinct}
    x = torch.tensor([3, -1, 0, -1, 9], dtype=torch.int32)
    a, b = torch.zeros(5, dtype=torch.int64), torch.zeros(5, dtype=torch.int64)
    mk.count_valid(x, a, 1)
    mk.count_valid_ref(x, b, 1)
    assert a.tolist() == b.tolist() == [0, 3, 0, 0, 0]
    assert mk.host_runs([True, True, False, True, False, False, True]) == [(0, 2), (3, 4), (6, 7)]
    assert mk.host_runs([False, False]) == [] and mk.host_runs([True] * 3) == [(0, 3)]


def test_fused_moe_expert_map_matches_reference(triton_mods: Any) -> None:
    _, mt = triton_mods
    from ftserve_kernels.moe import fused_moe_ref

    g = torch.Generator().manual_seed(1)
    t, h, inter, e, k, s = 5, 32, 16, 6, 2, 9
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(s, 2 * inter, h, generator=g) * 0.1  # slot rows
    w2 = torch.randn(s, h, inter, generator=g) * 0.1
    emap = torch.tensor([8, 0, 3, 5, 1, 7], dtype=torch.int32)  # expert -> slot
    ids = torch.randint(0, e, (t, k), generator=g, dtype=torch.int32)
    w = torch.softmax(torch.randn(t, k, generator=g), -1)
    got = mt.fused_moe_triton(x, w13, w2, w, ids, expert_map=emap)
    ref = fused_moe_ref(x, w13, w2, w, emap[ids.long()])
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("t", [1, 2])
def test_read_through_gemv_equals_fill_then_compute(triton_mods: Any, t: int) -> None:
    """The expert GEMVs with read-through (misses read from the bank, slots
    written on the way) compute what fill_rows + the reference compute, and
    leave every missed slot holding its whole bank row (both w13 and w2)."""
    _, mt = triton_mods
    mg = sys.modules["ftserve_kernels.moe_gemv_triton"]
    from ftserve_kernels.moe import fused_moe_ref
    from ftserve_kernels.moe_read_through import ReadThrough

    g = torch.Generator().manual_seed(5)
    h, inter, e, k, s = 32, 16, 8, 4, 7  # 8 experts of layer 1 (ids 8..15), 6 slots + trash
    r = 3 * inter * h
    bank = torch.randn(2 * e, r, generator=g) * 0.2  # [ids, R], slot-row layout [w13 | w2]
    slots = torch.randn(s, r, generator=g) * 0.2
    emap = torch.tensor([3, 0, 5, 1, 2, 4, 0, 1], dtype=torch.int32)  # expert -> slot
    ids = torch.tensor([[0, 2, 3, 5], [2, 1, 4, 0]][:t], dtype=torch.int32)  # t=2: expert 2 twice
    miss_slot = torch.tensor([5, 1, -1, 4][:2 * t], dtype=torch.int32)  # experts 2 and 3 miss;
    miss_id = torch.tensor([e + 2, e + 3, -1, e + 5][:2 * t], dtype=torch.int32)  # t=2: 5 as well
    poisoned = slots.clone()
    poisoned[miss_slot[miss_slot >= 0].long()] = float("nan")  # what the victims held: never read
    x = torch.randn(t, h, generator=g)
    w = torch.softmax(torch.randn(t, k, generator=g), -1)

    want_slots = poisoned.clone()
    fill = sys.modules["ftserve.moe.kernels"].fill_rows_ref
    fill(bank, want_slots, miss_id, miss_slot)
    w13 = lambda a: a[:, : 2 * inter * h].view(s, 2 * inter, h)  # noqa: E731
    w2 = lambda a: a[:, 2 * inter * h:].view(s, h, inter)  # noqa: E731
    want = fused_moe_ref(x, w13(want_slots), w2(want_slots), w, emap[ids.long()])

    got_slots = poisoned.clone()
    rt = ReadThrough(bank, miss_slot, miss_id, 0, 2 * inter * h)
    got = mg.fused_moe_gemv_triton(x, w13(got_slots), w2(got_slots), w, ids, emap, read_through=rt)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    used = sorted({int(emap[i]) for i in ids.reshape(-1).tolist()})
    for slot in used:  # every slot the step read: filled rows whole, the rest untouched
        assert torch.equal(got_slots[slot], want_slots[slot]), slot
    plain = mg.fused_moe_gemv_triton(x, w13(want_slots), w2(want_slots), w, ids, emap)
    torch.testing.assert_close(got, plain, rtol=0, atol=0)  # same sums as reading the filled slots


def test_sweep_uva_smoke_cpu(triton_mods: Any, tmp_path: Path) -> None:
    """tools/bench/sweep_uva on the CPU (interpreted, tiny shapes): every fill config
    copies correctly and every read-through config launches."""
    from tools.bench.sweep_uva import main

    res = main(["--smoke", "--budget-s", "600", "--out", str(tmp_path / "sweep.json")])
    assert len(res["fill"]) == 2 and all(r["correct"] for r in res["fill"]), res["fill"]
    assert [r["kernel"] for r in res["read_through"]] == ["gate_up", "down"], res["read_through"]
    assert all("s" in r for r in res["read_through"]), res["read_through"]


def test_bench_smoke_cpu(tmp_path: Path) -> None:
    from tools.bench.moe_cache import main

    # A budget no CI machine reaches: a skipped section would fail the checks below.
    res = main(["--smoke", "--budget-s", "600", "--out", str(tmp_path / "moe.json")])
    assert not res.get("errors"), res.get("errors")
    pre = res["summary"]["prefill"]
    assert {(r["mode"], r["prefix"]) for r in pre} >= {("offload", 0), ("offload", 256), ("offload_full", 64)}
    for r in pre:
        # 25% cache: chunks stream the experts the LRU does not hold; full never streams.
        if r["mode"] == "offload":
            assert TOTAL - 12 <= r["experts_uncached"] <= r["experts_streamed"] <= TOTAL, r
        else:
            assert r["experts_streamed"] == r["experts_uncached"] == 0, r
    dec = res["summary"]["decode"]
    rows = [r for r in dec if r["mode"] == "offload"]
    assert [r["batch"] for r in rows] == [1, 3], dec
    assert all(0.0 <= r["hit_rate"] <= 1.0 and r["copies_per_step"] > 0 for r in rows), rows
    # Seeded prompts and an emptied cache: offload decodes resident mode's tokens.
    for r in res["offload_decode"]:
        resident = next(x for x in res["resident_decode"] if x["batch"] == r["batch"])
        assert r["tokens"] == resident["tokens"] and len(r["tokens"]) > 4, (r["tokens"], resident["tokens"])


def test_offload_from_safetensors_equals_resident(tmp_path: Path) -> None:
    """Item 2: experts go from real (sharded) safetensors straight into the host bank."""
    from ftserve.models.checkpoint import write_checkpoint

    ckpt = write_checkpoint("tiny-moe", tmp_path / "ckpt", layers=2, seed=3, shard_size_mb=0.5)
    assert len(list(ckpt.glob("*.safetensors"))) > 1, "want a sharded checkpoint"
    p = prompts(11, 2, 20, 90)
    outs = []
    for slots in (None, 16):
        eng = make_engine(str(ckpt), "safetensors", moe_cache_size=slots)
        try:
            assert (eng.summary["moe_cache"] is None) == (slots is None)
            if slots is not None:
                # The bank holds the checkpoint's tensors, row by row.
                from safetensors import safe_open

                cache = cache_of(eng)
                checked = 0
                for f in ckpt.glob("*.safetensors"):
                    with safe_open(str(f), "pt") as h:
                        for name in h.keys():
                            if ".experts.5.down_proj" in name and "layers.1." in name:
                                assert torch.equal(cache.bank.w2(1)[5], h.get_tensor(name).float())
                                checked += 1
                assert checked == 1
            outs.append(run_greedy(eng, p, 6))
        finally:
            eng.shutdown()
    assert outs[0] == outs[1]


_AOT = r"""
import json, re
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ftserve.moe import kernels as mk

def ptx(fn, types, consts, warps):
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n not in consts}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 3})
    return k.asm["ptx"]

fill = {"bank": "i64", "slots_ptr": "*i64", "src_ptr": "*i32", "dst_ptr": "*i32"}
host = ptx(mk._fill_rows_kernel, fill, dict(HOST_SRC=True, WORD=tl.int64, BLOCK=8192), 8)
def ptrs(fn):
    return {n: "*i64" if n == "counters_ptr" else "*i32" for n in fn.arg_names if n.endswith("_ptr")}

plan = ptx(mk._plan_kernel, ptrs(mk._plan_kernel), dict(BLOCK=128), 4)
small = [ptx(mk._needed_kernel, ptrs(mk._needed_kernel),
             dict(LOOKUP_IDX=li, LIST=lst, BLOCK_E=128, CHUNK=16), 4) for li, lst in ((0, True), (-1, False))]
small.append(ptx(mk._count_kernel, ptrs(mk._count_kernel), dict(IDX=1, BLOCK=64), 4))
print(json.dumps({"host_loads": sorted(set(re.findall(r"ld\.global[.\w]*", host))), "plan": len(plan),
                  "small": [len(x) for x in small]}))
"""


def test_kernels_compile_for_sm90_with_vector_uva_loads() -> None:
    """The UVA row copy must issue 16-byte loads from host memory (the int ->
    pointer cast drops alignment; the kernel restores it) to approach PCIe speed."""
    from tests.sm90_compile import compile_in_child

    res = compile_in_child(["-c", _AOT], timeout=300)
    assert res["plan"] > 0 and all(n > 0 for n in res["small"])
    assert any(".v2.b64" in x or ".v4" in x for x in res["host_loads"]), res


def test_auto_slots_budget() -> None:
    """--moe-cache-auto arithmetic: KV reserve, activations and two layer buffers
    come off the budget; a budget that holds everything gives every expert."""
    from ftserve.moe.banks import HostBank
    from ftserve.moe.planning import ACTIVATION_BYTES_PER_TOKEN, auto_slots

    bank = HostBank(torch.empty(8 * 8, 3 * 4 * 8), 8, 8, 8, 4)  # 64 experts, rows of 384 B
    rb = bank.row_bytes
    cfg = EngineConfig(max_prefill_length=16, kv_cache_tokens=100, memory_ratio=0.5)
    act = 16 * ACTIVATION_BYTES_PER_TOKEN
    kv = 100 * 10
    free = int((act + kv + 2 * 8 * rb + 20 * rb) / 0.5)
    assert auto_slots(free, cfg, bank, 10) == 20
    assert auto_slots(int((act + kv + 64 * rb) / 0.5) + 2, cfg, bank, 10) == 64  # all fit: no buffers
    assert auto_slots(0, cfg, bank, 10) == 0
    # A hybrid's recurrent-state pool, allocated after the cache, comes off the budget too.
    assert auto_slots(free, cfg, bank, 10, reserve_bytes=5 * rb) == 15
