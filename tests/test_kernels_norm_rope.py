"""Triton RMSNorm (plain and fused with the residual add) and rotary against the twins."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # The interpreter is chosen when a kernel is decorated (see test_kernels_attention).
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in ("ftserve_kernels.norm_triton", "ftserve_kernels.rope_triton",
                  "ftserve_kernels.gemv_triton"):
        if _name in sys.modules:
            importlib.reload(sys.modules[_name])

from ftserve_kernels.gemv_triton import gemv_triton  # noqa: E402
from ftserve_kernels.norm_rope import (  # noqa: E402
    fused_add_rms_norm_ref,
    gated_rms_norm_ref,
    qk_norm_rotary_ref,
    rms_norm_ref,
    rotary_ref,
)
from ftserve_kernels.norm_triton import (  # noqa: E402
    fused_add_rms_norm_triton,
    gated_rms_norm_triton,
    norm_launch_params,
    rms_norm_triton,
)
from ftserve_kernels.rope_triton import qk_norm_rotary_triton, rotary_triton  # noqa: E402


def cos_sin_table(max_pos: int, rot: int, base: float = 10000.0) -> torch.Tensor:
    inv = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)  # [rot/2]
    ang = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]  # [P, rot/2]
    return torch.cat([ang.cos(), ang.sin()], dim=-1)  # [P, rot]


def close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:  # one bf16 rounding step apart at most
        torch.testing.assert_close(out.float(), ref.float(), rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h", [64, 48])  # 48: non-power-of-two width, masked tail
def test_rms_norm(dtype: torch.dtype, h: int) -> None:
    g = torch.Generator().manual_seed(h)
    x = (3 * torch.randn(5, h, generator=g)).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype).to(DEVICE)
    close(rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))


def test_rms_norm_many_rows_per_program() -> None:
    """Row counts that leave the last multi-row program partly empty, rows of a
    strided (non-contiguous) view, with and without the residual."""
    h = 32
    block_r = norm_launch_params(h)[1]
    assert block_r > 1
    g = torch.Generator().manual_seed(7)
    for t in (block_r - 1, 2 * block_r + 3):
        big = (2 * torch.randn(t, 3 * h, generator=g)).to(DEVICE)
        x = big[:, h : 2 * h]  # row stride 3h
        r = torch.randn(t, h, generator=g).to(DEVICE)
        w = (1 + 0.1 * torch.randn(h, generator=g)).to(DEVICE)
        close(rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
        out, summed = fused_add_rms_norm_triton(x, r, w, 1e-6)
        ref_out, ref_sum = fused_add_rms_norm_ref(x, r, w, 1e-6)
        close(out, ref_out)
        assert torch.equal(summed, ref_sum)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 32, generator=g).to(dtype).to(DEVICE)  # any leading shape
    r = torch.randn(4, 3, 32, generator=g).to(dtype).to(DEVICE)
    w = torch.randn(32, generator=g).to(dtype).to(DEVICE)
    x0, r0 = x.clone(), r.clone()
    out, summed = fused_add_rms_norm_triton(x, r, w, 1e-5)
    ref_out, ref_sum = fused_add_rms_norm_ref(x, r, w, 1e-5)
    if DEVICE == "cuda" or dtype == torch.float32:
        assert torch.equal(summed, ref_sum)
    else:  # the 3.9 interpreter truncates fp32 -> bf16 instead of rounding to nearest
        close(summed, ref_sum)
    close(out, ref_out)
    assert torch.equal(x, x0) and torch.equal(r, r0), "inputs are not modified"


def bf16_close(out: torch.Tensor, ref: torch.Tensor, ulps: int = 1) -> None:
    """On the CPU the 3.9 interpreter truncates fp32 -> bf16 where torch rounds to
    nearest: each rounding a kernel shares with the reference may differ by an ulp."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if DEVICE == "cuda" or out.dtype == torch.float32:
        close(out, ref)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=ulps * 1.6e-2, atol=ulps * 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_centered_norms(dtype: torch.dtype) -> None:
    """Qwen3-Next's norm(x) * (1 + w) rounded once: alone, after the residual add,
    and after the shared-expert combine (routed + sigmoid(logit) * shared, then the
    add), on a strided row view."""
    g = torch.Generator().manual_seed(11)
    t, h = 7, 48
    big = (2 * torch.randn(t, 2 * h, generator=g)).to(dtype).to(DEVICE)
    x = big[:, h:]  # row stride 2h
    r = torch.randn(t, h, generator=g).to(dtype).to(DEVICE)
    w = (0.1 * torch.randn(h, generator=g)).to(dtype).to(DEVICE)  # zero-centered: near 0
    y = torch.randn(t, h, generator=g).to(dtype).to(DEVICE)
    logit = (2 * torch.randn(t, 1, generator=g)).to(dtype).to(DEVICE)
    bf16_close(rms_norm_triton(x, w, 1e-6, zero_centered=True), rms_norm_ref(x, w, 1e-6, zero_centered=True))
    assert not torch.allclose(rms_norm_ref(x, w, 1e-6, zero_centered=True).float(),
                              rms_norm_ref(x, w, 1e-6).float(), atol=1e-2), "1 + w is not w"
    for shared in (None, (y, logit)):
        out, summed = fused_add_rms_norm_triton(x, r, w, 1e-6, zero_centered=True, shared=shared)
        ref_out, ref_sum = fused_add_rms_norm_ref(x, r, w, 1e-6, zero_centered=True, shared=shared)
        if DEVICE == "cuda" or dtype == torch.float32:
            torch.testing.assert_close(summed, ref_sum, rtol=1e-6, atol=1e-6)
        else:  # three roundings before the sum
            bf16_close(summed, ref_sum, ulps=3)
        bf16_close(out, ref_out, ulps=1 if shared is None else 3)
    plain = fused_add_rms_norm_triton(x, r, w, 1e-6, zero_centered=True)[1]
    assert not torch.allclose(summed.float(), plain.float()), "the shared expert was added"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_reads_the_gate_in_place(dtype: torch.dtype) -> None:
    """Gated DeltaNet's w * norm(o) * SiLU(z): z a [T, Hk, r, dv] view into a
    projection row (value heads grouped by key head), and a plain [T, NH, D] gate;
    rows spanning several programs (T * NH = 40, a partial last one)."""
    g = torch.Generator().manual_seed(12)
    t, hk, r, d = 5, 2, 4, 24  # 24: a masked head tail
    proj = torch.randn(t, hk, 3 * r * d, generator=g).to(dtype).to(DEVICE)  # per key head: [. | z | .]
    z = proj[:, :, r * d : 2 * r * d].view(t, hk, r, d)
    o = (3 * torch.randn(t, hk * r, d, generator=g)).to(dtype).to(DEVICE)
    w = (1 + 0.2 * torch.randn(d, generator=g)).to(dtype).to(DEVICE)
    want = gated_rms_norm_ref(o, z, w, 1e-6)
    got = gated_rms_norm_triton(o, z, w, 1e-6)
    assert got.is_contiguous()
    bf16_close(got, want, ulps=2)
    plain = z.reshape(t, hk * r, d)  # a copy: value head h = key head h // r, member h % r
    bf16_close(gated_rms_norm_triton(o, plain, w, 1e-6), want, ulps=2)
    bf16_close(got, gated_rms_norm_ref(o, plain, w, 1e-6), ulps=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,inter", [(0, 8), (1, 20), (5, 1536), (3, 1100)])
def test_silu_mul_in_place_matches_ref(dtype: torch.dtype, t: int, inter: int) -> None:
    """SiLU(gate) * up over [T, 2I] rows (one or more column blocks, a ragged last
    one) equals silu_mul_ref and lands in the gate half, the up half untouched;
    rows of a wider buffer (a row stride past 2I) are read and written in place."""
    from ftserve_kernels.glu_triton import silu_mul_triton
    from ftserve_kernels.norm_rope import silu_mul_ref

    g = torch.Generator().manual_seed(t + inter)
    buf = (3 * torch.randn(t, 2 * inter + 8, generator=g)).to(dtype).to(DEVICE)
    gate_up = buf[:, :2 * inter]  # row stride 2I + 8
    want = silu_mul_ref(gate_up.clone())
    up, tail = gate_up[:, inter:].clone(), buf[:, 2 * inter:].clone()
    got = silu_mul_triton(gate_up)
    assert got.shape == (t, inter) and got.data_ptr() == gate_up.data_ptr()
    bf16_close(got, want)
    assert torch.equal(gate_up[:, inter:], up) and torch.equal(buf[:, 2 * inter:], tail)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rotary_zero_centered_partial_with_store(dtype: torch.dtype) -> None:
    """Qwen3-Next's attention: q a [T, Hq, D] view strided by its interleaved gate
    (head stride 2D), zero-centered q/k norms, a quarter of the head rotated, the
    KV store in the same launch."""
    g = torch.Generator().manual_seed(13)
    t, hq, hk, d, rot, slots = 9, 4, 2, 32, 8, 24
    qg = (3 * torch.randn(t, hq, 2, d, generator=g)).to(dtype).to(DEVICE)
    q = qg[:, :, 0]  # [T, Hq, D], the gate between heads
    kv = torch.randn(t, 2, hk, d, generator=g).to(dtype).to(DEVICE)
    k, v = kv[:, 0], kv[:, 1]
    qw = (0.2 * torch.randn(d, generator=g)).to(dtype).to(DEVICE)
    kw = (0.2 * torch.randn(d, generator=g)).to(dtype).to(DEVICE)
    table = cos_sin_table(64, rot).to(DEVICE)
    pos = torch.randint(0, 64, (t,), generator=g).to(DEVICE)
    loc = torch.randperm(slots, generator=g)[:t].to(DEVICE)
    caches = [torch.zeros(slots, hk, d, dtype=dtype, device=DEVICE) for _ in range(4)]
    qo, ko = qk_norm_rotary_triton(q, k, qw, kw, 1e-6, pos, table, (caches[0], caches[1], v, loc),
                                   zero_centered=True)
    rq, rk = qk_norm_rotary_ref(q, k, qw, kw, 1e-6, pos, table, (caches[2], caches[3], v, loc),
                                zero_centered=True)
    for out, ref in ((qo, rq), (ko, rk), (caches[0], caches[2])):
        bf16_close(out, ref, ulps=3)
    assert torch.equal(caches[1], caches[3])
    plain = qk_norm_rotary_ref(q, k, qw, kw, 1e-6, pos, table)[0]
    assert not torch.allclose(plain.float(), rq.float(), atol=1e-2), "1 + w is not w"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot", [16, 8])  # 8 < head_dim 16: partial rotary tail passes through
def test_rotary(dtype: torch.dtype, rot: int) -> None:
    g = torch.Generator().manual_seed(rot)
    t, hq, hk, d = 6, 4, 2, 16
    table = cos_sin_table(64, rot).to(DEVICE)
    q = torch.randn(t, hq, d, generator=g).to(dtype).to(DEVICE)
    k = torch.randn(t, hk, d, generator=g).to(dtype).to(DEVICE)
    pos = torch.tensor([0, 1, 5, 63, 7, 2], dtype=torch.int64, device=DEVICE)
    qo, ko = rotary_triton(q, k, pos, table)
    rq, rk = rotary_ref(q, k, pos, table)
    close(qo, rq)
    close(ko, rk)


def test_rotary_strided_views() -> None:
    """q and k sliced out of one fused qkv projection (non-contiguous heads)."""
    t, hq, hk, d = 3, 4, 2, 16
    qkv = torch.randn(t, (hq + 2 * hk) * d).to(DEVICE)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    table = cos_sin_table(16, d).to(DEVICE)
    pos = torch.tensor([3, 9, 15], device=DEVICE)
    qo, ko = rotary_triton(q, k, pos, table)
    rq, rk = rotary_ref(q, k, pos, table)
    close(qo, rq)
    close(ko, rk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot", [16, 8])  # 8: partial rotary, the tail is normed only
def test_qk_norm_rotary(dtype: torch.dtype, rot: int) -> None:
    """Fused per-head q/k norm + rotary on views into one qkv projection output,
    with enough rows that q spans several programs and k a partial one."""
    g = torch.Generator().manual_seed(rot)
    t, hq, hk, d = 37, 4, 2, 16
    qkv = (3 * torch.randn(t, (hq + 2 * hk) * d, generator=g)).to(dtype).to(DEVICE)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    qw = (1 + 0.2 * torch.randn(d, generator=g)).to(dtype).to(DEVICE)
    kw = (1 + 0.2 * torch.randn(d, generator=g)).to(dtype).to(DEVICE)
    table = cos_sin_table(128, rot).to(DEVICE)
    pos = torch.randint(0, 128, (t,), generator=g).to(DEVICE)
    qo, ko = qk_norm_rotary_triton(q, k, qw, kw, 1e-6, pos, table)
    rq, rk = qk_norm_rotary_ref(q, k, qw, kw, 1e-6, pos, table)
    assert qo.is_contiguous() and ko.is_contiguous()
    if DEVICE == "cuda" or dtype == torch.float32:
        close(qo, rq)
        close(ko, rk)
    else:  # the interpreter truncates at each of the three bf16 roundings: a few ulps
        for out, ref in ((qo, rq), (ko, rk)):
            torch.testing.assert_close(out.float(), ref.float(), rtol=4e-2, atol=4e-2)


@pytest.mark.parametrize("rot", [16, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
def test_qk_norm_rotary_with_kv_store(rot: int, dtype: torch.dtype, norm: bool) -> None:
    """The q/k norm + rotary launch that also stores K/V: q and k as without the store, the rotated
    k and the untouched v at each token's slot, every other slot untouched. Without the norms
    (a model without q/k norms: ops.rotary with kv_store) the same launch is rotary_ref's
    rotary plus the store."""
    from ftserve_kernels import ops
    from ftserve_kernels.config import KernelConfig

    g = torch.Generator().manual_seed(7 + rot)
    t, hq, hk, d, slots = 21, 4, 2, 16, 64
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).to(dtype).to(DEVICE)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d :].view(t, hk, d)
    qw = (1 + 0.2 * torch.randn(d, generator=g)).to(dtype).to(DEVICE) if norm else None
    kw = (1 + 0.2 * torch.randn(d, generator=g)).to(dtype).to(DEVICE) if norm else None
    table = cos_sin_table(128, rot).to(DEVICE)
    pos = torch.randint(0, 128, (t,), generator=g).to(DEVICE)
    loc = torch.randperm(slots, generator=g)[:t].to(DEVICE)
    caches = [torch.full((slots, hk, d), 7.0, dtype=dtype, device=DEVICE) for _ in range(4)]
    if norm:
        qo, ko = qk_norm_rotary_triton(q, k, qw, kw, 1e-6, pos, table, (caches[0], caches[1], v, loc))
    else:
        qo, ko = ops.rotary(KernelConfig(backend="triton"), q, k, pos, table, (caches[0], caches[1], v, loc))
    rq, rk = qk_norm_rotary_ref(q, k, qw, kw, 1e-6, pos, table, (caches[2], caches[3], v, loc))
    if not norm:  # the rotary alone, rounded once: as rotary_ref, the store apart
        assert all(torch.equal(a, b) for a, b in zip((rq, rk), rotary_ref(q, k, pos, table)))
    if norm and dtype == torch.bfloat16 and DEVICE == "cpu":  # the interpreter truncates its roundings
        for out, ref in ((qo, rq), (ko, rk), (caches[0], caches[2])):
            torch.testing.assert_close(out.float(), ref.float(), rtol=4e-2, atol=4e-2)
    else:
        close(qo, rq)
        close(ko, rk)
        close(caches[0], caches[2])
    assert torch.equal(caches[1], caches[3]) and torch.equal(caches[1][loc], v)
    assert torch.equal(caches[0][loc], ko)
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[loc.cpu()] = False
    assert (caches[0][untouched.to(DEVICE)] == 7.0).all(), "a slot outside out_cache_loc changed"


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
def test_gpu_norm_rope_real_shapes() -> None:
    t, h, hq, hk, d = 8192, 2048, 32, 4, 128
    x = torch.randn(t, h, device="cuda").bfloat16()
    r = torch.randn(t, h, device="cuda").bfloat16()
    w = torch.randn(h, device="cuda").bfloat16()
    out, summed = fused_add_rms_norm_triton(x, r, w, 1e-6)
    ref_out, ref_sum = fused_add_rms_norm_ref(x, r, w, 1e-6)
    assert torch.equal(summed, ref_sum)
    close(out, ref_out)
    close(rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    table = cos_sin_table(262_144, d).cuda()
    pos = torch.randint(0, 262_144, (t,), device="cuda")
    q = torch.randn(t, hq, d, device="cuda").bfloat16()
    k = torch.randn(t, hk, d, device="cuda").bfloat16()
    qo, ko = rotary_triton(q, k, pos, table)
    rq, rk = rotary_ref(q, k, pos, table)
    close(qo, rq)
    close(ko, rk)
    qkv = torch.randn(t, (hq + 2 * hk) * d, device="cuda").bfloat16()
    qv = qkv[:, : hq * d].view(t, hq, d)
    kv = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    qw = torch.randn(d, device="cuda").bfloat16()
    kw = torch.randn(d, device="cuda").bfloat16()
    qo, ko = qk_norm_rotary_triton(qv, kv, qw, kw, 1e-6, pos, table)
    rq, rk = qk_norm_rotary_ref(qv, kv, qw, kw, 1e-6, pos, table)
    close(qo, rq)
    close(ko, rk)
    vv = qkv[:, (hq + hk) * d :].view(t, hk, d)
    loc = torch.randperm(4 * t, device="cuda")[:t]
    kc, vc = (torch.zeros(4 * t, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    qs, ks = qk_norm_rotary_triton(qv, kv, qw, kw, 1e-6, pos, table, (kc, vc, vv, loc))
    assert torch.equal(qs, qo) and torch.equal(ks, ko)  # the store changes nothing else
    assert torch.equal(kc[loc], ko) and torch.equal(vc[loc], vv)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("t,inter", [(5, 1536), (4096, 768), (4096, 12288)])  # k = 4 verify; prefill
def test_gpu_silu_mul_real_shapes_graph(t: int, inter: int) -> None:
    """SmolLM2's MLP in a 5-row verify step, an expert-sized and a wide prefill:
    bf16 within an ulp of silu_mul_ref (CUDA's exp against Triton's), the up half
    untouched, and a CUDA-graph replay of the PDL launch equal to the eager one."""
    from ftserve_kernels.glu_triton import silu_mul_triton
    from ftserve_kernels.norm_rope import silu_mul_ref

    src = (3 * torch.randn(t, 2 * inter, device="cuda")).bfloat16()
    want = silu_mul_ref(src.clone())
    gate_up = src.clone()
    got = silu_mul_triton(gate_up)
    torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-5)
    assert torch.equal(gate_up[:, inter:], src[:, inter:])
    static = src.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = silu_mul_triton(static)
    static.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)


# ---------------------------------------------------------------- dense GEMV


@pytest.mark.parametrize("t", [1, 2, 3])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("k,block", [(56, None), (600, (4, 512))])  # (4, 512): 2 warp-width sub-chunks
def test_gemv_matches_linear(t: int, bias: bool, k: int, block: tuple[int, int] | None) -> None:
    """N, K not multiples of the blocks (masked tails); T = 3 pads the row block."""
    g = torch.Generator().manual_seed(t)
    n = 37
    x = torch.randn(t, k, generator=g).to(DEVICE)
    w = torch.randn(n, k, generator=g).to(DEVICE)
    b = torch.randn(n, generator=g).to(DEVICE) if bias else None
    y = gemv_triton(x, w, b, block=block)
    assert y.shape == (t, n)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4)


def glu_ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The composition the GLU GEMV replaces: linear, SiLU of the gate half, times the up half."""
    gate_up = torch.nn.functional.linear(x, w, b)
    inter = w.shape[0] // 2
    return torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]


def close_rounded(out: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: to summation order; bf16: a few roundings apart (three bf16 roundings
    in a row, which the interpreter truncates)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    tol = 1e-5 if out.dtype == torch.float32 else 4e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("t", [1, 2, 3, 4])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_glu_matches_composition(t: int, bias: bool, dtype: torch.dtype) -> None:
    """The GLU GEMV (a gated MLP's gate/up, glu=True): SiLU(gate) * up as F.linear,
    F.silu and the product round them; odd K (masked tail), I not a multiple of a
    program's columns, T = 3 padding the row block."""
    g = torch.Generator().manual_seed(20 + t)
    k, inter = 37, 21
    x = torch.randn(t, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(2 * inter, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    b = torch.randn(2 * inter, generator=g).to(dtype).to(DEVICE) if bias else None
    y = gemv_triton(x, w, b, glu=True)
    assert y.shape == (t, inter)
    close_rounded(y, glu_ref(x, w, b))


@pytest.mark.parametrize("t", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_add_norm_leaves_the_norm_pending(t: int, dtype: torch.dtype) -> None:
    """gemv_add_norm_triton: the sum s = linear(x) + residual as fused_add_rms_norm
    rounds it, weight * s, and per program a partial sum of squares that add up to
    the row's; the GEMV given those parts computes linear(rms_norm(s)), and so does
    the GLU GEMV (the post-attention norm pending into a gated MLP's gate/up)."""
    from ftserve_kernels.gemv_triton import gemv_add_norm_triton
    from ftserve_kernels.moe_down_gemv_triton import NormNext

    g = torch.Generator().manual_seed(30 + t)
    k, n, inter = 45, 40, 12
    x = torch.randn(t, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE)
    r = torch.randn(t, n, generator=g).to(dtype).to(DEVICE)
    nw = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype).to(DEVICE)
    wq = (torch.randn(2 * inter, n, generator=g) / n**0.5).to(dtype).to(DEVICE)
    ref_n, ref_s = fused_add_rms_norm_ref(torch.nn.functional.linear(x, w, b), r, nw, 1e-6)
    scaled, summed, parts = gemv_add_norm_triton(x, w, b, NormNext(r, nw, 1e-6, None, deferred=True))
    assert parts.dtype == torch.float32 and parts.shape[0] == t and parts.shape[1] > 1
    close_rounded(summed, ref_s)
    torch.testing.assert_close(parts.sum(1), summed.float().pow(2).sum(1), rtol=1e-5, atol=1e-5)
    close_rounded(scaled, (nw.float() * summed.float()).to(dtype))
    # The consumers apply the norm unrounded: fp32 to float rounding, bf16 within its tolerance.
    close_rounded(gemv_triton(scaled, wq, None, 1e-6, parts=parts), torch.nn.functional.linear(ref_n, wq))
    close_rounded(gemv_triton(scaled, wq, None, 1e-6, parts=parts, glu=True), glu_ref(ref_n, wq, None))


def test_ops_dense_gemv_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """On Triton ops.linear runs the GEMV up to GEMV_MAX_ROWS rows, F.linear past
    them and with KernelConfig.dense_gemv off; ops.add_rms_norm_linear norms
    first, then takes linear's choice (a decode step's qkv arrives normed,
    prenormed, or pending). Results equal the composition either way."""
    from ftserve_kernels import gemv_triton as gv
    from ftserve_kernels import ops
    from ftserve_kernels.config import KernelConfig

    calls: list[int] = []

    def counting(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return gemv_triton(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(gv, "gemv_triton", counting)
    ops._triton_table.cache_clear()
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 32, generator=g).to(DEVICE)
    nw = torch.ones(32).to(DEVICE)
    try:
        for t, n_calls, kernels in [(2, 4, KernelConfig(backend="triton")),
                                    (gv.GEMV_MAX_ROWS + 1, 0, KernelConfig(backend="triton")),
                                    (2, 0, KernelConfig(backend="triton", dense_gemv=False))]:
            x = torch.randn(t, 32, generator=g).to(DEVICE)
            r = torch.randn(t, 32, generator=g).to(DEVICE)
            n0 = len(calls)
            y = ops.linear(kernels, x, w, None)
            y1, s1 = ops.add_rms_norm_linear(kernels, x, r, nw, 1e-6, w, None, prenormed=True)
            y2, s2 = ops.add_rms_norm_linear(kernels, x, r, nw, 1e-6, w, None)
            y3, s3 = ops.add_rms_norm_linear(kernels, x, None, nw, 1e-6, w, None)
            assert len(calls) - n0 == n_calls, (t, kernels)
            torch.testing.assert_close(y, torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(y1, y) and s1 is r
            n2, want = fused_add_rms_norm_ref(x, r, nw, 1e-6)
            torch.testing.assert_close(y2, torch.nn.functional.linear(n2, w), rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(s2, want)
            torch.testing.assert_close(y3, torch.nn.functional.linear(rms_norm_ref(x, nw, 1e-6), w),
                                       rtol=1e-5, atol=1e-4)
            assert s3 is x
    finally:
        ops._triton_table.cache_clear()


def test_ops_dense_mlp_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """ops.linear_add_rms_norm leaves the norm pending (one GEMV launch) exactly
    where ops.dense_folds_norm says, ops.gate_up_silu runs the GLU GEMV where
    linear runs the GEMV and applies a pending norm there, add_rms_norm_linear
    applies one too; past GEMV_MAX_ROWS, on the torch path and with dense_gemv
    off, the composition, its SiLU * up one glu_triton launch on Triton. Every
    way equals the composition."""
    from ftserve_kernels import gemv_triton as gv
    from ftserve_kernels import glu_triton as gl
    from ftserve_kernels import ops
    from ftserve_kernels.config import KernelConfig

    calls: list[str] = []

    def spy(name: str, mod: object = gv) -> object:
        real = getattr(mod, name)

        def counting(*args: object, **kwargs: object) -> object:
            calls.append(name + (":glu" if kwargs.get("glu") else "") + (":parts" if kwargs.get("parts") is not None
                                                                          else ""))
            return real(*args, **kwargs)
        return counting

    for name in ("gemv_triton", "gemv_add_norm_triton"):
        monkeypatch.setattr(gv, name, spy(name))
    monkeypatch.setattr(gl, "silu_mul_triton", spy("silu_mul_triton", gl))
    ops._triton_table.cache_clear()
    g = torch.Generator().manual_seed(4)
    q, h, inter, eps = 24, 32, 20, 1e-6
    wo = (torch.randn(h, q, generator=g) / q**0.5).to(DEVICE)
    w13 = (torch.randn(2 * inter, h, generator=g) / h**0.5).to(DEVICE)
    wq = (torch.randn(16, h, generator=g) / h**0.5).to(DEVICE)
    nw = (1 + 0.1 * torch.randn(h, generator=g)).to(DEVICE)
    lin = torch.nn.functional.linear
    try:
        glu = ["silu_mul_triton"] * 2  # the two gate_up_silu calls, composed on Triton
        for t, backend, dense_gemv, want in [
            (2, "triton", True, ["gemv_add_norm_triton", "gemv_triton:glu:parts", "gemv_triton:parts",
                                 "gemv_triton:glu"]),
            (gv.GEMV_MAX_ROWS + 1, "triton", True, glu), (2, "torch", True, []), (2, "triton", False, glu),
        ]:
            kernels = KernelConfig(backend=backend, dense_gemv=dense_gemv)
            a = torch.randn(t, q, generator=g).to(DEVICE)
            r = torch.randn(t, h, generator=g).to(DEVICE)
            calls.clear()
            folds = want[:1] == ["gemv_add_norm_triton"]
            assert ops.dense_folds_norm(kernels, a) == folds
            normed, summed = ops.linear_add_rms_norm(kernels, a, wo, None, r, nw, eps)
            assert isinstance(normed, ops.PendingNorm) == folds
            act = ops.gate_up_silu(kernels, normed, w13, None, eps)
            # The next layer's qkv, as a decoder layer hands it the norm: pending, or applied.
            x, prenormed = (summed, normed) if isinstance(normed, ops.PendingNorm) else (normed, True)
            qkv, s2 = ops.add_rms_norm_linear(kernels, x, summed, nw, eps, wq, None, prenormed=prenormed)
            ref_n, ref_s = fused_add_rms_norm_ref(lin(a, wo), r, nw, eps)
            plain = ops.gate_up_silu(kernels, ref_n, w13, None)
            assert calls == want, (t, backend, dense_gemv, calls)
            torch.testing.assert_close(summed, ref_s, rtol=1e-6, atol=1e-6)
            assert s2 is summed
            for got, ref in ((act, glu_ref(ref_n, w13, None)), (plain, glu_ref(ref_n, w13, None)),
                             (qkv, lin(ref_n, wq))):
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    finally:
        ops._triton_table.cache_clear()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k", [(5120, 2048), (2048, 4096)])  # qwen3-30b qkv_proj, o_proj
@pytest.mark.parametrize("t", [1, 2])
def test_gpu_gemv_qwen3_shapes_graph(n: int, k: int, t: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(n + t)
    x = torch.randn(t, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).bfloat16()
    gemv_triton(x, w)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            y = gemv_triton(x, w)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    x.copy_(torch.randn(t, k, device="cuda", generator=g).bfloat16())
    graph.replay()
    ref = torch.nn.functional.linear(x, w)
    torch.cuda.synchronize()
    assert float((y.float() - ref.float()).norm() / ref.float().norm()) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("h,inter", [(576, 1536), (4096, 14336)])  # SmolLM2-135M, an 8B dense model
@pytest.mark.parametrize("t", [1, 4])
def test_gpu_dense_layer_gemvs_graph(h: int, inter: int, t: int) -> None:
    """A dense layer's MLP chain at decode sizes, captured in a CUDA graph with
    syncs as errors: o_proj + residual leaving the post-attention norm pending,
    gate/up applying it with SiLU * up (GLU), down + residual leaving the next
    norm pending, the next qkv applying it; against the composition (F.linear,
    fused_add_rms_norm, F.silu, mul) within bf16 rounding."""
    from ftserve_kernels import ops
    from ftserve_kernels.config import KernelConfig

    kernels = KernelConfig()
    g = torch.Generator(device="cuda").manual_seed(h + t)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, device="cuda", generator=g)).bfloat16()

    a, r = rnd(t, h), rnd(t, h)
    wo, w13, w2, wq = rnd(h, h, scale=h**-0.5), rnd(2 * inter, h, scale=h**-0.5), \
        rnd(h, inter, scale=inter**-0.5), rnd(1024, h, scale=h**-0.5)
    nw1, nw2 = 1 + rnd(h, scale=0.1), 1 + rnd(h, scale=0.1)

    def chain() -> tuple[torch.Tensor, torch.Tensor]:
        post, s1 = ops.linear_add_rms_norm(kernels, a, wo, None, r, nw1, 1e-5)
        act = ops.gate_up_silu(kernels, post, w13, None, 1e-5)
        nxt, s2 = ops.linear_add_rms_norm(kernels, act, w2, None, s1, nw2, 1e-5)
        assert isinstance(post, ops.PendingNorm) and isinstance(nxt, ops.PendingNorm)
        qkv, _ = ops.add_rms_norm_linear(kernels, s2, s2, nw2, 1e-5, wq, None, prenormed=nxt)
        return qkv, s2

    chain()  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            qkv, s2 = chain()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    a.copy_(rnd(t, h))
    graph.replay()
    lin = torch.nn.functional.linear
    n1, ref_s1 = fused_add_rms_norm_ref(lin(a, wo), r, nw1, 1e-5)
    gu = lin(n1, w13)
    n2, ref_s2 = fused_add_rms_norm_ref(lin(torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:], w2), ref_s1,
                                        nw2, 1e-5)
    ref_qkv = lin(n2, wq)
    torch.cuda.synchronize()
    for got, ref in ((s2, ref_s2), (qkv, ref_qkv)):
        assert float((got.float() - ref.float()).norm() / ref.float().norm()) < 2e-2
