"""Sort-free top-k / top-p / min-p cuts (ftserve_kernels/filter_triton.py)
against the sorting reference (sampling.top_k_top_p_keep & min_p_keep), under
the Triton interpreter on the CPU and at the real vocabulary on the GPU."""

from __future__ import annotations

import pytest
import torch

from ftserve_kernels import sampling as ks
from ftserve_kernels.config import KernelConfig
from ftserve_kernels.filter_triton import apply_cuts_ref, filter_cuts_triton, float_keys
from ftserve_kernels.greedy_triton import greedy_sample_triton

NI = 5


def _reference(scaled: torch.Tensor, k: torch.Tensor, p: torch.Tensor, mp: torch.Tensor) -> torch.Tensor:
    return ks.top_k_top_p_keep(scaled, k, p) & ks.min_p_keep(scaled, mp)


def _rows(vocab: int, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(vocab, generator=g) * 3.0,  # peaked
            torch.randn(vocab, generator=g) * 0.05,  # flat
            torch.randint(-3, 4, (vocab,), generator=g).float(),  # ties everywhere
            torch.full((vocab,), 1.5),  # all tied: the cut's ties run past the candidates
            torch.randn(vocab, generator=g) * 2.0]
    rows[4][: vocab // 2] = float("-inf")  # half masked
    rows[0][7] = -0.0
    rows[0][8] = 0.0  # equal scores, different bits
    rows[0][[3, 5]] = 30.0  # stop ids 3 and 5 of slot 0 on top (masked below min_tokens)
    return torch.stack(rows).to(device)


def _tables(cases: list[tuple[int, float, float]], vocab: int, temps: list[float],
            device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """itab [S, NI + 4] (greedy, top_k, seed lo/hi, n_stops | stops) and ftab [S, 6]
    (temperature, top_p, min_p, ...) for one slot per case; slot 0 stops at 3 and 5."""
    b = len(cases)
    itab = torch.zeros(b + 1, NI + 4, dtype=torch.int64)
    ftab = torch.ones(b + 1, 6)
    for i, ((k, p, mp), t) in enumerate(zip(cases, temps)):
        itab[i, 1] = k if k > 0 else vocab
        itab[i, 2] = 100 + i
        ftab[i, :3] = torch.tensor([t, p, mp])
    itab[0, NI - 1] = 2
    itab[0, NI:NI + 2] = torch.tensor([3, 5])
    return itab.to(device), ftab.to(device)


def _scaled(logits: torch.Tensor, itab: torch.Tensor, ftab: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """The sampler's scores: the stop mask on active rows, then / temperature."""
    b = logits.shape[0]
    cols = torch.arange(itab.shape[1] - NI, device=logits.device)
    stop_active = (cols[None, :] < itab[:b, NI - 1][:, None]) & active[:, None]
    x = ks.mask_token_ids(logits, itab[:b, NI:], stop_active)
    return x / ftab[:b, 0].clamp_min(1e-6)[:, None]


CASES = [  # (top_k, top_p, min_p) per row; 0 = off
    [(3, 1.0, 0.0), (40, 1.0, 0.0), (5, 1.0, 0.0), (256, 1.0, 0.0), (20, 1.0, 0.0)],  # top-k
    # Rows 2 and 3 are tied: their top_p sits between two multiples of a tie's mass
    # (at an exact multiple the float rounding of the cumsum decides, as in torch).
    [(256, 0.9, 0.0), (256, 0.95, 0.0), (100, 0.5037, 0.0), (256, 0.3037, 0.0), (200, 0.8, 0.0)],
    [(20, 0.95, 0.0), (50, 0.8, 0.05), (9, 0.6, 0.0), (4, 0.9, 0.0), (30, 0.7, 0.1)],  # both
    [(0, 1.0, 0.1), (0, 1.0, 0.0), (1, 1.0, 0.5), (7, 1.0, 0.0), (1, 0.2, 0.0)],  # min-p, k=1, off
]
TEMPS = [0.6, 1.0, 0.7, 1.3, 0.9]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("vocab", [1000, 200])
def test_cuts_keep_what_the_sort_keeps(case: int, vocab: int) -> None:
    logits = _rows(vocab, seed=case + vocab)
    cases = [(min(k, vocab), p, mp) for k, p, mp in CASES[case]]
    itab, ftab = _tables(cases, vocab, TEMPS)
    slots = torch.arange(5)
    active = torch.tensor([case % 2 == 0, True, False, True, False])  # slot 0 masks its stops
    cut_key, cut_id, floor = filter_cuts_triton(logits, slots, active, itab, NI, ftab, block=128)
    scaled = _scaled(logits, itab, ftab, active)
    got = apply_cuts_ref(scaled, cut_key, cut_id, floor)
    want = _reference(scaled, itab[:5, 1], ftab[:5, 1], ftab[:5, 2])
    for r in range(5):
        assert torch.equal(got[r], want[r]), (case, r, int(got[r].sum()), int(want[r].sum()))


def test_the_fused_draw_under_cuts_equals_the_filtered_reference_draw() -> None:
    vocab = 1000
    logits = _rows(vocab, seed=4)
    itab, ftab = _tables(CASES[2], vocab, TEMPS)
    itab[2, 0] = 1  # a greedy row among them: the argmax of the masked logits
    slots = torch.tensor([0, 1, 2, 3, 4])
    active = torch.tensor([True, False, False, True, False])
    cuts = filter_cuts_triton(logits, slots, active, itab, NI, ftab)
    scaled = _scaled(logits, itab, ftab, active)
    filtered = torch.where(_reference(scaled, itab[:5, 1], ftab[:5, 1], ftab[:5, 2]), scaled, ks.NEG_INF)
    table = ks.token_hash_table(vocab, "cpu")
    counters = torch.zeros(8, dtype=torch.int32)
    for step in range(6):
        steps = torch.full((5,), step, dtype=torch.int64)
        got = greedy_sample_triton(logits, slots, active, itab, NI, counters, ftab=ftab, steps=steps,
                                   block=256, target_programs=8, cuts=cuts)
        k1, k2 = ks.row_keys(itab[:5, 2], itab[:5, 3], steps)
        want = ks.gumbel_argmax_ref(filtered, k1, k2, table)
        want[2] = (scaled[2] * ftab[2, 0]).argmax()
        assert torch.equal(got, want), step
        assert int(counters.abs().sum()) == 0


def test_sampler_filtering_on_triton_equals_the_sorting_path() -> None:
    """The engine's sampler with the "triton" kernel backend (the interpreter here, CUDA
    in service) draws what the torch path (sort, mask, Gumbel) draws, for a step
    of short filters (the fused path) and one with a top-p alone (the sort)."""
    from ftserve.engine.sampler import Sampler, SamplerFeatures
    from ftserve.engine.sampling_params import SamplingParams

    vocab = 700
    params = [SamplingParams(temperature=0.6, top_p=0.95, top_k=20, seed=1, min_tokens=3, stop_token_ids=(4,)),
              SamplingParams(temperature=1.0, top_k=100, top_p=0.9, seed=2),
              SamplingParams(temperature=0.8, min_p=0.1, seed=3),
              SamplingParams(temperature=0.0),  # greedy next to sampled rows
              SamplingParams(temperature=0.9, seed=6),  # no filter next to filtered rows
              SamplingParams(temperature=1.3, top_k=5, seed=4),
              SamplingParams(temperature=1.0, top_p=0.9, seed=7)]  # top-p alone: wide
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(len(params), vocab, generator=g) * 2.5
    logits[0, 4] = 20.0  # the stop id on top, masked below min_tokens
    out = {}
    for kernels in ("torch", "triton"):
        s = Sampler(vocab, 8, "cpu", kernels=KernelConfig(backend=kernels))
        for slot, sp in enumerate(params):
            s.admit(slot, sp, [], [4] if slot == 0 else [])
        assert s.features_of(range(6)) == SamplerFeatures(sampling=True, filtering=True)
        assert s.features_of(range(7)).wide_filter
        out[kernels] = [s.sample(logits[:n], torch.arange(n), torch.full((n,), step, dtype=torch.int64),
                                 torch.tensor([step < 3] + [False] * (n - 1)),
                                 features=s.features_of(range(n))).token_ids.tolist()
                        for step in range(4) for n in (6, 7)]
    assert out["triton"] == out["torch"]
    assert all(row[0] != 4 for row in out["torch"][:6])  # masked while below min_tokens


@pytest.mark.parametrize("filtering", [False, True])
def test_composed_stages_with_the_fused_draw_equal_the_torch_path(filtering: bool) -> None:
    """Penalties, logit bias and logprobs (the composed stages) on Triton end in
    greedy_triton's one launch (argmax, temperature, Gumbel draw, the copy into
    ``last``): the tokens, logprobs and ``last`` of the torch path."""
    from ftserve.engine.sampler import Sampler
    from ftserve.engine.sampling_params import SamplingParams

    vocab = 600
    top_p = 0.9 if filtering else 1.0
    params = [SamplingParams(temperature=0.8, top_p=top_p, presence_penalty=0.7, seed=1, logprobs=2),
              SamplingParams(temperature=0.0, frequency_penalty=0.5, logit_bias=((3, 5.0),)),
              SamplingParams(temperature=1.1, top_p=top_p, min_p=0.05 if filtering else 0.0,
                             repetition_penalty=1.3, seed=2, min_tokens=2, stop_token_ids=(9,)),
              SamplingParams(temperature=0.7, seed=3, logit_bias=((11, -100.0), (12, 4.0)))]
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(len(params), vocab, generator=g) * 2.0
    logits[2, 9] = 15.0  # the stop id on top: masked below min_tokens
    out = {}
    for kernels in ("torch", "triton"):
        s = Sampler(vocab, 6, "cpu", kernels=KernelConfig(backend=kernels))
        for slot, sp in enumerate(params):
            s.admit(slot, sp, list(range(slot, 40, 3)), [9] if slot == 2 else [])
        feats = s.features_of(range(len(params)))
        assert feats.penalties and feats.bias and feats.logprobs and feats.filtering == filtering
        rows = []
        for step in range(4):
            last = torch.full((8,), -1, dtype=torch.int64)
            o = s.sample(logits, torch.arange(len(params)), torch.full((len(params),), step, dtype=torch.int64),
                         torch.tensor([False, False, step < 2, False]), last=last, features=feats)
            s.update(torch.arange(len(params)), o.token_ids)
            assert torch.equal(last[:len(params)], o.token_ids) and bool((last[len(params):] == -1).all())
            assert o.logprobs is not None
            rows.append((o.token_ids.tolist(), [round(v, 5) for v in o.logprobs.tolist()]))
        out[kernels] = rows
    assert out["triton"] == out["torch"]
    assert all(toks[2] != 9 for toks, _ in out["torch"][:2])


def test_the_sampler_and_the_kernel_agree_on_short_k() -> None:
    from ftserve.engine import sampler
    from ftserve_kernels import filter_triton

    assert sampler.SHORT_K == filter_triton.SHORT_K


def test_float_keys_order_like_the_floats() -> None:
    x = torch.tensor([float("-inf"), -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, float("inf")])
    keys = float_keys(x)
    assert keys[3] == keys[4]
    assert bool((keys[1:] >= keys[:-1]).all()) and len(set(keys.tolist())) == len(x) - 1


@pytest.mark.gpu
def test_cuts_at_the_real_vocabulary_on_the_gpu() -> None:
    """Qwen3's 151,936-token vocabulary, a batch of 8 mixed rows and settings."""
    vocab = 151_936
    g = torch.Generator().manual_seed(21)
    rows = torch.randn(8, vocab, generator=g)
    rows *= torch.tensor([4.0, 0.02, 1.0, 2.5, 6.0, 0.5, 3.0, 1.5])[:, None]  # peaked .. flat
    rows[5, ::3] = float("-inf")
    rows[6] = rows[6].round()  # many ties
    rows[7] = 0.25  # all tied: the full-row tie scan
    logits = rows.cuda()
    cases = [(20, 0.95, 0.0), (256, 0.95, 0.0), (50, 0.8, 0.05), (1, 1.0, 0.0), (100, 0.9, 0.0),
             (256, 0.99, 0.0), (40, 0.7, 0.0), (200, 1.0, 0.2)]
    itab, ftab = _tables(cases, vocab, [0.6, 1.0, 0.7, 1.3, 0.9, 0.8, 1.1, 1.0], "cuda")
    slots = torch.arange(8, device="cuda")
    active = torch.tensor([True] + [False] * 7, device="cuda")
    poison = torch.full((3, 8), 7, dtype=torch.int32, device="cuda")
    del poison
    cuts = filter_cuts_triton(logits, slots, active, itab, NI, ftab)
    scaled = _scaled(logits, itab, ftab, active)
    want = _reference(scaled, itab[:8, 1], ftab[:8, 1], ftab[:8, 2])
    got = apply_cuts_ref(scaled, *cuts)
    for r in range(8):
        assert torch.equal(got[r], want[r]), (r, int(got[r].sum()), int(want[r].sum()))
    table = ks.token_hash_table(vocab, "cuda")
    steps = torch.full((8,), 2, dtype=torch.int64, device="cuda")
    counters = torch.zeros(8, dtype=torch.int32, device="cuda")
    drawn = greedy_sample_triton(logits, slots, active, itab, NI, counters, ftab=ftab, steps=steps, cuts=cuts)
    k1, k2 = ks.row_keys(itab[:8, 2], itab[:8, 3], steps)
    assert torch.equal(drawn, ks.gumbel_argmax_ref(torch.where(want, scaled, ks.NEG_INF), k1, k2, table))
