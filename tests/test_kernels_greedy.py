"""The fused greedy sampler (ftserve_kernels/greedy_triton.py) against its twin,
under the Triton interpreter on the CPU (real shapes on the GPU), and the
Sampler taking it for greedy-only steps."""

from __future__ import annotations

import pytest
import torch

from ftserve.engine.sampler import Sampler, SamplerFeatures
from ftserve.engine.sampling_params import SamplingParams
from ftserve_kernels.bookkeeping import StagedRows
from ftserve_kernels.config import KernelConfig
from ftserve_kernels.greedy_triton import greedy_sample_ref, greedy_sample_triton

NI = 5


# The tests without the gpu mark build CPU tensors for the Triton interpreter
# (conftest sets it where no GPU is): a CUDA machine runs the gpu-marked ones.
interpreter_only = pytest.mark.skipif(torch.cuda.is_available(), reason="an interpreter test: CPU tensors")


def _itab(stops: dict[int, list[int]], slots: int, m: int) -> torch.Tensor:
    t = torch.zeros(slots, NI + m, dtype=torch.int64)
    for slot, ids in stops.items():
        t[slot, NI - 1] = len(ids)
        t[slot, NI:NI + len(ids)] = torch.tensor(ids)
    return t


@interpreter_only
@pytest.mark.parametrize("vocab,block,programs", [(1000, 256, 8), (3001, 128, 5), (77, 1024, 264)])
def test_greedy_kernel_equals_reference(vocab: int, block: int, programs: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    itab = _itab({1: [7, 60], 2: [3, 3, vocab - 1], 4: [0]}, 6, 4)
    counters = torch.zeros(8, dtype=torch.int32)
    for trial in range(3):
        b = 5
        logits = torch.randn(b, vocab, generator=g)
        logits[0, 5] = logits[0, vocab // 2] = 50.0  # a tie: the lower index wins
        logits[1, 7], logits[1, 60], logits[1, 30] = 60.0, 59.0, 58.0  # masked below min_tokens
        logits[2, vocab - 1], logits[2, 3] = 70.0, 69.0
        logits[3] = float("-inf")  # nothing finite: index 0, as torch.argmax
        logits[4, 0] = 80.0
        slots = torch.tensor([0, 1, 2, 5, 4])
        active = torch.tensor([False, True, trial != 1, True, trial == 2])
        last = torch.full((8,), -1, dtype=torch.int64)
        poisoned = torch.full((4, 4), 7)  # keep the allocator from handing back zeros
        got = greedy_sample_triton(logits.to(torch.bfloat16 if trial == 0 else torch.float32),
                                   slots, active, itab, NI, counters, last, block=block,
                                   target_programs=programs)
        ref = greedy_sample_ref(logits.to(torch.bfloat16 if trial == 0 else torch.float32),
                                slots, active, itab, NI)
        del poisoned
        assert torch.equal(got, ref), (trial, got, ref)
        assert torch.equal(last[:b], ref) and torch.equal(last[b:], torch.full((3,), -1))
        assert int(counters.abs().sum()) == 0, "arrival counters must be left at zero"
        assert got[1] == 30 if active[1] else got[1] == 7


@interpreter_only
@pytest.mark.parametrize("rows", [1, 3])
def test_greedy_kernel_stores_the_tokens_into_the_staged_row(rows: int) -> None:
    """host_out: the tokens also land in the row of the pair that the word
    picks (the rest of the pair untouched) and the word toggles once per
    launch, after every row stored; all counters are left at zero. Two launches
    use the two rows in turn."""
    from ftserve_kernels.bookkeeping import StagedRows

    g = torch.Generator().manual_seed(rows)
    vocab = 700
    itab = _itab({}, 4, 2)
    counters = torch.zeros(rows + 1, dtype=torch.int32)
    pair = torch.full((2, 6), -5, dtype=torch.int64)
    parity = torch.zeros(1, dtype=torch.int32)
    staged = StagedRows(pair[:, :rows], parity)
    slots = torch.arange(rows)
    active = torch.zeros(rows, dtype=torch.bool)
    got = []
    for launch in range(2):
        logits = torch.randn(rows, vocab, generator=g)
        tokens = greedy_sample_triton(logits, slots, active, itab, NI, counters, block=128,
                                      target_programs=6, host_out=staged)
        assert torch.equal(tokens, greedy_sample_ref(logits, slots, active, itab, NI))
        assert torch.equal(pair[launch, :rows], tokens), launch
        assert int(parity) == 1 - launch, "the word toggles once a launch"
        assert int(counters.abs().sum()) == 0
        got.append(tokens)
    assert torch.equal(pair[:, rows:], torch.full((2, 6 - rows), -5)), "only the batch's words are written"
    assert torch.equal(pair[0, :rows], got[0]) and torch.equal(pair[1, :rows], got[1])


@interpreter_only
def test_temperature_mode_equals_reference() -> None:
    """With ftab: sampled rows take the Gumbel-max of logits / T with the
    sampler's (seed, step, token) noise, greedy rows the argmax; stop masks too."""
    from ftserve_kernels import sampling as ks

    g = torch.Generator().manual_seed(9)
    itab = _itab({1: [7, 60], 3: [5]}, 6, 4)
    itab[:, 0] = torch.tensor([1, 0, 0, 1, 0, 1])  # column 0: greedy
    for slot in range(6):
        itab[slot, 2], itab[slot, 3] = ks.split_seed(1000 + 77 * slot)
    ftab = torch.ones(6, 6)
    ftab[:, 0] = torch.tensor([1.0, 0.7, 1.3, 1.0, 1e-9, 1.0])  # slot 4: clamped to 1e-6
    counters = torch.zeros(8, dtype=torch.int32)
    for trial in range(6):
        vocab = 3001 if trial % 2 else 500
        logits = 2 * torch.randn(5, vocab, generator=g)
        slots = torch.tensor([0, 1, 2, 4, 3])
        active = torch.tensor([False, True, False, False, True])
        steps = torch.randint(0, 1 << 20, (5,), generator=g)
        got = greedy_sample_triton(logits, slots, active, itab, NI, counters, None, ftab, steps,
                                   block=256, target_programs=8)
        ref = greedy_sample_ref(logits, slots, active, itab, NI, ftab, steps)
        assert torch.equal(got, ref), (trial, got, ref)
        assert got[1] not in (7, 60)
        assert int(counters.abs().sum()) == 0


@interpreter_only
def test_sampler_takes_the_fused_kernel_for_greedy_only_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """the "triton" kernel backend runs the kernel (interpreted here): same tokens as
    the torch path, min_tokens masking included, ``last`` filled either way."""
    import ftserve_kernels.greedy_triton as gt

    calls = []
    real = gt.greedy_sample_triton

    def counted(*a: object, **k: object) -> torch.Tensor:
        calls.append(1)
        return real(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr("ftserve.engine.sampler.greedy_sample_triton", counted)
    torch.manual_seed(3)
    vocab = 300
    logits = torch.randn(4, vocab)
    logits[:, 11] = 30.0  # eos: masked while below min_tokens
    results = {}
    for kernels in ("torch", "triton"):
        s = Sampler(vocab, 4, "cpu", kernels=KernelConfig(backend=kernels))
        s.admit(0, SamplingParams(temperature=0.0, min_tokens=2), [], [11])
        s.admit(1, SamplingParams(temperature=0.0), [], [11])
        assert s.features == SamplerFeatures()
        last = torch.zeros(5, dtype=torch.int64)
        out = s.sample(logits, torch.tensor([0, 1, 0, s.dummy_slot]), torch.zeros(4, dtype=torch.int64),
                       torch.tensor([True, False, False, True]), last=last)
        results[kernels] = out.token_ids
        assert torch.equal(last[:4], out.token_ids) and not out.on_host
        # A host_out row: the fused kernel fills it and says so; the torch path
        # leaves it to the caller (on_host False, the row untouched).
        pair = torch.full((2, 4), -1, dtype=torch.int64)
        staged = StagedRows(pair, torch.zeros(1, dtype=torch.int32))
        out = s.sample(logits, torch.tensor([0, 1, 0, s.dummy_slot]), torch.zeros(4, dtype=torch.int64),
                       torch.tensor([True, False, False, True]), host_out=staged)
        assert out.on_host == (kernels == "triton")
        assert torch.equal(pair[0], out.token_ids if out.on_host else torch.full((4,), -1))
    assert len(calls) == 2, "the triton runs took the fused kernel, the torch runs did not"
    assert torch.equal(results["torch"], results["triton"])
    assert results["triton"][0] != 11 and results["triton"][1] == 11 and results["triton"][2] == 11
    # Temperature alone takes it too, with the composed path's draws; a top-p
    # alone (the sorting filter) runs the composed stages, then ends in it.
    draws = {}
    for kernels in ("torch", "triton"):
        s = Sampler(vocab, 4, "cpu", kernels=KernelConfig(backend=kernels))
        s.admit(0, SamplingParams(temperature=0.7, seed=1), [], [])
        s.admit(1, SamplingParams(temperature=0.0), [], [])
        draws[kernels] = s.sample(logits[:3] * 0.1, torch.tensor([0, 1, 0]), torch.tensor([0, 0, 9]),
                                  torch.zeros(3, dtype=torch.bool)).token_ids
    assert len(calls) == 3 and torch.equal(draws["torch"], draws["triton"])
    s.admit(2, SamplingParams(temperature=0.7, top_p=0.5, seed=1), [], [])
    assert s.features_of([2]).wide_filter
    s.sample(logits[:1], torch.tensor([2]), torch.zeros(1, dtype=torch.int64), torch.tensor([False]))
    assert len(calls) == 4


@pytest.mark.gpu
def test_greedy_kernel_at_vocab_scale_on_gpu() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    vocab = 151_936
    itab = _itab({1: [151_643, 151_645]}, 4, 24).cuda()
    counters = torch.zeros(64, dtype=torch.int32, device="cuda")
    for b in (1, 8, 64):
        logits = torch.randn(b, vocab, generator=g, device="cuda").to(torch.bfloat16).float()
        logits[:, 151_645] = 40.0
        slots = (torch.arange(b, device="cuda") % 4)
        active = torch.arange(b, device="cuda") % 3 == 0
        last = torch.full((64,), -1, dtype=torch.int64, device="cuda")
        got = greedy_sample_triton(logits, slots, active, itab, NI, counters, last)
        assert torch.equal(got, greedy_sample_ref(logits, slots, active, itab, NI))
        assert torch.equal(last[:b], got) and int(counters.abs().sum()) == 0


@pytest.mark.gpu
def test_temperature_mode_equals_the_composed_sampler_on_gpu() -> None:
    """Sampler at Qwen3's vocabulary on the GPU: temperature-only steps (one
    launch) draw what the composed path (filters on but neutral, Gumbel-max
    kernel) draws for the same seeds and steps."""
    vocab, dev = 151_936, torch.device("cuda")
    s = Sampler(vocab, 64, dev, seed=0)
    for slot in range(64):
        s.admit(slot, SamplingParams(temperature=0.0 if slot % 4 == 0 else 0.6 + slot / 64, seed=slot),
                [], [151_645])
    s.enable(SamplerFeatures(sampling=True, filtering=True))
    g = torch.Generator(device=dev).manual_seed(1)
    for b in (1, 8, 64):
        logits = 3 * torch.randn(b, vocab, generator=g, device=dev)
        slots = torch.arange(b, device=dev)
        steps = torch.randint(0, 1000, (b,), device=dev, generator=g)
        active = torch.arange(b, device=dev) % 3 == 0
        fused = s.sample(logits, slots, steps, active, features=SamplerFeatures(sampling=True))
        composed = s.sample(logits, slots, steps, active,
                            features=SamplerFeatures(sampling=True, filtering=True))
        assert torch.equal(fused.token_ids, composed.token_ids), b
        # The Gumbel-max kernel of the unfused composition, on the masked scores.
        from ftserve_kernels import sampling as ks
        from ftserve_kernels.greedy_triton import greedy_sample_ref

        irow = s._i.index_select(0, slots)
        x = greedy_sample_ref(logits, slots, active, s._i, 5)  # the masked argmax (greedy rows)
        cols = torch.arange(irow.shape[1] - 5, device=dev)
        masked = ks.mask_token_ids(logits, irow[:, 5:], (cols[None, :] < irow[:, 4:5]) & active[:, None])
        temp = s._f.index_select(0, slots)[:, 0].clamp_min(1e-6)
        k1, k2 = ks.row_keys(irow[:, 2], irow[:, 3], steps)
        drawn = ks.gumbel_argmax_triton(masked / temp[:, None], k1, k2)
        assert torch.equal(fused.token_ids, torch.where(irow[:, 0] != 0, x, drawn)), b


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 3])
def test_gpu_staged_step_io_in_a_graph(n: int) -> None:
    """A greedy decode graph's I/O without copy kernels: the inputs launch reads
    the pinned row the device word names (over UVA), the greedy kernel stores
    the tokens into the same row of the output pair and toggles the word. The
    host writes step N's words into row N % 2 and reads its tokens there one
    step late, with no sync but the events (tokens = 3 * input + 1)."""
    from typing import Any

    from ftserve.engine.cuda_graph import MIN_FLAG, capture_graph
    from ftserve_kernels import ops
    from ftserve_kernels.decode_inputs import WORDS, DecodeRow
    from tests.engine_util import read_one_step_late

    dev = torch.device("cuda")
    vocab = 130_000
    h_in = torch.zeros(2, WORDS * n, dtype=torch.int64).pin_memory()
    h_out = torch.zeros(2, n, dtype=torch.int64).pin_memory()
    parity = torch.zeros(1, dtype=torch.int32, device=dev)
    decoy = torch.zeros(n, WORDS, dtype=torch.int64, device=dev)
    last = torch.zeros(n, dtype=torch.int64, device=dev)
    page_table = torch.zeros(n, 4, dtype=torch.int32, device=dev)
    itab = _itab({}, n, 2).to(dev)
    counters = torch.zeros(n + 1, dtype=torch.int32, device=dev)
    cols = torch.arange(vocab, device=dev)

    def step_fn() -> torch.Tensor:
        d = ops.decode_inputs(KernelConfig(), decoy, last, page_table, None, MIN_FLAG,
                              staged=StagedRows(h_in, parity))
        logits = (cols[None, :] == (3 * d.input_ids + 1)[:, None]).float()  # [n, V]
        return greedy_sample_triton(logits, d.slots, d.min_active, itab, NI, counters, last,
                                    host_out=StagedRows(h_out, parity))

    def words(step: int) -> torch.Tensor:  # the host's input ids i + 1000 * step, slot i
        return torch.tensor([DecodeRow(input_id=i + 1000 * step, position=0, out_cache_loc=0, seq_len=1, slot=i,
                                       step=0, src_row=-1) for i in range(n)]).view(-1)

    h_in.copy_(words(0).expand(2, -1))
    graph, _ = capture_graph(step_fn, None)
    torch.cuda.synchronize()
    parity.zero_()  # the warm-up runs toggled it
    pending: list[tuple[int, Any]] = []
    for step in range(40):
        h_in[step % 2].copy_(words(step))
        graph.replay()
        read_one_step_late(pending, step, h_out, n)
    torch.cuda.synchronize()
    assert parity.item() == 0 and int(counters.abs().sum()) == 0  # 40 flips
