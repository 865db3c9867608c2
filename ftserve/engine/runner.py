"""Runs one scheduled batch on the device: metadata upload, forward, sample,
token read-back.

Host -> device: the scheduler's plan is packed into ONE int64 host buffer
(pinned on CUDA) and sent with one non-blocking copy; the device views it.
Per-request page tables live on the device, one row per request slot, and are
updated with only the pages added since the last step:

    page_table [max_running + 1, max_pages] int32
    row s      = pages of the request in slot s (padded with dummy page 0)
    last row   = all dummy: padded batch rows (CUDA-graph padding) read it

Grammar masks (response_format): before a step that samples a constrained
request, llguidance computes each such row's token mask on the host into one
pinned int32 buffer (n mask rows of W words, then the n slots), sent with one non-blocking
copy and scattered into the sampler's per-slot mask table (``_grammar_masks``).

Device -> host: the sampled tokens, read once per step that samples. That is
the step's one deliberate sync; a non-final prefill chunk reads nothing.

Hybrid models: every batch carries each sequence's state-pool slot (in the
packed upload, or a decode graph's rows), and a prefill step copies the
prefix-cache checkpoints it resumes from into those slots before its forward
and saves the checkpoints it ends on after it (``StatePool.copy_slots``, by
index tensors in the same upload's manner: no sync). A verify step (speculative
decoding) leaves the slots as they were in its forward; after sampling, each
request's kept count is taken on the device (spec/accept.py's rule) and its
slot moved on by those tokens (``StatePool.commit_verified``), so the state is
committed before the read-back and the next step finds it, with no sync. The
captured prefill and verify graphs run the same way: the checkpoint loads, the
saves and the commit stay outside the replay, around it (prefill_graph.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ftserve.engine import prompt_logprobs as prompt_lp
from ftserve.engine.grammar import MaskFiller
from ftserve.engine.messages import TokenLogprob
from ftserve.engine.scheduler import ScheduledBatch
from ftserve.engine.spec import accept
from ftserve.kvcache.pool import KVPool
from ftserve.models.forward_batch import (
    AttentionBackend,
    AttentionMetadata,
    ForwardBatch,
    PackedTokens,
    pack_tokens,
)
from ftserve_kernels.bookkeeping import copy_host_words
from ftserve_kernels.config import KernelConfig
from ftserve_kernels.gated_delta import InnerSaves

if TYPE_CHECKING:
    from ftserve.engine.cuda_graph import DecodeGraphs
    from ftserve.engine.prefill_graph import PrefillGraphs
    from ftserve.engine.request import Req
    from ftserve.engine.sampler import SampleOutput, Sampler
    from ftserve.engine.spec.mtp import MTPDrafter
    from ftserve.kvcache.host_tier import HostKVTier
    from ftserve.kvcache.state_pool import StatePool


@contextlib.contextmanager
def deliberate_sync() -> Iterator[None]:
    """Marks the one read-back a step may make; tests run everything else
    under torch.cuda.set_sync_debug_mode("error")."""
    if not torch.cuda.is_available():
        yield
        return
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_pool: KVPool,
        attn_backend: AttentionBackend,
        sampler: Sampler,
        device: torch.device,
        *,
        max_running: int,
        max_model_len: int,
        eos_token_ids: list[int],
        kernels: KernelConfig,
    ) -> None:
        self.model = model
        # The kernel choices of every forward (fixed at start-up; the sampler was
        # built with the same).
        self.kernels = kernels
        self.kv_pool = kv_pool
        self.attn_backend = attn_backend
        self.sampler = sampler
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.page_size = kv_pool.page_size
        self.max_pages = -(-max_model_len // self.page_size)
        self.sink_row = max_running
        self.page_table = torch.zeros(  # [max_running + 1, max_pages]
            max_running + 1, self.max_pages, dtype=torch.int32, device=device)
        # Which admission of which request owns each slot's rows (page table,
        # sampler) and how many of its pages the device row already holds. Keyed
        # on (req, req.admissions), not req alone: a preempted request admitted
        # again can take its old slot back with other pages (and its sampler row
        # counted a token the preemption dropped), so both rows must be rebuilt.
        self._owner: list[tuple[Req, int] | None] = [None] * max_running  # whose pages each table row mirrors
        self._admitted: list[tuple[Req, int] | None] = [None] * max_running  # whose parameters each sampler slot holds
        self._synced: list[int] = [0] * max_running
        self._pin = device.type == "cuda"
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        # Speculative verify steps (every position a logits row), captured per width.
        self.verify_graphs: PrefillGraphs | None = None
        # --speculative mtp: the draft chain and the MTP KV upkeep (spec/mtp.py).
        self.mtp: MTPDrafter | None = None
        # KV host tier (set by setup when --kv-host-* is given): the page moves
        # the scheduler planned for this step are launched before its forward.
        self.kv_host: HostKVTier | None = None
        # Hybrid models (set by setup): the recurrent-state pool every forward reads.
        self.state_pool: StatePool | None = None
        # Sampled tokens of the latest step, by sampled row: the next decode
        # step's inputs for requests whose tokens the host has not read yet.
        self.last_tokens = torch.zeros(max_running + 1, dtype=torch.int64, device=device)
        self._out_host = [torch.zeros(max_running + 1, dtype=torch.int64, pin_memory=self._pin)
                          for _ in range(2)]
        self._out_flip = 0
        self.read_backs = 0  # deliberate device->host reads so far (tests count them)
        self._masks = MaskFiller()

    # ----- host -> device ------------------------------------------------
    def _upload(self, values: list[int] | np.ndarray) -> torch.Tensor:
        """One non-blocking copy of int64 values to the device (numpy -> torch
        shares memory; pinning copies into the caching host allocator, which keeps
        the block until the copy has run)."""
        host = torch.from_numpy(np.asarray(values, dtype=np.int64))
        if self._pin:
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def prepare_slots(self, reqs: list[Req]) -> None:
        """Admit new owners to the sampler and mirror newly added pages."""
        self.mirror_pages(reqs)
        self.admit_slots(reqs)

    def admit_slots(self, reqs: list[Req]) -> None:
        """Load new owners' sampling parameters into their sampler slots (a few
        small uploads). Only sampling reads them: a prefill step does this after
        launching its forward, so the GPU does not wait for it."""
        for req in reqs:
            s, key = req.slot, (req, req.admissions)
            if self._admitted[s] != key:  # Req compares by identity (eq=False)
                self._admitted[s] = key
                self.sampler.admit(s, req.params, req.prompt_ids, self.eos_token_ids, req.output_ids,
                                   constrained=req.grammar is not None)

    def _sampling_inputs(self, batch: ScheduledBatch) -> None:
        """What sampling reads and the forward does not: new owners' parameters and
        the constrained rows' masks."""
        self.admit_slots(batch.reqs)
        self._grammar_masks(batch)

    def mirror_pages(self, reqs: list[Req]) -> None:
        """Copy the pages added to each request since the last step into the device
        page table (one upload): the forward reads them."""
        rows: list[int] = []
        cols: list[int] = []
        pages: list[int] = []
        for req in reqs:
            s, key = req.slot, (req, req.admissions)
            if self._owner[s] != key:
                self._owner[s] = key
                self._synced[s] = 0
            n = self._synced[s]
            if req.pages_trimmed_to is not None:  # the scheduler dropped pages since
                n = self._synced[s] = min(n, req.pages_trimmed_to)
                req.pages_trimmed_to = None
            m = len(req.pages)
            if m > n:
                rows += [s] * (m - n)
                cols += range(n, m)
                pages += req.pages[n:]
                self._synced[s] = m
        if rows:
            dev = self._upload(rows + cols + pages).view(3, -1)
            self.page_table.index_put_((dev[0], dev[1]), dev[2].to(torch.int32))

    def check_page_rows(self, reqs: list[Req]) -> None:
        """Each request's device page-table row starts with its host pages (a
        device read: for integrity checks in tests, never the step path)."""
        for req in reqs:
            row = self.page_table[req.slot, :len(req.pages)].tolist()
            assert row == req.pages, (
                f"{req.request_id}: device page-table row {row} != host pages {req.pages}")

    def _grammar_masks(self, batch: ScheduledBatch) -> None:
        """This step's token masks of its constrained rows that sample: computed on the
        host (each matcher has seen every token its request committed: the engine
        does not overlap a constrained step with the next), one upload."""
        reqs = [q for q, s in zip(batch.reqs, batch.samples) if s and q.grammar is not None]
        if not reqs:
            return
        n, w = len(reqs), self.sampler.mask_words
        host = torch.empty(n * w + n, dtype=torch.int32, pin_memory=self._pin)  # words | slots
        buf = host.numpy()
        self._masks.fill([q.grammar for q in reqs], buf[:n * w].reshape(n, w))  # type: ignore[misc]
        buf[n * w:] = [q.slot for q in reqs]
        # Pinned: the caching host allocator keeps the block until the copy has run.
        dev = host.to(self.device, non_blocking=True)
        self.sampler.set_grammar_masks(dev[n * w:], dev[:n * w].view(n, w))

    def build(self, batch: ScheduledBatch, prompt: prompt_lp.Plan | None = None,
              ) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Eager path: (forward batch, sampler slots, steps, min_tokens_active).
        With ``prompt``, the forward's logits rows are the sampled ones, then the
        plan's rows."""
        ps = self.page_size
        ids, pos, locs, indptr, seq_lens, last = token_layout(batch, ps)
        rows = sample_rows(batch)  # a verify step: each drafted request's k + 1 rows
        t, b, r = len(ids), len(batch.reqs), len(rows)
        n_pl = prompt.count if prompt is not None else 0
        if batch.src_rows:  # per request; a request fed from the device has one token
            src = np.repeat(np.array(batch.src_rows, dtype=np.int64),
                            [len(x) for x in batch.new_tokens])
        else:
            src = np.full(t, -1)
        hybrid = self.state_pool is not None
        if hybrid and batch.verifies:
            log = self.state_pool.verify_log  # type: ignore[union-attr]
            assert log is not None and t <= log.tokens, "a verify step past the log sized at start-up"
        small = (indptr + seq_lens + list(batch.prefix_lens) + [q.slot for q in batch.reqs]
                 + ([q.state_slot for q in batch.reqs] if hybrid else [])
                 + logits_rows(batch, rows, last) + sampling_words(batch, rows)
                 + (prompt.rows if prompt is not None else []))
        dev = self._upload(np.concatenate([ids, src, pos, locs, np.array(small, dtype=np.int64)]))
        o = 0

        def take(n: int) -> torch.Tensor:
            nonlocal o
            o += n
            return dev[o - n:o]

        host_ids, src_rows, positions, out_loc = take(t), take(t), take(t), take(t)
        qo_indptr, d_seq, d_pre = take(b + 1), take(b), take(b)
        d_slots = take(b)
        d_state_slots = take(b) if hybrid else None
        logits_idx = take(r)
        s_slots, s_steps, s_min = take(r), take(r), take(r)
        if n_pl:
            logits_idx = torch.cat([logits_idx, take(n_pl)])
        if batch.src_rows and max(batch.src_rows) >= 0:
            input_ids = self._device_inputs(host_ids, src_rows)
        else:
            input_ids = host_ids
        attn = AttentionMetadata(
            page_size=ps,
            qo_indptr=qo_indptr.to(torch.int32),
            seq_lens=d_seq.to(torch.int32),
            prefix_lens=d_pre.to(torch.int32),
            page_table=self.page_table.index_select(0, d_slots),
            out_cache_loc=out_loc,
            seq_lens_host=seq_lens,
            prefix_lens_host=list(batch.prefix_lens),
            max_seq_len=max(seq_lens),
            max_extend_len=max(len(x) for x in batch.new_tokens),
        )
        fb = ForwardBatch(input_ids, positions, attn, self.kv_pool, self.attn_backend,
                          logits_indices=logits_idx, is_decode=batch.is_decode, kernels=self.kernels,
                          state_pool=self.state_pool, state_slots=d_state_slots,
                          state_verify=hybrid and batch.verifies, state_inner=self._inner_saves(batch))
        return fb, s_slots, s_steps, s_min.bool()

    def _inner_saves(self, batch: ScheduledBatch) -> InnerSaves | None:
        """The step's state checkpoints inside its chunks, on the device (one copy)."""
        if not any(batch.state_inner):
            return None
        k = max(len(x) for x in batch.state_inner)
        rows = [x + [(0, -1)] * (k - len(x)) for x in batch.state_inner]
        dev = self._upload([off for row in rows for off, _ in row] + [s for row in rows for _, s in row])
        return InnerSaves(dev[:len(rows) * k].view(-1, k), dev[len(rows) * k:].view(-1, k), batch.state_inner)

    def _extend_graphs(self, batch: ScheduledBatch) -> PrefillGraphs | None:
        """The captured graphs that run this (non-decode) step, if any: verify
        graphs for a verify step, prefill graphs for the rest."""
        graphs = self.verify_graphs if batch.verifies else self.prefill_graphs
        return graphs if graphs is not None and graphs.can_run(batch) else None

    def _copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """state[dst] = state[src] for each (src, dst) pair of state-pool slots,
        queued on the stream in order with the forwards around it."""
        if not pairs:
            return
        assert self.state_pool is not None
        dev = self._upload([src for src, _ in pairs] + [dst for _, dst in pairs]).view(2, -1)
        self.state_pool.copy_slots(dev[0], dev[1])

    def _commit_states(self, batch: ScheduledBatch, fb: ForwardBatch, sampled: torch.Tensor) -> None:
        """A hybrid's verify step, after sampling: each request's state slot moves
        on by the inputs it keeps (its last token and the accepted draft), as
        plain decode steps would have left it; on the device, no sync. The host's
        commit (Scheduler.commit_verified) keeps the same tokens, or fewer when a
        stop ends the request, whose state then no longer matters."""
        assert self.state_pool is not None and fb.state_slots is not None and fb.state_verify
        # Checkpoints are saved by prefill chunks only: never at a draft's positions.
        assert not batch.state_saves and not batch.state_loads
        lens = [len(x) for x in batch.new_tokens]
        b, n = len(lens), sum(lens)
        assert len(sampled) >= n, "every input of a verify step is sampled"
        idx, width = accept.device_plan(lens)
        # fb may be a verify graph's static batch, padded past the step's b
        # sequences and n tokens: views of its leading rows (no copy, no sync).
        kept = accept.kept_counts(fb.input_ids[:n], sampled[:n], self._upload(idx).view(b, width))
        self.state_pool.commit_verified(self.kernels, fb.state_slots[:b], fb.attn.prefix_lens[:b] > 0,
                                        fb.attn.qo_indptr[:b], kept, width + 1)

    def _device_inputs(self, host_ids: torch.Tensor, src_rows: torch.Tensor) -> torch.Tensor:
        """Input ids where the previous step's sampled token stands in for the
        ones the host does not know yet (src_rows >= 0). Fixed shape, no sync."""
        prev = self.last_tokens.index_select(0, src_rows.clamp(min=0))  # [B]
        return torch.where(src_rows >= 0, prev, host_ids)

    # ----- one step ------------------------------------------------------
    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> Launched:
        """Enqueue the step's device work; the tokens come back in collect()."""
        # A step holding a request that drafts with the MTP layers (or may later)
        # keeps the MTP KV: the decode graphs run the MTP pass themselves, the
        # prefill and verify graphs keep the hidden states for it (spec/mtp.py).
        mtp = self.mtp if self.mtp is not None and self.mtp.tracks_any(batch) else None
        decode_graph = (self.graphs is not None and (mtp is None or self.graphs.with_mtp)
                        and batch.is_decode and self.graphs.can_run(len(batch.reqs)))
        layer_ready = None
        if self.kv_host is not None:
            # Offloads of evicted pages and loads of host-tier hits, ordered by
            # events after the previous steps (no host wait). A restore streams in
            # layer by layer under an eager forward, layer L waiting for its own
            # pages only; a decode graph waits for all of it.
            layered = not decode_graph and self.kv_host.has_pending_loads
            layer_ready = self.kv_host.flush(layered=layered)
        self.mirror_pages(batch.reqs)
        # Prefix-cache checkpoints into the slots of the requests resuming from them.
        self._copy_states(batch.state_loads)
        rows = sample_rows(batch)
        prompt = prompt_lp.plan(batch)  # rows of prompt logprobs: the eager path
        if decode_graph:
            assert self.graphs is not None
            assert not batch.state_saves, "a decode step saves no state checkpoint"
            self._sampling_inputs(batch)  # the graph samples: parameters first
            out, graph_host = self.graphs.replay(batch)
            return Launched(batch, rows, self._copy_out(batch, rows, out, graph_host))
        elif (layer_ready is None and prompt is None and (graphs := self._extend_graphs(batch))
              and (mtp is None or graphs.keep_hidden)):
            # A prefill graph's logits: row i = reqs[i]; a verify graph's: the
            # sampled rows in order (PrefillGraphs.all_rows). A hybrid's state work
            # that is not fixed-shape runs around the replay: checkpoint loads
            # before it (above), saves after it, a verify step's commit after sampling.
            drafts: torch.Tensor | None = None
            if mtp is not None and batch.verifies:  # the chain, eagerly, then the replay
                drafts = mtp.draft(batch)  # [D]
                logits_all = graphs.replay(batch, (self._upload(mtp.draft_positions(batch)), drafts))
            else:
                logits_all = graphs.replay(batch)
            self._copy_states(batch.state_saves)
            if not rows:
                if mtp is not None:
                    mtp.extend(batch, graphs.static_batch(batch), None, rows)
                return Launched(batch, rows, None)
            self._sampling_inputs(batch)  # behind the forward on the stream, before sampling
            if graphs.all_rows:  # the sampled rows lead, in order: a view
                dev = self._upload(sampling_words(batch, rows)).view(3, -1)
                logits = logits_all[:len(rows)]  # [R, V]
            else:
                dev = self._upload(rows + sampling_words(batch, rows)).view(4, -1)
                logits = logits_all.index_select(0, dev[0])  # [R, V]
                dev = dev[1:]
            out = self.sampler.sample(logits, dev[0], dev[1], dev[2].bool(),
                                      last=None if batch.verifies else self.last_tokens,
                                      features=self.sampler.features_of(batch.reqs[i].slot for i in rows))
            self.sampler.update(dev[0], out.token_ids)
            if graphs.hybrid and batch.verifies:
                self._commit_states(batch, graphs.static_batch(batch), out.token_ids)
            if mtp is not None:
                mtp.extend(batch, graphs.static_batch(batch), out.token_ids, rows)
                return Launched(batch, rows, self._copy_out(batch, rows, out, drafts=drafts))
        else:
            fb, slots, steps, min_active = self.build(batch, prompt)
            fb.layer_ready = layer_ready
            drafts = None
            if mtp is not None:
                fb.keep_hidden = True
                if batch.verifies:
                    if layer_ready:  # the chain writes the MTP layer's pages first
                        torch.cuda.current_stream(self.device).wait_event(layer_ready[-1])
                    drafts = mtp.draft(batch)  # [D], written over the -1 placeholders
                    fb.input_ids = fb.input_ids.index_copy(
                        0, self._upload(mtp.draft_positions(batch)), drafts)
            logits = self.model(fb)  # [R (+ P), V] fp32 (unused for a non-final chunk)
            if prompt is not None:
                r = len(rows)
                targets = self._upload(prompt.targets)  # [P]
                prompt_lp.hand_off(prompt, prompt_lp.table(logits[r:], targets, prompt.top_k), self._pin)
                logits = logits[:r]
            if layer_ready:
                # Every move is done before the step ends, also if some layer
                # never waited (later steps rely on the stream order alone).
                torch.cuda.current_stream(self.device).wait_event(layer_ready[-1])
            # The states of chunks that end on a checkpoint boundary, for the prefix cache.
            self._copy_states(batch.state_saves)
            if not rows:
                # A non-final prefill chunk: only the KV matters; no logits, no sync.
                if mtp is not None:
                    mtp.extend(batch, fb, None, rows)
                return Launched(batch, rows, None)
            self._sampling_inputs(batch)
            # A verify step is read back before the next is planned (engine._step):
            # no later step takes its inputs from last_tokens, which holds one row
            # per request, not per draft position.
            last = None if batch.verifies else self.last_tokens
            out = self.sampler.sample(logits, slots, steps, min_active, last=last,
                                      features=self.sampler.features_of(batch.reqs[i].slot for i in rows))
            self.sampler.update(slots, out.token_ids)
            if fb.state_verify:
                self._commit_states(batch, fb, out.token_ids)
            if mtp is not None:
                mtp.extend(batch, fb, out.token_ids, rows)
            return Launched(batch, rows, self._copy_out(batch, rows, out, drafts=drafts))
        return Launched(batch, rows, self._copy_out(batch, rows, out))

    def _copy_out(self, batch: ScheduledBatch, rows: list[int], out: SampleOutput,
                  graph_host: torch.Tensor | None = None, drafts: torch.Tensor | None = None,
                  ) -> _HostOut:
        """Start the device->host copy of the sampled tokens (and logprobs if
        asked); ``graph_host``: the pinned row a decode graph stored them in;
        ``drafts``: the step's device-made draft tokens, read back with them."""
        n = len(rows)
        want = out.logprobs is not None and any(
            batch.reqs[i].params.logprobs is not None for i in rows)
        if want:
            assert out.logprobs is not None and out.top_ids is not None
            assert out.top_logprobs is not None
            packed = torch.cat([out.token_ids[:n, None].double(), out.logprobs[:n, None].double(),
                                out.top_ids[:n].double(), out.top_logprobs[:n].double()],
                               dim=1)  # [n, 2 + 2K]
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=self._pin)
            host.copy_(packed, non_blocking=True)
        elif graph_host is not None:
            host = graph_host[:n]  # the graph stored them there itself (cuda_graph)
        else:
            # Tokens only: straight into a persistent pinned buffer. Two of them
            # alternate: step N's is read (collect) before step N+2 rewrites it.
            self._out_flip ^= 1
            host = self._out_host[self._out_flip][:n]
            if n > host.numel():  # a verify step's rows outnumber the requests
                host = torch.empty(n, dtype=torch.int64, pin_memory=self._pin)
            copy_host_words(out.token_ids[:n], host)  # a kernel storing over UVA where on CUDA
        draft_host = None
        if drafts is not None:
            draft_host = torch.empty(drafts.shape[0], dtype=torch.int64, pin_memory=self._pin)
            copy_host_words(drafts, draft_host)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return _HostOut(host, event, want, draft_host)

    def _read(self, launched: Launched) -> tuple[list[int], list[TokenLogprob | None] | None]:
        """Wait for a launched step's sampled rows (token, and logprob where its
        request asked): the step's one deliberate sync."""
        batch, rows, hout = launched.batch, launched.rows, launched.out
        assert hout is not None
        self.read_backs += 1
        with deliberate_sync():
            if hout.event is not None:
                hout.event.synchronize()
            table = hout.host.tolist()
        if not hout.logprobs:
            return table, None
        sampled = [int(row[0]) for row in table]
        k_max = (len(table[0]) - 2) // 2 if table else 0
        lps: list[TokenLogprob | None] = [None] * len(rows)
        for j, i in enumerate(rows):
            k = batch.reqs[i].params.logprobs
            if k is not None:
                row = table[j]
                ids = [int(x) for x in row[2:2 + k_max]][:k]
                vals = row[2 + k_max:2 + 2 * k_max][:k]
                lps[j] = TokenLogprob(sampled[j], float(row[1]), tuple(zip(ids, vals)))
        return sampled, lps

    def collect(self, launched: Launched) -> tuple[list[int], list[TokenLogprob | None] | None]:
        """A plain step's tokens, one per request (-1 where it samples nothing)."""
        batch, rows = launched.batch, launched.rows
        if launched.out is None:
            return [], None
        sampled, row_lps = self._read(launched)
        token_ids = [-1] * len(batch.reqs)
        for i, tok in zip(rows, sampled):
            token_ids[i] = tok
        if row_lps is None:
            return token_ids, None
        lps: list[TokenLogprob | None] = [None] * len(batch.reqs)
        for i, lp in zip(rows, row_lps):
            lps[i] = lp
        return token_ids, lps

    def collect_verified(self, launched: Launched,
                         ) -> tuple[list[list[int]], list[list[TokenLogprob | None]] | None]:
        """A verify step's sampled tokens per request, one per position (its
        draft's length + 1; one for a plain row)."""
        batch, rows = launched.batch, launched.rows
        assert launched.out is not None
        sampled, row_lps = self._read(launched)
        if launched.out.drafts is not None:  # fill in the placeholders (spec/mtp.py)
            made = launched.out.drafts.tolist()  # pinned host memory, behind the event read waited for
            o = 0
            for d, toks in zip(batch.drafts, batch.new_tokens):
                k = len(d)
                d[:] = made[o:o + k]
                toks[1:1 + k] = d  # fed after the request's last token
                o += k
        # rows is sample_rows(batch): each request's rows in one run, in request order.
        tokens: list[list[int]] = []
        lps: list[list[TokenLogprob | None]] | None = None if row_lps is None else []
        o = 0
        for d, s in zip(batch.drafts, batch.samples):
            n = len(d) + 1 if s else 0
            tokens.append(sampled[o:o + n])
            if lps is not None and row_lps is not None:
                lps.append(row_lps[o:o + n])
            o += n
        assert o == len(rows), "rows must be sample_rows(batch)"
        return tokens, lps

    def step(self, batch: ScheduledBatch) -> tuple[list[int], list[TokenLogprob | None] | None]:
        """launch + collect, without overlap."""
        return self.collect(self.launch(batch))


