"""The engine on a hybrid model (tiny Qwen3-Next: Gated DeltaNet + attention) on
the CPU in float32: greedy outputs with chunked prefill, batching, preemption and
prefix-cache hits at every kind of state checkpoint (a prompt's end, every N
pages of a long prefill, a page-aligned prompt, a prompt shared with a request
still prefilling it) equal a plain full recompute, token for token; the state
slots and checkpoints are accounted for after every step
(``Engine.check_integrity``) and back at baseline after every scenario.

Pages of 4 tokens, a checkpoint every 4 pages (16 tokens), prefill chunks of 24
tokens: chunks are cut at checkpoint boundaries, not at the budget.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from ftserve.config import EngineConfig
from ftserve.engine.engine import Engine
from ftserve.engine.setup import build_engine
from tests.engine_util import (
    collect,
    drive,
    greedy,
    make_context_sensitive,
    reference_greedy,
    tokens_of,
)

VOCAB_HI = 1000
PS = 4
EVERY = 16  # --state-checkpoint-pages 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from ftserve.models.checkpoint import write_checkpoint

    out = tmp_path_factory.mktemp("tiny-qwen3-next")
    write_checkpoint("tiny-qwen3-next", out, config_only=True)
    return str(out)


def make_engine(model_dir: str, **kw: object) -> Engine:
    base = dict(model=model_dir, load_format="dummy", device="cpu", dtype="float32",
                page_size=PS, num_pages=512, max_prefill_length=24, max_running_requests=8,
                state_checkpoint_pages=EVERY // PS, status_log_interval=0.0)
    base.update(kw)
    eng = build_engine(EngineConfig(**base))  # type: ignore[arg-type]
    eng.check_integrity = True
    make_context_sensitive(eng.runner.model)  # else greedy tokens cannot see a wrong state
    return eng


@pytest.fixture(scope="module")
def engine(model_dir: str) -> Iterator[Engine]:
    eng = make_engine(model_dir)
    yield eng
    eng.shutdown()


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, VOCAB_HI) for _ in range(n)]


def ref(eng: Engine, p: list[int], n: int) -> list[int]:
    return reference_greedy(eng.runner.model, eng.model_config, p, n)


def assert_baseline(eng: Engine) -> None:
    """Nothing runs; every KV page and state slot is free or held by the prefix cache."""
    s = eng.scheduler
    assert not s.running and not s.waiting
    assert s.allocator.num_free + s.radix.cached_pages == s.allocator.num_total
    pool = s.state_pool
    assert pool is not None
    assert pool.num_free + s.radix.cached_states == pool.num_slots and s.radix.states_out == 0
    s.check_integrity()


def test_the_state_pool_caps_running_requests(engine: Engine) -> None:
    """One state slot per running request plus the checkpoints (2 x running by
    default), sized at start-up; the KV pool holds the attention layers only."""
    cfg = engine.model_config
    assert engine.runner.kv_pool.num_layers == len(cfg.kv_layers) == 2
    pool = engine.scheduler.state_pool
    assert pool is not None and pool.num_slots == 8 + 16
    assert engine.scheduler.radix.max_states == 16
    assert engine.runner.state_pool is pool and engine.runner.prefill_graphs is None
    # The memory plan counted what the pool holds (StateLayout.pool_bytes).
    assert engine.summary["state_gib"] * 2**30 == pool.nbytes


def test_batched_chunked_prompts_equal_a_full_recompute(engine: Engine) -> None:
    """Eight requests at once, prompts from 1 to 70 tokens (up to five chunks, cut at
    checkpoint boundaries), decoding together in one batch."""
    rng = random.Random(1)
    lens = [1, 3, 15, 16, 17, 33, 52, 70]
    reqs = [(f"b{i}", prompt(rng, n), greedy(rng.randint(3, 9))) for i, n in enumerate(lens)]
    outs = collect(engine, reqs)
    for rid, p, params in reqs:
        assert tokens_of(outs[rid]) == ref(engine, p, params.max_tokens), rid
    assert_baseline(engine)


def test_checkpoints_inside_and_at_the_end_of_chunks(engine: Engine) -> None:
    """A 70-token prompt with chunks of 24 saves its state at 16, 32, 48, 64 (every
    16) and 68 (the last page before the final token) without a chunk of its own
    for any: the linear layers save the ones inside a chunk as they pass
    (ScheduledBatch.state_inner, at most MAX_INNER a chunk), a chunk ending on one
    copies it after the forward. Chunks: [0, 24) saving 16 inside, [24, 48) saving
    32 inside and 48 at its end, [48, 70) saving 64 and 68 inside."""
    from ftserve.engine.driver import EngineDriver

    drv = EngineDriver(engine)
    rng = random.Random(2)
    req = drv.add(prompt(rng, 70), max_tokens=2)
    ends, saves, inside = [], [], []
    while not req.finished:
        batch = drv.step()
        if batch is not None and req in batch.reqs and not batch.is_decode:
            i = batch.reqs.index(req)
            ends.append(batch.prefix_lens[i] + len(batch.new_tokens[i]))
            saves.append(len(batch.state_saves))
            inner = batch.state_inner[i] if batch.state_inner else []
            inside.append([batch.prefix_lens[i] + off for off, _ in inner])
    drv.flush()
    assert ends == [24, 48, 70]
    assert saves == [0, 1, 0]
    assert inside == [[16], [32], [64, 68]]
    assert engine.scheduler.counters.state_checkpoints_saved_total >= 5
    assert_baseline(engine)


def test_a_third_checkpoint_ends_the_chunk(engine: Engine) -> None:
    """MAX_INNER checkpoints fit inside one chunk: a 70-token prompt in one chunk
    budget would pass five, so its chunk ends on the third (48), saving 16 and 32
    inside, then [48, 70) saves 64 and 68 inside."""
    from ftserve.engine import state_checkpoints
    from ftserve.engine.driver import EngineDriver

    assert state_checkpoints.MAX_INNER == 2
    drv = EngineDriver(engine)
    budget = engine.scheduler.max_prefill_length
    engine.scheduler.max_prefill_length = 128
    try:
        rng = random.Random(3)
        req = drv.add(prompt(rng, 70), max_tokens=2)
        ends, inside = [], []
        while not req.finished:
            batch = drv.step()
            if batch is not None and req in batch.reqs and not batch.is_decode:
                i = batch.reqs.index(req)
                ends.append(batch.prefix_lens[i] + len(batch.new_tokens[i]))
                inner = batch.state_inner[i] if batch.state_inner else []
                inside.append([batch.prefix_lens[i] + off for off, _ in inner])
        drv.flush()
    finally:
        engine.scheduler.max_prefill_length = budget
    assert ends == [48, 70] and inside == [[16, 32], [64, 68]]
    assert_baseline(engine)


def test_a_checkpoint_before_the_unsent_tail(engine: Engine) -> None:
    """A chat prompt whose last 10 tokens a later turn will not resend (its
    generation prompt: GenerateRequest.unsent_tail) also saves its state at 60,
    the page boundary before them; a next turn that parts from it inside that
    tail resumes there, with a full recompute's tokens."""
    from ftserve.engine.driver import EngineDriver

    drv = EngineDriver(engine)
    rng = random.Random(15)
    p = prompt(rng, 70)
    req = drv.add(p, max_tokens=2)
    req.unsent_tail = 10
    ends = []
    while not req.finished:
        batch = drv.step()
        if batch is not None and not batch.is_decode:
            ends.append(batch.prefix_lens[0] + len(batch.new_tokens[0]))
    drv.flush()
    assert ends == [24, 48, 68, 70]  # 60 and 64 inside [48, 68), which ends on the third (68)
    turn2 = p[:62] + prompt(rng, 12)  # its reply stands where the tail stood
    res = collect(engine, [("turn2", turn2, greedy(5))])["turn2"]
    assert res[-1].cached_tokens == 60 and tokens_of(res) == ref(engine, turn2, 5)
    assert_baseline(engine)


