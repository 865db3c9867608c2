"""The batch-1 decode layer kernel (ftserve_kernels/decode_layer_triton.py)
against the unfused layer: on the CPU its six phases run as six launches under
the interpreter; on CUDA the fused kernel (grid barriers) runs eagerly and in
a captured graph, and must leave its barrier words at zero and unflagged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ftserve.kvcache.pool import KVPool
from ftserve.models.checkpoint import write_checkpoint
from ftserve.models.forward_batch import build_forward_batch
from ftserve.models.loader import load_model
from ftserve_kernels.attention_triton import TritonAttentionBackend
from ftserve_kernels.paged_attention import TorchAttentionBackend

PAGE = 4


def _decode(path: Path, preset_dtype: str, device: str, prompt_len: int, fused: bool,
            monkeypatch: pytest.MonkeyPatch, graph: bool = False,
            qk_norm: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Prefill a prompt on the reference path, then one decode step on the path
    under test -> (logits [1, V], every layer's K and V pages after the step)."""
    dtype = getattr(torch, preset_dtype)
    model, cfg = load_model(path, dtype=preset_dtype, device=device)
    if not qk_norm:  # a Mixtral-style layer: rotary without per-head norms
        for layer in model.layers:
            layer.self_attn.q_norm = layer.self_attn.k_norm = None
    pool = KVPool(cfg.num_layers, 24, PAGE, cfg.num_kv_heads, cfg.head_dim, dtype, device)
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(3, cfg.vocab_size, (prompt_len,), generator=g).tolist()
    pages = [list(range(2, 2 + (prompt_len + PAGE) // PAGE + 1))]
    monkeypatch.setenv("FTSERVE_KERNELS", "torch")
    monkeypatch.setenv("FTSERVE_DECODE_LAYER_KERNEL", "0")
    monkeypatch.setenv("FTSERVE_LM_HEAD_GEMV", "0")  # not under test (and slow interpreted)
    with torch.no_grad():
        model(build_forward_batch([prompt], [0], pages, pool, TorchAttentionBackend()))
        monkeypatch.setenv("FTSERVE_KERNELS", "torch" if not fused else "triton")
        monkeypatch.setenv("FTSERVE_DECODE_LAYER_KERNEL", "1" if fused else "0")
        backend = TritonAttentionBackend() if fused else TorchAttentionBackend()
        step = build_forward_batch([[7]], [prompt_len], pages, pool, backend, is_decode=True)
        if graph:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                model(step)  # warm-up (compiles), then capture and replay
            torch.cuda.current_stream().wait_stream(s)
            cg = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cg):
                logits = model(step)
            logits.fill_(float("nan"))
            cg.replay()
            cg.replay()  # twice: the barrier words must be back at zero
        else:
            logits = model(step)
    kv = [t[: pages[0][-1] * PAGE + PAGE].clone() for t in (*pool.k, *pool.v)]
    return logits.float(), kv


@pytest.mark.parametrize("qk_norm", [True, False])
def test_decode_layer_kernel_phases_match_unfused_layer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, qk_norm: bool
) -> None:
    """tiny-moe (16 experts top-4; with and without its q/k norms), fp32 on the
    CPU: logits and the KV cache the step wrote equal the torch path's, with the
    new token in the first split and in the second."""
    from ftserve_kernels import decode_layer_triton as dl

    calls: list[int] = []
    real = dl.decode_layer_triton
    monkeypatch.setattr(dl, "decode_layer_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    write_checkpoint("tiny-moe", tmp_path, seed=5, dtype="float32")
    for prompt_len in (9, 20):  # 16-token tiles, 2 splits: the token in split 0, then split 1
        ref, ref_kv = _decode(tmp_path, "float32", "cpu", prompt_len, False, monkeypatch, qk_norm=qk_norm)
        got, got_kv = _decode(tmp_path, "float32", "cpu", prompt_len, True, monkeypatch, qk_norm=qk_norm)
        assert torch.isfinite(got).all()
        err = float((got - ref).norm() / ref.norm())
        assert err < 1e-4, err
        for r, o in zip(ref_kv, got_kv):
            torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-5)
    assert calls, "the fused layer never ran"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graph", [False, True])
def test_gpu_decode_layer_kernel_fused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, graph: bool) -> None:
    """bf16 on CUDA, all phases in one launch per layer (grid barriers): logits
    within bf16 tolerance of the torch path, the K/V the step stored equal, and
    every layer's sync words zero with no barrier timeout."""
    from ftserve.models.decoder import DecoderForCausalLM

    write_checkpoint("tiny-moe", tmp_path, seed=5, dtype="bfloat16")
    ref, ref_kv = _decode(tmp_path, "bfloat16", "cuda", 37, False, monkeypatch)
    seen: list[torch.Tensor] = []
    real_forward = DecoderForCausalLM.forward

    def spy(self: DecoderForCausalLM, batch: object) -> torch.Tensor:
        out = real_forward(self, batch)
        seen.extend(layer._fused_sync for layer in self.layers if hasattr(layer, "_fused_sync"))
        return out

    monkeypatch.setattr(DecoderForCausalLM, "forward", spy)
    got, got_kv = _decode(tmp_path, "bfloat16", "cuda", 37, True, monkeypatch, graph=graph)
    torch.cuda.synchronize()
    assert seen, "the fused layer never ran"
    for sync in seen:
        assert int(sync.abs().sum()) == 0, sync.tolist()
    assert torch.isfinite(got).all()
    err = float((got - ref).norm() / ref.norm())
    assert err < 3e-2, err
    for r, o in zip(ref_kv, got_kv):
        torch.testing.assert_close(o.float(), r.float(), rtol=2e-2, atol=2e-2)


