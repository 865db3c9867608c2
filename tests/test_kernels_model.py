"""The whole model on the Triton kernels (CPU: the interpreter) against the torch
reference path: a tiny Qwen3-MoE checkpoint (per-head q/k norms, so the fused
norm + rotary kernel runs on views into the qkv projection), a packed prefill,
an extend chunk over the cached prefix, and a decode step (GEMV MoE path)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from ftserve.kvcache.pool import KVPool
from ftserve.models.checkpoint import write_checkpoint
from ftserve.models.forward_batch import AttentionBackend, ForwardBatch, build_forward_batch
from ftserve.models.loader import load_model
from ftserve_kernels.attention_triton import TritonAttentionBackend
from ftserve_kernels.config import KernelConfig
from ftserve_kernels.paged_attention import TorchAttentionBackend

PAGE = 4


def run_steps(path: Path, backend: AttentionBackend, kernels: KernelConfig) -> list[torch.Tensor]:
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
                                    is_decode=all(len(t) == 1 for t in toks), kernels=kernels)
        with torch.no_grad():
            outs.append(model(batch))  # [rows, V] fp32
    return outs


def test_model_on_triton_kernels_matches_torch_path(tmp_path: Path) -> None:
    """The decode step (T = 2) runs the decode fusions: norm + router + top-k in
    one launch, the o_proj and qkv GEMVs."""
    write_checkpoint("tiny-moe", tmp_path, seed=5, dtype="float32")
    ref = run_steps(tmp_path, TorchAttentionBackend(), KernelConfig(backend="torch"))
    got = run_steps(tmp_path, TritonAttentionBackend(), KernelConfig(backend="triton"))
    for r, o in zip(ref, got):
        assert o.shape == r.shape and torch.isfinite(o).all()
        err = float((o - r).norm() / r.norm())
        assert err < 1e-4, err


def prefill_then_decode(path: Path, backend: AttentionBackend, kernels: KernelConfig,
                        token_seed: int) -> list[torch.Tensor]:
    """One sequence of a float32 checkpoint: the logits of a 10-token prefill,
    then of one decode step over it (the one-row decode path)."""
    model, cfg = load_model(path, dtype="float32", device="cpu")
    pool = KVPool(cfg.num_layers, 16, PAGE, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(token_seed)
    toks = torch.randint(3, cfg.vocab_size, (11,), generator=gen).tolist()
    outs = []
    for new, prefix in ((toks[:10], 0), (toks[10:], 10)):
        batch = build_forward_batch([new], [prefix], [list(range(1, 5))], pool, backend,
                                    is_decode=len(new) == 1, kernels=kernels)
        with torch.no_grad():
            outs.append(model(batch))
    return outs


def test_one_row_decode_on_triton_matches_torch_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-sequence decode step (batch-1 decode: each layer's MoE down kernel
    leaves the next layer's input norm pending, which that layer's qkv GEMV
    applies from the down kernel's partial sums, and the last one applies the
    final norm; the lm_head is the one-row GEMV) against the torch path. A
    small vocabulary: the interpreter runs the lm_head GEMV program by program."""
    write_checkpoint("tiny-moe", tmp_path, seed=6, dtype="float32", overrides={"vocab_size": 256})

    def run(backend: AttentionBackend, kernels: KernelConfig) -> list[torch.Tensor]:
        return prefill_then_decode(tmp_path, backend, kernels, token_seed=1)

    from ftserve_kernels import decode_inputs as di
    from ftserve_kernels import norm_triton as nt
    from ftserve_kernels import ops

    ref = run(TorchAttentionBackend(), KernelConfig(backend="torch"))
    deferred = {"parts": 0}
    real_gemv = ops.add_rms_norm_linear

    def watching(*a: Any, **kw: Any) -> Any:
        deferred["parts"] += isinstance(kw.get("prenormed"), ops.PendingNorm)
        return real_gemv(*a, **kw)

    monkeypatch.setattr(ops, "add_rms_norm_linear", watching)
    # Layer 0's input norm runs with the embedding gather at decode (one launch
    # for both), not as a norm launch of its own; prefill keeps the norm launch.
    calls: dict[str, int] = {"embed_norm": 0, "rms_norm": 0}
    for mod, name, key in ((di, "embed_rms_norm_triton", "embed_norm"), (nt, "rms_norm_triton", "rms_norm")):
        def counting(*a: Any, _real: Any = getattr(mod, name), _key: str = key, **kw: Any) -> Any:
            calls[_key] += 1
            return _real(*a, **kw)
        monkeypatch.setattr(mod, name, counting)
    ops._triton_table.cache_clear()
    try:
        got = run(TritonAttentionBackend(), KernelConfig(backend="triton"))
    finally:
        ops._triton_table.cache_clear()
    assert calls == {"embed_norm": 1, "rms_norm": 1}, calls
    assert deferred["parts"] > 0, deferred  # tiny-moe's layers after the first take the pending norm
    for r, o in zip(ref, got):
        assert o.shape == r.shape and torch.isfinite(o).all()
        err = float((o - r).norm() / r.norm())
        assert err < 1e-4, err


