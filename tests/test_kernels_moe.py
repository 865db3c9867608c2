"""Triton MoE (routing, alignment, grouped GEMMs) against the torch twins."""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
interpreter_only = pytest.mark.skipif(torch.cuda.is_available(), reason="an interpreter test: CPU tensors")
if DEVICE == "cpu":
    # The interpreter is chosen when a kernel is decorated (see test_kernels_attention).
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in ("ftserve_kernels.attention_common", "ftserve_kernels.attention_decode_triton",
                  "ftserve_kernels.attention_extend_triton", "ftserve_kernels.attention_triton",
                  "ftserve_kernels.moe_read_through",
                  "ftserve_kernels.moe_gemv_triton",
                  "ftserve_kernels.moe_align_triton", "ftserve_kernels.moe_triton",
                  "ftserve_kernels.decode_fused_triton"):
        if _name in sys.modules:
            importlib.reload(sys.modules[_name])

from ftserve_kernels import decode_fused_triton as df  # noqa: E402
from ftserve_kernels import moe_align_triton as ma  # noqa: E402
from ftserve_kernels import moe_configs as mc  # noqa: E402
from ftserve_kernels import moe_triton as mt  # noqa: E402
from ftserve_kernels import ops  # noqa: E402
from ftserve_kernels.config import KernelConfig  # noqa: E402
from ftserve_kernels.moe import fused_moe_ref, route_topk_ref  # noqa: E402
from tools.tune import moe as tune  # noqa: E402


def count_calls(monkeypatch: pytest.MonkeyPatch, module: Any, name: str,
                when: Callable[[dict[str, Any]], bool] | None = None) -> list[int]:
    """Wrap ``module.name`` so each call (whose keyword arguments ``when``
    accepts) appends to the returned list; clear ops' kernel table after."""
    calls: list[int] = []
    real = getattr(module, name)

    def counting(*args: Any, **kwargs: Any) -> Any:
        if when is None or when(kwargs):
            calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))


@pytest.mark.parametrize("renorm", [False, True])
@pytest.mark.parametrize("t", [5, 300])  # 300: several multi-token programs, a partial last one
def test_route_topk_matches_reference(renorm: bool, t: int) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(t, 12, generator=g).to(DEVICE)
    w, ids = mt.route_topk_triton(logits, 3, renorm)
    rw, rids = route_topk_ref(logits, 3, renorm)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precount", [False, True])
