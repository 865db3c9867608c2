"""Fixed-shape bookkeeping kernels (expert admission, invalidation, page copy)
against their torch twins, plus the invariants they must keep."""

from __future__ import annotations

import importlib
import os
import random
import sys
from typing import Any

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # The interpreter is chosen when a kernel is decorated (see test_kernels_attention).
    os.environ["TRITON_INTERPRET"] = "1"
    if "ftserve_kernels.bookkeeping" in sys.modules:
        importlib.reload(sys.modules["ftserve_kernels.bookkeeping"])

from ftserve_kernels import bookkeeping as bk  # noqa: E402
from tests.engine_util import read_one_step_late  # noqa: E402


def check_maps(slot_of_id: torch.Tensor, id_of_slot: torch.Tensor) -> None:
    """The two maps are inverse to each other (sink excluded)."""
    sid = slot_of_id[:-1].cpu().tolist()
    ios = id_of_slot.cpu().tolist()
    for s, i in enumerate(ios):
        if i >= 0:
            assert sid[i] == s, (s, i)
    for i, s in enumerate(sid):
        if s >= 0:
            assert ios[s] == i, (i, s)


def test_admission_small_case_is_lru() -> None:
    maps = bk.new_slot_maps(10, 3, DEVICE)
    slot_of_id, id_of_slot, last_used, step = maps

    def admit(ids: list[int]) -> list[int]:
        needed = torch.tensor(ids, dtype=torch.int32, device=DEVICE)
        slots, ms, mi = bk.admit_experts(needed, *maps)
        check_maps(slot_of_id, id_of_slot)
        got = id_of_slot.cpu().tolist()
        for i, s in zip(ids, slots.cpu().tolist()):
            assert (i < 0 and s == -1) or got[s] == i
        return slots.cpu().tolist()

    assert admit([4, -1, 4]) == [0, -1, 0]  # empty slots fill in slot order, repeats share
    assert admit([7, 2]) == [1, 2]
    assert admit([4]) == [0]  # hit: 4 is now the most recent
    assert admit([9, -1]) == [1, -1]  # evicts 7 (least recently used), not 2 or 4
    assert slot_of_id[7].item() == -1
    assert admit([2, 5]) == [2, 0]  # 2 hits (protected); 5 evicts 4, the LRU of {0, 1}
    assert int(step.item()) == 5


def test_admission_matches_reference_random() -> None:
    rng = random.Random(0)
    num_ids, num_slots, m = 40, 12, 8
    tri = bk.new_slot_maps(num_ids, num_slots, DEVICE)
    ref = bk.new_slot_maps(num_ids, num_slots, DEVICE)
    for _ in range(12):
        ids = [rng.randrange(num_ids) if rng.random() < 0.8 else -1 for _ in range(m)]
        ids = [i if i < 0 else i % 16 for i in ids]  # small hot set: hits and repeats
        needed = torch.tensor(ids, dtype=torch.int32, device=DEVICE)
        got = bk.admit_experts(needed, *tri)
        want = bk.admit_experts_ref(needed, *ref)
        for a, b in zip(got, want):
            assert torch.equal(a.cpu(), b.cpu())
        for a, b in zip(tri, ref):
            assert torch.equal(a[:-1].cpu(), b[:-1].cpu()) if a.numel() == num_ids + 1 else \
                torch.equal(a.cpu(), b.cpu())
        check_maps(tri[0], tri[1])
        # Fill list: each miss owner once, into a slot that now holds it.
        ms, mi = got[1].cpu().tolist(), got[2].cpu().tolist()
        pairs = [(s, i) for s, i in zip(ms, mi) if s >= 0]
        assert len({i for _, i in pairs}) == len(pairs)
        assert all(tri[1][s].item() == i for s, i in pairs)


