"""GPU engine guarantees (issue 5 items 2 and 4), on a scaled-up tiny-moe with
dummy bf16 weights, Triton attention and CUDA-graph decode:

- no hidden device->host sync: every engine step (overlapped, as the engine
  thread runs it: plan + launch step N+1, read back + commit step N) runs under
  torch.cuda.set_sync_debug_mode("error"); the one deliberate read-back
  (runner.deliberate_sync, counted in runner.read_backs) is 0 for a non-final
  prefill chunk and exactly 1 for a decode step. Covered: a cold prompt longer
  than max_prefill_length, chunked prefill over a long cached prefix left by a
  finished request, decode at batch sizes 1, 3 (padded to 4) and 8;
- greedy outputs with CUDA graphs equal eager outputs;
- CUDA bf16 logits are close to the CPU fp32 reference for the same weights.

Plus two CPU tests that keep tools/bench/engine.py honest: its FLOP / byte
accounting against hand counts, and a --smoke run end to end.

The Scheduler and ModelRunner are driven synchronously (tools.bench.engine_driver's
EngineDriver), so every step is checked on its own. Each scenario runs once
unchecked first: Triton compiles (and any autotuning) happen at first launch
of a shape, which is start-up cost, not the steady state the rule is about.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ftserve.config import EngineConfig
from ftserve.engine.driver import EngineDriver
from ftserve.engine.engine import Engine
from ftserve.engine.request import Req, ReqState
from ftserve.engine.runner import Launched
from ftserve.engine.sampler import SamplerFeatures
from ftserve.engine.scheduler import ScheduledBatch
from ftserve.models.checkpoint import write_config
from tests.engine_util import make_context_sensitive

CHUNK = 256  # max_prefill_length
# tiny-moe widened so the Triton kernels run at realistic tile shapes.
SCALE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
             head_dim=64, moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4,
             max_position_embeddings=8192)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_config("tiny-moe", Path(tmp_path_factory.mktemp("gpu-moe")), layers=2, **SCALE)


def make_engine(model_dir: str, device: str = "cuda", graphs: bool = True, **kw: Any) -> Engine:
    from ftserve.engine.setup import build_engine

    kw.setdefault("speculative_gate", False)  # drafting by the test's design, not by timing
    kw.setdefault("max_running_requests", 8)
    cfg = EngineConfig(
        model=model_dir, load_format="dummy", device=device,
        dtype="bfloat16" if device == "cuda" else "float32",
        attention_backend="triton" if device == "cuda" else "torch",
        page_size=16, num_pages=1024, max_prefill_length=CHUNK,
        cuda_graph_max_bs=8 if graphs else 0, status_log_interval=0.0, **kw,
    )
    return build_engine(cfg)


@pytest.fixture(scope="module")
def engine(model_dir: str) -> Iterator[Engine]:
    eng = make_engine(model_dir)
    assert eng.runner.graphs is not None, "CUDA graphs must be on for this test"
    # Else greedy tokens cannot see wrong KV; engines built from this one copy
    # its weights (load_state_dict), gain included.
    make_context_sensitive(eng.runner.model)
    yield eng
    eng.shutdown()


@contextlib.contextmanager
def sync_is_error(on: bool) -> Iterator[None]:
    """Any synchronizing CUDA call inside raises (except deliberate_sync)."""
    if not on or not torch.cuda.is_available():
        yield
        return
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


class CheckedDriver(EngineDriver):
    """The engine's overlapped step (plan + launch N+1, then read back and
    commit N) under sync errors, logging (kind, batch size, read-backs) for
    every launched step when it is committed."""

    def __init__(self, engine: Engine, seed: int, check: bool) -> None:
        super().__init__(engine, seed)
        self.check = check
        self.log: list[tuple[str, int, int]] = []

    def step(self) -> ScheduledBatch | None:
        with sync_is_error(self.check):
            return super().step()

    def flush(self) -> None:
        with sync_is_error(self.check):
            super().flush()

    def finish(self, launched: Launched) -> None:
        before = self.runner.read_backs
        super().finish(launched)
        b = launched.batch
        kind = "decode" if b.is_decode else "prefill_final" if any(b.samples) else "prefill_chunk"
        self.log.append((kind, len(b.reqs), self.runner.read_backs - before))

    def until(self, cond: Callable[[], bool], limit: int = 200) -> None:
        for _ in range(limit):
            if cond():
                return
            if self.step() is None and self.idle:
                break
        assert cond(), "the engine stopped before the condition held"


def scenario(engine: Engine, seed: int, check: bool) -> CheckedDriver:
    """Cold chunked prefill -> chunked prefill over a cached prefix -> decode
    at batch sizes 1, 3, 8. Lengths are fixed so the checked run launches
    exactly the kernel shapes the warm-up run compiled."""
    drv = CheckedDriver(engine, seed, check)
    # 1. Cold prompt of 4 chunks; finishing puts its KV in the prefix cache.
    first = drv.add(drv.tokens(4 * CHUNK - 24), max_tokens=2)
    drv.until(lambda: first.finished)
    # 2. A longer prompt over that prefix: 3 chunks computed over ~1k cached tokens.
    second = drv.add(first.tokens + drv.tokens(2 * CHUNK + 100), max_tokens=2)
    drv.until(lambda: second.finished)
    assert second.cached_len >= (len(first.tokens) - 1) // 16 * 16, second.cached_len
    # 3. Decode at graph batch sizes 1, 3 (padded to 4) and 8.
    for bs in (1, 3, 8):
        reqs = [drv.add(drv.tokens(20 + 7 * i), max_tokens=6) for i in range(bs)]
        drv.until(lambda rs=reqs: all(r.state is ReqState.DECODE for r in rs))
        assert engine.runner.graphs is None or engine.runner.graphs.can_run(bs)
        for _ in range(3):
            b = drv.step()
            assert b is not None and b.is_decode and len(b.reqs) == bs
        drv.until(lambda rs=reqs: all(r.finished for r in rs))
    return drv


@pytest.mark.gpu
def test_no_hidden_syncs(engine: Engine) -> None:
    scenario(engine, seed=0, check=False)  # compile every kernel shape once
    drv = scenario(engine, seed=1, check=True)
    kinds = {k for k, _, _ in drv.log}
    assert {"prefill_chunk", "prefill_final", "decode"} <= kinds, kinds
    for kind, bs, n in drv.log:
        if kind == "prefill_chunk":
            assert n == 0, f"a non-final prefill chunk read the device back {n} times"
        else:
            assert n == 1, f"a {kind} step of batch {bs} made {n} read-backs, expected exactly 1"
    decode_sizes = {bs for kind, bs, _ in drv.log if kind == "decode"}
    assert {1, 3, 8} <= decode_sizes, decode_sizes
    assert sum(1 for k, _, _ in drv.log if k == "prefill_chunk") >= 5


def run_greedy(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    drv = EngineDriver(engine)
    reqs: list[Req] = [drv.add(p, max_tokens) for p in prompts]
    drv.run_all()
    assert all(r.finished for r in reqs)
    return [list(r.output_ids) for r in reqs]


@pytest.mark.gpu
def test_dense_model_decode_graphs_without_hidden_syncs(tmp_path: Path) -> None:
    """A dense model (SmolLM2-135M's layer shapes, two layers, dummy bf16): its
    decode layers run the dense GEMV folds (GLU gate/up, the norms left pending by
    o_proj and down, rotary + KV store in the split kernel): the scenario's steps
    sync nothing but the one read-back, and the graphs' greedy tokens equal eager
    decoding's."""
    model_dir = write_config("smollm2-135m", tmp_path, layers=2, max_position_embeddings=8192)
    dense = make_engine(model_dir)
    eager = make_engine(model_dir, graphs=False)
    try:
        assert dense.runner.graphs is not None and not dense.model_config.is_moe
        make_context_sensitive(dense.runner.model)
        eager.runner.model.load_state_dict(dense.runner.model.state_dict())
        scenario(dense, seed=0, check=False)  # compile every kernel shape once
        drv = scenario(dense, seed=1, check=True)
        for kind, bs, n in drv.log:
            assert n == (0 if kind == "prefill_chunk" else 1), (kind, bs, n)
        rng = random.Random(5)
        for bs in (1, 3):
            prompts = [[rng.randrange(100, 32000) for _ in range(rng.randint(10, 60))] for _ in range(bs)]
            assert run_greedy(dense, prompts, 16) == run_greedy(eager, prompts, 16), bs
    finally:
        dense.shutdown()
        eager.shutdown()


@pytest.mark.gpu
def test_constrained_decode_in_graphs_without_hidden_syncs(engine: Engine) -> None:
    """response_format requests batched with free ones through the captured decode
    graphs (all-stages variant, grammar-mask stage on): no hidden sync (the masks go
    up in one non-blocking copy), exactly one read-back per sampling step, each
    constrained output valid JSON ending with its grammar. (Free requests' tokens
    next to constrained ones are compared in fp32 on the CPU,
    tests/test_structured_engine.py: bf16 rows are not batch-size invariant.)"""
    import json

    import llguidance

    from ftserve.engine.grammar import GrammarMatcher
    from ftserve.engine.setup import demo_model_dir
    from ftserve.tokenizer import load_tokenizer
    from ftserve.tokenizer.grammar_view import grammar_tokenizer

    tok = load_tokenizer(demo_model_dir())
    vocab = grammar_tokenizer(tok, engine.vocab_size)
    schema = {"type": "object", "additionalProperties": False, "required": ["id", "tag"],
              "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                             "tag": {"type": "string", "maxLength": 6}}}
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False})
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 32000) for _ in range(20 + 5 * i)] for i in range(4)]
    assert engine.runner.graphs is not None
    def run(check: bool) -> tuple[CheckedDriver, list[Req]]:
        engine.scheduler.reset_prefix_cache()
        drv = CheckedDriver(engine, 0, check)
        reqs = [drv.add(p, 24) for p in prompts[:2]]
        for p in prompts[2:]:
            r = drv.add(p, 80)
            r.grammar = GrammarMatcher.compile(vocab, grammar)
            reqs.append(r)
        drv.until(lambda: all(r.finished for r in reqs))
        drv.flush()
        return drv, reqs

    run(check=False)  # compile every kernel shape once
    drv, reqs = run(check=True)
    assert engine.runner.sampler.features.grammar
    for kind, bs, n in drv.log:
        assert n == (0 if kind == "prefill_chunk" else 1), (kind, bs, n)
    assert any(kind == "decode" and bs >= 3 for kind, bs, _ in drv.log), drv.log
    assert all(r.finish_reason == "length" for r in reqs[:2])
    for r in reqs[2:]:
        assert r.finish_reason == "stop", r.finish_reason
        obj = json.loads(tok.decode(r.output_ids))
        assert set(obj) == {"id", "tag"} and 0 <= obj["id"] <= 99 and len(obj["tag"]) <= 6


