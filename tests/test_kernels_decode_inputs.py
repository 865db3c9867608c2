"""The decode graph's fused inputs launch (ftserve_kernels/decode_inputs.py)
against its torch twin, under the Triton interpreter."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ftserve.engine.cuda_graph import MIN_FLAG
from ftserve_kernels import ops
from ftserve_kernels.decode_inputs import decode_inputs_ref, decode_inputs_triton


@pytest.mark.parametrize("max_pages,block_p,with_embed", [(37, 16, True), (8, 1024, False), (300, 128, True)])
def test_decode_inputs_equal_reference(max_pages: int, block_p: int, with_embed: bool) -> None:
    g = torch.Generator().manual_seed(max_pages)
    rows, bsz, vocab, hidden = 6, 5, 50, 40
    page_table = torch.randint(0, 1000, (rows, max_pages), generator=g, dtype=torch.int32)
    last = torch.randint(0, vocab, (rows,), generator=g)
    embed = torch.randn(vocab, hidden, generator=g).to(torch.bfloat16) if with_embed else None
    packed = torch.stack([
        torch.randint(0, vocab, (bsz,), generator=g),  # host-known id
        torch.randint(0, 4000, (bsz,), generator=g),  # position
        torch.randint(0, 9000, (bsz,), generator=g),  # KV slot
        torch.randint(1, 4000, (bsz,), generator=g),  # seq len
        torch.tensor([0, 3 | MIN_FLAG, 5, 2 | MIN_FLAG, 5]),  # slot, flag; 5 = the sink row
        torch.randint(0, 99, (bsz,), generator=g),  # step
        torch.tensor([-1, 2, -1, 0, 4]),  # src row of last (-1: the host's id)
    ], dim=1).contiguous()
    got = decode_inputs_triton(packed, last, page_table, embed, MIN_FLAG, block_p=block_p)
    ref = decode_inputs_ref(packed, last, page_table, embed, MIN_FLAG)
    for f in dataclasses.fields(ref):
        a, b = getattr(got, f.name), getattr(ref, f.name)
        if b is None:
            assert a is None
            continue
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f.name
    assert got.input_ids[1] == last[2] and got.input_ids[0] == packed[0, 0]
    assert got.min_active.tolist() == [False, True, False, True, False]
    assert got.slots.tolist() == [0, 3, 5, 2, 5]


def test_ops_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    packed = torch.tensor([[4, 1, 17, 2, 1, 0, -1]])
    pt = torch.arange(12, dtype=torch.int32).view(3, 4)
    last = torch.zeros(3, dtype=torch.int64)
    for kernels in ("torch", "triton"):
        monkeypatch.setenv("FTSERVE_KERNELS", kernels)
        d = ops.decode_inputs(packed, last, pt, None, MIN_FLAG)
        assert d.page_rows.tolist() == [[4, 5, 6, 7]] and d.prefix_lens.tolist() == [1]
