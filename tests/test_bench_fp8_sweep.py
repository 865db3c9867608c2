"""tools/bench/fp8_prefill_sweep on the CPU (--smoke: tiny shapes under the
Triton interpreter, in a subprocess so the interpreter choice is its own): every
row is timed and recorded, fp8 and bf16 alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_fp8_prefill_sweep_smoke_cpu(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "sweep.json"
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "tools.bench.fp8_prefill_sweep", "--smoke", "--out", str(out)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [r["config"] for r in res["moe"]] == ["fp8 pick", "fp8 (16, 32, 4, 1)", "bf16 table"]
    assert [r["config"] for r in res["gemm"]["qkv"]] == ["qkv fp8 pick", "qkv fp8 (16, 32, 4, 1)", "qkv bf16 matmul"]
    for r in res["moe"] + res["gemm"]["qkv"]:
        assert r["s"] > 0 and r["tflops"] > 0, r