def _label(name: str, consts: dict[str, Any]) -> str:
    flags = sorted(k for k in ("GLU", "HAS_PARTS", "NORM_DEFER", "QK", "NORM", "STORE") if consts.get(k))
    return "+".join([name.strip("_").removesuffix("_kernel"), *flags])


# One decode row of a dense layer: the qkv GEMV (applying the input norm left
# pending), the split kernel (rotary and KV store inside; no q/k norms), its
# reduce, o_proj + residual leaving the post-attention norm pending, gate/up
# applying it with SiLU * up, down + residual leaving the next input norm pending.
DENSE_LAYER = ["gemv+HAS_PARTS", "decode_split+QK", "decode_reduce", "gemv+NORM_DEFER", "gemv+GLU+HAS_PARTS",
               "gemv+NORM_DEFER"]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="counts the interpreter's launches")
def test_dense_decode_row_takes_the_folded_launches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SmolLM2-shaped tiny Llama (tied embeddings, no q/k norms; three layers)
    decoding one row on the Triton kernels: six launches a layer (DENSE_LAYER;
    layer 0's input norm comes with the embedding rows, the last layer's down is
    plain and the final norm its own launch), no cuBLAS linear, no SiLU or product
    launch. Its logits are the torch reference path's: fp32 to 1e-5, bf16 to a
    relative L2 error of 5e-2 (the torch bf16 path is itself ~1e-2 from fp32; the
    interpreter truncates bf16 casts where CUDA rounds)."""
    from triton.runtime.interpreter import InterpretedFunction

    write_checkpoint("tiny-dense", tmp_path, seed=6, dtype="float32", overrides={
        "vocab_size": 64, "intermediate_size": 48, "tie_word_embeddings": True, "num_hidden_layers": 3})
    launches: list[str] = []
    linears = {"linear": 0, "silu": 0}
    real_run = InterpretedFunction.run

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        launches.append(_label(self.fn.__name__, kwargs))
        return real_run(self, *args, **kwargs)

    def counting(name: str) -> Any:
        real = getattr(torch.nn.functional, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            linears[name] += 1
            return real(*args, **kwargs)
        return call

    def decode(dtype: str, backend: AttentionBackend, kernels: KernelConfig) -> list[torch.Tensor]:
        model, cfg = load_model(tmp_path, dtype=dtype, device="cpu")
        pool = KVPool(cfg.num_layers, 16, PAGE, cfg.num_kv_heads, cfg.head_dim, getattr(torch, dtype), "cpu")
        toks = torch.randint(3, cfg.vocab_size, (6,), generator=torch.Generator().manual_seed(1)).tolist()
        outs = []
        for new, prefix in ((toks[:5], 0), (toks[5:], 5)):
            batch = build_forward_batch([new], [prefix], [list(range(1, 3))], pool, backend,
                                        is_decode=len(new) == 1, kernels=kernels)
            launches.clear()
            linears.update(linear=0, silu=0)
            with torch.no_grad(), monkeypatch.context() as m:
                m.setattr(InterpretedFunction, "run", run)
                for name in linears:
                    m.setattr(torch.nn.functional, name, counting(name))
                outs.append(model(batch))
        return outs

    from ftserve_kernels import ops

    ops._triton_table.cache_clear()
    try:
        for dtype, tol in (("float32", 1e-5), ("bfloat16", 5e-2)):
            ref = decode(dtype, TorchAttentionBackend(), KernelConfig(backend="torch"))
            got = decode(dtype, TritonAttentionBackend(), KernelConfig(backend="triton"))
            want = ["embed_norm", *(["gemv"] + DENSE_LAYER[1:]), *DENSE_LAYER, *DENSE_LAYER[:-1], "gemv",
                    "rms_norm", "gemv"]
            assert launches == want, launches
            assert linears == {"linear": 0, "silu": 0}, linears
            for r, o in zip(ref, got):
                assert o.shape == r.shape and torch.isfinite(o).all()
                err = float((o.float() - r.float()).norm() / r.float().norm())
                assert err < tol, (dtype, err)
    finally:
        ops._triton_table.cache_clear()


@pytest.mark.parametrize("rows,gemv_rows", [(1, [1]), (2, [])])
def test_lm_head_gemv_takes_one_row(monkeypatch: pytest.MonkeyPatch, rows: int, gemv_rows: list[int]) -> None:
    """ops.linear_fp32 (the lm_head) runs the Triton GEMV for one row, cuBLAS /
    F.linear otherwise; same logits either way."""
    import dataclasses

    import torch.nn.functional as F

    from ftserve_kernels import ops

    kernels = KernelConfig(backend="triton")
    real = ops._table(kernels, torch.empty(0))
    seen: list[int] = []

    def spy(x: torch.Tensor, *args: object, **kwargs: object) -> object:
        seen.append(x.shape[0])
        return real.gemv(x, *args, **kwargs)

    monkeypatch.setattr(ops, "_table", lambda kc, t: dataclasses.replace(real, gemv=spy))
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(rows, 64, generator=g), torch.randn(300, 64, generator=g)
    got = ops.linear_fp32(kernels, x, w)
    assert got.dtype == torch.float32 and seen == gemv_rows
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-4)
    # bf16 weights: the GEMV writes fp32 logits holding bf16-rounded values, as
    # F.linear(...).float() gives (the sampler reads them without a cast launch).
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    got = ops.linear_fp32(kernels, xb, wb)
    assert got.dtype == torch.float32
    assert torch.equal(got, got.to(torch.bfloat16).float()), "values are bf16-rounded"
    torch.testing.assert_close(got, F.linear(xb, wb).float(), rtol=2e-2, atol=2e-2)


def test_logits_rows_with_and_without_gathers(tmp_path: Path) -> None:
    """logits_indices picks the last token of each sequence: a decode batch (every
    token a row; the model skips the gathers) and a prefill (real gathers) give
    the matching rows of the every-token logits."""
    write_checkpoint("tiny-moe", tmp_path, seed=5, dtype="float32")
    model, cfg = load_model(tmp_path, dtype="float32", device="cpu")
    pool = KVPool(cfg.num_layers, 40, PAGE, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    backend = TorchAttentionBackend()
    pages = [list(range(1, 8)), list(range(20, 23))]
    steps = [([[5, 6, 7, 8], [9, 10]], [0, 0], False, [3, 5]), ([[11], [12]], [4, 2], True, [0, 1])]
    with torch.no_grad():
        for toks, prefix, decode, rows in steps:
            full = model(build_forward_batch(toks, prefix, pages, pool, backend, all_logits=True,
                                             is_decode=decode))
            picked = model(build_forward_batch(toks, prefix, pages, pool, backend, is_decode=decode))
            torch.testing.assert_close(picked, full[rows], rtol=1e-5, atol=1e-5)  # GEMM blocking


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_prefill_chunk_graph_replay(tmp_path: Path) -> None:
    """A whole prefill forward (norms, fused q/k norm + rotary, KV store, extend
    with a static grid bound, MoE) captured once for a 32-token budget over two
    sequences, replayed with the tokens split differently: equals eager."""
    write_checkpoint("tiny-moe", tmp_path, seed=5, dtype="bfloat16")
    model, cfg = load_model(tmp_path, dtype="bfloat16", device="cuda")
    pool = KVPool(cfg.num_layers, 40, PAGE, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cuda")
    budget = 32
    pages = [list(range(1, 9)), list(range(10, 18))]  # 32 slots each: any split fits
    g = torch.Generator().manual_seed(4)
    toks = torch.randint(3, cfg.vocab_size, (budget,), generator=g).tolist()

    def batch_for(split: int, backend: AttentionBackend) -> ForwardBatch:
        return build_forward_batch([toks[:split], toks[split:]], [0, 0], pages, pool, backend,
                                   all_logits=True)

    graph_backend = TritonAttentionBackend(extend_token_bound=budget)
    static = batch_for(20, graph_backend)
    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # compile every kernel outside the capture
            model(static)
            model(static)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = model(static)  # [budget, V]
        for split in (20, 7, 31):
            new = batch_for(split, graph_backend)
            for name in ("input_ids", "positions"):
                getattr(static, name).copy_(getattr(new, name))
            for name in ("qo_indptr", "seq_lens", "prefix_lens", "page_table", "out_cache_loc"):
                getattr(static.attn, name).copy_(getattr(new.attn, name))
            logits.fill_(float("nan"))
            graph.replay()
            eager = model(batch_for(split, TritonAttentionBackend()))
            torch.cuda.synchronize()
            assert torch.isfinite(logits).all()
            err = float((logits - eager).norm() / eager.norm())
            assert err < 1e-2, (split, err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_decode_step_fusions_graph(tmp_path: Path) -> None:
    """A bf16 decode step of two sequences (logits rows = every token: the
    gathers are skipped) on the decode fusions: the captured graph replays the
    eager step, and both agree with the torch reference path."""
    write_checkpoint("tiny-moe", tmp_path, seed=5, dtype="bfloat16")
    model, cfg = load_model(tmp_path, dtype="bfloat16", device="cuda")
    pool = KVPool(cfg.num_layers, 40, PAGE, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cuda")
    g = torch.Generator().manual_seed(3)
    a, b = (torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in (21, 6))
    pages = [list(range(1, 8)), list(range(20, 23))]
    backend = TritonAttentionBackend()
    with torch.no_grad():
        model(build_forward_batch([a, b], [0, 0], pages, pool, backend))  # fill the KV cache
        step = build_forward_batch([[7], [9]], [21, 6], pages, pool, backend, is_decode=True)
        assert step.logits_indices is not None
        eager = model(step)  # [2, V]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            model(step)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = model(step)
        logits.fill_(float("nan"))
        graph.replay()
        ref = model(build_forward_batch([[7], [9]], [21, 6], pages, pool, TorchAttentionBackend(),
                                        is_decode=True, kernels=KernelConfig(backend="torch")))
    torch.cuda.synchronize()
    assert torch.isfinite(logits).all()
    assert float((logits - eager).norm() / eager.norm()) < 1e-3
    assert float((eager - ref).norm() / ref.norm()) < 3e-2
