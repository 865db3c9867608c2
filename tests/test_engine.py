"""Engine correctness on the CPU (float32): exact greedy equality with a plain
full-recompute decode, across batching, chunking, prefix hits, preemption and
aborts; plus pool accounting after every scenario. The model is made
context-sensitive (engine_util.make_context_sensitive) so that equality means
the KV was right, not only the last token."""

from __future__ import annotations

import random

import pytest

from ftserve.config import EngineConfig
from ftserve.engine.engine import Engine
from ftserve.engine.setup import build_engine
from tests.engine_util import collect, greedy, make_context_sensitive, reference_greedy, tokens_of

VOCAB_HI = 32000


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from ftserve.models.checkpoint import write_checkpoint

    out = tmp_path_factory.mktemp("tiny-moe")
    write_checkpoint("tiny-moe", out, config_only=True)
    return str(out)


def make_engine(model_dir: str, **kw: object) -> Engine:
    base = dict(model=model_dir, load_format="dummy", device="cpu", dtype="float32",
                page_size=4, num_pages=512, max_prefill_length=64, max_running_requests=16,
                status_log_interval=0.0)
    base.update(kw)
    eng = build_engine(EngineConfig(**base))  # type: ignore[arg-type]
    eng.check_integrity = True
    make_context_sensitive(eng.runner.model)  # else greedy tokens cannot see wrong KV
    return eng


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, VOCAB_HI) for _ in range(n)]


def assert_pool_baseline(eng: Engine) -> None:
    s = eng.scheduler
    assert not s.running and not s.waiting
    assert s.num_pages_used == 0
    assert s.allocator.num_free + s.radix.cached_pages == s.allocator.num_total
    s.check_integrity()


@pytest.fixture(scope="module")
def engine(model_dir: str) -> Engine:
    eng = make_engine(model_dir)
    yield eng
    eng.shutdown()


def test_single_request_matches_reference(engine: Engine) -> None:
    rng = random.Random(0)
    p = prompt(rng, 13)
    outs = collect(engine, [("a", p, greedy(12))])
    ref = reference_greedy(engine.runner.model, engine.model_config, p, 12)
    assert tokens_of(outs["a"]) == ref
    last = outs["a"][-1]
    assert last.finish_reason == "length" and last.completion_tokens == 12
    assert_pool_baseline(engine)


def test_sixteen_concurrent_requests(engine: Engine) -> None:
    rng = random.Random(1)
    reqs = [(f"r{i}", prompt(rng, rng.randint(1, 40)), greedy(rng.randint(1, 10))) for i in range(16)]
    outs = collect(engine, reqs)
    for rid, p, params in reqs:
        assert tokens_of(outs[rid]) == reference_greedy(
            engine.runner.model, engine.model_config, p, params.max_tokens), rid
    assert_pool_baseline(engine)


def test_without_overlap_scheduling_same_tokens(model_dir: str, engine: Engine) -> None:
    eng = make_engine(model_dir, overlap_schedule=False)
    try:
        rng = random.Random(11)
        reqs = [(f"o{i}", prompt(rng, rng.randint(1, 30)), greedy(rng.randint(1, 8))) for i in range(6)]
        a = collect(eng, reqs)
        b = collect(engine, reqs)
        for rid, _, _ in reqs:
            assert tokens_of(a[rid]) == tokens_of(b[rid]), rid
        assert_pool_baseline(eng)
    finally:
        eng.shutdown()


def test_chunked_prefill_longer_than_chunk(engine: Engine) -> None:
    rng = random.Random(2)
    p = prompt(rng, 150)  # max_prefill_length 64: three chunks
    outs = collect(engine, [("long", p, greedy(6)), ("short", prompt(rng, 5), greedy(20))])
    assert tokens_of(outs["long"]) == reference_greedy(engine.runner.model, engine.model_config, p, 6)
    assert_pool_baseline(engine)


