"""Fixed-shape bookkeeping kernels: expert-slot admission, slot-range
invalidation, page copies, a decode step's host words. Each has a torch twin
(``*_ref``) with identical results; neither ever reads a device value back to
the host.

Expert-slot maps (issue 6)::

    slot_of_id [L*E + 1] int32   (layer*E + expert) -> slot or -1; the last
                                 entry is the sink that absorbs "no id" writes
    id_of_slot [S] int32         slot -> id or -1 (empty)
    last_used  [S] int64         stamp of the admission that last touched it
    step       [1] int64         admission counter, incremented by each call

Admission algorithm (``admit_experts``), for ``needed [M]`` (-1 = padding):

1. The first occurrence of each id is its owner; repeats only read the result.
2. hit = slot_of_id[id]. Slots hit in this call are protected from eviction.
3. Owners that missed are ranked 0..n-1 in ``needed`` order.
4. Victims are the n unprotected slots with the smallest key
   ``last_used * S + slot`` (empty slots count as last_used = -1, so they go
   first; ties cannot happen). The kernel finds the n-th smallest key by a
   binary search over the key range (at most ~64 steps, none when n = 0).
5. Victims, taken in slot order, go to the misses in rank order: the evicted id
   is unmapped (through the sink if the slot was empty), the new id mapped,
   hits and victims stamped ``last_used = step``; ``step += 1``.
6. Outputs: ``slots [M]`` (the slot of every entry, -1 for padding) and the
   fill list ``miss_slot [M]`` / ``miss_id [M]`` (-1 where entry i is not a
   miss owner): copy expert ``miss_id[i]``'s weights into ``miss_slot[i]``.

The caller must size S so that S - (distinct hits) >= misses of any call
(every step's distinct experts fit); ``admit_experts`` checks S >= M.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ftserve_kernels.attention_common import interpreting

_BIG = 2**62  # key of protected slots: never a victim
_BIG_K: tl.constexpr = tl.constexpr(_BIG)


def new_slot_maps(
    num_ids: int, num_slots: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty maps: (slot_of_id [num_ids + 1], id_of_slot [S], last_used [S], step [1])."""
    return (
        torch.full((num_ids + 1,), -1, dtype=torch.int32, device=device),
        torch.full((num_slots,), -1, dtype=torch.int32, device=device),
        torch.full((num_slots,), -1, dtype=torch.int64, device=device),
        torch.zeros(1, dtype=torch.int64, device=device),
    )


# ---------------------------------------------------------------- admission