@pytest.mark.gpu
def test_cuda_graph_decode_equals_eager(engine: Engine, model_dir: str) -> None:
    eager = make_engine(model_dir, graphs=False)
    try:
        assert eager.runner.graphs is None
        # Same weights by construction (seeded dummy fill); copied to make sure.
        eager.runner.model.load_state_dict(engine.runner.model.state_dict())
        rng = random.Random(7)
        for bs in (3, 8):  # 3 runs padded to the size-4 graph
            prompts = [[rng.randrange(100, 32000) for _ in range(rng.randint(10, 60))] for _ in range(bs)]
            with_graphs = run_greedy(engine, prompts, 16)
            without = run_greedy(eager, prompts, 16)
            for i, (g, e) in enumerate(zip(with_graphs, without)):
                assert g == e, f"batch {bs} request {i}: graph {g} != eager {e}"
    finally:
        eager.shutdown()


@pytest.mark.gpu
def test_short_context_graph_band_equals_eager(engine: Engine, model_dir: str) -> None:
    """Batch sizes whose split count the attention backend's short-context cap
    lowers get a second graph, bounded at the cap's limit (the batch's longest
    sequence picks it); sequences that decode across the limit switch graphs
    mid-request, and the greedy tokens still equal eager's (which takes the
    cap by the same bound)."""
    graphs = engine.runner.graphs
    assert graphs is not None
    limit = engine.runner.attn_backend.short_context_limit(torch.device("cuda"))
    assert 0 < limit < graphs.full_bound
    assert graphs.bounds[1] == [limit, graphs.full_bound]
    assert graphs.bounds[8] == [graphs.full_bound]  # 8 x 2 heads: fewer splits than the cap already
    eager = make_engine(model_dir, graphs=False)
    try:
        eager.runner.model.load_state_dict(engine.runner.model.state_dict())
        rng = random.Random(11)
        for lens in ([limit - 9], [40, limit - 4, 300]):
            prompts = [[rng.randrange(100, 32000) for _ in range(n)] for n in lens]
            with_graphs = run_greedy(engine, prompts, 16)
            without = run_greedy(eager, prompts, 16)
            assert with_graphs == without, (lens, with_graphs, without)
    finally:
        eager.shutdown()


