"""Sampler: greedy, filters, seeded determinism, distribution, penalties,
min_tokens, logprobs, and (GPU) CUDA-graph capture without host syncs."""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Iterator

import pytest
import torch

from ftserve.engine.sampler import SampleOutput, Sampler, SamplerFeatures
from ftserve.engine.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams, SamplingParamsError
from ftserve_kernels import sampling as ks
from ftserve_kernels.config import KernelConfig

V = 32


def _i64(xs: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64, device=device)


def _sample(
    s: Sampler, logits: torch.Tensor, slots: list[int], steps: list[int] | None = None,
    active: list[bool] | None = None,
) -> torch.Tensor:
    b = len(slots)
    return s.sample(
        logits, _i64(slots), _i64(steps or [0] * b),
        torch.tensor(active or [False] * b, dtype=torch.bool),
    ).token_ids


def _draws(params: SamplingParams, logits: torch.Tensor, n: int) -> torch.Tensor:
    """n draws for one request: one row per output step, all in one batch."""
    s = Sampler(logits.shape[-1], 2, "cpu")
    s.admit(0, params, [], [])
    rows = logits.expand(n, -1).contiguous()
    return s.sample(rows, _i64([0] * n), torch.arange(n), torch.zeros(n, dtype=torch.bool)).token_ids


def test_greedy_is_argmax_and_top_k_1_is_greedy() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, V)
    s = Sampler(V, 8, "cpu")
    s.admit(0, SamplingParams(temperature=0.0), [], [])
    s.admit(1, SamplingParams(temperature=1.3, top_k=1, seed=5), [], [])
    s.admit(2, SamplingParams(temperature=0.8, seed=9), [], [])  # forces the sampling path
    slots = [0, 1, 0, 1, s.dummy_slot, 0]
    got = _sample(s, logits, slots, steps=[0, 1, 2, 3, 0, 7])
    assert s.features.sampling
    assert torch.equal(got, logits.argmax(-1))


def test_mixed_batch_greedy_rows_unaffected_by_enabled_features() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, V)
    plain = Sampler(V, 4, "cpu")
    plain.admit(0, SamplingParams(temperature=0.0), [], [])
    full = Sampler(V, 4, "cpu")
    full.enable(SamplerFeatures.all())
    full.admit(0, SamplingParams(temperature=0.0), [], [])
    a = _sample(plain, logits, [0, 0, 0, 0])
    b = _sample(full, logits, [0, 0, 0, 0])
    assert plain.features == SamplerFeatures()
    assert torch.equal(a, b) and torch.equal(a, logits.argmax(-1))


def test_forced_features_select_a_variant_and_restore() -> None:
    torch.manual_seed(8)
    logits = torch.randn(2, V)
    s = Sampler(V, 2, "cpu")
    s.admit(0, SamplingParams(temperature=1.0, seed=3), [], [])
    assert s.features == SamplerFeatures(sampling=True)
    with s.forced_features(SamplerFeatures.all()):
        assert s.features == SamplerFeatures.all() and s.counts is not None
        out = s.sample(logits, _i64([0, 0]), _i64([0, 1]), torch.zeros(2, dtype=torch.bool))
        assert out.logprobs is not None
    assert s.features == SamplerFeatures(sampling=True)
    again = _sample(s, logits, [0, 0], steps=[0, 1])
    assert torch.equal(out.token_ids, again)  # the extra stages are exact no-ops here
    with s.forced_features(SamplerFeatures()):
        assert torch.equal(_sample(s, logits, [0, 0]), logits.argmax(-1))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=3, seed=1),
        SamplingParams(temperature=1.5, top_p=0.6, seed=2),
        SamplingParams(temperature=0.7, min_p=0.3, seed=3),
        SamplingParams(temperature=2.0, top_k=5, top_p=0.8, min_p=0.05, seed=4),
    ],
)
def test_filters_never_sample_outside_allowed_set(params: SamplingParams) -> None:
    torch.manual_seed(2)
    logits = torch.randn(V) * 2.0
    draws = _draws(params, logits[None], 3000)
    scaled = logits / params.temperature
    order = scaled.argsort(descending=True)
    k = params.top_k if params.top_k > 0 else V
    probs_k = torch.softmax(scaled[order[:k]].double(), -1)
    allowed: set[int] = set()
    mass = 0.0
    for tok, p in zip(order[:k].tolist(), probs_k.tolist()):
        if mass >= params.top_p:
            break
        allowed.add(tok)
        mass += p
    p_full = torch.softmax(scaled.double(), -1)
    allowed = {t for t in allowed if p_full[t] >= params.min_p * p_full.max()}
    seen = set(draws.tolist())
    assert seen <= allowed
    assert len(seen) == len(allowed)  # every allowed token shows up over 3000 draws