def test_admission_rejects_too_few_slots() -> None:
    maps = bk.new_slot_maps(10, 2, DEVICE)
    with pytest.raises(ValueError, match="slots"):
        bk.admit_experts(torch.tensor([1, 2, 3], dtype=torch.int32, device=DEVICE), *maps)


def test_invalidate_matches_reference() -> None:
    for impl in (bk.invalidate_slots, bk.invalidate_slots_ref):
        slot_of_id, id_of_slot, _, _ = bk.new_slot_maps(20, 8, DEVICE)
        for s, i in [(0, 3), (2, 11), (3, 0), (5, 19), (7, 6)]:
            id_of_slot[s] = i
            slot_of_id[i] = s
        impl(slot_of_id, id_of_slot, 2, 6)  # slot 4 is empty: its write goes to the sink
        assert id_of_slot.cpu().tolist() == [3, -1, -1, -1, -1, -1, -1, 6]
        assert slot_of_id[3].item() == 0 and slot_of_id[6].item() == 7
        assert all(slot_of_id[i].item() == -1 for i in (11, 0, 19))
        check_maps(slot_of_id, id_of_slot)


@pytest.mark.parametrize("max_programs", [None, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_copy_pages_matches_reference(dtype: torch.dtype, max_programs: int | None) -> None:
    layers, pages, ps, hkv, d = 2, 6, 4, 2, 8
    shape = (layers, pages * ps, hkv, d)
    g = torch.Generator().manual_seed(0)
    src_k = torch.randint(0, 100, shape, generator=g).to(dtype).to(DEVICE)
    src_v = torch.randint(0, 100, shape, generator=g).to(dtype).to(DEVICE)
    dst = [torch.zeros(shape, dtype=dtype, device=DEVICE) for _ in range(4)]
    sp = torch.tensor([1, 4, -1, 2, 5], dtype=torch.int32, device=DEVICE)
    dp = torch.tensor([3, 1, 2, -1, 5], dtype=torch.int32, device=DEVICE)
    # Capped at 2 programs along the pages, each walks every other page of the 5.
    bk.copy_kv_pages(src_k, src_v, dst[0], dst[1], sp, dp, ps, max_programs=max_programs)
    bk.copy_kv_pages_ref(src_k, src_v, dst[2], dst[3], sp, dp, ps)
    assert torch.equal(dst[0], dst[2]) and torch.equal(dst[1], dst[3])
    assert torch.equal(dst[0][:, 3 * ps : 4 * ps], src_k[:, ps : 2 * ps])
    assert not dst[0][:, 2 * ps : 3 * ps].any(), "-1 pairs are skipped"


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
def test_gpu_copy_pages_host_device_roundtrip_in_graph() -> None:
    layers, pages, ps, hkv, d = 4, 64, 16, 4, 128
    shape = (layers, pages * ps, hkv, d)
    dev_k = torch.randn(shape, device="cuda").bfloat16()
    dev_v = torch.randn(shape, device="cuda").bfloat16()
    host_k = torch.zeros(shape, dtype=torch.bfloat16).pin_memory()
    host_v = torch.zeros(shape, dtype=torch.bfloat16).pin_memory()
    sp = torch.tensor([3, 9, -1, 63], dtype=torch.int32, device="cuda")
    dp = torch.tensor([1, 2, 5, 60], dtype=torch.int32, device="cuda")
    bk.copy_kv_pages(dev_k, dev_v, host_k, host_v, sp, dp, ps)  # device -> host
    torch.cuda.synchronize()
    for s, t in [(3, 1), (9, 2), (63, 60)]:
        assert torch.equal(host_k[:, t * ps : (t + 1) * ps], dev_k[:, s * ps : (s + 1) * ps].cpu())
        assert torch.equal(host_v[:, t * ps : (t + 1) * ps], dev_v[:, s * ps : (s + 1) * ps].cpu())
    back_k, back_v = torch.zeros_like(dev_k), torch.zeros_like(dev_v)
    bk.copy_kv_pages(host_k, host_v, back_k, back_v, dp, sp, ps)  # compile outside the capture
    back_k.zero_()
    back_v.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # host -> device, captured
        bk.copy_kv_pages(host_k, host_v, back_k, back_v, dp, sp, ps)
    graph.replay()
    torch.cuda.synchronize()
    for s in (3, 9, 63):
        assert torch.equal(back_k[:, s * ps : (s + 1) * ps], dev_k[:, s * ps : (s + 1) * ps])
        assert torch.equal(back_v[:, s * ps : (s + 1) * ps], dev_v[:, s * ps : (s + 1) * ps])


@pytest.mark.gpu
@gpu
def test_gpu_admission_no_sync_and_matches_reference() -> None:
    num_ids, num_slots, m = 48 * 128, 1536, 512
    tri = bk.new_slot_maps(num_ids, num_slots, "cuda")
    ref = bk.new_slot_maps(num_ids, num_slots, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for it in range(6):
        needed = torch.randint(-1, 3000, (m,), device="cuda", generator=gen).int()
        if it == 0:  # compile outside the sync check
            scratch = bk.new_slot_maps(num_ids, num_slots, "cuda")
            bk.admit_experts(needed.clone(), *scratch)
            bk.invalidate_slots(scratch[0], scratch[1], 0, 50)
            torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = bk.admit_experts(needed, *tri)
            bk.invalidate_slots(tri[0], tri[1], 100 * it, 100 * it + 50)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        want = bk.admit_experts_ref(needed, *ref)
        bk.invalidate_slots_ref(ref[0], ref[1], 100 * it, 100 * it + 50)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        assert torch.equal(tri[1], ref[1]) and torch.equal(tri[2], ref[2])
        assert torch.equal(tri[0][:-1], ref[0][:-1])
    check_maps(tri[0], tri[1])


def test_copy_rows_matches_reference() -> None:
    g = torch.Generator().manual_seed(2)
    src = torch.randn(7, 3, 5, generator=g).to(DEVICE)
    outs = [torch.zeros(4, 3, 5, device=DEVICE) for _ in range(2)]
    si = torch.tensor([6, -1, 0, 2], dtype=torch.int32, device=DEVICE)
    di = torch.tensor([1, 0, 3, -1], dtype=torch.int32, device=DEVICE)
    bk.copy_rows(src, outs[0], si, di)
    bk.copy_rows_ref(src, outs[1], si, di)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0][1], src[6]) and torch.equal(outs[0][3], src[0])
    assert not outs[0][0].any() and not outs[0][2].any()


@pytest.mark.gpu
@gpu
def test_gpu_expert_fill_from_pinned_host_in_graph() -> None:
    """Admission + fill from pinned host banks, captured in one CUDA graph."""
    num_ids, slots, rows, cols = 64, 8, 96, 128
    bank = torch.randn(num_ids, rows, cols).bfloat16().pin_memory()
    cache = torch.zeros(slots, rows, cols, dtype=torch.bfloat16, device="cuda")
    maps = bk.new_slot_maps(num_ids, slots, "cuda")
    needed = torch.full((4,), -1, dtype=torch.int32, device="cuda")
    needed.copy_(torch.tensor([5, 9, -1, 5]))
    out = bk.admit_experts(needed, *maps)  # warm-up compiles outside the capture
    bk.copy_rows(bank, cache, out[2], out[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        slots_out, miss_slot, miss_id = bk.admit_experts(needed, *maps)
        bk.copy_rows(bank, cache, miss_id, miss_slot)
    for ids in ([1, 2, 3, 4], [7, 1, -1, 63], [10, 11, 12, 13], [63, 7, 10, 2]):
        needed.copy_(torch.tensor(ids))
        graph.replay()
        torch.cuda.synchronize()
        for i, s in zip(ids, slots_out.tolist()):
            if i >= 0:
                assert torch.equal(cache[s].cpu(), bank[i]), (i, s)


@pytest.mark.parametrize("n", [1, 7, 2500])
def test_host_words_kernel_both_ways(n: int) -> None:
    """The step-copy kernel moves every word, either side given as a bare
    address (the pinned side's UVA pointer on a GPU; here, under the
    interpreter, a host tensor's), and nothing past n; on CUDA for real."""
    g = torch.Generator().manual_seed(n)
    words = torch.randint(-(1 << 62), 1 << 62, (n,), dtype=torch.int64, generator=g)
    if DEVICE == "cuda":
        host, dev = words.pin_memory(), torch.full((n + 3,), -7, dtype=torch.int64, device="cuda")
        bk.copy_host_words(host, dev[:n])
        back = torch.full((n + 3,), -9, dtype=torch.int64).pin_memory()
        bk.copy_host_words(dev[:n], back[:n])
        torch.cuda.synchronize()
        assert torch.equal(dev[:n].cpu(), words) and (dev[n:] == -7).all()
        assert torch.equal(back[:n], words) and (back[n:] == -9).all()
        return
    block = min(1024, 1 << (n - 1).bit_length())
    dst = torch.full((n + 3,), -7, dtype=torch.int64)
    bk._host_words_kernel[(1,)](words.data_ptr(), dst, n, dst, 0, HOST_SRC=True, BLOCK=block)
    assert torch.equal(dst[:n], words) and (dst[n:] == -7).all()
    back = torch.full((n + 3,), -9, dtype=torch.int64)
    bk._host_words_kernel[(1,)](dst, back.data_ptr(), n, dst, 0, HOST_SRC=False, BLOCK=block)
    assert torch.equal(back[:n], words) and (back[n:] == -9).all()


def test_copy_host_words_checks_its_arguments() -> None:
    with pytest.raises(AssertionError):
        bk.copy_host_words(torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int32))
    with pytest.raises(AssertionError):
        bk.copy_host_words(torch.zeros(4, dtype=torch.int64), torch.zeros(5, dtype=torch.int64))
    a, b = torch.arange(4), torch.zeros(4, dtype=torch.int64)
    bk.copy_host_words(a, b)  # host to host: the plain copy
    assert torch.equal(a, b)


@pytest.mark.gpu
@gpu
def test_gpu_step_copies_stay_stream_ordered() -> None:
    """Input words written on the host, a kernel reading them, device work,
    tokens stored back over UVA, an event: after the event the host sees the
    tokens of *this* step, across many steps with alternating buffers (as the
    decode graphs and the runner use them), without a device sync."""
    n = 9
    h_in = [torch.zeros(n, dtype=torch.int64).pin_memory() for _ in range(2)]
    h_out = [torch.zeros(n, dtype=torch.int64).pin_memory() for _ in range(2)]
    g_in = torch.zeros(n, dtype=torch.int64, device="cuda")
    pending: list[tuple[int, Any]] = []
    for step in range(40):
        h_in[step % 2].copy_(torch.arange(n) + 1000 * step)
        bk.copy_host_words(h_in[step % 2], g_in)
        out = g_in * 3 + 1  # the step's "tokens"
        bk.copy_host_words(out, h_out[step % 2])
        read_one_step_late(pending, step, h_out, n)


@pytest.mark.parametrize("side", [0, 1])
@pytest.mark.parametrize("n", [1, 7, 1500])
def test_paired_host_words_kernel_follows_the_device_word(side: int, n: int) -> None:
    """The paired step copy reads (or writes) the row of the pair that the
    parity word names, nothing past n and nothing of the other row; FLIP
    toggles the word. Under the interpreter the pair is a host tensor given
    by address, as its pinned UVA pointer is on a GPU."""
    if DEVICE == "cuda":
        pytest.skip("the CUDA run is test_gpu_paired_step_copies_in_a_graph")
    g = torch.Generator().manual_seed(n + side)
    pair = torch.randint(-(1 << 62), 1 << 62, (2, n + 5), dtype=torch.int64, generator=g)
    block = min(1024, 1 << (max(n, 1) - 1).bit_length())
    parity = torch.tensor([side], dtype=torch.int32)
    dst = torch.full((n + 3,), -7, dtype=torch.int64)
    bk._host_words_kernel[(1,)](pair.data_ptr(), dst, n, parity, pair.stride(0), HOST_SRC=True,
                                BLOCK=block, PAIRED=True)
    assert torch.equal(dst[:n], pair[side, :n]) and (dst[n:] == -7).all()
    assert parity.item() == side  # no FLIP: the word stays
    before = pair.clone()
    words = torch.arange(n, dtype=torch.int64) * 3 - 11
    bk._host_words_kernel[(1,)](words, pair.data_ptr(), n, parity, pair.stride(0), HOST_SRC=False,
                                BLOCK=block, PAIRED=True, FLIP=True)
    assert torch.equal(pair[side, :n], words) and torch.equal(pair[side, n:], before[side, n:])
    assert torch.equal(pair[1 - side], before[1 - side])
    assert parity.item() == 1 - side


def test_copy_host_words_paired_twin_and_checks() -> None:
    """Off CUDA the paired copy is its twin: the parity word read on the host,
    the row copied, the word toggled with flip; bad shapes are refused."""
    pair = torch.zeros(2, 4, dtype=torch.int64)
    parity = torch.zeros(1, dtype=torch.int32)
    for step in range(4):
        words = torch.arange(4) + 10 * step
        bk.copy_host_words_paired(words, pair, parity, flip=True)
        assert torch.equal(pair[step % 2], words) and parity.item() == (step + 1) % 2
        back = torch.zeros(4, dtype=torch.int64)
        bk.copy_host_words_paired(pair, back, torch.tensor([step % 2], dtype=torch.int32))
        assert torch.equal(back, words)
    with pytest.raises(AssertionError):
        bk.copy_host_words_paired(torch.zeros(4, dtype=torch.int64), torch.zeros(3, 4, dtype=torch.int64), parity)
    with pytest.raises(AssertionError):
        bk.copy_host_words_paired(torch.zeros(5, dtype=torch.int64), pair, parity)
    with pytest.raises(AssertionError):
        bk.copy_host_words_paired(torch.zeros(4, dtype=torch.int64), pair, parity.long())


@pytest.mark.gpu
@gpu
def test_gpu_paired_step_copies_in_a_graph() -> None:
    """The decode graphs' pattern: one captured graph reads its input words
    from the pinned row the device word names, computes, writes its tokens to
    the same row of the output pair and toggles the word; the host writes
    step N's inputs into row N % 2 and reads its tokens there one step late,
    with no sync but the events."""
    n = 9
    h_in = torch.zeros(2, n, dtype=torch.int64).pin_memory()
    h_out = torch.zeros(2, n, dtype=torch.int64).pin_memory()
    g_in = torch.zeros(n, dtype=torch.int64, device="cuda")
    parity = torch.zeros(1, dtype=torch.int32, device="cuda")

    def step_fn() -> None:
        bk.copy_host_words_paired(h_in, g_in, parity)
        out = g_in * 3 + 1  # the step's "tokens"
        bk.copy_host_words_paired(out, h_out, parity, flip=True)

    from ftserve.engine.cuda_graph import capture_graph

    graph, _ = capture_graph(step_fn, None)
    parity.zero_()  # the warm-up runs toggled it
    pending: list[tuple[int, Any]] = []
    for step in range(40):
        h_in[step % 2].copy_(torch.arange(n) + 1000 * step)
        graph.replay()
        read_one_step_late(pending, step, h_out, n)
    torch.cuda.synchronize()
    assert parity.item() == 0  # 40 flips
