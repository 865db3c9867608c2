"""Greedy sampling in one launch: the stop-id mask and the argmax over the
vocabulary, and the token written where the next decode step reads it; with
``ftab`` also temperature sampling (no filters, penalties, bias, grammar or
logprobs): rows that sample take the Gumbel-max of logits / temperature with
the sampler's counter-based noise (ftserve_kernels/sampling.py), greedy rows
the plain argmax. Twin: ``greedy_sample_ref`` (the sampler's composition).

A greedy-only step (no temperature, filters, penalties, bias or logprobs in
any admitted request) spent ~30 us of a 0.67 ms batch-1 decode step on the
H200 in ~14 small torch launches (the slot-row gathers, the stop mask's
scatter, a cast, the argmax's two-pass reduction, a copy). Here::

    program (row b, chunk c):  (max, first index) of the masked logits of its chunk
    last program of row b:     combines the row's chunks -> tokens[b] (and last[b])

The last program is found with an arrival counter per row (zero between
launches; the last program re-zeroes it).
With ``host_out`` (bookkeeping.StagedRows) the last program of each row also
stores the token into the picked row of a pinned pair over UVA, and the last
row to finish toggles the word (a second counter, ``counters[B]``; one row
needs none): a decode graph then needs no copy kernel after this one.
Ties go to the lowest index, as torch.argmax. Rows below their min_tokens
mask their slot's eos/stop ids to -inf first; the loop over them runs only on
such rows. NaN logits are skipped here, where torch.argmax would pick them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftserve_kernels import pdl
from ftserve_kernels.bookkeeping import StagedRows
from ftserve_kernels.config import DEFAULT_KERNELS, KernelConfig
from ftserve_kernels.filter_triton import _float_key
from ftserve_kernels.sampling import (
    _GOLDEN_TL,
    _SALT_TL,
    _argmax_combine,
    _gumbel_tl,
    _mix32_tl,
    gumbel_argmax_ref,
    mask_token_ids,
    row_keys,
    token_hash_table,
    vocab_chunks,
)


def greedy_sample_ref(
    logits: torch.Tensor,  # [B, V]
    slots: torch.Tensor,  # [B] int64: rows of itab
    min_active: torch.Tensor,  # [B] bool: mask the slot's stop ids
    itab: torch.Tensor,  # [S, ni + M] int64: greedy, top_k, seed_lo, seed_hi, n_stops | stop ids
    ni: int,
    ftab: torch.Tensor | None = None,  # [S, >= 1] fp32, column 0 = temperature: sample
    steps: torch.Tensor | None = None,  # [B] int64, with ftab: the output index
    min_temperature: float = 1e-6,
) -> torch.Tensor:
    """-> tokens [B] int64."""
    irow = itab.index_select(0, slots)  # [B, ni + M]
    num_stops = irow[:, ni - 1]
    cols = torch.arange(irow.shape[1] - ni, device=logits.device)  # [M]
    active = (cols[None, :] < num_stops[:, None]) & min_active[:, None]
    x = mask_token_ids(logits.float(), irow[:, ni:], active)  # [B, V]
    tokens = x.argmax(dim=-1)
    if ftab is None:
        return tokens
    assert steps is not None
    temperature = ftab.index_select(0, slots)[:, 0]
    k1, k2 = row_keys(irow[:, 2], irow[:, 3], steps)
    hashes = token_hash_table(logits.shape[1], logits.device)
    drawn = gumbel_argmax_ref(x / temperature.clamp_min(min_temperature)[:, None], k1, k2, hashes)
    return torch.where(irow[:, 0] != 0, tokens, drawn)


@triton.jit
def _greedy_kernel(
    logits_ptr, slots_ptr, min_ptr, itab_ptr, part_v_ptr, part_i_ptr, count_ptr, out_ptr, last_ptr,
    ftab_ptr, steps_ptr, min_temperature, cut_key_ptr, cut_id_ptr, floor_ptr,
    vocab, stride_row, stride_itab, stride_ftab, chunk,
    host_ptr, parity_ptr, pair_stride,
    NI: tl.constexpr, NUM_CHUNKS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr,
    HAS_LAST: tl.constexpr, SAMPLING: tl.constexpr, HAS_CUT: tl.constexpr,
    HOST_OUT: tl.constexpr = False, ONE_ROW: tl.constexpr = True, PDL: tl.constexpr = 0,
):
    pdl.enter(PDL)  # the logits (and a filter's cuts) come from the launch before
    row = tl.program_id(0)
    c = tl.program_id(1)
    slot = tl.load(slots_ptr + row)
    itab_row = itab_ptr + slot * stride_itab
    masked = tl.load(min_ptr + row) != 0
    n_stops = tl.load(itab_row + NI - 1)
    draw = False
    if SAMPLING:  # this row's keys, as sampling.row_keys
        draw = tl.load(itab_row) == 0  # column 0: greedy
        temp = tl.maximum(tl.load(ftab_ptr + slot * stride_ftab), min_temperature)
        step = tl.load(steps_ptr + row).to(tl.uint32)
        k1 = _mix32_tl(tl.load(itab_row + 2).to(tl.uint32) ^ _mix32_tl(step ^ _GOLDEN_TL))
        k2 = _mix32_tl(tl.load(itab_row + 3).to(tl.uint32) ^ _mix32_tl(k1 ^ _SALT_TL))
        if HAS_CUT:  # filter_triton's cut of this row's scores (top-k / top-p / min-p)
            cut_key = tl.load(cut_key_ptr + row)
            cut_id = tl.load(cut_id_ptr + row)
            floor = tl.load(floor_ptr + row)
    lane = tl.arange(0, BLOCK)
    best_v = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_i = tl.full((BLOCK,), 0, tl.int32)
    start = c * chunk
    for off in range(start, start + chunk, BLOCK):
        idx = off + lane  # [BLOCK]
        ok = idx < vocab
        v = tl.load(logits_ptr + row.to(tl.int64) * stride_row + idx, mask=ok,
                    other=float("-inf")).to(tl.float32)
        if masked:
            for j in range(n_stops):
                v = tl.where(idx == tl.load(itab_row + NI + j), float("-inf"), v)
        if SAMPLING:
            if draw:  # + Gumbel noise of (keys, token), as _gumbel_argmax_kernel
                v = tl.math.div_rn(v, temp)
                if HAS_CUT:
                    key = _float_key(v)
                    kept = ((key > cut_key) | ((key == cut_key) & (idx <= cut_id))) & (v >= floor)
                    v = tl.where(kept, v, float("-inf"))
                v = v + _gumbel_tl(idx, k1, k2)  # finite: a -inf (masked, cut) stays -inf
        take = (v > best_v) & ok  # strict: a lane's indices grow, the first maximum stays
        best_v = tl.where(take, v, best_v)
        best_i = tl.where(take, idx, best_i)
    m, first = tl.reduce((best_v, best_i), 0, _argmax_combine)
    tl.store(part_v_ptr + row * NUM_CHUNKS + c, m)
    tl.store(part_i_ptr + row * NUM_CHUNKS + c, first)
    # Every thread's stores precede the barrier, the barrier the release by the
    # atomic; the last arrival's acquire precedes its (L2, .cg) loads.
    tl.debug_barrier()
    done = tl.atomic_add(count_ptr + row, 1, sem="acq_rel", scope="gpu")
    if done == NUM_CHUNKS - 1:
        cc = tl.arange(0, BLOCK_C)
        cm = cc < NUM_CHUNKS
        pv = tl.load(part_v_ptr + row * NUM_CHUNKS + cc, mask=cm, other=float("-inf"),
                     cache_modifier=".cg")
        pi = tl.load(part_i_ptr + row * NUM_CHUNKS + cc, mask=cm, other=0, cache_modifier=".cg")
        _, tok = tl.reduce((pv, pi), 0, _argmax_combine)
        tl.store(out_ptr + row, tok.to(tl.int64))
        if HAS_LAST:
            tl.store(last_ptr + row, tok.to(tl.int64))
        tl.atomic_xchg(count_ptr + row, 0)
        if HOST_OUT:
            # The token into row `side` of the pinned pair. The word flips once
            # every row has stored: each row's read of it precedes its release
            # below, the flipper's acquire follows them all.
            side = tl.load(parity_ptr)
            hp = host_ptr.to(tl.int64).to(tl.pointer_type(tl.int64)) + side.to(tl.int64) * pair_stride
            tl.store(hp + row, tok.to(tl.int64))
            if ONE_ROW:
                tl.store(parity_ptr, 1 - side)
            else:
                rows_ptr = count_ptr + tl.num_programs(0)
                if tl.atomic_add(rows_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
                    tl.store(parity_ptr, 1 - side)
                    tl.atomic_xchg(rows_ptr, 0)


def greedy_sample_triton(
    logits: torch.Tensor,  # [B, V] any float dtype, unit stride along V
    slots: torch.Tensor,  # [B] int64
    min_active: torch.Tensor,  # [B] bool
    itab: torch.Tensor,  # [S, ni + M] int64, contiguous
    ni: int,
    counters: torch.Tensor,  # [>= B] int32, zero (and left zero)
    last: torch.Tensor | None = None,  # [>= B] int64: also gets the tokens
    ftab: torch.Tensor | None = None,  # [S, >= 1] fp32, contiguous: temperature sampling
    steps: torch.Tensor | None = None,  # [B] int64, with ftab
    min_temperature: float = 1e-6,
    block: int = 1024,
    target_programs: int = 264,
    cuts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    host_out: StagedRows | None = None,
    kernels: KernelConfig = DEFAULT_KERNELS,
) -> torch.Tensor:
    """Same tokens as greedy_sample_ref (finite logits; sampled rows up to the
    fp32 log rounding gumbel_argmax_triton has too): [B] int64. ``cuts`` (with
    ftab; filter_triton.filter_cuts_triton's): sampled rows draw only from the
    tokens their cut keeps. ``host_out``: the tokens also go to its picked row's
    first B words, and the word toggles (copy_host_words_paired(..., flip=True)
    in the same launch); counters then needs B + 1 entries where B > 1. Shapes
    depend only on (B, V): graph-capturable."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and itab.is_contiguous() and counters.numel() >= rows
    if host_out is not None:
        assert host_out.pair.shape[1] >= rows and host_out.parity.device == logits.device
        assert rows == 1 or counters.numel() > rows, "the rows' own counter follows theirs"
    assert ftab is None or (ftab.is_contiguous() and steps is not None)
    assert cuts is None or ftab is not None, "a cut filters sampled rows: it needs ftab"
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    chunk, num_chunks = vocab_chunks(rows, vocab, block, target_programs)
    part_v = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    part_i = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    on = pdl.active(logits, kernels)
    _greedy_kernel[(rows, num_chunks)](
        logits, slots, min_active, itab, part_v, part_i, counters, out,
        last if last is not None else out,
        ftab if ftab is not None else logits, steps if steps is not None else slots, min_temperature,
        *(cuts if cuts is not None else (part_i, part_i, part_v)),  # unread without cuts
        vocab, logits.stride(0), itab.stride(0), ftab.stride(0) if ftab is not None else 0, chunk,
        host_out.address() if host_out is not None else 0,
        host_out.parity if host_out is not None else counters,
        host_out.pair.stride(0) if host_out is not None else 0,
        NI=ni, NUM_CHUNKS=num_chunks, BLOCK=block, BLOCK_C=triton.next_power_of_2(num_chunks),
        HAS_LAST=last is not None, SAMPLING=ftab is not None, HAS_CUT=cuts is not None,
        HOST_OUT=host_out is not None, ONE_ROW=rows == 1, PDL=on, num_warps=4, **pdl.launch(on),
    )
    return out

