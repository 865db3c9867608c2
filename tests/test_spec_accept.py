"""The acceptance rule: verify steps sampled by the real Sampler keep the tokens
plain decoding samples (same seed, token for token), and so the target
distribution: chi-square tests over many seeds on a six-token vocabulary."""

from __future__ import annotations

import pytest
import torch

from ftserve.engine.sampler import Sampler
from ftserve.engine.sampling_params import SamplingParams
from ftserve.engine.spec.accept import accepted_length, kept_tokens

V = 6
SEEDS = 800
BASES = 12  # independent step bases per seed: SEEDS * BASES trials
# A bigram "model": the logits after token t are BIGRAM[t]; the context's logits L0.
L0 = torch.tensor([1.2, 0.3, -0.5, 0.9, 0.0, -1.5])
BIGRAM = torch.tensor([[0.5, 1.0, -1.0, 0.2, 0.0, 0.3],
                       [1.5, -0.2, 0.4, 0.0, -1.0, 0.8],
                       [0.0, 0.0, 2.0, -0.5, 0.5, 0.1],
                       [-0.3, 1.1, 0.6, 0.0, 0.9, -0.7],
                       [0.2, 0.2, 0.2, 1.4, -2.0, 0.0],
                       [1.0, -1.0, 0.5, 0.5, 0.0, 1.2]])


def test_accepted_length() -> None:
    assert accepted_length([4, 5, 6], [4, 5, 9, 1]) == 2
    assert accepted_length([4, 5, 6], [3, 5, 6, 1]) == 0
    assert accepted_length([4, 5], [4, 5, 7]) == 2
    assert accepted_length([], [7]) == 0
    assert kept_tokens([4, 5, 6], [4, 5, 9, 1]) == [4, 5, 9]
    assert kept_tokens([4, 5, 6], [4, 5, 6, 1]) == [4, 5, 6, 1]
    assert kept_tokens([4], [2, 8]) == [2]


def target(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the sampler draws from: softmax of logits / T over the top-k."""
    x = logits / params.temperature
    if params.top_k > 0:
        cut = x.topk(params.top_k).values[-1]
        x = torch.where(x >= cut, x, float("-inf"))
    return torch.softmax(x.double(), dim=-1)


def chi2_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square p-value of observed counts against probabilities
    (cells of zero probability must be empty)."""
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token outside the support was drawn"
    n = counts.sum().double()
    exp = probs[keep] * n
    stat = ((counts[keep].double() - exp) ** 2 / exp).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def _sampler(params: SamplingParams) -> Sampler:
    s = Sampler(V, SEEDS, "cpu")
    for i in range(SEEDS):
        s.admit(i, SamplingParams(**{**params.__dict__, "seed": 7919 * i + 13}), [0], [])
    return s


def _draw(s: Sampler, logits: torch.Tensor, slots: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    off = torch.zeros(len(slots), dtype=torch.bool)
    return s.sample(logits, slots, steps, off, features=s.features_of(range(SEEDS))).token_ids


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8),
                                    SamplingParams(temperature=1.3, top_k=4),
                                    SamplingParams(temperature=0.0)], ids=["t0.8", "t1.3-k4", "greedy"])
def test_verify_keeps_plain_sampling(params: SamplingParams) -> None:
    """A verify step over a two-token draft d = (0, 1) — the context's likeliest
    token and then its bigram's — versus plain decoding, seed by seed: the kept
    tokens are a prefix of plain decoding's. Then, over all trials: the first
    token is distributed as p0 (chi-square), the draft's first token is kept
    with probability p0(d1) (a z-test of the rejection-sampling rate), a rejected
    position is distributed as p0 without d1, and the token after an accepted
    d1 as p(. | d1)."""
    s = _sampler(params)
    d1, d2 = 0, 1
    slots = torch.arange(SEEDS).repeat(BASES)  # [N]
    base = (torch.arange(BASES) * 3 + 5).repeat_interleave(SEEDS)  # [N] output index of y_0
    n = len(slots)
    # Verify: the rows of positions 0, 1, 2 (contexts: c, c d1, c d1 d2).
    y0 = _draw(s, L0.expand(n, V), slots, base)
    y1 = _draw(s, BIGRAM[d1].expand(n, V), slots, base + 1)
    y2 = _draw(s, BIGRAM[d2].expand(n, V), slots, base + 2)
    # Plain decoding: one token at a time, each in the context of the last.
    p0 = _draw(s, L0.expand(n, V), slots, base)
    p1 = _draw(s, BIGRAM[p0], slots, base + 1)
    p2 = _draw(s, BIGRAM[p1], slots, base + 2)
    kept = [kept_tokens([d1, d2], [int(a), int(b), int(c)]) for a, b, c in zip(y0, y1, y2)]
    plain = torch.stack([p0, p1, p2], 1).tolist()
    for k, p in zip(kept, plain):
        assert k == p[:len(k)], (k, p)
    if params.greedy:
        assert all(len(k) == 3 for k in kept)  # argmax chain 0 -> 1 -> (bigram 1's argmax)
        return
    first = torch.bincount(y0, minlength=V)
    probs0 = target(L0, params)
    assert chi2_p(first, probs0) > 1e-3
    accepted = y0 == d1
    rate, expect = accepted.double().mean(), probs0[d1]
    assert abs(rate - expect) < 4 * (expect * (1 - expect) / n) ** 0.5
    residual = probs0.clone()
    residual[d1] = 0
    assert chi2_p(torch.bincount(y0[~accepted], minlength=V), residual / residual.sum()) > 1e-3
    assert chi2_p(torch.bincount(y1[accepted], minlength=V), target(BIGRAM[d1], params)) > 1e-3


def test_chi_square_sees_a_wrong_rule() -> None:
    """The same test rejects a plausible wrong rule: on rejection, redraw from all
    of p (the draft token included), which over-weights it."""
    params = SamplingParams(temperature=0.8)
    s = _sampler(params)
    slots = torch.arange(SEEDS).repeat(BASES)
    base = (torch.arange(BASES) * 3 + 5).repeat_interleave(SEEDS)
    n = len(slots)
    d1 = 0
    y0 = _draw(s, L0.expand(n, V), slots, base)
    redraw = _draw(s, L0.expand(n, V), slots, base + 1000)  # fresh noise, full p
    wrong = torch.where(y0 == d1, y0, redraw)
    assert chi2_p(torch.bincount(wrong, minlength=V), target(L0, params)) < 1e-6
