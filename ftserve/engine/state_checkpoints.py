"""Where a hybrid model's prefill saves recurrent-state checkpoints for the
prefix cache.

A linear-attention layer keeps one state per sequence (kvcache/state_pool.py),
overwritten by every chunk; the KV pages of a cached prefix are of no use to a
later request without the state after exactly that prefix. So a prefill chunk
saves the request's state into a fresh slot at each boundary it reaches: one it
ends on by a copy after the forward (``ScheduledBatch.state_saves``), up to
MAX_INNER inside it by the linear layers themselves as they pass
(``ScheduledBatch.state_inner``: their kernels cut the sequence there and carry
the state on, gated_delta.InnerSaves), so a boundary costs no forward of its
own; a chunk with more ends on the next one. The prefix cache keeps those slots
at node ends (kvcache/radix.py), and a hit resumes at the deepest one its prompt
reaches (``ScheduledBatch.state_loads``, run before the forward).

Boundaries of a request with T tokens to prefill (page size ps, every
``every`` tokens = --state-checkpoint-pages pages)::

    0        every      2*every      turn     last    T
    |----------|----------|-----------|--------|--+
               ^          ^           ^        ^
               every multiple below last       last = (T - 1) // ps * ps
                                      turn = (P - tail) // ps * ps

``last``: the end of the last whole page before the final token, the deepest
point a request can resume from (one token is always left to compute for its
logits). A later turn of a conversation, which resends this prompt plus more,
resumes there: within a page of its previous prompt's end. The same prompt
again (``n`` choices, a retry) resumes there too and computes the rest.
``turn``: where a chat request's prompt (P tokens) ends but for the tail a
later turn will not resend (``Req.unsent_tail``: the template's generation
prompt, such as Qwen3's ``<|im_start|>assistant\n<think>\n``, and a forced
call's start): the next turn re-renders the reply in its place, so it parts
from this prompt inside that tail, and ``last`` may lie past where it parts.
The multiples of ``every`` serve long prefills (a preempted request, agents
diverging inside a long shared context). Every boundary lies before the final
token, so the chunk that saves a checkpoint never samples.
"""

from __future__ import annotations

from ftserve.engine.request import Req

# Checkpoints one prefill chunk saves inside it (the linear layers' kernels cut
# a sequence there, gated_delta.InnerSaves); it ends on the next one.
MAX_INNER = 2


def last_boundary(num_tokens: int, page_size: int) -> int:
    """The deepest checkpoint of a request prefilling ``num_tokens`` tokens."""
    return (num_tokens - 1) // page_size * page_size


def turn_boundary(req: Req, page_size: int) -> int:
    """The page boundary before ``req``'s unsent prompt tail (0: none told)."""
    if req.unsent_tail <= 0:
        return 0
    return max(0, req.prompt_len - req.unsent_tail) // page_size * page_size


def boundaries_ahead(req: Req, page_size: int, every: int) -> list[int]:
    """The checkpoint boundaries past ``req.computed_len``, ascending."""
    c = req.computed_len
    last = last_boundary(len(req.tokens), page_size)
    if last <= c:
        return []
    ahead = list(range((c // every + 1) * every, last, every))
    turn = turn_boundary(req, page_size)
    if c < turn < last and turn % every:
        ahead.append(turn)
        ahead.sort()
    return [*ahead, last]




def boundaries(req: Req, page_size: int, every: int) -> list[int]:
    """Lengths at which ``req`` holds a checkpoint it has not handed to the
    prefix cache, or will save one, ascending."""
    return [n for n, _ in req.checkpoints] + boundaries_ahead(req, page_size, every)