def test_hits_at_a_prompt_end_and_every_n_pages(engine: Engine) -> None:
    """A conversation's next turn resumes at its previous prompt's last page
    boundary; a request sharing the first 45 tokens of a 70-token prompt resumes
    at the checkpoint 32 saved during that prompt's prefill; all equal a full
    recompute, and usage reports those cached tokens."""
    rng = random.Random(3)
    turn1 = prompt(rng, 38)
    out1 = tokens_of(collect(engine, [("t1", turn1, greedy(6))])["t1"])
    assert out1 == ref(engine, turn1, 6)
    turn2 = turn1 + out1 + prompt(rng, 9)
    res = collect(engine, [("t2", turn2, greedy(6))])["t2"]
    assert tokens_of(res) == ref(engine, turn2, 6)
    assert res[-1].cached_tokens == 36  # (38 - 1) // 4 * 4: within a page of turn 1's prompt
    long = prompt(rng, 70)  # checkpoints at 16, 32, 48, 64 and 68
    assert tokens_of(collect(engine, [("long", long, greedy(3))])["long"]) == ref(engine, long, 3)
    side = long[:45] + prompt(rng, 7)
    res = collect(engine, [("side", side, greedy(5))])["side"]
    assert tokens_of(res) == ref(engine, side, 5)
    assert res[-1].cached_tokens == 32
    assert_baseline(engine)


