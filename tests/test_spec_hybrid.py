"""Speculative decoding on a hybrid model (tiny Qwen3-Next: Gated DeltaNet and
gated attention, CPU, float32): --speculative ngram and mtp give plain
decoding's tokens, greedy and seeded, through batching, chunked prefill cut at
state checkpoints, prefix hits on a checkpoint and preemption, with and
without overlap; the scheduler, radix tree, state slots and page rows are
checked after every step and back at baseline after each scenario; drafts were
kept in full, in part and rejected. And the point of it all: after every
verify step each running request's state slot (conv window and recurrent
state, every linear layer) holds the state plain decoding has after the same
tokens.

A verify step's forward leaves the slots alone and logs the linear layers'
inputs; once it has sampled, the device counts the kept tokens and replays
them into each slot (kvcache/state_pool.py). A slot moved on by one token too
many or too few, or not at all, fails the state check at once, and usually
the greedy comparison too.

Prompts: n-gram drafts copy from X + C + X (C: what the model says after X,
test_spec_engine's echo prompts); the MTP layer is made a near identity
(``distill``), so it drafts what the model would say for the next token with
its layers silent: often right, often not. The attention gain (3) keeps
copies and drafts common while a wrong state still flips greedy tokens."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from ftserve.config import EngineConfig
from ftserve.engine.engine import Engine
from ftserve.engine.request import ReqState
from ftserve.engine.sampling_params import SamplingParams
from ftserve.engine.setup import build_engine
from ftserve.engine.spec import speculator as spec_mod
from ftserve.kvcache.pool import KVPool
from ftserve.kvcache.state_pool import StatePool
from ftserve.models.forward_batch import build_forward_batch
from ftserve_kernels.paged_attention import TorchAttentionBackend
from tests.engine_util import collect, greedy, make_context_sensitive, tokens_of
from tests.test_engine_hybrid import assert_baseline
from tests.test_spec_engine import counters, delta, same_outputs

GAIN = 3.0
PS = 4
VOCAB_HI = 1000


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from ftserve.models.checkpoint import write_checkpoint

    out = tmp_path_factory.mktemp("tiny-qwen3-next-spec")
    write_checkpoint("tiny-qwen3-next", out, config_only=True)  # ships one MTP layer
    return str(out)


@torch.no_grad()
def distill(model: torch.nn.Module, hidden_share: float = 0.0, seed: int = 0) -> None:
    """The MTP layer made a near identity: its attention and MoE outputs zeroed,
    fc passing the next token's embedding through (plus ``hidden_share`` of the
    hidden state), the final norm the model's: it drafts lm_head(norm(embedding))
    of the token before, what the model says when its layers add little."""
    mtp = model.mtp
    layer = mtp.layers[0]
    layer.self_attn.o_proj.weight.zero_()
    layer.mlp.w2.zero_()
    layer.mlp.shared_expert.down_proj.weight.zero_()
    mtp.norm.weight.copy_(model.norm.weight)
    mtp.pre_fc_norm_embedding.weight.zero_()  # zero-centered: a plain RMSNorm
    mtp.pre_fc_norm_hidden.weight.zero_()
    h = model.config.hidden_size
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(h, h, generator=gen) * hidden_share * h ** -0.5
    mtp.fc.weight.copy_(torch.cat([torch.eye(h), mixed], dim=1).to(mtp.fc.weight.dtype))


def make(model_dir: str, distilled: bool = True, **kw: Any) -> Engine:
    base: dict[str, Any] = dict(model=model_dir, load_format="dummy", device="cpu", dtype="float32",
                                page_size=PS, num_pages=512, max_prefill_length=24, max_running_requests=8,
                                state_checkpoint_pages=4, state_checkpoints=128, status_log_interval=0.0,
                                speculative_gate=False)  # the gate's timed windows would hold some steps' drafting off (test_spec_gate.py)
    base.update(kw)
    eng = build_engine(EngineConfig(**base))
    eng.check_integrity = True
    make_context_sensitive(eng.runner.model, GAIN)
    if distilled and getattr(eng.runner.model, "mtp", None) is not None:
        distill(eng.runner.model)
    return eng


@pytest.fixture(scope="module")
def plain(model_dir: str) -> Iterator[Engine]:
    eng = make(model_dir)
    yield eng
    eng.shutdown()


class StateLog:
    """After each verify step's commit: every request of the step that goes on
    decoding, with its tokens, computed_len and its slot's states (all linear
    layers), for ``check_states``."""

    def __init__(self, eng: Engine) -> None:
        self.seen: list[tuple[str, list[int], int, int, torch.Tensor, torch.Tensor]] = []
        sched, pool = eng.scheduler, eng.scheduler.state_pool
        assert pool is not None
        commit = sched.commit_verified

        def logged(batch: Any, sampled: Any, lps: Any = None) -> None:
            commit(batch, sampled, lps)
            for req in batch.reqs:
                if req.state is ReqState.DECODE and req in sched.running:
                    self.seen.append((req.request_id, list(req.tokens), req.prompt_len, req.computed_len,
                                      pool.conv[:, req.state_slot].clone(),
                                      pool.recurrent[:, req.state_slot].clone()))

        sched.commit_verified = logged  # type: ignore[method-assign]


@torch.inference_mode()
def plain_decode_states(eng: Engine, tokens: list[int], prompt_len: int,
                        upto: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """A plain run's states: the prompt in one prefill, then one decode forward
    per token; the (conv, recurrent) states after n tokens, n = prompt_len .. upto."""
    model, cfg = eng.runner.model, eng.model_config
    pages = list(range(1, upto // PS + 2))
    kv = KVPool(len(cfg.kv_layers) + 1, len(pages) + 1, PS, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    states = StatePool.for_model(cfg, 1, torch.float32)
    backend = TorchAttentionBackend()
    out = {}
    fb = build_forward_batch([tokens[:prompt_len]], [0], [pages], kv, backend, state_pool=states, state_slots=[1])
    model(fb)
    out[prompt_len] = (states.conv[:, 1].clone(), states.recurrent[:, 1].clone())
    for n in range(prompt_len, upto):
        fb = build_forward_batch([[tokens[n]]], [n], [pages], kv, backend, is_decode=True, state_pool=states,
                                 state_slots=[1])
        model(fb)
        out[n + 1] = (states.conv[:, 1].clone(), states.recurrent[:, 1].clone())
    return out


def check_states(eng: Engine, log: StateLog, start: int = 0) -> int:
    """Every slot logged since ``start`` holds plain decoding's state after its
    computed tokens (fp32: the chunked prefill and the token-by-token form sum in
    other orders). Returns how many were checked."""
    seen = log.seen[start:]
    longest: dict[str, tuple[list[int], int]] = {}
    for rid, tokens, prompt_len, _, _, _ in seen:
        if len(tokens) > len(longest.get(rid, ([], 0))[0]):
            longest[rid] = (tokens, prompt_len)
    refs = {rid: plain_decode_states(eng, toks, p, len(toks) - 1) for rid, (toks, p) in longest.items()}
    for rid, tokens, _, computed, conv, rec in seen:
        assert computed == len(tokens) - 1, (rid, computed, len(tokens))
        assert tokens == longest[rid][0][:len(tokens)]
        want_conv, want_rec = refs[rid][computed]
        torch.testing.assert_close(conv, want_conv, rtol=1e-4, atol=1e-4, msg=f"{rid} conv at {computed}")
        torch.testing.assert_close(rec, want_rec, rtol=1e-4, atol=1e-4, msg=f"{rid} state at {computed}")
    return len(seen)


@pytest.fixture(scope="module")
def ngram(model_dir: str) -> Iterator[tuple[Engine, StateLog]]:
    eng = make(model_dir, speculative="ngram", num_speculative_tokens=4)
    yield eng, StateLog(eng)
    eng.shutdown()


@pytest.fixture(scope="module")
def mtp(model_dir: str) -> Iterator[tuple[Engine, StateLog]]:
    eng = make(model_dir, speculative="mtp", num_speculative_tokens=3)
    assert eng.runner.mtp is not None
    yield eng, StateLog(eng)
    eng.shutdown()


def prompts(seed: int, n: int, lengths: tuple[int, int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, VOCAB_HI) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def echo_prompts(plain: Engine, seed: int, n: int, lengths: tuple[int, int] = (3, 40)) -> list[list[int]]:
    """X + C + X, C = the plain engine's output after X (n-gram drafts copy C)."""
    xs = prompts(seed, n, lengths)
    outs = collect(plain, [(f"x{i}", x, greedy(24)) for i, x in enumerate(xs)])
    return [x + tokens_of(outs[f"x{i}"]) + x for i, x in enumerate(xs)]