@pytest.mark.gpu
def test_sampled_decode_graph_variants_equal_eager(engine: Engine, model_dir: str) -> None:
    """Seeded sampled requests (temperature; top-p) batched with greedy ones replay
    the smallest sampler variant covering the batch (cuda_graph.sampler_variant):
    the same tokens as the eager engine, and a greedy batch after them replays the
    greedy graph again (the stage set is the step's, not every admitted one's).
    Penalized rows replay the penalties variant, whose graph counts the tokens."""
    from ftserve.engine import cuda_graph
    from ftserve.engine.sampling_params import SamplingParams

    eager = make_engine(model_dir, graphs=False)
    used: list[object] = []
    real = cuda_graph.sampler_variant

    def spy(need: object) -> object:
        v = real(need)  # type: ignore[arg-type]
        used.append(v)
        return v

    try:
        eager.runner.model.load_state_dict(engine.runner.model.state_dict())
        rng = random.Random(9)
        prompts = [[rng.randrange(100, 32000) for _ in range(rng.randint(10, 60))] for _ in range(7)]
        params = [None, SamplingParams(temperature=0.8, seed=11), None,
                  SamplingParams(temperature=0.7, top_p=0.9, seed=12),  # top-p alone: the sort
                  SamplingParams(temperature=0.6, top_p=0.95, top_k=20, seed=13),  # sort-free
                  # Qwen3-Coder's defaults: penalties, counted inside the graph
                  SamplingParams(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05, seed=14),
                  SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=1.0)]

        def run(eng: Engine, which: list[int]) -> list[list[int]]:
            drv = EngineDriver(eng)
            reqs = [drv.add(prompts[i], 12, params[i]) for i in which]
            drv.run_all()
            return [list(r.output_ids) for r in reqs]

        cuda_graph.sampler_variant = spy  # type: ignore[assignment]
        mixed = run(engine, [0, 1, 2, 3])
        assert mixed == run(eager, [0, 1, 2, 3])
        assert SamplerFeatures(sampling=True, filtering=True, wide_filter=True) in used
        used.clear()
        assert run(engine, [0, 1, 4]) == run(eager, [0, 1, 4])
        assert SamplerFeatures(sampling=True, filtering=True) in used, used
        used.clear()
        assert run(engine, [0, 2]) == run(eager, [0, 2])
        assert used and all(v == SamplerFeatures() for v in used), used
        used.clear()
        assert run(engine, [5, 6, 1]) == run(eager, [5, 6, 1])
        assert SamplerFeatures(sampling=True, filtering=True, penalties=True) in used, used
        used.clear()
        assert run(engine, [0, 6]) == run(eager, [0, 6])  # greedy + a penalized greedy row
        assert SamplerFeatures(sampling=True, filtering=True, penalties=True) in used, used
    finally:
        cuda_graph.sampler_variant = real  # type: ignore[assignment]
        eager.shutdown()