def test_distribution_matches_softmax() -> None:
    torch.manual_seed(3)
    logits = torch.randn(V)
    n = 20000
    draws = _draws(SamplingParams(temperature=1.0, seed=1234), logits[None], n)
    observed = torch.bincount(draws, minlength=V).double()
    expected = torch.softmax(logits.double(), -1) * n
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    # 31 degrees of freedom: mean 31, sd ~7.9; 70 is beyond the 99.99th percentile.
    assert chi2 < 70.0, chi2
    # Temperature actually sharpens: at 0.5 the top token is drawn more often.
    cold = _draws(SamplingParams(temperature=0.5, seed=1234), logits[None], n)
    top = int(logits.argmax())
    assert (cold == top).sum() > (draws == top).sum()


def test_same_seed_independent_of_batch_and_row_order() -> None:
    torch.manual_seed(4)
    logits = torch.randn(3, V)
    a = Sampler(V, 8, "cpu")
    a.admit(5, SamplingParams(temperature=1.0, seed=42), [1, 2], [])
    alone = [int(_sample(a, logits[i : i + 1], [5], steps=[i])[0]) for i in range(3)]
    b = Sampler(V, 8, "cpu")
    b.admit(0, SamplingParams(temperature=0.9, seed=7), [], [])
    b.admit(3, SamplingParams(temperature=1.0, seed=42), [9], [])
    b.admit(1, SamplingParams(temperature=0.0), [], [])
    other = torch.randn(3, V)
    batch = torch.stack([other[0], logits[2], other[1], logits[0], logits[1], other[2]])
    got = _sample(b, batch, [0, 3, 1, 3, 3, b.dummy_slot], steps=[0, 2, 0, 0, 1, 0])
    assert [int(got[3]), int(got[4]), int(got[1])] == alone


def test_different_seeds_differ_and_unseeded_requests_get_fresh_seeds() -> None:
    logits = torch.zeros(1, V)  # uniform: every token equally likely
    runs = [_draws(SamplingParams(temperature=1.0, seed=sd), logits, 64) for sd in (1, 2, -1)]
    assert not torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    assert torch.equal(runs[0], _draws(SamplingParams(temperature=1.0, seed=1), logits, 64))
    s = Sampler(V, 4, "cpu", seed=0)
    s.admit(0, SamplingParams(temperature=1.0), [], [])
    s.admit(1, SamplingParams(temperature=1.0), [], [])
    rows = logits.expand(64, -1)
    steps = torch.arange(64)
    t0 = s.sample(rows, _i64([0] * 64), steps, torch.zeros(64, dtype=torch.bool)).token_ids
    t1 = s.sample(rows, _i64([1] * 64), steps, torch.zeros(64, dtype=torch.bool)).token_ids
    assert not torch.equal(t0, t1)


def _penalized_reference(
    logits: list[float], prompt: list[int], output: list[int], rep: float, pres: float, freq: float
) -> list[float]:
    out = list(logits)
    for t in set(prompt) | set(output):  # HF: prompt and generated tokens
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output):  # OpenAI: generated tokens only
        out[t] -= output.count(t) * freq + pres
    return out


