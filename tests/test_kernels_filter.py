"""Sort-free top-k / top-p / min-p cuts (ftserve_kernels/filter_triton.py)
against the sorting reference (sampling.top_k_top_p_keep & min_p_keep), under
the Triton interpreter on the CPU and at the real vocabulary on the GPU."""

from __future__ import annotations

import pytest
import torch

from ftserve_kernels import sampling as ks
from ftserve_kernels.filter_triton import (
    apply_cuts_ref,
    filter_cuts_triton,
    float_keys,
    tie_broken_keys,
)


def _reference(scaled: torch.Tensor, k: torch.Tensor, p: torch.Tensor, mp: torch.Tensor) -> torch.Tensor:
    return ks.top_k_top_p_keep(scaled, k, p) & ks.min_p_keep(scaled, mp)


def _rows(vocab: int, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(vocab, generator=g) * 3.0,  # peaked
            torch.randn(vocab, generator=g) * 0.05,  # flat: a big nucleus
            torch.randint(-3, 4, (vocab,), generator=g).float(),  # ties everywhere
            torch.full((vocab,), 1.5),  # all tied
            torch.randn(vocab, generator=g) * 2.0]
    rows[4][: vocab // 2] = float("-inf")  # half masked (grammar, stop ids)
    rows[0][7] = -0.0
    rows[0][8] = 0.0  # equal scores, different bits
    return torch.stack(rows).to(device)


CASES = [  # (top_k, top_p, min_p) per row
    [(3, 1.0, 0.0), (40, 1.0, 0.0), (5, 1.0, 0.0), (7, 1.0, 0.0), (20, 1.0, 0.0)],  # top-k
    # Rows 2 and 3 are tied: their top_p sits between two multiples of a tie's mass
    # (at an exact multiple the float rounding of the cumsum decides, as in torch).
    [(256, 0.9, 0.0), (256, 0.95, 0.0), (100, 0.5037, 0.0), (256, 0.3037, 0.0), (200, 0.8, 0.0)],  # top-p
    [(20, 0.95, 0.0), (50, 0.8, 0.05), (9, 0.6, 0.0), (4, 0.9, 0.0), (30, 0.7, 0.1)],  # both
    [(0, 1.0, 0.1), (0, 1.0, 0.0), (1, 1.0, 0.5), (0, 1.0, 0.0), (1, 0.2, 0.0)],  # min-p, k=1, off
    [(256, 1.0, 0.0), (255, 0.99, 0.0), (256, 0.999, 0.02), (256, 0.9037, 0.0), (64, 0.9, 0.0)],  # long k
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("vocab", [1000, 3001, 200])
def test_cuts_keep_what_the_sort_keeps(case: int, vocab: int) -> None:
    scaled = _rows(vocab, seed=case + vocab)
    k = torch.tensor([min(c[0], vocab) if c[0] > 0 else vocab for c in CASES[case]])
    p = torch.tensor([c[1] for c in CASES[case]])
    mp = torch.tensor([c[2] for c in CASES[case]])
    cut_key, cut_id, floor = filter_cuts_triton(scaled, k, p, mp)
    got = apply_cuts_ref(scaled, cut_key, cut_id, floor)
    want = _reference(scaled, k, p, mp)
    for r in range(scaled.shape[0]):
        assert torch.equal(got[r], want[r]), (case, r, int(got[r].sum()), int(want[r].sum()))


def test_the_sampler_and_the_kernel_agree_on_short_k() -> None:
    from ftserve.engine import sampler
    from ftserve_kernels import filter_triton

    assert sampler.SHORT_K == filter_triton.SHORT_K


def test_float_keys_order_like_the_floats() -> None:
    x = torch.tensor([float("-inf"), -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, float("inf")])
    keys = float_keys(x)
    assert keys[3] == keys[4]
    assert bool((keys[1:] >= keys[:-1]).all()) and len(set(keys.tolist())) == len(x) - 1
    tied = tie_broken_keys(torch.tensor([[1.0, 2.0, 1.0, -0.0, 0.0]]))
    assert tied[0].argsort(descending=True).tolist() == [1, 0, 2, 3, 4]  # ties by id


def test_draw_under_cuts_equals_the_filtered_reference_draw() -> None:
    vocab = 1000
    scaled = _rows(vocab, seed=4)
    k = torch.tensor([20, 256, 9, 4, 30])
    p = torch.tensor([0.95, 0.8, 0.6, 0.9, 0.7])
    mp = torch.tensor([0.0, 0.05, 0.0, 0.0, 0.1])
    cuts = filter_cuts_triton(scaled, k, p, mp)
    filtered = torch.where(_reference(scaled, k, p, mp), scaled, ks.NEG_INF)
    table = ks.token_hash_table(vocab, "cpu")
    for step in range(6):
        k1, k2 = ks.row_keys(torch.arange(5, dtype=torch.int64) + 11, torch.zeros(5, dtype=torch.int64),
                             torch.full((5,), step, dtype=torch.int64))
        got = ks.gumbel_argmax_triton(scaled, k1, k2, block=256, target_programs=8, cuts=cuts)
        assert torch.equal(got, ks.gumbel_argmax_ref(filtered, k1, k2, table)), step


def test_sampler_filtering_on_triton_equals_the_sorting_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's sampler with FTSERVE_KERNELS=triton (the interpreter here, CUDA
    in service) draws what the torch path (sort, mask, Gumbel) draws."""
    from ftserve.engine.sampler import Sampler, SamplerFeatures
    from ftserve.engine.sampling_params import SamplingParams

    vocab = 700
    params = [SamplingParams(temperature=0.6, top_p=0.95, top_k=20, seed=1),
              SamplingParams(temperature=1.0, top_k=100, top_p=0.9, seed=2),
              SamplingParams(temperature=0.8, min_p=0.1, seed=3),
              SamplingParams(temperature=0.0),  # greedy next to sampled rows
              SamplingParams(temperature=0.9, seed=6),  # no filter next to filtered rows
              SamplingParams(temperature=1.3, top_k=5, seed=4)]
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(len(params), vocab, generator=g) * 2.5
    out = {}
    for kernels in ("torch", "triton"):
        monkeypatch.setenv("FTSERVE_KERNELS", kernels)
        s = Sampler(vocab, 8, "cpu")
        for slot, sp in enumerate(params):
            s.admit(slot, sp, [], [])
        slots = torch.arange(len(params), dtype=torch.int64)
        out[kernels] = [s.sample(logits, slots, torch.full((len(params),), step, dtype=torch.int64),
                                 torch.zeros(len(params), dtype=torch.bool)).token_ids.tolist()
                        for step in range(4)]
    assert out["triton"] == out["torch"]
    assert s.features_of(range(len(params))) == SamplerFeatures(sampling=True, filtering=True)
    s.admit(5, SamplingParams(temperature=1.0, top_p=0.9, seed=7), [], [])  # top-p alone: wide
    assert s.features_of([0, 5]).wide_filter and not s.features_of([0, 1, 2]).wide_filter


@pytest.mark.gpu
def test_cuts_at_the_real_vocabulary_on_the_gpu() -> None:
    """Qwen3's 151,936-token vocabulary, a batch of 8 mixed rows and settings;
    outputs poisoned before the run (torch.empty buffers are refilled)."""
    vocab = 151_936
    g = torch.Generator().manual_seed(21)
    rows = torch.randn(8, vocab, generator=g)
    rows *= torch.tensor([4.0, 0.02, 1.0, 2.5, 6.0, 0.5, 3.0, 1.5])[:, None]  # peaked .. flat
    rows[5, ::3] = float("-inf")
    rows[6] = rows[6].round()  # many ties
    scaled = rows.cuda()
    k = torch.tensor([20, 256, 50, 1, 100, 256, 40, vocab]).cuda()
    p = torch.tensor([0.95, 0.95, 0.8, 1.0, 0.9, 0.99, 0.7, 1.0]).cuda()
    mp = torch.tensor([0.0, 0.0, 0.05, 0.0, 0.0, 0.0, 0.0, 0.2]).cuda()
    poison = torch.full((3, 8), 7, dtype=torch.int32, device="cuda")
    del poison
    cut_key, cut_id, floor = filter_cuts_triton(scaled, k, p, mp)
    got = apply_cuts_ref(scaled, cut_key, cut_id, floor)
    want = _reference(scaled, k, p, mp)
    for r in range(8):
        assert torch.equal(got[r], want[r]), (r, int(got[r].sum()), int(want[r].sum()))
    table = ks.token_hash_table(vocab, "cuda")
    k1, k2 = ks.row_keys(torch.arange(8, device="cuda") + 3, torch.zeros(8, dtype=torch.int64, device="cuda"),
                         torch.full((8,), 2, dtype=torch.int64, device="cuda"))
    drawn = ks.gumbel_argmax_triton(scaled, k1, k2, cuts=(cut_key, cut_id, floor))
    assert torch.equal(drawn, ks.gumbel_argmax_ref(torch.where(want, scaled, ks.NEG_INF), k1, k2, table))