def test_the_same_prompt_again_page_aligned_or_not(engine: Engine) -> None:
    """The same prompt a second time resumes at the last page boundary before its
    final token: 36 of 37 tokens, and 36 of 40 (a page-aligned prompt computes its
    last page again for the final token's logits)."""
    rng = random.Random(4)
    for n, cached in ((37, 36), (40, 36)):
        p = prompt(rng, n)
        first = collect(engine, [("once", p, greedy(5))])["once"]
        again = collect(engine, [("again", p, greedy(5))])["again"]
        want = ref(engine, p, 5)
        assert tokens_of(first) == want and tokens_of(again) == want
        assert first[-1].cached_tokens == 0 and again[-1].cached_tokens == cached
    assert_baseline(engine)


def test_followers_resume_from_the_leaders_checkpoint(engine: Engine) -> None:
    """Requests with one prompt sent together (n choices, agents fanning out): the
    others wait for the first one's prefill, then resume from a copy of its state
    at the prompt's last page boundary; one that diverges after 40 tokens resumes
    at the leader's checkpoint 32. All equal a full recompute."""
    rng = random.Random(5)
    p = prompt(rng, 50)
    fork = p[:40] + prompt(rng, 11)
    saved = engine.scheduler.counters.state_checkpoints_saved_total
    outs = collect(engine, [("lead", p, greedy(6)), ("c1", p, greedy(4)), ("c2", p, greedy(3)),
                            ("fork", fork, greedy(4))])
    want = ref(engine, p, 6)
    assert tokens_of(outs["lead"]) == want
    assert tokens_of(outs["c1"]) == want[:4] and tokens_of(outs["c2"]) == want[:3]
    assert tokens_of(outs["fork"]) == ref(engine, fork, 4)
    assert [outs[r][-1].cached_tokens for r in ("lead", "c1", "c2", "fork")] == [0, 48, 48, 32]
    # The shared prompt was prefilled once: checkpoints 16, 32, 48 of the leader and
    # 48 of the fork (past its hit at 32); the choices saved none.
    assert engine.scheduler.counters.state_checkpoints_saved_total - saved == 4
    assert_baseline(engine)


def test_preemption_resumes_exactly(model_dir: str) -> None:
    """24 usable pages for four requests growing to ~45 tokens: decode steps preempt
    the youngest (its pages to the prefix cache up to its deepest checkpoint), which
    later resumes from that checkpoint."""
    eng = make_engine(model_dir, num_pages=25, max_running_requests=4, max_prefill_length=32)
    try:
        rng = random.Random(6)
        reqs = [(f"p{i}", prompt(rng, 20), greedy(25)) for i in range(4)]
        outs = collect(eng, reqs)
        assert eng.scheduler.counters.preemptions_total > 0
        for rid, p, params in reqs:
            assert tokens_of(outs[rid]) == ref(eng, p, params.max_tokens), rid
        assert_baseline(eng)
    finally:
        eng.shutdown()


