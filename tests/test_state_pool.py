"""StatePool: sized from the config alone, slots handed out around the sink,
prefix-cache checkpoint copies by slot index."""

from __future__ import annotations

import pytest
import torch

from ftserve.kvcache.state_pool import SINK_SLOT, StateLayout, StatePool
from ftserve.models.checkpoint import preset_config
from ftserve.models.config import ModelConfig


def test_layout_of_qwen3_next_80b() -> None:
    layout = StateLayout.from_config(ModelConfig.from_hf(preset_config("qwen3-next-80b-a3b")))
    assert (layout.num_layers, layout.conv_dim, layout.conv_width) == (36, 8192, 3)
    assert layout.recurrent_shape == (32, 128, 128)
    # 36 layers x (conv 8192 x 3 bf16 + state 32 x 128 x 128 fp32)
    assert layout.bytes_per_slot(torch.bfloat16, torch.float32) == 36 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)
    with pytest.raises(ValueError, match="no linear-attention layers"):
        StateLayout.from_config(ModelConfig.from_hf(preset_config("tiny-moe")))


def test_pool_bytes_are_what_it_allocates() -> None:
    cfg = ModelConfig.from_hf(preset_config("tiny-qwen3-next"))
    pool = StatePool.for_model(cfg, 5, torch.bfloat16)
    assert pool.conv.shape == (2, 6, 2 * 2 * 16 + 4 * 16, 3) and pool.conv.dtype == torch.bfloat16
    assert pool.recurrent.shape == (2, 6, 4, 16, 16) and pool.recurrent.dtype == torch.float32
    assert pool.nbytes == pool.layout.pool_bytes(5, torch.bfloat16, torch.float32)


def test_verify_log_is_counted_and_small_beside_a_state() -> None:
    """The verify log (speculative decoding) holds per token and linear layer the
    conv inputs, k, v and beta in the model's dtype and g in fp32; the plan
    counts exactly what it allocates. At Qwen3-Next-80B's shapes a token's log is
    under 2% of one state slot."""
    cfg = ModelConfig.from_hf(preset_config("tiny-qwen3-next"))
    pool = StatePool.for_model(cfg, 5, torch.bfloat16, verify_tokens=10)
    log = pool.verify_log
    assert log is not None and log.tokens == 10
    assert log.k.shape == (2, 10, 2, 16) and log.v.shape == (2, 10, 4, 16) and log.conv_in.shape == (2, 10, 128)
    assert log.g.dtype == torch.float32 and log.beta.dtype == log.k.dtype == torch.bfloat16
    assert pool.nbytes == pool.layout.pool_bytes(5, torch.bfloat16, torch.float32, verify_tokens=10)
    assert StatePool.for_model(cfg, 5, torch.bfloat16).verify_log is None
    big = StateLayout.from_config(ModelConfig.from_hf(preset_config("qwen3-next-80b-a3b")))
    per_token = big.log_bytes_per_token(torch.bfloat16)
    assert per_token == 36 * ((8192 + 16 * 128 + 32 * 129) * 2 + 32 * 4)
    assert per_token < 0.02 * big.bytes_per_slot(torch.bfloat16, torch.float32)


def test_alloc_and_free() -> None:
    pool = StatePool(StateLayout(1, 4, 2, 1, 2, 2), 3, torch.float32)
    slots = [pool.alloc() for _ in range(3)]
    assert sorted(slots) == [1, 2, 3] and SINK_SLOT not in slots and pool.num_free == 0
    with pytest.raises(RuntimeError, match="all 3 state slots"):
        pool.alloc()
    pool.free(slots[1])
    assert pool.alloc() == slots[1]  # the slot just freed comes back first
    pool.free(slots[0])
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(slots[0])
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(SINK_SLOT)


def test_copy_slots_moves_whole_states() -> None:
    pool = StatePool(StateLayout(2, 4, 2, 2, 3, 3), 4, torch.float32)
    g = torch.Generator().manual_seed(0)
    pool.conv.copy_(torch.randn(pool.conv.shape, generator=g))
    pool.recurrent.copy_(torch.randn(pool.recurrent.shape, generator=g))
    conv, rec = pool.conv.clone(), pool.recurrent.clone()
    # checkpoint slot 2 into 4 and restore 1 into 3, padded with a sink-to-sink pair
    pool.copy_slots(torch.tensor([2, 1, SINK_SLOT]), torch.tensor([4, 3, SINK_SLOT]))
    for dst, src in ((4, 2), (3, 1), (2, 2), (1, 1), (0, 0)):
        assert torch.equal(pool.conv[:, dst], conv[:, src]) and torch.equal(pool.recurrent[:, dst], rec[:, src])
