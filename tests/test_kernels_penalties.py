"""Penalties in one launch (ftserve_kernels/penalties_triton.py) against the
reference (sampling.apply_penalties_ref over the rows gathered by slot), under
the Triton interpreter on the CPU and at the real vocabulary on the GPU; and
the sampler's fused path for penalized steps with short filters (the graph
variant that Qwen3-Coder's generation_config defaults land on)."""

from __future__ import annotations

import pytest
import torch

from ftserve_kernels import sampling as ks
from ftserve_kernels.config import KernelConfig
from ftserve_kernels.penalties_triton import apply_penalties_triton


def _state(slots: int, vocab: int, seed: int, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """counts [S, V] int32, prompt_mask [S, V] bool, ftab [S, 6] (temperature, top_p,
    min_p, repetition, presence, frequency); slot 0 neutral, the others mixed."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 4, (slots, vocab), generator=g, dtype=torch.int32)
    counts[counts == 1] = 0  # most tokens unseen
    prompt = torch.rand(slots, vocab, generator=g) < 0.3
    ftab = torch.ones(slots, 6)
    ftab[:, 4:] = 0.0
    for s in range(1, slots):
        ftab[s, 3] = [1.05, 1.3, 0.8, 1.0][s % 4]
        ftab[s, 4] = [0.0, 0.7, -0.5, 1.5][s % 4]
        ftab[s, 5] = [0.0, 0.0, 0.25, 2.0][s % 4]
    return counts.to(device), prompt.to(device), ftab.to(device)


def _logits(rows: int, vocab: int, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 3.0
    x[0, ::7] = float("-inf")  # masked tokens stay masked
    x[:, 5] = 0.0  # neither > 0 nor < 0
    x[:, 6] = -0.0
    return x.to(device)


def _reference(logits: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor,
               prompt: torch.Tensor, ftab: torch.Tensor) -> torch.Tensor:
    f = ftab.index_select(0, slots)
    return ks.apply_penalties_ref(logits.float(), counts.index_select(0, slots),
                                  prompt.index_select(0, slots), f[:, 3], f[:, 4], f[:, 5])


@pytest.mark.parametrize(("vocab", "block", "programs"), [(1000, 128, 8), (3001, 256, 64), (513, 1024, 264)])
def test_kernel_equals_reference(vocab: int, block: int, programs: int) -> None:
    counts, prompt, ftab = _state(5, vocab, seed=vocab)
    logits = _logits(6, vocab, seed=1)
    slots = torch.tensor([0, 1, 2, 3, 4, 2])  # a slot twice: rows read their slot in place
    got = apply_penalties_triton(logits, slots, counts, prompt, ftab, block=block, target_programs=programs)
    want = _reference(logits, slots, counts, prompt, ftab)
    assert torch.equal(got, want)
    assert torch.equal(got[0], logits[0])  # the neutral slot: an exact no-op
    assert not torch.equal(got[2], logits[2])


def test_bf16_logits_are_read_as_fp32() -> None:
    counts, prompt, ftab = _state(3, 700, seed=2)
    logits = _logits(3, 700, seed=3).bfloat16()
    slots = torch.tensor([2, 1, 0])
    got = apply_penalties_triton(logits, slots, counts, prompt, ftab, block=128)
    assert got.dtype == torch.float32
    assert torch.equal(got, _reference(logits, slots, counts, prompt, ftab))


def test_penalized_short_filter_steps_take_the_fused_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """the "triton" kernel backend: a step whose rows use penalties and short filters
    (and greedy rows with a repetition penalty) runs penalties_triton, the cuts and
    the fused draw, and draws what the torch path draws, step after step as the
    counts grow; the CUDA graphs replay their own variant for it."""
    from ftserve.engine import cuda_graph, sampler
    from ftserve.engine.sampler import Sampler, SamplerFeatures
    from ftserve.engine.sampling_params import SamplingParams

    vocab = 800
    params = [SamplingParams(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05, seed=1),
              SamplingParams(temperature=0.0, repetition_penalty=1.3),  # greedy, penalized
              SamplingParams(temperature=1.0, top_k=50, presence_penalty=1.5, frequency_penalty=0.5, seed=2,
                             min_tokens=2, stop_token_ids=(9,)),
              SamplingParams(temperature=0.6, top_k=20, top_p=0.95, seed=3)]  # no penalty beside them
    need = SamplerFeatures(sampling=True, filtering=True, penalties=True)
    assert cuda_graph.sampler_variant(need) == need
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(len(params), vocab, generator=g) * 2.0
    logits[1, 30:40] += 6.0  # the greedy row's favourites: the penalty moves it among them
    logits[2, 9] = 15.0  # the stop id on top, masked below min_tokens
    calls = []
    real = sampler.apply_penalties_triton

    def spy(*args: object, **kw: object) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(sampler, "apply_penalties_triton", spy)
    out = {}
    for kernels in ("torch", "triton"):
        s = Sampler(vocab, 6, "cpu", kernels=KernelConfig(backend=kernels))
        for slot, sp in enumerate(params):
            s.admit(slot, sp, list(range(30 + slot, 40, 2)), [9] if slot == 2 else [])
        feats = s.features_of(range(len(params)))
        assert feats == need
        rows = []
        slots = torch.arange(len(params))
        for step in range(6):
            o = s.sample(logits, slots, torch.full((len(params),), step, dtype=torch.int64),
                         torch.tensor([False, False, step < 2, False]), features=feats)
            s.update(slots, o.token_ids)
            rows.append(o.token_ids.tolist())
        out[kernels] = rows
    assert len(calls) == 6  # the triton run only, once a step
    assert out["triton"] == out["torch"]
    assert len({r[1] for r in out["torch"]}) > 1  # the greedy row's penalty moved it
    assert all(r[2] != 9 for r in out["torch"][:2])


@pytest.mark.gpu
def test_kernel_at_the_real_vocabulary_on_the_gpu() -> None:
    """Qwen3's vocabulary, 8 rows of mixed slots: within one fp32 rounding of the
    reference (an FMA may fuse the frequency term), exact where frequency is 0."""
    vocab = 151_936
    counts, prompt, ftab = _state(6, vocab, seed=5, device="cuda")
    logits = _logits(8, vocab, seed=6, device="cuda").bfloat16()
    slots = torch.tensor([0, 1, 2, 3, 4, 5, 1, 3], device="cuda")
    got = apply_penalties_triton(logits, slots, counts, prompt, ftab)
    want = _reference(logits, slots, counts, prompt, ftab)
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite)
    assert torch.allclose(got[finite], want[finite], rtol=2e-7, atol=1e-6)
    no_freq = (ftab.index_select(0, slots)[:, 5] == 0).cpu()
    assert torch.equal(got[no_freq], want[no_freq])
