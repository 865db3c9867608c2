"""Speculative decoding on CUDA (bf16, Triton attention, decode, prefill and verify
graphs on): verify steps make no hidden device->host sync and exactly one deliberate read-back,
plain steps of requests in back-off keep overlap, and greedy outputs equal plain
decoding's up to bf16 near-ties. Driven step by step (tools.bench.engine_driver), as
test_gpu_engine.py.

Why not token for token: a verify step scores its k + 1 positions with the
prefill/extend kernels (GEMMs, extend attention, the unfused router), plain
decoding with the decode ones (GEMVs, decode attention, the fused router); in
bf16 they round differently, so where the random model's top two tokens are
near-tied the greedy tokens can differ and the rows part. (In fp32 on the CPU,
tests/test_spec_engine.py, they are equal token for token.) The comparison,
engine_util.assert_greedy_equal_up_to_ties, tells such a tie from a bug by the
same weights in fp32: both paths must be about as close to it, and a row may
part only where the two tokens are tied within that measured error.

The step-by-step runs end with the driver flushed (run_logged): with overlap the
step after a request's last plain step is launched before that step is read
back, so it is still in flight when every request shows finished; flushed, it
is committed and logged like every other launched step."""

from __future__ import annotations

import random
from typing import Any

import pytest

from ftserve.engine.engine import Engine
from ftserve.engine.runner import Launched
from tests.engine_util import (
    assert_greedy_equal_up_to_ties,
    make_context_sensitive,
    reference_logprobs,
    run_greedy_logprobs,
)
from tests.test_gpu_engine import CheckedDriver, cpu_twin, make_engine, model_dir, run_greedy  # noqa: F401

ROWS = 8  # requests compared (max_running_requests): near-ties part at most half of them


def echo_prompts(engine: Engine, seed: int, n: int) -> list[list[int]]:
    """n prompts X + C + X, C the engine's greedy output after X (test_spec_engine),
    led by those after which plain decoding repeats C[:2].

    An n-gram draft needs the request's last two tokens earlier in its context:
    after X + C + X, X's last token and C[0]. So a request drafts (C[1:]) only
    where its first output is C[0] again, and keeps a draft token only where its
    second is C[1]: on this model about 2 candidates in 5 and 1 in 5 (CPU, fp32).
    Left to chance, 8 prompts made as few as 2 verify steps and kept no draft
    token (1 seed in 12), and the 3 prompts of the step-by-step runs could make
    no verify step at all. So 6n candidates are ranked by how far the engine's
    own greedy decoding repeats C after them (at least 3 must repeat C[:2]).
    The prefix cache is cleared after, so the comparison's plain run prefills
    each prompt whole, as the speculative engine does: otherwise the plain
    engine's KV of C would come from its decode steps, the other's from a
    prefill, a second bf16 difference beside the verify steps'."""
    rng = random.Random(seed)
    xs = [[rng.randrange(100, 32000) for _ in range(rng.randint(10, 40))] for _ in range(6 * n)]
    cs = run_greedy(engine, xs, 24)
    assert engine.scheduler.reset_prefix_cache()
    cands = [x + c + x for x, c in zip(xs, cs)]
    heads = run_greedy(engine, cands, 2)
    assert engine.scheduler.reset_prefix_cache()
    depth = [2 if h == c[:2] else int(h[0] == c[0]) for h, c in zip(heads, cs)]
    assert depth.count(2) >= 3, f"too few prompts the model echoes: {depth}"
    order = sorted(range(len(cands)), key=lambda i: -depth[i])  # stable: seed order within a depth
    return [cands[i] for i in order[:n]]