def test_few_checkpoint_slots_evict_leaves_with_their_pages(model_dir: str) -> None:
    """Two checkpoint slots for many conversations: saving a checkpoint evicts the
    least recently used leaf, pages and state together; a boundary with every
    checkpoint locked is skipped. Outputs stay exact, and a conversation's turn 2
    still hits."""
    eng = make_engine(model_dir, state_checkpoints=2, max_running_requests=3)
    try:
        rng = random.Random(7)
        reqs = [(f"k{i}", prompt(rng, rng.randint(20, 60)), greedy(4)) for i in range(6)]
        outs = drive(eng, reqs)  # queued before the first step: the same schedule every run
        for rid, p, params in reqs:
            assert tokens_of(outs[rid]) == ref(eng, p, params.max_tokens), rid
        s = eng.scheduler
        assert s.radix.cached_states <= 2 and s.counters.state_checkpoints_skipped_total > 0
        turn1 = prompt(rng, 30)  # its checkpoints (16, 28) evict the others'
        turn2 = turn1 + tokens_of(collect(eng, [("turn1", turn1, greedy(4))])["turn1"]) + prompt(rng, 5)
        res = collect(eng, [("turn2", turn2, greedy(4))])["turn2"]
        assert tokens_of(res) == ref(eng, turn2, 4) and res[-1].cached_tokens == 28
        assert_baseline(eng)
    finally:
        eng.shutdown()


def test_a_long_prefill_past_the_cap_keeps_its_prompt_end(model_dir: str) -> None:
    """Two checkpoint slots for a prompt with five boundaries (16, 32, 48, 64, 68):
    past the cap its latest checkpoint moves deeper, so it keeps 16 and 68, and
    the next turn resumes at its prompt end, not at 32."""
    eng = make_engine(model_dir, state_checkpoints=2, max_running_requests=1)
    try:
        rng = random.Random(16)
        p = prompt(rng, 70)
        out1 = tokens_of(collect(eng, [("t1", p, greedy(3))])["t1"])
        c = eng.scheduler.counters
        assert c.state_checkpoints_saved_total == 5 and c.state_checkpoints_skipped_total == 0
        assert eng.scheduler.radix.cached_states == 2
        turn2 = p + out1 + prompt(rng, 6)
        res = collect(eng, [("t2", turn2, greedy(4))])["t2"]
        assert res[-1].cached_tokens == 68 and tokens_of(res) == ref(eng, turn2, 4)
        assert_baseline(eng)
    finally:
        eng.shutdown()


def test_aborts_free_state_slots(engine: Engine) -> None:
    rng = random.Random(8)
    reqs = [(f"x{i}", prompt(rng, 10 + 15 * i), greedy(30)) for i in range(5)]
    outs = collect(engine, reqs, abort_after={"x0": 1, "x1": 4, "x3": 2})
    for rid in ("x0", "x1", "x3"):
        assert outs[rid][-1].finish_reason == "abort"
    for rid in ("x2", "x4"):
        p = next(p for r, p, _ in reqs if r == rid)
        assert tokens_of(outs[rid]) == ref(engine, p, 30)
    assert_baseline(engine)


@pytest.mark.parametrize("kw", [dict(enable_prefix_cache=False), dict(overlap_schedule=False)])
def test_without_prefix_cache_or_overlap(model_dir: str, kw: dict[str, object]) -> None:
    """Without a prefix cache a hybrid keeps no checkpoints and prefills in chunks of
    the budget; without overlap scheduling the same tokens come out."""
    eng = make_engine(model_dir, **kw)
    try:
        rng = random.Random(9)
        reqs = [(f"n{i}", prompt(rng, n), greedy(6)) for i, n in enumerate((5, 30, 61))]
        outs = collect(eng, reqs)
        for rid, p, params in reqs:
            assert tokens_of(outs[rid]) == ref(eng, p, params.max_tokens), rid
        again = collect(eng, [("again", reqs[2][1], greedy(6))])["again"]
        assert tokens_of(again) == tokens_of(outs["n2"])
        s = eng.scheduler
        if kw.get("enable_prefix_cache") is False:
            assert s.radix.max_states == 0 and again[-1].cached_tokens == 0
            assert s.state_pool is not None and s.state_pool.num_slots == 8
        else:
            assert again[-1].cached_tokens == 60
        assert s.state_pool is not None and s.state_pool.num_free + s.radix.cached_states == s.state_pool.num_slots
    finally:
        eng.shutdown()


