"""Pull weights into L2 ahead of the kernel that reads them, from a side stream.

At batch 1 a decode layer alternates between kernels that stream weights
(qkv, o_proj, the experts) and latency-bound ones that leave HBM idle (split-K
attention over a short context, its reduce, the norm + router + top-k). The
weights of the next GEMV are known long before its input is, so a tiny kernel
on a second stream can fetch them while the latency-bound kernels run::

    main:  qkv | attention | reduce | o_proj (hits L2) | route | ...
    side:        prefetch o_proj + router ^

The kernel's input is a table of byte ranges (``chunk_table``: the address
and size of each CHUNK-byte piece of the tensors, built once on the host),
one table row per program row. Modes (constexpr):

- ``line``: one ``prefetch.global.L2`` per 128-byte line (fire and forget:
  the program holds no registers for the data and exits);
- ``line_last``: the same with ``L2::evict_last`` priority, so the lines
  outlive streaming traffic of normal priority;
- ``bulk``: one ``cp.async.bulk.prefetch.L2`` per row (sm_90 TMA unit);
- ``load``: ordinary loads of every 4-byte word, summed into a checksum per
  program (``out``). The only mode the Triton interpreter runs (no inline
  PTX there), and the one the tests check coverage with.

A prefetch changes no value, so the torch twin (``prefetch_l2_ref``) only
computes the ``load`` mode's checksums. Sync-free and capturable: the table
is a device tensor made once, the launch has a fixed grid.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ftserve_kernels.attention_common import interpreting

MODES = ("line", "line_last", "bulk", "load")
CHUNK = 4096  # bytes per table row: 32 lines of 128 bytes
LINE = 128
_ROWS_PER_PROGRAM = 8  # 256 lines per program of 4 warps: 2 prefetches a thread


def chunk_table(tensors: Sequence[torch.Tensor], chunk: int = CHUNK) -> torch.Tensor:
    """[n, 2] int64 on the tensors' device: (address, bytes) of each ``chunk``-byte
    piece of every tensor's storage span, in order; the last piece of a tensor
    may be shorter. Sizes are multiples of 16 (``bulk`` needs it): a tail of
    fewer than 16 bytes is left out."""
    assert chunk % LINE == 0 and tensors
    device = tensors[0].device
    rows: list[tuple[int, int]] = []
    for t in tensors:
        assert t.device == device and t.is_contiguous(), "contiguous tensors of one device"
        start, size = t.data_ptr(), t.numel() * t.element_size()
        for off in range(0, size, chunk):
            n = min(chunk, size - off) // 16 * 16
            if n:
                rows.append((start + off, n))
    return torch.tensor(rows, dtype=torch.int64).to(device)


def covered_bytes(t: torch.Tensor, chunk: int = CHUNK) -> int:
    """How many leading bytes of ``t`` chunk_table covers (all but a sub-16-byte tail)."""
    size = t.numel() * t.element_size()
    return size - size % chunk + (size % chunk) // 16 * 16


def checksum_ref(tensors: Sequence[torch.Tensor], chunk: int = CHUNK) -> int:
    """What the ``load`` mode's checksums add up to over chunk_table(tensors): the
    sum of every int32 word the table covers."""
    total = 0
    for t in tensors:
        b = t.reshape(-1).view(torch.uint8)[: covered_bytes(t, chunk)]
        total += int(b.view(torch.int32).sum(dtype=torch.int64))
    return total


def prefetch_l2_ref(tensors: Sequence[torch.Tensor], mode: str, out: torch.Tensor | None = None) -> None:
    """The twin: a prefetch changes nothing; ``load`` fills ``out[0]`` with the checksum
    (the kernel spreads it over its programs: compare sums)."""
    assert mode in MODES
    if mode == "load" and out is not None:
        out.zero_()
        out[0] = checksum_ref(tensors)


@triton.jit
def _prefetch_kernel(table_ptr, out_ptr, n_rows,
                     MODE: tl.constexpr, ROWS: tl.constexpr, CHUNK_B: tl.constexpr, LINE_B: tl.constexpr):
    pid = tl.program_id(0)
    r = pid * ROWS + tl.arange(0, ROWS)  # [R] table rows of this program
    rmask = r < n_rows
    r = tl.where(rmask, r, 0)  # rows past the end repeat row 0: harmless
    addr = tl.load(table_ptr + r * 2)  # [R] int64
    size = tl.load(table_ptr + r * 2 + 1)  # [R] int64, > 0
    if MODE == "load":
        w = tl.arange(0, CHUNK_B // 4)
        wmask = rmask[:, None] & (w[None, :] < (size // 4)[:, None])
        ptr = addr.to(tl.pointer_type(tl.int32), bitcast=True)
        words = tl.load(ptr[:, None] + w[None, :], mask=wmask, other=0, eviction_policy="evict_last")
        tl.store(out_ptr + pid, tl.sum(tl.sum(words.to(tl.int64), 1), 0))
    elif MODE == "bulk":
        done = tl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;", "=r,l,r",
            [addr, size.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(out_ptr + pid + r * 0, done, mask=done != 0)  # never: keeps the asm
    else:
        j = tl.arange(0, CHUNK_B // LINE_B)
        off = tl.where(j[None, :] * LINE_B < size[:, None], j[None, :] * LINE_B, 0)  # [R, L]
        lines = addr[:, None] + off
        if MODE == "line_last":
            asm: tl.constexpr = "prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;"
        else:
            asm: tl.constexpr = "prefetch.global.L2 [$1]; mov.u32 $0, 0;"
        done = tl.inline_asm_elementwise(asm, "=r,l", [lines], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(out_ptr + pid + lines * 0, done, mask=done != 0)  # never: keeps the asm


def programs(table: torch.Tensor) -> int:
    """The launch's grid (and the length ``out`` must have)."""
    return triton.cdiv(table.shape[0], _ROWS_PER_PROGRAM)


def prefetch_l2_triton(table: torch.Tensor, mode: str, out: torch.Tensor) -> None:
    """One launch over ``table`` (chunk_table's rows). ``out``: int64 [programs(table)];
    ``load`` writes each program's checksum there, the other modes nothing."""
    assert mode in MODES, f"prefetch mode {mode!r} is not one of {MODES}"
    assert table.dtype == torch.int64 and table.shape[1] == 2 and table.is_contiguous()
    assert out.dtype == torch.int64 and out.numel() >= programs(table)
    if mode != "load" and interpreting():
        return  # inline PTX does not run in the interpreter; a prefetch changes nothing
    _prefetch_kernel[(programs(table),)](
        table, out, table.shape[0], MODE=mode, ROWS=_ROWS_PER_PROGRAM, CHUNK_B=CHUNK, LINE_B=LINE,
        num_warps=4,
    )
