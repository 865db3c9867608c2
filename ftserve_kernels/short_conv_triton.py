"""The short causal conv of Gated DeltaNet in Triton: conv_prefill and conv_decode
of ftserve_kernels/gated_delta.py (the torch reference and the contract) with
the same signatures; gated_delta_triton re-exports them beside the rule.
In a captured graph (``seq_bounds=None``) the grids are sized from the slot
rows and ``static_len`` instead of the host bounds (``seq_grid``): each program
reads its sequence's length from cu_seqlens and skips what lies past it.

    conv_decode     grid (B, C / BLOCK_C): the window [state | x] of one slot, the
                    K-tap dot and SiLU, the window shifted back into the slot; x read
                    where the projection left it (q, k, v of each key-head group)
    conv_prefill    grid (B, max_len / BLOCK_T, C / BLOCK_C) over packed sequences
                    (device cu_seqlens; the host bounds size the grid), then the
                    state update, grid (B, C / BLOCK_C): a separate launch, since
                    the first one still reads the old windows

Each tap is read straight from x or, before a sequence's first token, from its
slot's window (zeros for a sequence without a prefix). Sums in fp32, one
rounding to x's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ftserve_kernels.gated_delta import InnerSaves

# launch shapes (sm_90 compile test); prefill's the fastest of a device sweep
CONV_BLOCK_T, CONV_BLOCK_C, CONV_WARPS, CONV_DECODE_BLOCK_C = 16, 64, 2, 256


@triton.jit
def slot_flag(ptr, lanes):
    """A bool loaded once per lane of ``lanes`` (an index vector): a vector, not a
    scalar, so that it ands into vector masks (the interpreter cannot broadcast
    a loaded scalar bool into a mask)."""
    return tl.load(ptr + lanes * 0) != 0


@triton.jit
def _load_part(ptr, b, c, lo, stride_t, stride_h, D: tl.constexpr, N: tl.constexpr, mask):
    """Channels c of one input part (channels [lo, lo + N D): N heads of D), zero elsewhere."""
    cc = c - lo
    m = mask & (cc >= 0) & (cc < N * D)
    cc = tl.where(m, cc, 0)
    return tl.load(ptr + b * stride_t + (cc // D) * stride_h + cc % D, mask=m, other=0.0)


@triton.jit
def _conv_decode_kernel(x_ptr, x1_ptr, x2_ptr, w_ptr, cs_ptr, slot_ptr, has_ptr, out_ptr,
                        stride_xt, stride_xh, stride_x1t, stride_x1h, stride_x2t, stride_x2h,
                        stride_ot, stride_cs, C,
                        W: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr,
                        D0: tl.constexpr, N0: tl.constexpr, D1: tl.constexpr, N1: tl.constexpr,
                        D2: tl.constexpr, N2: tl.constexpr):
    # The input row is up to three parts (conv_decode's), read where they lie;
    # a part's masked-off lanes load zeros, so the sum is exactly the channel's value.
    b = tl.program_id(0)
    oc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = oc < C
    e = tl.arange(0, BLOCK_E)  # window position: [0, W) the state, W the new input
    slot = tl.load(slot_ptr + b).to(tl.int64)
    has = slot_flag(has_ptr + b, oc)
    x = _load_part(x_ptr, b, oc, 0, stride_xt, stride_xh, D0, N0, mc)
    if N1 > 0:
        x += _load_part(x1_ptr, b, oc, N0 * D0, stride_x1t, stride_x1h, D1, N1, mc)
    if N2 > 0:
        x += _load_part(x2_ptr, b, oc, N0 * D0 + N1 * D1, stride_x2t, stride_x2h, D2, N2, mc)
    st_ptr = cs_ptr + slot * stride_cs + oc[:, None] * W + e[None, :]  # [BLOCK_C, BLOCK_E]
    old = tl.load(st_ptr, mask=(mc & has)[:, None] & (e < W)[None, :], other=0.0)
    win = tl.where((e == W)[None, :], x[:, None], old.to(x.dtype))  # the reference's ext, in x's dtype
    w = tl.load(w_ptr + oc[:, None] * (W + 1) + e[None, :], mask=mc[:, None] & (e <= W)[None, :], other=0.0)
    y = tl.sum(win.to(tl.float32) * w.to(tl.float32), 1)
    tl.store(out_ptr + b * stride_ot + oc, (y * tl.sigmoid(y)).to(out_ptr.dtype.element_ty), mask=mc)
    # The window shifts by one: position e moves to e - 1. Other threads read the
    # old window above; the barrier keeps every read before any write.
    tl.debug_barrier()
    tl.store(st_ptr - 1, win.to(cs_ptr.dtype.element_ty), mask=mc[:, None] & (e >= 1)[None, :] & (e <= W)[None, :])


@triton.jit
def _conv_prefill_kernel(x_ptr, w_ptr, cs_ptr, slot_ptr, has_ptr, cu_ptr, out_ptr,
                         stride_xt, stride_ot, stride_cs, C,
                         W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    n = tl.program_id(0)
    lo = tl.load(cu_ptr + n)
    length = tl.load(cu_ptr + n + 1) - lo
    # Offsets within one sequence fit in int32; the sequence's start is added as a
    # scalar (64-bit pointer tiles would cost twice the registers).
    x_seq = x_ptr + lo.to(tl.int64) * stride_xt
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)  # token within the sequence
    oc = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = oc < C
    m = (t < length)[:, None] & mc[None, :]
    slot = tl.load(slot_ptr + n).to(tl.int64)
    has = slot_flag(has_ptr + n, oc)
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(W + 1):
        # Tap j of token t reads window position t + j: the sequence's token
        # t - W + j, or before the sequence's start its conv state.
        in_x = t >= W - j
        xv = tl.load(x_seq + (t - W + j)[:, None] * stride_xt + oc[None, :], mask=m & in_x[:, None], other=0.0)
        sv = tl.load(cs_ptr + slot * stride_cs + oc[None, :] * W + (t + j)[:, None],
                     mask=m & (~in_x)[:, None] & has[None, :], other=0.0)
        val = tl.where(in_x[:, None], xv, sv.to(xv.dtype)).to(tl.float32)
        wj = tl.load(w_ptr + oc * (W + 1) + j, mask=mc, other=0.0).to(tl.float32)
        acc += val * wj[None, :]
    out = acc * tl.sigmoid(acc)
    tl.store(out_ptr + lo.to(tl.int64) * stride_ot + t[:, None] * stride_ot + oc[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _conv_state_kernel(x_ptr, cs_ptr, slot_ptr, has_ptr, cu_ptr, stride_xt, stride_cs, C,
                       W: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr,
                       off_ptr=None, save_ptr=None, K: tl.constexpr = 0):
    """The last W window positions of [old state | the sequence's tokens] become the state.
    K > 0 (InnerSaves, program n K + i): the window after the sequence's first
    off_ptr[n K + i] tokens goes into slot save_ptr[n K + i] instead (-1: none)."""
    if K > 0:
        n = tl.program_id(0) // K
        p = tl.program_id(0)
    else:
        n = tl.program_id(0)
    lo = tl.load(cu_ptr + n).to(tl.int64)
    if K > 0:
        hi = lo + tl.load(off_ptr + p)
    else:
        hi = tl.load(cu_ptr + n + 1).to(tl.int64)
    oc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = oc < C
    e = tl.arange(0, BLOCK_W)
    me = e < W
    slot = tl.load(slot_ptr + n).to(tl.int64)
    has = slot_flag(has_ptr + n, oc)
    pos = (hi - lo) + e  # window position of new state entry e
    in_x = pos >= W
    m = mc[:, None] & me[None, :]
    xv = tl.load(x_ptr + (lo + pos - W)[None, :] * stride_xt + oc[:, None], mask=m & in_x[None, :], other=0.0)
    st_ptr = cs_ptr + slot * stride_cs + oc[:, None] * W
    sv = tl.load(st_ptr + pos[None, :], mask=m & (~in_x)[None, :] & has[:, None], other=0.0)
    val = tl.where(in_x[None, :], xv, sv.to(xv.dtype)).to(cs_ptr.dtype.element_ty)
    if K > 0:
        dst = tl.load(save_ptr + p + oc * 0).to(tl.int64)  # [BLOCK_C]
        tl.store(cs_ptr + dst[:, None] * stride_cs + oc[:, None] * W + e[None, :], val, mask=m & (dst >= 0)[:, None])
    else:
        tl.debug_barrier()  # a short sequence moves old entries within the same row
        tl.store(st_ptr + e[None, :], val, mask=m)


def seq_grid(seq_bounds: Sequence[int] | None, slots: torch.Tensor, static_len: int | None,
             ) -> tuple[int, int]:
    """(sequences, the most tokens of one) that size a launch's grid: from the
    host bounds, or in a captured graph (seq_bounds None) every slot row and
    the graph's static bound."""
    if seq_bounds is None:
        assert static_len is not None, "a graph's step passes static_len"
        return slots.shape[0], static_len
    n = len(seq_bounds) - 1
    return n, max((seq_bounds[i + 1] - seq_bounds[i] for i in range(n)), default=0)


def device_bounds(seq_bounds: Sequence[int] | None, cu_seqlens: torch.Tensor | None,
                  device: torch.device) -> torch.Tensor:
    """cu_seqlens as given (the batch's qo_indptr), else the host bounds sent with a
    non-blocking copy (host to device: no sync)."""
    if cu_seqlens is not None:
        return cu_seqlens
    assert seq_bounds is not None, "a graph's step passes cu_seqlens"
    return torch.tensor(list(seq_bounds), dtype=torch.int32).to(device, non_blocking=True)


def check_slot_state(states: torch.Tensor, shape: tuple[int, ...]) -> None:
    assert states.shape[1:] == shape, (states.shape, shape)
    assert states.stride()[1:] == tuple(torch.empty(shape).stride()), "a slot's state must be contiguous"


def conv_decode(x: torch.Tensor | tuple[torch.Tensor, ...], w: torch.Tensor, conv_states: torch.Tensor,
                slots: torch.Tensor, has_state: torch.Tensor) -> torch.Tensor:
    """x [B, C], or up to three [B, N, D] parts of it read in place (gated_delta.conv_decode)."""
    parts = [p[:, None, :] if p.dim() == 2 else p for p in (x if isinstance(x, tuple) else (x,))]
    assert 1 <= len(parts) <= 3 and all(p.dim() == 3 and p.stride(-1) == 1 for p in parts)
    b = parts[0].shape[0]
    c = sum(p.shape[1] * p.shape[2] for p in parts)
    width = w.shape[1] - 1
    check_slot_state(conv_states, (c, width))
    assert w.is_contiguous()
    out = torch.empty((b, c), dtype=parts[0].dtype, device=parts[0].device)
    block_c = min(triton.next_power_of_2(c), CONV_DECODE_BLOCK_C)
    p0 = parts[0]
    p1, p2 = (parts[i] if len(parts) > i else p0[:, :0] for i in (1, 2))  # [B, 0, D]: unread
    _conv_decode_kernel[(b, triton.cdiv(c, block_c))](
        p0, p1, p2, w, conv_states, slots, has_state, out,
        p0.stride(0), p0.stride(1), p1.stride(0), p1.stride(1), p2.stride(0), p2.stride(1),
        out.stride(0), conv_states.stride(0), c,
        W=width, BLOCK_E=triton.next_power_of_2(width + 1), BLOCK_C=block_c,
        D0=p0.shape[2], N0=p0.shape[1], D1=p1.shape[2], N1=p1.shape[1], D2=p2.shape[2], N2=p2.shape[1])
    return out


def conv_prefill(x: torch.Tensor, w: torch.Tensor, conv_states: torch.Tensor, slots: torch.Tensor,
                 has_state: torch.Tensor, seq_bounds: Sequence[int] | None,
                 cu_seqlens: torch.Tensor | None = None, static_len: int | None = None,
                 move_windows: bool = True, saves: InnerSaves | None = None) -> torch.Tensor:
    """``move_windows=False``: the outputs alone, every slot's window left as it
    was (a verify step's conv, gated_delta_verify_triton.conv_verify). ``saves``:
    the windows inside the sequences too (gated_delta.InnerSaves)."""
    t, c = x.shape
    width = w.shape[1] - 1
    check_slot_state(conv_states, (c, width))
    assert x.stride(1) == 1 and w.is_contiguous()
    nseq, max_len = seq_grid(seq_bounds, slots, static_len)
    cu = device_bounds(seq_bounds, cu_seqlens, x.device)
    out = torch.empty((t, c), dtype=x.dtype, device=x.device)
    if nseq == 0:
        return out
    block_t, block_c = CONV_BLOCK_T, min(triton.next_power_of_2(c), CONV_BLOCK_C)
    if max_len > 0:
        _conv_prefill_kernel[(nseq, triton.cdiv(max_len, block_t), triton.cdiv(c, block_c))](
            x, w, conv_states, slots, has_state, cu, out, x.stride(0), out.stride(0), conv_states.stride(0), c,
            W=width, BLOCK_T=block_t, BLOCK_C=block_c, num_warps=CONV_WARPS)
    if saves is not None:  # before the final windows replace the old ones these read
        assert saves.slots.shape[0] == nseq and saves.slots.is_contiguous() and saves.offsets.is_contiguous()
        _conv_state_kernel[(nseq * saves.per_seq, triton.cdiv(c, block_c))](
            x, conv_states, slots, has_state, cu, x.stride(0), conv_states.stride(0), c,
            W=width, BLOCK_W=triton.next_power_of_2(width), BLOCK_C=block_c,
            off_ptr=saves.offsets, save_ptr=saves.slots, K=saves.per_seq)
    if move_windows:
        _conv_state_kernel[(nseq, triton.cdiv(c, block_c))](
            x, conv_states, slots, has_state, cu, x.stride(0), conv_states.stride(0), c,
            W=width, BLOCK_W=triton.next_power_of_2(width), BLOCK_C=block_c)
    return out
