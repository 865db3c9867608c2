"""ftserve's torch dequantizers (ftserve/models/gguf_quants.py) against ggml's own
(gguf.quants.dequantize), bit for bit, on random blocks of every type they cover;
and the dispatch: the gguf package's types, an unknown type."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as Q

from ftserve.models.gguf_quants import _BLOCKS, dequantize, dequantize_torch

# where each type keeps its float16 scale(s) inside a block
_SCALES = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q5_0: (0,), Q.Q4_1: (0, 2), Q.Q5_1: (0, 2),
           Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def _random_blocks(kind: Q, n: int, seed: int = 0) -> np.ndarray:
    """Random bytes with finite float16 scales (random bits would hold NaNs)."""
    rng = np.random.default_rng(seed)
    _, size = GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for at in _SCALES[kind]:
        raw[:, at:at + 2] = rng.uniform(-0.5, 0.5, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    return raw


@pytest.mark.parametrize("qtype", sorted(_BLOCKS), ids=lambda t: Q(t).name)
def test_torch_dequantizer_equals_ggml(qtype: int) -> None:
    raw = _random_blocks(Q(qtype), 96, seed=qtype)
    want = quants.dequantize(raw, Q(qtype))  # [96, values per block]
    got = dequantize_torch(torch.from_numpy(raw.reshape(-1)), qtype, want.shape)
    assert got.dtype == torch.float32
    assert np.array_equal(got.numpy(), want)
    # through the loader's entry point, in a tensor's shape (rows of several blocks)
    rows = (8, want.size // 8)
    assert np.array_equal(dequantize(raw.reshape(-1), qtype, rows, torch.device("cpu")).numpy(),
                          want.reshape(rows))


@pytest.mark.parametrize("kind", [Q.F16, Q.BF16, Q.F32])
def test_float_types(kind: Q) -> None:
    x = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    raw = {Q.F16: x.astype(np.float16).view(np.uint8), Q.F32: x.view(np.uint8),
           Q.BF16: quants.quantize(x, Q.BF16)}[kind]
    want = quants.dequantize(raw, kind) if kind == Q.BF16 else raw.view(
        np.float16 if kind == Q.F16 else np.float32).astype(np.float32)
    got = dequantize(raw.reshape(-1), int(kind), (4, 64), torch.device("cpu"))
    assert np.array_equal(got.numpy(), want)


def test_other_types_through_gguf_and_unknown_ones_named() -> None:
    raw = np.random.default_rng(3).integers(0, 256, (4, GGML_QUANT_SIZES[Q.Q3_K][1]), dtype=np.uint8)
    raw[:, -2:] = np.array([0.01], np.float16).view(np.uint8)  # Q3_K's d: its last two bytes
    got = dequantize(raw.reshape(-1), int(Q.Q3_K), (4, 256), torch.device("cpu"))
    assert np.array_equal(got.numpy(), quants.dequantize(raw, Q.Q3_K))
    with pytest.raises(NotImplementedError, match="I32"):
        dequantize(np.zeros(16, np.uint8), int(Q.I32), (4,), torch.device("cpu"))
    with pytest.raises(NotImplementedError, match="#999"):
        dequantize(np.zeros(16, np.uint8), 999, (4,), torch.device("cpu"))


def test_short_data_is_an_error() -> None:
    raw = _random_blocks(Q.Q8_0, 2)
    with pytest.raises(ValueError, match="does not hold"):
        dequantize_torch(torch.from_numpy(raw.reshape(-1)), int(Q.Q8_0), (96,))


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", sorted(_BLOCKS), ids=lambda t: Q(t).name)
def test_torch_dequantizer_on_cuda_equals_ggml(qtype: int) -> None:
    """On a GPU every block type goes through torch (the K-quants too)."""
    raw = _random_blocks(Q(qtype), 4096, seed=qtype)
    want = quants.dequantize(raw, Q(qtype))
    got = dequantize(raw.reshape(-1), qtype, want.shape, torch.device("cuda"))
    assert got.device.type == "cuda" and np.array_equal(got.cpu().numpy(), want)