def admit_experts_ref(
    needed: torch.Tensor, slot_of_id: torch.Tensor, id_of_slot: torch.Tensor,
    last_used: torch.Tensor, step: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch twin of ``admit_experts`` (same results, maps updated in place)."""
    dev = needed.device
    m, s = needed.numel(), id_of_slot.numel()
    sink = slot_of_id.numel() - 1
    ids = needed.long()
    valid = ids >= 0
    ar_m = torch.arange(m, device=dev)
    earlier_same = (ids[None, :] == ids[:, None]) & (ar_m[None, :] < ar_m[:, None])  # [M, M]
    owner = valid & ~earlier_same.any(1)
    safe_ids = torch.where(valid, ids, sink)
    hit = torch.where(valid, slot_of_id[safe_ids].long(), -1)  # [M]
    prot = torch.zeros(s + 1, dtype=torch.bool, device=dev)
    prot.scatter_(0, torch.where(hit >= 0, hit, s), True)
    prot = prot[:s]
    is_miss = owner & (hit < 0)
    n_miss = is_miss.sum()
    miss_rank = torch.cumsum(is_miss.long(), 0) - 1
    ar_s = torch.arange(s, device=dev)
    lu = torch.where(id_of_slot >= 0, last_used, -1)
    key = torch.where(prot, _BIG, lu * s + ar_s)  # [S], unique
    rank = torch.empty_like(ar_s)
    rank[torch.argsort(key)] = ar_s
    is_victim = rank < n_miss
    vrank = torch.cumsum(is_victim.long(), 0) - 1
    victims = torch.full((s + 1,), -1, dtype=torch.long, device=dev)
    victims.scatter_(0, torch.where(is_victim, vrank, s), ar_s)
    v = torch.where(is_miss, victims[miss_rank.clamp_min(0)], -1)  # [M]
    v_safe = torch.where(is_miss, v, s)
    old = torch.where(is_miss, id_of_slot[v.clamp_min(0)].long(), -1)
    slot_of_id.scatter_(0, torch.where(old >= 0, old, sink), -1)
    slot_of_id.scatter_(0, torch.where(is_miss, ids, sink), torch.where(is_miss, v, -1).int())
    slot_of_id[sink] = -1
    id_pad = torch.cat([id_of_slot, id_of_slot.new_full((1,), -1)])
    id_pad.scatter_(0, v_safe, torch.where(is_miss, ids, -1).int())
    id_of_slot.copy_(id_pad[:s])
    stamped = torch.where(prot, step, last_used)
    lu_pad = torch.cat([stamped, stamped.new_full((1,), -1)])
    lu_pad.scatter_(0, v_safe, step.expand(m))
    last_used.copy_(lu_pad[:s])
    step += 1
    slots = torch.where(valid, slot_of_id[safe_ids].long(), -1).int()
    return slots, v.int(), torch.where(is_miss, ids, -1).int()


@triton.jit
def _admit_kernel(
    needed_ptr, slot_of_id_ptr, id_of_slot_ptr, last_used_ptr, step_ptr,
    out_slot_ptr, miss_slot_ptr, miss_id_ptr, prot_ptr, victim_ptr,
    M, S, SINK,
    BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK_J: tl.constexpr,
):
    # One program; phases talk through global scratch, ordered by barriers.
    step = tl.load(step_ptr)
    i = tl.arange(0, BLOCK_M)
    im = i < M
    ids = tl.load(needed_ptr + i, mask=im, other=-1)
    valid = ids >= 0
    dup = tl.zeros([BLOCK_M], tl.int32)
    for j0 in range(0, M, CHUNK_J):
        j = j0 + tl.arange(0, CHUNK_J)
        idj = tl.load(needed_ptr + j, mask=j < M, other=-1)
        same = (idj[None, :] == ids[:, None]) & (j[None, :] < i[:, None])
        dup += tl.sum(same.to(tl.int32), 1)
    owner = valid & (dup == 0)
    safe_ids = tl.where(valid, ids, SINK)
    hit = tl.load(slot_of_id_ptr + safe_ids, mask=im, other=-1)
    hit = tl.where(valid, hit, -1)
    s = tl.arange(0, BLOCK_S)
    sm = s < S
    tl.store(prot_ptr + s, tl.zeros([BLOCK_S], tl.int32), mask=sm)
    tl.debug_barrier()
    tl.store(prot_ptr + hit, tl.full([BLOCK_M], 1, tl.int32), mask=hit >= 0)
    tl.debug_barrier()
    prot = tl.load(prot_ptr + s, mask=sm, other=1, volatile=True) != 0
    is_miss = owner & (hit < 0)
    n_miss = tl.sum(is_miss.to(tl.int32), 0)
    miss_rank = tl.cumsum(is_miss.to(tl.int32), 0) - 1
    occ = tl.load(id_of_slot_ptr + s, mask=sm, other=-1)
    lu = tl.load(last_used_ptr + s, mask=sm, other=0)
    lu = tl.where(occ >= 0, lu, -1)
    key = tl.where(prot | (s >= S), _BIG_K, lu * S + s)  # [S] int64, unique
    # Smallest threshold with n_miss keys at or below it, searched in
    # [min key - 1, max unprotected key]; n_miss = 0 -> no iterations, no victims.
    # The iteration count only shortens the search: extra steps change nothing.
    kmin = tl.min(key, 0)
    kmax = tl.max(tl.where(key < _BIG_K, key, kmin), 0)
    lo = kmin - 1
    hi = kmax
    span = (kmax - lo + 1).to(tl.float32)
    iters = tl.where(n_miss > 0, tl.ceil(tl.log2(span)).to(tl.int32) + 2, 0)
    for _ in range(iters):
        mid = lo + (hi - lo) // 2
        enough = tl.sum((key <= mid).to(tl.int32), 0) >= n_miss
        hi = tl.where(enough, mid, hi)
        lo = tl.where(enough, lo, mid + 1)
    is_victim = key <= hi
    vrank = tl.cumsum(is_victim.to(tl.int32), 0) - 1
    tl.store(victim_ptr + vrank, s, mask=is_victim)
    tl.debug_barrier()
    v = tl.load(victim_ptr + miss_rank, mask=is_miss, other=-1, volatile=True)
    old = tl.load(id_of_slot_ptr + v, mask=is_miss, other=-1)
    tl.store(slot_of_id_ptr + tl.where(old >= 0, old, SINK), tl.full([BLOCK_M], -1, tl.int32),
             mask=is_miss)
    tl.debug_barrier()
    tl.store(slot_of_id_ptr + ids, v, mask=is_miss)
    tl.store(id_of_slot_ptr + v, ids, mask=is_miss)
    tl.store(last_used_ptr + v, tl.zeros([BLOCK_M], tl.int64) + step, mask=is_miss)
    tl.store(last_used_ptr + s, tl.zeros([BLOCK_S], tl.int64) + step, mask=sm & prot)
    tl.store(slot_of_id_ptr + SINK, -1)
    tl.store(miss_slot_ptr + i, tl.where(is_miss, v, -1), mask=im)
    tl.store(miss_id_ptr + i, tl.where(is_miss, ids, -1), mask=im)
    tl.debug_barrier()
    out = tl.load(slot_of_id_ptr + safe_ids, mask=im, other=-1, volatile=True)
    tl.store(out_slot_ptr + i, tl.where(valid, out, -1), mask=im)
    tl.store(step_ptr, step + 1)


def admit_experts(
    needed: torch.Tensor, slot_of_id: torch.Tensor, id_of_slot: torch.Tensor,
    last_used: torch.Tensor, step: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """needed [M] int32 ids (-1 = padding) -> (slots [M], miss_slot [M], miss_id [M]),
    all int32; maps updated in place (see the module docstring). One launch."""
    m, s = needed.numel(), id_of_slot.numel()
    if s < m:
        raise ValueError(f"{s} expert slots cannot hold the {m} experts one call may need")
    assert slot_of_id.dtype == id_of_slot.dtype == torch.int32 and last_used.dtype == torch.int64
    dev = needed.device
    out = torch.empty(m, dtype=torch.int32, device=dev)
    miss_slot = torch.empty(m, dtype=torch.int32, device=dev)
    miss_id = torch.empty(m, dtype=torch.int32, device=dev)
    prot = torch.empty(s, dtype=torch.int32, device=dev)
    victims = torch.empty(s, dtype=torch.int32, device=dev)
    block_s = triton.next_power_of_2(s)
    _admit_kernel[(1,)](
        needed, slot_of_id, id_of_slot, last_used, step, out, miss_slot, miss_id, prot, victims,
        m, s, slot_of_id.numel() - 1,
        BLOCK_M=triton.next_power_of_2(m), BLOCK_S=block_s, CHUNK_J=32,
        num_warps=min(16, max(4, block_s // 256)),
    )
    return out, miss_slot, miss_id


# ---------------------------------------------------------------- invalidation


def invalidate_slots_ref(
    slot_of_id: torch.Tensor, id_of_slot: torch.Tensor, start: int, end: int
) -> None:
    """slot_of_id[id_of_slot[s]] = -1 and id_of_slot[s] = -1 for s in [start, end)."""
    sink = slot_of_id.numel() - 1
    old = id_of_slot[start:end].long()
    slot_of_id.scatter_(0, torch.where(old >= 0, old, sink), -1)
    id_of_slot[start:end] = -1


@triton.jit
def _invalidate_kernel(slot_of_id_ptr, id_of_slot_ptr, start, end, SINK, BLOCK: tl.constexpr):
    s = start + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = s < end
    old = tl.load(id_of_slot_ptr + s, mask=m, other=-1)
    # Empty slots write the sink: no branch, no data-dependent shape.
    tl.store(slot_of_id_ptr + tl.where(old >= 0, old, SINK), tl.full([BLOCK], -1, tl.int32), mask=m)
    tl.store(id_of_slot_ptr + s, tl.full([BLOCK], -1, tl.int32), mask=m)


def invalidate_slots(
    slot_of_id: torch.Tensor, id_of_slot: torch.Tensor, start: int, end: int
) -> None:
    """One fixed-shape launch; the range is host data (a buffer's slot range)."""
    if end <= start:
        return
    block = 1024
    _invalidate_kernel[(triton.cdiv(end - start, block),)](
        slot_of_id, id_of_slot, start, end, slot_of_id.numel() - 1, BLOCK=block
    )


# ---------------------------------------------------------------- page copy


def copy_kv_pages_ref(
    src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
    src_pages: torch.Tensor, dst_pages: torch.Tensor, page_size: int,
) -> None:
    """Pools [L, slots, Hkv, D]: page src_pages[i] -> dst_pages[i] in every layer;
    -1 in either list skips the pair. Reads the lists on the host: reference only."""
    for sp, dp in zip(src_pages.tolist(), dst_pages.tolist()):
        if sp < 0 or dp < 0:
            continue
        src_rows = slice(sp * page_size, (sp + 1) * page_size)
        dst_rows = slice(dp * page_size, (dp + 1) * page_size)
        dst_k[:, dst_rows] = src_k[:, src_rows].to(dst_k.device)
        dst_v[:, dst_rows] = src_v[:, src_rows].to(dst_v.device)


@triton.jit
def _copy_blocks_kernel(
    src_a, src_b, dst_a, dst_b, src_idx_ptr, dst_idx_ptr, N,
    group_stride_src, group_stride_dst, BLOCK_ELEMS,
    HOST_SRC: tl.constexpr, HOST_DST: tl.constexpr, ELEM: tl.constexpr, BLOCK: tl.constexpr,
):
    # Blocks src_idx[i] -> dst_idx[i] of tensor a or b, in group g (a KV layer),
    # for i = program 0's index, + the programs along axis 0, ... < N: one block
    # per program when the grid covers every block, a strided loop when the grid
    # was capped (a copy that must leave most SMs to concurrent compute).
    group_ab = tl.program_id(1)  # group * 2 + (0 for a, 1 for b)
    chunk = tl.program_id(2)
    # Pinned host memory arrives as an int64 address (UVA): cast it to a pointer.
    # New names, bound before the runtime branch, keep each name's type fixed.
    if HOST_SRC:
        sa = src_a.to(tl.pointer_type(ELEM))
        sb = src_b.to(tl.pointer_type(ELEM))
    else:
        sa = src_a
        sb = src_b
    if HOST_DST:
        da = dst_a.to(tl.pointer_type(ELEM))
        db = dst_b.to(tl.pointer_type(ELEM))
    else:
        da = dst_a
        db = dst_b
    group = (group_ab // 2).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    m = offs < BLOCK_ELEMS
    for i in range(tl.program_id(0), N, tl.num_programs(0)):
        sp = tl.load(src_idx_ptr + i).to(tl.int64)
        dp = tl.load(dst_idx_ptr + i).to(tl.int64)
        if (sp >= 0) & (dp >= 0):
            s_off = group * group_stride_src + sp * BLOCK_ELEMS + offs
            d_off = group * group_stride_dst + dp * BLOCK_ELEMS + offs
            if group_ab % 2 == 0:
                tl.store(da + d_off, tl.load(sa + s_off, mask=m), mask=m)
            else:
                tl.store(db + d_off, tl.load(sb + s_off, mask=m), mask=m)


_WORD = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_TL_WORD = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


def _launch_copy(
    srcs: tuple[torch.Tensor, torch.Tensor], dsts: tuple[torch.Tensor, torch.Tensor],
    src_idx: torch.Tensor, dst_idx: torch.Tensor, groups: int, pairs: int,
    group_stride_src: int, group_stride_dst: int, block_elems: int,
    max_programs: int | None = None,
) -> None:
    n = src_idx.numel()
    if n == 0:
        return
    assert all(t.is_contiguous() for t in (*srcs, *dsts))
    assert srcs[0].dtype == dsts[0].dtype, "copies move bits: same dtype on both sides"
    esize = srcs[0].element_size()
    on_gpu = src_idx.is_cuda

    def arg(t: torch.Tensor) -> torch.Tensor | int:
        if on_gpu and not t.is_cuda:
            assert t.is_pinned(), "host-side tensors must be pinned for UVA access"
            return t.data_ptr()
        return t.view(_WORD[esize])

    sa, sb, da, db = (arg(t) for t in (*srcs, *dsts))
    block = min(4096, triton.next_power_of_2(block_elems))
    rows = n if max_programs is None else max(1, min(n, max_programs))
    grid = (rows, groups * pairs, triton.cdiv(block_elems, block))
    _copy_blocks_kernel[grid](
        sa, sb, da, db, src_idx, dst_idx, n, group_stride_src, group_stride_dst, block_elems,
        HOST_SRC=isinstance(sa, int), HOST_DST=isinstance(da, int),
        ELEM=_TL_WORD[esize], BLOCK=block,
    )


def copy_kv_pages(
    src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
    src_pages: torch.Tensor, dst_pages: torch.Tensor, page_size: int,
    max_programs: int | None = None,
) -> None:
    """Copy pages between two pools (device<->device, or device<->pinned host over
    UVA) for every layer in one launch. ``src_pages``/``dst_pages`` [P] int32 on
    the compute device, -1 = skip. Pools: contiguous [L, slots, Hkv, D], same dtype;
    also the fp8 scales [L, slots, Hkv] (any trailing dims: a page is page_size rows).
    ``max_programs`` caps the programs along the page axis (each then walks every
    max_programs-th page): a copy meant to run beside compute kernels, not to
    flood the SMs with thousands of short programs."""
    assert src_k.shape[0] == dst_k.shape[0] and src_k.shape[2:] == dst_k.shape[2:]
    page_elems = page_size * math.prod(src_k.shape[2:])
    _launch_copy((src_k, src_v), (dst_k, dst_v), src_pages, dst_pages, src_k.shape[0], 2,
                 src_k[0].numel(), dst_k[0].numel(), page_elems, max_programs)


def copy_rows_ref(
    src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor
) -> None:
    """dst[dst_idx[i]] = src[src_idx[i]] where both are >= 0. Reference only (host loop)."""
    for s, d in zip(src_idx.tolist(), dst_idx.tolist()):
        if s >= 0 and d >= 0:
            dst[d] = src[s].to(dst.device)


def copy_rows(
    src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor
) -> None:
    """dst[dst_idx[i]] = src[src_idx[i]] along dim 0 where both are >= 0; one launch,
    either side may be pinned host memory (UVA). Expert fill after admission::

        copy_rows(host_w13, slot_w13, miss_id, miss_slot)   # [L*E, 2I, H] -> [S, 2I, H]
    """
    assert src.shape[1:] == dst.shape[1:]
    _launch_copy((src, src), (dst, dst), src_idx, dst_idx, 1, 1, 0, 0, src[0].numel())


@triton.jit
def _host_words_kernel(src, dst, n, parity_ptr, pair_stride, HOST_SRC: tl.constexpr, BLOCK: tl.constexpr,
                       PAIRED: tl.constexpr = False, FLIP: tl.constexpr = False):
    # The pinned side arrives as an int64 address (UVA), as in _copy_blocks_kernel.
    # PAIRED: it is a pair of buffers, pair_stride words apart, and the device
    # word at parity_ptr (0 or 1) picks one; FLIP then toggles that word.
    if HOST_SRC:
        sp = src.to(tl.pointer_type(tl.int64))
        dp = dst
    else:
        sp = src
        dp = dst.to(tl.pointer_type(tl.int64))
    if PAIRED:
        side = tl.load(parity_ptr)
        if HOST_SRC:
            sp += side.to(tl.int64) * pair_stride
        else:
            dp += side.to(tl.int64) * pair_stride
    for off in range(0, n, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(dp + offs, tl.load(sp + offs, mask=m), mask=m)
    if FLIP:
        # One program: every thread read the side before any thread writes it.
        tl.debug_barrier()
        tl.store(parity_ptr, 1 - side)


def copy_host_words_ref(src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst <- src, int64 words, one side pinned host memory: a stream-ordered copy."""
    dst.copy_(src, non_blocking=True)


def copy_host_words(src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst <- src for a few int64 words between pinned host memory and a CUDA
    tensor (either way), as one small kernel on the current stream instead of
    a copy-engine transfer. A decode step's inputs and sampled tokens are tens
    of words; as memcpys, each waited for the compute stream, ran on a copy
    engine and handed back (H200, batch 1, 2k context: 17.3 us between two
    decode graphs, of which the two copies' own time was 2.7; with these
    kernels 11.5 us, most of it the next graph's start). Same ordering as a copy: the host
    may reuse ``src`` / read ``dst`` once work after this on the stream is
    known done (an event). Off CUDA (or interpreted): the copy itself."""
    assert src.dtype == dst.dtype == torch.int64 and src.numel() == dst.numel()
    assert src.is_contiguous() and dst.is_contiguous()
    if not (src.is_cuda or dst.is_cuda) or interpreting():
        copy_host_words_ref(src, dst)
        return
    host_src = not src.is_cuda
    host = src if host_src else dst
    assert host.is_pinned() and (dst.is_cuda if host_src else src.is_cuda), \
        "one side pinned host memory, the other a CUDA tensor"
    n = src.numel()
    if n == 0:
        return
    _host_words_kernel[(1,)](
        host.data_ptr() if host_src else src, dst if host_src else host.data_ptr(), n,
        dst if host_src else src, 0,  # parity: unread
        HOST_SRC=host_src, BLOCK=min(1024, triton.next_power_of_2(n)), num_warps=1,
    )


def copy_host_words_paired_ref(src: torch.Tensor, dst: torch.Tensor, parity: torch.Tensor,
                               flip: bool = False) -> None:
    """The twin of copy_host_words_paired (host code: it reads ``parity``)."""
    side = int(parity.reshape(-1)[0])
    if src.dim() == 2:
        dst.copy_(src[side], non_blocking=True)
    else:
        dst[side].copy_(src, non_blocking=True)
    if flip:
        parity.fill_(1 - side)


def paired_copies_supported(device: torch.device) -> bool:
    """Whether copy_host_words_paired runs as a kernel there: what lets a CUDA
    graph move a step's words itself (the memcpy cannot follow a device word)."""
    return device.type == "cuda" and not interpreting()


@dataclass(frozen=True)
class StagedRows:
    """A pinned pair of int64 rows, ``pair`` [2, n] (words contiguous within a
    row), and the device word that picks the row a step uses (``parity`` [1]
    int32, 0 or 1): copy_host_words_paired's layout, for a kernel inside a
    decode graph to read its step's words from, or store its tokens into, over
    UVA itself (decode_inputs, greedy_triton) instead of a copy kernel."""

    pair: torch.Tensor
    parity: torch.Tensor

    def __post_init__(self) -> None:
        assert self.pair.dtype == torch.int64 and self.pair.dim() == 2 and self.pair.shape[0] == 2
        assert self.pair.stride(1) == 1 and self.parity.dtype == torch.int32 and self.parity.numel() == 1

    def host_row(self) -> torch.Tensor:
        """The row the word picks, read on the host (the twins': a sync on CUDA)."""
        return self.pair[int(self.parity.reshape(-1)[0])]

    def address(self) -> int:
        """The pair's first word as an int64 address (pinned: valid on the device)."""
        return self.pair.data_ptr()


def copy_host_words_paired(src: torch.Tensor, dst: torch.Tensor, parity: torch.Tensor,
                           flip: bool = False) -> None:
    """copy_host_words where the pinned side is a pair of buffers, [2, n] (rows
    contiguous), and a device word picks the row: ``parity`` [1] int32, 0 or 1,
    read by the kernel (no host sync: the copy can sit inside a CUDA graph whose
    steps alternate between the two rows). ``flip`` toggles the word after the
    copy. Step N of the decode graphs uses row N % 2 (the host writes and reads
    the same row): their inputs launch reads its words from the row itself
    (StagedRows), and a graph whose greedy kernel does not store the tokens
    ends with this copy + flip. Off CUDA the twin (it reads the word on the host)."""
    pair, other = (src, dst) if src.dim() == 2 else (dst, src)
    assert src.dtype == dst.dtype == torch.int64 and pair.shape[0] == 2 and other.dim() == 1
    assert pair.shape[1] == other.numel() and pair.stride(1) == 1 and other.is_contiguous()
    assert parity.dtype == torch.int32 and parity.numel() == 1 and parity.device == other.device
    if not (other.is_cuda and paired_copies_supported(other.device)):
        copy_host_words_paired_ref(src, dst, parity, flip)
        return
    assert pair.is_pinned(), "the pair is pinned host memory, the other side a CUDA tensor"
    n = other.numel()
    host_src = pair is src
    _host_words_kernel[(1,)](
        pair.data_ptr() if host_src else src, dst if host_src else pair.data_ptr(), n, parity,
        pair.stride(0), HOST_SRC=host_src, BLOCK=min(1024, triton.next_power_of_2(max(n, 1))),
        PAIRED=True, FLIP=flip, num_warps=1,
    )
