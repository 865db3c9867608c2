"""--speculative mtp (CPU, float32): drafts from a checkpoint's MTP layer.

Random MTP weights would propose noise; the tests' MTP layer is made a near
copy of a one-layer model's own layer (``distill``: fc feeds it the next
token's embedding, plus a little of the hidden state), so it predicts the
token after next about as the model itself would, and full, partial and
rejected drafts all occur. Checked: the drafts are exactly what the MTP layer
computes over a full recompute of the request's context (so its KV is kept
right across prefill chunks, verify steps, prefix hits and preemption); the
outputs are plain decoding's, greedy and seeded, and at temperature 1 the
drafted positions' tokens follow the model's distribution (chi-square); the
start-up errors; the loader's MTP tensors, Qwen3-Next's included."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from ftserve.config import ConfigError, EngineConfig
from ftserve.engine.engine import Engine
from ftserve.engine.request import Req
from ftserve.engine.sampling_params import SamplingParams
from ftserve.engine.scheduler import Scheduler
from ftserve.engine.setup import build_engine
from ftserve.engine.spec.mtp import MTPSpeculator
from ftserve.kvcache.pool import KVPool
from ftserve.models.checkpoint import write_checkpoint
from ftserve.models.forward_batch import build_forward_batch
from ftserve_kernels.paged_attention import TorchAttentionBackend
from tests.engine_util import collect, greedy, make_context_sensitive, tokens_of
from tests.test_engine import assert_pool_baseline
from tests.test_spec_accept import chi2_p
from tests.test_spec_engine import counters, delta, same_outputs

MTP = {"num_nextn_predict_layers": 1}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("tiny-moe-mtp")
    write_checkpoint("tiny-moe", out, layers=1, config_only=True, overrides=MTP)
    return str(out)


@torch.no_grad()
def distill(model: torch.nn.Module, hidden_share: float = 0.3, seed: int = 0) -> None:
    """The MTP layer := the model's only layer, its final norm := the model's; fc
    passes the next token's (normed) embedding through and mixes in a random
    ``hidden_share`` of the hidden state, so its drafts are good, not perfect."""
    mtp = model.mtp
    mtp.layers[0].load_state_dict(model.layers[0].state_dict())
    mtp.norm.weight.copy_(model.norm.weight)
    h = model.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    mixed = torch.randn(h, h, generator=g, dtype=torch.float32) * hidden_share * h ** -0.5
    mtp.fc.weight.copy_(torch.cat([torch.eye(h), mixed], dim=1).to(mtp.fc.weight.dtype))


def make(model_dir: str, gain: float = 8.0, distilled: bool = True, **kw: Any) -> Engine:
    base: dict[str, Any] = dict(model=model_dir, load_format="dummy", device="cpu", dtype="float32",
                                page_size=4, num_pages=512, max_prefill_length=64,
                                max_running_requests=16, status_log_interval=0.0,
                                speculative_gate=False)  # the gate's timed windows would hold some steps' drafting off (test_spec_gate.py)
    base.update(kw)
    eng = build_engine(EngineConfig(**base))
    eng.check_integrity = True
    make_context_sensitive(eng.runner.model, gain)
    if distilled and getattr(eng.runner.model, "mtp", None) is not None:
        distill(eng.runner.model)
    return eng


@pytest.fixture(scope="module")
def plain(model_dir: str) -> Engine:
    eng = make(model_dir)
    yield eng
    eng.shutdown()


class DraftLog:
    """Records each verify's drafts with the request's tokens before it, at commit
    (``at``: each request's output counts when it verified, kept count after)."""

    def __init__(self, eng: Engine) -> None:
        self.seen: list[tuple[list[int], int, list[int]]] = []  # (tokens, computed_len, draft)
        self.at: dict[str, list[tuple[int, int]]] = {}
        sched = eng.scheduler
        commit = sched.commit_verified

        def logged(batch: Any, sampled: Any, lps: Any = None) -> None:
            before = [(req.num_outputs, list(d)) for req, d in zip(batch.reqs, batch.drafts)]
            for req, d in zip(batch.reqs, batch.drafts):
                if d:
                    self.seen.append((list(req.tokens), req.computed_len, list(d)))
            commit(batch, sampled, lps)
            for req, (n, d) in zip(batch.reqs, before):
                if d:
                    self.at.setdefault(req.request_id, []).append((n, req.num_outputs - n - 1))

        sched.commit_verified = logged  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def spec(model_dir: str) -> tuple[Engine, DraftLog]:
    eng = make(model_dir, speculative="mtp", num_speculative_tokens=3)
    log = DraftLog(eng)
    yield eng, log
    eng.shutdown()


@torch.inference_mode()
def reference_drafts(model: torch.nn.Module, tokens: list[int], k: int) -> list[int]:
    """What the MTP layer drafts after ``tokens`` (t_0 .. t_L), recomputed from
    nothing: the model over t_0 .. t_{L-1}, the MTP layer over (hidden[i],
    t_{i+1}) at positions 0 .. L-1, then k - 1 chained steps."""
    cfg = model.config
    n, ps = len(tokens), 16
    pages = list(range(1, (n + k) // ps + 2))
    pool = KVPool(cfg.num_layers + 1, len(pages) + 1, ps, cfg.num_kv_heads, cfg.head_dim,
                  next(model.parameters()).dtype, "cpu")
    backend = TorchAttentionBackend()
    fb = build_forward_batch([tokens[:-1]], [0], [pages], pool, backend, all_logits=True)
    fb.keep_hidden = True
    model(fb)
    mfb = build_forward_batch([tokens[1:]], [0], [pages], pool, backend, all_logits=True)
    g = model.mtp(fb.hidden, model.embed_tokens(mfb.input_ids), mfb, model.cos_sin)[-1:]
    out: list[int] = []
    for m in range(k):
        d = int((g.float() @ model.lm_head_weight().float().T).argmax())
        out.append(d)
        if m + 1 < k:
            step = build_forward_batch([[d]], [n - 1 + m], [pages], pool, backend)
            g = model.mtp(g, model.embed_tokens(step.input_ids), step, model.cos_sin)
    return out


def prompts(seed: int, n: int, lengths: tuple[int, int] = (3, 90)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 32000) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def check_drafts(eng: Engine, log: DraftLog, start: int) -> None:
    """Every draft since ``start`` is the MTP layer's over a full recompute."""
    seen = log.seen[start:]
    assert seen
    for tokens, computed, draft in seen:
        assert computed == len(tokens) - 1
        assert draft == reference_drafts(eng.runner.model, tokens, len(draft)), (tokens, draft)


def test_greedy_same_tokens_and_exact_drafts(plain: Engine, spec: tuple[Engine, DraftLog]) -> None:
    """Ten concurrent requests (prompts up to 90 tokens: chunked at 64), then a
    second turn of each that hits the prefix cache (one page less than plain
    decoding's hit: the MTP layer recomputes the last matched page), then
    branches off the first turn's prompts at a page boundary."""
    eng, log = spec
    ps = eng.scheduler.page_size
    ps_list = prompts(0, 10)
    reqs = [(f"g{i}", p, greedy(20)) for i, p in enumerate(ps_list)]
    before, start = counters(eng), len(log.seen)
    a, b = collect(plain, reqs), collect(eng, reqs)
    same_outputs(a, b)
    turn2 = [(f"t{i}", p + tokens_of(a[f"g{i}"]) + p[:5], greedy(12)) for i, p in enumerate(ps_list)]
    a2, b2 = collect(plain, turn2), collect(eng, turn2)
    same_outputs(a2, b2)
    # Branches off a cached prefix at a page boundary: the cached page's last MTP
    # entry was computed with the other branch's token.
    cut = [len(p) // ps * ps for p in ps_list]
    turn3 = [(f"b{i}", p[:c] + [31000 + i] + p[:6], greedy(12)) for i, (p, c) in enumerate(zip(ps_list, cut))]
    a3, b3 = collect(plain, turn3), collect(eng, turn3)
    same_outputs(a3, b3)
    for rid, _, _ in turn2 + turn3:
        hit = (a2 | a3)[rid][-1].cached_tokens
        assert hit > 0 and (b2 | b3)[rid][-1].cached_tokens == max(0, hit - ps), rid
    verifies, proposed, accepted, lengths = delta(counters(eng), before)
    assert sum(lengths) == verifies and 0 < accepted < proposed
    assert lengths[0] > 0 and lengths[-1] > 0 and sum(lengths[1:-1]) > 0, lengths
    check_drafts(eng, log, start)
    assert_pool_baseline(plain)
    assert_pool_baseline(eng)


def test_seeded_sampling_same_tokens_and_logprobs(plain: Engine, spec: tuple[Engine, DraftLog]) -> None:
    eng, _ = spec
    kinds = [SamplingParams(max_tokens=16, temperature=0.6, seed=11, ignore_eos=True, logprobs=3),
             SamplingParams(max_tokens=16, temperature=1.0, top_k=40, top_p=0.9, seed=12, ignore_eos=True),
             SamplingParams(max_tokens=16, temperature=0.3, min_p=0.05, seed=13, ignore_eos=True,
                            logit_bias=((77, 3.0),), logprobs=0),
             greedy(16, logprobs=5)]
    reqs = [(f"s{i}", p, kinds[i % len(kinds)]) for i, p in enumerate(prompts(1, 8, (3, 30)))]
    before = counters(eng)
    same_outputs(collect(plain, reqs), collect(eng, reqs), logprobs=True)
    verifies, _, accepted, _ = delta(counters(eng), before)
    assert verifies > 0 and accepted > 0
    assert_pool_baseline(eng)


def test_stops_limits_and_penalties(plain: Engine, spec: tuple[Engine, DraftLog]) -> None:
    """Stops and max_tokens inside drafts cut as plain decoding does; requests
    with penalties decode plainly beside drafting ones (their steps keep the MTP
    KV of the others)."""
    eng, log = spec
    ps_list = prompts(2, 4, (5, 20))
    base = collect(plain, [(f"b{i}", p, greedy(20)) for i, p in enumerate(ps_list)])
    pen = SamplingParams(max_tokens=12, temperature=0.0, presence_penalty=0.5, ignore_eos=True)
    reqs = []
    for i, p in enumerate(ps_list):
        cont = tokens_of(base[f"b{i}"])
        reqs.append((f"stop{i}", p, greedy(20, stop_token_ids=(cont[7],))))
        reqs.append((f"min{i}", p, SamplingParams(max_tokens=16, temperature=0.0, min_tokens=9,
                                                   stop_token_ids=(cont[3], cont[12]))))
        reqs.append((f"len{i}", p, greedy(2 + i % 3)))
        reqs.append((f"pen{i}", p, pen))
    start = len(log.seen)
    a, b = collect(plain, reqs), collect(eng, reqs)
    same_outputs(a, b)
    assert {a[f"stop{i}"][-1].finish_reason for i in range(4)} == {"stop"}
    check_drafts(eng, log, start)
    assert_pool_baseline(eng)


def test_preemption_and_no_overlap(model_dir: str, plain: Engine) -> None:
    """A pool small enough that requests preempt each other (their MTP KV is
    rebuilt with the main KV), with and without overlap scheduling."""
    reqs = [(f"p{i}", p, greedy(16)) for i, p in enumerate(prompts(3, 8, (30, 60)))]
    ref = collect(plain, reqs)
    for overlap in (True, False):
        eng = make(model_dir, speculative="mtp", num_speculative_tokens=4, num_pages=60,
                   overlap_schedule=overlap)
        log = DraftLog(eng)
        try:
            same_outputs(ref, collect(eng, reqs))
            assert eng.stats().preemptions_total > 0 and eng.stats().spec_accepted_tokens_total > 0
            check_drafts(eng, log, 0)
            assert_pool_baseline(eng)
        finally:
            eng.shutdown()


def test_host_tier_restores_the_mtp_kv(model_dir: str, plain: Engine) -> None:
    """Prefix pages evicted to the KV host tier and loaded back carry the MTP
    layer's K/V too: the second turns' drafts are still exact."""
    eng = make(model_dir, speculative="mtp", num_speculative_tokens=3, num_pages=80, kv_host_pages=400)
    log = DraftLog(eng)
    try:
        first = prompts(7, 6, (40, 80))
        reqs = [(f"h{i}", p, greedy(12)) for i, p in enumerate(first)]
        a = collect(plain, reqs)
        same_outputs(a, collect(eng, reqs))
        other = [(f"o{i}", p, greedy(8)) for i, p in enumerate(prompts(8, 6, (40, 80)))]
        same_outputs(collect(plain, other), collect(eng, other))
        turn2 = [(f"ht{i}", p + tokens_of(a[f"h{i}"]) + p[:5], greedy(12)) for i, p in enumerate(first)]
        b2 = collect(eng, turn2)
        same_outputs(collect(plain, turn2), b2)
        assert eng.runner.kv_host is not None and eng.runner.kv_host.counters.pages_loaded_total > 0
        assert all(b2[rid][-1].cached_tokens > 0 for rid, _, _ in turn2)
        check_drafts(eng, log, 0)
        assert_pool_baseline(eng)
    finally:
        eng.shutdown()


def test_sampled_tokens_keep_the_distribution(tmp_path: Path) -> None:
    """Temperature 1 on an 8-token vocabulary, 640 seeds, max_tokens 3: the first
    verify step feeds one draft token; the third output token (sampled at the
    draft's position when the step kept it, else by the next step) is
    distributed as the model's own marginal, computed exactly."""
    v = 8
    write_checkpoint("tiny-dense", tmp_path, layers=1, config_only=True,
                     overrides={**MTP, "vocab_size": v})
    eng = make(str(tmp_path), gain=8.0, speculative="mtp", num_speculative_tokens=3,
               max_running_requests=32)
    try:
        with torch.no_grad():  # peaked, context-dependent distributions (logits ~ N(0, 2))
            eng.runner.model.lm_head.weight.mul_(12.0)
        prompt = [3, 5, 1, 6]
        n = 640
        reqs = [(f"c{s}", prompt, SamplingParams(max_tokens=3, temperature=1.0, seed=s, ignore_eos=True))
                for s in range(n)]
        outs = collect(eng, reqs)
        third = torch.tensor([tokens_of(outs[f"c{s}"])[2] for s in range(n)])
        st = eng.stats()
        assert 0 < st.spec_accepted_tokens_total < st.spec_proposed_tokens_total
        model = eng.runner.model

        def probs(ctx: list[int]) -> torch.Tensor:
            pool = KVPool(model.config.num_layers, 2, 16, model.config.num_kv_heads, model.config.head_dim,
                          torch.float32, "cpu")
            fb = build_forward_batch([ctx], [0], [[1]], pool, TorchAttentionBackend())
            with torch.inference_mode():
                return torch.softmax(model(fb)[0].double(), dim=-1)

        p1 = probs(prompt)

        def second_marginal() -> torch.Tensor:
            w = torch.zeros(v, dtype=torch.float64)
            for y1 in range(v):
                w += p1[y1] * probs(prompt + [y1])
            return w
        marginal = torch.zeros(v, dtype=torch.float64)
        for y1 in range(v):
            p2 = probs(prompt + [y1])
            for y2 in range(v):
                marginal += p1[y1] * p2[y2] * probs(prompt + [y1, y2])
        counts = torch.bincount(third, minlength=v)
        assert chi2_p(counts, marginal) > 1e-3
        assert chi2_p(counts, second_marginal()) < 1e-6  # the test tells distributions apart
    finally:
        eng.shutdown()


def test_a_head_that_never_agrees_backs_off(model_dir: str, plain: Engine) -> None:
    """Random MTP weights: no draft is kept, so each request backs off (2, 4, 8,
    ... plain tokens after its 1st, 2nd, 3rd ... rejected verify) and verifies
    only at outputs 1, 4, 9, 18 and 35 of 48, not at every step; the outputs
    stay plain decoding's, and the drafts after 8 and 16 plain tokens are still
    the MTP layer's over a full recompute: the steps in back-off kept its KV
    (with and without overlap: such steps overlap)."""
    reqs = [(f"r{i}", p, greedy(48)) for i, p in enumerate(prompts(9, 4, (5, 40)))]
    ref = collect(plain, reqs)
    for overlap in (True, False):
        eng = make(model_dir, distilled=False, speculative="mtp", num_speculative_tokens=3,
                   overlap_schedule=overlap)
        log = DraftLog(eng)
        try:
            same_outputs(ref, collect(eng, reqs))
            verifies, proposed, accepted, _ = delta(counters(eng), (0, 0, 0, [0] * 4))
            assert accepted == 0 and verifies == 4 * 5 and proposed == 3 * verifies
            assert {rid: [n for n, _ in at] for rid, at in log.at.items()} == {
                rid: [1, 4, 9, 18, 35] for rid, _, _ in reqs}
            check_drafts(eng, log, 0)
            assert_pool_baseline(eng)
        finally:
            eng.shutdown()


def test_a_head_that_starts_agreeing_resumes_drafting(model_dir: str, plain: Engine) -> None:
    """Random MTP weights, made the model's near copy (``distill``) once a
    request has 20 outputs: each request, deep in back-off by then (its next
    draft at output 35), drafts there, keeps some, and after each verify that
    keeps something drafts at its very next step; the outputs are plain
    decoding's throughout. (The MTP KV of the
    positions before the swap is the random layer's, so the drafts differ from
    a full recompute's; they are verified as ever.)"""
    eng = make(model_dir, distilled=False, speculative="mtp", num_speculative_tokens=3)
    log = DraftLog(eng)
    sched, swapped = eng.scheduler, []
    commit = sched.commit

    def swap_weights(batch: Any, *a: Any, **kw: Any) -> None:
        commit(batch, *a, **kw)
        if not swapped and any(r.num_outputs >= 20 for r in sched.running):
            distill(eng.runner.model)  # on the engine thread, between steps
            swapped.append(True)

    sched.commit = swap_weights  # type: ignore[method-assign]
    try:
        reqs = [(f"r{i}", p, greedy(64)) for i, p in enumerate(prompts(9, 4, (5, 40)))]
        same_outputs(collect(plain, reqs), collect(eng, reqs))
        assert swapped
        for rid, _, _ in reqs:
            at = log.at[rid]
            assert [n for n, _ in at[:4]] == [1, 4, 9, 18] and all(a == 0 for _, a in at[:4]), (rid, at)
            later = at[4:]
            assert later[0][0] == 35 and sum(a for _, a in later) > 0, (rid, at)
            # A verify that keeps something resets the back-off: the request's next
            # step drafts again (while it has room for a draft: 63 outputs).
            nxt = dict(zip([n for n, _ in later], [n for n, _ in later[1:]] + [None]))
            for n, a in later:
                if a and n + a + 1 < 63:
                    assert nxt[n] == n + a + 1, (rid, at)
            assert len(later) >= 5, (rid, at)  # back-off alone: none after 35
        assert_pool_baseline(eng)
    finally:
        eng.shutdown()


# ----- CUDA graphs, their static forwards run eagerly -------------------------

def static_graphs(eng: Engine) -> dict[str, int]:
    """Give the runner decode, prefill and verify graphs whose replays run the
    captured static forward eagerly (what CUDA captures: padded, fixed-shape,
    the MTP pass inside the decode graph; Triton attention under the
    interpreter, which reads the device lengths, not the static bounds).
    Returns the replay counts by kind, and counts the steps the runner built
    eagerly by kind."""
    from ftserve.engine.cuda_graph import DecodeGraphs
    from ftserve.engine.prefill_graph import PrefillGraphs, verify_buckets
    from ftserve_kernels.attention_triton import TritonAttentionBackend

    counts = {"decode": 0, "prefill": 0, "verify": 0, "eager_decode": 0, "eager_verify": 0}

    class StaticDecode(DecodeGraphs):
        def _run(self, key: Any) -> Any:
            counts["decode"] += 1
            pbs, feats, bound = key
            with self.runner.sampler.forced_features(feats):
                return self._forward(pbs, bound)

    class StaticExtend(PrefillGraphs):
        def _run(self, bucket: int) -> torch.Tensor:
            counts["verify" if self.all_rows else "prefill"] += 1
            return self._forward(bucket)

    r = eng.runner
    r.graphs = StaticDecode(r, 4)
    r.graphs.backend = TritonAttentionBackend()
    r.prefill_graphs = StaticExtend(r, 64, 4)
    r.verify_graphs = StaticExtend(r, 0, 4, buckets=verify_buckets(4, 3), all_rows=True)
    build = r.build

    def counted(batch: Any, *a: Any, **kw: Any) -> Any:
        if batch.is_decode:
            counts["eager_decode"] += 1
        elif batch.verifies:
            counts["eager_verify"] += 1
        return build(batch, *a, **kw)

    r.build = counted  # type: ignore[method-assign]
    return counts


@pytest.mark.parametrize("distilled", [False, True])
def test_graph_paths_same_tokens_and_exact_drafts(model_dir: str, plain: Engine, distilled: bool) -> None:
    """The runner's graph paths under MTP, each replay the graph's static forward
    run eagerly: decode steps (the MTP pass inside the graph), prefill chunks
    and verify steps (the MTP pass over the graph's static hidden states) give
    plain decoding's tokens, and every draft, made from the MTP KV and outputs
    those passes left, is the MTP layer's over a full recompute. Random head:
    requests back off, so most steps are plain decode steps; distilled: most
    are verify steps. No decode step runs eagerly."""
    eng = make(model_dir, distilled=distilled, speculative="mtp", num_speculative_tokens=3,
               max_model_len=128)
    log = DraftLog(eng)
    try:
        assert eng.runner.mtp is not None
        counts = static_graphs(eng)
        reqs = [(f"sg{i}", p, greedy(20)) for i, p in enumerate(prompts(9, 3, (5, 30)))]
        same_outputs(collect(plain, reqs), collect(eng, reqs))
        check_drafts(eng, log, 0)
        assert counts["prefill"] > 0 and counts["verify"] > 0 and counts["eager_decode"] == 0, counts
        if not distilled:
            assert counts["decode"] > 2 * counts["verify"], counts
        else:
            assert eng.stats().spec_accepted_tokens_total > 0
        assert_pool_baseline(eng)
    finally:
        eng.shutdown()


def test_backoff_steps_counted_as_the_gpu_test_counts_them(model_dir: str) -> None:
    """test_gpu_spec.test_mtp_random_head_backs_off_sync_free's step accounting on
    the CPU: a random head's requests, stepped to their end as that test steps
    them (run_logged), verify at outputs 1, 4, 9 and 18 only, and every launched
    step is a logged step of its kind (the GPU test counts graph replays, one a
    launched decode or verify step). The step launched after the last plain
    step, while that step was in flight, is one of them: without the flush it
    stayed launched and unlogged, one decode replay above the logged ones."""
    from tests.test_gpu_spec import run_logged

    eng = make(model_dir, distilled=False, speculative="mtp", num_speculative_tokens=3, max_model_len=128)
    launched = {"decode": 0, "verify": 0, "prefill": 0}
    launch = eng.runner.launch

    def counted(batch: Any) -> Any:
        launched["decode" if batch.is_decode else "verify" if batch.verifies else "prefill"] += 1
        return launch(batch)

    eng.runner.launch = counted  # type: ignore[method-assign]
    try:
        drv = run_logged(eng, prompts(11, 3, (5, 20)), 24, check=False)
        kinds = [k for k, _, _ in drv.log]
        assert launched["decode"] == kinds.count("decode"), (launched, kinds)
        assert launched["verify"] == kinds.count("verify") == 4, (launched, kinds)
        assert kinds.count("decode") > 2 * kinds.count("verify"), kinds
        assert drv.inflight is None and eng.stats().spec_accepted_tokens_total == 0
        assert_pool_baseline(eng)
    finally:
        eng.shutdown()


# ----- start-up and loading ---------------------------------------------------

def test_checkpoint_without_mtp_layers_is_a_start_up_error(tmp_path: Path) -> None:
    write_checkpoint("tiny-dense", tmp_path / "weights", layers=1)
    write_checkpoint("tiny-dense", tmp_path / "config", layers=1, config_only=True)
    for path, fmt in ((tmp_path / "weights", "safetensors"), (tmp_path / "config", "dummy")):
        cfg = EngineConfig(model=str(path), load_format=fmt, device="cpu", speculative="mtp",
                           num_pages=64)
        with pytest.raises(ConfigError, match=r"--speculative mtp needs a checkpoint with MTP layers") as err:
            build_engine(cfg)
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="expert offload"):
        EngineConfig(speculative="mtp", moe_cache_size=8).validate()


def test_mtp_tensors_load_from_safetensors(tmp_path: Path) -> None:
    """make_model --mtp writes the mtp.* tensors; --speculative mtp loads every one
    of them into the MTP layer (the same values), and a plain load skips them."""
    from safetensors import safe_open

    from ftserve.models.loader import load_model
    from tools.make_model import main as make_model

    make_model(["--preset", "tiny-moe", "--out", str(tmp_path), "--layers", "1", "--mtp", "1",
                "--dtype", "float32"])
    names: dict[str, torch.Tensor] = {}
    for f in tmp_path.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            names.update({n: h.get_tensor(n) for n in h.keys() if n.startswith("mtp.")})
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
            "mtp.norm.weight", "mtp.layers.0.mlp.gate.weight", "mtp.layers.0.self_attn.q_proj.weight",
            "mtp.layers.0.mlp.experts.15.down_proj.weight"} <= set(names)
    model, _ = load_model(tmp_path, dtype="float32", mtp=True)
    params = dict(model.named_parameters())
    torch.testing.assert_close(params["mtp.fc.weight"], names["mtp.fc.weight"])
    torch.testing.assert_close(params["mtp.layers.0.mlp.w2"][15], names["mtp.layers.0.mlp.experts.15.down_proj.weight"])
    assert load_model(tmp_path, dtype="float32")[0].mtp is None
    eng = build_engine(EngineConfig(model=str(tmp_path), device="cpu", dtype="float32", speculative="mtp",
                                    num_pages=64, status_log_interval=0.0))
    try:
        assert eng.runner.mtp is not None and eng.runner.kv_pool.num_layers == 2
        out = collect(eng, [("r", [5, 6, 7, 8, 9], greedy(6))])
        assert len(tokens_of(out["r"])) == 6 and eng.stats().spec_verifies_total > 0
    finally:
        eng.shutdown()


def test_qwen3_next_mtp_layer_loads_and_runs(tmp_path: Path) -> None:
    """tiny-qwen3-next ships an MTP layer (full attention, shared-expert MoE,
    zero-centered norms) that loads and runs over the KV pool layer after the
    model's; the engine speculates with it on the hybrid (tests/test_spec_hybrid.py
    checks the outputs and states)."""
    from ftserve.models.loader import load_model
    from ftserve.models.qwen3_next import Qwen3NextMTP

    write_checkpoint("tiny-qwen3-next", tmp_path, seed=2, dtype="float32")
    model, cfg = load_model(tmp_path, dtype="float32", mtp=True)
    assert isinstance(model.mtp, Qwen3NextMTP)
    attn = model.mtp.layers[0].self_attn
    assert attn is not None and attn.kv_layer == len(cfg.kv_layers)
    kv = KVPool(len(cfg.kv_layers) + 1, 4, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    ids = [[11, 12, 13, 14, 15]]
    fb = build_forward_batch(ids, [0], [[1]], kv, TorchAttentionBackend(), all_logits=True)
    hidden = torch.randn(5, cfg.hidden_size)
    with torch.inference_mode():
        g = model.mtp(hidden, model.embed_tokens(fb.input_ids), fb, model.cos_sin)
    assert g.shape == (5, cfg.hidden_size) and torch.isfinite(g).all()
    assert kv.k[len(cfg.kv_layers)][16:21].abs().sum() > 0 and kv.k[0].abs().sum() == 0
    eng = build_engine(EngineConfig(model=str(tmp_path), device="cpu", dtype="float32", speculative="mtp",
                                    num_pages=64, status_log_interval=0.0))
    try:
        assert eng.runner.mtp is not None and eng.runner.kv_pool.num_layers == len(cfg.kv_layers) + 1
        out = collect(eng, [("r", [5, 6, 7, 8, 9], greedy(6))])
        assert len(tokens_of(out["r"])) == 6 and eng.scheduler.spec.counters.verifies_total > 0
    finally:
        eng.shutdown()


# ----- the scheduler's side, without a model --------------------------------

def test_scheduler_plans_placeholders_and_gives_back_the_last_matched_page() -> None:
    s = Scheduler(page_size=4, num_pages=32, max_running=2, max_prefill_length=64, max_model_len=60,
                  eos_token_ids=[2], speculator=MTPSpeculator(3, max_model_len=60))
    prompt = list(range(10, 23))  # 13 tokens: 3 full pages
    a = Req("a", prompt, greedy(5), 0.0)
    s.add(a)
    b = s.schedule()
    assert b is not None
    s.commit(b, [7])
    b = s.schedule()
    assert b is not None and b.verifies and b.drafts == [[-1, -1, -1]] and b.new_tokens == [[7, -1, -1, -1]]
    s.commit_verified(dataclasses.replace(b, drafts=[[8, 9, 5]]), [[8, 9, 1, 1]])
    assert a.output_ids == [7, 8, 9, 1] and a.computed_len == 16
    s.abort("a")  # its 4 full pages go to the prefix cache
    c = Req("c", prompt + [50], greedy(2), 0.0)
    s.add(c)
    b = s.schedule()
    assert b is not None and c.cached_len == 8  # 3 pages matched, the last recomputed
    s.check_integrity()