def test_second_turn_hits_prefix_cache(engine: Engine) -> None:
    rng = random.Random(3)
    turn1 = prompt(rng, 37)
    out1 = tokens_of(collect(engine, [("t1", turn1, greedy(9))])["t1"])
    turn2 = turn1 + out1 + prompt(rng, 11)
    res = collect(engine, [("t2", turn2, greedy(7))])["t2"]
    assert tokens_of(res) == reference_greedy(engine.runner.model, engine.model_config, turn2, 7)
    # Turn 1's prompt and all but its last generated token have KV: whole pages are reused.
    reusable = (len(turn1) + len(out1) - 1) // 4 * 4
    assert res[-1].cached_tokens == reusable
    assert_pool_baseline(engine)


def test_prompt_pages_shared_once_prefill_is_done(engine: Engine) -> None:
    """Requests that arrive while another with the same prompt decodes reuse that
    prompt's full pages (published to the prefix cache at the end of the first
    one's prefill, not at its end); one sent at the same time waits for that
    prefill instead of repeating it; all match the reference."""
    rng = random.Random(12)
    p = prompt(rng, 37)
    before = engine.scheduler.counters.published_prompt_pages_total
    outs = collect(engine, [("first", p, greedy(12)), ("second", p, greedy(5)),
                            ("third", p + prompt(rng, 6), greedy(5)), ("fourth", p, greedy(3))],
                   start_after={"second": "first", "third": "second"})  # fourth: with first
    want = reference_greedy(engine.runner.model, engine.model_config, p, 12)
    assert tokens_of(outs["first"]) == want and tokens_of(outs["second"]) == want[:5]
    assert outs["second"][-1].cached_tokens == 36  # 9 pages of 4; the last token is computed
    assert outs["third"][-1].cached_tokens == 36  # the shared pages, then its own 6 tokens + 1
    # Sent together with first, fourth waited for first's prefill instead of repeating it.
    assert outs["fourth"][-1].cached_tokens == 36 and tokens_of(outs["fourth"]) == want[:3]
    assert engine.scheduler.counters.published_prompt_pages_total - before >= 9 + 1
    assert_pool_baseline(engine)


def test_abort_everywhere_returns_pool_to_baseline(engine: Engine) -> None:
    rng = random.Random(4)
    reqs = [(f"x{i}", prompt(rng, 30 + 20 * i), greedy(50)) for i in range(6)]
    outs = collect(engine, reqs, abort_after={"x0": 1, "x1": 3, "x2": 10})
    for rid in ("x0", "x1", "x2"):
        assert outs[rid][-1].finish_reason == "abort"
    assert_pool_baseline(engine)


def test_abort_queued_and_unknown(engine: Engine) -> None:
    engine.abort("does-not-exist")
    rng = random.Random(5)
    outs = collect(engine, [("q", prompt(rng, 8), greedy(3))])
    assert tokens_of(outs["q"])
    assert_pool_baseline(engine)


def test_preemption_and_resume_exact(model_dir: str) -> None:
    # 24 usable pages of 4 tokens = 96 tokens for 4 requests growing to ~45 tokens each.
    eng = make_engine(model_dir, num_pages=25, max_running_requests=4, max_prefill_length=32)
    try:
        rng = random.Random(6)
        reqs = [(f"p{i}", prompt(rng, 20), greedy(25)) for i in range(4)]
        outs = collect(eng, reqs)
        assert eng.scheduler.counters.preemptions_total > 0
        for rid, p, params in reqs:
            assert tokens_of(outs[rid]) == reference_greedy(
                eng.runner.model, eng.model_config, p, params.max_tokens), rid
        assert_pool_baseline(eng)
    finally:
        eng.shutdown()


def test_too_long_prompt_fails_at_once(model_dir: str) -> None:
    eng = make_engine(model_dir, num_pages=9)  # 32 tokens of KV
    try:
        outs = collect(eng, [("big", list(range(10, 50)), greedy(2)), ("ok", [11, 12, 13], greedy(2))])
        assert outs["big"][-1].finish_reason == "error"
        assert "maximum context length" in (outs["big"][-1].error or "")
        assert outs["ok"][-1].finish_reason == "length"
        assert_pool_baseline(eng)
    finally:
        eng.shutdown()