def test_penalties_match_formulas() -> None:
    torch.manual_seed(5)
    logits = torch.randn(3, V) * 3.0
    cases = [
        ([1, 2, 3, 3], [3, 4, 4, 4, 7], 1.3, 0.5, 0.25),
        ([], [0, 0, 31], 0.8, -0.4, 1.1),
        ([5, 6], [], 1.0, 0.0, 0.0),  # neutral: unchanged
    ]
    s = Sampler(V, 4, "cpu")
    for slot, (prompt, output, rep, pres, freq) in enumerate(cases):
        params = SamplingParams(
            temperature=0.0, repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq)
        half = len(output) // 2
        # Half the outputs restored at admit (a resumed request), half via update().
        s.admit(slot, params, prompt, [], output_ids=output[:half])
        for tok in output[half:]:
            s.update(_i64([slot]), _i64([tok]))
    assert s.counts is not None and s.prompt_mask is not None
    got = ks.apply_penalties_ref(
        logits, s.counts[:3], s.prompt_mask[:3], s.repetition[:3], s.presence[:3], s.frequency[:3])
    for i, (prompt, output, rep, pres, freq) in enumerate(cases):
        want = _penalized_reference(logits[i].tolist(), prompt, output, rep, pres, freq)
        torch.testing.assert_close(got[i], torch.tensor(want), rtol=1e-6, atol=1e-6)
    assert torch.equal(got[2], logits[2])
    # And the greedy choice follows the penalized logits.
    picked = _sample(s, logits, [0, 1, 2])
    assert torch.equal(picked, got.argmax(-1))


def test_update_counts_and_readmit_resets() -> None:
    s = Sampler(V, 4, "cpu")
    s.admit(2, SamplingParams(frequency_penalty=1.0), [4], [])
    s.update(_i64([2, 2, s.dummy_slot]), _i64([9, 9, 9]))
    assert s.counts is not None and s.prompt_mask is not None
    assert int(s.counts[2, 9]) == 2 and bool(s.prompt_mask[2, 4])
    s.release(2)
    neutral = s.dummy_slot
    assert torch.equal(s._f[2], s._f[neutral]) and torch.equal(s._i[2], s._i[neutral])
    s.admit(2, SamplingParams(presence_penalty=1.0), [], [])
    assert int(s.counts[2].sum()) == 0 and not bool(s.prompt_mask[2].any())


def test_logit_bias_forces_and_bans_tokens_per_row() -> None:
    """Bias is added per slot before the argmax / draw: +100 forces a token (also
    when sampling), -100 bans the argmax; other rows and released slots are
    untouched; logprobs stay those of the raw logits."""
    torch.manual_seed(4)
    logits = torch.randn(4, V)
    best = logits.argmax(-1)
    s = Sampler(V, 4, "cpu")
    s.admit(0, SamplingParams(temperature=0.0, logit_bias=((7, 100.0),)), [], [])
    s.admit(1, SamplingParams(temperature=0.0, logit_bias=((int(best[1]), -100.0),)), [], [])
    s.admit(2, SamplingParams(temperature=0.0), [], [])
    s.admit(3, SamplingParams(temperature=1.0, seed=3, logit_bias=((9, 100.0),), logprobs=2), [], [])
    assert s.features.bias
    out = s.sample(logits, _i64([0, 1, 2, 3]), _i64([0, 0, 0, 0]), torch.zeros(4, dtype=torch.bool))
    got = out.token_ids
    assert got[0] == 7 and got[3] == 9 and got[2] == best[2]
    second = logits[1].clone()
    second[best[1]] = -1e9
    assert got[1] == second.argmax() != best[1]
    assert out.logprobs is not None
    assert torch.allclose(out.logprobs[3], torch.log_softmax(logits[3], -1)[9])
    s.release(0)  # a released (or re-admitted) slot loses its bias
    s.admit(1, SamplingParams(temperature=0.0), [], [])
    again = _sample(s, logits[:2], [0, 1])
    assert torch.equal(again, best[:2])
    with pytest.raises(SamplingParamsError) as bad:
        SamplingParams(logit_bias=((3, 101.0),)).validate(V)
    assert bad.value.param == "logit_bias"
    with pytest.raises(SamplingParamsError):
        SamplingParams(logit_bias=((V, 1.0),)).validate(V)


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.zeros(4, V)
    logits[:, 7] = 10.0  # eos is the favourite
    logits[:, 11] = 9.0  # then a stop id
    logits[:, 3] = 8.0
    s = Sampler(V, 4, "cpu")
    s.admit(0, SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(11,)), [], [7])
    s.admit(1, SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True), [], [7])
    got = _sample(s, logits, [0, 0, 1, 1], active=[True, False, True, False])
    # Row 0: eos and stop masked -> 3. Row 1: min_tokens done -> eos.
    # Row 2: ignore_eos, so eos is not a stop and is never masked.
    assert got.tolist() == [3, 7, 7, 7]
    s.admit(2, SamplingParams(temperature=1.0, seed=3, min_tokens=5), [], [7])
    drawn = s.sample(logits[:1].expand(500, -1), _i64([2] * 500), torch.arange(500),
                     torch.ones(500, dtype=torch.bool)).token_ids
    assert not bool((drawn == 7).any())


