"""The CUDA-graph prefill layout, checked on the CPU: the static, padded
forward (what the graph captures) must give the eager forward's logits for
the real sequences, whatever the padding. Capture itself is a `gpu` test."""

from __future__ import annotations

import random

import pytest
import torch

from ftserve.config import EngineConfig
from ftserve.engine.prefill_graph import PrefillGraphs, prefill_buckets, verify_buckets
from ftserve.engine.request import Req
from ftserve.engine.sampling_params import SamplingParams
from ftserve.engine.setup import build_engine
from tests.engine_util import make_context_sensitive


def test_buckets_cover_the_chunk() -> None:
    assert prefill_buckets(4096) == [256, 512, 1024, 2048, 4096]
    assert prefill_buckets(3000) == [256, 512, 1024, 2048, 3000]
    assert prefill_buckets(64) == [64]


def test_verify_buckets_start_at_one_full_draft() -> None:
    """Batch 1's verify step has a graph of its exact width: at <= GEMV_MAX_ROWS
    rows its linears take the decode GEMVs (ops.dense_folds_norm), which an
    8-row bucket's padding would turn away."""
    from ftserve_kernels.gemv_triton import GEMV_MAX_ROWS

    assert verify_buckets(16, 3) == [4, 8, 16, 32, 64]
    assert verify_buckets(16, 4) == [5, 8, 16, 32, 64, 80]
    assert verify_buckets(1, 3) == [4]
    assert verify_buckets(16, 7) == [8, 16, 32, 64, 128]
    assert verify_buckets(2, 1) == [2, 4]
    assert verify_buckets(16, 3)[0] <= GEMV_MAX_ROWS


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from ftserve.models.checkpoint import write_checkpoint

    out = tmp_path_factory.mktemp("tiny-moe-pg")
    write_checkpoint("tiny-moe", out, config_only=True)
    eng = build_engine(EngineConfig(model=str(out), load_format="dummy", device="cpu",
                                    dtype="float32", page_size=4, num_pages=128,
                                    max_prefill_length=48, max_running_requests=4,
                                    status_log_interval=0.0))
    make_context_sensitive(eng.runner.model)  # else logits barely see the cached prefix
    yield eng
    eng.shutdown()


@torch.inference_mode()
def test_padded_static_forward_equals_eager(engine, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """... and tells the MoE layers how many rows are real (ForwardBatch.valid_tokens,
    the grouped GEMMs skip the padding's pairs on Triton); eager steps have no padding."""
    from ftserve_kernels import ops

    seen: list[int | None] = []
    real_moe = ops.fused_moe

    def recording(*args, valid_rows=None, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(None if valid_rows is None else int(valid_rows.item()))
        return real_moe(*args, valid_rows=valid_rows, **kwargs)

    monkeypatch.setattr(ops, "fused_moe", recording)
    sched, runner = engine.scheduler, engine.runner
    rng = random.Random(0)
    # Two requests, the first long enough to need a second chunk over its prefix.
    prompts = [[rng.randrange(10, 32000) for _ in range(n)] for n in (40, 9)]
    for i, p in enumerate(prompts):
        sched.add(Req(f"pg{i}", p, SamplingParams(max_tokens=2, temperature=0.0), 0.0))
    graphs = PrefillGraphs(runner, 48, 4)
    checked = padded = 0
    for _ in range(6):
        batch = sched.schedule()
        assert batch is not None
        if batch.is_decode:  # interleaved decode steps are not the subject here
            sched.commit(batch, [5] * len(batch.reqs))
            continue
        assert graphs.can_run(batch)
        runner.prepare_slots(batch.reqs)
        # The graph's static forward, eagerly, on padded inputs ...
        bucket = graphs._bucket(batch.num_tokens)
        graphs._fill(batch, bucket)
        seen.clear()
        static = graphs._forward(bucket)[: len(batch.reqs)]
        assert seen == [batch.num_tokens] * len(runner.model.layers)
        padded += bucket > batch.num_tokens
        # ... then the eager forward of the same step rewrites the same KV.
        fb, _, _, _ = runner.build(batch)
        fb.logits_indices = torch.tensor(
            [sum(len(t) for t in batch.new_tokens[: i + 1]) - 1 for i in range(len(batch.reqs))])
        seen.clear()
        eager = runner.model(fb)
        assert seen and all(v is None for v in seen)
        torch.testing.assert_close(static, eager, rtol=1e-4, atol=1e-4)
        sched.commit(batch, [5] * len(batch.reqs))
        checked += 1
        if not any(r.state.value == "prefill" for r in sched.running) and not sched.waiting:
            break
    assert checked >= 2 and padded  # a packed two-request chunk, then a chunk over a cached prefix
    for r in list(sched.running):
        sched.finish(r, "abort")
    sched.finished_reqs.clear()


def test_runner_prefill_graph_path_keeps_first_token_logprobs(engine) -> None:  # type: ignore[no-untyped-def]
    """The runner's prefill-graph path (the static forward run in place of a
    replay) samples a request's first token with the stages its own parameters
    ask for: admitted before they are read, so logprobs asked for come back for
    every token, the first included, as on the eager path."""
    from ftserve.engine.driver import EngineDriver

    class Static(PrefillGraphs):
        replays = 0

        def _run(self, bucket: int) -> torch.Tensor:
            Static.replays += 1
            return self._forward(bucket)

    def run() -> list[tuple[list[int], list[int]]]:
        drv = EngineDriver(engine)
        rng = random.Random(3)
        reqs = [drv.add([rng.randrange(10, 32000) for _ in range(n)], 6,
                        SamplingParams(temperature=0.0, logprobs=k))
                for n, k in ((12, 3), (30, 0), (7, 5))]
        drv.run_all()
        assert engine.scheduler.reset_prefix_cache()
        return [(list(r.output_ids), [lp.token_id for lp in r.pending_logprobs]) for r in reqs]

    runner = engine.runner
    runner.prefill_graphs = Static(runner, 48, 4)  # first: the slots' last owners asked for no logprobs
    try:
        graphed = run()
    finally:
        runner.prefill_graphs = None
    eager = run()
    assert Static.replays > 0
    assert all(ids == lps and len(ids) == 6 for ids, lps in graphed), graphed
    assert graphed == eager
