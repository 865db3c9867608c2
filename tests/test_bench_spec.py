"""tools/bench/spec.py's --budget-s arithmetic: each run's share of what is left
after the server start-ups still to come, and a skip when nothing is left."""

from __future__ import annotations

import time
from pathlib import Path

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


def test_markdown_rows_per_draft_length_against_the_one_plain_run() -> None:
    """--ks: one row per (speculative server, batch), each against the plain run of
    its batch; a skipped run says why."""
    from tools.bench.spec import render_markdown

    def run(tps: float, verifies: float = 0.0) -> dict[str, object]:
        return {"output_throughput": tps, "completed": 4, "failed": 0,
                "spec": {"acceptance_rate": 0.9, "kept_per_verify": 3.5, "verifies": verifies, "gated_steps": 0}}

    res = {"mode": "ngram", "spec_labels": ["ngram_k4", "ngram_k8"], "batch_sizes": [1, 16],
           "off": {"1": run(100.0), "16": run(800.0), "startup_s": 9.0},
           "ngram_k4": {"1": run(225.0, 10), "16": run(1400.0, 20), "startup_s": 8.0},
           "ngram_k8": {"1": run(290.0, 7), "16": {"skipped": "no time left (--budget-s)"}},
           "ratios": {"ngram_k4": {"1": 2.25, "16": 1.75}, "ngram_k8": {"1": 2.9, "16": None}},
           "model": "m", "where": "w", "date_utc": "d", "argv": ["--ks", "4,8"], "wall_s": 60.0}
    rows = [line for line in render_markdown(res).splitlines() if line.startswith("| ngram")]
    assert [r.split(" | ")[:2] for r in rows] == [["| ngram_k4", "1"], ["| ngram_k4", "16"],
                                                  ["| ngram_k8", "1"], ["| ngram_k8", "16"]]
    assert "| 100 | 225 | 2.250 |" in rows[0] and "| 800 | 1,400 | 1.750 |" in rows[1]
    assert "| 100 | 290 | 2.900 |" in rows[2]
    assert "skipped: no time left (--budget-s)" in rows[3]
    assert "off 9 s, ngram_k4 8 s" in render_markdown(res)


def test_ks_and_a_draft_length_flag_conflict(tmp_path: Path) -> None:
    from tools.bench.spec import main

    with pytest.raises(SystemExit):
        main(["--model", "m", "--ks", "2,4", "--out", str(tmp_path), "--", "--num-speculative-tokens", "3"])
