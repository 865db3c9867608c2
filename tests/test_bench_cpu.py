"""tools/bench/cpu.py on a tiny Llama checkpoint: both engines run on the same
weights, produce the same greedy tokens, and the report holds the ratios."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from ftserve.models.checkpoint import write_checkpoint  # noqa: E402
from tools.bench import cpu as bench_cpu  # noqa: E402


def test_bench_cpu_runs_both_engines_on_one_checkpoint(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    model = write_checkpoint("tiny-dense", tmp_path / "m", dtype="float32")
    out = tmp_path / "r.json"
    assert bench_cpu.main(["--model", str(model), "--threads", "1", "--ttft-tokens", "40",
                           "--prompt-tokens", "8", "--decode-tokens", "6", "--repeats", "2",
                           "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    # Same weights, same math: every greedy token agrees (a wrong rotary, mask or
    # KV page in either would not).
    assert res["greedy_agreement"]["first_token"] == "2/2"
    assert res["greedy_agreement"]["decode_leading_tokens"] == [7, 7]
    for name in ("ftserve", "transformers"):
        assert len(res["runs"]["ttft_s"][name]) == 2
        assert len(res["runs"]["decode_step_s"][name]) == 2 * 6
        assert res["stats"][name]["decode_tokens_per_s"] > 0
    r = res["ratios"]
    assert r["ttft_ftserve_over_hf"] == pytest.approx(
        res["stats"]["ftserve"]["ttft_best_s"] / res["stats"]["transformers"]["ttft_best_s"])
    assert "| TTFT, 40-token prompt, best |" in capsys.readouterr().out
