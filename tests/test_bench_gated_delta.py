"""tools/bench/gated_delta --smoke: the tool's whole flow on the CPU (Triton
interpreted at tiny shapes), every candidate checked against the torch reference
before it is timed."""

from __future__ import annotations

import json
from pathlib import Path

from tools.bench import gated_delta as bench


def test_smoke_checks_every_candidate_against_the_reference(tmp_path: Path) -> None:
    out = tmp_path / "gd.json"
    results = bench.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == results["rows"]
    sections = {(r["section"], r["candidate"]) for r in results["rows"]}
    assert sections >= {("prefill", "triton"), ("prefill", "triton scan=32/4/2"), ("decode", "triton"),
                        ("decode", "triton block_v=32"), ("conv_prefill", "triton"),
                        ("conv_decode", "triton"), ("prefill", "torch")}
    for r in results["rows"]:
        assert "failed" not in r, r
        assert r["err_out"] <= 1e-5 and r["err_state"] <= 1e-5, r
        assert r.get("ms", 0) > 0 or r.get("us", 0) > 0
    assert "| prefill | triton |" in results["report"]


def test_flop_and_byte_counts_at_the_80b_shape() -> None:
    s = bench.QWEN3_NEXT_80B
    assert s.conv_dim == 8192
    # One 64-token chunk of one value head: 11.5 MFLOP (see chunk_flops' docstring).
    assert bench.chunk_flops(64, s) / s.hv == 10 * 64 * 64 * 128 + 6 * 64 * 128 * 128
    # Decode at batch 1 is the fp32 state read and written: 4 MiB, plus the token's inputs.
    assert 4 << 20 < bench.decode_bytes(1, s) < (4 << 20) + 64 * 1024
