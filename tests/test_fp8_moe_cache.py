"""Expert offload with fp8 banks (issue 32 item 4) on the CPU: host banks and
VRAM slots hold e4m3 codes plus their block scales, one contiguous row per
expert of about half the bf16 row's bytes; offload mode's greedy tokens equal
resident mode's exactly (test_moe_cache's scenarios, reused on tiny-moe-fp8),
from dummy weights and from an fp8 checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ftserve.models.checkpoint import write_config
from ftserve.models.layers import MoEBlock
from ftserve.moe.banks import Fp8Row, moe_blocks
from ftserve_kernels.fp8_quant import FP8, Fp8Weight
from tests import test_moe_cache as tm
from tests.test_moe_cache import resident_tokens  # noqa: F401  (the fixture, on this module's model)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_config("tiny-moe-fp8", Path(tmp_path_factory.mktemp("fp8-moe-cache")), layers=tm.LAYERS)


def test_fp8_row_is_half_the_bf16_row() -> None:
    """qwen3-30b-a3b's expert: 3 x 768 x 2048 codes + 36 fp32 block scales (+ padding)
    against 3 x 768 x 2048 bf16 values: what one miss moves over PCIe."""
    row = Fp8Row(2048, 768, (128, 128), (128, 128))
    assert row.w13_scale_shape == (12, 16) and row.w2_scale_shape == (16, 6)
    assert row.row_bytes == 3 * 768 * 2048 + 4 * (12 * 16 + 16 * 6)
    assert row.row_bytes / (3 * 768 * 2048 * 2) < 0.5003


def test_bank_and_slots_hold_codes_and_scales(model_dir: str) -> None:
    eng = tm.make_engine(model_dir, moe_cache_size=24)
    try:
        cache = tm.cache_of(eng)
        bank = cache.bank
        assert bank.fp8 is not None and bank.data.dtype == torch.uint8
        assert bank.row_bytes == bank.fp8.row_bytes and bank.row_bytes % 16 == 0
        assert isinstance(cache.w13, Fp8Weight) and isinstance(cache.w2, Fp8Weight)
        assert cache.w13.codes.dtype == FP8 and cache.w13.codes.shape[1:] == (2 * bank.inter, bank.hidden)
        # The blocks' parameters are views of the bank: the loader wrote through them.
        blk = moe_blocks(eng.runner.model)[1]
        assert isinstance(blk, MoEBlock) and blk.is_fp8
        views = bank.fp8.views(bank.data[bank.num_experts:2 * bank.num_experts])
        assert blk.w13.data_ptr() == views[0].codes.data_ptr()
        assert blk.w2_scale is not None and torch.equal(blk.w2_scale, views[1].scale)
        assert blk.w2_scale.data_ptr() == views[1].scale.data_ptr()
        assert eng.summary["moe_cache"]["expert_bytes"] == bank.fp8.row_bytes
    finally:
        eng.shutdown()


@pytest.mark.parametrize("slots", [24, tm.TOTAL])  # part of the experts, every expert
def test_offload_equals_resident(model_dir: str, resident_tokens: dict[str, list[list[int]]],  # noqa: F811
                                 slots: int) -> None:
    tm.test_offload_equals_resident(model_dir, resident_tokens, slots)


def test_slot_planning_counts_kv_in_the_model_dtype(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The KV bytes per token the slot plan reserves (--moe-cache-auto on CUDA)
    are the model dtype's: an fp8 bank's rows are bytes, not the KV's dtype."""
    from ftserve.config import EngineConfig
    from ftserve.kvcache.pool import KVPool
    from ftserve.moe import planning

    seen: list[int] = []
    real = planning.plan_num_slots
    monkeypatch.setattr(planning, "plan_num_slots", lambda *a: seen.append(a[4]) or real(*a))
    cfg = EngineConfig(model=model_dir, load_format="dummy", device="cpu", dtype="float32", moe_cache_size=24)
    _, mcfg, cache = planning.load_with_expert_cache(model_dir, cfg, torch.device("cpu"), "dummy")
    assert cache.bank.data.dtype == torch.uint8
    assert seen == [KVPool.bytes_per_token(len(mcfg.kv_layers), mcfg.num_kv_heads, mcfg.head_dim, torch.float32)]


test_stream_invalidates_old_buffer_mappings = tm.test_stream_invalidates_old_buffer_mappings
test_bookkeeping_is_fixed_shape = tm.test_bookkeeping_is_fixed_shape


def test_offload_from_fp8_safetensors_equals_resident(tmp_path: Path) -> None:
    """An fp8 checkpoint loaded into host banks (codes and scales through the
    bank views) decodes exactly as the resident load of the same checkpoint."""
    from ftserve.models.checkpoint import write_checkpoint

    ckpt = write_checkpoint("tiny-moe-fp8", tmp_path / "ckpt", layers=2, seed=3, shard_size_mb=0.5)
    ps = tm.prompts(8, 3, 5, 90)
    res = tm.make_engine(str(ckpt), load_format="safetensors")
    try:
        want = tm.run_greedy(res, ps, 6)
        resident_w2 = [b.w2_scale.clone() for b in moe_blocks(res.runner.model)]
    finally:
        res.shutdown()
    off = tm.make_engine(str(ckpt), load_format="safetensors", moe_cache_size=20)
    try:
        assert [torch.equal(a, b.w2_scale) for a, b in zip(resident_w2, moe_blocks(off.runner.model))] == [True] * 2
        assert tm.run_greedy(off, ps, 6) == want
        tm.check_cache(tm.cache_of(off))
    finally:
        off.shutdown()