def assert_drafts_kept_and_rejected(eng: Engine, before: tuple) -> None:
    verifies, proposed, accepted, lengths = delta(counters(eng), before)
    assert sum(lengths) == verifies and 0 < accepted < proposed
    assert lengths[0] > 0 and lengths[-1] > 0 and sum(lengths[1:-1]) > 0, lengths


@pytest.mark.parametrize("kind", ["ngram", "mtp"])
def test_greedy_equals_plain_and_states_equal_plain_decoding(
        kind: str, plain: Engine, ngram: tuple[Engine, StateLog], mtp: tuple[Engine, StateLog]) -> None:
    """Eight concurrent requests (prompts up to ~100 tokens: several chunks, cut at
    checkpoints), then a second turn of each, resuming at the first turn's
    prompt-end checkpoint (usage reports plain decoding's cached tokens); every
    verify step leaves plain decoding's states."""
    eng, log = ngram if kind == "ngram" else mtp
    firsts = echo_prompts(plain, 0, 8) if kind == "ngram" else prompts(1, 8, (3, 90))
    before, start = counters(eng), len(log.seen)
    reqs = [(f"{kind}{i}", p, greedy(24)) for i, p in enumerate(firsts)]
    a = collect(plain, reqs)
    same_outputs(a, collect(eng, reqs))
    turn2 = [(f"{kind}t{i}", p + tokens_of(a[f"{kind}{i}"]) + p[:7], greedy(16)) for i, p in enumerate(firsts)]
    a2, b2 = collect(plain, turn2), collect(eng, turn2)
    same_outputs(a2, b2)
    for rid, _, _ in turn2:
        assert b2[rid][-1].cached_tokens == a2[rid][-1].cached_tokens > 0, rid
    assert_drafts_kept_and_rejected(eng, before)
    assert check_states(eng, log, start) > 20
    assert_baseline(plain)
    assert_baseline(eng)


