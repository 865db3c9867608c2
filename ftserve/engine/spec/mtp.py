"""``--speculative mtp``: drafts from the checkpoint's MTP layers (models/mtp.py),
verified as n-gram drafts are (accept.py), made on the device.

Who drafts: the requests ``Speculator.supports`` (no penalties, no grammar),
up to ``--num-speculative-tokens`` tokens, with n-gram drafting's back-off
(speculator.py): every verify that keeps no draft token is a miss, and m
misses in a row make the request decode plainly for min(2^m, MAX_BACKOFF)
tokens, so a head that rarely agrees with the model costs a verify step of
k + 1 positions only now and then. The scheduler plans a verify row
as for n-gram drafts but does not know the draft: it feeds ``[t_L, -1 ...]``
and the runner writes the draft into the step's inputs on the device, then
reads it back with the sampled tokens (one read-back) and fills in
``ScheduledBatch.drafts`` before the scheduler commits.

The MTP KV (one more pool layer) holds at slot i the MTP layer's K/V of
(hidden[i], t[i + 1]), so it is valid exactly where the main KV is: slots
< computed_len. Every step that holds a request that ``supports`` drafting
keeps it so, whether the request drafts this step or not (``tracks``:
a request in back-off is a plain row whose MTP pair is still written, since
the hidden states a later recompute would need are gone once the step ends),
with ``MTPDrafter.extend``, after sampling, over the step's own token layout:

    step      main model at positions     MTP pair at position p: (hidden[p], next)
    prefill   c0 .. c1 - 1                next = t[p + 1] (the prompt, or the sampled token)
    decode    L - 1                        next = the sampled token
    verify    L .. L + k (t_L, d_1..d_k)   next = y_{p - L}, the token sampled at p:
                                           right for the kept positions p <= L + a,
                                           overwritten before it is read past them

and stores each request's MTP outputs g there (``out[slot]``, one row per
sampled position). The next step, planned once the host knows a (a step
after which a request drafts is read back at once), drafts from row a:

    d_1 = argmax lm_head(g at L' - 1)           (L' = L + a + 1: the new last token's position)
    d_m = argmax lm_head(MTP(g_{m-1}, d_{m-1})) at position L' - 2 + m, m = 2 .. k

Chain positions write MTP KV at L' .. L' + k - 2, pages the verify reserved;
the verify step's extend then rewrites them. Greedy drafts are point masses, so
accept.py's rule keeps plain decoding's tokens exactly, at any temperature.

Prefix cache: a full page's last MTP entry depends on the token after the page,
which the radix key does not hold, so a match drops its last page
(``Scheduler._admit``); the request recomputes it, main and MTP KV alike. A
hybrid resumes exactly at a state checkpoint and keeps that page: its entry
pairs with the cached token after the checkpoint, stale only for a request
that parts from the cache right there (its first drafts may be worse; its
outputs are verified as ever).

CUDA graphs: the decode graphs run the MTP pass themselves (``decode_pass``:
fixed shape, the graph's own hidden states, sampled tokens, positions, KV
slots and attention metadata; padded rows write the dummy page and the sink
slot's outputs), so a plain decode step of a request that may draft replays
one graph as without MTP. Prefill and verify graphs keep every token's hidden
state in a static buffer (``PrefillGraphs.fbs``); the draft chain before a
verify replay and the MTP pass after its sampling (``extend`` over the graph's
padded static batch) run eagerly, a k-step chain and one layer beside the
replayed main model. Steps no graph covers run all of it eagerly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from ftserve.engine.spec.speculator import SpecState, Speculator
from ftserve.models.forward_batch import AttentionMetadata, ForwardBatch, pack_tokens
from ftserve_kernels import ops

if TYPE_CHECKING:
    from ftserve.engine.request import Req
    from ftserve.engine.runner import ModelRunner
    from ftserve.engine.scheduler import ScheduledBatch

DRAFT_PLACEHOLDER = -1  # a draft token the runner fills in on the device


class MTPSpeculator(Speculator):
    """The scheduler's side: which requests draft, how many tokens and the
    back-off (all Speculator's); the drafts themselves are the runner's."""

    device_drafts = True

    def __init__(self, num_tokens: int, max_model_len: int) -> None:
        super().__init__(num_tokens, 1, 1, max_model_len)

    def _new_state(self) -> SpecState:
        return SpecState()  # no n-gram index

    def _draft(self, req: Req, st: SpecState, k: int) -> list[int]:
        return [DRAFT_PLACEHOLDER] * k


class MTPDrafter:
    """The runner's side: the draft chain before a verify step's forward and the
    MTP extend after each step's sampling (module docstring)."""

    def __init__(self, runner: ModelRunner, num_tokens: int, tracks: Callable[[Req], bool]) -> None:
        model = runner.model
        head = getattr(model, "mtp", None)
        assert head is not None, "the model was built without its MTP layers"
        self.runner, self.model, self.head = runner, model, head
        self.k = num_tokens
        self.tracks = tracks
        h = model.config.hidden_size
        slots = runner.sink_row + 1
        # out[slot, r]: the MTP output g at the r-th sampled position of the slot's
        # latest sampling step (r = 0 for a plain row, 0 .. k for a verify row).
        self.out = torch.zeros(slots, num_tokens + 1, h, dtype=model.embed_tokens.weight.dtype,
                               device=runner.device)
        # Host: whose rows those are ((req, admissions)) and row 0's position.
        self._base: list[tuple[tuple[Req, int], int] | None] = [None] * slots

    def tracks_any(self, batch: ScheduledBatch) -> bool:
        """Some request in the step drafts, or may later (in back-off too): the
        step keeps the MTP KV."""
        return any(self.tracks(r) for r in batch.reqs)

    # ----- before the forward --------------------------------------------
    def _logits_argmax(self, g: torch.Tensor) -> torch.Tensor:
        logits = ops.linear_fp32(self.runner.kernels, g, self.model.lm_head_weight())  # [n, V]
        return logits.argmax(dim=-1)  # [n]

    def draft(self, batch: ScheduledBatch) -> torch.Tensor:
        """The step's draft tokens on the device, [sum of draft lengths] int64 in
        batch order (request, then position). The page-table rows must be mirrored."""
        r = self.runner
        h = self.out.shape[-1]
        items = [(i, len(d)) for i, d in enumerate(batch.drafts) if d]
        rows = []
        for i, _ in items:
            req = batch.reqs[i]
            owner = self._base[req.slot]
            assert owner is not None and owner[0] == (req, req.admissions), req.request_id
            row = batch.prefix_lens[i] - 1 - owner[1]  # its latest step's position L - 1
            assert 0 <= row <= self.k, (req.request_id, row)
            rows.append(req.slot * (self.k + 1) + row)
        g = self.out.view(-1, h).index_select(0, r._upload(rows))  # [n, H]
        d = self._logits_argmax(g)
        steps = [d]  # steps[m]: d_{m+1} of the items with k > m, in item order
        active = list(range(len(items)))
        for m in range(1, max(k for _, k in items)):
            now = [j for j in active if items[j][1] > m]
            keep = [active.index(j) for j in now]
            g, d = self._chain_step(batch, [items[j][0] for j in now], m, g, d, keep)
            steps.append(d)
            active = now
        # Flatten to batch order: item j's d_{m+1} is row rank_m(j) of steps[m].
        offsets = np.cumsum([0] + [s.shape[0] for s in steps])
        ranks: list[dict[int, int]] = []
        active = list(range(len(items)))
        for m in range(len(steps)):
            active = [j for j in active if items[j][1] > m]
            ranks.append({j: n for n, j in enumerate(active)})
        order = [int(offsets[m]) + ranks[m][j] for j, (_, k) in enumerate(items) for m in range(k)]
        return torch.cat(steps).index_select(0, r._upload(order))

    def _chain_step(self, batch: ScheduledBatch, idx: list[int], m: int, g: torch.Tensor,
                    d: torch.Tensor, keep: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP step for requests ``idx`` (batch indices): the pair (g, d) of
        each (rows ``keep`` of the previous step's) at position L - 1 + m."""
        r = self.runner
        reqs = [batch.reqs[i] for i in idx]
        prefix = [batch.prefix_lens[i] - 1 + m for i in idx]
        _, pos, locs, indptr, seq_lens, _ = pack_tokens([[0]] * len(reqs), prefix,
                                                        [q.pages for q in reqs], r.page_size)
        n = len(reqs)
        dev = r._upload(np.concatenate([pos, locs, np.array(indptr + seq_lens + prefix
                                                            + [q.slot for q in reqs] + keep)]))
        o = 2 * n
        attn = AttentionMetadata(
            page_size=r.page_size,
            qo_indptr=dev[o:o + n + 1].to(torch.int32),
            seq_lens=dev[o + n + 1:o + 2 * n + 1].to(torch.int32),
            prefix_lens=dev[o + 2 * n + 1:o + 3 * n + 1].to(torch.int32),
            page_table=r.page_table.index_select(0, dev[o + 3 * n + 1:o + 4 * n + 1]),
            out_cache_loc=dev[n:2 * n],
            seq_lens_host=seq_lens, prefix_lens_host=prefix,
            max_seq_len=max(seq_lens), max_extend_len=1,
        )
        sel = dev[o + 4 * n + 1:]
        d_in = d.index_select(0, sel)
        fb = ForwardBatch(d_in, dev[:n], attn, r.kv_pool, r.attn_backend, logits_indices=None,
                          kernels=r.kernels)
        g = self.head(g.index_select(0, sel), self.model.embed_tokens(d_in), fb, self.model.cos_sin)
        return g, self._logits_argmax(g)

    @staticmethod
    def draft_positions(batch: ScheduledBatch) -> list[int]:
        """The packed token index of each draft token, in draft() order."""
        out, o = [], 0
        for toks, d in zip(batch.new_tokens, batch.drafts):
            out.extend(range(o + 1, o + 1 + len(d)))
            o += len(toks)
        return out

    # ----- after sampling ------------------------------------------------
    def _pass(self, fb: ForwardBatch, ids: torch.Tensor) -> torch.Tensor:
        """g [T, H] of the MTP pairs (fb.hidden[p], ids[p]) at the step's
        positions, written into the MTP KV at fb's slots."""
        assert fb.hidden is not None
        mfb = dataclasses.replace(fb, input_ids=ids, logits_indices=None, input_embeds=None,
                                  input_normed=None, layer_ready=None, keep_hidden=False, hidden=None)
        return self.head(fb.hidden, self.model.embed_tokens(ids), mfb, self.model.cos_sin)

    def decode_pass(self, fb: ForwardBatch, sampled: torch.Tensor, slots: torch.Tensor) -> None:
        """A decode graph's MTP pass (device only, fixed shape): each row's pair
        (hidden, the token sampled after it) at its position; g into row 0 of
        its slot's outputs. ``slots`` [B] (padded rows: the sink slot, whose
        outputs nothing reads)."""
        g = self._pass(fb, sampled)  # [B, H]
        h = self.out.shape[-1]
        self.out.view(-1, h).index_copy_(0, slots * (self.k + 1), g)

    def note_decode(self, batch: ScheduledBatch) -> None:
        """The host's side of ``decode_pass``: each request's outputs now hold
        row 0 at its step's position."""
        for req, pre in zip(batch.reqs, batch.prefix_lens):
            self._base[req.slot] = ((req, req.admissions), pre)

    def extend(self, batch: ScheduledBatch, fb: ForwardBatch, sampled: torch.Tensor | None,
               rows: list[int]) -> None:
        """The MTP pairs of the step's positions (module docstring's table), from
        the forward's hidden states (fb.hidden) and the step's input and sampled
        tokens; keeps each sampling request's MTP outputs in ``out``."""
        r = self.runner
        assert fb.hidden is not None
        # A graph's static batch pads past the step's tokens: those rows take
        # token 0 and write the dummy page.
        t, n_rows = fb.input_ids.shape[0], len(rows)
        src = np.zeros(t, dtype=np.int64)  # index into [inputs | sampled | extra]
        extra: list[int] = []
        store_rows: list[int] = []  # token rows whose g is kept ...
        store_at: list[int] = []  # ... at these rows of out.view(-1, H)
        o = j = 0
        for i, (req, toks) in enumerate(zip(batch.reqs, batch.new_tokens)):
            n, pre = len(toks), batch.prefix_lens[i]
            key = (req, req.admissions)
            if batch.drafts and batch.drafts[i]:  # its n = k + 1 sampled rows, in order
                src[o:o + n] = np.arange(t + j, t + j + n)
                store_rows += range(o, o + n)
                store_at += range(req.slot * (self.k + 1), req.slot * (self.k + 1) + n)
                self._base[req.slot] = (key, pre)
                j += n
            else:
                src[o:o + n - 1] = np.arange(o + 1, o + n)
                if batch.samples[i]:
                    src[o + n - 1] = t + j
                    store_rows.append(o + n - 1)
                    store_at.append(req.slot * (self.k + 1))
                    self._base[req.slot] = (key, pre + n - 1)
                    j += 1
                else:  # a prompt chunk before the last: the next prompt token
                    src[o + n - 1] = t + n_rows + len(extra)
                    extra.append(req.tokens[pre + n])
            o += n
        assert j == n_rows, (j, n_rows)
        dev = r._upload(np.concatenate([src, np.array(extra + store_rows + store_at, dtype=np.int64)]))
        e, s = len(extra), len(store_rows)
        parts = [fb.input_ids] + ([sampled[:n_rows]] if sampled is not None else []) + [dev[t:t + e]]
        ids = torch.cat(parts).index_select(0, dev[:t])  # [T]: each position's next token
        g = self._pass(fb, ids)  # [T, H]
        if s:
            h = self.out.shape[-1]
            self.out.view(-1, h).index_copy_(0, dev[t + e + s:], g.index_select(0, dev[t + e:t + e + s]))
