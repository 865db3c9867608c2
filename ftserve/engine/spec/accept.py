"""Which proposed tokens a verify step keeps.

A verify step feeds a request's last token and its k proposals d_1..d_k and
samples every one of the k + 1 positions with the ordinary sampler, position m
at output step s + m (s: the request's next output index):

    inputs    t    d_1   d_2  ...  d_k
    sampled   y_0  y_1   y_2  ...  y_k        y_m ~ p(. | context, d_1..d_m)

It keeps y_0 .. y_a, a = the longest prefix with d_{m+1} == y_m: every kept
token was sampled in the context plain decoding would have had (each accepted
d equals the token before it), at the step index plain decoding would have
used. The sampler's draw is a pure function of (seed, step, context): greedy
rows take the argmax, sampled rows the Gumbel-max argmax(logits / T + g) with
g hashed from (seed, step, token). So the kept tokens are token for token the
ones plain decoding samples with the same seed, at any temperature.

That is rejection sampling for a deterministic draft. An n-gram draft is a
point mass q = delta(d), so the textbook rule (accept d with probability
min(1, p(d) / q(d)) = p(d), else draw from the residual max(0, p - q)
renormalized, which is p with d removed) must give tokens distributed as p.
Gumbel-max realizes exactly that coupling: P(y == d) = p(d), and given
y != d, y is the argmax over the other tokens, distributed as p renormalized
without d. The acceptance rate is p(d), the most any rule keeping p can
reach. Logprobs, stop ids, min_tokens and max_tokens then apply to the kept
tokens one at a time, as after plain steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def accepted_length(draft: Sequence[int], sampled: Sequence[int]) -> int:
    """a: the number of leading draft tokens equal to the tokens sampled at the
    positions before them (``sampled`` holds len(draft) + 1 tokens)."""
    assert len(sampled) == len(draft) + 1, (len(draft), len(sampled))
    a = 0
    while a < len(draft) and draft[a] == sampled[a]:
        a += 1
    return a


def kept_tokens(draft: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The tokens a verify step commits: y_0 .. y_a (1 to len(draft) + 1 tokens)."""
    return list(sampled[:accepted_length(draft, sampled) + 1])


# ----- the same rule on the device ---------------------------------------------
# A hybrid model's verify step moves each request's recurrent state on by the
# tokens it keeps before the host has read them (kvcache/state_pool.py), so
# the count is also taken on the device, from the step's inputs and samples.
# Every input of a verify step is sampled (sample_rows), so sampled row t is
# the token sampled at input t, and d_{m+1} == y_m reads ids[t + 1] == sampled[t].


def device_plan(lens: Sequence[int]) -> tuple[list[int], int]:
    """For a verify step's sequences of ``lens`` inputs each (1 + draft length):
    ([B * W] flat indices, W = the longest draft): row b lists the input rows t
    whose test ids[t + 1] == sampled[t] decides its draft position m, padded
    with the last row (never a draft position: its test is always false)."""
    width = max(lens) - 1
    pad = sum(lens) - 1
    idx: list[int] = []
    o = 0
    for n in lens:
        idx.extend(o + m if m < n - 1 else pad for m in range(width))
        o += n
    return idx, width


def kept_counts(ids: torch.Tensor, sampled: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """kept = accepted_length + 1 per sequence, on the device: ids [T] the step's
    inputs (drafts included), sampled [T], idx [B, W] from device_plan -> [B]
    int64. Fixed shapes, no sync."""
    eq = torch.zeros_like(ids, dtype=torch.bool)
    eq[:-1] = ids[1:] == sampled[:-1]  # eq[T - 1] stays false: the padding
    hits = eq.index_select(0, idx.reshape(-1)).view(idx.shape)  # [B, W]
    return 1 + hits.long().cumprod(dim=1).sum(dim=1)