@pytest.mark.parametrize("kind", ["ngram", "mtp"])
def test_seeded_sampling_same_tokens_and_logprobs(
        kind: str, plain: Engine, ngram: tuple[Engine, StateLog], mtp: tuple[Engine, StateLog]) -> None:
    """Temperature, top-k / top-p / min-p, logit_bias, seeded, with logprobs: each
    verify row draws what the plain step at its position draws, so the outputs
    (their distribution at any temperature included) are plain decoding's; a
    request with penalties decodes plainly in the same steps."""
    eng, log = ngram if kind == "ngram" else mtp
    kinds = [SamplingParams(max_tokens=16, temperature=0.6, seed=11, ignore_eos=True, logprobs=3),
             SamplingParams(max_tokens=16, temperature=1.0, top_k=40, top_p=0.9, seed=12, ignore_eos=True),
             SamplingParams(max_tokens=16, temperature=0.3, min_p=0.05, seed=13, ignore_eos=True,
                            logit_bias=((77, 3.0),), logprobs=0),
             SamplingParams(max_tokens=12, temperature=0.0, presence_penalty=0.5, ignore_eos=True)]
    ps = echo_prompts(plain, 2, 6, (3, 20)) if kind == "ngram" else prompts(3, 6, (3, 30))
    reqs = [(f"s{kind}{i}", p, kinds[i % len(kinds)]) for i, p in enumerate(ps)]
    before, start = counters(eng), len(log.seen)
    same_outputs(collect(plain, reqs), collect(eng, reqs), logprobs=True)
    verifies, _, accepted, _ = delta(counters(eng), before)
    assert verifies > 0 and accepted > 0
    assert check_states(eng, log, start) > 0
    assert_baseline(eng)


