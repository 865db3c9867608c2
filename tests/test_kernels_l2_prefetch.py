"""The L2 prefetch kernel (ftserve_kernels/l2_prefetch.py): its byte-range
table covers every tensor, the ``load`` mode reads every word the table
covers (its checksum against the twin's, under the Triton interpreter on the
CPU), and on the GPU every mode runs inside a captured graph."""

from __future__ import annotations

import pytest
import torch

from ftserve_kernels import l2_prefetch as l2k


def _tensors(device: str = "cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    shapes = [(37, 96), (5,), (3, 4096 + 24), (2 * l2k.CHUNK // 2,)]  # tails of 10 bytes, 48, none
    return [torch.randint(-30000, 30000, s, generator=g, dtype=torch.int16).view(torch.bfloat16).to(device)
            for s in shapes]


def test_chunk_table_covers_each_tensor_in_order() -> None:
    ts = _tensors()
    table = l2k.chunk_table(ts)
    rows = table.tolist()
    i = 0
    for t in ts:
        start, size = t.data_ptr(), t.numel() * t.element_size()
        covered = 0
        while i < len(rows) and start <= rows[i][0] < start + size:
            addr, n = rows[i]
            assert addr == start + covered, "pieces follow each other with no gap"
            assert 16 <= n <= l2k.CHUNK and n % 16 == 0
            covered += n
            i += 1
        assert covered == l2k.covered_bytes(t) and size - covered < 16
    assert i == len(rows)
    assert l2k.covered_bytes(ts[1]) == 0  # 10 bytes: no row at all


def test_load_mode_reads_every_covered_word() -> None:
    ts = _tensors()
    table = l2k.chunk_table(ts)
    out = torch.full((l2k.programs(table),), 123, dtype=torch.int64)
    l2k.prefetch_l2_triton(table, "load", out)
    want = torch.zeros(1, dtype=torch.int64)
    l2k.prefetch_l2_ref(ts, "load", want)
    assert int(out.sum()) == int(want[0]) == l2k.checksum_ref(ts)
    # One word changed changes the sum: the kernel reads memory, not the table.
    ts[0].view(torch.int16)[5, 6] += 1  # the low half of an int32 word
    l2k.prefetch_l2_triton(table, "load", out)
    assert int(out.sum()) == int(want[0]) + 1 == l2k.checksum_ref(ts)


def test_bad_mode_is_refused() -> None:
    table = l2k.chunk_table(_tensors())
    with pytest.raises(AssertionError, match="not one of"):
        l2k.prefetch_l2_triton(table, "prefetch", torch.zeros(l2k.programs(table), dtype=torch.int64))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", l2k.MODES)
def test_every_mode_runs_in_a_graph(mode: str) -> None:
    ts = _tensors("cuda") + [torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)]
    before = [t.clone() for t in ts]
    table = l2k.chunk_table(ts)
    out = torch.full((l2k.programs(table),), -7, dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        l2k.prefetch_l2_triton(table, mode, out)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        l2k.prefetch_l2_triton(table, mode, out)
    out.fill_(-7)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(ts, before)), "a prefetch writes nothing"
    if mode == "load":
        assert int(out.sum()) == l2k.checksum_ref(ts)
    else:
        assert bool((out == -7).all()), "only the load mode writes out"