# 1 chunk; 3 chunks; 5 chunks of 128 pairs, each in 4 sub-chunks (past 128 experts, qwen3-next's 512)
@pytest.mark.parametrize("t,k,e,bm", [(9, 3, 7, 4), (100, 3, 128, 16), (200, 3, 512, 64)])
def test_align_is_a_padded_grouping(
    precount: bool, t: int, k: int, e: int, bm: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every pair appears once, in a block of its expert, in pair order (stable);
    padding is the sentinel. ``precount`` forces the per-chunk histogram pass
    used for large batches."""
    monkeypatch.setattr(ma, "_PRECOUNT_MIN", 0 if precount else 10**9)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, e, (t, k), generator=g, dtype=torch.int32)
    ids[0] = torch.tensor([2, 2, 5])  # repeated expert inside one token's choices is legal input
    sorted_ids, block_expert, total = ma.moe_align(ids.to(DEVICE), e, bm)
    sorted_ids, block_expert, total = sorted_ids.cpu(), block_expert.cpu(), int(total.cpu()[0])
    n = t * k
    counts = torch.bincount(ids.reshape(-1).long(), minlength=e)
    assert total == int(((counts + bm - 1) // bm * bm).sum())
    assert sorted_ids.numel() >= total and sorted_ids.numel() % bm == 0
    real = sorted_ids[:total]
    assert sorted(real[real < n].tolist()) == list(range(n))
    assert torch.all((real < n) | (real == n)), "an expert's padding rows hold the sentinel"
    assert torch.all(sorted_ids[total:] == n)
    flat = ids.reshape(-1)
    for b in range(total // bm):
        rows = real[b * bm : (b + 1) * bm]
        rows = rows[rows < n]
        assert rows.numel() > 0, "no block is all padding"
        assert torch.all(flat[rows.long()] == block_expert[b])
    assert torch.all(block_expert[total // bm :] == -1)
    # Blocks are in expert order, pairs in id order: the grouping is a stable sort.
    used = block_expert[: total // bm]
    assert torch.all(used[1:] >= used[:-1])
    assert torch.equal(real[real < n], torch.argsort(flat.long(), stable=True).int())


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # the interpreter's numpy max over NaN
@pytest.mark.parametrize("precount", [False, True])
@pytest.mark.parametrize("t,k,e", [(400, 3, 128), (400, 3, 20)])
def test_align_chunk_does_not_change_the_result(
    precount: bool, t: int, k: int, e: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Larger chunks (a tuned-table field) walk each chunk in sub-chunks; the
    grouping must be bit-identical to the default plan: same order, padding and
    block map. e=128: 512-pair chunks of 4 sub-chunks; e=20: up to 8."""
    monkeypatch.setattr(ma, "_PRECOUNT_MIN", 0 if precount else 10**9)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, e, (t, k), generator=g, dtype=torch.int32).to(DEVICE)
    ref = [x.cpu() for x in ma.moe_align(ids, e, 16)]
    default_chunk = ma._align_plan(t * k, e, 16)[3]
    for chunk in (256, 512, 1024):
        plan = ma._align_plan(t * k, e, 16, chunk)
        assert plan[3] == max(chunk, default_chunk) and plan[4] == -(-t * k // plan[3])
        got = [x.cpu() for x in ma.moe_align(ids, e, 16, chunk)]
        for a, b in zip(got, ref):
            assert torch.equal(a, b), chunk


def test_route_nan_rows_give_in_range_ids() -> None:
    """Padding rows of a captured batch may hold garbage: ids must still index
    the expert maps in bounds, and real rows are unaffected."""
    logits = torch.randn(4, 8).to(DEVICE)
    logits[1] = float("nan")
    logits[2, 3] = float("nan")
    w, ids = mt.route_topk_triton(logits, 2, True)
    assert bool(((ids >= 0) & (ids < 8)).all())
    rw, rids = route_topk_ref(logits[[0, 3]], 2, True)
    assert torch.equal(ids[[0, 3]], rids)


def test_align_drops_out_of_range_ids() -> None:
    """An id outside [0, E) is placed nowhere (never over another pair's row)."""
    ids = torch.tensor([[0, 3], [5, 1], [3, 0]], dtype=torch.int32, device=DEVICE)  # 5 >= E
    sorted_ids, block_expert, total = ma.moe_align(ids, 4, 2)
    real = sorted_ids[: int(total.cpu()[0])].cpu()
    assert sorted(real[real < 6].tolist()) == [0, 1, 3, 4, 5]


@pytest.mark.parametrize("precount", [False, True])
@pytest.mark.parametrize("valid", [0, 1, 37, 200])
def test_align_valid_rows_groups_only_those_rows(
    precount: bool, valid: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``valid_rows`` (a padded graph bucket's real tokens, on the device)
    the alignment equals the one of the first ``valid`` rows alone: the padding
    rows' pairs sit in no block and cost no GEMM rows."""
    monkeypatch.setattr(ma, "_PRECOUNT_MIN", 0 if precount else 10**9)
    t, k, e, bm = 200, 3, 64, 16
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, e, (t, k), generator=g, dtype=torch.int32)
    n = t * k
    rows = torch.tensor([valid], dtype=torch.int32, device=DEVICE)
    sorted_ids, block_expert, total = (x.cpu() for x in ma.moe_align(ids.to(DEVICE), e, bm, valid_rows=rows))
    total = int(total[0])
    counts = torch.bincount(ids[:valid].reshape(-1).long(), minlength=e)
    assert total == int(((counts + bm - 1) // bm * bm).sum())
    real = sorted_ids[:total]
    flat = ids[:valid].reshape(-1)
    assert torch.equal(real[real < n], torch.argsort(flat.long(), stable=True).int())
    assert torch.all(sorted_ids[total:] == n) and torch.all(block_expert[total // bm :] == -1)
    full = ma.moe_align(ids.to(DEVICE), e, bm, valid_rows=torch.tensor([t], dtype=torch.int32, device=DEVICE))
    for a, b in zip(full, ma.moe_align(ids.to(DEVICE), e, bm)):
        assert torch.equal(a.cpu(), b.cpu())


@pytest.mark.parametrize("fp8", [False, True])
def test_fused_moe_valid_rows_skips_padding(fp8: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """ops.fused_moe with valid_rows: the real rows equal the full computation's
    and the grouped GEMMs get only the real rows' pairs (the alignment's padded
    row count is the one of those pairs alone)."""
    from ftserve_kernels import fp8_moe_triton, fp8_quant

    totals: list[int] = []
    real_align = ma.moe_align

    def recording(*args: Any, **kwargs: Any) -> Any:
        out = real_align(*args, **kwargs)
        totals.append(int(out[2].cpu()[0]))
        return out

    monkeypatch.setattr(fp8_moe_triton if fp8 else mt, "moe_align", recording)
    g = torch.Generator().manual_seed(11)
    t, valid, e, k, h, inter = 40, 9, 6, 2, 128, 128
    x = torch.randn(t, h, generator=g).to(DEVICE)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).to(DEVICE)
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).to(DEVICE)
    weights, ids = route_topk_ref(torch.randn(t, e, generator=g).to(DEVICE), k, True)
    rows = torch.tensor([valid], dtype=torch.int32, device=DEVICE)
    kernels = KernelConfig(backend="triton")
    w = (fp8_quant.quantize_weight(w13), fp8_quant.quantize_weight(w2)) if fp8 else (w13, w2)
    full = ops.fused_moe(kernels, x, *w, weights, ids)
    out = ops.fused_moe(kernels, x, *w, weights, ids, valid_rows=rows)
    assert torch.equal(out[:valid], full[:valid])
    assert len(totals) == 2 and totals[0] >= t * k and totals[1] < totals[0]
    ref = ops.fused_moe(KernelConfig(backend="torch"), x, w13, w2, weights, ids, valid_rows=rows)
    assert torch.equal(ref, fused_moe_ref(x, w13, w2, weights, ids))


@pytest.mark.parametrize("t,gemv", [(1, None), (1, False), (5, None), (5, True), (33, None)])
def test_fused_moe_matches_reference(t: int, gemv: bool | None) -> None:
    """Grouped-GEMM path and the GEMV path (default for T <= GEMV_MAX_TOKENS)."""
    g = torch.Generator().manual_seed(t)
    e, k, h, inter = 6, 2, 40, 24  # h, inter not multiples of the K block: masked tails
    x = torch.randn(t, h, generator=g).to(DEVICE)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).to(DEVICE)
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).to(DEVICE)
    logits = torch.randn(t, e, generator=g).to(DEVICE)
    weights, ids = route_topk_ref(logits, k, True)
    out = mt.fused_moe_triton(x, w13, w2, weights, ids, gemv=gemv)
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel_err(out, ref) < 1e-4


@pytest.mark.parametrize("t,dtype", [(1, torch.float32), (2, torch.float32), (2, torch.bfloat16)])
def test_fused_moe_add_norm_matches_composition(t: int, dtype: torch.dtype) -> None:
    """The next layer's input norm in the down kernel's epilogue: the sums and
    the normed rows equal fused_add_rms_norm of the MoE output (fp32: to float
    rounding; bf16: the rounding points are the composition's). H = 40 is not a
    power of two; two launches share the counter, which must end at zero."""
    from ftserve_kernels import moe_down_gemv_triton as md
    from ftserve_kernels import moe_gemv_triton as mg
    from ftserve_kernels.norm_rope import fused_add_rms_norm_ref

    g = torch.Generator().manual_seed(t)
    e, k, h, inter = 6, 3, 40, 24
    x = torch.randn(t, h, generator=g).to(dtype).to(DEVICE)
    r = torch.randn(t, h, generator=g).to(dtype).to(DEVICE)
    nw = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype).to(DEVICE)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).to(dtype).to(DEVICE)
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).to(dtype).to(DEVICE)
    weights, ids = route_topk_ref(torch.randn(t, e, generator=g).to(DEVICE), k, True)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    moe = mg.fused_moe_gemv_triton(x, w13, w2, weights, ids)
    ref_n, ref_s = fused_add_rms_norm_ref(moe, r, nw, 1e-6)
    for _ in range(2):
        normed, summed, none = mg.fused_moe_add_norm_gemv_triton(x, w13, w2, weights, ids,
                                                                 md.NormNext(r, nw, 1e-6, counter))
        assert none is None
        assert int(counter.cpu()[0]) == 0
        if dtype == torch.float32:
            torch.testing.assert_close(summed, ref_s, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(normed, ref_n, rtol=1e-5, atol=1e-5)
        else:  # the interpreter's bf16 casts truncate; CUDA's round
            tol = 0 if DEVICE == "cuda" else 2e-2
            torch.testing.assert_close(summed, ref_s, rtol=tol, atol=tol)
            torch.testing.assert_close(normed, ref_n, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("t,dtype", [(1, torch.float32), (2, torch.float32), (1, torch.bfloat16)])
def test_deferred_norm_parts_then_the_gemv_applies_it(t: int, dtype: torch.dtype) -> None:
    """A deferred NormNext: the down kernel stores the sums (as the folded norm
    does) and per column program a partial sum of squares that add up to the
    row's; the GEMV given those parts computes linear(rms_norm(sum)) (the norm
    unrounded: fp32 to float rounding, bf16 within its tolerance). The counter
    is not touched."""
    from ftserve_kernels import gemv_triton as gv
    from ftserve_kernels import moe_down_gemv_triton as md
    from ftserve_kernels import moe_gemv_triton as mg
    from ftserve_kernels.norm_rope import fused_add_rms_norm_ref

    g = torch.Generator().manual_seed(10 + t)
    e, k, h, inter, n = 6, 3, 40, 24, 24
    x = torch.randn(t, h, generator=g).to(dtype).to(DEVICE)
    r = torch.randn(t, h, generator=g).to(dtype).to(DEVICE)
    nw = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype).to(DEVICE)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).to(dtype).to(DEVICE)
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).to(dtype).to(DEVICE)
    wq = (torch.randn(n, h, generator=g) / h**0.5).to(dtype).to(DEVICE)
    weights, ids = route_topk_ref(torch.randn(t, e, generator=g).to(DEVICE), k, True)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    moe = mg.fused_moe_gemv_triton(x, w13, w2, weights, ids)
    ref_n, ref_s = fused_add_rms_norm_ref(moe, r, nw, 1e-6)
    scaled, summed, parts = mg.fused_moe_add_norm_gemv_triton(x, w13, w2, weights, ids,
                                                              md.NormNext(r, nw, 1e-6, counter, deferred=True))
    assert int(counter.cpu()[0]) == 0 and parts is not None
    assert parts.dtype == torch.float32 and parts.shape[0] == t and parts.shape[1] > 1
    tol = 1e-6 if dtype == torch.float32 else (0 if DEVICE == "cuda" else 2e-2)
    torch.testing.assert_close(summed, ref_s, rtol=tol, atol=tol)
    torch.testing.assert_close(parts.sum(1), summed.float().pow(2).sum(1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scaled, (nw.float() * summed.float()).to(dtype), rtol=tol, atol=tol)
    y = gv.gemv_triton(scaled, wq, None, 1e-6, parts=parts)
    assert y.dtype == dtype
    ref_y = torch.nn.functional.linear(ref_n, wq)
    if dtype == torch.float32:
        torch.testing.assert_close(y, ref_y, rtol=1e-5, atol=1e-5)
    else:
        assert rel_err(y.float(), ref_y.float()) < 2e-2


def test_ops_moe_add_norm_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """ops.fused_moe_add_rms_norm folds the norm at GEMV sizes on Triton (and
    moe_folds_next_norm says so), composes past them and on the torch path;
    all agree."""
    from ftserve_kernels import moe_gemv_triton as mg

    g = torch.Generator().manual_seed(8)
    e, k, h, inter = 5, 2, 32, 16
    nw = (1 + 0.1 * torch.randn(h, generator=g)).to(DEVICE)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).to(DEVICE)
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).to(DEVICE)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    calls = count_calls(monkeypatch, mg, "fused_moe_add_norm_gemv_triton")
    ops._triton_table.cache_clear()
    try:
        for backend, t, fused in [("triton", 1, True), ("triton", mg.GEMV_MAX_TOKENS + 1, False),
                                  ("torch", 1, False)]:
            kernels = KernelConfig(backend=backend)
            x = torch.randn(t, h, generator=g).to(DEVICE)
            r = torch.randn(t, h, generator=g).to(DEVICE)
            weights, ids = route_topk_ref(torch.randn(t, e, generator=g).to(DEVICE), k, True)
            assert ops.moe_folds_next_norm(kernels, x) == fused
            n0 = len(calls)
            normed, summed = ops.fused_moe_add_rms_norm(kernels, x, w13, w2, weights, ids, r, nw, 1e-6,
                                                        counter)
            assert (len(calls) > n0) == fused
            ref_s = fused_moe_ref(x, w13, w2, weights, ids) + r
            torch.testing.assert_close(summed, ref_s, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(normed, ops.rms_norm(kernels, ref_s, nw, 1e-6), rtol=1e-4, atol=1e-4)
    finally:
        ops._triton_table.cache_clear()


def test_fused_moe_gemv_odd_top_k() -> None:
    """k = 3: the GEMV down kernel pads the choices to 4 rows per column."""
    g = torch.Generator().manual_seed(9)
    t, e, k, h, inter = 2, 5, 3, 24, 40
    x = torch.randn(t, h, generator=g).to(DEVICE)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).to(DEVICE)
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).to(DEVICE)
    weights, ids = route_topk_ref(torch.randn(t, e, generator=g).to(DEVICE), k, False)
    out = mt.fused_moe_triton(x, w13, w2, weights, ids, gemv=True)
    assert rel_err(out, fused_moe_ref(x, w13, w2, weights, ids)) < 1e-4


