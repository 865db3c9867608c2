"""The whole model on the Triton kernels (CPU: the interpreter) against the torch
reference path: a tiny Qwen3-MoE checkpoint (per-head q/k norms, so the fused
norm + rotary kernel runs on views into the qkv projection), a packed prefill,
an extend chunk over the cached prefix, and a decode step (GEMV MoE path)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ftserve.kvcache.pool import KVPool
from ftserve.models.checkpoint import write_checkpoint
from ftserve.models.forward_batch import AttentionBackend, build_forward_batch
from ftserve.models.loader import load_model
from ftserve_kernels.attention_triton import TritonAttentionBackend
from ftserve_kernels.paged_attention import TorchAttentionBackend

PAGE = 4


def run_steps(path: Path, backend: AttentionBackend) -> list[torch.Tensor]:
    model, cfg = load_model(path, dtype="float32", device="cpu")
    pool = KVPool(cfg.num_layers, 40, PAGE, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    g = torch.Generator().manual_seed(3)
    a, b = (torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in (21, 6))
    pages = [list(range(1, 8)), list(range(20, 23))]  # 28 and 12 slots
    steps = [  # (new tokens per sequence, prefix lengths)
        ([a[:13], b[:5]], [0, 0]),  # packed cold prefill
        ([a[13:], b[5:]], [13, 5]),  # extend over the cached prefixes
        ([[7], [9]], [21, 6]),  # decode
    ]
    outs = []
    for toks, prefix in steps:
        batch = build_forward_batch(toks, prefix, pages, pool, backend, all_logits=True,
                                    is_decode=all(len(t) == 1 for t in toks))
        with torch.no_grad():
            outs.append(model(batch))  # [rows, V] fp32
    return outs


def test_model_on_triton_kernels_matches_torch_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_checkpoint("tiny-moe", tmp_path, seed=5, dtype="float32")
    monkeypatch.setenv("FTSERVE_KERNELS", "torch")
    ref = run_steps(tmp_path, TorchAttentionBackend())
    monkeypatch.setenv("FTSERVE_KERNELS", "triton")
    got = run_steps(tmp_path, TritonAttentionBackend())
    for r, o in zip(ref, got):
        assert o.shape == r.shape and torch.isfinite(o).all()
        err = float((o - r).norm() / r.norm())
        assert err < 1e-4, err
