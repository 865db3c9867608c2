"""Speculative decoding in the engine (CPU, float32, the tiny random model): the
same tokens, logprobs and finish reasons with and without --speculative ngram,
across greedy and seeded sampling, batching, chunked prefill, prefix hits,
preemption and overlap; the pool, the radix tree and the device page-table rows
stay consistent (checked after every step) and drafts really were proposed,
kept and rejected.

Random weights do not copy from their context the way a trained model does, so
the prompts are made to be copied: X + C + X, where C is what the model
generates after X. After the second X the n-gram draft proposes C again; the
model, its attention scaled up (make_context_sensitive) so that context matters,
repeats part of it and diverges: full, partial and rejected drafts all occur."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
import torch

from ftserve.config import EngineConfig
from ftserve.engine.engine import Engine
from ftserve.engine.request import Req
from ftserve.engine.sampling_params import SamplingParams
from ftserve.engine.scheduler import Scheduler
from ftserve.engine.setup import build_engine
from ftserve.engine.spec import speculator as spec_mod
from ftserve.engine.spec.speculator import Speculator
from tests.engine_util import collect, greedy, make_context_sensitive, tokens_of
from tests.test_engine import assert_pool_baseline

GAIN = 8.0  # attention gain: context matters, and copies still happen


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from ftserve.models.checkpoint import write_checkpoint

    out = tmp_path_factory.mktemp("tiny-moe")
    write_checkpoint("tiny-moe", out, config_only=True)
    return str(out)


def make(model_dir: str, **kw: Any) -> Engine:
    base: dict[str, Any] = dict(model=model_dir, load_format="dummy", device="cpu", dtype="float32",
                                page_size=4, num_pages=512, max_prefill_length=64,
                                max_running_requests=16, status_log_interval=0.0,
                                speculative_gate=False)  # the gate's timed windows would hold some steps' drafting off (test_spec_gate.py)
    base.update(kw)
    eng = build_engine(EngineConfig(**base))
    eng.check_integrity = True  # scheduler, radix and device page rows after every step
    make_context_sensitive(eng.runner.model, GAIN)
    return eng


@pytest.fixture(scope="module")
def plain(model_dir: str) -> Engine:
    eng = make(model_dir)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def spec(model_dir: str) -> Engine:
    eng = make(model_dir, speculative="ngram", num_speculative_tokens=4)
    yield eng
    eng.shutdown()


def echo_prompts(plain: Engine, seed: int, n: int, params: SamplingParams,
                 lengths: tuple[int, int] = (3, 40)) -> list[list[int]]:
    """X + C + X, C = the plain engine's output after X (module docstring)."""
    rng = random.Random(seed)
    xs = [[rng.randrange(10, 32000) for _ in range(rng.randint(*lengths))] for _ in range(n)]
    outs = collect(plain, [(f"x{i}", x, params) for i, x in enumerate(xs)])
    return [x + tokens_of(outs[f"x{i}"]) + x for i, x in enumerate(xs)]


def counters(eng: Engine) -> tuple[int, int, int, list[int]]:
    st = eng.stats()
    return (st.spec_verifies_total, st.spec_proposed_tokens_total, st.spec_accepted_tokens_total,
            list(st.spec_accept_lengths))


def delta(after: tuple, before: tuple) -> tuple[int, int, int, list[int]]:
    return (after[0] - before[0], after[1] - before[1], after[2] - before[2],
            [a - b for a, b in zip(after[3], before[3])])


def same_outputs(a: dict, b: dict, logprobs: bool = False) -> None:
    for rid in a:
        assert tokens_of(b[rid]) == tokens_of(a[rid]), rid
        assert b[rid][-1].finish_reason == a[rid][-1].finish_reason, rid
        assert b[rid][-1].completion_tokens == a[rid][-1].completion_tokens, rid
        if logprobs:
            la = [lp for o in a[rid] for lp in (o.logprobs or [])]
            lb = [lp for o in b[rid] for lp in (o.logprobs or [])]
            assert len(la) == len(lb) and len(la) in (0, len(tokens_of(a[rid]))), rid
            for x, y in zip(la, lb):
                assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)
                assert [t for t, _ in x.top] == [t for t, _ in y.top], rid