def test_a_lost_state_restore_would_show(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparisons above can fail: a hit that skips copying its checkpoint into
    the request's slot (stale state) changes the tokens."""
    rng = random.Random(10)
    p = prompt(rng, 41)
    collect(engine, [("warm", p, greedy(2))])
    real_launch = engine.runner.launch
    dropped: list[tuple[int, int]] = []

    def launch_without_loads(batch):  # type: ignore[no-untyped-def]
        dropped.extend(batch.state_loads)
        batch.state_loads = []
        return real_launch(batch)

    monkeypatch.setattr(engine.runner, "launch", launch_without_loads)
    q = p + prompt(rng, 3)
    res = collect(engine, [("stale", q, greedy(8))])["stale"]
    monkeypatch.undo()
    assert dropped and res[-1].cached_tokens == 40
    assert tokens_of(res) != ref(engine, q, 8)
    assert_baseline(engine)


def test_conversation_resumes_from_the_host_tier(model_dir: str) -> None:
    """A 40-page device pool over a host tier: other conversations push turn 1's
    pages and its checkpoints to pinned host memory; turn 2 brings them back (the
    state into a device checkpoint slot, then into the request's) and resumes at
    turn 1's prompt end, with a full recompute's tokens."""
    eng = make_engine(model_dir, num_pages=41, max_running_requests=4, kv_host_pages=64)
    try:
        s = eng.scheduler
        rng = random.Random(11)
        turn1 = prompt(rng, 45)
        out1 = tokens_of(collect(eng, [("t1", turn1, greedy(6))])["t1"])
        for k in range(3):  # 40 pages of other conversations: turn 1's are the LRU ones
            collect(eng, [(f"f{k}", prompt(rng, 60), greedy(2))])
        turn2 = turn1 + out1 + prompt(rng, 9)
        m = s.radix.match_prefix(turn2, count_stats=False)
        assert m.state_tokens == 0 and m.host_tokens >= 44, "turn 1 should sit in the host tier now"
        assert s.radix.host_cached_states > 0
        host = eng.runner.kv_host
        assert host is not None and host.counters.states_offloaded_total > 0
        outs = collect(eng, [("t2", turn2, greedy(8))])["t2"]
        assert host.counters.states_loaded_total > 0
        assert outs[-1].cached_tokens == 44  # (45 - 1) // 4 * 4
        assert tokens_of(outs) == ref(eng, turn2, 8)
        assert eng.stats().state_checkpoints_host_cached == s.radix.host_cached_states
        assert_baseline(eng)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("seed", [0, 1])
def test_random_shared_prefixes_under_both_evictions(model_dir: str, seed: int) -> None:
    """Requests over a few shared stems, in small concurrent waves, through a
    40-page device pool, 4 checkpoint slots and a 20-page host tier with 3 state
    slots: pages and checkpoints offloaded together, dropped by the host LRU,
    restored at admission; integrity checked after every step, every output
    equal to a full recompute."""
    rng = random.Random(seed)
    eng = make_engine(model_dir, num_pages=41, max_running_requests=3, kv_host_pages=20,
                      state_checkpoints=4, state_host_checkpoints=3)
    try:
        stems = [prompt(rng, rng.randint(20, 44)) for _ in range(4)]
        for wave in range(8):
            reqs = []
            for i in range(rng.randint(1, 3)):
                p = rng.choice(stems)[: rng.randint(12, 44)] + prompt(rng, rng.randint(1, 24))
                reqs.append((f"w{wave}r{i}", p, greedy(rng.randint(1, 3))))
            outs = collect(eng, reqs)
            for rid, p, params in reqs:
                assert tokens_of(outs[rid]) == ref(eng, p, params.max_tokens), rid
        host = eng.runner.kv_host
        assert host is not None and host.counters.states_offloaded_total > 0
        assert eng.scheduler.radix.host_hit_tokens_total > 0
        assert_baseline(eng)
    finally:
        eng.shutdown()


def test_abort_mid_prefill_keeps_its_checkpoints(model_dir: str) -> None:
    """A 70-token prompt aborted after its third chunk (checkpoints 16, 32, 48
    saved): the request waiting to share its prompt goes on alone, resuming from
    the aborted one's checkpoint 48 (an abort hands computed pages and their
    checkpoints to the prefix cache), with a full recompute's tokens."""
    eng = make_engine(model_dir)
    try:
        rng = random.Random(12)
        p = prompt(rng, 70)
        outs = drive(eng, [("lead", p, greedy(4)), ("follow", p, greedy(4))], abort_at_step={"lead": 3})
        assert outs["lead"][-1].finish_reason == "abort" and not tokens_of(outs["lead"])
        assert tokens_of(outs["follow"]) == ref(eng, p, 4)
        assert outs["follow"][-1].cached_tokens == 48
        assert_baseline(eng)
    finally:
        eng.shutdown()


def test_expert_offload_with_512_experts(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Qwen3-Next's routing (512 experts, top-10, a shared expert) on a linear and
    an attention layer, experts offloaded to host banks with 64 of the 1,024 in
    VRAM slots (prefill streams whole layers, decode admits misses): chunked,
    batched prompts and a turn that resumes from a checkpoint give the tokens of
    the engine holding every expert."""
    from ftserve.engine.driver import EngineDriver
    from ftserve.models.checkpoint import write_checkpoint
    from tests.test_moe_cache import make_experts_matter

    out = tmp_path_factory.mktemp("qwen3-next-512")
    write_checkpoint("tiny-qwen3-next", out, config_only=True, layers=2,
                     overrides=dict(num_experts=512, num_experts_per_tok=10, moe_intermediate_size=8))
    rng = random.Random(13)
    prompts = [prompt(rng, n) for n in (5, 29)]
    turn2 = prompts[1] + prompt(rng, 4)
    got: dict[str, list[list[int]]] = {}
    for name, kw in (("resident", {}), ("offload", dict(moe_cache_size=64))):
        eng = make_engine(str(out), max_running_requests=2, state_checkpoints=8, **kw)
        try:
            make_experts_matter(eng.runner.model)
            drv = EngineDriver(eng)
            reqs = [drv.add(p, 5) for p in prompts]
            drv.run_all()
            again = drv.add(turn2, 5)
            drv.run_all()
            assert again.cached_len == 28  # prompts[1]'s prompt-end checkpoint
            got[name] = [list(r.output_ids) for r in (*reqs, again)]
            cache = getattr(eng.runner.model, "expert_cache", None)
            if name == "offload":
                assert cache is not None and not cache.full
                st = cache.stats()
                assert st["experts_streamed"] > 0 and 0 < st["misses"] < st["lookups"], st
            else:
                assert cache is None
                assert got[name][0] == ref(eng, prompts[0], 5)
            assert_baseline(eng)
        finally:
            eng.shutdown()
    assert got["offload"] == got["resident"]


def test_fp8_kv_for_the_attention_layers(model_dir: str) -> None:
    """--kv-cache-dtype fp8_e4m3 on a hybrid: the pool holds fp8 codes and scales
    for the two attention layers only; a conversation whose second turn resumes
    from a checkpoint, beside a chunked 70-token prompt, gives the tokens of the
    same fp8 engine without a prefix cache (a full recompute); its logprobs
    differ from an fp32 KV cache's (the fp8 pages were read) by little."""
    rng = random.Random(14)
    turn1, side, tail = prompt(rng, 45), prompt(rng, 70), prompt(rng, 9)
    got: dict[str, tuple[list[int], list[float], int]] = {}
    for name, kw in (("fp8", dict(kv_cache_dtype="fp8_e4m3")),
                     ("fp8-recompute", dict(kv_cache_dtype="fp8_e4m3", enable_prefix_cache=False)),
                     ("fp32", {})):
        eng = make_engine(model_dir, **kw)
        try:
            pool = eng.runner.kv_pool
            assert pool.num_layers == 2
            assert (pool.dtype == torch.float8_e4m3fn) == name.startswith("fp8")
            params = greedy(6, logprobs=0)
            outs = collect(eng, [("t1", turn1, params), ("side", side, params)])
            out1 = tokens_of(outs["t1"])
            res = collect(eng, [("t2", turn1 + out1 + tail, greedy(8, logprobs=0))])["t2"]
            lps = [lp.logprob for o in (*outs["t1"], *res) for lp in o.logprobs or []]
            got[name] = (out1 + tokens_of(res) + tokens_of(outs["side"]), lps, res[-1].cached_tokens)
            if kw.get("enable_prefix_cache") is not False:
                assert_baseline(eng)
        finally:
            eng.shutdown()
    assert got["fp8"][2] == 44 and got["fp8-recompute"][2] == 0
    assert got["fp8"][0] == got["fp8-recompute"][0]
    # Up to the first token the two caches choose differently (a flat random model
    # may tip either way), the same positions are scored.
    a, b = got["fp8"][0][:14], got["fp32"][0][:14]
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), 14)
    assert same >= 6, (a, b)
    fp8, fp32 = torch.tensor(got["fp8"][1][:same]), torch.tensor(got["fp32"][1][:same])
    err = (fp8 - fp32).abs().max().item()
    assert 0.0 < err < 0.05, err
