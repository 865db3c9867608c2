"""Read-through: decode's expert GEMVs (moe_gemv_triton) read this step's
expert-cache misses from the pinned host bank over UVA and write their slots
as the rows pass, instead of a fill kernel first (see ftserve/moe/cache.py).
Here: the miss list the GEMVs take, the jit helpers their kernels call and the
launcher helpers that turn the list into kernel arguments.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class ReadThrough(NamedTuple):
    """This step's expert-cache misses, read by the GEMVs straight from the host
    bank (UVA) and written into their slots on the way, instead of a fill
    kernel first (moe/cache.py). ``miss_slot`` / ``miss_id`` [M] int32 are the
    admission's fill list (-1 = none): slot miss_slot[i] gets bank row
    miss_id[i]; w13 / w2 of a bank row start ``w13_col`` / ``w2_col`` elements
    into it, as in a slot row. The bank is pinned (moe.kernels.check_bank) or,
    for the interpreter, any CPU tensor."""

    bank: torch.Tensor  # [ids, R]
    miss_slot: torch.Tensor  # [M] int32
    miss_id: torch.Tensor  # [M] int32
    w13_col: int
    w2_col: int

    def args(self, col: int) -> tuple[int, torch.Tensor, torch.Tensor, int, int]:
        return self.bank.data_ptr(), self.miss_slot, self.miss_id, self.miss_slot.numel(), col


def _no_read_through(ids: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor, int, int]:
    return 0, ids, ids, 0, 0  # unread: READ_THROUGH=False


@triton.jit
def _miss_source(slot, miss_slot_ptr, miss_id_ptr, M, BLOCK_M: tl.constexpr):
    """The bank row to read ``slot`` from: its id in this step's fill list
    (miss_slot[i] == slot), else -1 (a hit: read the slot). ``slot`` is a scalar
    or [KP, 1] (-> [KP]); the list is M <= T*k entries, -1 = none."""
    offs = tl.arange(0, BLOCK_M)
    ms = tl.load(miss_slot_ptr + offs, mask=offs < M, other=-1)
    mi = tl.load(miss_id_ptr + offs, mask=offs < M, other=-1)
    hit = (slot == ms) & (mi >= 0)
    return tl.max(tl.where(hit, mi, -1), axis=len(hit.shape) - 1).to(tl.int64)


@triton.jit
def _bank_rows(bank, dtype: tl.constexpr):
    # The pinned bank's address as an int64 (UVA); rows are 16-byte aligned
    # (moe.kernels.check_bank), which the cast forgets: restore it for vector loads.
    return tl.multiple_of(bank.to(tl.pointer_type(dtype)), 16)


def _read_through_args(rt: ReadThrough | None, ids: torch.Tensor, w: torch.Tensor,
                       col: str) -> tuple[int, torch.Tensor, torch.Tensor, int, int]:
    if rt is None:
        return _no_read_through(ids)
    assert rt.bank.dtype == w.dtype and rt.bank.shape[1] == w.stride(0), "bank rows are laid out as slot rows"
    assert rt.miss_slot.dtype == rt.miss_id.dtype == torch.int32 and rt.miss_slot.shape == rt.miss_id.shape
    return rt.args(getattr(rt, col))


def _read_through_consts(rt: ReadThrough | None) -> dict[str, object]:
    m = 0 if rt is None else rt.miss_slot.numel()
    return dict(READ_THROUGH=rt is not None, BLOCK_M=max(2, triton.next_power_of_2(max(m, 1))))
