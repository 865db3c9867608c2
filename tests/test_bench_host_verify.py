"""tools/bench/host_verify.py on the CPU: every timed step is a verify step that
replays the stand-in verify graph and keeps every draft (asserted by the tool),
the requests' outputs follow the stand-in model, and the report has every part
per batch, with the part of it the device's work can hide."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.bench import host_verify


def test_host_verify_times_verify_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "verify.json"
    assert host_verify.main(["--batches", "1,3", "--k", "3", "--context", "40", "--steps", "5",
                             "--repeats", "2", "--warmup", "2", "--vocab", "256", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["batch"] for r in res["rows"]] == [1, 3]
    for r in res["rows"]:
        parts = [r[f"{p}_us"] for p in host_verify.PARTS]
        assert all(v > 0 for v in parts), r
        assert r["total_us"] == pytest.approx(sum(parts), abs=0.05)
        assert r["graph_us"] > 0 and r["sample_us"] > 0
        # The last step's outputs and stats go out behind the next replay.
        assert 0 < r["overlap_us"] < r["total_us"] and r["critical_us"] > 0
    text = capsys.readouterr().out
    assert "schedule" in text and "commit" in text and "k = 3" in text
