"""The sampling noise at the ends of its range: a masked token is never drawn.

The Gumbel noise of a (seed, step, token) is a pure function of a 32-bit hash;
where the hash's top bits are all ones the uniform sits at the top of its
range. These tests use such keys (found once by a search over seeds and steps,
and checked here) with every stage that takes tokens away: the grammar mask,
top-k, top-p (sort-free and sorting), min-p, a logit_bias of -100, the stop ids
below min_tokens, on the torch path and on the Triton kernels (the interpreter
here). The drawn token must be one the stages keep, and a token ~80 nats below
the rest (probability e^-80) must never come out of a faithful draw."""

from __future__ import annotations

import math

import pytest
import torch

from ftserve.engine.sampler import Sampler
from ftserve.engine.sampling_params import SamplingParams
from ftserve_kernels import sampling as ks
from ftserve_kernels.config import KernelConfig
from ftserve_kernels.greedy_triton import greedy_sample_ref, greedy_sample_triton

VOCAB = 1024
# (seed, step, token) whose hash has its top 24 bits set, at VOCAB tokens: the
# largest uniform the noise can draw lands on `token`.
EXTREMES = [(11, 39, 979), (166, 6, 358), (787, 63, 482), (863, 62, 238), (1360, 39, 244),
            (1394, 45, 1022), (1660, 63, 1016), (1987, 63, 946), (2328, 49, 467), (2440, 13, 281),
            (2503, 7, 242), (2769, 20, 677)]
MANY = 36  # more rows: random seeds and steps, a random token banned in each


def _rows() -> tuple[list[int], list[int], list[int]]:
    """(seeds, steps, target tokens): the extreme keys, then MANY random ones."""
    g = torch.Generator().manual_seed(29)
    seeds = [s for s, _, _ in EXTREMES] + torch.randint(0, 2**62, (MANY,), generator=g).tolist()
    steps = [st for _, st, _ in EXTREMES] + torch.randint(0, 4096, (MANY,), generator=g).tolist()
    targets = [t for _, _, t in EXTREMES] + torch.randint(0, VOCAB, (MANY,), generator=g).tolist()
    return seeds, steps, targets