def equal_plain_up_to_ties(plain: Engine, spec: Engine, prompts: list[list[int]]) -> None:
    """Greedy outputs with top-5 logprobs, spec against plain, checked against the
    plain model's weights in fp32 on the CPU (module docstring)."""
    want = run_greedy_logprobs(plain, prompts, 24)
    got = run_greedy_logprobs(spec, prompts, 24)
    model, mcfg = cpu_twin(plain), plain.model_config
    summary = assert_greedy_equal_up_to_ties(
        prompts, want, got, lambda p, out: reference_logprobs(model, mcfg, p, out),
        min_equal_rows=ROWS // 2)
    print(summary)


class VerifyLog(CheckedDriver):
    def finish(self, launched: Launched) -> None:
        super().finish(launched)
        if launched.batch.verifies:
            kind, bs, n = self.log[-1]
            self.log[-1] = ("verify", bs, n)


def run_logged(engine: Engine, prompts: list[list[int]], max_tokens: int, check: bool) -> VerifyLog:
    """Greedy requests for ``prompts`` stepped to the end as the engine thread steps
    them (VerifyLog: under sync errors when ``check``), every launched step in the
    log. A plain step (a request in back-off) overlaps the next, which is planned
    from its device-side tokens: the step after a request's last token is launched
    before that token is read back, and is still in flight when every request shows
    finished. The flush commits it (its rows of finished requests are dropped), so
    it is logged like the rest and every graph replay counted is a logged step."""
    drv = VerifyLog(engine, seed=1, check=check)
    reqs = [drv.add(p, max_tokens) for p in prompts]
    drv.until(lambda: all(r.finished for r in reqs))
    drv.flush()
    return drv


@pytest.mark.gpu
def test_verify_steps_sync_free_and_equal_plain(model_dir: str) -> None:  # noqa: F811
    plain = make_engine(model_dir)
    spec = make_engine(model_dir, speculative="ngram", num_speculative_tokens=4)
    try:
        make_context_sensitive(plain.runner.model, 8.0)
        spec.runner.model.load_state_dict(plain.runner.model.state_dict())
        if hasattr(spec.runner.model, "refresh_derived"):
            spec.runner.model.refresh_derived()
        assert spec.runner.verify_graphs is not None  # verify steps replay captured widths
        prompts = echo_prompts(plain, 0, ROWS)
        equal_plain_up_to_ties(plain, spec, prompts)
        assert spec.scheduler.spec is not None and spec.scheduler.spec.counters.accepted_tokens_total > 0
        for check in (False, True):  # the first run compiles every shape
            drv = run_logged(spec, prompts[:3], 16, check)
        kinds = {k for k, _, _ in drv.log}
        assert "verify" in kinds, kinds
        for kind, bs, n in drv.log:
            assert n == (0 if kind == "prefill_chunk" else 1), (kind, bs, n)
    finally:
        plain.shutdown()
        spec.shutdown()


@pytest.mark.gpu
def test_dense_batch1_verify_replays_its_exact_width(tmp_path_factory: pytest.TempPathFactory) -> None:
    """SmolLM2's layer shapes (two layers, dummy bf16) with 3 drafts, one request
    at a time: every verify step replays the 4-token graph (verify_buckets: no
    padding rows), whose dense linears take the decode GEMVs and their folds (the
    norms left pending, SiLU * up in the epilogue); greedy outputs equal plain
    decoding's up to bf16 near-ties."""
    from ftserve.models.checkpoint import write_config

    d = write_config("smollm2-135m", tmp_path_factory.mktemp("gpu-spec-dense"), layers=2,
                     max_position_embeddings=8192)
    plain = make_engine(d)
    spec = make_engine(d, speculative="ngram", num_speculative_tokens=3, max_running_requests=1)
    try:
        make_context_sensitive(plain.runner.model, 8.0)
        spec.runner.model.load_state_dict(plain.runner.model.state_dict())
        vg = spec.runner.verify_graphs
        assert vg is not None and vg.buckets == [4]
        widths: list[int] = []
        replay = vg._run

        def run(bucket: int) -> Any:
            widths.append(bucket)
            return replay(bucket)

        vg._run = run  # type: ignore[method-assign]
        # Random prompts: this random model repeats its tokens, so the n-gram index
        # drafts from its own output (it echoes no X + C + X prompt: echo_prompts).
        rng = random.Random(5)
        prompts = [[rng.randrange(100, 32000) for _ in range(rng.randint(10, 40))] for _ in range(ROWS)]
        equal_plain_up_to_ties(plain, spec, prompts)
        assert spec.scheduler.spec is not None and spec.scheduler.spec.counters.accepted_tokens_total > 0
        assert widths and set(widths) == {4}, widths
    finally:
        plain.shutdown()
        spec.shutdown()


def count_replays(engine: Engine) -> dict[str, int]:
    """Count the runner's graph replays by kind (decode, prefill, verify) and
    the steps it built eagerly (eager_decode, eager_verify), from now on."""
    r = engine.runner
    counts = {"decode": 0, "prefill": 0, "verify": 0, "eager_decode": 0, "eager_verify": 0}

    def counted(kind: str, fn: Any) -> Any:
        def run(*a: Any, **kw: Any) -> Any:
            counts[kind] += 1
            return fn(*a, **kw)
        return run

    assert r.graphs is not None and r.prefill_graphs is not None and r.verify_graphs is not None
    r.graphs._run = counted("decode", r.graphs._run)  # type: ignore[method-assign]
    r.prefill_graphs._run = counted("prefill", r.prefill_graphs._run)  # type: ignore[method-assign]
    r.verify_graphs._run = counted("verify", r.verify_graphs._run)  # type: ignore[method-assign]
    build = r.build

    def built(batch: Any, *a: Any, **kw: Any) -> Any:
        if batch.is_decode:
            counts["eager_decode"] += 1
        elif batch.verifies:
            counts["eager_verify"] += 1
        return build(batch, *a, **kw)

    r.build = built  # type: ignore[method-assign]
    return counts


@pytest.mark.gpu
def test_mtp_steps_sync_free_and_equal_plain(tmp_path_factory: pytest.TempPathFactory) -> None:
    """--speculative mtp on CUDA (bf16, Triton): the draft chain, the verify
    forward (a verify graph replay) and the MTP layer's pass make no hidden
    sync and one read-back per step (tokens and drafts together); decode steps
    replay the decode graphs (the MTP pass inside); greedy outputs equal plain
    decoding's."""
    from ftserve.models.checkpoint import write_config
    from tests.test_gpu_engine import SCALE
    from tests.test_spec_mtp import distill

    d = write_config("tiny-moe", tmp_path_factory.mktemp("gpu-mtp"), layers=1,
                     num_nextn_predict_layers=1, **SCALE)
    plain = make_engine(d)
    spec = make_engine(d, speculative="mtp", num_speculative_tokens=3)
    try:
        make_context_sensitive(plain.runner.model, 8.0)
        spec.runner.model.load_state_dict(plain.runner.model.state_dict(), strict=False)
        distill(spec.runner.model)
        assert spec.runner.mtp is not None and spec.runner.verify_graphs is not None
        assert spec.runner.graphs is not None and spec.runner.graphs.with_mtp
        rng = random.Random(3)
        prompts = [[rng.randrange(100, 32000) for _ in range(rng.randint(10, 300))] for _ in range(ROWS)]
        equal_plain_up_to_ties(plain, spec, prompts)
        assert spec.scheduler.spec is not None and spec.scheduler.spec.counters.accepted_tokens_total > 0
        for check in (False, True):  # the first run compiles every shape
            counts = count_replays(spec)
            drv = run_logged(spec, prompts[:3], 16, check)
        kinds = [k for k, _, _ in drv.log]
        assert "verify" in kinds, kinds
        for kind, bs, n in drv.log:
            assert n == (0 if kind == "prefill_chunk" else 1), (kind, bs, n)
        # MTP steps replay graphs: every decode step, and the verify steps
        # (a verify step beside a prefill chunk wider than the verify widths
        # may still run eagerly).
        print("replays", counts, "steps", {k: kinds.count(k) for k in set(kinds)})
        assert counts["eager_decode"] == 0 and counts["decode"] == kinds.count("decode"), counts
        assert counts["verify"] > 0 and counts["verify"] + counts["eager_verify"] == kinds.count("verify"), counts
    finally:
        plain.shutdown()
        spec.shutdown()


@pytest.mark.gpu
def test_mtp_random_head_backs_off_sync_free(tmp_path_factory: pytest.TempPathFactory) -> None:
    """--speculative mtp with the MTP layer's random weights (its drafts are
    rejected): requests back off, verifying a few times per request instead of
    at every step; their plain steps (decode graph replays, the MTP pass
    inside keeping the MTP KV, overlapped) make no hidden sync and one read-back each, the verify steps too; greedy
    outputs equal plain decoding's up to bf16 near-ties."""
    from ftserve.models.checkpoint import write_config
    from tests.test_gpu_engine import SCALE

    d = write_config("tiny-moe", tmp_path_factory.mktemp("gpu-mtp-random"), layers=1,
                     num_nextn_predict_layers=1, **SCALE)
    plain = make_engine(d)
    spec = make_engine(d, speculative="mtp", num_speculative_tokens=3)
    try:
        make_context_sensitive(plain.runner.model, 8.0)
        spec.runner.model.load_state_dict(plain.runner.model.state_dict(), strict=False)  # MTP: random
        assert spec.runner.mtp is not None and spec.scheduler.spec is not None
        rng = random.Random(4)
        prompts = [[rng.randrange(100, 32000) for _ in range(rng.randint(10, 300))] for _ in range(ROWS)]
        equal_plain_up_to_ties(plain, spec, prompts)
        c = spec.scheduler.spec.counters
        # 24 tokens: a request that keeps nothing verifies at outputs 1, 4, 9 and 18.
        assert 0 < c.verifies_total <= ROWS * 6 and c.accepted_tokens_total * 10 <= c.proposed_tokens_total
        for check in (False, True):  # the first run compiles every shape
            counts = count_replays(spec)
            drv = run_logged(spec, prompts[:3], 24, check)
        kinds = [k for k, _, _ in drv.log]
        assert "verify" in kinds and kinds.count("decode") > 2 * kinds.count("verify"), kinds
        for kind, bs, n in drv.log:
            assert n == (0 if kind == "prefill_chunk" else 1), (kind, bs, n)
        # The plain steps of requests in back-off replay the decode graphs (the
        # MTP pass inside them), with no hidden sync (checked above).
        print("replays", counts, "steps", {k: kinds.count(k) for k in set(kinds)})
        assert counts["eager_decode"] == 0 and counts["decode"] == kinds.count("decode"), counts
        assert counts["verify"] > 0, counts
    finally:
        plain.shutdown()
        spec.shutdown()
