"""CUDA-graph decode: one captured graph per padded batch size, replayed with
one call.

Static input, refilled each step from pinned memory over UVA: the graph's
first node (the decode inputs kernel) reads the step's words from a pinned
row itself. The pinned rows are a pair that alternates between steps, and a
device word picks the row (bookkeeping.StagedRows); the greedy kernel stores
the sampled tokens into the same row of a pinned output pair and toggles the
word (the sampler's other stage sets end with a copy kernel that does it,
copy_host_words_paired). So a decode step is one graph launch, with nothing
between two graphs (H200, batch 1: 11 us of copies and gaps did sit there),
and no copy kernel inside a greedy one. Where UVA kernels cannot run (the
Triton interpreter) the copies stay outside, into ``DecodeGraphIO.rows``.

A step's words are one ``DecodeRow`` per sequence (decode_inputs.py: input_id,
position, out_cache_loc, seq_len, sampler slot with the min_tokens flag in bit
62, step, src_row: the row of runner.last_tokens holding the input id when the
host does not know it yet -- overlap scheduling -- else -1, and a hybrid
model's state-pool slot), packed row-major so the first pbs rows are one
contiguous copy; the graph's first launch picks them apart into contiguous
per-field vectors (the state slots into the forward's ``state_slots``: the
linear-attention layers gather and scatter each row's state by it).

Padded rows (batch size rounded up to a captured size) read the dummy page
(slot 0), the dummy page-table row, the dummy sampler slot and the state
pool's sink slot, so they write nowhere real and need no branch. Graphs are captured largest first into one
memory pool, for each sampler stage set of SAMPLER_VARIANTS (greedy,
temperature, + short filters, + any filter, everything; a step replays the
smallest that covers its rows). The everything set includes the grammar-mask stage, which reads the
sampler's per-slot mask table: the runner rewrites constrained rows in place
before each replay.

With ``--speculative mtp`` every graph also runs the MTP layer's pass after
sampling (spec/mtp.py ``MTPDrafter.decode_pass``): the forward keeps each
row's final hidden state, and the pass pairs it with the sampled token at the
row's position and KV slot, so a decode step of requests that may draft stays
one replay and one read-back.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

from ftserve.engine.sampler import SampleOutput, SamplerFeatures
from ftserve.kvcache.state_pool import SINK_SLOT
from ftserve.models.forward_batch import AttentionMetadata, ForwardBatch
from ftserve_kernels import ops
from ftserve_kernels.bookkeeping import (
    StagedRows,
    copy_host_words,
    copy_host_words_paired,
    paired_copies_supported,
)
from ftserve_kernels.decode_inputs import WORDS, DecodeRow

if TYPE_CHECKING:
    from ftserve.engine.runner import ModelRunner
    from ftserve.engine.scheduler import ScheduledBatch

log = logging.getLogger(__name__)

T = TypeVar("T")
MIN_FLAG = 1 << 62
ALL_FEATURES = SamplerFeatures.all()
# The sampler stage sets captured per batch size, smallest first; a step replays
# the first that covers its rows' needs (Sampler.features_of). The stages differ
# by an order of magnitude in cost (BENCHMARKS.md, "Sampler stages per step"):
# with one all-stages graph, one sampled request anywhere would make every
# later step, greedy ones included, pay for every stage.
SAMPLER_VARIANTS = (
    SamplerFeatures(),
    SamplerFeatures(sampling=True),
    SamplerFeatures(sampling=True, filtering=True),
    SamplerFeatures(sampling=True, filtering=True, penalties=True),
    SamplerFeatures(sampling=True, filtering=True, wide_filter=True),
    ALL_FEATURES,
)


@functools.cache
def sampler_variant(need: SamplerFeatures) -> SamplerFeatures:
    """The smallest captured sampler stage set that runs every stage in ``need``."""
    return next(v for v in SAMPLER_VARIANTS if v.covers(need))


def graph_batch_sizes(max_bs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs]
    sizes += list(range(16, max_bs + 1, 8))
    if max_bs not in sizes:
        sizes.append(max_bs)
    return sorted(set(sizes))


def pack_decode_rows(batch: ScheduledBatch, page_size: int, sink_row: int, padded_bs: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """A decode step's words [padded_bs * WORDS] int64: one DecodeRow per request
    of ``batch``, then padding rows up to ``padded_bs``. Written into the front
    of ``out`` (a CPU int64 vector, the graphs' pinned staging row) where given.

    Built by field (a list per field, stored as a column of the rows in one
    numpy assignment), not as a DecodeRow object per request converted by
    torch.tensor: it runs on the engine thread every decode step, and host time
    per step bounds throughput at large batches (tools/bench/host_step.py)."""
    n, ps = len(batch.reqs), page_size
    words = out[:padded_bs * WORDS] if out is not None else torch.empty(padded_bs * WORDS, dtype=torch.int64)
    rows = words.numpy().reshape(padded_bs, WORDS)
    reqs, pos = batch.reqs, batch.prefix_lens
    cols: DecodeRow[list[int]] = DecodeRow(
        input_id=[toks[0] for toks in batch.new_tokens],
        position=pos,
        out_cache_loc=[req.pages[p // ps] * ps + p % ps for req, p in zip(reqs, pos)],
        seq_len=[p + 1 for p in pos],
        slot=[req.slot | (MIN_FLAG if step < req.params.min_tokens else 0)
              for req, step in zip(reqs, batch.steps)],
        step=batch.steps,
        src_row=batch.src_rows,
        state_slot=[max(req.state_slot, SINK_SLOT) for req in reqs],
    )
    rows[:n].T[:] = cols  # [WORDS, n]: field f of every row
    if padded_bs > n:
        rows[n:] = DecodeRow.padding(sink_row)
    return words


def capture_graph(fn: Callable[[], T], pool: object) -> tuple[torch.cuda.CUDAGraph, T]:
    """Warm fn up on a side stream (kernel compiles, allocator settles), then
    capture one call of it into pool; returns the graph and fn's static output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


@dataclass
class DecodeGraphIO:
    """The decode graphs' static step buffers: the captured graphs hold their
    addresses, so they are refilled every step and never reallocated. A step
    of padded batch size pbs uses the first pbs rows / words of each."""

    # [max_bs, WORDS] int64, device: the step's DecodeRows where the graph cannot
    # read pinned memory itself (copied in before the replay); with in-graph
    # I/O it only gives the inputs launch its shape.
    rows: torch.Tensor
    # [2, max_bs * WORDS] int64, pinned: two staging rows of the step's words,
    # alternating (with overlap scheduling the copy out of one may still be
    # queued while the next step is planned); the graph reads row ``parity``.
    host_rows: torch.Tensor
    # [2, max_bs] int64, pinned: the sampled tokens, stored into row ``parity``.
    host_tokens: torch.Tensor
    # [1] int32, device: the row of both pairs this step uses; the node that
    # stores the tokens toggles it.
    parity: torch.Tensor
    qo_indptr: torch.Tensor  # [max_bs + 1] int32: one query per sequence
    logits_indices: torch.Tensor  # [max_bs] int64: every row is a logits row

    @classmethod
    def allocate(cls, max_bs: int, device: torch.device) -> DecodeGraphIO:
        pin = device.type == "cuda"  # CPU: the static forward runs eagerly in tests
        return cls(
            rows=torch.zeros(max_bs, WORDS, dtype=torch.int64, device=device),
            host_rows=torch.zeros(2, max_bs * WORDS, dtype=torch.int64, pin_memory=pin),
            host_tokens=torch.zeros(2, max_bs, dtype=torch.int64, pin_memory=pin),
            parity=torch.zeros(1, dtype=torch.int32, device=device),
            qo_indptr=torch.arange(max_bs + 1, dtype=torch.int32, device=device),
            logits_indices=torch.arange(max_bs, dtype=torch.int64, device=device),
        )

    def staged_rows(self, bs: int) -> StagedRows:
        """The pinned pair of the first bs rows' words, picked by ``parity``."""
        return StagedRows(self.host_rows[:, :bs * WORDS], self.parity)

    def staged_tokens(self, bs: int) -> StagedRows:
        return StagedRows(self.host_tokens[:, :bs], self.parity)


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, max_bs: int) -> None:
        self.runner = runner
        self.device = runner.device
        self.max_bs = max_bs
        self.sizes = graph_batch_sizes(max_bs)
        self.io = DecodeGraphIO.allocate(max_bs, self.device)
        # The attention backend the graphs run (the runner's; tests running the
        # static forward on the CPU give it the Triton one, which reads the
        # device lengths rather than the static host bounds).
        self.backend = runner.attn_backend
        # --speculative mtp: each graph also runs the MTP layer's pass over the
        # step's (hidden state, sampled token) pairs (spec/mtp.py), so decode steps
        # of requests that may draft replay graphs too.
        self.with_mtp = runner.mtp is not None
        # With in-graph copies the graph reads row `parity` of the staging pair
        # and writes its tokens to row `parity` of the token pair, then toggles
        # the word; the host's `_flip` is the same count of replays mod 2
        # (reset_parity() sets both to 0).
        self.in_graph_io = paired_copies_supported(self.device)
        self._flip = 0
        # Keyed (padded batch size, sampler stages, bound on the longest sequence).
        self.graphs: dict[tuple[int, SamplerFeatures, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, SamplerFeatures, int], SampleOutput] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        self.full_bound = runner.max_pages * runner.page_size
        self.bounds = {bs: self._bounds(bs) for bs in self.sizes}

    def _bounds(self, bs: int) -> list[int]:
        """The sequence-length bounds graphs of batch size ``bs`` are captured
        for, ascending, the last the pool's whole width: a shorter one where the
        attention backend takes fewer splits up to it (its short-context cap)."""
        backend = self.backend
        limit_of = getattr(backend, "short_context_limit", None)
        full = self.full_bound
        if limit_of is None:
            return [full]
        limit = min(limit_of(self.device), full)
        hkv = self.runner.kv_pool.num_kv_heads
        if limit <= 0 or limit == full or (backend.num_splits(bs, hkv, self.device, limit)
                                           == backend.num_splits(bs, hkv, self.device, full)):
            return [full]
        return [limit, full]

    def _bound(self, pbs: int, batch: ScheduledBatch) -> int:
        """The tightest captured bound over every sequence of the batch."""
        longest = max(batch.prefix_lens) + 1
        return next(b for b in self.bounds[pbs] if b >= longest)

    def can_run(self, bs: int) -> bool:
        return bs <= self.max_bs

    def _padded(self, bs: int) -> int:
        for s in self.sizes:
            if s >= bs:
                return s
        raise ValueError(bs)

    def _forward(self, bs: int, bound: int) -> SampleOutput:
        r = self.runner
        # One launch on Triton: the fields, the page-table rows, the embeddings.
        # With the first layer's input norm too, where the model takes it (as
        # its eager decode step does: the same rows to the bit). With in-graph
        # I/O it reads the step's words from the pinned row itself.
        embed = getattr(r.model, "embed_tokens", None)
        first_norm = getattr(r.model, "decode_input_norm", None)
        io = self.io
        staged_in = io.staged_rows(bs) if self.in_graph_io else None
        d = ops.decode_inputs(r.kernels, io.rows[:bs], r.last_tokens, r.page_table,
                              None if embed is None else embed.weight, MIN_FLAG,
                              first_norm() if embed is not None and first_norm is not None else None,
                              staged=staged_in)
        attn = AttentionMetadata(
            page_size=r.page_size,
            qo_indptr=io.qo_indptr[:bs + 1],
            seq_lens=d.seq_lens,
            prefix_lens=d.prefix_lens,
            page_table=d.page_rows,
            out_cache_loc=d.out_cache_loc,
            seq_lens_host=[bound] * bs,  # static upper bound: the split count follows it
            prefix_lens_host=[bound - 1] * bs,
            max_seq_len=bound,
            max_extend_len=1,
        )
        fb = ForwardBatch(d.input_ids, d.positions, attn, r.kv_pool, self.backend,
                          logits_indices=io.logits_indices[:bs], is_decode=True,
                          input_embeds=d.embeds, input_normed=d.normed, kernels=r.kernels,
                          state_pool=r.state_pool,
                          state_slots=d.state_slots if r.state_pool is not None else None,
                          keep_hidden=self.with_mtp)
        logits = r.model(fb)  # [bs, V]
        # last_tokens: the next step's device-side inputs. The greedy kernel, where
        # it runs, also stores the tokens into the pinned row and toggles the word.
        staged_out = io.staged_tokens(bs) if self.in_graph_io else None
        out = r.sampler.sample(logits, d.slots, d.steps, d.min_active, last=r.last_tokens,
                               host_out=staged_out)
        # The penalty counts of a penalized variant's rows (padded rows count into
        # the dummy slot, which never reads them). Steps of other variants hold no
        # row that reads its counts, and admit() resets a row it hands out.
        r.sampler.update(d.slots, out.token_ids)
        if staged_out is not None and not out.on_host:  # the tokens to the host, and the next step's row
            copy_host_words_paired(out.token_ids[:bs], staged_out.pair, staged_out.parity, flip=True)
        if self.with_mtp:
            # After the tokens' store: the host's read waits for the whole graph,
            # but the next step's planning needs nothing from this pass.
            assert r.mtp is not None
            r.mtp.decode_pass(fb, out.token_ids[:bs], d.slots)
        return out

    def capture(self) -> None:
        t0 = time.monotonic()
        r = self.runner
        self._fill_dummy()
        with torch.inference_mode():
            for feats in SAMPLER_VARIANTS:
                with r.sampler.forced_features(feats):  # capture exactly this stage set
                    for bs in sorted(self.sizes, reverse=True):
                        for bound in reversed(self.bounds[bs]):
                            self._capture_one(bs, feats, bound)
                log.info("captured %d decode graphs (%s)", sum(map(len, self.bounds.values())),
                         ", ".join(k for k, on in dataclasses.asdict(feats).items() if on) or "greedy")
        torch.cuda.synchronize()
        self.reset_parity()  # the warm-up runs toggled the word
        log.info("CUDA graphs for batch sizes %s captured in %.1f s", self.sizes, time.monotonic() - t0)

    def reset_parity(self) -> None:
        """Device word and host count back to row 0, stream-ordered: after
        replays the host did not count (capture's warm-ups; a tool that replays
        a graph itself), each of which toggled the word behind its back."""
        self.io.parity.zero_()
        self._flip = 0

    def _capture_one(self, bs: int, feats: SamplerFeatures, bound: int) -> None:
        graph, out = capture_graph(lambda: self._forward(bs, bound), self.pool)
        self.graphs[(bs, feats, bound)] = graph
        self.outputs[(bs, feats, bound)] = out

    def _fill_dummy(self) -> None:
        """Every row a padded one (also both staging rows: the warm-up runs
        before capture copy them in)."""
        pad = torch.tensor([DecodeRow.padding(self.runner.sink_row)] * self.max_bs, dtype=torch.int64)
        self.io.host_rows.copy_(pad.view(1, -1).expand(2, -1))
        self.io.rows.copy_(pad)

    def step_rows(self, batch: ScheduledBatch, out: torch.Tensor | None = None) -> tuple[int, torch.Tensor]:
        """-> (padded batch size, the step's words [pbs * WORDS]: a DecodeRow per
        sequence, then padding rows; in the front of ``out`` where given)."""
        pbs = self._padded(len(batch.reqs))
        return pbs, pack_decode_rows(batch, self.runner.page_size, self.runner.sink_row, pbs, out)

    def graph_for(self, batch: ScheduledBatch, feats: SamplerFeatures) -> torch.cuda.CUDAGraph:
        """The graph a step of ``batch`` with sampler stages ``feats`` replays."""
        pbs = self._padded(len(batch.reqs))
        return self.graphs[(pbs, feats, self._bound(pbs, batch))]

    def replay(self, batch: ScheduledBatch) -> tuple[SampleOutput, torch.Tensor | None]:
        """-> (the graph's static output, the pinned row its tokens land in, or
        None where the caller copies them out)."""
        r = self.runner
        io = self.io
        # This row was last used two steps ago; the engine has read back that
        # step's tokens since, which waited for its graph (or copy).
        side = self._flip
        self._flip ^= 1
        pbs, words = self.step_rows(batch, out=io.host_rows[side])  # packed in place
        if not self.in_graph_io:
            copy_host_words(words, io.rows[:pbs].view(-1))
        feats = sampler_variant(r.sampler.features_of(req.slot for req in batch.reqs))
        out = self._run((pbs, feats, self._bound(pbs, batch)))
        if self.with_mtp:
            assert r.mtp is not None
            r.mtp.note_decode(batch)  # whose MTP outputs the graph stored (host only)
        host = io.host_tokens[side, :len(batch.reqs)] if self.in_graph_io else None
        return out, host

    def _run(self, key: tuple[int, SamplerFeatures, int]) -> SampleOutput:
        """Replay the graph of ``key``; its static output (tests on the CPU run
        ``_forward`` in its place)."""
        self.graphs[key].replay()
        return self.outputs[key]