def test_greedy_same_tokens_with_kept_and_rejected_drafts(plain: Engine, spec: Engine) -> None:
    """Ten concurrent requests (some prompts past the 64-token prefill chunk,
    so chunked), then a second turn of each that hits the prefix cache."""
    prompts = echo_prompts(plain, 0, 10, greedy(24))
    reqs = [(f"g{i}", p, greedy(24)) for i, p in enumerate(prompts)]
    before = counters(spec)
    a, b = collect(plain, reqs), collect(spec, reqs)
    same_outputs(a, b)
    turn2 = [(f"t{i}", p + tokens_of(a[f"g{i}"]) + p[:7], greedy(16)) for i, p in enumerate(prompts)]
    a2, b2 = collect(plain, turn2), collect(spec, turn2)
    same_outputs(a2, b2)
    assert all(b2[rid][-1].cached_tokens == a2[rid][-1].cached_tokens > 0 for rid, _, _ in turn2)
    verifies, proposed, accepted, lengths = delta(counters(spec), before)
    assert sum(lengths) == verifies and 0 < accepted < proposed
    assert lengths[0] > 0 and lengths[-1] > 0 and sum(lengths[1:-1]) > 0, lengths
    assert_pool_baseline(plain)
    assert_pool_baseline(spec)


def test_seeded_sampling_same_tokens_and_logprobs(plain: Engine, spec: Engine) -> None:
    """Sampled requests (temperature, top-k / top-p / min-p, logit_bias), seeded,
    with logprobs: the verify step's rows draw what plain steps draw."""
    kinds = [SamplingParams(max_tokens=16, temperature=0.6, seed=11, ignore_eos=True, logprobs=3),
             SamplingParams(max_tokens=16, temperature=1.0, top_k=40, top_p=0.9, seed=12,
                            ignore_eos=True),
             SamplingParams(max_tokens=16, temperature=0.3, min_p=0.05, seed=13, ignore_eos=True,
                            logit_bias=((77, 3.0),), logprobs=0),
             greedy(16, logprobs=5)]
    prompts = echo_prompts(plain, 1, 4, greedy(16))
    reqs = [(f"s{i}", p, kinds[i % len(kinds)]) for i, p in enumerate(prompts)]
    before = counters(spec)
    same_outputs(collect(plain, reqs), collect(spec, reqs), logprobs=True)
    verifies, _, accepted, _ = delta(counters(spec), before)
    assert verifies > 0 and accepted > 0
    assert_pool_baseline(spec)


def test_stops_and_limits_inside_drafts(plain: Engine, spec: Engine) -> None:
    """A stop id that the continuation reaches mid-draft, min_tokens that holds
    eos back, max_tokens shorter than a draft: the same cut as plain decoding."""
    prompts = echo_prompts(plain, 2, 4, greedy(20))
    base = collect(plain, [(f"b{i}", p, greedy(20)) for i, p in enumerate(prompts)])
    reqs = []
    for i, p in enumerate(prompts):
        cont = tokens_of(base[f"b{i}"])
        reqs.append((f"stop{i}", p, greedy(20, stop_token_ids=(cont[7],))))
        reqs.append((f"min{i}", p, SamplingParams(max_tokens=16, temperature=0.0, min_tokens=9,
                                                   stop_token_ids=(cont[3], cont[12]))))
        reqs.append((f"len{i}", p, greedy(2 + i % 3)))
    a, b = collect(plain, reqs), collect(spec, reqs)
    same_outputs(a, b)
    assert {a[f"stop{i}"][-1].finish_reason for i in range(4)} == {"stop"}
    assert_pool_baseline(spec)