@pytest.mark.gpu
def test_pdl_graph_decode_equals_default(engine: Engine, model_dir: str) -> None:
    """PDL (ftserve_kernels/pdl.py): graphs captured with programmatic
    dependent launches decode the same greedy tokens as graphs without."""
    rng = random.Random(11)
    prompts = {bs: [[rng.randrange(100, 32000) for _ in range(rng.randint(10, 60))] for _ in range(bs)]
               for bs in (1, 3, 8)}
    plain = make_engine(model_dir, pdl=False)
    try:
        plain.runner.model.load_state_dict(engine.runner.model.state_dict())
        want = {bs: run_greedy(plain, p, 16) for bs, p in prompts.items()}
    finally:
        plain.shutdown()
    linked = make_engine(model_dir)  # graphs captured with the PDL launches (the default)
    assert linked.runner.kernels.pdl
    try:
        linked.runner.model.load_state_dict(engine.runner.model.state_dict())
        for bs, p in prompts.items():
            assert run_greedy(linked, p, 16) == want[bs], f"batch {bs}"
    finally:
        linked.shutdown()


@pytest.mark.gpu
def test_routed_oproj_graph_decode_equals_eager(engine: Engine, model_dir: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """At one decode row o_proj routes and the experts weigh: graphs decode the
    same greedy tokens as eager steps (which route the same way). The graphs are
    captured again after the weights are copied in: the folded router derives
    from them."""
    rng = random.Random(13)
    prompts = {bs: [[rng.randrange(100, 32000) for _ in range(rng.randint(10, 60))] for _ in range(bs)]
               for bs in (1, 3)}
    eager = make_engine(model_dir, graphs=False)
    try:
        eager.runner.model.load_state_dict(engine.runner.model.state_dict())
        want = {bs: run_greedy(eager, p, 16) for bs, p in prompts.items()}
    finally:
        eager.shutdown()
    graphed = make_engine(model_dir)
    try:
        graphed.runner.model.load_state_dict(engine.runner.model.state_dict())
        assert graphed.runner.graphs is not None
        graphed.runner.graphs.capture()
        for bs, p in prompts.items():
            assert run_greedy(graphed, p, 16) == want[bs], f"batch {bs}"
        layers = graphed.runner.model.layers
        assert all(layer._folded is not None for layer in layers)  # the batch-1 steps routed in o_proj
    finally:
        graphed.shutdown()


@pytest.mark.gpu
def test_cuda_bf16_logits_track_cpu_fp32(engine: Engine) -> None:
    with torch.inference_mode():
        _compare_logits(engine)


def cpu_twin(engine: Engine) -> torch.nn.Module:
    """The engine's model on the CPU in fp32, with the same weights."""
    from ftserve.models.loader import build_model

    cpu_model = build_model(engine.model_config, torch.float32, torch.device("cpu"))
    gpu_params = dict(engine.runner.model.named_parameters())
    for name, p in cpu_model.named_parameters():
        p.copy_(gpu_params[name].float().cpu())
    return cpu_model


def _compare_logits(engine: Engine) -> None:
    from ftserve.kvcache.pool import KVPool
    from ftserve.models.forward_batch import build_forward_batch
    from ftserve_kernels.attention_triton import TritonAttentionBackend
    from ftserve_kernels.paged_attention import TorchAttentionBackend

    gpu_model = engine.runner.model
    cfg = engine.model_config
    cpu_model = cpu_twin(engine)
    rng = random.Random(11)
    prompt = [rng.randrange(100, 32000) for _ in range(100)]
    pages = list(range(1, 8))  # 7 pages x 16 slots >= 100 tokens

    def pool(dtype: torch.dtype, device: str) -> KVPool:
        return KVPool(cfg.num_layers, 8, 16, cfg.num_kv_heads, cfg.head_dim, dtype, device)

    ref = cpu_model(build_forward_batch([prompt], [0], [pages], pool(torch.float32, "cpu"),
                                        TorchAttentionBackend(), all_logits=True))  # [100, V]
    gpool, backend = pool(torch.bfloat16, "cuda"), TritonAttentionBackend()
    # Two chunks on the GPU (64 new, then 36 over the 64 cached) to cover extend-over-prefix.
    a = gpu_model(build_forward_batch([prompt[:64]], [0], [pages], gpool, backend, all_logits=True))
    b = gpu_model(build_forward_batch([prompt[64:]], [64], [pages], gpool, backend, all_logits=True))
    got = torch.cat([a, b]).float().cpu()  # [100, V]
    rel = (got - ref).norm() / ref.norm()
    assert rel < 0.05, f"relative logit error {rel:.4f}"
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)  # [100]
    assert cos.min() > 0.99, f"worst row cosine {cos.min():.4f}"
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean()
    assert agree >= 0.9, f"top-1 agreement {agree:.2f}"


