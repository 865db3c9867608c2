"""tools/bench/spec.py's --budget-s arithmetic: each run's share of what is left
after the server start-ups still to come, and a skip when nothing is left."""

from __future__ import annotations

import time

import pytest

from tools.bench.spec import Budget


def test_unbounded_without_a_budget() -> None:
    b = Budget(None, runs=4, servers=2)
    assert b.left() is None and b.run_share() is None and b.startup_timeout(900.0) == 900.0


def test_shares_reserve_the_next_start_up_and_skip_when_spent(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    b = Budget(150.0, runs=4, servers=2)
    assert b.startup_timeout(900.0) == 145.0  # the whole budget less a shutdown
    now[0] += 30.0
    b.started(30.0)  # the first server took 30 s: the second is reserved as long
    # 120 s left - (30 + 5) for the second server - 5 for this one's stop = 80 s over 4 runs,
    # two thirds of each slice to send requests in
    assert b.run_share() == pytest.approx(80 / 4 * 2 / 3)
    b.runs_left = 1
    now[0] += 110.0  # 10 s left: less than a run needs after the reserve
    assert b.run_share() == 0.0
