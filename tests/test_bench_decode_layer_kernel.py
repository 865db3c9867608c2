"""tools/bench_decode_layer_kernel --smoke: the tool's whole flow on the CPU
(unfused layers, then the one-launch layer interpreted phase by phase, checked
against them before it is timed)."""

from __future__ import annotations

import json
from pathlib import Path

from tools import bench_decode_layer_kernel as bench


def test_smoke_checks_the_fused_layer_against_the_unfused(tmp_path: Path) -> None:
    out = tmp_path / "dlk.json"
    results = bench.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text())["points"] == results["points"]
    unfused, fused = results["points"]
    assert unfused["config"] == "unfused" and unfused["us_per_layer"] > 0 and unfused["roofline_us"] > 0
    assert fused["config"] == "default" and "failed" not in fused, fused
    assert fused["rel_err"] < 1e-4 and fused["sync_clean"] and fused["us_per_layer"] > 0
