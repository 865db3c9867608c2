"""One load run: warm-up -> measure -> drain, with progress, canaries and soak scrapes.

Phases by request start time: before ``t0 + warmup`` a request is "warmup" (excluded from the
summary); after it, "measure". The run stops issuing when --duration has passed after warm-up or
--max-requests measured requests were issued, then drains: in-flight requests get
--drain-timeout seconds to finish and are cancelled after that. Ctrl-C cancels at once and still
reports what was measured.
"""

from __future__ import annotations

import asyncio
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from tools.loadgen import anthropic
from tools.loadgen.client import Cancelled, RequestRecord, RequestSpec, send
from tools.loadgen.profiles import WorkloadConfig, build
from tools.loadgen.soak import KV_USAGE, RUNNING, SoakConfig, SoakMonitor

CANARY_PROMPT = "The quick brown fox jumps over the lazy dog. Count: one two three four"


@dataclass(frozen=True)
class RunConfig:
    url: str
    workload: WorkloadConfig
    duration_s: float | None = 60.0
    max_requests: int | None = None
    warmup_s: float = 0.0
    drain_timeout_s: float = 30.0
    request_timeout_s: float = 600.0
    abort_rate: float = 0.0
    api_key: str | None = None
    progress_interval_s: float = 1.0  # 0 = no progress line
    soak: SoakConfig | None = None
    canary_interval_s: float = 0.0  # 0 = no canaries
    canary_max_tokens: int = 8
    # "all": every canary must match the first; "idle": only those sent with nothing else in
    # flight (first and post-drain), for engines whose greedy output depends on batch shape.
    canary_compare: str = "all"


@dataclass
class RunResult:
    records: list[RequestRecord]
    measure_duration_s: float
    interrupted: bool
    soak: SoakMonitor | None
    canaries: list[RequestRecord] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)


