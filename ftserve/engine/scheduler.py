"""Continuous batching with chunked prefill, a radix prefix cache and preemption.

Each step is either a prefill step (chunks of waiting or partly prefilled
requests, at most ``max_prefill_length`` new tokens in all) or a decode step
(one token for every generating request). When both kinds of work exist the
two alternate, so a long prompt never stalls running streams for more than one
chunk.

Preemption (KV back to the prefix cache, the request to the front of the
queue): a decode short of pages preempts the youngest running request; a
prefill short of pages preempts younger prefilling requests only, and while it
waits for decoders to free pages nobody new is admitted. So the oldest request
can always go on and the pool never wedges.

All state here is host state; the scheduler never reads the device. It plans
every sequence length, page and chunk, which the runner turns into device
metadata with one copy.

Hybrid models (a ``state_pool``): each admitted request also holds a state
slot (so the pool's running slots cap running requests with the sampler's);
with the prefix cache on, prefill chunks end on checkpoint boundaries and save
the state there, and a hit resumes from the deepest checkpoint
(engine/state_checkpoints.py); a preempted request resumes the same way, so
its outputs stay those of a full recompute.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ftserve.engine import prefix_sharing as sharing
from ftserve.engine import state_checkpoints
from ftserve.engine.messages import TokenLogprob
from ftserve.engine.request import Req, ReqState
from ftserve.engine.spec.accept import kept_tokens
from ftserve.kvcache.allocator import PageAllocator
from ftserve.kvcache.radix import RadixCache

if TYPE_CHECKING:
    from ftserve.engine.sampling_params import SamplingParams
    from ftserve.engine.spec.speculator import Speculator
    from ftserve.kvcache.host_tier import HostKVTier
    from ftserve.kvcache.state_pool import StatePool

log = logging.getLogger(__name__)

# A prefill step computes prompt logprobs for at most this many tokens, all its
# requests together: they hold [tokens, vocab] fp32 logits (155 MB at Qwen3's
# 151,936 tokens).
PROMPT_LOGPROBS_CHUNK = 256


@dataclass
class ScheduledBatch:
    reqs: list[Req]
    is_decode: bool
    new_tokens: list[list[int]]  # tokens fed this step, per request (-1: from the device)
    prefix_lens: list[int]  # KV length before this step, per request
    samples: list[bool]  # whether the request samples a token after this step
    # Decode only: the row of the previous (still in-flight) step's sampled
    # tokens that holds this request's input token, or -1 when the host has it.
    src_rows: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)  # index of the output token each row samples
    # A verify step (speculative decoding): each request's draft, fed after its
    # last token (new_tokens = [last] + draft), every position sampled at step
    # steps[i] + m; empty lists for plain rows. Empty: no drafts in this step.
    # Drafts made on the device (--speculative mtp) are -1 placeholders here,
    # in drafts and new_tokens alike, until the runner reads them back.
    drafts: list[list[int]] = field(default_factory=list)
    step_id: int = -1  # set by Scheduler.schedule
    drafting: bool = False  # a decode step planned with drafting allowed (spec/gate.py)
    # Hybrid models, (source, destination) state-pool slots: prefix-cache
    # checkpoints copied into requests' slots before the forward, and requests'
    # states saved as checkpoints after it.
    state_loads: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    # ... and checkpoints inside a request's chunk, saved by the linear layers as
    # they pass (engine/state_checkpoints.py): per request, (tokens into its
    # chunk, checkpoint slot), ascending; empty lists for none.
    state_inner: list[list[tuple[int, int]]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.new_tokens)

    @property
    def verifies(self) -> bool:
        """Some request feeds a draft: the step samples several rows for it."""
        return any(self.drafts)


@dataclass
class SchedulerCounters:
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    prefix_hit_tokens_total: int = 0
    preemptions_total: int = 0
    finished_total: int = 0
    published_prompt_pages_total: int = 0  # prompt pages given to the prefix cache at prefill end
    state_checkpoints_saved_total: int = 0  # hybrid models: checkpoints a prefill chunk saved
    state_checkpoints_skipped_total: int = 0  # ... and boundaries with no slot to save into


class Scheduler:
    def __init__(
        self,
        *,
        page_size: int,
        num_pages: int,
        max_running: int,
        max_prefill_length: int,
        max_model_len: int,
        eos_token_ids: list[int],
        enable_prefix_cache: bool = True,
        host_tier: HostKVTier | None = None,
        state_pool: StatePool | None = None,
        max_checkpoints: int = 0,
        checkpoint_pages: int = 256,
        speculator: Speculator | None = None,
    ) -> None:
        self.page_size = page_size
        # Speculative decoding (--speculative): drafts for decode steps; None: off.
        self.spec = speculator
        self.max_running = max_running
        self.max_prefill_length = max_prefill_length
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.enable_prefix_cache = enable_prefix_cache
        self.allocator = PageAllocator(num_pages)
        # With a host tier, prefix-cache eviction moves pages to host memory and
        # admission brings them back; the moves are planned here and performed
        # by the runner (HostKVTier.flush) before the step that needs them.
        self.host_tier = host_tier
        # Hybrid models: one state slot per running request, the rest the prefix
        # cache's checkpoints (none without a prefix cache).
        self.state_pool = state_pool
        if state_pool is not None and state_pool.num_slots < max_running + max_checkpoints:
            raise ValueError(f"a state pool of {state_pool.num_slots} slots cannot hold {max_running} "
                             f"running requests and {max_checkpoints} checkpoints")
        stateful = state_pool is not None and enable_prefix_cache
        if stateful and max_checkpoints < 1:
            raise ValueError("a hybrid model's prefix cache needs at least one checkpoint slot")
        self.checkpoint_every = checkpoint_pages * page_size if stateful else 0
        self.radix = RadixCache(page_size, self.allocator, host=host_tier,
                                states=state_pool if stateful else None, max_states=max_checkpoints)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # admitted: PREFILL or DECODE, in admission order
        self.by_id: dict[str, Req] = {}
        self.free_slots: list[int] = list(range(max_running - 1, -1, -1))
        self.counters = SchedulerCounters()
        self._last_was_prefill = False
        self._step_id = 0
        self.finished_reqs: list[Req] = []  # finished since the last drain

    # ----- intake -------------------------------------------------------
    def validate(self, req: Req) -> str | None:
        """Why a request can never run, or None."""
        n = len(req.prompt_ids)
        if n == 0:
            return "the prompt is empty"
        if n + 1 > self.max_model_len:
            return (f"this model's maximum context length is {self.max_model_len} tokens; "
                    f"the prompt has {n} tokens and needs room for at least one output token")
        return None

    def add(self, req: Req) -> None:
        self.by_id[req.request_id] = req
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ----- planning ------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        """Plan the next step. A previous step may still be in flight (overlap
        scheduling): its requests decode from their device-side tokens and are
        not prefilled again until it is committed."""
        batch = self._plan()
        if batch is not None:
            self._step_id += 1
            batch.step_id = self._step_id
            j = 0
            for req, s in zip(batch.reqs, batch.samples):
                req.inflight_step = batch.step_id
                req.inflight_row = j if s else -1
                j += s
        return batch

    def _plan(self) -> ScheduledBatch | None:
        prefilling = [r for r in self.running if r.state is ReqState.PREFILL and not r.inflight]
        decoding = [r for r in self.running if r.state is ReqState.DECODE]
        want_prefill = bool(prefilling or (self.waiting and self.free_slots))
        if decoding and (not want_prefill or self._last_was_prefill):
            batch = self._schedule_decode()
            if batch is not None:
                self._last_was_prefill = False
                return batch
        batch = self._schedule_prefill()
        if batch is not None:
            self._last_was_prefill = True
            return batch
        if decoding:
            self._last_was_prefill = False
            return self._schedule_decode()
        return None

    def _schedule_prefill(self) -> ScheduledBatch | None:
        budget = self.max_prefill_length
        logit_rows = PROMPT_LOGPROBS_CHUNK  # the step's prompt-logprob tokens, all requests together
        chunks: list[tuple[Req, int]] = []  # (request, new tokens this step)
        saves: list[tuple[int, int]] = []  # hybrid models: (request slot, checkpoint slot)
        inner: list[list[tuple[int, int]]] = []  # hybrid models: each chunk's checkpoints inside it
        stalled = False

        def room(req: Req) -> int:
            n = min(req.remaining_prefill, budget, logit_rows if req.wants_prompt_logprobs else budget)
            cuts = self._checkpoint_cuts(req)
            if len(cuts) > state_checkpoints.MAX_INNER and req.computed_len + n > cuts[state_checkpoints.MAX_INNER]:
                # MAX_INNER checkpoints inside the chunk at most: it ends on the next one
                n = cuts[state_checkpoints.MAX_INNER] - req.computed_len
            return n

        def take(req: Req, n: int) -> None:
            nonlocal budget, logit_rows
            chunks.append((req, n))
            budget -= n
            logit_rows -= n if req.wants_prompt_logprobs else 0
            self._plan_checkpoints(req, req.computed_len + n, saves, inner)

        for req in [r for r in self.running if r.state is ReqState.PREFILL and not r.inflight]:
            if budget <= 0:
                break
            if req.state is not ReqState.PREFILL:
                continue  # preempted just now for an older one
            n = room(req)
            if n == 0:
                continue  # this step's prompt-logprob rows are taken: the next step
            if not self._reserve_prefill(req, req.computed_len + n):
                # The rest are held by decoders, which free them as they finish or
                # preempt. Admit nobody behind it: a newcomer with a smaller first
                # chunk would take the pages this request waits for.
                stalled = True
                break
            take(req, n)
        while not stalled and budget > 0 and self.waiting and self.free_slots:
            req = self.waiting[0]
            if req.inflight:
                break  # preempted while its last step is in flight: wait for the commit
            if req.wants_prompt_logprobs and logit_rows == 0:
                break  # this step's prompt-logprob rows are taken: admitted next step
            if not req.wants_prompt_logprobs and self._prefill_leader(req) is not None:
                break  # its prompt's next pages are being prefilled: wait for them
            self._admit(req)
            n = room(req)
            if not self._reserve(req, req.computed_len + n):
                # Admission matched pages but the chunk does not fit yet: undo.
                self._release(req, keep_kv=True)
                req.state = ReqState.WAITING
                break
            self.waiting.popleft()
            self._count_admission(req)
            take(req, n)
        if not chunks:
            return None
        reqs = [req for req, _ in chunks]
        loads = [(req.state_restore, req.state_slot) for req in reqs if req.state_restore >= 0]
        for req in reqs:
            req.state_restore = -1
        return ScheduledBatch(
            reqs, False,
            new_tokens=[req.tokens[req.computed_len:req.computed_len + n] for req, n in chunks],
            prefix_lens=[req.computed_len for req in reqs],
            samples=[req.computed_len + n == len(req.tokens) for req, n in chunks],
            steps=[req.num_outputs for req in reqs], state_loads=loads, state_saves=saves,
            state_inner=inner if any(inner) else [])

    def _schedule_decode(self) -> ScheduledBatch | None:
        reqs: list[Req] = []
        for req in list(self.running):
            if req.state is not ReqState.DECODE:
                continue  # prefilling, or preempted by this loop (WAITING, out of running)
            if req.inflight and req.inflight_row < 0:
                continue  # defensive: an in-flight step that samples nothing
            if req.num_inflight_tokens and self._last_in_flight(req):
                continue  # its in-flight step samples its last token: nothing follows it
            while not self._reserve(req, req.computed_len + req.num_inflight_tokens + 1):
                victim = self._pick_victim(exclude=req)
                if victim is None:
                    # Cannot happen when max_model_len fits the pool; fail loudly.
                    raise RuntimeError("KV pool exhausted by a single request")
                self._preempt(victim)
                if victim in reqs:
                    reqs.remove(victim)
            reqs.append(req)
        if not reqs:
            return None
        # Speculation's drafts: for requests whose last token the host holds, and
        # only where the pool has the draft's pages without preempting anyone
        # (else plain decoding).
        spec = self.spec
        drafting = spec.begin_step(len(reqs)) if spec is not None else False
        new_tokens, prefix_lens, src_rows, steps = [], [], [], []
        drafts: list[list[int]] = []
        for r in reqs:
            n_out = len(r.output_ids)
            if r.num_inflight_tokens:  # its input token is the in-flight step's output
                new_tokens.append([-1])
                prefix_lens.append(r.computed_len + 1)
                src_rows.append(r.inflight_row)
                steps.append(n_out + 1)
                drafts.append([])
                continue
            d = spec.propose(r) if spec is not None else []
            if d and not self._reserve(r, r.computed_len + 1 + len(d)):
                d = []
            drafts.append(d)
            new_tokens.append([r.tokens[-1], *d])
            prefix_lens.append(r.computed_len)
            src_rows.append(-1)
            steps.append(n_out)
        verify = any(drafts)
        return ScheduledBatch(reqs, not verify, new_tokens, prefix_lens, [True] * len(reqs),
                              src_rows=src_rows, steps=steps, drafts=drafts if verify else [],
                              drafting=drafting)

    # ----- pages ---------------------------------------------------------
    def _reserve(self, req: Req, num_tokens: int) -> bool:
        """Make req.pages cover num_tokens, evicting the prefix cache if needed."""
        need = -(-num_tokens // self.page_size) - len(req.pages)
        if need <= 0:
            return True
        if self.allocator.num_free < need:
            self.radix.evict(need - self.allocator.num_free)
        pages = self.allocator.alloc(need)
        if pages is None:
            return False
        req.pages.extend(pages)
        return True

    def _reserve_prefill(self, req: Req, num_tokens: int) -> bool:
        """_reserve for a running prefill, preempting younger prefilling requests
        while the pool is short. Without that, two partly prefilled requests (one
        admitted while the other's chunk was in flight) can hold the whole pool
        with no decoder left to preempt either: no step could be planned again.
        The oldest prefilling request can thus always go on once no decoder
        holds pages (its whole context fits the pool: max_model_len)."""
        while not self._reserve(req, num_tokens):
            younger = self.running[self.running.index(req) + 1:]
            victim = next((r for r in reversed(younger) if r.state is ReqState.PREFILL), None)
            if victim is None:
                return False
            self._preempt(victim)
        return True

    def _admit(self, req: Req) -> None:
        """Take a sampler slot and match the prefix cache (the caller checked a
        slot is free)."""
        if self.enable_prefix_cache and not req.wants_prompt_logprobs:
            # Keep at least one token to compute: its logits give the next token.
            # (Prompt logprobs need the logits of every prompt token: no hit.)
            match = self.radix.match_prefix(req.tokens[:len(req.tokens) - 1])
            # Host-tier hit: device pages are allocated now and the load runs
            # before this step's forward; those tokens count as cached.
            match = self.radix.restore(match)
            node, n_tokens = match.node, match.num_tokens
            if self.radix.stateful:
                # A hybrid resumes at the deepest checkpoint it matched, from a copy
                # of that state (before its first chunk's forward).
                assert match.state_node is not None
                node, n_tokens = match.state_node, match.state_tokens
                req.state_restore = match.state_slot if n_tokens else -1
            n_pages = n_tokens // self.page_size
            if self.spec is not None and self.spec.device_drafts and n_pages and not self.radix.stateful:
                # MTP drafts: a page's last MTP entry was computed with the token
                # after it, which the match does not cover; recompute that page.
                # (A hybrid cannot: it resumes exactly at its checkpoint. That entry
                # then pairs with the cached token after the checkpoint, which is
                # the request's own unless it parts from the cache right there: its
                # drafts attend to one stale entry, its outputs are verified as ever.)
                n_pages -= 1
            self.radix.lock(node)
            req.tree_node = node
            req.pages = list(match.pages[:n_pages])
            req.num_tree_pages = n_pages
            req.computed_len = n_pages * self.page_size
        else:
            req.pages, req.num_tree_pages, req.computed_len = [], 0, 0
        req.slot = self.free_slots.pop()
        if self.state_pool is not None:
            req.state_slot = self.state_pool.alloc()
        req.admissions += 1
        req.state = ReqState.PREFILL
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        self.running.append(req)

    def _count_admission(self, req: Req) -> None:
        """Prompt and prefix-hit counters, once per request: at its first
        admission that got pages (not an undone one, not a resume)."""
        if req.num_preemptions == 0 and not req.counted:
            req.counted = True
            req.cached_len = req.computed_len
            self.counters.prefix_hit_tokens_total += req.cached_len
            self.counters.prompt_tokens_total += req.prompt_len

    def _release(self, req: Req, keep_kv: bool) -> None:
        """Give back the request's slot and pages; its computed KV goes to the
        prefix cache when keep_kv (finish, preemption, abort).

        A step still in flight may write KV for this request after this: only at
        positions >= computed_len, which are never in the full pages handed to
        the tree, and before (in stream order) any later owner of a freed page
        writes it. Its sampled token is dropped at commit."""
        if req in self.running:
            self.running.remove(req)
        if req.slot >= 0:
            self.free_slots.append(req.slot)
            req.slot = -1
        if req.state_slot >= 0:
            # A step still in flight may write this slot: before (in stream order)
            # anything a later owner runs.
            assert self.state_pool is not None
            self.state_pool.free(req.state_slot)
            req.state_slot, req.state_restore = -1, -1
        n_full = 0
        if keep_kv and self.enable_prefix_cache and req.pages:
            n_full = min(req.computed_len // self.page_size, len(req.pages))
            states: list[tuple[int, int]] = []
            if self.radix.stateful:
                n_full, states = self._checkpointed_extent(req, n_full)
            if n_full > 0:
                self.radix.insert(req.tokens[:n_full * self.page_size], req.pages[:n_full], states)
        else:
            n_full = req.num_tree_pages  # tree pages stay in the tree
        for _, slot in req.checkpoints:
            self.radix.free_state(slot)
        req.checkpoints = []
        rest = req.pages[max(n_full, req.num_tree_pages):]
        if rest:
            self.allocator.free(rest)
        if req.tree_node is not None:
            self.radix.unlock(req.tree_node)
            req.tree_node = None
        req.pages, req.num_tree_pages, req.computed_len = [], 0, 0

    def _checkpointed_extent(self, req: Req, n_full: int) -> tuple[int, list[tuple[int, int]]]:
        """Of a hybrid request's first n_full computed pages, how many the prefix
        cache can use (up to its deepest checkpoint, or its match), and the
        checkpoints that go with them (taken off ``req.checkpoints``)."""
        ps = self.page_size
        give = [(n, slot) for n, slot in req.checkpoints if n <= n_full * ps]
        req.checkpoints = [(n, slot) for n, slot in req.checkpoints if n > n_full * ps]
        end = max([n for n, _ in give] + [req.num_tree_pages * ps])
        return end // ps, give

    def _checkpoint_cuts(self, req: Req) -> list[int]:
        """Hybrid models with a prefix cache: the lengths past req's computed ones at
        which it saves a state checkpoint, ascending (engine/state_checkpoints.py)."""
        if not self.checkpoint_every:
            return []
        return state_checkpoints.boundaries_ahead(req, self.page_size, self.checkpoint_every)

    def _plan_checkpoints(self, req: Req, end: int, saves: list[tuple[int, int]],
                          inner: list[list[tuple[int, int]]]) -> None:
        """A slot for each checkpoint boundary req's chunk reaches: one it ends on is
        saved after the forward (``saves``), ones inside it by the linear layers as
        they pass (``inner``, tokens into the chunk). When every checkpoint is locked,
        req's own latest (not yet in the prefix cache) moves to the deeper boundary:
        a long prefill past the cap keeps its early checkpoints and its deepest, the
        one its prompt ends on (the next turn's resume point); with none of its own,
        skipped."""
        start = req.computed_len
        mine: list[tuple[int, int]] = []
        for cut in self._checkpoint_cuts(req):
            if cut > end:
                break
            slot = self.radix.alloc_state()
            if slot is None and req.checkpoints:
                # A save into it that a step still runs comes first in stream order;
                # one of this chunk's own is not made at all.
                _, slot = req.checkpoints.pop()
                mine = [(off, s) for off, s in mine if s != slot]
            if slot is None:
                self.counters.state_checkpoints_skipped_total += 1
                continue
            if cut == end:
                saves.append((req.state_slot, slot))
            else:
                mine.append((cut - start, slot))
            req.checkpoints.append((cut, slot))
            self.counters.state_checkpoints_saved_total += 1
        inner.append(mine)

    def _prefill_leader(self, req: Req) -> Req | None:
        if not self.enable_prefix_cache:
            return None
        return sharing.prefill_leader(self.radix, self.running, req, self.page_size, self.checkpoint_every)

    def _publish_prompt(self, req: Req) -> None:
        if self.enable_prefix_cache:
            self.counters.published_prompt_pages_total += sharing.publish_prompt(
                self.radix, req, self.page_size)

    def _pick_victim(self, exclude: Req) -> Req | None:
        for req in reversed(self.running):  # youngest first
            if req is not exclude:
                return req
        return None

    def _preempt(self, req: Req) -> None:
        log.info("preempting %s (%d tokens) to free KV pages", req.request_id, len(req.tokens))
        self._release(req, keep_kv=True)
        req.state = ReqState.WAITING
        req.num_preemptions += 1
        self.counters.preemptions_total += 1
        self.waiting.appendleft(req)

    # ----- results -------------------------------------------------------
    def commit(
        self, batch: ScheduledBatch, token_ids: list[int],
        logprobs: list[TokenLogprob | None] | None = None,
    ) -> None:
        """Apply one step's results (token_ids[i] for batch.reqs[i] where it samples)."""
        now = time.monotonic()
        self._landed(batch)
        # Who was running when the results landed, as a set: a list scan per
        # request would make each commit quadratic in the batch. (The loop
        # finishes only the request it is at, so the set stays true for the rest.)
        running = set(self.running)
        for i, req in enumerate(batch.reqs):
            if req.state is ReqState.FINISHED or req not in running:
                continue  # aborted, finished or preempted while the step ran
            req.computed_len = batch.prefix_lens[i] + len(batch.new_tokens[i])
            if batch.samples[i]:
                self._append(req, token_ids[i], logprobs[i] if logprobs is not None else None, now)

    def commit_verified(
        self, batch: ScheduledBatch, sampled: list[list[int]],
        logprobs: list[list[TokenLogprob | None]] | None = None,
    ) -> None:
        """Apply a verify step's results: sampled[i] holds the tokens sampled at each
        of request i's positions (len(drafts[i]) + 1). It keeps the sampled tokens
        up to the first that differs from its draft (spec/accept.py), one at a time
        with the stop checks of plain steps, and the KV of the draft tokens before
        it; the KV written for the rest is stale, and the pages that hold only
        stale KV go back to the pool (_trim_pages). The prefix cache sees none of
        it: only computed_len's full pages ever enter it."""
        assert self.spec is not None
        now = time.monotonic()
        self._landed(batch)
        running = set(self.running)  # as in commit
        for i, req in enumerate(batch.reqs):
            if req.state is ReqState.FINISHED or req not in running:
                continue
            draft = batch.drafts[i]
            kept = kept_tokens(draft, sampled[i])
            lps = logprobs[i] if logprobs is not None else None
            if req.grammar is None and req.first_token_time is not None:
                self._append_kept(req, kept, lps, batch.prefix_lens[i])
            else:
                for j, tok in enumerate(kept):
                    # The KV of the inputs up to this token's position is valid: the
                    # last token, then draft tokens equal to the sampled ones.
                    req.computed_len = batch.prefix_lens[i] + 1 + j
                    self._append(req, tok, lps[j] if lps is not None else None, now)
                    if req.state is ReqState.FINISHED:
                        break
            if draft:
                self.spec.record(req, len(draft), len(kept) - 1)
                if req.state is not ReqState.FINISHED:
                    self._trim_pages(req)

    def plan_ahead(self, batch: ScheduledBatch) -> None:
        """Host work for the step after a verify step, done while the device runs
        it (engine._step): each draft's n-grams indexed as if kept
        (Speculator.index_ahead), and the pages the request's next verify needs
        at most (all of this draft kept, then a full draft), taken only while the
        pool has them free with a page to spare per running request (no eviction,
        no preemption for a guess). _trim_pages keeps them for a request that
        drafts on; the runner mirrors them before the read-back."""
        spec = self.spec
        if spec is None or spec.device_drafts:  # MTP: placeholders, and no n-gram index
            return
        ps, alloc = self.page_size, self.allocator
        spare = len(self.running)
        for req, draft, pre in zip(batch.reqs, batch.drafts, batch.prefix_lens):
            if not draft:
                continue
            spec.index_ahead(req, draft)
            top = min(pre + len(draft) + 2 + spec.num_tokens, self.max_model_len)
            need = -(-top // ps) - len(req.pages)
            if need > 0 and alloc.num_free - need >= spare:
                pages = alloc.alloc(need)
                if pages is not None:
                    req.pages.extend(pages)

    def wants_tokens_now(self, batch: ScheduledBatch) -> bool:
        """The step must be read back before the next is planned: a request in it
        will look for a draft next, from its tokens on the host."""
        spec = self.spec
        rows = len(batch.reqs)
        return spec is not None and any(
            s and spec.drafting(r, rows) for r, s in zip(batch.reqs, batch.samples))

    def _landed(self, batch: ScheduledBatch) -> None:
        for req in batch.reqs:
            if req.inflight_step == batch.step_id:  # not re-planned since
                req.inflight_step, req.inflight_row = -1, -1

    def _append(self, req: Req, tok: int, logprob: TokenLogprob | None, now: float) -> None:
        """One sampled token: output, counters, the first token's prompt publishing,
        stop and grammar checks (finishing the request)."""
        req.tokens.append(tok)
        req.output_ids.append(tok)
        req.pending_ids.append(tok)
        if logprob is not None:
            req.pending_logprobs.append(logprob)
        self.counters.generation_tokens_total += 1
        if req.first_token_time is None:
            req.first_token_time = now
            self._publish_prompt(req)
        req.state = ReqState.DECODE
        req.check()
        reason = self._stop_reason(req, tok)
        if req.grammar is not None and reason is None:
            reason = self._grammar_step(req, tok)
        if reason is not None:
            self.finish(req, reason)

    def _append_kept(self, req: Req, kept: list[int], lps: list[TokenLogprob | None] | None,
                     prefix_len: int) -> None:
        """A verify step's kept tokens at once, as ``_append`` one at a time would
        leave them (for a request past its first token, without a grammar): up to
        and including the first that stops it, the KV valid through that one's
        input (its last token, then draft tokens equal to the sampled ones)."""
        n0, len0 = req.num_outputs, len(req.tokens)
        end, reason = len(kept), None
        p = req.params
        if (n0 + end >= p.max_tokens or len0 + end >= self.max_model_len
                or (p.stop_token_ids and not set(p.stop_token_ids).isdisjoint(kept))
                or (not p.ignore_eos and not self.eos_token_ids.isdisjoint(kept))):
            # Some kept token may stop it: find the first that does.
            for j, tok in enumerate(kept):
                reason = self._stop_reason_at(p, tok, n0 + j + 1, len0 + j + 1)
                if reason is not None:
                    end = j + 1
                    break
        toks = kept[:end] if end < len(kept) else kept
        req.computed_len = prefix_len + end
        req.tokens.extend(toks)
        req.output_ids.extend(toks)
        req.pending_ids.extend(toks)
        if lps is not None:
            req.pending_logprobs.extend(lp for lp in lps[:end] if lp is not None)
        self.counters.generation_tokens_total += end
        req.state = ReqState.DECODE
        req.check()
        if reason is not None:
            self.finish(req, reason)

    def _trim_pages(self, req: Req) -> None:
        """Free the private pages past what the next step needs (a plain step's,
        or a full draft's if the request drafts on: they hold only rejected draft
        KV) and tell the runner to re-mirror from there.

            pages   [ tree ... | private .......... | x x ]   x: stale KV only
                                      computed_len ^  ^ keep = pages for computed_len + 1
                                                          (+ num_tokens drafting on)
        """
        end = req.computed_len + 1
        spec = self.spec
        if spec is not None and not spec.device_drafts and spec.drafting(req):
            end += spec.num_tokens  # its next verify's (plan_ahead may have taken them)
        keep = max(-(-end // self.page_size), req.num_tree_pages)
        if len(req.pages) > keep:
            self.allocator.free(req.pages[keep:])
            del req.pages[keep:]
            prev = req.pages_trimmed_to
            req.pages_trimmed_to = keep if prev is None else min(prev, keep)

    def _grammar_step(self, req: Req, tok: int) -> str | None:
        """Advance a constrained request's matcher: "stop" once its grammar is complete.
        The token was sampled under the grammar's own mask (which no other stage can
        empty: min_tokens yields to it, and the noise is finite), so a rejection
        means the mask did not hold, a server bug: the request ends with an internal
        error rather than invalid output. The matcher's state (tokens, parser,
        grammar) goes to the log with the request id, never to the client."""
        assert req.grammar is not None
        if not req.grammar.accept(tok):
            log.error("request %s: sampled token %d (output token %d) is outside its output "
                      "grammar; the request ends with an internal error. Matcher: %s",
                      req.request_id, tok, req.num_outputs, req.grammar.error)
            req.error = "internal error: the sampled output broke the request's output constraint"
            req.internal_error = True
            return "error"
        return "stop" if req.grammar.done else None

    def _last_in_flight(self, req: Req) -> bool:
        """Whether the token req's in-flight step samples ends it by count
        (max_tokens, the context limit): the overlap planner then leaves it out of
        the next step, which would only compute a token that is thrown away."""
        return self._length_reached(req.params, req.num_outputs + 1, len(req.tokens) + 1)

    def _length_reached(self, p: SamplingParams, n: int, length: int) -> bool:
        """Whether a request ends by count at its n-th output token, ``length`` in all."""
        return n >= p.max_tokens or length >= self.max_model_len

    def _stop_reason(self, req: Req, tok: int) -> str | None:
        return self._stop_reason_at(req.params, tok, req.num_outputs, len(req.tokens))

    def _stop_reason_at(self, p: SamplingParams, tok: int, n: int, length: int) -> str | None:
        """Why a request stops after ``tok``, its n-th output token, at ``length``
        tokens in all (None: it goes on)."""
        if n >= p.min_tokens:
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
                return "stop"
        if self._length_reached(p, n, length):
            return "length"
        return None

    def finish(self, req: Req, reason: str) -> None:
        if req.state is ReqState.FINISHED:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        self._release(req, keep_kv=True)
        req.state = ReqState.FINISHED
        req.finish_reason = reason
        req.finished_time = time.monotonic()
        self.counters.finished_total += 1
        self.by_id.pop(req.request_id, None)
        self.finished_reqs.append(req)

    def abort(self, request_id: str) -> Req | None:
        req = self.by_id.get(request_id)
        if req is None:
            return None
        self.finish(req, "abort")
        return req

    def reset_prefix_cache(self) -> bool:
        return self.radix.reset()

    # ----- invariants ----------------------------------------------------
    def live_private_pages(self) -> list[int]:
        return [p for r in self.running for p in r.private_pages]

    def live_state_slots(self) -> list[int]:
        """State slots held by running requests: their own and checkpoints not yet
        in the prefix cache (hybrid models)."""
        return ([r.state_slot for r in self.running if r.state_slot >= 0]
                + [slot for r in self.running for _, slot in r.checkpoints])

    def check_integrity(self) -> None:
        for r in self.running:
            r.check()
            assert (r.state_slot >= 0) == (self.state_pool is not None), (r.request_id, r.state_slot)
        assert all(r.state_slot < 0 and not r.checkpoints for r in self.waiting)
        self.radix.check_integrity(self.live_private_pages(), self.live_state_slots())
        slots = [r.slot for r in self.running]
        assert len(set(slots)) == len(slots) and -1 not in slots, slots
        assert len(slots) + len(self.free_slots) == self.max_running

    @property
    def num_pages_used(self) -> int:
        """Pages held by live requests (private ones; shared prefix pages count as cached)."""
        return sum(len(r.private_pages) for r in self.running)
