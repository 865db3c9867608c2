"""The engine's step loop on the caller's thread: Scheduler + ModelRunner stepped
one call at a time, with nothing in between. Benchmarks time exactly the steps
they ask for with it (tools/bench/), and tests step through schedules with it.
The server never uses it: EngineCore runs the same steps on its own thread.
"""

from __future__ import annotations

import dataclasses
import random
import time

from ftserve.engine.engine import Engine
from ftserve.engine.request import Req
from ftserve.engine.runner import Launched
from ftserve.engine.sampling_params import SamplingParams
from ftserve.engine.scheduler import ScheduledBatch


class EngineDriver:
    """Drives Scheduler + ModelRunner on this thread, one step per call.

    ``step`` is the engine's overlapped step (EngineCore._step): plan and
    launch step N+1, then read back and commit step N. ``sync_step`` is
    launch + read-back + commit of one step with nothing in flight.
    """

    def __init__(self, engine: Engine, seed: int = 0) -> None:
        self.engine = engine
        self.sched = engine.scheduler
        self.runner = engine.runner
        self.rng = random.Random(seed)
        self.vocab = int(engine.model_config.vocab_size)
        self.inflight: Launched | None = None
        self.host_s = 0.0  # time spent planning, launching and committing (not waiting)
        self._n = 0

    def tokens(self, n: int, rng: random.Random | None = None) -> list[int]:
        """Random prompt ids away from the special ids at the start of the vocab
        (from ``rng`` when given, else the driver's own stream)."""
        rng = rng or self.rng
        return [rng.randrange(100, self.vocab - 1) for _ in range(n)]

    def add(self, prompt: list[int], max_tokens: int, params: SamplingParams | None = None) -> Req:
        """A request for ``prompt``: greedy, ``max_tokens`` tokens ignoring eos,
        unless ``params`` says otherwise (max_tokens and ignore_eos are applied to it)."""
        self._n += 1
        params = dataclasses.replace(params or SamplingParams(temperature=0.0),
                                     max_tokens=max_tokens, ignore_eos=True)
        req = Req(f"bench-{self._n}", list(prompt), params, time.monotonic())
        why = self.sched.validate(req)
        if why is not None:
            raise ValueError(why)
        self.sched.add(req)
        return req

    def step(self) -> ScheduledBatch | None:
        t0 = time.perf_counter()
        batch = self.sched.schedule()
        launched = self.runner.launch(batch) if batch is not None else None
        self.host_s += time.perf_counter() - t0
        prev, self.inflight = self.inflight, None
        if prev is not None:
            self.finish(prev)
        if launched is not None:
            if (launched.out is None or launched.constrained
                    or self.sched.wants_tokens_now(launched.batch)):
                # A non-final chunk: nothing to wait for; a constrained request's
                # token must reach its matcher before the next mask; a speculative
                # draft continues tokens the host holds (EngineCore._step), which
                # plans what of the next step it can while a verify step runs.
                if launched.batch.verifies:
                    t0 = time.perf_counter()
                    self.sched.plan_ahead(launched.batch)
                    self.runner.mirror_pages(launched.batch.reqs)
                    self.host_s += time.perf_counter() - t0
                self.finish(launched)
            else:
                self.inflight = launched
        return batch

    def finish(self, launched: Launched) -> None:
        """Read back (the step's one deliberate sync) and commit."""
        if launched.batch.verifies:
            sampled, row_lps = self.runner.collect_verified(launched)
            t0 = time.perf_counter()
            self.sched.commit_verified(launched.batch, sampled, row_lps)
        else:
            token_ids, logprobs = self.runner.collect(launched)
            t0 = time.perf_counter()
            self.sched.commit(launched.batch, token_ids, logprobs)
        self.sched.finished_reqs.clear()
        self.host_s += time.perf_counter() - t0

    def flush(self) -> None:
        prev, self.inflight = self.inflight, None
        if prev is not None:
            self.finish(prev)

    def sync_step(self, batch: ScheduledBatch | None = None) -> ScheduledBatch | None:
        self.flush()
        batch = batch if batch is not None else self.sched.schedule()
        if batch is not None:
            self.finish(self.runner.launch(batch))
        return batch

    @property
    def idle(self) -> bool:
        return self.inflight is None and not self.sched.has_work

    def run_all(self, max_steps: int = 1_000_000) -> None:
        for _ in range(max_steps):
            if self.step() is None and self.idle:
                return
        raise RuntimeError(f"work left after {max_steps} steps")

    def abort_all(self) -> None:
        self.flush()
        for req in list(self.sched.by_id.values()):
            self.sched.finish(req, "abort")
        self.sched.finished_reqs.clear()
