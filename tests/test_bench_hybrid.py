"""tools/bench/hybrid --smoke: the whole flow on the CPU (tiny-qwen3-next): the cold
and cached turns take the steps the checkpoints imply, the cached one resumes at
the conversation's prompt end, decode reads state bytes, every target is judged;
and the FLOP / byte counts at the 80B shape are the ones the docstrings state."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from tools.bench import hybrid as bench


def test_smoke_measures_every_target(tmp_path: Path) -> None:
    out = tmp_path / "hybrid.json"
    res = bench.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text())["targets"] == [list(t) for t in res["targets"]]
    assert not res.get("errors") and not res.get("skipped"), (res.get("errors"), res.get("skipped"))
    cold, cached = res["cold"], res["cached"]
    # 64 new tokens, pages of 16: one chunk, its last page boundary's checkpoint (48) saved inside it.
    assert cold["steps"] == [(0, 64)] and cold["cached_tokens"] == 0
    # The 256-token conversation's prompt-end checkpoint is at 240: 80 tokens to compute in chunks
    # of 64 (the smoke run's budget; the second ends on the prompt's last page boundary, 304).
    assert cached["cached_tokens"] == 240 and cached["steps"] == [(240, 64), (304, 16)]
    assert res["state_checkpoints_saved"] > 0
    assert [r["context"] for r in res["decode"]] == [48, 256]
    for r in res["decode"]:
        assert r["state_bytes"] > 0 and 0 < r["frac_of_roofline"]
    assert [t[0].split(" ")[0] for t in res["targets"]] == ["64-token", "cold", "decode"]
    assert "| target | measured | met |" in bench.render(res)



def test_a_failed_turn_leaves_the_next_sections_a_clean_engine(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A turn that fails mid-step (on the H100, an out-of-shared-memory launch)
    is recorded, and its request no longer sits in the scheduler: the conversation
    prefill and the cached turn after it still run."""
    real, calls = bench.bench_turn, []

    def failing_first(drv, *a, **kw):  # type: ignore[no-untyped-def]
        calls.append(a[3])  # (device, limits, base, prefix, chunk, reps)
        if len(calls) > 1:
            return real(drv, *a, **kw)
        launch = drv.runner.launch

        def fail_once(batch, *la, **lkw):  # type: ignore[no-untyped-def]
            drv.runner.launch = launch  # the next launch is real again
            raise RuntimeError("injected launch failure")

        drv.runner.launch = fail_once  # the turn's first step fails inside the runner
        return real(drv, *a, **kw)

    monkeypatch.setattr(bench, "bench_turn", failing_first)
    # Before the abort the next section waited forever on the failed step's request:
    # bounded here, in a daemon thread.
    done: list[dict] = []
    t = threading.Thread(daemon=True, target=lambda: done.append(
        bench.main(["--smoke", "--sections", "cold,cached", "--out", str(tmp_path / "h.json")])))
    t.start()
    t.join(timeout=150)
    assert done, "the sections after a failed turn did not finish"
    res = done[0]
    assert list(res["errors"]) == ["cold"] and "injected" in res["errors"]["cold"]
    assert res["base"] is not None and res["cached"]["cached_tokens"] == 240, res.get("errors")

@pytest.fixture(scope="module")
def engine_80b(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The benchmarked shape (8 layers of qwen3-next-80b-a3b) on the meta device:
    the counts need the module tree, not the weights."""
    import torch

    from ftserve.models.checkpoint import preset_config
    from ftserve.models.config import ModelConfig
    from ftserve.models.registry import model_class

    mcfg = ModelConfig.from_hf(preset_config("qwen3-next-80b-a3b", layers=8))
    with torch.device("meta"):
        return model_class(mcfg.architecture)(mcfg, torch.bfloat16), mcfg


def test_counts_at_the_80b_shape(engine_80b) -> None:  # type: ignore[no-untyped-def]
    model, mcfg = engine_80b
    assert len(mcfg.kv_layers) == 2 and len(mcfg.linear_layers) == 6
    w = bench.weight_counts(model)
    assert w["moe_layers"] == 8 and w["top_k"] == 10 and w["num_experts"] == 512
    assert w["expert"] == 3 * 2048 * 512
    h = 2048
    attn = h * (2 * 4096 + 2 * 512) + 4096 * h  # q with its gate, k, v; o
    linear = h * (2 * 2048 + 2 * 4096 + 2 * 32) + 4096 * h  # in_proj (qkvz, ba); out_proj
    moe = h * 512 + 3 * h * 512 + h  # router, shared expert, its gate
    assert w["dense"] == 2 * attn + 6 * linear + 8 * moe
    fl = bench.prefill_flops(model, mcfg, 4096, 0)
    assert fl["matmul_flops"] == 2 * 4096 * (w["dense"] + 8 * 10 * w["expert"]) + 2 * h * 151936
    assert fl["attention_flops"] == 2 * 4 * 256 * 16 * (4096 * 4097 / 2)
    # About 1.1 GFLOP a token: 4.5 TFLOP for the cold 4k prompt, matmuls nearly all of it.
    assert 4.4e12 < fl["total_flops"] < 4.9e12