def test_eligible_only_for_batch_one_resident_unobserved_layers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one-launch layer is taken only when switched on, for a one-token decode
    on the Triton kernels and the Triton attention backend, with resident experts
    and no router hooks; everything else keeps the unfused layer."""
    from ftserve.models import fused_layer

    write_checkpoint("tiny-moe", tmp_path, seed=5, dtype="float32")
    model, cfg = load_model(tmp_path, dtype="float32", device="cpu")
    pool = KVPool(cfg.num_layers, 24, PAGE, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    layer = model.layers[0]
    one = build_forward_batch([[7]], [5], [[2, 3]], pool, TritonAttentionBackend(), is_decode=True)
    two = build_forward_batch([[7], [8]], [5, 5], [[2, 3], [4, 5]], pool, TritonAttentionBackend(), is_decode=True)
    torch_attn = build_forward_batch([[7]], [5], [[2, 3]], pool, TorchAttentionBackend(), is_decode=True)
    x1, x2 = torch.zeros(1, cfg.hidden_size), torch.zeros(2, cfg.hidden_size)
    monkeypatch.setenv("FTSERVE_KERNELS", "triton")
    monkeypatch.setenv("FTSERVE_DECODE_LAYER_KERNEL", "1")
    assert fused_layer.eligible(layer, x1, one, model.cos_sin)
    assert not fused_layer.eligible(layer, x2, two, model.cos_sin)  # two tokens
    assert not fused_layer.eligible(layer, x1, torch_attn, model.cos_sin)  # another attention backend
    handle = layer.mlp.gate.register_forward_hook(lambda *a: None)  # someone observes the router
    assert not fused_layer.eligible(layer, x1, one, model.cos_sin)
    handle.remove()
    layer.mlp.expert_compute = lambda x, w, i: x  # an expert cache's slots, not resident weights
    assert not fused_layer.eligible(layer, x1, one, model.cos_sin)
    layer.mlp.expert_compute = None
    fp8 = KVPool(cfg.num_layers, 24, PAGE, cfg.num_kv_heads, cfg.head_dim, torch.float8_e4m3fn, "cpu")
    fp8_step = build_forward_batch([[7]], [5], [[2, 3]], fp8, TritonAttentionBackend(), is_decode=True)
    assert not fused_layer.eligible(layer, x1, fp8_step, model.cos_sin)  # fp8 pages and their scales
    monkeypatch.setenv("FTSERVE_KERNELS", "torch")
    assert not fused_layer.eligible(layer, x1, one, model.cos_sin)  # the torch reference path
    monkeypatch.setenv("FTSERVE_KERNELS", "triton")
    monkeypatch.setenv("FTSERVE_DECODE_LAYER_KERNEL", "0")
    assert not fused_layer.eligible(layer, x1, one, model.cos_sin)  # switched off
