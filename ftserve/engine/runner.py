"""Runs one scheduled batch on the device: forward, sample, read tokens back.

The token read-back is the step's one deliberate device-to-host sync.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ftserve.engine.messages import TokenLogprob
from ftserve.engine.scheduler import ScheduledBatch
from ftserve.kvcache.pool import KVPool
from ftserve.models.forward_batch import AttentionBackend, build_forward_batch

if TYPE_CHECKING:
    from ftserve.engine.sampler import Sampler


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_pool: KVPool,
        attn_backend: AttentionBackend,
        sampler: Sampler,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.attn_backend = attn_backend
        self.sampler = sampler
        self.device = device

    @torch.inference_mode()
    def step(self, batch: ScheduledBatch) -> tuple[list[int], list[TokenLogprob | None] | None]:
        fb = build_forward_batch(
            batch.new_tokens, batch.prefix_lens, [r.pages for r in batch.reqs],
            self.kv_pool, self.attn_backend, is_decode=batch.is_decode, device=self.device,
        )
        logits = self.model(fb)  # [B, V] fp32
        rows = [i for i, s in enumerate(batch.samples) if s]
        if not rows:
            # A non-final prefill chunk: nothing to sample, nothing to read back.
            return [], None
        if len(rows) != len(batch.reqs):
            logits = logits[torch.tensor(rows, dtype=torch.int64, device=self.device)]
        reqs = [batch.reqs[i] for i in rows]
        slots = torch.tensor([r.slot for r in reqs], dtype=torch.int64, device=self.device)
        steps = torch.tensor([r.num_outputs for r in reqs], dtype=torch.int64, device=self.device)
        min_active = torch.tensor(
            [r.num_outputs < r.params.min_tokens for r in reqs], dtype=torch.bool, device=self.device)
        out = self.sampler.sample(logits, slots, steps, min_active)
        self.sampler.update(slots, out.token_ids)
        want_lp = any(r.params.logprobs is not None for r in reqs)
        # The step's one deliberate sync: the host needs the tokens to stream them.
        sampled: list[int] = out.token_ids.tolist()
        token_ids = [-1] * len(batch.reqs)
        for i, tok in zip(rows, sampled):
            token_ids[i] = tok
        if not want_lp:
            return token_ids, None
        chosen = out.logprobs.tolist()
        top_ids = out.top_ids.tolist()
        top_lp = out.top_logprobs.tolist()
        lps: list[TokenLogprob | None] = [None] * len(batch.reqs)
        for j, (i, r) in enumerate(zip(rows, reqs)):
            k = r.params.logprobs
            if k is not None:
                alts = tuple(zip(top_ids[j][:k], top_lp[j][:k]))
                lps[i] = TokenLogprob(sampled[j], float(chosen[j]), alts)
        return token_ids, lps
