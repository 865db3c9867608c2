"""tools/bench/common.overlap_seconds: how much of one kernel's time other
kernels ran beside it (a copy kernel vs the compute it should hide under); the
decode roofline's byte count for a dense model."""

from __future__ import annotations

import pytest

from ftserve.models.checkpoint import preset_config
from ftserve.models.config import ModelConfig
from tools.bench.common import decode_step_bytes, hbm_spec_gbps, overlap_seconds


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


def test_decode_bytes_of_a_dense_model() -> None:
    """SmolLM2-135M: no experts to route to (no division by E = 0); every
    weight once (the tied lm_head is the embedding: counted once, as the
    lm_head), the batch's embedding rows, each row's KV."""
    cfg = ModelConfig.from_hf(preset_config("smollm2-135m"))
    r = decode_step_bytes(cfg, 2, 64, [100] * 64)
    assert r["experts_per_layer"] == 0.0
    per_layer = 576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536
    assert r["weight_bytes"] == 2 * (30 * per_layer + 49152 * 576 + 64 * 576)
    assert r["kv_bytes"] == 64 * 100 * 2 * 30 * 3 * 64 * 2
    assert hbm_spec_gbps("NVIDIA H200") == 4800.0 and hbm_spec_gbps("NVIDIA A100-SXM4-80GB") is None
