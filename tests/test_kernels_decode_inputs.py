"""The decode graph's fused inputs launch (ftserve_kernels/decode_inputs.py)
against its torch twin, under the Triton interpreter."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ftserve.engine.cuda_graph import MIN_FLAG
from ftserve_kernels import ops
from ftserve_kernels.config import KernelConfig
from ftserve_kernels.decode_inputs import (
    WORDS,
    DecodeRow,
    InputNorm,
    decode_inputs_ref,
    decode_inputs_triton,
    embed_rms_norm_ref,
    embed_rms_norm_triton,
)

# The tests without the gpu mark build CPU tensors for the Triton interpreter
# (conftest sets it where no GPU is): a CUDA machine runs the gpu-marked ones.
interpreter_only = pytest.mark.skipif(torch.cuda.is_available(), reason="an interpreter test: CPU tensors")


@pytest.mark.parametrize("max_pages,block_p,with_embed,with_norm,hidden", [
    (37, 16, True, False, 40), (8, 1024, False, False, 40), (300, 128, True, True, 40),
    (5, 1024, True, True, 2500),  # hidden past one 2048-wide row block: two passes of chunks
])
@interpreter_only
def test_decode_inputs_equal_reference(
    max_pages: int, block_p: int, with_embed: bool, with_norm: bool, hidden: int
) -> None:
    g = torch.Generator().manual_seed(max_pages)
    rows, bsz, vocab = 6, 5, 50
    page_table = torch.randint(0, 1000, (rows, max_pages), generator=g, dtype=torch.int32)
    last = torch.randint(0, vocab, (rows,), generator=g)
    embed = torch.randn(vocab, hidden, generator=g).to(torch.bfloat16) if with_embed else None
    norm = InputNorm((1 + 0.2 * torch.randn(hidden, generator=g)).to(torch.bfloat16), 1e-6) if with_norm else None
    packed = torch.stack(DecodeRow(
        input_id=torch.randint(0, vocab, (bsz,), generator=g),  # host-known id
        position=torch.randint(0, 4000, (bsz,), generator=g),
        out_cache_loc=torch.randint(0, 9000, (bsz,), generator=g),
        seq_len=torch.randint(1, 4000, (bsz,), generator=g),
        slot=torch.tensor([0, 3 | MIN_FLAG, 5, 2 | MIN_FLAG, 5]),  # with the flag; 5 = the sink row
        step=torch.randint(0, 99, (bsz,), generator=g),
        src_row=torch.tensor([-1, 2, -1, 0, 4]),  # row of last (-1: the host's id)
    ), dim=1).contiguous()
    got = decode_inputs_triton(packed, last, page_table, embed, MIN_FLAG, norm, block_p=block_p)
    ref = decode_inputs_ref(packed, last, page_table, embed, MIN_FLAG, norm)
    for f in dataclasses.fields(ref):
        a, b = getattr(got, f.name), getattr(ref, f.name)
        if b is None:
            assert a is None
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, f.name
        if f.name == "normed":  # fp32 sums in another order: a flip of its two bf16 roundings at most
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=1e-2)
        else:
            assert torch.equal(a, b), f.name
    assert (got.normed is not None) == with_norm
    if norm is not None:
        # The eager step's launch does the same row work: the same bits.
        assert embed is not None
        rows_e, normed_e = embed_rms_norm_triton(got.input_ids, embed, norm)
        assert torch.equal(rows_e, got.embeds) and torch.equal(normed_e, got.normed)
        ref_rows, ref_normed = embed_rms_norm_ref(got.input_ids, embed, norm)
        assert torch.equal(ref_rows, got.embeds) and torch.equal(ref_normed, ref.normed)
    assert got.input_ids[1] == last[2] and got.input_ids[0] == DecodeRow(*packed.t()).input_id[0]
    assert got.min_active.tolist() == [False, True, False, True, False]
    assert got.slots.tolist() == [0, 3, 5, 2, 5]


@interpreter_only
@pytest.mark.parametrize("side", [0, 1])
def test_decode_inputs_read_the_staged_row(side: int) -> None:
    """With ``staged`` the kernel reads the row of the pair that the device word
    picks (over UVA on CUDA; a plain address under the interpreter), not
    ``packed``; the twin reads the word on the host. Each equals its own plain
    call on that row's words, to the bit."""
    from ftserve_kernels.bookkeeping import StagedRows

    g = torch.Generator().manual_seed(side)
    bsz, vocab, hidden = 3, 40, 24
    page_table = torch.randint(0, 1000, (4, 9), generator=g, dtype=torch.int32)
    last = torch.randint(0, vocab, (4,), generator=g)
    embed = torch.randn(vocab, hidden, generator=g).to(torch.bfloat16)
    norm = InputNorm((1 + 0.2 * torch.randn(hidden, generator=g)).to(torch.bfloat16), 1e-6)

    def rows(seed: int) -> torch.Tensor:
        r = torch.Generator().manual_seed(seed)
        return torch.stack(DecodeRow(
            input_id=torch.randint(0, vocab, (bsz,), generator=r),
            position=torch.randint(0, 90, (bsz,), generator=r),
            out_cache_loc=torch.randint(0, 900, (bsz,), generator=r),
            seq_len=torch.randint(1, 90, (bsz,), generator=r),
            slot=torch.tensor([0, 2 | MIN_FLAG, 3]), step=torch.randint(0, 9, (bsz,), generator=r),
            src_row=torch.tensor([-1, 1, -1]),
        ), dim=1).contiguous()

    # Two different rows, wider than the batch (the graph's pair is max_bs wide).
    n = WORDS * bsz
    pair = torch.full((2, n + 5), -7, dtype=torch.int64)
    pair[0, :n] = rows(10).view(-1)
    pair[1, :n] = rows(11).view(-1)
    staged = StagedRows(pair[:, :n], torch.tensor([side], dtype=torch.int32))
    decoy = torch.zeros(bsz, WORDS, dtype=torch.int64)  # shape only: never read
    packed = pair[side, :n].view(bsz, WORDS).clone()
    for fn in (decode_inputs_triton, decode_inputs_ref):
        want = fn(packed, last, page_table, embed, MIN_FLAG, norm)
        got = fn(decoy, last, page_table, embed, MIN_FLAG, norm, staged=staged)
        for f in dataclasses.fields(want):
            assert torch.equal(getattr(got, f.name), getattr(want, f.name)), (fn.__name__, f.name)
    assert int(staged.parity) == side, "reading a row leaves the word alone"


