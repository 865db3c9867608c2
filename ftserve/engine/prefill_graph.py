"""CUDA-graph prefill: the model forward of a prefill step captured once per
token budget (bucket) and replayed, so a chunk costs no per-kernel launch
overhead (eager prefill spends ~20% of a cold 4,096-token chunk launching).

A step with T new tokens over S sequences replays the smallest bucket >= T,
captured for at most ``max_seqs`` sequences. Static input, refilled by one
non-blocking copy from pinned memory; ``PrefillInputs`` names its fields, as
views of the device buffer and of each pinned staging copy::

    p_in int64: ids [Tmax] | positions [Tmax] | out_cache_loc [Tmax]
                | qo_indptr [S+1] | seq_lens [S] | prefix_lens [S]
                | page-table rows (request slots) [S] | logits rows [S]
                (verify graphs: logits rows [Tmax] | each token's page-table row [Tmax]
                 | the row of each token's sequence's first token [Tmax])
                | state-pool slots [S] (hybrid models only)

    tokens:     [ seq 0 | seq 1 | ... | padding up to the bucket ]
    sequences:  [ real ones ... | empty ones (qo_indptr repeats, 0 tokens) ]

Padding tokens write their K/V to the dummy page and attend to nothing; empty
sequences read the dummy page-table row; the extend kernel sizes its grid from
the bucket (``extend_token_bound``) and skips what lies past each sequence; a
bucket whose grid leaves SMs idle (few tokens) attends split-K over the KV at a
split count fixed at capture from the bucket and the static context bound
(TritonAttentionBackend.extend_splits), so a small chunk over a long prefix
still fills the GPU. Rows
of padding tokens carry garbage through the layers but every op is row-local,
and only the real sequences' last rows become logits. Sampling runs eagerly on
the graph's static logits (it is a handful of launches).

Verify graphs (speculative decoding: each sequence feeds its last token and a
few draft tokens over a long cached prefix) attend with one split-K decode
query per token (AttentionMetadata.query_seq_lens) rather than the extend
kernel, whose one program per (head, sequence) would walk the whole prefix
alone; padding tokens read the dummy row at length 1.

Hybrid models (Gated DeltaNet layers over state-pool slots): the step's slots
are one more static field (empty sequences: the sink slot, 0 tokens, so the
kernels leave every real slot alone), and the linear layers take each
sequence's length from qo_indptr within a static bound (``seq_tokens``:
ForwardBatch.graph_seq_bound). What is not fixed-shape stays outside the
replay, in the runner, as in eager steps: a chunk's state-checkpoint loads
before it and saves after it (StatePool.copy_slots), and a verify step's
commit after its sampling (StatePool.commit_verified, over this graph's static
inputs, slots and the verify log its forward wrote, sized at start-up for the
largest bucket).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np
import torch

from ftserve.engine.cuda_graph import capture_graph
from ftserve.engine.runner import logits_rows, sample_rows, token_layout
from ftserve.engine.state_checkpoints import MAX_INNER
from ftserve.kvcache.state_pool import SINK_SLOT
from ftserve.models.forward_batch import AttentionMetadata, ForwardBatch
from ftserve_kernels.gated_delta import InnerSaves

if TYPE_CHECKING:
    from ftserve.engine.runner import ModelRunner
    from ftserve.engine.scheduler import ScheduledBatch

log = logging.getLogger(__name__)

A = TypeVar("A")  # a device tensor or a numpy view of a pinned staging copy


@dataclass
class PrefillInputs(Generic[A]):
    """A prefill graph's static input fields, as consecutive views of one packed
    int64 buffer (``views``): the graph reads the device one, the host fills a
    pinned copy of it field by field and sends it with one copy."""

    ids: A  # [Tmax] token ids, padding 0
    positions: A  # [Tmax]
    out_cache_loc: A  # [Tmax] KV slots, padding the dummy slot 0
    qo_indptr: A  # [S + 1] token offsets; empty sequences repeat the last
    seq_lens: A  # [S]
    prefix_lens: A  # [S]
    slots: A  # [S] page-table rows (request slots); empty sequences: the dummy row
    # [S] the token row of each sequence's last new token; all_rows (verify
    # graphs): [Tmax] the token row of each sampled row, padding row 0
    logits_rows: A
    # all_rows only ([0] otherwise): [Tmax] each token's page-table row (its
    # request's slot; padding: the dummy row)
    token_rows: A
    # all_rows only ([0] otherwise): [Tmax] the token row of each token's
    # sequence's first token (padding: its own row), for the attention's fold
    # (AttentionMetadata.query_first_rows)
    first_rows: A
    # hybrid only ([0] otherwise): [S] each sequence's state-pool slot; empty
    # sequences: the sink slot (state_pool.SINK_SLOT, 0)
    state_slots: A
    # hybrid prefill only ([0] otherwise): [S * MAX_INNER] each sequence's state
    # checkpoints inside its chunk (ScheduledBatch.state_inner), row-major: tokens
    # into the chunk, and the slot (-1: none)
    save_offsets: A
    save_slots: A

    @staticmethod
    def sizes(max_tokens: int, max_seqs: int, all_rows: bool = False, hybrid: bool = False) -> list[int]:
        t, s = max_tokens, max_seqs
        saves = s * MAX_INNER if hybrid and not all_rows else 0
        return [t, t, t, s + 1, s, s, s, t if all_rows else s, t if all_rows else 0, t if all_rows else 0,
                s if hybrid else 0, saves, saves]

    @classmethod
    def views(cls, buf: Any, max_tokens: int, max_seqs: int, all_rows: bool = False,
              hybrid: bool = False) -> PrefillInputs[Any]:
        """The fields of ``buf`` (a 1-D tensor or array of sum(sizes) words)."""
        out, o = [], 0
        for n in cls.sizes(max_tokens, max_seqs, all_rows, hybrid):
            out.append(buf[o:o + n])
            o += n
        assert o == buf.shape[0], (o, buf.shape)
        return cls(*out)


def prefill_buckets(max_tokens: int, smallest: int = 256) -> list[int]:
    sizes = []
    b = smallest
    while b < max_tokens:
        sizes.append(b)
        b *= 2
    sizes.append(max_tokens)
    return sizes


def verify_buckets(max_seqs: int, num_draft: int) -> list[int]:
    """Token budgets of the verify graphs: one sequence's full draft,
    num_draft + 1, then powers of two from 8 up to every sequence feeding one,
    max_seqs * (num_draft + 1). The first is batch 1's step exactly, unpadded:
    at up to GEMV_MAX_ROWS rows its dense linears run the decode GEMVs and
    their folds (norms left pending, SiLU * up in the epilogue), which padding
    to 8 rows would trade for cuBLAS and separate norm and activation launches
    (BENCHMARKS.md, the verify step's trace)."""
    top = max_seqs * (num_draft + 1)
    sizes = prefill_buckets(top, smallest=min(8, top))
    return sizes if num_draft + 1 >= sizes[0] else [num_draft + 1, *sizes]


class PrefillGraphs:
    """Captured extend forwards per token budget. ``all_rows``: the verify graphs
    of speculative decoding, whose logits rows are a step's sampled rows (each
    drafted request's last token and draft, in sample_rows order) rather than
    each sequence's last token; ``buckets``: their budgets (verify_buckets);
    ``seq_tokens``: the most new tokens of one sequence a step may hold (a
    verify step: its draft width + 1; default: the largest bucket), which
    bounds a hybrid's linear-layer grids."""

    def __init__(self, runner: ModelRunner, max_tokens: int, max_seqs: int,
                 pool: object | None = None, *, buckets: list[int] | None = None,
                 all_rows: bool = False, seq_tokens: int | None = None) -> None:
        from ftserve_kernels.attention_triton import TritonAttentionBackend

        self.runner = runner
        self.max_seqs = max_seqs
        self.all_rows = all_rows
        self.buckets = buckets if buckets is not None else prefill_buckets(max_tokens)
        self.t_max = self.buckets[-1]
        self.seq_tokens = seq_tokens if seq_tokens is not None else self.t_max
        # A hybrid model's steps carry state slots (module docstring).
        self.hybrid = runner.state_pool is not None
        if self.hybrid and all_rows:
            vlog = runner.state_pool.verify_log  # type: ignore[union-attr]
            assert vlog is not None and vlog.tokens >= self.t_max, "the verify log holds the largest bucket"
        self.size = sum(PrefillInputs.sizes(self.t_max, max_seqs, all_rows, self.hybrid))
        self.p_in = torch.zeros(self.size, dtype=torch.int64, device=runner.device)
        self.inputs: PrefillInputs[torch.Tensor] = PrefillInputs.views(self.p_in, self.t_max, max_seqs,
                                                                       all_rows, self.hybrid)
        # Two pinned staging copies of p_in, alternating; each one's event says when
        # its last copy has run, so it is refilled only then (a query, not a wait;
        # one still in flight falls back to a fresh pinned block). CPU: no events.
        pin = runner.device.type == "cuda"
        self._stage = [torch.zeros(self.size, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._stage_done = [torch.cuda.Event() for _ in range(2)] if pin else None
        self._flip = 0
        # Each staging copy's field views, and the all-padding step every fill starts
        # from (token 0 -> dummy slot 0, the dummy page-table row, the sink state
        # slot, each padding token its own first row): one copy, not a write a field.
        self._views = [PrefillInputs.views(h.numpy(), self.t_max, max_seqs, all_rows, self.hybrid)
                       for h in self._stage]
        self._blank = np.zeros(self.size, dtype=np.int64)
        blank = PrefillInputs.views(self._blank, self.t_max, max_seqs, all_rows, self.hybrid)
        blank.slots[:] = runner.sink_row  # empty sequences read the dummy row
        blank.token_rows[:] = runner.sink_row  # so do padding tokens
        blank.state_slots[:] = SINK_SLOT  # and empty sequences' states (hybrid)
        blank.save_slots[:] = -1  # no state checkpoints inside the chunks
        blank.first_rows[:] = np.arange(blank.first_rows.shape[0])
        self.backends = {b: TritonAttentionBackend(extend_token_bound=b) for b in self.buckets}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        # --speculative mtp: the forward also keeps every token's final hidden
        # state; fbs[bucket] is the captured batch, its ``hidden`` the static
        # [bucket, H] buffer the MTP pass after sampling reads (spec/mtp.py).
        self.keep_hidden = runner.mtp is not None
        self.fbs: dict[int, ForwardBatch] = {}
        self.pool = pool  # set at capture (CUDA only)

    def can_run(self, batch: ScheduledBatch) -> bool:
        """Its kind (verify or not), sequences and tokens fit, and the host holds
        every input token: a verify step can carry plain rows whose token is the
        in-flight step's output (src_rows), which the graph does not read; such a
        step runs eagerly."""
        return (not batch.is_decode and batch.verifies == self.all_rows
                and len(batch.reqs) <= self.max_seqs and batch.num_tokens <= self.t_max
                and max(len(x) for x in batch.new_tokens) <= self.seq_tokens
                and all(s < 0 for s in batch.src_rows))

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _forward(self, bucket: int) -> torch.Tensor:
        r = self.runner
        s = self.max_seqs
        p = self.inputs
        attn = AttentionMetadata(
            page_size=r.page_size,
            qo_indptr=p.qo_indptr.to(torch.int32),
            seq_lens=p.seq_lens.to(torch.int32),
            prefix_lens=p.prefix_lens.to(torch.int32),
            page_table=r.page_table.index_select(0, p.slots),
            out_cache_loc=p.out_cache_loc[:bucket],
            seq_lens_host=[r.max_pages * r.page_size] * s,  # static upper bounds
            prefix_lens_host=[0] * s,
            max_seq_len=r.max_pages * r.page_size,
            max_extend_len=bucket,
        )
        rows = p.logits_rows[:bucket] if self.all_rows else p.logits_rows
        if self.all_rows:
            attn.query_page_table = r.page_table.index_select(0, p.token_rows[:bucket])  # [bucket, W]
            attn.query_seq_lens = (p.positions[:bucket] + 1).to(torch.int32)  # [bucket]
            attn.query_first_rows = p.first_rows[:bucket]
            attn.query_rows_bound = min(self.seq_tokens, bucket)
        fb = ForwardBatch(p.ids[:bucket], p.positions[:bucket], attn,
                          r.kv_pool, self.backends[bucket],
                          logits_indices=rows, is_decode=False, kernels=r.kernels,
                          keep_hidden=self.keep_hidden)
        fb.valid_tokens = attn.qo_indptr[-1:]  # empty sequences repeat the last entry
        if self.hybrid:  # the slots by index; a verify step logs its linear layers' inputs
            fb.state_pool, fb.state_slots = r.state_pool, p.state_slots
            fb.state_verify = self.all_rows
            fb.graph_seq_bound = min(self.seq_tokens, bucket)
            if not self.all_rows:  # the linear layers' kernels cut each sequence at its checkpoints
                fb.state_inner = InnerSaves(p.save_offsets.view(s, MAX_INNER), p.save_slots.view(s, MAX_INNER))
        self.fbs[bucket] = fb  # the captured call's is the last
        return r.model(fb)  # [S, V] fp32 ([bucket, V] with all_rows)

    def capture(self) -> None:
        t0 = time.monotonic()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        self._fill(None, self.t_max)
        with torch.inference_mode():
            for bucket in sorted(self.buckets, reverse=True):
                self.graphs[bucket], self.logits[bucket] = capture_graph(
                    lambda b=bucket: self._forward(b), self.pool)
        torch.cuda.synchronize()
        log.info("CUDA graphs for %s token budgets %s (up to %d sequences) captured in %.1f s",
                 "verify" if self.all_rows else "prefill", self.buckets, self.max_seqs,
                 time.monotonic() - t0)

    def _fill(self, batch: ScheduledBatch | None, bucket: int) -> None:
        """Pack the step into p_in with one copy (batch None: an all-padding step)."""
        r = self.runner
        self._flip ^= 1
        done = self._stage_done[self._flip] if self._stage_done is not None else None
        host, f = self._stage[self._flip], self._views[self._flip]
        if done is not None and not done.query():  # an unrecorded event counts as done
            host = torch.empty_like(host, pin_memory=True)  # still being copied
            f = PrefillInputs.views(host.numpy(), self.t_max, self.max_seqs, self.all_rows, self.hybrid)
        host.numpy()[:] = self._blank  # an all-padding step (__init__), the batch over it
        if batch is not None:
            ids, pos, locs, indptr, seq, last = token_layout(batch, r.page_size)
            t, k = len(ids), len(seq)
            f.ids[:t] = ids
            f.positions[:t] = pos
            f.out_cache_loc[:t] = locs
            f.qo_indptr[:k + 1] = indptr
            f.qo_indptr[k + 1:] = t  # empty sequences: 0 tokens
            f.seq_lens[:k] = seq
            f.prefix_lens[:k] = batch.prefix_lens
            f.slots[:k] = [req.slot for req in batch.reqs]
            if self.hybrid:
                f.state_slots[:k] = [req.state_slot for req in batch.reqs]
                for i, cuts in enumerate(batch.state_inner):
                    for j, (off, slot) in enumerate(cuts):
                        f.save_offsets[i * MAX_INNER + j] = off
                        f.save_slots[i * MAX_INNER + j] = slot
            if self.all_rows:
                rows = logits_rows(batch, sample_rows(batch), last)
                f.logits_rows[:len(rows)] = rows
                f.token_rows[:t] = [req.slot for req, x in zip(batch.reqs, batch.new_tokens) for _ in x]
                for i in range(k):
                    f.first_rows[indptr[i]:indptr[i + 1]] = indptr[i]
            else:
                f.logits_rows[:k] = last
        self.p_in.copy_(host, non_blocking=True)
        if done is not None and host is self._stage[self._flip]:
            done.record()

    def replay(self, batch: ScheduledBatch, drafts: tuple[torch.Tensor, torch.Tensor] | None = None,
               ) -> torch.Tensor:
        """Run the step's forward; returns static logits [max_seqs, V] (row i =
        batch.reqs[i]'s last new token; rows past len(batch.reqs) are padding),
        with all_rows [bucket, V] (row j = the step's sampled row j).
        ``drafts``: (token rows, tokens) made on the device (spec/mtp.py),
        written over the placeholders of the step's input ids, stream-ordered
        after the upload."""
        bucket = self._bucket(batch.num_tokens)
        self._fill(batch, bucket)
        if drafts is not None:
            self.inputs.ids.index_copy_(0, drafts[0], drafts[1])
        return self._run(bucket)

    def _run(self, bucket: int) -> torch.Tensor:
        """Replay the graph of ``bucket``; its static logits (tests on the CPU
        run ``_forward`` in its place)."""
        self.graphs[bucket].replay()
        return self.logits[bucket]

    def static_batch(self, batch: ScheduledBatch) -> ForwardBatch:
        """The captured forward batch the step of ``batch`` replayed (its
        hidden states, inputs and attention metadata, static)."""
        return self.fbs[self._bucket(batch.num_tokens)]