def test_logprobs_are_raw_log_softmax() -> None:
    torch.manual_seed(6)
    logits = torch.randn(3, V)
    s = Sampler(V, 4, "cpu", max_top_logprobs=5)
    s.admit(0, SamplingParams(temperature=0.7, seed=1, logprobs=3, presence_penalty=1.0), [], [])
    out = s.sample(logits, _i64([0, 0, 0]), _i64([0, 1, 2]), torch.zeros(3, dtype=torch.bool))
    assert out.logprobs is not None and out.top_ids is not None and out.top_logprobs is not None
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.token_ids[:, None]).squeeze(1))
    want_lp, want_ids = ref.topk(5, dim=-1)
    assert out.top_ids.shape == (3, 5)
    assert torch.equal(out.top_ids, want_ids)
    torch.testing.assert_close(out.top_logprobs, want_lp)


def test_noise_is_uniform_and_hash_matches_known_values() -> None:
    table = ks.token_hash_table(4096, "cpu")
    assert len(set(table.tolist())) == 4096  # mix32 is a bijection
    k1, k2 = ks.row_keys(_i64([1, 1]), _i64([0, 0]), _i64([0, 1]))
    u = ks.uniform_ref(k1, k2, table)  # [2, 4096]
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.02
    assert float((u[0] - u[1]).abs().mean()) > 0.2  # steps decorrelate
    # lowbias32 of 1: pins the arithmetic so the Triton twin cannot drift.
    assert int(ks.mix32(_i64([1]))[0]) == _lowbias32_py(1)


def _lowbias32_py(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_admit_rejects_bad_slot_and_too_many_stop_ids() -> None:
    s = Sampler(V, 2, "cpu", max_stop_ids=2)
    with pytest.raises(ValueError):
        s.admit(2, SamplingParams(), [], [])
    with pytest.raises(ValueError):
        s.admit(0, SamplingParams(stop_token_ids=(1, 2)), [], [3])
    s.admit(0, SamplingParams(stop_token_ids=(1, 2), ignore_eos=True), [], [3])  # eos not a stop
    too_many = SamplingParams(stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS + 1)))
    with pytest.raises(SamplingParamsError):  # rejected upstream, before any slot
        too_many.validate(vocab_size=1000)
    assert Sampler(V, 1, "cpu").max_stop_ids > MAX_STOP_TOKEN_IDS


def _assert_same_draw(fast: torch.Tensor, ref: torch.Tensor, scores: torch.Tensor,
                      k1: torch.Tensor, k2: torch.Tensor, table: torch.Tensor) -> None:
    """The kernel's pick is a maximum of the reference's perturbed scores (exact
    equality could only fail on an fp32 log rounding tie)."""
    perturbed = scores + -torch.log(-torch.log(ks.uniform_ref(k1, k2, table)))  # [B, V]
    best = perturbed.gather(1, ref[:, None])
    assert math.isfinite(float(best.min()))
    assert bool(torch.all(perturbed.gather(1, fast[:, None]) >= best - 1e-5))
    assert float((fast == ref).float().mean()) >= 0.9


