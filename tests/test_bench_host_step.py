"""tools/bench/host_step.py on the CPU: every timed step takes the decode graph
path (HostOnlyGraphs stands in for the captured graphs), the requests decode
the tokens the stand-in graphs return (both asserted by the tool), and the
report has every part per batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.bench import host_step


def test_host_step_times_the_graph_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "host.json"
    assert host_step.main(["--batches", "1,3", "--context", "40", "--steps", "6", "--repeats", "2",
                           "--warmup", "2", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["batch"] for r in res["rows"]] == [1, 3]
    for r in res["rows"]:
        parts = [r[f"{p}_us"] for p in host_step.PARTS]
        assert all(v > 0 for v in parts), r
        assert r["total_us"] == pytest.approx(sum(parts), abs=0.05)
    text = capsys.readouterr().out
    assert "schedule" in text and "pack" in text and "commit" in text
