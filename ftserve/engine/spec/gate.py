"""Speculation only where it measures faster: on or off by batch size, from
the engine's own tokens/s.

Acceptance alone cannot say whether speculation pays. A verify step of k + 1
positions per request costs more than a decode step, by how much depends on
the model and the batch: for a dense model at batch 1 almost nothing (the
weights are read once either way), for a MoE model up to k + 1 times the
experts' bytes (each position routes to its own experts), and at large
batches the verify widths turn a bandwidth-bound step compute-bound. Drafts
that are kept at 85% can still lose tokens/s, so the gate measures instead of
modelling:

    windows of WINDOW consecutive decode steps (plain or verify) at one batch
    size bucket (1, 2, 3, 4, 5-6, 7-9, 10-13, 14-19, ...): tokens committed /
    wall seconds
    the incumbent mode (speculation on, at first) runs; every ``probe_every``
    windows one window runs the other mode; the faster by more than
    HYSTERESIS becomes the incumbent
    a probe that confirms the incumbent doubles probe_every (to MAX_PROBE),
    a switch resets it (MIN_PROBE)

so a mode that loses by x costs about x / (probe_every + 1) of tokens/s once
settled (at MAX_PROBE, 1.5% of a 100% loss). Each committed step counts in the
mode it was planned in (a step in flight at a switch belongs to the old one);
a prefill step, a step of the other mode, a change of bucket or an idle engine
breaks a window (its partial count is dropped).

Speculation off at a bucket means no request drafts in steps of that size:
``Speculator.propose`` returns no draft without counting a miss (the
per-request back-off in speculator.py is untouched), and steps keep overlap
scheduling. The engine feeds ``observe`` once per committed step
(engine._commit).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

WINDOW = 64  # decode steps per measurement: a step's token or two at its edges is <= 3%
MIN_PROBE, MAX_PROBE = 8, 64  # windows of the incumbent between probes of the other mode
HYSTERESIS = 0.02  # the other mode must be this much faster to take over
EWMA = 0.5  # weight of a new window in the incumbent's rate


def bucket(rows: int) -> int:
    """Batch size bucket: half octaves centred on the powers of two, so that a
    closed loop of 16 clients (15 or 16 running) stays in one: rows 1, 2, 3,
    4, 5-6, 7-9, 10-13, 14-19, 20-26, ... -> 1, 3, 4, 5, 6, 7, 8, 9, 10, ..."""
    return 1 + round(2 * math.log2(max(1, rows)))


@functools.cache
def bucket_name(b: int) -> str:
    """The rows of bucket b, as "lo-hi" (or "n")."""
    rows = [n for n in range(1, 1 << (b // 2 + 2)) if bucket(n) == b]
    if not rows:
        return "none"
    return str(rows[0]) if rows[0] == rows[-1] else f"{rows[0]}-{rows[-1]}"


@dataclass
class _Bucket:
    on: bool = True  # the incumbent mode: speculation on
    probing: bool = False  # this window runs the other mode
    rate: dict[bool, float] = field(default_factory=dict)  # mode -> tokens/s
    windows: int = 0  # incumbent windows since the last probe
    probe_every: int = MIN_PROBE

    @property
    def mode(self) -> bool:
        return self.on != self.probing


@dataclass
class GateCounters:
    off_steps_total: int = 0  # decode steps planned with speculation held off
    switches_total: int = 0


class SpecGate:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.buckets: dict[int, _Bucket] = {}
        self.counters = GateCounters()
        # The window being measured: its bucket, mode, steps, tokens, start time.
        self._b = 0
        self._mode = True
        self._steps = 0
        self._tokens = 0
        self._t0 = 0.0

    def _get(self, b: int) -> _Bucket:
        st = self.buckets.get(b)
        if st is None:
            st = self.buckets[b] = _Bucket()
        return st

    def allows(self, rows: int) -> bool:
        """Whether requests may draft in a decode step of ``rows`` requests."""
        st = self.buckets.get(bucket(rows))
        return st is None or st.mode

    def planned(self, rows: int) -> bool:
        """A decode step of ``rows`` requests is being planned: whether they may draft."""
        ok = self.allows(rows)
        if not ok:
            self.counters.off_steps_total += 1
        return ok

    def idle(self) -> None:
        """The engine waits for work: the window breaks."""
        self._b = 0

    def observe(self, rows: int, decode: bool, tokens: int, drafting: bool) -> None:
        """A step was committed: ``rows`` requests, ``decode`` whether it was a
        decode or verify step, the ``tokens`` it committed, and whether it was
        planned with drafting allowed (its mode). A window counts the steps of
        one mode at one bucket, from the commit before its first to its last:
        with overlap scheduling a step is committed when the device is done with
        it, so the interval between two commits is the device's time per step."""
        now = self.clock()
        b = bucket(rows) if rows and decode else 0
        if b == 0 or b != self._b or drafting != self._mode:
            self._b, self._mode, self._steps, self._tokens, self._t0 = b, drafting, 0, 0, now
            return
        self._steps += 1
        self._tokens += tokens
        if self._steps < WINDOW:
            return
        dt = now - self._t0
        rate = self._tokens / dt if dt > 0 else 0.0
        self._steps, self._tokens, self._t0 = 0, 0, now
        self._window(b, drafting, rate)

    def _window(self, b: int, mode: bool, rate: float) -> None:
        st = self._get(b)
        if mode != st.mode:
            return  # measured before the policy last changed
        if st.probing:
            st.rate[mode] = rate
            st.probing = False
            inc, other = st.rate[st.on], st.rate[mode]
            if other > inc * (1.0 + HYSTERESIS):
                st.on, st.probe_every = mode, MIN_PROBE
                self.counters.switches_total += 1
                log.info("speculation %s at batch %s: %.0f tokens/s with it, %.0f without",
                         "on" if mode else "off", bucket_name(b),
                         st.rate.get(True, 0.0), st.rate.get(False, 0.0))
            else:
                st.probe_every = min(2 * st.probe_every, MAX_PROBE)
            st.windows = 0
            return
        old = st.rate.get(mode)
        st.rate[mode] = rate if old is None else (1.0 - EWMA) * old + EWMA * rate
        st.windows += 1
        if (not st.on) not in st.rate or st.windows >= st.probe_every:
            st.probing = True
