"""L2 prefetch hints: a latency-bound launch warms L2 with the next launch's weights.

At batch 1 some decode launches barely touch HBM: the split-K attention at a
short context reads 4 MB of KV in ~6 us, its programs mostly waiting on one
dependent chain. The launch after it (o_proj + router) then streams 18 MB of
weights from cold. Here the idle launch issues Hopper's bulk L2 prefetch
(``cp.async.bulk.prefetch.L2.global``: one instruction per range, carried out
by the SM's copy engine, nothing waits on it) over the next launch's weights,
spread over all its programs::

    attention programs p = 0..P-1:  prefetch bytes [p * per, (p + 1) * per) of W
    o_proj programs:                read W (from L2 where the prefetch got there)

A prefetch is only a hint: results never depend on it (the launch that reads
the weights loads them as always), so there is no twin to check against; the
CPU interpreter, which cannot run inline PTX, skips it (``ON`` False), and so
do GPUs before sm_90. What can be checked there is which bytes each program's
threads name (``_thread_range``, tests/test_kernels_l2_prefetch.py).

Where it runs is FTSERVE_L2_PREFETCH (ftserve/envs.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ftserve_kernels.attention_common import interpreting

ALIGN = 16  # the instruction's address and size granularity
MIN_CHUNK = 4096  # bytes one thread's instruction covers at the least


@triton.jit
def _thread_range(part, parts, nbytes, NT: tl.constexpr):
    """Byte offsets [NT] (int64) and sizes [NT] (int32, 0: nothing) of the ranges
    the NT threads of program ``part`` of ``parts`` prefetch: the program's
    share is [part * per, (part + 1) * per), per = nbytes / parts rounded up to
    ALIGN, cut into equal ALIGN-multiple chunks of at least MIN_CHUNK bytes."""
    per = tl.cdiv(tl.cdiv(nbytes, parts), 16) * 16
    chunk = tl.maximum(tl.cdiv(tl.cdiv(per, NT), 16) * 16, 4096)
    t = tl.arange(0, NT).to(tl.int64)
    start = part.to(tl.int64) * per
    lo = start + t * chunk
    hi = tl.minimum(tl.minimum(lo + chunk, start + per), nbytes)
    return lo, tl.maximum(hi - lo, 0).to(tl.int32)


@triton.jit
def issue(ptr, nbytes, part, parts, NT: tl.constexpr, ON: tl.constexpr):
    """Program ``part`` of ``parts`` prefetches its share of the ``nbytes`` bytes
    at ``ptr`` (16-byte aligned, nbytes a multiple of 16) into L2. NT must be
    the launch's thread count (32 x num_warps): one range per thread."""
    if ON:
        lo, size = _thread_range(part, parts, nbytes, NT)
        addr = ptr.to(tl.pointer_type(tl.uint8)) + lo
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; "
            "mov.u32 $0, 0; }",
            "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


@functools.lru_cache(maxsize=8)
def _supported(device_type: str, index: int | None) -> bool:
    if device_type != "cuda" or interpreting():
        return False
    return torch.cuda.get_device_capability(index) >= (9, 0)


@dataclass(frozen=True)
class Region:
    """A contiguous tensor to prefetch, as kernel arguments: the tensor (its
    address) and its size in bytes, rounded down to ALIGN (a hint may miss a
    few bytes at the end)."""

    tensor: torch.Tensor
    nbytes: int


def regions(tensors: tuple[torch.Tensor, ...], device: torch.device, count: int = 2) -> tuple[Region, ...] | None:
    """``count`` Regions for a kernel's prefetch arguments (missing ones: 0
    bytes), or None where prefetch cannot run (no tensors, not sm_90+, the
    interpreter). Tensors must be contiguous and 16-byte aligned."""
    live = [t for t in tensors if t is not None and t.numel()]
    if not live or not _supported(device.type, device.index):
        return None
    assert len(live) <= count, f"{len(live)} prefetch regions, the kernel takes {count}"
    out = []
    for t in live:
        assert t.is_contiguous() and t.data_ptr() % ALIGN == 0, "prefetch regions: contiguous, 16-byte aligned"
        out.append(Region(t, t.numel() * t.element_size() // ALIGN * ALIGN))
    while len(out) < count:
        out.append(Region(live[0], 0))
    return tuple(out)


def kernel_args(rs: tuple[Region, ...] | None, fallback: torch.Tensor) -> dict:
    """The keyword arguments pf_a, pf_a_n, pf_b, pf_b_n and PF of a kernel taking
    two regions; with none, ``fallback`` and 0 bytes (unread: PF is off)."""
    if rs is None:
        return dict(pf_a=fallback, pf_a_n=0, pf_b=fallback, pf_b_n=0, PF=False)
    a, b = rs
    return dict(pf_a=a.tensor, pf_a_n=a.nbytes, pf_b=b.tensor, pf_b_n=b.nbytes, PF=True)
