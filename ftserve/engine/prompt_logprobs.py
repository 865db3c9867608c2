"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt token's logprob
given the tokens before it, its rank, and the best alternatives there.

A prefill chunk of such a request also takes the logits of its tokens whose next
token is still prompt (the last prompt token's logits give the first output
token, which the sampler handles)::

    prompt    t0 t1 t2 t3 t4 t5            chunk = positions 2..4
    logits at       p2 p3 p4               -> logprobs of t3, t4, t5

The model returns those rows after the sampled ones (ForwardBatch.logits_indices);
``table`` turns them into [P, 2 + 2K] (logprob, rank, K top ids, K top logprobs)
on the device, and ``hand_off`` starts its copy into pinned host memory. Nothing
reads it until the request's first output, which comes after the read-back of
the step that sampled that token: that step is later on the same stream than
every chunk's copy, so the copies are done, and a non-final chunk stays
sync-free (no event, no wait of its own).
The scheduler gives such a request no prefix-cache hit (a hit would skip the
logits of the cached tokens) and gives a step at most PROMPT_LOGPROBS_CHUNK such
tokens, all requests together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ftserve.engine.messages import TokenLogprob
from ftserve.engine.request import Req
from ftserve.engine.scheduler import ScheduledBatch


@dataclass
class Plan:
    """The prompt-logprob rows of one prefill step."""

    rows: list[int]  # packed token indices (into the step's token layout)
    targets: list[int]  # the prompt token each row's logits predict
    spans: list[tuple[Req, int, int]]  # (request, first position, rows) in row order
    top_k: int  # alternatives per row: the largest any of these requests asked for

    @property
    def count(self) -> int:
        return len(self.rows)


def plan(batch: ScheduledBatch) -> Plan | None:
    """The step's rows whose logits predict a prompt token of a request that
    wants prompt logprobs; None when there are none."""
    if batch.is_decode or not any(r.wants_prompt_logprobs for r in batch.reqs):
        return None
    rows: list[int] = []
    targets: list[int] = []
    spans: list[tuple[Req, int, int]] = []
    top_k = 0
    start = 0
    for req, toks, pre in zip(batch.reqs, batch.new_tokens, batch.prefix_lens):
        if req.wants_prompt_logprobs:
            end = min(pre + len(toks), req.prompt_len - 1)  # positions pre .. end-1
            if end > pre:
                rows.extend(range(start, start + end - pre))
                targets.extend(req.prompt_ids[pre + 1:end + 1])
                spans.append((req, pre, end - pre))
                assert req.params.prompt_logprobs is not None
                top_k = max(top_k, req.params.prompt_logprobs)
        start += len(toks)
    return Plan(rows, targets, spans, top_k) if rows else None


def table(logits: torch.Tensor, targets: torch.Tensor, top_k: int) -> torch.Tensor:
    """[P, 2 + 2K] float64: logprob of each target, its rank (1 = the argmax;
    ties rank alike), the K best ids and their logprobs. logits [P, V] fp32."""
    lse = torch.logsumexp(logits, dim=-1)  # [P]
    chosen = logits.gather(1, targets[:, None])  # [P, 1]
    rank = (logits > chosen).sum(dim=-1, keepdim=True) + 1  # [P, 1]
    cols = [(chosen[:, 0] - lse)[:, None].double(), rank.double()]
    if top_k > 0:
        vals, ids = logits.topk(top_k, dim=-1)  # [P, K] each
        cols += [ids.double(), (vals - lse[:, None]).double()]
    return torch.cat(cols, dim=1)


@dataclass
class Part:
    """One request's rows of one chunk, on their way to the host."""

    first: int  # the position of the first row (it predicts prompt token first + 1)
    host: torch.Tensor  # [rows, 2 + 2K] float64, pinned on CUDA


def hand_off(step_plan: Plan, packed: torch.Tensor, pin: bool) -> None:
    """Start the copy of ``packed`` (``table`` of the plan's rows) and give each
    request its part; no wait here."""
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=pin)
    host.copy_(packed, non_blocking=True)
    o = 0
    for req, first, n in step_plan.spans:
        req.prompt_logprob_parts.append(Part(first, host[o:o + n]))
        o += n


def collect(req: Req) -> list[TokenLogprob | None]:
    """The request's prompt logprobs from its parts (a recomputed chunk after a
    preemption gives the same positions again; the last copy counts): one per
    prompt token, None for the first. Called with its first output, after that
    step's read-back, so the copies are done (see the module)."""
    k = req.params.prompt_logprobs
    assert k is not None
    out: list[TokenLogprob | None] = [None] * req.prompt_len
    for part in req.prompt_logprob_parts:
        k_max = (part.host.shape[1] - 2) // 2
        for j, row in enumerate(part.host.tolist()):
            pos = part.first + j + 1
            ids = [int(x) for x in row[2:2 + k_max]][:k]
            vals = row[2 + k_max:2 + 2 * k_max][:k]
            out[pos] = TokenLogprob(req.prompt_ids[pos], float(row[0]), tuple(zip(ids, vals)), int(row[1]))
    missing = [i for i, v in enumerate(out) if v is None and i > 0]
    assert not missing, f"{req.request_id}: no prompt logprobs at positions {missing[:5]}"
    req.prompt_logprob_parts.clear()
    req.prompt_logprobs_sent = True
    return out