@pytest.mark.parametrize("t,k,bn", [(1, 3, None), (2, 8, (16, 8)), (2, 2, (16, 4))])
def test_gemv_moe_shapes(t: int, k: int, bn: tuple[int, int] | None) -> None:
    """The GEMV kernels at odd k (padded choice axis), H and I not multiples of
    the blocks, through an expert map, in bf16."""
    from ftserve_kernels.moe_gemv_triton import fused_moe_gemv_triton

    g = torch.Generator().manual_seed(k)
    e, h, inter = 9, 36, 40
    x = torch.randn(t, h, generator=g).bfloat16().to(DEVICE)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).bfloat16().to(DEVICE)
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).bfloat16().to(DEVICE)
    perm = torch.randperm(e, generator=g).to(torch.int32).to(DEVICE)  # expert -> row
    s13, s2 = torch.empty_like(w13), torch.empty_like(w2)
    s13[perm.long()], s2[perm.long()] = w13, w2
    weights, ids = route_topk_ref(torch.randn(t, e, generator=g).to(DEVICE), k, True)
    out = fused_moe_gemv_triton(x, s13, s2, weights, ids, expert_map=perm, block_n=bn)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, fused_moe_ref(x, w13, w2, weights, ids)) < 2e-2


def test_fused_moe_expert_map() -> None:
    """Slot-cache mode: ids name experts, the map names their rows in w13/w2."""
    g = torch.Generator().manual_seed(4)
    t, e, k, h, inter, slots = 6, 5, 2, 16, 16, 8
    x = torch.randn(t, h, generator=g).to(DEVICE)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).to(DEVICE)
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).to(DEVICE)
    slot_of = torch.tensor([6, 0, 3, 7, 2], dtype=torch.int32, device=DEVICE)
    s13 = torch.full((slots, 2 * inter, h), float("nan"), device=DEVICE)  # unused slots poisoned
    s2 = torch.full((slots, h, inter), float("nan"), device=DEVICE)
    s13[slot_of.long()] = w13
    s2[slot_of.long()] = w2
    weights, ids = route_topk_ref(torch.randn(t, e, generator=g).to(DEVICE), k, True)
    for gemv in (False, True):
        out = mt.fused_moe_triton(x, s13, s2, weights, ids, expert_map=slot_of, gemv=gemv)
        assert rel_err(out, fused_moe_ref(x, w13, w2, weights, ids)) < 1e-4