@pytest.mark.parametrize("kind", ["ngram", "mtp"])
def test_preemption_and_no_overlap(kind: str, model_dir: str, plain: Engine,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool too small for four growing requests: decode steps preempt the
    youngest, which resumes from its deepest checkpoint (saved in its prefill:
    never at a verify step's positions) and recomputes the rest; drafting at
    every step (no back-off), with and without overlap scheduling."""
    monkeypatch.setattr(spec_mod, "MAX_BACKOFF", 1)
    ps = echo_prompts(plain, 4, 4, (6, 10)) if kind == "ngram" else prompts(5, 4, (20, 30))
    reqs = [(f"p{kind}{i}", p, greedy(24)) for i, p in enumerate(ps)]
    ref = collect(plain, reqs)
    for overlap in (True, False):
        eng = make(model_dir, num_pages=41, max_running_requests=4, max_prefill_length=32,
                   speculative=kind, num_speculative_tokens=3, overlap_schedule=overlap)
        log = StateLog(eng)
        try:
            same_outputs(ref, collect(eng, reqs))
            st = eng.stats()
            assert st.preemptions_total > 0 and st.spec_accepted_tokens_total > 0
            assert check_states(eng, log) > 0
            assert_baseline(eng)
        finally:
            eng.shutdown()


def test_mtp_head_that_never_agrees_backs_off(model_dir: str, plain: Engine) -> None:
    """Random MTP weights on the hybrid: nothing is kept, each request verifies
    4 times in 32 outputs (at 1, 4, 9 and 18: back-off), its steps in between plain
    rows of eager steps that keep the MTP KV; the outputs are plain decoding's
    and every verify step (those after 4 and 8 plain tokens too) leaves the
    state plain decoding has."""
    eng = make(model_dir, distilled=False, speculative="mtp", num_speculative_tokens=3)
    log = StateLog(eng)
    try:
        reqs = [(f"nb{i}", p, greedy(32)) for i, p in enumerate(prompts(6, 4, (5, 40)))]
        same_outputs(collect(plain, reqs), collect(eng, reqs))
        verifies, _, accepted, _ = counters(eng)
        assert accepted == 0 and verifies == 4 * 4
        assert check_states(eng, log) >= 16  # (plain rows of the verify steps too)
        assert_baseline(eng)
    finally:
        eng.shutdown()


def test_a_missing_state_commit_would_show(model_dir: str, plain: Engine,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks above can fail: a commit that moves each slot on by every
    input of the step, kept or not, breaks the state check (and the tokens)."""
    from ftserve.engine.spec import accept

    real = accept.kept_counts
    monkeypatch.setattr(accept, "kept_counts",
                        lambda ids, sampled, idx: torch.full_like(real(ids, sampled, idx), idx.shape[1] + 1))
    eng = make(model_dir, speculative="ngram", num_speculative_tokens=4)
    log = StateLog(eng)
    try:
        ps = echo_prompts(plain, 0, 8)
        collect(eng, [(f"m{i}", p, greedy(24)) for i, p in enumerate(ps)])
        assert eng.stats().spec_accept_lengths[-1] < eng.stats().spec_verifies_total  # some rejected
        with pytest.raises(AssertionError, match="state at|conv at"):
            check_states(eng, log)
    finally:
        eng.shutdown()


def test_start_up_sizes_the_verify_log(model_dir: str, ngram: tuple[Engine, StateLog]) -> None:
    """The state pool holds a log for the largest verify step (every running
    request with a full draft) and the memory plan counts it; without
    --speculative there is none."""
    eng, _ = ngram
    pool = eng.scheduler.state_pool
    assert pool is not None and pool.verify_log is not None
    assert pool.verify_log.tokens == 8 * (4 + 1) == eng.summary["state_verify_tokens"]
    assert eng.summary["state_gib"] * 2**30 == pool.nbytes > pool.conv.nbytes + pool.recurrent.nbytes
    assert pool.num_slots == 8 + 128
    assert eng.runner.verify_graphs is None  # CPU: no graphs (the graph tests run their static forward)
    off = make(model_dir)
    try:
        assert off.scheduler.state_pool is not None and off.scheduler.state_pool.verify_log is None
    finally:
        off.shutdown()


@pytest.mark.parametrize("kind", ["ngram", "mtp"])
def test_sampled_tokens_keep_the_distribution(kind: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Temperature 1 on an 8-token vocabulary (a linear and an attention layer),
    640 seeds, max_tokens 3: the first verify step feeds the drafts after the
    prefill's token; the third output token (sampled at the first draft
    position when the step kept it, else by the next step, from the state the
    commit left) is distributed as the model's own marginal, computed exactly."""
    from ftserve.models.checkpoint import write_checkpoint
    from tests.test_spec_accept import chi2_p

    monkeypatch.setattr(spec_mod, "MAX_BACKOFF", 1)
    v = 8
    write_checkpoint("tiny-qwen3-next", tmp_path, layers=2, config_only=True, overrides={"vocab_size": v})
    extra = dict(ngram_min_match=1) if kind == "ngram" else {}
    eng = make(str(tmp_path), speculative=kind, num_speculative_tokens=3, max_running_requests=32, **extra)
    try:
        model = eng.runner.model
        # The mixers' outputs 15x (the state shows in the distributions: a commit of
        # every input instead of the kept ones brings p near 1e-3 here) and peaked,
        # context-dependent distributions.
        make_context_sensitive(model, 5.0)
        with torch.no_grad():
            model.lm_head_weight().mul_(12.0)
        prompt = [3, 5, 1, 6, 7, 4, 0, 2]  # every token once: an n-gram draft for any next one
        n = 640
        reqs = [(f"c{s}", prompt, SamplingParams(max_tokens=3, temperature=1.0, seed=s, ignore_eos=True))
                for s in range(n)]
        outs = collect(eng, reqs)
        third = torch.tensor([tokens_of(outs[f"c{s}"])[2] for s in range(n)])
        c = eng.scheduler.spec.counters  # type: ignore[union-attr]
        assert 0 < c.accepted_tokens_total < c.proposed_tokens_total
        cfg = eng.model_config

        @torch.inference_mode()
        def probs(ctx: list[int]) -> torch.Tensor:
            kv = KVPool(len(cfg.kv_layers) + 1, 4, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
            states = StatePool.for_model(cfg, 1, torch.float32)
            fb = build_forward_batch([ctx], [0], [[1]], kv, TorchAttentionBackend(), state_pool=states,
                                     state_slots=[1])
            return torch.softmax(model(fb)[0].double(), dim=-1)

        p1 = probs(prompt)
        p2 = [probs(prompt + [y1]) for y1 in range(v)]
        marginal = torch.zeros(v, dtype=torch.float64)
        second = torch.zeros(v, dtype=torch.float64)
        for y1 in range(v):
            second += p1[y1] * p2[y1]
            for y2 in range(v):
                marginal += p1[y1] * p2[y1][y2] * probs(prompt + [y1, y2])
        counts = torch.bincount(third, minlength=v)
        assert chi2_p(counts, marginal) > 1e-3
        assert chi2_p(counts, second) < 1e-6  # the test tells distributions apart
    finally:
        eng.shutdown()


# ----- CUDA graphs (prefill_graph.py) on the CPU: each replay runs the graph's
# static, padded forward over its static buffers (what CUDA captures per
# bucket), the linear layers in their graph form (no host bounds: each
# sequence's length from qo_indptr within a static bound, slots by a static
# index field); the state work outside the replay is the runner's own.


class StaticReplay:
    """Builds PrefillGraphs whose replay runs ``_forward`` eagerly, counted."""

    @staticmethod
    def graphs(runner: Any, *args: Any, **kw: Any) -> Any:
        from ftserve.engine.prefill_graph import PrefillGraphs

        class Static(PrefillGraphs):
            replays = 0

            def _run(self, bucket: int) -> torch.Tensor:
                self.replays += 1
                return self._forward(bucket)

        return Static(runner, *args, **kw)


def with_static_graphs(eng: Engine, k: int, seqs: int = 8) -> None:
    """The prefill and verify graphs setup captures on CUDA (max_prefill_length
    24: one bucket), replayed as static forwards."""
    from ftserve.engine.prefill_graph import verify_buckets

    r = eng.runner
    r.prefill_graphs = StaticReplay.graphs(r, 24, seqs)
    r.verify_graphs = StaticReplay.graphs(r, 0, seqs, buckets=verify_buckets(seqs, k), all_rows=True,
                                          seq_tokens=k + 1)


def test_verify_graph_static_forward_and_commit_equal_eager(model_dir: str) -> None:
    """A verify graph's static forward (two drafted requests, a plain row, padding
    tokens and two empty sequences on the sink slot) gives the eager verify
    step's logits at every sampled row, and the commit after it, over the
    graph's static inputs, slots and the log its forward wrote, leaves every
    state slot as the eager step's commit does (kept counts 3, 1 and 1)."""
    from ftserve.engine.prefill_graph import verify_buckets
    from ftserve.engine.request import Req

    eng = make(model_dir, speculative="ngram", num_speculative_tokens=3, max_running_requests=4)
    try:
        sched, runner, pool = eng.scheduler, eng.runner, eng.scheduler.state_pool
        assert pool is not None
        graphs = StaticReplay.graphs(runner, 0, 4, buckets=verify_buckets(4, 3), all_rows=True, seq_tokens=4)
        assert graphs.hybrid and graphs.buckets == [4, 8, 16]
        prompts_ = {"a": [5, 6, 7, 8, 9, 5, 6], "b": [11, 12, 13, 14, 11, 12], "c": [20, 21, 22]}
        firsts = {"a": 7, "b": 13, "c": 23}
        for rid, p in prompts_.items():
            sched.add(Req(rid, p, greedy(10), 0.0))
        batch = sched.schedule()
        while batch is not None and not batch.verifies:  # the prompts (cut at checkpoints), c's decode
            with torch.inference_mode():
                runner.launch(batch)
            sched.commit(batch, [24 if batch.is_decode else firsts[r.request_id] for r in batch.reqs])
            batch = sched.schedule()
        assert batch is not None and batch.verifies and graphs.can_run(batch)
        assert batch.drafts == [[8, 9, 5], [14, 11, 12], []]
        runner.prepare_slots(batch.reqs)
        # Sampled rows: a keeps 2 drafts (then y_2 differs), b none, c its one token.
        sampled = torch.tensor([8, 9, 1, 2, 3, 4, 5, 6, 7])
        saved = pool.conv.clone(), pool.recurrent.clone()
        with torch.inference_mode():
            bucket = graphs._bucket(batch.num_tokens)
            graphs._fill(batch, bucket)
            static = graphs._run(bucket)[:9]  # 4 + 4 + 1 rows
            fb_static = graphs.static_batch(batch)
            assert fb_static.state_verify and fb_static.graph_seq_bound == 4
            assert fb_static.state_slots.tolist() == [r.state_slot for r in batch.reqs] + [0]
            runner._commit_states(batch, fb_static, sampled)
            graph_states = pool.conv.clone(), pool.recurrent.clone()
            pool.conv.copy_(saved[0])
            pool.recurrent.copy_(saved[1])
            fb, _, _, _ = runner.build(batch)
            eager = runner.model(fb)  # [9, V]
            runner._commit_states(batch, fb, sampled)
        torch.testing.assert_close(static, eager, rtol=1e-4, atol=1e-4)
        for a, b in zip(graph_states, (pool.conv, pool.recurrent)):
            torch.testing.assert_close(a[:, 1:], b[:, 1:], rtol=1e-5, atol=1e-5)  # the sink: garbage
        for i, req in enumerate(batch.reqs):  # the commit moved each slot (not a no-op)
            assert not torch.equal(pool.recurrent[:, req.state_slot], saved[1][:, req.state_slot]), i
    finally:
        eng.shutdown()


@pytest.mark.parametrize("kind", ["ngram", "mtp"])
def test_graph_replays_equal_plain_decoding(kind: str, model_dir: str, plain: Engine) -> None:
    """Prefill chunks (cut at state checkpoints) and verify steps replayed as
    graphs (their static forwards) give plain decoding's tokens, across a second
    turn resuming at a checkpoint (loaded before the replay, saved after
    another), and every verify step's commit leaves plain decoding's states;
    both kinds took the graphs (a verify step with a plain row fed from the
    in-flight step runs eagerly: PrefillGraphs.can_run)."""
    k = 4 if kind == "ngram" else 3
    eng = make(model_dir, speculative=kind, num_speculative_tokens=k)
    log = StateLog(eng)
    with_static_graphs(eng, k)
    try:
        firsts = echo_prompts(plain, 0, 3, (3, 24)) if kind == "ngram" else prompts(1, 3, (3, 30))
        reqs = [(f"g{kind}{i}", p, greedy(16)) for i, p in enumerate(firsts)]
        before = counters(eng)
        a = collect(plain, reqs)
        same_outputs(a, collect(eng, reqs))
        turn2 = [(f"g{kind}t{i}", p + tokens_of(a[f"g{kind}{i}"]) + p[:5], greedy(8))
                 for i, p in enumerate(firsts)]
        a2, b2 = collect(plain, turn2), collect(eng, turn2)
        same_outputs(a2, b2)
        for rid, _, _ in turn2:
            assert b2[rid][-1].cached_tokens == a2[rid][-1].cached_tokens > 0, rid
        verifies, _, accepted, _ = delta(counters(eng), before)
        assert verifies > 0 and accepted > 0
        r = eng.runner
        assert 0 < r.verify_graphs.replays <= verifies  # type: ignore[union-attr]
        assert r.prefill_graphs.replays > 0  # type: ignore[union-attr]
        assert eng.scheduler.counters.state_checkpoints_saved_total > 0
        assert check_states(eng, log) > 5
        assert_baseline(eng)
    finally:
        eng.shutdown()
