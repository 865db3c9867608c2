"""tools/bench/fp8 on the CPU (--smoke: tiny-moe in float32 against tiny-moe-fp8
at the same shape): every section runs and is recorded, and the byte counts the
targets are checked against come out as the formats say."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_bench_fp8_smoke_cpu(tmp_path: Path) -> None:
    from tools.bench.fp8 import main

    res = main(["--smoke", "--budget-s", "600", "--out", str(tmp_path / "fp8.json")])
    assert not res.get("errors") and not res.get("skipped"), (res.get("errors"), res.get("skipped"))
    for fmt in ("bf16", "fp8"):
        assert res[f"{fmt}_cold"]["wall_s"] > 0
        assert [r["batch"] for r in res[f"{fmt}_decode"]] == [1, 3]
        assert [r["batch"] for r in res[f"{fmt}_offload"]] == [1, 3]
    # One byte per fp8 weight (+ a scale per block) against 4 in the float32 smoke model.
    s = res["summary"]
    assert s["expert_row_ratio"] == pytest.approx(0.25, abs=0.002)
    assert s["weights_ratio"] < 1
    f, b = res["fp8_decode"][0], res["bf16_decode"][0]
    assert f["weight_bytes"] < b["weight_bytes"]
    assert set(res["targets"]) == {"decode_b1_speedup", "decode_b1_fp8_roofline_frac", "cold_speedup",
                                   "offload_b1_speedup", "offload_b8_speedup", "weights_ratio_max"}
    assert res["targets"]["weights_ratio_max"]["got"] == s["weights_ratio"]