def test_preemption_and_no_overlap(model_dir: str, plain: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool that makes requests preempt each other, drafting at every step (no
    back-off), with and without overlap scheduling."""
    monkeypatch.setattr(spec_mod, "MAX_BACKOFF", 1)
    prompts = echo_prompts(plain, 3, 8, greedy(16), lengths=(10, 30))
    reqs = [(f"p{i}", p, greedy(16)) for i, p in enumerate(prompts)]
    ref = collect(plain, reqs)
    for overlap in (True, False):
        eng = make(model_dir, speculative="ngram", num_speculative_tokens=5, num_pages=72,
                   overlap_schedule=overlap)
        try:
            same_outputs(ref, collect(eng, reqs))
            assert eng.stats().preemptions_total > 0 and eng.stats().spec_verifies_total > 0
            assert_pool_baseline(eng)
        finally:
            eng.shutdown()


def test_penalties_and_grammar_fall_back(plain: Engine, spec: Engine) -> None:
    """Requests whose sampling a verify step cannot reproduce decode plainly."""
    prompts = echo_prompts(plain, 4, 3, greedy(12))
    params = SamplingParams(max_tokens=12, temperature=0.0, presence_penalty=0.5, ignore_eos=True)
    reqs = [(f"pen{i}", p, params) for i, p in enumerate(prompts)]
    before = counters(spec)
    same_outputs(collect(plain, reqs), collect(spec, reqs))
    assert delta(counters(spec), before)[0] == 0


# ----- the scheduler's side, without a model --------------------------------

def test_driver_plans_verify_steps_ahead_as_the_engine(model_dir: str, plain: Engine) -> None:
    """EngineDriver (benchmarks, the GPU tests) runs a verify step's plan-ahead as
    the engine does: greedy tokens and logprobs equal plain decoding's, drafts kept,
    every page back after. (Engines of their own: the fixtures' threads run.)"""
    from tests.engine_util import run_greedy_logprobs

    prompts = echo_prompts(plain, 21, 4, greedy(16))
    off, on = make(model_dir), make(model_dir, speculative="ngram", num_speculative_tokens=4)
    want = run_greedy_logprobs(off, prompts, 16)
    got = run_greedy_logprobs(on, prompts, 16)
    assert got.tokens == want.tokens
    for a, b in zip(want.logprobs, got.logprobs):
        assert [x.logprob for x in a] == pytest.approx([y.logprob for y in b], abs=1e-4)
    assert on.scheduler.spec is not None and on.scheduler.spec.counters.accepted_tokens_total > 0
    assert_pool_baseline(on)


def _sched(num_pages: int = 16, k: int = 4) -> Scheduler:
    return Scheduler(page_size=4, num_pages=num_pages, max_running=2, max_prefill_length=64,
                     max_model_len=60, eos_token_ids=[2],
                     speculator=Speculator(k, 1, 3, max_model_len=60))


def test_verify_commit_trims_rejected_pages() -> None:
    """A draft reserves pages for its positions; a verify that rejects most of it
    keeps its accepted tokens' KV and frees the pages only rejected KV used."""
    s = _sched()
    prompt = [5, 6, 7, 8, 9, 5, 6]  # "5 6" recurs: the draft is 7 8 9 5
    req = Req("r", prompt, greedy(20), 0.0)
    s.add(req)
    b = s.schedule()
    assert b is not None and not b.is_decode
    s.commit(b, [7])  # the prefill's token: tokens ... 5 6 7
    b = s.schedule()
    assert b is not None and b.verifies and b.drafts == [[8, 9, 5, 6]]
    assert b.new_tokens == [[7, 8, 9, 5, 6]] and b.prefix_lens == [7]
    assert len(req.pages) == 3  # positions 7 .. 11
    s.commit_verified(b, [[8, 3, 1, 1, 1]])  # keeps 8, then 3 instead of 9
    assert req.output_ids == [7, 8, 3] and req.computed_len == 9
    assert len(req.pages) == 3 and req.pages_trimmed_to is None  # position 9 needs page 2
    s.check_integrity()
    b = s.schedule()  # "3" occurs nowhere before: plain decode, back-off
    assert b is not None and b.is_decode and not b.verifies
    s.commit(b, [5])
    req.spec.resume_at = 0
    b = s.schedule()  # "3 5" no, "5": draft 6 7 8 3
    assert b is not None and b.drafts == [[6, 7, 8, 3]] and len(req.pages) == 4
    s.commit_verified(b, [[1, 1, 1, 1, 1]])  # all rejected: keeps 1
    assert req.computed_len == 11 and len(req.pages) == 3 and req.pages_trimmed_to == 3
    assert s.allocator.num_free == s.allocator.num_total - 3
    s.check_integrity()
    st = s.spec.counters  # type: ignore[union-attr]
    assert (st.verifies_total, st.proposed_tokens_total, st.accepted_tokens_total) == (2, 8, 1)
    assert st.accept_lengths == [1, 1, 0, 0, 0]


def test_plan_ahead_takes_the_next_verify_pages_from_free_ones() -> None:
    """While a verify step runs, plan_ahead takes the pages its request's next
    verify can need (this draft all kept, then a full draft) from free pages; the
    commit keeps them for a request that drafts on and frees them for one that
    backs off; with no page to spare per running request it takes none."""
    s = _sched()
    req = Req("r", [5, 6, 7, 8, 9, 5, 6], greedy(20), 0.0)
    s.add(req)
    b = s.schedule()
    assert b is not None
    s.commit(b, [7])
    b = s.schedule()
    assert b is not None and b.drafts == [[8, 9, 5, 6]] and len(req.pages) == 3
    s.plan_ahead(b)  # up to 7 + 4 + 2 + 4 = 17 tokens: 5 pages
    assert len(req.pages) == 5
    s.commit_verified(b, [[8, 9, 5, 6, 7]])  # all kept: 12 computed, drafts on
    assert req.computed_len == 12 and len(req.pages) == 5 and req.pages_trimmed_to is None
    s.check_integrity()
    b = s.schedule()
    assert b is not None and b.drafts == [[8, 9, 5, 6]] and len(req.pages) == 5  # nothing new
    free = s.allocator.num_free
    held = s.allocator.alloc(free - 1)  # 1 free: the page it needs (22 tokens), none to spare
    s.plan_ahead(b)
    assert len(req.pages) == 5
    s.commit_verified(b, [[1, 1, 1, 1, 1]])  # all rejected: back-off, plain steps next
    assert req.computed_len == 13 and len(req.pages) == 4 and req.pages_trimmed_to == 4
    assert held is not None
    s.allocator.free(held)
    s.check_integrity()


def test_back_off_doubles_and_resets() -> None:
    sp = Speculator(4, 2, 2, max_model_len=5000)
    req = Req("r", [1, 2, 3, 4], greedy(2000), 0.0)
    waits = []
    for _ in range(9):
        assert sp.propose(req) == []  # nothing recurs
        st = req.spec
        waits.append(st.resume_at - req.num_outputs)
        while req.num_outputs < st.resume_at:
            assert sp.propose(req) == [] and not sp.drafting(req) or req.num_outputs + 1 >= st.resume_at
            req.tokens.append(100 + len(req.tokens))
            req.output_ids.append(0)
    assert waits == [2, 4, 8, 16, 32, 64, 128, 128, 128]
    req.tokens += [1, 2]  # "1 2" recurs: draft 3 4 ...
    assert sp.propose(req)[:2] == [3, 4]
    sp.record(req, 4, 1)
    assert req.spec.misses == 0 and sp.drafting(req)
    assert Speculator(4, 2, 2, 1000).limit(Req("x", [1] * 5, greedy(3), 0.0)) == 2  # max_tokens - 1
    constrained = Req("c", [1, 2, 1, 2], greedy(9), 0.0, grammar=object())  # type: ignore[arg-type]
    assert not sp.supports(constrained) and sp.propose(constrained) == [] and not sp.drafting(constrained)


def test_hybrid_models_speculate(tmp_path: Any) -> None:
    """--speculative ngram on a hybrid model starts (the state pool carries a
    verify log: tests/test_spec_hybrid.py checks the outputs and states) and
    drafts; the same folder starts without the flag, with no log."""
    from ftserve.models.checkpoint import write_config

    model = write_config("tiny-qwen3-next", tmp_path / "hybrid")
    cfg = EngineConfig(model=model, load_format="dummy", device="cpu", dtype="float32",
                       num_pages=64, max_running_requests=2, speculative="ngram", status_log_interval=0.0,
                       speculative_gate=False)
    engine = build_engine(cfg)
    try:
        pool = engine.scheduler.state_pool
        assert engine.scheduler.spec is not None and pool is not None and pool.verify_log is not None
        x = [5, 6, 7, 8, 9]
        c = tokens_of(collect(engine, [("x", x, greedy(6))])["x"])
        out = collect(engine, [("r", x + c + x, greedy(6))])  # drafts copy c
        assert len(tokens_of(out["r"])) == 6 and engine.scheduler.spec.counters.verifies_total > 0
    finally:
        engine.shutdown()
    engine = build_engine(dataclasses.replace(cfg, speculative="off"))
    assert engine.scheduler.spec is None and engine.scheduler.state_pool is not None
    assert engine.scheduler.state_pool.verify_log is None


def test_verify_graph_static_forward_equals_eager(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The verify graphs' static, padded forward (what CUDA captures per width; run
    eagerly here, Triton attention under the interpreter) gives the eager verify
    step's logits at every sampled row: two drafted requests and a plain one.
    Each layer's attention folds the rotary and the KV store into the decode
    kernel (every token's sequence's first row in the static inputs)."""
    from ftserve.engine.prefill_graph import PrefillGraphs, verify_buckets
    from ftserve_kernels import attention_triton as at

    folded: list[list[int]] = []
    real = at.decode_attention_triton

    def spy(*args: Any, qk: Any = None, **kwargs: Any) -> Any:
        if qk is not None and qk.first_rows is not None:
            folded.append(qk.first_rows.tolist())
        return real(*args, qk=qk, **kwargs)

    monkeypatch.setattr(at, "decode_attention_triton", spy)

    eng = make(model_dir, speculative="ngram", num_speculative_tokens=3)
    try:
        sched, runner = eng.scheduler, eng.runner
        graphs = PrefillGraphs(runner, 0, 4, buckets=verify_buckets(4, 3), all_rows=True, seq_tokens=4)
        assert graphs.buckets == [4, 8, 16]
        prompts = {"a": [5, 6, 7, 8, 9, 5, 6], "b": [11, 12, 13, 14, 11, 12], "c": [20, 21, 22]}
        firsts = {"a": 7, "b": 13, "c": 23}  # a: "6 7" recurs, b: "12 13"; c: nothing
        for rid, p in prompts.items():
            sched.add(Req(rid, p, greedy(10), 0.0))
        batch = sched.schedule()
        assert batch is not None and not batch.is_decode and not batch.verifies
        sched.commit(batch, [firsts[r.request_id] for r in batch.reqs])
        batch = sched.schedule()
        assert batch is not None and batch.verifies and graphs.can_run(batch)
        assert batch.drafts == [[8, 9, 5], [14, 11, 12], []]
        # A plain row fed from an in-flight step's output: the graph cannot read it.
        assert not graphs.can_run(dataclasses.replace(batch, src_rows=[-1, -1, 0]))
        runner.prepare_slots(batch.reqs)
        with torch.inference_mode():
            graphs._fill(batch, graphs._bucket(batch.num_tokens))
            static = graphs._forward(graphs._bucket(batch.num_tokens))[:9]  # 4 + 4 + 1 rows
            # Each token attends as a decode query of its own (prefill_graph docstring).
            meta = graphs.fbs[graphs._bucket(batch.num_tokens)].attn
            assert meta.query_seq_lens is not None and meta.query_page_table is not None
            slots = [r.slot for r in batch.reqs]
            assert graphs.inputs.token_rows.tolist() == [slots[0]] * 4 + [slots[1]] * 4 + [slots[2]] \
                + [runner.sink_row] * 7
            first = [0] * 4 + [4] * 4 + [8] + list(range(9, 16))  # padding: its own row
            assert graphs.inputs.first_rows.tolist() == first
            assert folded == [first] * len(runner.model.layers), "every layer folds the rotary and store"
            fb, slots, steps, _ = runner.build(batch)
            eager = runner.model(fb)  # [9, V]
        torch.testing.assert_close(static, eager, rtol=1e-4, atol=1e-4)
        assert steps.tolist() == [1, 2, 3, 4, 1, 2, 3, 4, 1]
        assert slots.tolist() == [r.slot for r in batch.reqs for _ in range(4)][:9]
    finally:
        eng.shutdown()


def test_verify_graph_path_in_the_runner_same_tokens(model_dir: str, plain: Engine) -> None:
    """The runner's graph path for verify steps (static logits, rows in order,
    eager sampling), with the graph's static forward run eagerly in place of a
    replay: the same tokens as plain decoding."""
    from ftserve.engine.prefill_graph import PrefillGraphs, verify_buckets

    class StaticForward(PrefillGraphs):
        replays = 0

        def replay(self, batch: Any) -> torch.Tensor:
            StaticForward.replays += 1
            bucket = self._bucket(batch.num_tokens)
            self._fill(batch, bucket)
            return self._forward(bucket)

    prompts = echo_prompts(plain, 5, 3, greedy(12), lengths=(4, 12))
    reqs = [(f"vg{i}", p, greedy(12)) for i, p in enumerate(prompts)]
    eng = make(model_dir, speculative="ngram", num_speculative_tokens=3)
    try:
        eng.runner.verify_graphs = StaticForward(eng.runner, 0, 4, buckets=verify_buckets(4, 3),
                                                 all_rows=True, seq_tokens=4)
        same_outputs(collect(plain, reqs), collect(eng, reqs))
        assert eng.stats().spec_accepted_tokens_total > 0
        assert 0 < StaticForward.replays <= eng.stats().spec_verifies_total  # every verify step
        assert_pool_baseline(eng)
    finally:
        eng.shutdown()
