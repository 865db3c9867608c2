"""The radix select of each row's n best logits (ftserve_kernels/select_triton.py)
against torch.topk, under the Triton interpreter on the CPU and at the real
vocabulary on the GPU (eager and graph-replayed). Ties at the n-th key may be
taken in any order, so the checks are of the set's properties: n distinct ids,
the same values as torch.topk's (as multisets), nothing left out scoring above
the lowest candidate."""

from __future__ import annotations

import pytest
import torch

from ftserve_kernels.select_triton import top_candidates_ref, top_candidates_triton


def _rows(vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(vocab, generator=g) * 3.0,  # peaked
            torch.randn(vocab, generator=g) * 0.01 + 7.0,  # flat: the n-th key deep in a level-1 bin
            torch.randint(-3, 4, (vocab,), generator=g).float(),  # ties everywhere
            torch.full((vocab,), 1.5),  # all tied
            torch.randn(vocab, generator=g) * 2.0,
            -torch.rand(vocab, generator=g) * 5.0]  # negative only
    rows[4][: vocab // 2] = float("-inf")  # half masked
    rows[0][7], rows[0][8] = -0.0, 0.0  # equal scores, different bits
    rows[0][100] = float("inf")
    return torch.stack(rows)


def _check(logits: torch.Tensor, ids: torch.Tensor, n: int) -> None:
    want = top_candidates_ref(logits, n)
    for r in range(logits.shape[0]):
        row, got = logits[r], ids[r]
        assert got.unique().numel() == n, f"row {r}: repeated or missing ids"
        vals = row[got]
        assert torch.equal(vals.sort().values, row[want[r]].sort().values), f"row {r}: values differ"
        left_out = torch.ones_like(row, dtype=torch.bool)
        left_out[got] = False
        assert bool((row[left_out] <= vals.min()).all()), f"row {r}: a better token left out"


@pytest.mark.parametrize(("vocab", "n", "block", "programs", "bits"),
                         [(3000, 272, 256, 16, 8), (1500, 20, 128, 6, 4), (700, 699, 128, 3, 8),
                          (4097, 1, 1024, 132, 8)])
def test_select_equals_topk(vocab: int, n: int, block: int, programs: int, bits: int) -> None:
    logits = _rows(vocab, seed=vocab)
    ids = top_candidates_triton(logits, n, block=block, target_programs=programs, bits=bits)
    assert ids.shape == (logits.shape[0], n) and ids.dtype == torch.int64
    _check(logits, ids, n)


def test_bf16_rows_and_the_whole_vocabulary() -> None:
    logits = _rows(900, seed=3).bfloat16()  # bf16: many more ties
    _check(logits.float(), top_candidates_triton(logits, 300, block=128, target_programs=8), 300)
    every = top_candidates_triton(logits, 900)
    assert torch.equal(every, torch.arange(900).expand(6, 900))


@pytest.mark.gpu
def test_select_at_the_real_vocabulary_on_the_gpu() -> None:
    """151,936 tokens, 8 mixed rows, eager and replayed in a CUDA graph (fixed
    shapes, no sync: the zeroed work buffer is allocated inside the graph)."""
    vocab, n = 151_936, 272
    rows = torch.cat([_rows(vocab, seed=5), torch.randn(2, vocab) * 10.0]).cuda()
    ids = top_candidates_triton(rows, n)
    _check(rows.cpu(), ids.cpu(), n)
    from ftserve.engine.cuda_graph import capture_graph
    from tests.test_gpu_engine import sync_is_error

    graph, out = capture_graph(lambda: top_candidates_triton(rows, n), None)
    fresh = torch.randn(8, vocab, device="cuda") * 4.0
    rows.copy_(fresh)
    with sync_is_error(True):
        graph.replay()
    torch.cuda.synchronize()
    _check(fresh.cpu(), out.cpu(), n)