@pytest.fixture
def interpreted_kernels(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Re-decorate the sampling kernels for the CPU interpreter, then restore."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    importlib.reload(ks)
    yield
    monkeypatch.undo()
    importlib.reload(ks)


@pytest.mark.skipif(ks.triton is None, reason="needs triton")
def test_triton_gumbel_argmax_matches_reference(interpreted_kernels: None) -> None:
    g = torch.Generator().manual_seed(7)
    b, vocab = 5, 3000
    scores = torch.randn(b, vocab, generator=g) * 2
    scores[1, 100:] = float("-inf")  # a heavily masked row (top-k style)
    table = ks.token_hash_table(vocab, "cpu")
    k1, k2 = ks.row_keys(_i64([1, 2, 3, 4, 5]), _i64([0, 9, 8, 7, 2**32 - 1]),
                         _i64([0, 5, 7, 1, 2**33 + 3]))
    ref = ks.gumbel_argmax_ref(scores, k1, k2, table)
    # Small blocks and several chunks per row exercise the cross-chunk reduction.
    fast = ks.gumbel_argmax_triton(scores, k1, k2, block=256, target_programs=8)
    assert int(fast[1]) < 100
    _assert_same_draw(fast, ref, scores, k1, k2, table)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_capture_matches_eager_without_syncs() -> None:
    dev = torch.device("cuda")
    vocab, b = 151_936, 8
    s = Sampler(vocab, 16, dev)
    s.enable(SamplerFeatures.all())
    s.admit(0, SamplingParams(temperature=0.0), [1, 2, 3], [2])
    s.admit(1, SamplingParams(temperature=0.8, top_p=0.9, seed=1, logprobs=5), [4], [2])
    s.admit(2, SamplingParams(temperature=1.2, top_k=40, min_p=0.05, seed=2,
                              repetition_penalty=1.2, frequency_penalty=0.5, min_tokens=4),
             [5, 6], [2])
    s.admit(3, SamplingParams(temperature=1.0, min_tokens=3), [], [2])
    logits = torch.randn(b, vocab, device=dev) * 4
    logits[:, 2] = 50.0  # eos dominates: rows below min_tokens must avoid it
    slots = torch.tensor([0, 1, 2, 3, 1, 2, s.dummy_slot, s.dummy_slot], device=dev)
    steps = torch.tensor([0, 1, 2, 0, 5, 6, 0, 0], device=dev)
    active = torch.tensor([False, False, True, True, False, False, False, False], device=dev)
    assert s.counts is not None

    def step() -> SampleOutput:
        out = s.sample(logits, slots, steps, active)
        s.update(slots, out.token_ids)
        return out

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any hidden sync raises
    try:
        # A request joining mid-run: admit/release upload without a sync too.
        s.admit(5, SamplingParams(temperature=0.5, repetition_penalty=1.1, seed=3), [7, 8], [2],
                output_ids=[9])
        s.release(5)
        counts0 = s.counts.clone()
        eager = step()
        counts1 = s.counts.clone()
        s.counts.copy_(counts0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up on a side stream, as torch.cuda.graphs recommends
    torch.cuda.current_stream().wait_stream(stream)
    s.counts.copy_(counts0)
    graph = torch.cuda.CUDAGraph()
    # (graph entry synchronizes by itself; a sync inside capture would fail it)
    with torch.cuda.graph(graph):
        out = step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.equal(out.token_ids, eager.token_ids)
    assert out.logprobs is not None and eager.logprobs is not None
    assert torch.equal(out.logprobs, eager.logprobs)
    assert torch.equal(out.top_ids, eager.top_ids)
    assert torch.equal(s.counts, counts1)  # update() replayed the same counts
    assert int(s.counts.sum() - counts0.sum()) == b
    # Greedy row 0 takes eos (the argmax); rows 2 and 3 are below min_tokens.
    assert int(out.token_ids[0]) == 2
    assert int(out.token_ids[2]) != 2 and int(out.token_ids[3]) != 2
    # The Triton noise path agrees with the torch reference at the real vocab.
    scaled = torch.randn(b, vocab, device=dev)
    k1, k2 = ks.row_keys(s.seed_lo[:b], s.seed_hi[:b], steps)
    ref = ks.gumbel_argmax_ref(scaled, k1, k2, s.token_hash)
    fast = ks.gumbel_argmax_triton(scaled, k1, k2)
    _assert_same_draw(fast, ref, scaled, k1, k2, s.token_hash)


def test_update_is_free_until_a_request_uses_penalties() -> None:
    """Capturing the all-stages graph allocates the penalty counts; decode steps
    must still skip the counting until an admitted request uses penalties."""
    s = Sampler(32, 4, "cpu", seed=0)
    with s.forced_features(SamplerFeatures.all()):
        pass
    assert s.counts is not None and not s.features.penalties
    s.admit(0, SamplingParams(temperature=0.0), [1, 2], [3])
    s.update(torch.tensor([0]), torch.tensor([7]))
    assert int(s.counts.sum()) == 0
    s.admit(1, SamplingParams(temperature=0.0, presence_penalty=1.0), [1, 2], [3])
    s.update(torch.tensor([1]), torch.tensor([7]))
    assert int(s.counts.view(-1, 32)[1, 7]) == 1


# -- grammar bitmask stage (response_format) ----------------------------------------


def _mask_row(allowed: set[int], vocab: int) -> list[int]:
    """int32 words of a bitmask with exactly ``allowed`` set (llguidance's layout)."""
    words = [0] * ks.mask_words(vocab)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return [w - (1 << 32) if w >= 1 << 31 else w for w in words]  # as signed int32


def test_bitmask_stage_bans_exactly_the_masked_tokens() -> None:
    vocab = 70  # three words, the last one partly past the vocabulary
    rng = torch.Generator().manual_seed(0)
    allowed = [{0, 31, 32, 63, 69}, set(range(vocab)) - {5, 33, 64}]
    words = torch.tensor([_mask_row(a, vocab) for a in allowed], dtype=torch.int32)
    logits = torch.randn(2, vocab, generator=rng)
    word_of = torch.arange(vocab) // 32
    bit_of = (torch.arange(vocab) % 32).to(torch.int32)
    out = ks.apply_token_bitmask(logits, words, word_of, bit_of)
    for b, a in enumerate(allowed):
        banned = {t for t in range(vocab) if out[b, t] == float("-inf")}
        assert banned == set(range(vocab)) - a
        kept = sorted(a)
        assert torch.equal(out[b, kept], logits[b, kept])


def test_sampler_grammar_rows_constrain_only_their_slots() -> None:
    s = Sampler(V, 3, "cpu", seed=0)
    s.admit(0, SamplingParams(temperature=0.0), [], [])
    s.admit(1, SamplingParams(temperature=1.0, seed=3, logprobs=2,
                              logit_bias=((4, 100.0),)), [], [], constrained=True)
    assert s.features.grammar
    allowed = {2, 9, 17}
    s.set_grammar_masks(torch.tensor([1], dtype=torch.int32),
                        torch.tensor([_mask_row(allowed, V)], dtype=torch.int32))
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(1))
    logits[:, 4] = 50.0  # the free row's argmax; banned (even with its +100 bias) for slot 1
    for step in range(40):
        out = s.sample(logits, _i64([0, 1]), _i64([step, step]), torch.zeros(2, dtype=torch.bool))
        assert int(out.token_ids[0]) == 4
        assert int(out.token_ids[1]) in allowed
        # Logprobs stay those of the raw model, as for logit_bias.
        raw = torch.log_softmax(logits[1], -1)
        assert out.logprobs is not None
        assert math.isclose(float(out.logprobs[1]), float(raw[out.token_ids[1]]), rel_tol=1e-5)
    # The slot's next owner without a grammar samples freely again.
    s.admit(1, SamplingParams(temperature=0.0), [], [])
    assert int(_sample(s, logits, [1])[0]) == 4


def test_features_of_is_the_union_of_the_batch_rows() -> None:
    s = Sampler(V, 6, "cpu")
    s.admit(0, SamplingParams(temperature=0.0), [], [])
    s.admit(1, SamplingParams(temperature=0.7, seed=1), [], [])
    s.admit(2, SamplingParams(temperature=0.7, top_p=0.9, seed=2), [], [])
    s.admit(3, SamplingParams(temperature=0.0, logprobs=2), [], [])
    assert s.features_of([0, s.dummy_slot]) == SamplerFeatures()
    assert s.features_of([0, 1]) == SamplerFeatures(sampling=True)
    # top-p without a short top-k needs the whole sorted vocabulary; with one, not.
    assert s.features_of([1, 2]) == SamplerFeatures(sampling=True, filtering=True, wide_filter=True)
    s.admit(4, SamplingParams(temperature=0.7, top_p=0.9, top_k=20, min_p=0.1, seed=4), [], [])
    assert s.features_of([1, 4]) == SamplerFeatures(sampling=True, filtering=True)
    assert s.features_of([0, 3]) == SamplerFeatures(logprobs=True)
    s.release(2)
    assert s.features_of([1, 2]) == SamplerFeatures(sampling=True)
    assert s.features.covers(SamplerFeatures(sampling=True, filtering=True, logprobs=True))
    for bits in range(1 << len(dataclasses.fields(SamplerFeatures))):
        assert SamplerFeatures.from_bits(bits).bits == bits


def test_a_step_runs_only_its_rows_stages_with_the_same_tokens() -> None:
    """Rows that need fewer stages than the sampler has enabled: running the
    step's own union (or the smallest captured variant over it) draws exactly
    the tokens of every stage on."""
    from ftserve.engine.cuda_graph import SAMPLER_VARIANTS, sampler_variant

    torch.manual_seed(4)
    logits = torch.randn(5, V)
    s = Sampler(V, 6, "cpu")
    s.admit(0, SamplingParams(temperature=0.0), [], [])
    s.admit(1, SamplingParams(temperature=0.9, seed=3), [], [])
    s.admit(2, SamplingParams(temperature=0.9, seed=4), [], [])
    s.admit(5, SamplingParams(temperature=1.1, top_k=3, presence_penalty=0.5, logprobs=1,
                              logit_bias=((4, 5.0),)), [1, 2], [])  # enables every other stage
    slots = [0, 1, 2, s.dummy_slot, 0]
    steps = [3, 5, 0, 0, 1]
    need = s.features_of(slots)
    assert need == SamplerFeatures(sampling=True)
    everything = _sample(s, logits, slots, steps)
    for f in (need, sampler_variant(need), s.features):
        got = s.sample(logits, _i64(slots), _i64(steps), torch.zeros(5, dtype=torch.bool), features=f)
        assert torch.equal(got.token_ids, everything), f
    greedy = s.sample(logits[:1], _i64([0]), _i64([0]), torch.zeros(1, dtype=torch.bool),
                      features=s.features_of([0]))
    assert greedy.token_ids.item() == logits[0].argmax().item()
    for bits in range(1 << len(dataclasses.fields(SamplerFeatures))):
        want = SamplerFeatures.from_bits(bits)
        v = sampler_variant(want)
        assert v in SAMPLER_VARIANTS and v.covers(want)
    assert sampler_variant(SamplerFeatures()) == SamplerFeatures()
    assert sampler_variant(SamplerFeatures(sampling=True)) == SamplerFeatures(sampling=True)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_min_tokens_yields_only_where_the_grammar_allows_nothing_but_stop_ids(
    monkeypatch: pytest.MonkeyPatch, kernels: str,
) -> None:
    """Below min_tokens the stop ids are masked, except on a row whose grammar
    allows nothing else: there the grammar wins (its completion ends the request),
    rather than a draw from a row with no token left. Torch and the fused draw."""
    if kernels == "triton" and torch.cuda.is_available():
        pytest.skip("an interpreter test: CPU tensors")
    s = Sampler(V, 3, "cpu", seed=0, kernels=KernelConfig(backend=kernels))
    for slot in range(3):
        s.admit(slot, SamplingParams(temperature=1.0, seed=slot, min_tokens=9, stop_token_ids=(7, 8)),
                [], [], constrained=True)
    allowed = [{7, 8}, {7, 8, 20}, {7}]  # only stop ids / one more token / one stop id
    s.set_grammar_masks(torch.tensor([0, 1, 2], dtype=torch.int32),
                        torch.tensor([_mask_row(a, V) for a in allowed], dtype=torch.int32))
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    logits[:, 20] = -30.0  # improbable, yet the only token row 1 has below min_tokens
    for step in range(6):
        got = s.sample(logits, _i64([0, 1, 2]), _i64([step] * 3), torch.ones(3, dtype=torch.bool),
                       features=s.features_of(range(3))).token_ids.tolist()
        assert got[0] in (7, 8) and got[1] == 20 and got[2] == 7, got
