"""PDL on the GPU: a decode layer's kernel chain gives bit-identical
outputs with and without programmatic dependent launch, eagerly and replayed
from a CUDA graph (a missing or misplaced wait would read a producer's output
before it is written: poisoned buffers make that visible)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from ftserve_kernels import pdl
from ftserve_kernels.config import KernelConfig

pytestmark = pytest.mark.gpu


def _chain(g: torch.Generator) -> Callable[[KernelConfig], list[torch.Tensor]]:
    """One decode layer's Triton launches at batch 2, qwen3-30b-a3b widths: input
    norm, o_proj-like GEMV, split-K attention, residual add + norm + router,
    expert gate/up and down."""
    from ftserve_kernels.attention_decode_triton import decode_attention_triton
    from ftserve_kernels.decode_fused_triton import add_norm_route_triton
    from ftserve_kernels.gemv_triton import gemv_triton
    from ftserve_kernels.moe_gemv_triton import fused_moe_gemv_triton
    from ftserve_kernels.norm_triton import fused_add_rms_norm_triton

    dev, bf = "cuda", torch.bfloat16
    t, h, hq, hkv, d, e, k, inter = 2, 2048, 32, 4, 128, 128, 8, 768

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(bf).to(dev)

    x, res = rnd(t, h), rnd(t, h)
    norm_w = (1 + 0.1 * torch.randn(h, generator=g)).to(bf).to(dev)
    w_o = rnd(h, hq * d, scale=0.02)
    gate = rnd(e, h, scale=0.05)
    w13, w2 = rnd(e, 2 * inter, h, scale=0.02), rnd(e, h, inter, scale=0.02)
    page, ctx = 16, 3000
    pages = torch.randperm(512, generator=g)[: 2 * ((ctx + page - 1) // page)].view(2, -1)
    kc, vc = rnd(512 * page, hkv, d), rnd(512 * page, hkv, d)
    table = pages.to(torch.int32).to(dev)
    seq_lens = torch.tensor([ctx, ctx - 777], dtype=torch.int32, device=dev)
    counter = torch.zeros(1, dtype=torch.int32, device=dev)

    def run(kc_: KernelConfig) -> list[torch.Tensor]:
        n1, s1 = fused_add_rms_norm_triton(x, res, norm_w, 1e-6, kernels=kc_)
        q = n1.repeat(1, 2).view(t, hq, d)  # [T, Hq, D] from the normed rows
        attn = decode_attention_triton(q, kc, vc, table, seq_lens, page, d ** -0.5, 16, kernels=kc_)
        o = gemv_triton(attn.view(t, hq * d), w_o, kernels=kc_)
        n2, s2, wts, ids = add_norm_route_triton(o, s1, norm_w, 1e-6, gate, k, True, counter, kernels=kc_)
        out = fused_moe_gemv_triton(n2, w13, w2, wts, ids, kernels=kc_)
        return [n1, s1, attn, o, n2, s2, wts, ids, out]

    return run


def _poison() -> None:
    """Fill the allocator's free blocks with NaN so a read ahead of its producer shows."""
    junk = torch.full((64 << 20,), float("nan"), dtype=torch.float32, device="cuda")
    del junk


