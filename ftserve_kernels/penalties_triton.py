"""Repetition, presence and frequency penalties in one launch, reading each
row's slot state in place. Twin: ``sampling.apply_penalties_ref`` over the
rows gathered by slot (the composed sampler's path).

The composed path gathers the slots' [B, V] count and prompt-mask rows, then
runs ~8 elementwise launches over [B, V]; on the H200 at Qwen3's vocabulary
that was ~30 us of a batch-1 step, and it kept every penalized request (e.g.
Qwen3-Coder's generation_config, repetition_penalty 1.05) on the composed
sampler. Here each program takes one chunk of one row::

    program (row b, chunk c):  slot = slots[b]; rep, presence, frequency = ftab[slot, 3:6]
                               x = logits[b, chunk]; n = counts[slot, chunk]; p = prompt[slot, chunk]
                               out[b, chunk] = the reference's operations on (x, n, p)

The division is round-to-nearest (torch's); the products and differences are
separate fp32 operations in the reference, so the result is within one
rounding of it where the compiler contracts one into an FMA (a nonzero
frequency penalty), and the same bits otherwise. Shapes depend only on (B, V):
graph-capturable, no host reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftserve_kernels.sampling import vocab_chunks

# ftab columns (sampler._f): temperature, top_p, min_p, repetition, presence, frequency
REPETITION_COL = 3


@triton.jit
def _penalties_kernel(
    logits_ptr, slots_ptr, counts_ptr, prompt_ptr, ftab_ptr, out_ptr,
    V, stride_row, stride_counts, stride_prompt, stride_ftab, stride_out, chunk,
    REP: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    start = tl.program_id(1) * chunk
    slot = tl.load(slots_ptr + row).to(tl.int64)
    f = ftab_ptr + slot * stride_ftab
    rep = tl.load(f + REP)
    presence = tl.load(f + REP + 1)
    frequency = tl.load(f + REP + 2)
    for off in range(start, start + chunk, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        ok = idx < V
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + idx, mask=ok, other=0.0).to(tl.float32)
        n = tl.load(counts_ptr + slot * stride_counts + idx, mask=ok, other=0)
        in_prompt = tl.load(prompt_ptr + slot * stride_prompt + idx, mask=ok, other=0) != 0
        seen = n > 0
        penalized = tl.where(x > 0, tl.math.div_rn(x, rep), x * rep)
        y = tl.where(seen | in_prompt, penalized, x)
        y = y - n.to(tl.float32) * frequency
        y = y - seen.to(tl.float32) * presence
        tl.store(out_ptr + row.to(tl.int64) * stride_out + idx, y, mask=ok)


def apply_penalties_triton(
    logits: torch.Tensor,  # [B, V] any float dtype, unit stride along V
    slots: torch.Tensor,  # [B] int64: rows of counts, prompt_mask and ftab
    counts: torch.Tensor,  # [S, V] int32: generated-token counts per slot
    prompt_mask: torch.Tensor,  # [S, V] bool: token in the slot's prompt
    ftab: torch.Tensor,  # [S, >= 6] fp32, contiguous: ..., repetition, presence, frequency
    block: int = 1024,
    target_programs: int = 264,
) -> torch.Tensor:
    """-> penalized fp32 logits [B, V] (see the module)."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and counts.stride(1) == 1 and prompt_mask.stride(1) == 1
    assert ftab.is_contiguous() and ftab.shape[1] >= REPETITION_COL + 3
    out = torch.empty(rows, vocab, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return out
    chunk, num_chunks = vocab_chunks(rows, vocab, block, target_programs)
    _penalties_kernel[(rows, num_chunks)](
        logits, slots, counts, prompt_mask.view(torch.uint8), ftab, out,
        vocab, logits.stride(0), counts.stride(0), prompt_mask.stride(0), ftab.stride(0), out.stride(0),
        chunk, REP=REPETITION_COL, BLOCK=block, num_warps=4,
    )
    return out
