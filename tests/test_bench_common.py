"""tools/bench/common.overlap_seconds: how much of one kernel's time other
kernels ran beside it (a copy kernel vs the compute it should hide under)."""

from __future__ import annotations

import pytest

from tools.bench.common import overlap_seconds


def test_overlap_counts_only_time_shared_with_other_kernels() -> None:
    spans = [
        (0.0, 10.0, "gemv"),  # fill 5-15 overlaps 5-10 of this
        (5.0, 15.0, "_fill_rows_kernel"),
        (12.0, 13.0, "norm"),  # and 12-13
        (14.0, 20.0, "attn"),  # and 14-15
        (30.0, 40.0, "_fill_rows_kernel"),  # alone
        (35.0, 38.0, "_fill_rows_kernel"),  # merged into the one above, not double-counted
    ]
    r = overlap_seconds(spans, "fill_rows")
    assert r["key_s"] == pytest.approx(20e-6)
    assert r["overlapped_s"] == pytest.approx(7e-6)


def test_overlap_without_the_key_or_without_others() -> None:
    assert overlap_seconds([(0.0, 5.0, "gemv")], "fill") == {"key_s": 0.0, "overlapped_s": 0.0}
    r = overlap_seconds([(0.0, 5.0, "fill"), (1.0, 2.0, "fill")], "fill")
    assert r == {"key_s": pytest.approx(5e-6), "overlapped_s": 0.0}
    # Other kernels that touch but do not overlap add nothing; nested ones count once.
    r = overlap_seconds([(0.0, 5.0, "fill"), (5.0, 9.0, "a"), (1.0, 4.0, "b"), (2.0, 3.0, "c")], "fill")
    assert r["overlapped_s"] == pytest.approx(3e-6)
