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
