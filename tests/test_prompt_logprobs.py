"""Prompt logprobs in the engine (SamplingParams.prompt_logprobs,
engine/prompt_logprobs.py) on the CPU (float32), against one full forward of
the prompt: every prompt token's logprob, rank and alternatives, over chunks
cut to PROMPT_LOGPROBS_CHUNK, next to ordinary requests, past a cached prefix
(which such a request does not use), and through a preemption."""

from __future__ import annotations

import random

import pytest
import torch

from ftserve.config import EngineConfig
from ftserve.engine.engine import Engine
from ftserve.engine.messages import RequestOutput
from ftserve.engine.sampling_params import SamplingParams, SamplingParamsError
from ftserve.engine.scheduler import PROMPT_LOGPROBS_CHUNK
from ftserve.engine.setup import build_engine
from ftserve.kvcache.pool import KVPool
from ftserve.models.forward_batch import build_forward_batch
from ftserve_kernels.paged_attention import TorchAttentionBackend
from tests.engine_util import collect, greedy, make_context_sensitive, reference_greedy, tokens_of


def make_engine(tmp_path_factory: pytest.TempPathFactory, num_pages: int, max_prefill_length: int) -> Engine:
    from ftserve.models.checkpoint import write_checkpoint

    out = tmp_path_factory.mktemp("tiny-moe")
    write_checkpoint("tiny-moe", out, config_only=True)
    eng = build_engine(EngineConfig(model=str(out), load_format="dummy", device="cpu", dtype="float32",
                                    page_size=4, num_pages=num_pages, max_prefill_length=max_prefill_length,
                                    max_running_requests=4, status_log_interval=0.0))
    eng.check_integrity = True
    make_context_sensitive(eng.runner.model)
    return eng


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    eng = make_engine(tmp_path_factory, num_pages=512, max_prefill_length=300)
    yield eng
    eng.shutdown()


@torch.inference_mode()
def reference(engine: Engine, prompt: list[int]) -> torch.Tensor:
    """log_softmax of one full forward of the prompt: [len, V]; row p predicts p + 1."""
    cfg = engine.model_config
    ps = 16
    n_pages = (len(prompt) + ps - 1) // ps
    pool = KVPool(cfg.num_layers, n_pages + 1, ps, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    fb = build_forward_batch([prompt], [0], [list(range(1, n_pages + 1))], pool, TorchAttentionBackend(),
                             all_logits=True)
    return torch.log_softmax(engine.runner.model(fb).float(), dim=-1)


def check(engine: Engine, outs: list[RequestOutput], prompt: list[int], k: int) -> None:
    firsts = [o for o in outs if o.prompt_logprobs is not None]
    assert len(firsts) == 1 and firsts[0] is outs[0], "only the first output carries them"
    got = firsts[0].prompt_logprobs
    assert got is not None and len(got) == len(prompt) and got[0] is None
    ref = reference(engine, prompt)
    for p in range(1, len(prompt)):
        item = got[p]
        assert item is not None and item.token_id == prompt[p]
        want = float(ref[p - 1, prompt[p]])
        assert abs(item.logprob - want) < 1e-4, (p, item.logprob, want)
        assert item.rank == int((ref[p - 1] > ref[p - 1, prompt[p]] + 1e-6).sum()) + 1 or \
            abs(float(ref[p - 1].sort(descending=True).values[item.rank - 1]) - want) < 1e-4, p
        vals, ids = ref[p - 1].topk(k)
        assert [t for t, _ in item.top] == ids.tolist(), p
        assert all(abs(lp - float(v)) < 1e-4 for (_, lp), v in zip(item.top, vals)), p


def test_prompt_logprobs_over_chunks_next_to_other_requests(engine: Engine) -> None:
    rng = random.Random(0)
    long = [rng.randrange(10, 32000) for _ in range(2 * PROMPT_LOGPROBS_CHUNK + 37)]  # 3 chunks
    short = [rng.randrange(10, 32000) for _ in range(9)]
    other = [rng.randrange(10, 32000) for _ in range(120)]
    outs = collect(engine, [("long", long, greedy(3, prompt_logprobs=4)),
                            ("short", short, greedy(2, prompt_logprobs=0)),
                            ("other", other, greedy(5))])
    check(engine, outs["long"], long, 4)
    check(engine, outs["short"], short, 0)
    assert all(o.prompt_logprobs is None for o in outs["other"])
    for rid, p, n in (("long", long, 3), ("short", short, 2), ("other", other, 5)):
        assert tokens_of(outs[rid]) == reference_greedy(engine.runner.model, engine.model_config, p, n), rid
    assert not engine.scheduler.running and engine.scheduler.num_pages_used == 0


def test_several_share_one_steps_rows(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three prompt-logprobs requests at once: a step computes at most
    PROMPT_LOGPROBS_CHUNK rows of logits, all requests together, and each gets its own."""
    from ftserve.engine import prompt_logprobs as prompt_lp

    rows: list[int] = []
    real = prompt_lp.plan

    def spy(batch: object) -> object:
        plan = real(batch)  # type: ignore[arg-type]
        if plan is not None:
            rows.append(plan.count)
        return plan

    monkeypatch.setattr(prompt_lp, "plan", spy)
    rng = random.Random(3)
    prompts = {f"p{i}": [rng.randrange(10, 32000) for _ in range(150 + 40 * i)] for i in range(3)}
    outs = collect(engine, [(rid, p, greedy(2, prompt_logprobs=1)) for rid, p in prompts.items()])
    assert rows and max(rows) <= PROMPT_LOGPROBS_CHUNK, rows
    assert sum(rows) == sum(len(p) - 1 for p in prompts.values())
    for rid, p in prompts.items():
        check(engine, outs[rid], p, 1)


def test_a_cached_prefix_is_computed_again(engine: Engine) -> None:
    rng = random.Random(1)
    p = [rng.randrange(10, 32000) for _ in range(90)]
    first = collect(engine, [("warm", p, greedy(2))])
    assert first["warm"][-1].cached_tokens == 0
    again = collect(engine, [("hit", p, greedy(2))])
    assert again["hit"][-1].cached_tokens > 0  # the prefix is in the cache
    outs = collect(engine, [("lp", p, greedy(2, prompt_logprobs=2))])
    assert outs["lp"][-1].cached_tokens == 0
    check(engine, outs["lp"], p, 2)


def test_preempted_before_its_first_token(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A small pool: a decoding request preempts the prompt-logprobs one in the
    middle of its prefill; it recomputes its chunks, and each position comes out
    once, right."""
    eng = make_engine(tmp_path_factory, num_pages=300, max_prefill_length=64)
    seen: list[tuple[str, int]] = []
    real = eng.scheduler._preempt

    def spy(req: object) -> None:
        seen.append((req.request_id, req.num_outputs))  # type: ignore[attr-defined]
        real(req)  # type: ignore[arg-type]

    eng.scheduler._preempt = spy  # type: ignore[method-assign]
    try:
        rng = random.Random(2)
        p = [rng.randrange(10, 32000) for _ in range(1000)]
        hog = [rng.randrange(10, 32000) for _ in range(200)]
        outs = collect(eng, [("hog", hog, greedy(200)), ("lp", p, greedy(2, prompt_logprobs=1))])
        assert ("lp", 0) in seen, seen
        check(eng, outs["lp"], p, 1)
        assert tokens_of(outs["lp"]) == reference_greedy(eng.runner.model, eng.model_config, p, 2)
    finally:
        eng.shutdown()


def test_the_limit_is_checked() -> None:
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(prompt_logprobs=21).validate()
    assert err.value.param == "prompt_logprobs"