def test_stop_token_and_min_tokens(engine: Engine) -> None:
    rng = random.Random(7)
    p = prompt(rng, 10)
    ref = reference_greedy(engine.runner.model, engine.model_config, p, 8)
    stop_at = ref[3]
    first = ref.index(stop_at)
    outs = collect(engine, [("s", p, greedy(8, stop_token_ids=(stop_at,)))])
    assert tokens_of(outs["s"]) == ref[: first + 1]
    assert outs["s"][-1].finish_reason == "stop"


def test_engine_failure_surfaces(model_dir: str) -> None:
    eng = make_engine(model_dir)
    try:
        def boom(*a: object, **k: object) -> None:
            raise RuntimeError("injected device failure")

        eng.runner.launch = boom  # type: ignore[method-assign]
        outs = collect(eng, [("f", [5, 6, 7], greedy(3))])
        assert outs["f"][-1].finish_reason == "error"
        assert "injected device failure" in (outs["f"][-1].error or "")
        assert not eng.healthy
    finally:
        eng.shutdown()


def test_undone_admission_counts_prompt_once() -> None:
    """A request whose first chunk does not fit yet is admitted again later:
    prompt and prefix-hit counters count it once."""
    from ftserve.engine.request import Req
    from ftserve.engine.sampling_params import SamplingParams
    from ftserve.engine.scheduler import Scheduler

    s = Scheduler(page_size=4, num_pages=9, max_running=4, max_prefill_length=64,
                  max_model_len=32, eos_token_ids=[])
    a = Req("a", list(range(10, 34)), SamplingParams(max_tokens=4, temperature=0.0), 0.0)
    b = Req("b", list(range(50, 62)), SamplingParams(max_tokens=4, temperature=0.0), 0.0)
    s.add(a)
    s.add(b)
    batch = s.schedule()  # a takes 6 of 8 pages; b (3 pages) is admitted, undone
    assert batch is not None and batch.reqs == [a] and list(s.waiting) == [b]
    s.check_integrity()
    s.commit(batch, [1])
    s.finish(a, "abort")  # a's pages go to the tree, evictable
    batch = s.schedule()
    assert batch is not None and batch.reqs == [b]
    assert s.counters.prompt_tokens_total == 24 + 12
    s.check_integrity()


def test_prompt_sharing_at_the_scheduler() -> None:
    """Scheduler level (engine/prefix_sharing.py): a request whose prompt another
    running request is still prefilling waits, and at the leader's first token
    its full prompt pages move into the tree under its lock (same page ids, none
    freed); the follower is then admitted onto them. Where the tree already
    holds more of a prompt than the request matched (another publisher got
    there first), nothing is published. Integrity is checked after every step."""
    from ftserve.engine.request import Req
    from ftserve.engine.sampling_params import SamplingParams
    from ftserve.engine.scheduler import Scheduler

    s = Scheduler(page_size=4, num_pages=40, max_running=4, max_prefill_length=64,
                  max_model_len=64, eos_token_ids=[])
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    toks = list(range(10, 31))  # 21 tokens: 5 full pages
    a, b = Req("a", list(toks), sp, 0.0), Req("b", list(toks) + [7, 8], sp, 0.0)
    other = Req("o", list(range(100, 110)), sp, 0.0)
    s.add(a)
    s.add(b)  # same prompt: waits for a
    s.add(other)  # queued behind b
    batch = s.schedule()
    assert batch is not None and batch.reqs == [a] and list(s.waiting) == [b, other]
    pages_a = list(a.pages)
    s.commit(batch, [1])
    assert a.num_tree_pages == 5 and a.pages == pages_a and s.radix.cached_pages == 5
    assert s.counters.published_prompt_pages_total == 5
    s.check_integrity()
    seen_b = False
    for _ in range(12):
        batch = s.schedule()
        if batch is None:
            break
        if b in batch.reqs and not seen_b:  # b's prefill: the 5 shared pages, its own 3 tokens
            seen_b = True
            assert b.cached_len == b.computed_len == 20 and b.pages[:5] == pages_a[:5]
        s.commit(batch, [2] * len(batch.reqs))
        s.check_integrity()
    assert seen_b and other.num_outputs > 0
    # Another publisher first: c's own pages are not adopted while the tree has others.
    c = Req("c", list(range(200, 213)), sp, 0.0)  # 13 tokens: 3 full pages
    s.add(c)
    batch = s.schedule()
    while batch is not None and c not in batch.reqs:
        s.commit(batch, [3] * len(batch.reqs))
        batch = s.schedule()
    assert batch is not None
    theirs = s.allocator.alloc(3)
    assert theirs is not None
    s.radix.insert(c.tokens[:12], theirs)  # as if another request had published them
    before = s.counters.published_prompt_pages_total
    s.commit(batch, [3] * len(batch.reqs))
    assert c.num_tree_pages == 0 and s.counters.published_prompt_pages_total == before
    s.check_integrity()
    for r in (a, b, c, other):
        if not r.finished:
            s.finish(r, "abort")
    s.check_integrity()
    assert s.num_pages_used == 0
    assert s.allocator.num_free + s.radix.cached_pages == s.allocator.num_total