def _keys(seeds: list[int], steps: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    halves = [ks.split_seed(s) for s in seeds]
    return ks.row_keys(torch.tensor([lo for lo, _ in halves]), torch.tensor([hi for _, hi in halves]),
                       torch.tensor(steps))


def _mask_row(allowed: set[int], vocab: int) -> list[int]:
    """int32 words of a bitmask with exactly ``allowed`` set (llguidance's layout)."""
    words = [0] * ks.mask_words(vocab)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return [w - (1 << 32) if w >= 1 << 31 else w for w in words]  # as signed int32


def test_the_keys_are_extremes_and_the_noise_stays_finite_there() -> None:
    seeds, steps, targets = _rows()
    table = ks.token_hash_table(VOCAB, "cpu")
    k1, k2 = _keys(seeds, steps)
    h = ks.mix32(ks.mix32(table[None, :] ^ k1[:, None]) ^ k2[:, None])  # [B, V]
    n = len(EXTREMES)
    top = torch.tensor(targets[:n])
    assert bool(((h[:n].gather(1, top[:, None]) >> 8) == (1 << 24) - 1).all()), "not extreme keys"
    u = ks.uniform_ref(k1, k2, table)  # [B, V]
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0, "the uniform must stay inside (0, 1)"
    gumbel = -torch.log(-torch.log(u))
    assert bool(torch.isfinite(gumbel).all())
    # The largest draw is the top of the range, finite: ~17 at most.
    assert 15.0 < float(gumbel[:n].gather(1, top[:, None]).min()) < 18.0


def _stage(name: str, token: int, seed: int) -> tuple[SamplingParams, bool]:
    """(params, constrained) for a row whose stage ``name`` bans ``token``."""
    p: dict[str, object] = {"temperature": 1.0, "seed": seed}
    if name == "top_k":
        p["top_k"] = 5
    elif name == "top_p_short":
        p.update(top_k=64, top_p=0.5)
    elif name == "top_p_wide":
        p["top_p"] = 0.5
    elif name == "min_p":
        p["min_p"] = 0.2
    elif name == "logit_bias_ban":
        p["logit_bias"] = ((token, -100.0),)
    elif name == "stop_below_min_tokens":
        p.update(stop_token_ids=(token,), min_tokens=5)
    return SamplingParams(**p), name == "grammar"  # type: ignore[arg-type]


STAGES = ["grammar", "top_k", "top_p_short", "top_p_wide", "min_p", "logit_bias_ban",
          "stop_below_min_tokens", "improbable"]


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("stage", STAGES)
def test_no_stage_lets_a_banned_token_through_at_the_noise_extremes(
    monkeypatch: pytest.MonkeyPatch, stage: str, kernels: str,
) -> None:
    """The sampler at temperature 1, one row per key, each row's target token banned
    by ``stage`` (or, "improbable", left 80 nats below the rest): never drawn."""
    # Triton: the interpreter on CPU tensors here, the compiled kernels on a GPU.
    dev = "cuda" if kernels == "triton" and torch.cuda.is_available() else "cpu"
    seeds, steps, targets = _rows()
    # A token a stage bans by identity sits on top; one a filter cuts sits low.
    cut = stage in ("top_k", "top_p_short", "top_p_wide", "min_p")
    if dev == "cpu" and kernels == "triton":
        # The interpreter spends ~0.4 s a row in the draw and ~2.5 s in a filter's
        # cut (its sort): a few extreme keys per stage, all twelve over the stages.
        pick = [(3 * STAGES.index(stage) + i) % len(EXTREMES) for i in range(1 if cut else 3)]
        seeds, steps, targets = ([xs[i] for i in pick] for xs in (seeds, steps, targets))
    b = len(seeds)
    g = torch.Generator().manual_seed(STAGES.index(stage))
    logits = 1.5 * torch.randn(b, VOCAB, generator=g)  # [B, V]
    rows = torch.arange(b)
    tgt = torch.tensor(targets)
    logits[rows, tgt] = -80.0 if stage == "improbable" else -8.0 if cut else 8.0
    s = Sampler(VOCAB, b, dev, seed=0, kernels=KernelConfig(backend=kernels))
    allowed: list[set[int]] = []
    for r in range(b):
        params, constrained = _stage(stage, targets[r], seeds[r])
        s.admit(r, params, [], [], constrained=constrained)
        others = torch.randperm(VOCAB, generator=g)[: VOCAB // 2].tolist()
        allowed.append(set(others) - {targets[r]})
    if stage == "grammar":
        words = torch.tensor([_mask_row(a, VOCAB) for a in allowed], dtype=torch.int32)
        s.set_grammar_masks(rows.to(torch.int32).to(dev), words.to(dev))
    active = torch.full((b,), stage == "stop_below_min_tokens")
    out = s.sample(logits.to(dev), rows.to(dev), torch.tensor(steps, device=dev), active.to(dev),
                   features=s.features_of(range(b)))
    drawn = out.token_ids.cpu()
    assert not bool((drawn == tgt).any()), [(seeds[r], steps[r]) for r in range(b) if drawn[r] == tgt[r]]
    if stage == "grammar":
        assert all(int(drawn[r]) in allowed[r] for r in range(b))
    if cut:
        keep = (ks.top_k_top_p_keep(logits, s.top_k[:b].cpu(), s.top_p[:b].cpu())
                & ks.min_p_keep(logits, s.min_p[:b].cpu()))
        assert bool(keep.gather(1, drawn[:, None]).all())


NI = 5


@pytest.mark.skipif(torch.cuda.is_available(), reason="an interpreter test: CPU tensors")
def test_every_draw_kernel_skips_banned_and_improbable_tokens_at_the_extremes() -> None:
    """The draws themselves, each twin and kernel: the reference Gumbel-max, the
    Triton Gumbel-max (the sorting path's draw on CUDA), the fused greedy kernel
    in temperature mode and its reference. Half the rows ban the target (-inf),
    half leave it 80 nats below the rest. The extreme keys only (the interpreter
    is slow)."""
    seeds, steps, targets = (xs[:len(EXTREMES)] for xs in _rows())
    b = len(seeds)
    g = torch.Generator().manual_seed(5)
    scores = torch.randn(b, VOCAB, generator=g)  # [B, V]
    rows = torch.arange(b)
    tgt = torch.tensor(targets)
    scores[rows, tgt] = torch.where(rows % 2 == 0, -math.inf, -80.0)
    k1, k2 = _keys(seeds, steps)
    table = ks.token_hash_table(VOCAB, "cpu")
    itab = torch.zeros(b, NI + 1, dtype=torch.int64)
    halves = [ks.split_seed(s) for s in seeds]
    itab[:, 2] = torch.tensor([lo for lo, _ in halves])
    itab[:, 3] = torch.tensor([hi for _, hi in halves])
    ftab = torch.ones(b, 1)  # temperature 1
    inactive = torch.zeros(b, dtype=torch.bool)
    counters = torch.zeros(b + 1, dtype=torch.int32)
    draws = {
        "gumbel_argmax_ref": ks.gumbel_argmax_ref(scores, k1, k2, table),
        "gumbel_argmax_triton": ks.gumbel_argmax_triton(scores, k1, k2, block=256, target_programs=8),
        "greedy_sample_ref": greedy_sample_ref(scores, rows, inactive, itab, NI, ftab, torch.tensor(steps)),
        "greedy_sample_triton": greedy_sample_triton(scores, rows, inactive, itab, NI, counters,
                                                     ftab=ftab, steps=torch.tensor(steps),
                                                     block=256, target_programs=8),
    }
    for name, drawn in draws.items():
        assert not bool((drawn == tgt).any()), (name, drawn.eq(tgt).nonzero().flatten().tolist())
    assert torch.equal(draws["gumbel_argmax_triton"], draws["gumbel_argmax_ref"])
    assert torch.equal(draws["greedy_sample_triton"], draws["greedy_sample_ref"])
