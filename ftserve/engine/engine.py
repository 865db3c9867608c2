"""The engine thread: owns the device, runs the scheduler loop.

    event loop                      engine thread
    submit(GenerateRequest) --->  inbox (queue.Queue)
    abort(request_id)       --->      |
                                 schedule -> runner.step -> commit
    on_outputs(list)  <--- one call_soon_threadsafe per step

Overlap scheduling (step N+1 launched before step N's tokens are read) holds for
every batch without a constrained request (response_format); a step that samples
one is read back at once, since the next step's token mask needs its token, and
so is a speculative verify step (the next drafts continue the tokens it keeps).
After such a step the device idles until the next is launched, so its outputs
and stats are handed over just after that launch, while the device runs it:

    plain:    launch N+1 | read N, commit N | emit N             (the device runs N+1)
    at once:  launch N | plan ahead | read N, commit N, schedule N+1, launch N+1 | emit N
                                      '-- the device idles: nothing else here --'

where "plan ahead" (a verify step) is the part of step N+1's planning that does
not need step N's tokens (Scheduler.plan_ahead, the page mirror).

An exception in the engine thread fails every live request with
finish_reason "error" and marks the engine unhealthy; it never hangs silently.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ftserve.engine import prompt_logprobs as prompt_lp
from ftserve.engine.messages import GenerateRequest, RequestOutput
from ftserve.engine.request import Req
from ftserve.engine.runner import Launched, ModelRunner
from ftserve.engine.scheduler import Scheduler
from ftserve.engine.spec.gate import bucket_name

log = logging.getLogger(__name__)

OutputCallback = Callable[[list[RequestOutput]], None]


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_pages_total: int  # usable pages (the dummy page excluded)
    kv_pages_used: int  # held privately by live requests
    kv_pages_cached: int  # held by the prefix cache (some shared with live requests)
    kv_pages_free: int
    prefix_hit_tokens_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    preemptions_total: int
    finished_total: int
    kv_host_pages_total: int = 0  # usable host-tier pages (0: no host tier)
    kv_host_pages_cached: int = 0  # host pages holding evicted prefix-cache KV
    kv_host_hit_tokens_total: int = 0  # prompt tokens brought back from the host tier
    prefix_published_pages_total: int = 0  # prompt pages shared at the end of a prefill
    # Hybrid models: recurrent-state slots (running requests + checkpoints) and the
    # prefix cache's state checkpoints.
    state_slots_total: int = 0
    state_checkpoints_cached: int = 0
    state_checkpoints_host_cached: int = 0
    state_checkpoints_saved_total: int = 0
    state_checkpoints_skipped_total: int = 0  # boundaries with no slot to save into
    # Speculative decoding (all 0 when off): drafts verified, their tokens, the
    # tokens kept, and spec_accept_lengths[a] = verifies that kept a draft tokens.
    spec_verifies_total: int = 0
    spec_proposed_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    spec_accept_lengths: tuple[int, ...] = ()
    # The gate (spec/gate.py): decode steps it held speculation off in, and its
    # measured tokens/s per batch bucket with and without speculation.
    spec_gated_steps_total: int = 0
    spec_gate_rates: tuple[tuple[str, float | None, float | None], ...] = ()

    @property
    def kv_usage(self) -> float:
        return self.kv_pages_used / max(1, self.kv_pages_total)


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    fn: Callable[[], Any]
    done: threading.Event
    result: list[Any]


_STOP = object()
STALL_LOG_S = 5.0  # no plannable step for this long: logged as a stuck scheduler
STALL_NAP_S = 0.0005  # the loop's nap per unplannable iteration (no 100% spin)


class EngineCore:
    """Scheduler + runner + the thread that drives them."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, status_log_interval: float = 0.0,
                 check_integrity: bool = False, overlap: bool = True) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.overlap = overlap
        self._inflight: Launched | None = None
        # The requests of a step committed at once (nothing left in flight), whose
        # outputs and stats wait for the next launch (module docstring); None: none.
        self._unreported: list[Req] | None = None
        self.status_log_interval = status_log_interval
        self.check_integrity = check_integrity
        self.healthy = True
        self.error: str | None = None
        self._inbox: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_outputs: OutputCallback | None = None
        self._stats = self._make_stats()
        self._last_status = time.monotonic()
        self._last_counts = (0, 0)
        # Since when no step could be planned although requests wait or run and none
        # is in flight (None: progress). Briefly normal (a host-tier page move still
        # landing); for long it is a scheduler bug that would hang every client, so
        # it is logged once per stall and the loop naps instead of spinning.
        self._stalled_since: float | None = None
        self._stall_logged = False

    # ----- called from any thread ------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop, on_outputs: OutputCallback) -> None:
        self._loop, self._on_outputs = loop, on_outputs
        self._thread = threading.Thread(target=self._run, name="ftserve-engine", daemon=True)
        self._thread.start()

    def submit(self, req: GenerateRequest) -> None:
        self._inbox.put(req)

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def call(self, fn: Callable[[], Any], timeout: float = 30.0) -> Any:
        """Run fn on the engine thread between steps and return its result."""
        if self._thread is None or not self._thread.is_alive():
            return fn()
        c = _Call(fn, threading.Event(), [])
        self._inbox.put(c)
        if not c.done.wait(timeout):
            raise TimeoutError("the engine thread did not answer")
        if isinstance(c.result[0], BaseException):
            raise c.result[0]
        return c.result[0]

    def stats(self) -> EngineStats:
        return self._stats

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._inbox.put(_STOP)
            self._thread.join(timeout)

    # ----- engine thread -------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                busy = self.busy
                if not busy and self.scheduler.spec is not None and self.scheduler.spec.gate is not None:
                    self.scheduler.spec.gate.idle()
                if not self._drain_inbox(block=not busy):
                    break
                self._step()
        except BaseException as exc:  # noqa: BLE001 - any failure must surface
            log.exception("engine thread failed")
            self.healthy = False
            self.error = f"{type(exc).__name__}: {exc}"
            self._fail_all(self.error)

    @property
    def busy(self) -> bool:
        """Another _step has something to do: plan, commit or report."""
        return self.scheduler.has_work or self._inflight is not None or self._unreported is not None

    def _drain_inbox(self, block: bool) -> bool:
        if not block and not self._inbox.qsize():
            return True  # the common case between steps: no exception raised and caught
        while True:
            try:
                item = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                if block:
                    self._maybe_log_status()
                    self._stats = self._make_stats()
                    continue
                return True
            block = False
            if item is _STOP:
                self._fail_all("the engine is shutting down", reason="abort")
                return False
            if isinstance(item, GenerateRequest):
                self._add(item)
            elif isinstance(item, _Abort):
                req = self.scheduler.abort(item.request_id)
                if req is not None:
                    self._emit(self._collect())
            elif isinstance(item, _Call):
                try:
                    item.result.append(item.fn())
                except BaseException as exc:  # noqa: BLE001 - handed back to the caller
                    item.result.append(exc)
                item.done.set()
                self._stats = self._make_stats()

    def _add(self, msg: GenerateRequest) -> None:
        req = Req.from_message(msg)
        why = self.scheduler.validate(req)
        if why is not None:
            self._emit([RequestOutput(req.request_id, [], finish_reason="error", error=why,
                                      prompt_tokens=req.prompt_len)])
            return
        self.scheduler.add(req)

    def _step(self) -> None:
        """Plan and launch step N+1, then read back and commit step N.

        With overlap the host plans the next step while the device still runs
        the previous one; a step that samples nothing (a non-final prefill
        chunk) is committed at once, since there is nothing to wait for, and so
        is a step that samples a constrained request (see below). An in-flight
        step therefore never holds a constrained request, so one planned while it
        runs knows every constrained request's tokens.
        """
        batch = self.scheduler.schedule()
        launched = self.runner.launch(batch) if batch is not None else None
        if self._unreported is not None:
            # The last step's outputs, now that the device has this one to run.
            unreported, self._unreported = self._unreported, None
            self._report(unreported)
        if self.check_integrity and batch is not None:
            self.runner.check_page_rows(batch.reqs)
        stepped: list[Req] = []
        prev, self._inflight = self._inflight, None
        if batch is None and prev is None and self.scheduler.has_work:
            self._stalled()
        else:
            self._stalled_since, self._stall_logged = None, False
        if prev is not None:
            self._commit(prev)
            stepped += prev.batch.reqs
        if launched is not None:
            # A step that samples a constrained request (response_format) is read back
            # at once instead of overlapping the next: the next step's token mask is
            # computed on the host from this step's token, which the matcher must
            # have seen first (runner._grammar_masks). Unconstrained requests in the
            # same batch lose overlap for this step only.
            # Likewise a step after which some request looks for a speculative draft:
            # the draft continues the request's tokens, so they must be on the host
            # (a verify step always; a plain one whose request leaves back-off).
            if (launched.out is None or not self.overlap or launched.constrained
                    or self.scheduler.wants_tokens_now(launched.batch)):
                if launched.batch.verifies:  # while the device runs it
                    self.scheduler.plan_ahead(launched.batch)
                    self.runner.mirror_pages(launched.batch.reqs)
                self._commit(launched)
                stepped += launched.batch.reqs
            else:
                self._inflight = launched
        if self.check_integrity:
            self.scheduler.check_integrity()
        if launched is not None and self._inflight is None and self.scheduler.has_work:
            # Nothing in flight: the device idles until the next launch, so the
            # outputs go out after it. (With no work left they go now.)
            self._unreported = stepped
        else:
            self._report(stepped)

    def _report(self, stepped: list[Req]) -> None:
        """Hand the step's outputs (and whatever finished since) to the event loop
        and refresh the stats."""
        self._emit(self._collect(stepped))
        self._stats = self._make_stats()
        self._maybe_log_status()

    def _commit(self, launched: Launched) -> None:
        before = self.scheduler.counters.generation_tokens_total
        if launched.batch.verifies:
            sampled, row_lps = self.runner.collect_verified(launched)
            self.scheduler.commit_verified(launched.batch, sampled, row_lps)
        else:
            token_ids, logprobs = self.runner.collect(launched)
            self.scheduler.commit(launched.batch, token_ids, logprobs)
        spec = self.scheduler.spec
        if spec is not None and spec.gate is not None:  # spec/gate.py: tokens/s per mode
            b = launched.batch
            spec.gate.observe(len(b.reqs), b.is_decode or b.verifies,
                              self.scheduler.counters.generation_tokens_total - before, b.drafting)

    def _collect(self, stepped: list[Req] | None = None) -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        seen: set[int] = set()
        for req in list(stepped or []) + self.scheduler.finished_reqs:
            if id(req) in seen:
                continue
            seen.add(id(req))
            if req.finish_reported:
                # A request that finished while a later step was in flight shows
                # up again when that step commits: its last output already went.
                continue
            if not req.pending_ids and not req.finished:
                continue
            req.finish_reported = req.finished
            # The first output carries the prompt logprobs: its prompt is computed.
            prompt_lps = (prompt_lp.collect(req) if req.wants_prompt_logprobs and req.num_outputs > 0
                          else None)
            outs.append(RequestOutput(
                request_id=req.request_id,
                new_token_ids=req.pending_ids,
                finish_reason=req.finish_reason,
                error=req.error,
                internal_error=req.internal_error,
                prompt_tokens=req.prompt_len,
                cached_tokens=req.cached_len,
                completion_tokens=req.num_outputs,
                logprobs=req.pending_logprobs or None,
                prompt_logprobs=prompt_lps,
                first_scheduled_time=req.first_scheduled_time,
                first_token_time=req.first_token_time,
                finished_time=req.finished_time,
            ))
            req.pending_ids, req.pending_logprobs = [], []
        self.scheduler.finished_reqs.clear()
        return outs

    def _emit(self, outs: list[RequestOutput]) -> None:
        if outs and self._loop is not None and self._on_outputs is not None:
            try:
                self._loop.call_soon_threadsafe(self._on_outputs, outs)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _fail_all(self, message: str, reason: str = "error") -> None:
        # Requests that finished normally before the failure, and outputs not yet handed over.
        unreported, self._unreported = self._unreported or [], None
        outs = self._collect(unreported)
        for req in list(self.scheduler.by_id.values()):
            outs.append(RequestOutput(req.request_id, req.pending_ids, finish_reason=reason,
                                      error=message if reason == "error" else None,
                                      prompt_tokens=req.prompt_len,
                                      completion_tokens=req.num_outputs))
        self._inflight = None
        self.scheduler.by_id.clear()
        self.scheduler.waiting.clear()
        self.scheduler.running.clear()
        # Requests still in the inbox never reached the scheduler.
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, GenerateRequest):
                outs.append(RequestOutput(item.request_id, [], finish_reason=reason,
                                          error=message if reason == "error" else None))
            elif isinstance(item, _Call):
                item.result.append(RuntimeError(message))
                item.done.set()
        self._emit(outs)

    def _make_stats(self) -> EngineStats:
        s = self.scheduler
        c = s.counters
        return EngineStats(
            running=len(s.running), waiting=len(s.waiting),
            kv_pages_total=s.allocator.num_total, kv_pages_used=s.num_pages_used,
            kv_pages_cached=s.radix.cached_pages, kv_pages_free=s.allocator.num_free,
            prefix_hit_tokens_total=c.prefix_hit_tokens_total,
            prompt_tokens_total=c.prompt_tokens_total,
            generation_tokens_total=c.generation_tokens_total,
            preemptions_total=c.preemptions_total, finished_total=c.finished_total,
            kv_host_pages_total=s.host_tier.num_total if s.host_tier is not None else 0,
            kv_host_pages_cached=s.radix.host_cached_pages,
            kv_host_hit_tokens_total=s.radix.host_hit_tokens_total,
            prefix_published_pages_total=c.published_prompt_pages_total,
            state_slots_total=s.state_pool.num_slots if s.state_pool is not None else 0,
            state_checkpoints_cached=s.radix.cached_states,
            state_checkpoints_host_cached=s.radix.host_cached_states,
            state_checkpoints_saved_total=c.state_checkpoints_saved_total,
            state_checkpoints_skipped_total=c.state_checkpoints_skipped_total,
            **self._spec_stats(),
        )

    def _spec_stats(self) -> dict[str, Any]:
        if self.scheduler.spec is None:
            return {}
        spec = self.scheduler.spec
        c = spec.counters
        gate = {}
        if spec.gate is not None:
            gate = dict(spec_gated_steps_total=spec.gate.counters.off_steps_total,
                        spec_gate_rates=tuple(
                            (bucket_name(b), st.rate.get(True), st.rate.get(False))
                            for b, st in sorted(spec.gate.buckets.items())))
        return dict(spec_verifies_total=c.verifies_total,
                    spec_proposed_tokens_total=c.proposed_tokens_total,
                    spec_accepted_tokens_total=c.accepted_tokens_total,
                    spec_accept_lengths=tuple(c.accept_lengths), **gate)

    def _stalled(self) -> None:
        """No step could be planned and nothing is in flight, with work queued."""
        now = time.monotonic()
        if self._stalled_since is None:
            self._stalled_since = now
        elif not self._stall_logged and now - self._stalled_since > STALL_LOG_S:
            self._stall_logged = True
            s = self.scheduler
            log.error("no engine step could be planned for %.0f s with %d running and %d waiting "
                      "requests (%d KV pages free, %d held by the prefix cache): the scheduler is "
                      "stuck; those requests will not progress",
                      now - self._stalled_since, len(s.running), len(s.waiting),
                      s.allocator.num_free, s.radix.evictable_pages)
        time.sleep(STALL_NAP_S)

    def _maybe_log_status(self) -> None:
        if self.status_log_interval <= 0:
            return
        now = time.monotonic()
        dt = now - self._last_status
        if dt < self.status_log_interval:
            return
        st = self._stats
        gen, prompt = st.generation_tokens_total, st.prompt_tokens_total
        g0, p0 = self._last_counts
        if gen == g0 and prompt == p0 and st.running == 0 and st.waiting == 0:
            self._last_status = now
            return
        hit = st.prefix_hit_tokens_total / max(1, prompt)
        log.info("status: gen %.1f tok/s, prompt %.1f tok/s, running %d, waiting %d, "
                 "KV %.1f%% used (%d cached pages), prefix hit %.1f%%",
                 (gen - g0) / dt, (prompt - p0) / dt, st.running, st.waiting,
                 100 * st.kv_usage, st.kv_pages_cached, 100 * hit)
        self._last_status, self._last_counts = now, (gen, prompt)


class Engine(EngineCore):
    """EngineCore plus what the server needs to know about the model."""

    def __init__(self, core_args: dict[str, Any], *, model_dir: str, is_demo: bool,
                 max_model_len: int, vocab_size: int, eos_token_ids: list[int],
                 model_config: Any, summary: dict[str, Any]) -> None:
        super().__init__(**core_args)
        self.model_dir = model_dir
        self.is_demo = is_demo
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.model_config = model_config
        self.summary = summary  # start-up facts for logs and /v1/models

    @property
    def max_running_requests(self) -> int:
        """Requests decoding at once (--max-running-requests): the server's door
        admits that many plus its queue."""
        return int(self.scheduler.max_running)

    @classmethod
    def from_config(cls, cfg: Any) -> Engine:
        from ftserve.engine.setup import build_engine

        return build_engine(cfg)

    def reset_prefix_cache(self) -> bool:
        return bool(self.call(self.scheduler.reset_prefix_cache))