@pytest.mark.gpu
def test_prompt_logprobs_without_hidden_syncs(engine: Engine) -> None:
    """A prompt-logprobs request (three chunks of PROMPT_LOGPROBS_CHUNK) beside an
    ordinary one: its non-final chunks still read nothing back, its logprobs
    track the CPU fp32 model's, and the ordinary request's tokens equal a run
    without it."""
    from ftserve.engine import prompt_logprobs as prompt_lp
    from ftserve.engine.sampling_params import SamplingParams
    from ftserve.engine.scheduler import PROMPT_LOGPROBS_CHUNK
    from ftserve.kvcache.pool import KVPool
    from ftserve.models.forward_batch import build_forward_batch
    from ftserve_kernels.paged_attention import TorchAttentionBackend

    def run(seed: int, check: bool) -> tuple[CheckedDriver, Req, Req]:
        drv = CheckedDriver(engine, seed, check)
        lp = drv.add(drv.tokens(2 * PROMPT_LOGPROBS_CHUNK + 40), 2,
                     SamplingParams(temperature=0.0, prompt_logprobs=3))
        other = drv.add(drv.tokens(60), 4)
        drv.until(lambda: lp.finished and other.finished)
        return drv, lp, other

    run(0, check=False)  # compile the shapes
    drv, lp, other = run(1, check=True)
    for kind, bs, n in drv.log:
        assert n == (0 if kind == "prefill_chunk" else 1), (kind, bs, n)
    assert sum(k == "prefill_chunk" for k, _, _ in drv.log) >= 2
    assert run_greedy(engine, [other.prompt_ids], 4) == [list(other.output_ids)]
    got = prompt_lp.collect(lp)
    prompt = lp.prompt_ids
    cfg = engine.model_config
    pages = (len(prompt) + 15) // 16
    pool = KVPool(cfg.num_layers, pages + 1, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    with torch.inference_mode():
        ref = torch.log_softmax(cpu_twin(engine)(build_forward_batch(
            [prompt], [0], [list(range(1, pages + 1))], pool, TorchAttentionBackend(), all_logits=True)), -1)
    want = torch.tensor([float(ref[p - 1, prompt[p]]) for p in range(1, len(prompt))])
    have = torch.tensor([got[p].logprob for p in range(1, len(prompt))])  # type: ignore[union-attr]
    assert got[0] is None and float((have - want).abs().max()) < 0.1, float((have - want).abs().max())
    top1 = [got[p].top[0][0] == int(ref[p - 1].argmax()) for p in range(1, len(prompt))]  # type: ignore[union-attr]
    assert sum(top1) / len(top1) >= 0.9


# ----------------------------------------------------------------- CPU: the benchmark itself


def test_bench_accounting_matches_hand_counts() -> None:
    from ftserve.models.config import ModelConfig
    from ftserve.models.presets import PRESETS
    from tools.bench.common import decode_step_bytes, expected_distinct_experts, prefill_flops

    cfg = ModelConfig.from_hf({**PRESETS["qwen3-30b-a3b"], "num_hidden_layers": 8})
    h, i, e, k, v = 2048, 768, 128, 8, 151936
    attn = h * (32 * 128 + 2 * 4 * 128) + 32 * 128 * h  # qkv + o weights per layer
    assert expected_distinct_experts(e, k, 1) == pytest.approx(k)
    assert expected_distinct_experts(e, k, 10_000) == pytest.approx(e)
    b1 = decode_step_bytes(cfg, 2, 1, [2048])
    want = 2 * (8 * (attn + h * e + k * 3 * h * i) + v * h + h)
    assert b1["weight_bytes"] == pytest.approx(want)
    assert b1["kv_bytes"] == 2048 * 2 * 8 * 4 * 128 * 2
    measured = decode_step_bytes(cfg, 2, 64, [100] * 64, experts_per_layer=100.0)
    assert measured["experts_per_layer"] == 100.0
    fl = prefill_flops(cfg, 4096, 8192)
    assert fl["matmul_flops"] == pytest.approx(4096 * 8 * 2 * (attn + h * e + k * 3 * h * i) + 2 * h * v)
    pairs = 4096 * 8192 + 4096 * 4097 / 2
    assert fl["attention_flops"] == pytest.approx(8 * 32 * 4 * 128 * pairs)
    assert fl["attention_square_flops"] == pytest.approx(8 * 32 * 4 * 128 * 4096 * (8192 + 4096))
    # The reference: 0.040 s cold at "about 19%" of 790 TFLOP/s counts ~6.0 TFLOP.
    cold = prefill_flops(cfg, 4096, 0)
    assert (cold["matmul_flops"] + cold["attention_square_flops"]) / 0.040 / 790e12 == pytest.approx(0.19, abs=0.005)


def test_bench_engine_smoke_cpu(tmp_path: Path) -> None:
    from tools.bench.engine import main

    out = tmp_path / "bench.json"
    res = main(["--smoke", "--budget-s", "600", "--out", str(out), "--sections", "cold,cached,decode"])
    assert out.exists() and not res.get("errors"), res.get("errors")
    cached = res["cached_prefill"]
    assert [r["prefix"] for r in cached] == [0, 64, 256]
    # More cached tokens, same new tokens: strictly more attention work per chunk.
    assert cached[0]["attention_flops"] < cached[1]["attention_flops"] < cached[2]["attention_flops"]
    assert all(r["wall_s"] > 0 and r["tokens_per_s"] > 0 for r in cached)
    rows = {(r["context"], r["batch"]): r for r in res["decode"]}
    assert set(rows) == {(48, 1), (48, 3), (160, 1), (160, 3)}
    for (ctx, bs), r in rows.items():
        assert ctx <= r["mean_context"] <= ctx + 8
        # tiny-moe routes 4 of 16 experts: one token touches exactly 4 distinct ones.
        assert (r["experts_per_layer_measured"] == 4.0) if bs == 1 else 4.0 <= r["experts_per_layer_measured"] <= 12.0
        # The CPU's copy rate, measured beside other work, is a loose roofline: the
        # ratio is sane, not bounded by 1 as on an idle GPU.
        assert 0 < r["frac_of_roofline"] < 4.0
    assert res["base_prefill"]["tokens"] == 256