class Runner:
    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.t0 = time.perf_counter()
        self.records: list[RequestRecord] = []
        self.canaries: list[RequestRecord] = []
        self.violations: list[str] = []
        self.issued_measured = 0
        self.inflight = 0
        self.interrupted = False
        self._stop = asyncio.Event()
        self._abort_rng = random.Random(f"{cfg.workload.seed}:abort")
        self._headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
        self._messages_headers = anthropic.headers(cfg.api_key)
        self._session: aiohttp.ClientSession | None = None
        self.soak = SoakMonitor(cfg.url, cfg.soak, self.t0) if cfg.soak else None
        self.measure_start = self.t0 + cfg.warmup_s
        self.measure_end: float | None = None
        self._counts = {"measure": 0, "error": 0, "aborted": 0, "tokens": 0}
        self._last_tick = (self.t0, 0)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def _now(self) -> float:
        return time.perf_counter()

    async def issue(self, spec: RequestSpec) -> RequestRecord | None:
        if self.stopping:
            return None
        phase = "warmup" if self._now() < self.measure_start else "measure"
        if phase == "measure":
            if self.cfg.max_requests is not None and self.issued_measured >= self.cfg.max_requests:
                return None
            self.issued_measured += 1
            if self.cfg.max_requests is not None and self.issued_measured >= self.cfg.max_requests:
                self._stop.set()  # this one is still sent; the rest of the run is the drain
        if self.cfg.abort_rate > 0 and self._abort_rng.random() < self.cfg.abort_rate:
            cap = max(1, int(spec.body.get("max_tokens", 2)) // 2)
            spec.abort_after_chunks = self._abort_rng.randint(1, cap)
        assert self._session is not None
        self.inflight += 1
        try:
            headers = self._messages_headers if spec.endpoint == "messages" else self._headers
            rec = await send(self._session, self.cfg.url, spec, self.t0, phase,
                             self.cfg.request_timeout_s, headers)
        except Cancelled as c:
            self._record(c.record)
            return None
        finally:
            self.inflight -= 1
        self._record(rec)
        return rec

    def _record(self, rec: RequestRecord) -> None:
        """Keep ``rec`` and the running counts the progress line reads (O(1) per tick)."""
        self.records.append(rec)
        self._counts["tokens"] += rec.output_tokens
        if rec.phase == "measure":
            self._counts["measure"] += 1
            if rec.status in ("error", "aborted"):
                self._counts[rec.status] += 1

    async def _canary(self) -> None:
        assert self._session is not None
        body = {"model": self.cfg.workload.model, "prompt": CANARY_PROMPT, "temperature": 0.0,
                "max_tokens": self.cfg.canary_max_tokens, "seed": 0}
        spec = RequestSpec("completions", body, "canary")
        idle = self.inflight == 0
        try:
            rec = await send(self._session, self.cfg.url, spec, self.t0, "canary",
                             self.cfg.request_timeout_s, self._headers)
        except Cancelled:
            return
        self.canaries.append(rec)
        first = self.canaries[0]
        where = f"canary #{len(self.canaries) - 1} at t={rec.start:.1f}s"
        if rec.status != "ok":
            self.violations.append(f"{where} failed: {rec.error_kind}: {rec.error}")
        compared = idle or self.cfg.canary_compare == "all"
        if rec.status == "ok" and compared and first.status == "ok" and rec is not first and (
            rec.text != first.text or rec.output_tokens != first.output_tokens
        ):
            self.violations.append(
                f"{where} returned {rec.text!r} ({rec.output_tokens} tokens), the first canary "
                f"returned {first.text!r} ({first.output_tokens} tokens): greedy output changed "
                "(KV or prefix-cache corruption?)"
            )

    async def _canary_loop(self) -> None:
        while not self.stopping:
            try:
                await asyncio.wait_for(self._stop.wait(), self.cfg.canary_interval_s)
            except TimeoutError:
                await self._canary()

    def progress_line(self) -> str:
        now = self._now()
        el = now - self.t0
        phase = "warmup" if now < self.measure_start else ("drain" if self.stopping else "measure")
        c = self._counts
        recent: list[float] = []
        for r in reversed(self.records):  # newest last; stop at the 10 s window
            if r.start + (r.e2e or 0.0) < el - 10.0:
                break
            if r.ttft is not None:
                recent.append(r.ttft)
        ttft = f"{np.median(recent) * 1000:.0f}ms" if recent else "-"
        dt = max(now - self._last_tick[0], 1e-9)
        rate = (c["tokens"] - self._last_tick[1]) / dt
        self._last_tick = (now, c["tokens"])
        line = (f"[{phase} {el:6.1f}s] done {c['measure']} err {c['error']} abort {c['aborted']} "
                f"inflight {self.inflight} | ttft p50(10s) {ttft} | out {rate:.0f} tok/s")
        if self.soak and self.soak.snapshots:
            m = self.soak.snapshots[-1].metrics
            line += f" | run {m.get(RUNNING, float('nan')):g} kv {m.get(KV_USAGE, float('nan')):.2f}"
        if self.violations or (self.soak and self.soak.violations):
            line += " | SOAK VIOLATION"
        return line

    async def _progress_loop(self) -> None:
        tty = sys.stderr.isatty()
        while True:
            # A log file gets a line every 10 ticks; a terminal redraws one line every tick.
            await asyncio.sleep(self.cfg.progress_interval_s * (1 if tty else 10))
            line = self.progress_line()
            sys.stderr.write(("\r" + line + "\x1b[K") if tty else line + "\n")
            sys.stderr.flush()

    async def _stopper(self, workload_task: asyncio.Task[Any]) -> None:
        """Sets the stop event when --duration passes or the workload runs out of requests."""
        timeout = None
        if self.cfg.duration_s is not None:
            timeout = max(0.0, self.measure_start + self.cfg.duration_s - self._now())
        stop_wait = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({workload_task, stop_wait}, timeout=timeout,
                           return_when=asyncio.FIRST_COMPLETED)
        stop_wait.cancel()
        self._stop.set()

    def interrupt(self) -> None:
        self.interrupted = True
        self._stop.set()

    async def run(self) -> RunResult:
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGINT, self.interrupt)
        except (NotImplementedError, RuntimeError):
            pass  # not the main thread (tests) or no signals on this platform
        conn = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
            self._session = session
            try:
                return await self._run(session)
            finally:
                try:
                    loop.remove_signal_handler(signal.SIGINT)
                except (NotImplementedError, RuntimeError):
                    pass

    async def _run(self, session: aiohttp.ClientSession) -> RunResult:
        side: list[asyncio.Task[Any]] = []
        scrape_stop = asyncio.Event()
        if self.soak:
            await self.soak.take_baseline(session)
            side.append(asyncio.create_task(self.soak.run_periodic(session, scrape_stop)))
        if self.cfg.canary_interval_s > 0:
            await self._canary()  # the reference output, sent before any load
            side.append(asyncio.create_task(self._canary_loop()))
        if self.cfg.progress_interval_s > 0:
            side.append(asyncio.create_task(self._progress_loop()))
        # Re-anchor the phases: baseline and first canary are not part of the run's duration.
        self.measure_start = self._now() + self.cfg.warmup_s
        workload = asyncio.ensure_future(build(self.cfg.workload, self))
        await self._stopper(workload)
        # Drain: in-flight requests finish (or are cancelled at the timeout / on Ctrl-C).
        drain = 0.0 if self.interrupted else self.cfg.drain_timeout_s
        done, _ = await asyncio.wait({workload}, timeout=drain)
        if not done or self.interrupted:
            workload.cancel()
        try:
            await workload
        except asyncio.CancelledError:
            pass
        if not done and not self.interrupted and self.soak:
            self.violations.append(
                f"drain: requests still in flight after --drain-timeout {self.cfg.drain_timeout_s:g}s"
            )
        self.measure_end = self._now()
        scrape_stop.set()
        for t in side:
            t.cancel()
        await asyncio.gather(*side, return_exceptions=True)
        if self.cfg.progress_interval_s > 0:
            sys.stderr.write(("\r" + self.progress_line() + "\n") if sys.stderr.isatty() else "")
        if self.soak and not self.interrupted:
            await self.soak.settle(session)
            if self.cfg.canary_interval_s > 0:
                await self._canary()  # idle server, warm prefix cache: must still match
        return RunResult(
            records=self.records,
            measure_duration_s=max(0.0, self.measure_end - self.measure_start),
            interrupted=self.interrupted,
            soak=self.soak,
            canaries=self.canaries,
            violations=self.violations + (self.soak.violations if self.soak else []),
        )