def sample_rows(batch: ScheduledBatch) -> list[int]:
    """The batch index of each sampled row, in row order: one per request that
    samples, or in a verify step len(drafts[i]) + 1 for request i."""
    if not batch.drafts:
        return [i for i, s in enumerate(batch.samples) if s]
    return [i for i, s in enumerate(batch.samples) if s for _ in range(len(batch.drafts[i]) + 1)]


def logits_rows(batch: ScheduledBatch, rows: list[int], last: list[int]) -> list[int]:
    """The packed token index whose logits each sampled row reads: a request's
    last new token, or in a verify step the m-th of its last len(draft) + 1."""
    if not batch.drafts:
        return [last[i] for i in rows]
    if len(rows) == last[-1] + 1:  # every token is sampled (a verify batch): in token order
        return list(range(len(rows)))
    return [last[i] - len(batch.drafts[i]) + m for i, m in zip(rows, _draft_offsets(batch, rows))]


def sampling_words(batch: ScheduledBatch, rows: list[int]) -> list[int]:
    """Each sampled row's sampler slot, output step (steps[i] + its position in
    a draft) and below-min_tokens flag, as three runs of len(rows) words."""
    steps = [batch.steps[i] + m for i, m in zip(rows, _draft_offsets(batch, rows))]
    return ([batch.reqs[i].slot for i in rows] + steps
            + [int(st < batch.reqs[i].params.min_tokens) for i, st in zip(rows, steps)])