@interpreter_only
def test_ops_dispatch() -> None:
    packed = torch.tensor([DecodeRow(input_id=4, position=1, out_cache_loc=17, seq_len=2, slot=1, step=0,
                                     src_row=-1)])
    pt = torch.arange(12, dtype=torch.int32).view(3, 4)
    last = torch.zeros(3, dtype=torch.int64)
    for kernels in ("torch", "triton"):
        d = ops.decode_inputs(KernelConfig(backend=kernels), packed, last, pt, None, MIN_FLAG)
        assert d.page_rows.tolist() == [[4, 5, 6, 7]] and d.prefix_lens.tolist() == [1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_decode_inputs_norm_real_shape() -> None:
    """At the qwen3-30b-a3b width on the GPU: the graph's inputs launch and the
    eager embed + norm launch give the same bits, within bf16 rounding of the
    twin."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(3)
    vocab, hidden, bsz = 151_936, 2048, 8
    embed = torch.randn(vocab, hidden, generator=g, device=dev).to(torch.bfloat16)
    norm = InputNorm((1 + 0.1 * torch.randn(hidden, generator=g, device=dev)).to(torch.bfloat16), 1e-6)
    page_table = torch.randint(0, 1000, (16, 512), generator=g, device=dev, dtype=torch.int32)
    last = torch.randint(0, vocab, (16,), generator=g, device=dev)
    zeros = torch.zeros(bsz, dtype=torch.int64, device=dev)
    packed = torch.stack(DecodeRow(
        input_id=torch.randint(0, vocab, (bsz,), generator=g, device=dev), position=zeros, out_cache_loc=zeros,
        seq_len=zeros + 1, slot=torch.arange(bsz, device=dev), step=zeros,
        src_row=torch.tensor([-1, 3, -1, -1, 7, -1, -1, 0], device=dev)), dim=1).contiguous()
    got = decode_inputs_triton(packed, last, page_table, embed, MIN_FLAG, norm)
    assert got.normed is not None and got.embeds is not None
    rows, normed = embed_rms_norm_triton(got.input_ids, embed, norm)
    ref_rows, ref_normed = embed_rms_norm_ref(got.input_ids, embed, norm)
    assert torch.equal(rows, got.embeds) and torch.equal(rows, ref_rows)
    assert torch.equal(normed, got.normed)
    torch.testing.assert_close(normed.float(), ref_normed.float(), rtol=2e-2, atol=1e-2)