def test_fused_moe_bf16() -> None:
    g = torch.Generator().manual_seed(3)
    t, e, k, h, inter = 7, 4, 2, 32, 32
    x = torch.randn(t, h, generator=g).bfloat16().to(DEVICE)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).bfloat16().to(DEVICE)
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).bfloat16().to(DEVICE)
    weights, ids = route_topk_ref(torch.randn(t, e, generator=g).to(DEVICE), k, False)
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    for gemv in (False, True):
        out = mt.fused_moe_triton(x, w13, w2, weights, ids, gemv=gemv)
        assert out.dtype == torch.bfloat16
        assert rel_err(out, ref) < 2e-2


# ---------------------------------------------------------------- tuned tile tables


def _write_table(path: Path, configs: dict[str, Any]) -> str:
    path.write_text(json.dumps({"device": "test", "configs": configs}))
    return str(path)


def test_moe_config_table_picks_the_nearest_tuned_t(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The table KernelConfig.moe_table names drives MoeConfig.pick on CUDA devices: the tuned
    T within 2x, the largest past the end, else the heuristic; other shapes and
    CPU tensors never read the table."""
    small = mc.MoeConfig(64, 128, 64, 8, 4, 4, down_block_n=256, down_block_k=128, down_num_warps=8)
    large = mc.MoeConfig(128, 128, 64, 16, 8, 3, down_block_n=128, down_num_stages=4)
    path = _write_table(tmp_path / "t.json", {"E=8,H=64,I=32,k=2": {
        "512": small.to_dict(), "4096": large.to_dict()}})
    kernels = KernelConfig(moe_table=path)
    cuda0 = torch.device("cuda", 0)  # index given: no CUDA call is needed to find the table

    def pick(tokens: int, e: int = 8, shape: tuple[int, int, int] = (64, 32, 2)) -> mc.MoeConfig:
        h, inter, k = shape
        return mc.MoeConfig.pick(tokens * k, e, cuda0, hidden=h, inter=inter, top_k=k, kernels=kernels)

    assert pick(4096) == large and pick(3000) == large and pick(100_000) == large
    assert pick(512) == small and pick(300) == small and pick(1000) == small
    assert pick(100) == mc.heuristic(200, 8, "cuda")  # 5x below the smallest tuned T
    assert pick(4096, e=16) == mc.heuristic(8192, 16, "cuda")
    assert pick(4096, shape=(64, 32, 4)) == mc.heuristic(4 * 4096, 8, "cuda")
    assert mc.MoeConfig.pick(8192, 8, cuda0, kernels=kernels) == mc.heuristic(8192, 8, "cuda")  # no shape
    assert (mc.MoeConfig.pick(8192, 8, torch.device("cpu"), 64, 32, 2, kernels=kernels)
            == mc.MoeConfig(16, 16, 16, 2, 4, 1))
    assert large.down == (128, 64, 16, 8, 4) and small.down == (256, 128, 8, 8, 4)
    assert mc.parse_shape_key(mc.shape_key(8, 64, 32, 2)) == (8, 64, 32, 2)


@pytest.mark.parametrize("content,needle", [
    ("{not json", "JSONDecodeError"),
    ('{"table": {}}', "KeyError"),
    ('{"configs": {"E=8,H=64,I=32,k=2": {"512": {"block_m": 64}}}}', "TypeError"),
    ('{"configs": {"E=8,H=64,I=32,k=2": {"512": {"block_m": 64, "block_n": 64, "block_k": 64, '
     '"group_m": 8, "num_warps": 4, "num_stages": 3, "blockn": 64}}}}', "unknown MoeConfig fields"),
    ('{"configs": {"E=8,H=64,I=32,k=2": {"big": {}}}}', "ValueError"),
    ('{"configs": {"E=8,H=64,I=32,k=2": {"512": {"block_m": 48, "block_n": 64, "block_k": 64, '
     '"group_m": 8, "num_warps": 4, "num_stages": 3}}}}', "power of two"),
    (None, "FileNotFoundError"),
])
def test_moe_config_bad_table_is_an_error_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: str | None, needle: str
) -> None:
    """A table that exists (or is asked for) but does not parse fails loudly:
    ignoring it would silently keep the untuned tiles."""
    path = tmp_path / f"bad_{abs(hash(needle))}.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match="bad MoE config table") as info:
        mc.MoeConfig.pick(4096, 8, torch.device("cuda", 0), hidden=64, inter=32, top_k=2,
                          kernels=KernelConfig(moe_table=str(path)))
    assert str(path) in str(info.value) and needle in str(info.value)


def test_fused_moe_separate_down_tiles() -> None:
    """Down GEMM with its own block_n / block_k (I not a multiple: masked K tail),
    group_m, warps and stages, sharing block_m with gate/up."""
    g = torch.Generator().manual_seed(11)
    t, e, k, h, inter = 21, 5, 2, 64, 48
    x = torch.randn(t, h, generator=g).to(DEVICE)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).to(DEVICE)
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).to(DEVICE)
    weights, ids = route_topk_ref(torch.randn(t, e, generator=g).to(DEVICE), k, True)
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    cfg = mc.MoeConfig(16, 32, 16, 2, 4, 1, down_block_n=16, down_block_k=32, down_num_warps=2,
                       down_num_stages=2, down_group_m=1)
    assert rel_err(mt.fused_moe_triton(x, w13, w2, weights, ids, cfg=cfg), ref) < 1e-4


@pytest.mark.parametrize("shape", list(tune.SHAPES))
@pytest.mark.parametrize("tokens", tune.TOKENS)
def test_tune_candidates_cover_every_tile_shape(shape: str, tokens: int) -> None:
    """The pruned sweep is never empty, stays under its cap, only holds tiles
    that fit, offers both kernels the same block_m values (they share the
    alignment), and covers every surviving tile shape before repeating one."""
    e, k, h, inter = tune.SHAPES[shape]
    bms = tune.block_ms(tokens * k / e)
    cap = tune.cap_for(tokens)
    for kind, kd, nd in (("gate_up", h, inter), ("down", inter, h)):
        sweep = tune.candidates(kind, bms, kd, nd, cap)
        full = tune.candidates(kind, bms, kd, nd, 10**6)
        assert 0 < len(sweep) <= cap and len(sweep) == min(cap, len(full))
        assert all(tune.fits(kind, t, kd, nd) for t in full)
        assert {t.block_m for t in sweep} == set(bms)
        shapes = {(t.block_m, t.block_n, t.block_k) for t in full}
        assert {(t.block_m, t.block_n, t.block_k) for t in sweep} == shapes
        assert len(set(sweep)) == len(sweep)
    assert tune.smem_bytes("gate_up", tune.Tile(128, 256, 128, 8, 8, 5)) > tune.SMEM_LIMIT
    assert not tune.fits("gate_up", tune.Tile(128, 256, 64, 8, 8, 3), h, inter)  # 256 acc regs
    assert tune.candidates("down", bms, inter, h, 0) == []
    n = tokens * k
    chunks = tune.align_chunks(n, e, bms[-1])
    default = ma._align_plan(n, e, bms[-1])[3]  # qwen3: 128; mixtral (E=8): already 2048
    assert chunks == sorted(set(chunks))
    assert bool(chunks) == (min(max(tune.ALIGN_CHUNKS), 1 << (n - 1).bit_length()) > default)
    assert tune.align_chunks(16, e, 64) == []  # one chunk covers every pair already


def test_tune_choose_pairs_one_block_m() -> None:
    """The fastest gate/up and down tiles may disagree on block_m; the choice is
    the fastest pair that shares one, alignment time included."""
    tile = tune.Tile
    gate_up = {tile(64, 64, 64, 8, 4, 3): 1.0, tile(128, 128, 64, 8, 8, 3): 1.2}
    down = {tile(64, 128, 64, 8, 4, 3): 1.0, tile(128, 256, 64, 8, 8, 4): 0.5,
            tile(32, 64, 64, 8, 4, 3): 0.1}
    cfg, total = tune.choose(gate_up, down, {64: 0.0, 128: 0.05})
    assert cfg.block_m == 128 and total == pytest.approx(1.75)
    assert tune.split_config(cfg) == (tile(128, 128, 64, 8, 8, 3), tile(128, 256, 64, 8, 8, 4))
    assert tune.choose(gate_up, {tile(32, 64, 64, 8, 4, 3): 0.1}, {}) is None


@interpreter_only
def test_tune_run_writes_a_table_the_runtime_picks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """tools/tune/moe end to end on the interpreter (tiny tiles): the table it
    writes loads, MoeConfig.pick returns its entries, and fused_moe_triton with
    them matches the reference. A spent budget still leaves a loadable table,
    and a later run merges into the same file."""
    e, k, h, inter = 4, 2, 32, 32
    gu = [tune.Tile(16, 32, 16, 2, 4, 1), tune.Tile(16, 16, 32, 1, 4, 1)]
    dn = [tune.Tile(16, 32, 32, 2, 4, 1), tune.Tile(32, 16, 16, 2, 4, 1)]
    cpu = torch.device("cpu")
    empty = tune.run(tmp_path, 0.0, {"tiny": (e, k, h, inter)}, (8,), cpu, matmul_n=64,
                     sweep=lambda shape, t: (gu, dn), dtype=torch.float32, iters=1)
    assert mc.load_table(str(empty)) == {}
    path = tune.run(tmp_path, 600.0, {"tiny": (e, k, h, inter)}, (8, 16), cpu, matmul_n=64,
                    sweep=lambda shape, t: (gu, dn), dtype=torch.float32, iters=1)
    assert path == empty and path.name == "moe_cpu.json"
    raw = json.loads(path.read_text())
    key = mc.shape_key(e, h, inter, k)
    assert list(raw["configs"][key]) == ["8", "16"] and raw["meta"]["device"] == "cpu"
    timing = raw["timings"][key]["8"]
    assert timing["configs_timed"][0] >= 3 and not timing["budget_cut"]  # default + 2 + group_m 16
    assert f"| {key} | 16 |" in capsys.readouterr().out
    kernels = KernelConfig(moe_table=str(path))
    g = torch.Generator().manual_seed(5)
    for t in (8, 16):
        picked = mc.MoeConfig.pick(t * k, e, torch.device("cuda", 0), hidden=h, inter=inter, top_k=k,
                                   kernels=kernels)
        assert picked == mc.MoeConfig.from_dict(raw["configs"][key][str(t)])
        x = torch.randn(t, h, generator=g)
        w13 = torch.randn(e, 2 * inter, h, generator=g) / h**0.5
        w2 = torch.randn(e, h, inter, generator=g) / inter**0.5
        weights, ids = route_topk_ref(torch.randn(t, e, generator=g), k, True)
        out = mt.fused_moe_triton(x, w13, w2, weights, ids, cfg=picked)
        assert rel_err(out, fused_moe_ref(x, w13, w2, weights, ids)) < 1e-4


@interpreter_only
def test_tune_align_chunk_times_only_identical_plans() -> None:
    """Every chunk the tuner may put in the table reproduces the default grouping."""
    e, k, h, inter, t = 128, 3, 16, 16, 400
    bench = tune.Bench((e, k, h, inter), t, torch.randn(e, 2 * inter, h), torch.randn(e, h, inter), iters=1)
    times = bench.align_chunk_times(16, time.monotonic() + 600)
    assert sorted(times) == [0, 256, 512, 1024, 2048] and all(v > 0 for v in times.values())
    assert bench.align_chunk_times(16, time.monotonic() - 1) == {0: times[0]}


@interpreter_only
def test_tune_one_stops_at_the_deadline() -> None:
    """Past the deadline only the default config is timed, and it is the entry."""
    e, k, h, inter, t = 4, 2, 32, 32, 8
    w13 = torch.randn(e, 2 * inter, h) / h**0.5
    w2 = torch.randn(e, h, inter) / inter**0.5
    bench = tune.Bench((e, k, h, inter), t, w13, w2, iters=1)
    sweep = ([tune.Tile(16, 32, 16, 2, 4, 1)], [tune.Tile(16, 32, 32, 2, 4, 1)])
    cut = tune.tune_one(bench, time.monotonic() - 1, lambda msg: None, sweep=sweep)
    assert cut is not None and cut["timing"]["budget_cut"]
    assert cut["timing"]["configs_timed"] == [1, 1]
    assert tune.split_config(cut["config"]) == tune.split_config(mc.heuristic(t * k, e, "cpu"))


def norm_route_ref(
    x: torch.Tensor, r: torch.Tensor | None, nw: torch.Tensor, gw: torch.Tensor, k: int, renorm: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The unfused composition the fused kernel replaces (the torch backend)."""
    c = torch.zeros(1, dtype=torch.int32, device=x.device)
    return ops.add_rms_norm_route(KernelConfig(backend="torch"), x, r, nw, 1e-6, gw, k, renorm, c)


@pytest.mark.parametrize("t,residual,renorm", [(1, True, True), (2, True, False), (3, False, True)])
def test_add_norm_route_matches_composition(t: int, residual: bool, renorm: bool) -> None:
    """One launch = fused add + RMSNorm + router linear + top-k; E = 10 is not a
    multiple of the per-program expert block, H = 48 not a power of two. Two
    launches share the counter: the first must leave it at zero."""
    g = torch.Generator().manual_seed(t)
    e, k, h = 10, 3, 48
    x = torch.randn(t, h, generator=g).to(DEVICE)
    r = torch.randn(t, h, generator=g).to(DEVICE) if residual else None
    nw = (1 + 0.1 * torch.randn(h, generator=g)).to(DEVICE)
    gw = torch.randn(e, h, generator=g).to(DEVICE)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    ref = norm_route_ref(x, r, nw, gw, k, renorm)
    for _ in range(2):
        got = df.add_norm_route_triton(x, r, nw, 1e-6, gw, k, renorm, counter)
        assert int(counter.cpu()[0]) == 0
        torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
        if residual:
            assert got[1] is not None and ref[1] is not None and torch.equal(got[1], ref[1])
        else:
            assert got[1] is None
        assert got[3].dtype == torch.int32 and torch.equal(got[3], ref[3])
        torch.testing.assert_close(got[2], ref[2], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block_e", [1, 2, 8])
def test_add_norm_route_experts_per_program(block_e: int) -> None:
    """Other program widths (``block_e``), the same routing (E = 10 is no
    multiple of 4 or 8)."""
    g = torch.Generator().manual_seed(block_e)
    e, k, h = 10, 3, 48
    x, r = (torch.randn(2, h, generator=g).to(DEVICE) for _ in range(2))
    nw = (1 + 0.1 * torch.randn(h, generator=g)).to(DEVICE)
    gw = torch.randn(e, h, generator=g).to(DEVICE)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    got = df.add_norm_route_triton(x, r, nw, 1e-6, gw, k, True, counter, block_e=block_e)
    ref = norm_route_ref(x, r, nw, gw, k, True)
    assert torch.equal(got[3], ref[3]) and int(counter.cpu()[0]) == 0
    torch.testing.assert_close(got[2], ref[2], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="power of two"):
        df.add_norm_route_triton(x, r, nw, 1e-6, gw, k, True, counter, block_e=3)


def test_add_norm_route_ties_and_nan_rows() -> None:
    """Equal logits go lowest index first (each top-k round is one (value,
    index) reduction); a NaN row (graph padding garbage) still gives ids in
    [0, E), and the real rows beside it are unaffected."""
    g = torch.Generator().manual_seed(3)
    e, k, h = 12, 4, 32
    x = torch.randn(3, h, generator=g)
    x[1] = float("nan")
    nw = torch.ones(h)
    gw = torch.randn(e, h, generator=g) * 0.01
    gw[9] = gw[5] = gw[2] = x[0] * 3  # three equal, largest logits for row 0
    gw[7] = x[0] * 2
    x, nw, gw = x.to(DEVICE), nw.to(DEVICE), gw.to(DEVICE)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    _, _, w, ids = df.add_norm_route_triton(x, None, nw, 1e-6, gw, k, False, counter)
    ids, w = ids.cpu(), w.cpu()
    assert ids[0].tolist() == [2, 5, 9, 7], ids[0]
    assert w[0, 0] == w[0, 1] == w[0, 2] and w[0, 2] > w[0, 3]
    assert bool(((ids >= 0) & (ids < e)).all())
    ref = norm_route_ref(x[2:], None, nw, gw, k, False)
    assert torch.equal(ids[2], ref[3][0].cpu())
    assert int(counter.cpu()[0]) == 0


def test_add_norm_route_bf16_rounds_like_the_reference() -> None:
    """bf16: the sum is the exact bf16 sum (on CUDA); the normed rows and the
    routing weights agree with the composition to bf16 rounding."""
    g = torch.Generator().manual_seed(11)
    t, e, k, h = 2, 16, 4, 64
    x = torch.randn(t, h, generator=g).bfloat16().to(DEVICE)
    r = torch.randn(t, h, generator=g).bfloat16().to(DEVICE)
    nw = (1 + 0.1 * torch.randn(h, generator=g)).bfloat16().to(DEVICE)
    gw = (torch.randn(e, h, generator=g) / h**0.5).bfloat16().to(DEVICE)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    got = df.add_norm_route_triton(x, r, nw, 1e-6, gw, k, True, counter)
    ref = norm_route_ref(x, r, nw, gw, k, True)
    assert got[1] is not None and ref[1] is not None
    if DEVICE == "cuda":
        assert torch.equal(got[1], ref[1])
    else:  # the interpreter's fp32 -> bf16 cast truncates instead of rounding
        torch.testing.assert_close(got[1], ref[1], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got[0], ref[0], rtol=2e-2, atol=2e-2)
    # Logits round to bf16 in both; a 1-ulp difference can reorder a near tie, so
    # compare the probability mass chosen, not the ids.
    torch.testing.assert_close(got[2].sum(1), ref[2].sum(1))
    assert (got[3] == ref[3]).float().mean() >= 0.75


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_norm_route_zero_centered(dtype: torch.dtype) -> None:
    """Qwen3-Next's post-attention norm, norm(s) * (1 + w) rounded once, in the
    fused launch: the composition's normed rows, sum and routing."""
    g = torch.Generator().manual_seed(12)
    t, e, k, h = 2, 10, 3, 48
    x, r = ((2 * torch.randn(t, h, generator=g)).to(dtype).to(DEVICE) for _ in range(2))
    nw = (0.2 * torch.randn(h, generator=g)).to(dtype).to(DEVICE)
    gw = (torch.randn(e, h, generator=g) / h**0.5).to(dtype).to(DEVICE)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    got = df.add_norm_route_triton(x, r, nw, 1e-6, gw, k, True, counter, zero_centered=True)
    ref = ops.add_rms_norm_route(KernelConfig(backend="torch"), x, r, nw, 1e-6, gw, k, True,
                                 torch.zeros_like(counter), zero_centered=True)
    plain = norm_route_ref(x, r, nw, gw, k, True)
    assert not torch.allclose(plain[0].float(), ref[0].float(), atol=1e-2), "1 + w is not w"
    assert int(counter.cpu()[0]) == 0 and got[1] is not None and ref[1] is not None
    if dtype == torch.float32:
        torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(got[1], ref[1]) and torch.equal(got[3], ref[3])
        torch.testing.assert_close(got[2], ref[2], rtol=1e-5, atol=1e-6)
    else:  # the interpreter truncates its bf16 casts; a near tie may reorder
        torch.testing.assert_close(got[0].float(), ref[0].float(), rtol=3e-2, atol=3e-2)
        torch.testing.assert_close(got[2].sum(1), ref[2].sum(1), rtol=2e-2, atol=2e-2)
        assert (got[3] == ref[3]).float().mean() >= 0.5


def test_ops_norm_route_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton runs the fused kernel up to FUSED_MAX_TOKENS rows, the composition
    past it; both agree with the reference."""
    g = torch.Generator().manual_seed(5)
    e, k, h = 8, 2, 32
    nw = torch.ones(h).to(DEVICE)
    gw = torch.randn(e, h, generator=g).to(DEVICE)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    calls = count_calls(monkeypatch, df, "add_norm_route_triton")
    ops._triton_table.cache_clear()
    kernels = KernelConfig(backend="triton")
    try:
        for t, fused in [(3, True), (df.FUSED_MAX_TOKENS + 1, False)]:
            x = torch.randn(t, h, generator=g).to(DEVICE)
            r = torch.randn(t, h, generator=g).to(DEVICE)
            n0 = len(calls)
            got = ops.add_rms_norm_route(kernels, x, r, nw, 1e-6, gw, k, True, counter)
            assert (len(calls) > n0) == fused
            ref = norm_route_ref(x, r, nw, gw, k, True)
            assert torch.equal(got[3], ref[3])
    finally:
        ops._triton_table.cache_clear()


def test_decode_gemv_kernels_compile_for_sm90() -> None:
    """The decode GEMV kernels (MoE gate/up and down variants, norm + route, dense
    GEMV at 1, 2, 4 rows, and its GLU and pending-norm epilogues at SmolLM2's and
    an 8B dense model's shapes) compile for sm_90 at the qwen3-30b shapes without
    spilling, and the unrolled K loops issue several weight loads before their
    first FMA (tests/sm90_compile.py; a subprocess: this one runs the
    interpreter)."""
    from tests.sm90_compile import compile_in_child

    res = compile_in_child(["-m", "tests.sm90_compile"], timeout=600)
    assert not {k: v["error"] for k, v in res.items() if "error" in v}
    for name, r in res.items():
        assert r["local"] in (0, -1) and r["loop_spills"] in (0, -1), f"{name} spills registers: {r}"
    for name in ("add_norm_route", "add_norm_route_next", "add_norm_route_be4"):
        # No frame at all: a [4, 2048] router tile on one warp spilled 632 bytes (route_warps).
        assert res[name]["stack"] in (0, -1), (name, res[name])
    for name in ("moe_down3d", "gemv_o_T1", "gemv_o_T1_pdl", "gemv_add_norm_8b_down_T1_pdl", "gemv_glu_8b_T1"):
        n = res[name]["loads_before_first_use"]
        assert n == -1 or n >= 8, f"{name}: only {n} loads issued before the first FMA"
    for name, r in res.items():  # PDL: a wait exactly where compiled in, no early release
        assert r["pdl_wait"] == name.endswith("_pdl") and not r["pdl_release"], (name, r)
    # Weights in flight before the wait where they are no earlier kernel's output.
    assert res["gemv_o_T1_pdl"]["loads_before_wait"] >= 1, res["gemv_o_T1_pdl"]
    assert res["gemv_qkv_T2_pdl"]["loads_before_wait"] >= 1, res["gemv_qkv_T2_pdl"]
    assert res["add_norm_route_pdl"]["loads_before_wait"] >= 2, res["add_norm_route_pdl"]
    for name in ("moe_gate_up_pdl", "moe_down3d_pdl"):
        assert res[name]["loads_before_wait"] == 0, (name, res[name])
    for name in ("moe_gate_up", "moe_down3d"):  # read-through keeps the weight loads 16 bytes wide
        plain, rt = res[name]["v4_loads"], res[name + "_rt"]["v4_loads"]
        assert plain > 0 and rt >= plain, (name, plain, rt)  # one load from the slot or the bank


def test_moe_block_norm_route_hooks_see_the_router() -> None:
    """A forward hook on the router (tests, bench_engine's expert count) turns
    the fused launch off for that block: the hook sees the logits, and the
    routing equals the fused kernel's."""
    from ftserve.models.layers import MoEBlock, RMSNorm

    kernels = KernelConfig(backend="triton")
    g = torch.Generator().manual_seed(8)
    h, e, k = 32, 8, 2
    block = MoEBlock(0, h, 16, e, k, True, torch.float32).to(DEVICE)
    norm = RMSNorm(h, 1e-6, torch.float32).to(DEVICE)
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(e, h, generator=g))
        norm.weight.copy_(1 + 0.1 * torch.randn(h, generator=g))
    x, r = torch.randn(2, h, generator=g).to(DEVICE), torch.randn(2, h, generator=g).to(DEVICE)
    fused = block.norm_route(x, r, norm, kernels)
    seen: list[torch.Tensor] = []
    handle = block.gate.register_forward_hook(lambda m, i, o: seen.append(o))
    try:
        hooked = block.norm_route(x, r, norm, kernels)
    finally:
        handle.remove()
    assert len(seen) == 1 and seen[0].shape == (2, e)
    assert torch.equal(hooked[3], fused[3])
    torch.testing.assert_close(hooked[2], fused[2], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hooked[0], fused[0], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- GPU, real shapes

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("t", [1, 3, 64, 1000, 8192])
def test_gpu_fused_moe_qwen3_30b_shape(t: int) -> None:
    """E=128, k=8, H=2048, I=768 (qwen3-30b-a3b)."""
    g = torch.Generator(device="cuda").manual_seed(t)
    e, k, h, inter = 128, 8, 2048, 768
    x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
    w13 = (torch.randn(e, 2 * inter, h, device="cuda", generator=g) / h**0.5).bfloat16()
    w2 = (torch.randn(e, h, inter, device="cuda", generator=g) / inter**0.5).bfloat16()
    logits = torch.randn(t, e, device="cuda", generator=g)
    weights, ids = mt.route_topk_triton(logits, k, True)
    rw, rids = route_topk_ref(logits, k, True)
    # Ids may differ only where two probabilities tie to within an ulp (8192 x 128
    # random logits make that likely somewhere): compare the probabilities chosen.
    probs = torch.softmax(logits, dim=-1)
    torch.testing.assert_close(probs.gather(1, ids.long()), probs.gather(1, rids.long()),
                               rtol=1e-5, atol=1e-7)
    assert (ids == rids).float().mean() > 0.999
    torch.testing.assert_close(weights, rw, rtol=1e-5, atol=1e-6)
    out = mt.fused_moe_triton(x, w13, w2, weights, ids)
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 2e-2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("t", [1, 8])  # GEMV path, grouped path
def test_gpu_fused_moe_no_sync_and_graph_capturable(t: int) -> None:
    e, k, h, inter = 16, 4, 256, 128
    x = torch.randn(t, h, device="cuda").bfloat16()
    w13 = (torch.randn(e, 2 * inter, h, device="cuda") / h**0.5).bfloat16()
    w2 = (torch.randn(e, h, inter, device="cuda") / inter**0.5).bfloat16()
    logits = torch.randn(t, e, device="cuda")
    mt.fused_moe_triton(x, w13, w2, *mt.route_topk_triton(logits, k, True))  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mt.fused_moe_triton(x, w13, w2, *mt.route_topk_triton(logits, k, True))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mt.fused_moe_triton(x, w13, w2, *mt.route_topk_triton(logits, k, True))
    for seed in (1, 2):
        torch.manual_seed(seed)
        logits.copy_(torch.randn(t, e, device="cuda"))
        out.fill_(float("nan"))
        graph.replay()
        ref = fused_moe_ref(x, w13, w2, *route_topk_ref(logits, k, True))
        torch.cuda.synchronize()
        assert rel_err(out, ref) < 2e-2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("t", [1, 2, 4])
def test_gpu_add_norm_route_qwen3_shape_graph(t: int) -> None:
    """E=128, k=8, H=2048: sync-free, capturable, replays agree with the
    composition, and the counter is zero after every replay."""
    g = torch.Generator(device="cuda").manual_seed(t)
    e, k, h = 128, 8, 2048
    x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
    r = torch.randn(t, h, device="cuda", generator=g).bfloat16()
    nw = (1 + 0.1 * torch.randn(h, device="cuda", generator=g)).bfloat16()
    gw = (torch.randn(e, h, device="cuda", generator=g) / h**0.5).bfloat16()
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    df.add_norm_route_triton(x, r, nw, 1e-6, gw, k, True, counter)  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        df.add_norm_route_triton(x, r, nw, 1e-6, gw, k, True, counter)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = df.add_norm_route_triton(x, r, nw, 1e-6, gw, k, True, counter)
    for seed in (1, 2, 3):
        torch.manual_seed(seed)
        x.copy_(torch.randn(t, h, device="cuda"))
        graph.replay()
        ref = norm_route_ref(x, r, nw, gw, k, True)
        torch.cuda.synchronize()
        assert int(counter.item()) == 0
        assert out[1] is not None and ref[1] is not None and torch.equal(out[1], ref[1])
        torch.testing.assert_close(out[0], ref[0], rtol=1e-2, atol=1e-2)
        probs = torch.softmax(torch.nn.functional.linear(ref[0], gw).float(), dim=-1)
        torch.testing.assert_close(probs.gather(1, out[3].long()), probs.gather(1, ref[3].long()),
                                   rtol=2e-2, atol=1e-4)
        # The same experts, in either order among near-ties (measured on the H200:
        # positional agreement 0.875 at t=4, all from adjacent swaps of experts
        # whose probabilities agree to rounding; the MoE sum does not depend on order).
        same = out[3].sort(dim=1).values == ref[3].sort(dim=1).values
        assert same.float().mean() >= 0.9


@pytest.mark.gpu
@gpu
def test_gpu_packaged_moe_table_configs_match_reference() -> None:
    """Every entry of this GPU's packaged table runs and matches the reference
    (the tuner checked them at its T; this guards edits and Triton upgrades)."""
    path = mc.CONFIG_DIR / mc.table_file_name(torch.cuda.get_device_name())
    if not path.is_file():
        pytest.skip(f"no tuned table {path.name} for this GPU")
    torch.manual_seed(0)
    for key, by_t in mc.load_table(str(path)).items():
        e, h, inter, k = mc.parse_shape_key(key)
        w13 = (torch.randn(e, 2 * inter, h, device="cuda") / h**0.5).bfloat16()
        w2 = (torch.randn(e, h, inter, device="cuda") / inter**0.5).bfloat16()
        for t, cfg in by_t.items():
            t = min(t, 1024)  # the tiles, not T, are under test; keeps the reference cheap
            x = torch.randn(t, h, device="cuda").bfloat16()
            weights, ids = mt.route_topk_triton(torch.randn(t, e, device="cuda"), k, True)
            out = mt.fused_moe_triton(x, w13, w2, weights, ids, cfg=cfg)
            assert rel_err(out, fused_moe_ref(x, w13, w2, weights, ids)) < 2e-2, (key, t, cfg)
        del w13, w2