def _draft_offsets(batch: ScheduledBatch, rows: list[int]) -> list[int]:
    """Each sampled row's position within its request's rows (0 for plain rows)."""
    if not batch.drafts:
        return [0] * len(rows)
    # rows is sample_rows(batch): each drafted request's len(draft) + 1 rows in a run.
    offs = [m for i, s in enumerate(batch.samples) if s for m in range(len(batch.drafts[i]) + 1)]
    assert len(offs) == len(rows), "rows must be sample_rows(batch)"
    return offs


def token_layout(batch: ScheduledBatch, page_size: int) -> PackedTokens:
    """The packed token layout of a scheduled step (see pack_tokens)."""
    return pack_tokens(batch.new_tokens, batch.prefix_lens, [r.pages for r in batch.reqs],
                       page_size)


@dataclass
class _HostOut:
    host: torch.Tensor  # [n] int64 tokens, or [n, 2 + 2K] float64: token, logprob, top ids, top logprobs
    event: torch.cuda.Event | None
    logprobs: bool
    drafts: torch.Tensor | None = None  # [D] int64: the device-made drafts (spec/mtp.py)


@dataclass
class Launched:
    batch: ScheduledBatch
    rows: list[int]  # the batch index of each sampled row (sample_rows)
    out: _HostOut | None  # None: nothing sampled (non-final prefill chunk)

    @property
    def constrained(self) -> bool:
        """Some row that samples has a grammar: its tokens gate the next step's masks."""
        b = self.batch
        return any(r.grammar is not None for r, s in zip(b.reqs, b.samples) if s)