def _assert_eager_and_replays_equal(run: Callable[[], list[torch.Tensor]], ref: list[torch.Tensor]) -> None:
    """``run``'s outputs equal ``ref`` bit for bit in eager runs over poisoned free
    memory, and in graph replays over poisoned outputs (the programmatic edges
    live in the captured graph): a read ahead of its producer would show."""
    for _ in range(3):
        _poison()
        for i, (a, b) in enumerate(zip(run(), ref)):
            assert torch.equal(a, b), f"output {i} differs (eager)"
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    for _ in range(5):
        for o in outs:
            o.fill_(-7 if not o.is_floating_point() else float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for i, (a, b) in enumerate(zip(outs, ref)):
            assert torch.equal(a, b), f"output {i} differs (graph replay)"


def _paged_context(g: torch.Generator, rnd: Callable[..., torch.Tensor], hkv: int, d: int) -> tuple[Any, ...]:
    """One sequence of 2,048 tokens in scattered 16-token pages of random K/V, its
    new token's position and slot, and the rotary table: (page, table, k_cache,
    v_cache, seq_lens, positions, out_cache_loc, cos_sin)."""
    dev = "cuda"
    page, ctx = 16, 2048
    table = torch.randperm(512, generator=g)[: ctx // page].view(1, -1).to(torch.int32).to(dev)
    kc, vc = rnd(512 * page, hkv, d), rnd(512 * page, hkv, d)
    seq_lens = torch.tensor([ctx], dtype=torch.int32, device=dev)
    positions = seq_lens.long() - 1
    loc = table[:, -1].long() * page + page - 1  # the new token's slot (position ctx - 1)
    ang = torch.arange(ctx)[:, None] / 10000.0 ** (torch.arange(d // 2) / (d // 2))[None, :]
    cos_sin = torch.cat([ang.cos(), ang.sin()], 1).float().to(dev)  # [ctx, d]
    return page, table, kc, vc, seq_lens, positions, loc, cos_sin


def _decode_qk_chain(g: torch.Generator) -> Callable[[KernelConfig], list[torch.Tensor]]:
    """Batch 1 at qwen3-30b-a3b widths, one decode layer's launches as the model
    makes them: the prenormed qkv GEMV, split-K attention from raw q/k (DecodeQK:
    its norms, rotary and KV store in the split kernel), o_proj, norm + router,
    the experts, with and without the next norm in the down kernel."""
    from ftserve_kernels import ops
    from ftserve_kernels.attention_decode_triton import DecodeQK, decode_attention_triton
    from ftserve_kernels.decode_fused_triton import add_norm_route_triton
    from ftserve_kernels.moe_down_gemv_triton import NormNext
    from ftserve_kernels.moe_gemv_triton import (
        fused_moe_add_norm_gemv_triton,
        fused_moe_gemv_triton,
    )

    dev, bf = "cuda", torch.bfloat16
    h, hq, hkv, d, e, k, inter = 2048, 32, 4, 128, 128, 8, 768

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(bf).to(dev)

    res, xn = rnd(1, h), rnd(1, h)
    w_qkv = rnd((hq + 2 * hkv) * d, h, scale=0.02)
    q_w = (1 + 0.1 * torch.randn(d, generator=g)).to(bf).to(dev)
    k_w = (1 + 0.1 * torch.randn(d, generator=g)).to(bf).to(dev)
    norm_w = (1 + 0.1 * torch.randn(h, generator=g)).to(bf).to(dev)
    w_o = rnd(h, hq * d, scale=0.02)
    gate = rnd(e, h, scale=0.05)
    w13, w2 = rnd(e, 2 * inter, h, scale=0.02), rnd(e, h, inter, scale=0.02)
    page, table, kc, vc, seq_lens, positions, loc, cos_sin = _paged_context(g, rnd, hkv, d)
    counters = [torch.zeros(1, dtype=torch.int32, device=dev) for _ in range(2)]

    def run(kc_: KernelConfig) -> list[torch.Tensor]:
        qkv = ops.linear(kc_, xn, w_qkv, None)
        qh, kh, vh = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        qk = DecodeQK(kh.view(1, hkv, d), vh.view(1, hkv, d), q_w, k_w, 1e-6, positions, cos_sin, loc)
        attn = decode_attention_triton(qh.view(1, hq, d), kc, vc, table, seq_lens, page, d ** -0.5, 128,
                                       qk=qk, kernels=kc_)
        o = ops.linear(kc_, attn.view(1, hq * d), w_o, None)
        n2, s2, wts, ids = add_norm_route_triton(o, res, norm_w, 1e-6, gate, k, True, counters[0], kernels=kc_)
        out = fused_moe_gemv_triton(n2, w13, w2, wts, ids, kernels=kc_)
        n3, s3, _ = fused_moe_add_norm_gemv_triton(n2, w13, w2, wts, ids, NormNext(s2, norm_w, 1e-6, counters[1]),
                                                   kernels=kc_)
        return [qkv, attn, o, n2, s2, wts, ids, out, n3, s3]

    return run


def _dense_chain(g: torch.Generator) -> Callable[[KernelConfig], list[torch.Tensor]]:
    """Two dense decode layers at batch 1, SmolLM2-135M widths, as the model
    launches them (DecoderLayer._dense): the qkv GEMV applying the input norm
    left pending, split-K attention from raw q/k (DecodeQK without norms: the
    rotary and KV store inside), o_proj + residual leaving the post-attention
    norm pending, the GLU gate/up applying it, down + residual leaving the next
    input norm pending for the second layer's qkv."""
    from ftserve_kernels import ops
    from ftserve_kernels.attention_decode_triton import DecodeQK, decode_attention_triton

    dev, bf = "cuda", torch.bfloat16
    h, hq, hkv, d, inter = 576, 9, 3, 64, 1536

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(bf).to(dev)

    res, a0 = rnd(1, h), rnd(1, hq * d)  # a0: the attention output of a layer before
    w_qkv, w_o = rnd((hq + 2 * hkv) * d, h, scale=0.04), rnd(h, hq * d, scale=0.04)
    w13, w2 = rnd(2 * inter, h, scale=0.04), rnd(h, inter, scale=0.025)
    norm_w = (1 + 0.1 * torch.randn(h, generator=g)).to(bf).to(dev)
    page, table, kc, vc, seq_lens, positions, loc, cos_sin = _paged_context(g, rnd, hkv, d)

    def run(kc_: KernelConfig) -> list[torch.Tensor]:
        pending, summed = ops.linear_add_rms_norm(kc_, a0, w_o, None, res, norm_w, 1e-5)
        outs: list[torch.Tensor] = []
        for _ in range(2):
            assert isinstance(pending, ops.PendingNorm)
            qkv, _ = ops.add_rms_norm_linear(kc_, summed, summed, norm_w, 1e-5, w_qkv, None, prenormed=pending)
            qh, kh, vh = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            qk = DecodeQK(kh.view(1, hkv, d), vh.view(1, hkv, d), None, None, 0.0, positions, cos_sin, loc)
            attn = decode_attention_triton(qh.view(1, hq, d), kc, vc, table, seq_lens, page, d ** -0.5, 64,
                                           qk=qk, kernels=kc_)
            post, s1 = ops.linear_add_rms_norm(kc_, attn.view(1, hq * d), w_o, None, summed, norm_w, 1e-5)
            act = ops.gate_up_silu(kc_, post, w13, None, 1e-5)
            pending, summed = ops.linear_add_rms_norm(kc_, act, w2, None, s1, norm_w, 1e-5)
            assert isinstance(post, ops.PendingNorm) and isinstance(pending, ops.PendingNorm)
            outs += [qkv, attn, post.scaled, post.parts, s1, act, pending.scaled, pending.parts, summed]
        return outs

    return run


@pytest.mark.parametrize("chain,seed", [(_chain, 5), (_decode_qk_chain, 9), (_dense_chain, 13)],
                         ids=["layer", "decode_qk", "dense"])
def test_pdl_chain_bit_identical(chain: Callable[..., Any], seed: int) -> None:
    """A decode layer's launches linked by PDL (the plain chain, and the
    model's batch-1 order: DecodeQK attention, the down kernel with the next
    norm; a dense model's two layers): the bits of the unlinked launches, eagerly over poisoned memory and in
    graph replays over poisoned outputs."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs sm_90")
    run = chain(torch.Generator().manual_seed(seed))
    ref = [r.clone() for r in run(KernelConfig(pdl=False))]
    linked = KernelConfig(pdl=True)
    assert pdl.active(ref[0], linked), "PDL should be on for this test"
    _assert_eager_and_replays_equal(lambda: run(linked), ref)