def test_follower_proceeds_when_its_leader_goes() -> None:
    """A request waiting on a leader's prefill is admitted on its own when the
    leader is aborted mid-prefill."""
    from ftserve.engine.request import Req
    from ftserve.engine.sampling_params import SamplingParams
    from ftserve.engine.scheduler import Scheduler

    s = Scheduler(page_size=4, num_pages=40, max_running=4, max_prefill_length=8,
                  max_model_len=64, eos_token_ids=[])
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    toks = list(range(10, 40))  # 30 tokens: 4 chunks of 8
    a, b = Req("a", list(toks), sp, 0.0), Req("b", list(toks), sp, 0.0)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert batch is not None and batch.reqs == [a] and list(s.waiting) == [b]
    s.commit(batch, [0])  # a non-final chunk: nothing sampled
    batch = s.schedule()
    assert batch is not None and batch.reqs == [a]  # b still waits for a
    s.abort("a")
    s.commit(batch, [0])
    batch = s.schedule()
    # Admitted on its own, onto what a had computed when aborted (its first chunk: an
    # abort hands computed pages to the prefix cache), not onto a published prompt.
    assert batch is not None and b in batch.reqs and b.cached_len == 8
    s.check_integrity()


def test_pack_tokens_matches_per_token_layout() -> None:
    """The vectorized packer equals the per-token definition for short (decode,
    verify) and long (chunk) sequences mixed, across page boundaries, also with long
    runs of short ones (a verify batch); too few pages for a sequence is an
    IndexError, not another sequence's slots."""
    from ftserve.models.forward_batch import pack_tokens

    rng = random.Random(3)
    ps = 4
    short_run = [(rng.randrange(1, 6), rng.randrange(0, 30)) for _ in range(12)]  # > 24 tokens
    for shape in ([(1, 9), (40, 0), (3, 5), (17, 13), (1, 0), (64, 31)],
                  [(5, 3), *short_run, (17, 2), (1, 4), (2, 7), *short_run]):
        toks, pres, tables = [], [], []
        for n, pre in shape:
            toks.append([rng.randrange(100) for _ in range(n)])
            pres.append(pre)
            tables.append(rng.sample(range(1, 500), (pre + n + ps - 1) // ps))
        ids, pos, locs, indptr, seq_lens, last = pack_tokens(toks, pres, tables, ps)
        want_pos = [p for t, pre in zip(toks, pres) for p in range(pre, pre + len(t))]
        want_locs = [tab[p // ps] * ps + p % ps
                     for t, pre, tab in zip(toks, pres, tables) for p in range(pre, pre + len(t))]
        assert ids.tolist() == [x for t in toks for x in t]
        assert pos.tolist() == want_pos
        assert locs.tolist() == want_locs
        ends = [sum(len(t) for t in toks[:i + 1]) for i in range(len(toks))]
        assert indptr == [0, *ends]
        assert seq_lens == [pre + len(t) for t, pre in zip(toks, pres)]
        assert last == [e - 1 for e in ends]
    assert indptr[:3] == [0, 5, 5 + short_run[0][0]]
    tables[3] = tables[3][:-1]  # a short sequence one page short
    with pytest.raises(IndexError):
        pack_tokens(toks, pres, tables, ps)


def test_fused_kv_store_same_tokens(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Into a float KV pool the q/k norm + rotary op of a q/k-normed model
    (Qwen3) stores K/V and the backend skips its store (an fp8 pool keeps the
    backend's store; a model without q/k norms stores in its rotary op alike,
    tests/test_kernels_model.py): chunked prefill, a prefix hit
    and decode give the tokens of a full recompute, and the backend saw
    kv_stored on every call."""
    backend = engine.runner.attn_backend
    seen: list[bool] = []
    real = backend.forward

    def spy(q, k, v, layer, batch, kv_stored=False):  # type: ignore[no-untyped-def]
        seen.append(kv_stored)
        return real(q, k, v, layer, batch, kv_stored=kv_stored)

    monkeypatch.setattr(backend, "forward", spy)
    rng = random.Random(21)
    p = prompt(rng, 150)  # > max_prefill_length 64: three chunks
    first = tokens_of(collect(engine, [("f1", p, greedy(6))])["f1"])
    turn2 = p + first + prompt(rng, 9)
    outs = collect(engine, [("f2", turn2, greedy(6))])["f2"]
    assert outs[-1].cached_tokens > 0, "turn 2 should hit the prefix cache"
    model, mcfg = engine.runner.model, engine.model_config
    assert first == reference_greedy(model, mcfg, p, 6)
    assert tokens_of(outs) == reference_greedy(model, mcfg, turn2, 6)
    assert seen and all(seen), "the q/k norm + rotary op stores K/V into a float pool"
    assert_pool_baseline(engine)


def test_decode_graph_rows_carry_the_eager_steps_inputs(model_dir: str) -> None:
    """A decode step packed as a decode graph's rows (cuda_graph.pack_decode_rows,
    one named DecodeRow per request, then padding) and unpacked by the inputs
    launch's twin gives what the eager path builds for the same step: the ids
    (the host's, or through src_row the token the step before left on the
    device), positions, KV slots, lengths, page-table rows, sampler slots,
    steps and min_tokens; padding rows point at the dummy row and write slot 0."""
    import torch

    from ftserve.engine.cuda_graph import MIN_FLAG, pack_decode_rows
    from ftserve.engine.driver import EngineDriver
    from ftserve.engine.sampling_params import SamplingParams
    from ftserve_kernels.decode_inputs import WORDS, decode_inputs_ref

    eng = make_engine(model_dir)
    try:
        drv, runner = EngineDriver(eng), eng.runner
        rng = random.Random(4)
        drv.add(prompt(rng, 9), max_tokens=8, params=SamplingParams(temperature=0.0, min_tokens=4))
        drv.add(prompt(rng, 21), max_tokens=8)
        for _ in range(4):  # both prefilled, then decode steps, one in flight (overlap)
            drv.step()
        batch = eng.scheduler.schedule()
        assert batch is not None and batch.is_decode and len(batch.reqs) == 2
        assert drv.inflight is not None and max(batch.src_rows) >= 0, "an id the host does not know yet"
        runner.mirror_pages(batch.reqs)
        pbs = 4
        words = pack_decode_rows(batch, runner.page_size, runner.sink_row, pbs)
        assert words.shape == (pbs * WORDS,)
        got = decode_inputs_ref(words.view(pbs, WORDS), runner.last_tokens, runner.page_table, None, MIN_FLAG)
        fb, slots, steps, min_active = runner.build(batch)
        n = len(batch.reqs)
        assert torch.equal(got.input_ids[:n], fb.input_ids) and torch.equal(got.positions[:n], fb.positions)
        assert torch.equal(got.out_cache_loc[:n], fb.attn.out_cache_loc)
        assert torch.equal(got.seq_lens[:n], fb.attn.seq_lens)
        assert torch.equal(got.prefix_lens[:n], fb.attn.prefix_lens)
        assert torch.equal(got.page_rows[:n], fb.attn.page_table)
        assert torch.equal(got.slots[:n], slots) and torch.equal(got.steps[:n], steps)
        assert torch.equal(got.min_active[:n], min_active) and got.min_active[:n].tolist() == [True, False]
        assert got.slots[n:].tolist() == [runner.sink_row] * (pbs - n)
        assert got.out_cache_loc[n:].tolist() == [0] * (pbs - n) and got.seq_lens[n:].tolist() == [1] * (pbs - n)
        drv.flush()
        drv.abort_all()
    finally:
        eng.shutdown()


@pytest.mark.parametrize("padded_bs", [5, 8])
def test_pack_decode_rows_is_one_decode_row_per_request(padded_bs: int) -> None:
    """pack_decode_rows (built by field) gives, row by row, the DecodeRow of each
    request as the field comments define it, then DecodeRow.padding rows; also
    when packed into the front of a longer buffer holding an older step's words."""
    import torch

    from ftserve.engine.cuda_graph import MIN_FLAG, pack_decode_rows
    from ftserve.engine.request import Req
    from ftserve.engine.sampling_params import SamplingParams
    from ftserve.engine.scheduler import ScheduledBatch
    from ftserve_kernels.decode_inputs import WORDS, DecodeRow

    ps, sink = 4, 31
    rng = random.Random(7)
    reqs = []
    for i, (min_tokens, state_slot) in enumerate([(0, -1), (9, 3), (2, 5), (0, 0), (5, -1)]):
        req = Req(f"r{i}", prompt(rng, 3), SamplingParams(min_tokens=min_tokens), 0.0)
        req.pages = rng.sample(range(1, 400), 6)
        req.slot, req.state_slot = 2 * i + 1, state_slot
        reqs.append(req)
    prefix = [rng.randrange(0, 6 * ps) for _ in reqs]
    steps = [0, 3, 2, 7, 4]  # against min_tokens 0, 9, 2, 0, 5: below for rows 1 and 4
    src = [-1, 4, -1, 0, 2]
    toks = [[-1] if s >= 0 else [rng.randrange(10, 999)] for s in src]
    batch = ScheduledBatch(reqs, True, toks, prefix, [True] * len(reqs), src_rows=src, steps=steps)
    want = [DecodeRow(input_id=t[0], position=p, out_cache_loc=q.pages[p // ps] * ps + p % ps, seq_len=p + 1,
                      slot=q.slot | (MIN_FLAG if s < q.params.min_tokens else 0), step=s, src_row=r,
                      state_slot=max(q.state_slot, 0))
            for q, t, p, s, r in zip(reqs, toks, prefix, steps, src)]
    want += [DecodeRow.padding(sink)] * (padded_bs - len(reqs))
    assert [w.slot & MIN_FLAG != 0 for w in want[:5]] == [False, True, False, False, True]
    got = pack_decode_rows(batch, ps, sink, padded_bs)
    assert got.dtype == torch.int64 and got.shape == (padded_bs * WORDS,)
    assert [DecodeRow(*r) for r in got.view(padded_bs, WORDS).tolist()] == want
    buf = torch.full((2 * 8 * WORDS,), -7, dtype=torch.int64)
    into = pack_decode_rows(batch, ps, sink, padded_bs, out=buf[8 * WORDS:])
    assert into.data_ptr() == buf.data_ptr() + 8 * WORDS * 8 and torch.equal(into, got)
    assert (buf[:8 * WORDS] == -7).all() and (buf[8 * WORDS + padded_bs * WORDS:] == -7).all()


@pytest.mark.parametrize("limit", ["max_tokens", "max_model_len"])
def test_overlap_launches_no_step_past_the_last_token(model_dir: str, limit: str) -> None:
    """With overlap scheduling the next step is planned while one is in flight;
    a request whose in-flight step samples its last token (by max_tokens or the
    context limit, both known by count) is not decoded again: n output tokens
    cost one prefill and n - 1 decode steps, the same as without overlap."""
    from ftserve.engine.driver import EngineDriver

    eng = make_engine(model_dir, max_model_len=16 if limit == "max_model_len" else 4096)
    try:
        drv = EngineDriver(eng)
        prompt_ids = prompt(random.Random(5), 10)
        req = drv.add(prompt_ids, max_tokens=6 if limit == "max_tokens" else 100)
        launched = []
        for _ in range(20):
            batch = drv.step()
            if batch is not None:
                launched.append(batch.is_decode)
            if drv.idle:
                break
        assert req.finish_reason == "length" and req.num_outputs == 6
        assert launched == [False] + [True] * 5, launched
    finally:
        eng.shutdown()
