"""The fp8 kernels (issue 32 item 3) against their torch twins, interpreted on
the CPU: the per-token-group activation quantization (bit for bit), the
block-scaled w8a8 GEMM (prefill), the dense fp8 GEMV (decode), the grouped fp8
expert GEMMs (prefill) and the expert GEMVs (decode, with an expert-slot map
and read-through from an fp8 bank); the fused o_proj + router over an fp8
o_proj and the expert GEMVs taking its route parts; ops' dispatch; a tiny fp8
model on the Triton kernels against the torch path, with the bound the
activation quantization sets; and a one-row fp8 decode step routed in o_proj
against the unfused fp8 path.

Tolerances: in float32 a kernel and its twin differ only by fp32 summation
order (relative 1e-5). The interpreter rounds fp32 -> bf16 toward zero (the GPU
rounds to nearest), so bf16 outputs may differ by one bf16 ulp here, and where
a bf16 intermediate is quantized again (the grouped experts' SiLU product) that
ulp can move an e4m3 code by one step: those compare by relative error.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    # The interpreter is chosen when a kernel is decorated (see test_kernels_attention).
    os.environ["TRITON_INTERPRET"] = "1"
    # Not fp8_quant: a new Fp8Weight class would fail ops' isinstance checks (its one
    # kernel was decorated after conftest chose the interpreter anyway).
    for _name in ("ftserve_kernels.attention_common", "ftserve_kernels.moe_align_triton",
                  "ftserve_kernels.fp8_gemm_triton", "ftserve_kernels.fp8_gemv_triton",
                  "ftserve_kernels.fp8_moe_triton", "ftserve_kernels.fp8_moe_gemv_triton",
                  "ftserve_kernels.oproj_route_triton"):
        if _name in sys.modules:
            importlib.reload(sys.modules[_name])

from ftserve.moe.banks import Fp8Row  # noqa: E402
from ftserve_kernels import fp8_gemm_triton as fg  # noqa: E402
from ftserve_kernels import fp8_gemv_triton as fv  # noqa: E402
from ftserve_kernels import fp8_moe_gemv_triton as fmg  # noqa: E402
from ftserve_kernels import fp8_moe_triton as fm  # noqa: E402
from ftserve_kernels import fp8_ops, ops  # noqa: E402
from ftserve_kernels import fp8_scaled_mm as sm  # noqa: E402
from ftserve_kernels import oproj_route_triton as orr  # noqa: E402
from ftserve_kernels.config import KernelConfig  # noqa: E402
from ftserve_kernels.fp8_quant import (  # noqa: E402
    FP8,
    Fp8Weight,
    dequantize,
    fake_quant_act,
    fp8_linear_ref,
    quantize_act_ref,
    quantize_act_triton,
    quantize_weight,
)
from ftserve_kernels.gemv_configs import GemvConfig  # noqa: E402
from ftserve_kernels.moe_down_gemv_triton import NormNext  # noqa: E402
from ftserve_kernels.moe_gemv_triton import RouteParts  # noqa: E402
from tests.fp8_cases import (  # noqa: E402
    DISPATCH_SHAPE,
    DISPATCH_TOKENS,
    DTYPES,
    GEMM_CASES,
    GEMV_CASES,
    GEMV_TILE_BN,
    GEMV_TILE_CASES,
    GROUPED_MOE_CASES,
    MOE_GEMV_CASES,
    MOE_GEMV_SHAPE,
    NORM_NEXT_TOKENS,
    ROUTE_CASES,
    ROUTE_E_K,
    ROUTED_SHAPE,
    WIDE_CASES,
    WIDE_SHAPE,
    WIDE_TILES,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))


def close(out: torch.Tensor, ref: torch.Tensor, rounded_inside: bool = False) -> None:
    """fp32: summation order only; bf16: within one bf16 ulp, or, for a kernel that
    rounds intermediates to bf16 (the experts' SiLU product, each weighted row)
    under the interpreter, within 2^-6 relative: three truncations of up to an
    ulp (2^-7) each instead of roundings (see the module docstring)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    elif rounded_inside and DEVICE == "cpu":
        assert rel_err(out, ref) < 2.0 ** -6, rel_err(out, ref)
    else:
        ulp = ref.float().abs() * 2.0 ** -7 + 1e-6
        assert ((out.float() - ref.float()).abs() <= ulp).all(), float((out.float() - ref.float()).abs().max())


# Hopper's fp8 wgmma keeps about 14 bits of its running sum (Triton leaves fp8
# dots in that mode on sm_90; the kernels add each 128-column step's dot, four
# k=32 instructions, into an fp32 accumulator): an output of a w8a8 GEMM is off
# by at most about 4 x 2^-13 of the sum of |a| |b| over its dot. (MMA-Sim's
# bit-accurate model of the instruction, the products and the running sum
# aligned to the largest one's exponent and truncated to 13 fraction bits,
# puts these tests' largest error at 2^-12.9 of it.)
FP8_DOT_REL = 2.0 ** -11


def magnitude(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """sum_k |a[t, k]| |w[n, k]| [T, N] for the quantized activations, fp32."""
    return fake_quant_act(x).abs() @ dequantize(w).abs().T


def close_fp8_dot(out: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor) -> None:
    """A w8a8 GEMM against its twin (which rounds the activations the same way).
    Interpreted: close(). On the GPU: within FP8_DOT_REL of ``mag`` (magnitude()),
    plus a bf16 ulp for bf16 outputs. A wrong scale (another block's, or a
    missing one) moves an output by a share of its block's partial sum, which is
    of the order of sqrt(128) / 128 of its magnitude: about 40x this bound."""
    if DEVICE == "cpu":
        close(out, ref)
        return
    assert out.dtype == ref.dtype and out.shape == ref.shape
    tol = FP8_DOT_REL * mag.to(out.device) + 1e-6
    if out.dtype != torch.float32:
        tol = tol + ref.float().abs() * 2.0 ** -7
    err = (out.float() - ref.float()).abs()
    assert (err <= tol).all(), float((err / tol).max())


def weight(g: torch.Generator, shape: tuple[int, ...], bn: int = 128, bk: int = 128) -> Fp8Weight:
    w = torch.randn(shape, generator=g) * shape[-1] ** -0.5
    return move(quantize_weight(w, bn, bk))


def move(w: Fp8Weight) -> Fp8Weight:
    return Fp8Weight(w.codes.to(DEVICE), w.scale.to(DEVICE), w.block_n, w.block_k)


# ------------------------------------------------------------------ quantization


def test_weight_quantization_round_trip() -> None:
    """Per-block scale amax / 448 (partial blocks included): every block's largest
    value is exact, the rest within half an e4m3 ulp."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=g) * torch.logspace(-3, 1, 300)  # columns of very different size
    q = quantize_weight(w)
    assert q.codes.dtype == FP8 and q.scale.shape == (2, 3)
    deq = dequantize(q)
    step = q.scale.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    assert ((deq - w).abs() <= 2.0 ** -4 * w.abs() + 2.0 ** -10 * step).all()
    assert torch.equal(q.codes.float().abs().amax(), torch.tensor(448.0))
    z = quantize_weight(torch.zeros(4, 8))
    assert torch.equal(z.scale, torch.ones(1, 1)) and not dequantize(z).any()  # an all-zero block


@pytest.mark.parametrize("dtype", DTYPES)
def test_activation_quantization_is_bit_exact(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(19, 300, generator=g) * torch.logspace(-4, 3, 300)).to(dtype)  # 3 groups, the last partial
    x[3] = 0  # an all-zero row: the floor scale, zero codes
    x[5, 7] = 1e5  # one outlier sets its group's scale
    codes, scales = quantize_act_triton(x.to(DEVICE))
    want_c, want_s = quantize_act_ref(x)
    assert scales.shape == (19, 3) and codes.dtype == FP8
    assert torch.equal(codes.cpu().view(torch.uint8), want_c.view(torch.uint8))
    assert torch.equal(scales.cpu(), want_s)
    assert (codes[3].float() == 0).all() and codes[5, 7].float().item() == 448.0
    assert (want_c.view(torch.uint8) == 0x80).any()  # -0 codes: negative values that round to zero
    # The twin itself is the same bit for bit on the device, where the GEMM tests run it.
    dev_c, dev_s = quantize_act_ref(x.to(DEVICE))
    assert torch.equal(dev_c.cpu().view(torch.uint8), want_c.view(torch.uint8)) and torch.equal(dev_s.cpu(), want_s)


@pytest.mark.skipif(DEVICE == "cuda", reason="interpreted: the test above runs the compiled kernel on the GPU")
def test_activation_codes_keep_the_sign_of_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative values that round to zero are -0 codes (0x80), as torch casts them,
    also where unary minus on floats is ``0 - x``, which makes +0 of -0: Triton up to
    3.6 lowers it so, and there a sign applied by negation gave 0x00 (the GPU run's
    codes; round_e4m3 puts the sign bit back with integer ops)."""
    from triton.language.semantic import TritonSemantic

    monkeypatch.setattr(TritonSemantic, "minus", lambda self, v: self.sub(0.0 if v.type.scalar.is_floating() else 0,
                                                                        v, True))
    x = torch.tensor([[448.0, -1e-4, 1e-4, -0.0, 0.0, -3e-3, -1.0] + [0.5] * 121])  # one group, amax 448
    codes, _ = quantize_act_triton(x)
    want, _ = quantize_act_ref(x)
    assert torch.equal(codes.view(torch.uint8), want.view(torch.uint8))
    assert want.view(torch.uint8)[0, :7].tolist() == [0x7E, 0x80, 0x00, 0x80, 0x00, 0x82, 0xB8]


# ------------------------------------------------------------------ dense


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,bn,bk", GEMM_CASES)
def test_gemm_matches_twin(dtype: torch.dtype, m: int, n: int, k: int, bn: int, bk: int) -> None:
    g = torch.Generator().manual_seed(m)
    w = weight(g, (n, k), bn, bk)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE)
    got = fg.fp8_linear_triton(x, w, b)
    close_fp8_dot(got, fp8_linear_ref(x, w, b, act_quant=True), magnitude(x, w))
    # The activation rounding is the only difference from the exact product.
    assert rel_err(got, fp8_linear_ref(x, w, b)) < 0.05


SCALED_MM_CASES = [  # m, n, k: rows padded to 4 (5, 37) or not; K / 128 = 4 and 8
    (5, 256, 512), (37, 384, 1024), (64, 128, 512)]


def meta_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


@pytest.mark.parametrize("m,n,k", SCALED_MM_CASES)
def test_scaled_mm_operands_meet_the_recipe(m: int, n: int, k: int) -> None:
    """fp8_scaled_mm's operands: the quantization kernel writes x's codes and
    scales (bit for bit the twin's) into the padded column-major buffers, the
    padding rows zero codes with the floor scale; the weight's views and those
    pass torch's own check of the 1x128 x 128x128 recipe (scaled_mm on meta
    tensors), which row-major activation scales fail."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(m)
    w = weight(g, (n, k))
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEVICE)
    assert sm.fits(w)
    codes, scales = quantize_act_triton(x, sm.act_buffers(m, k, x.device))
    m4 = -(-m // 4) * 4
    assert codes.shape == (m4, k) and scales.shape == (m4, k // 128) and scales.stride() == (1, m4)
    want_c, want_s = quantize_act_ref(x.cpu())
    assert torch.equal(codes[:m].cpu().view(torch.uint8), want_c.view(torch.uint8))
    assert torch.equal(scales[:m].cpu(), want_s)
    floor = quantize_act_ref(torch.zeros(m4 - m, k))[1]
    assert not codes[m:].float().any() and torch.equal(scales[m:].cpu(), floor)
    wc, ws = sm.weight_operands(w)
    assert wc.data_ptr() == w.codes.data_ptr() and ws.data_ptr() == w.scale.data_ptr()  # views, no copy
    recipe = (F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128)
    y = F.scaled_mm(meta_like(codes), meta_like(wc), meta_like(scales), recipe[0], meta_like(ws), recipe[1],
                    output_dtype=torch.bfloat16)
    assert y.shape == (m4, n)
    with pytest.raises(RuntimeError, match="1x128 x 128x128"):
        F.scaled_mm(meta_like(codes), meta_like(wc), meta_like(scales.contiguous()), recipe[0], meta_like(ws),
                    recipe[1], output_dtype=torch.bfloat16)


def test_scaled_mm_takes_only_its_recipe() -> None:
    """Grids other than 128 x 128 blocks over whole blocks stay on the Triton GEMM."""
    g = torch.Generator().manual_seed(0)
    assert sm.fits(weight(g, (256, 512)))
    assert not sm.fits(weight(g, (256, 512), bn=64))  # fused projections' smaller row blocks
    assert not sm.fits(weight(g, (256, 512), bn=1, bk=512))  # per-channel
    assert not sm.fits(weight(g, (256, 384)))  # K / 128 not a multiple of 4
    assert not sm.fits(weight(g, (200, 512)))  # a partial row block
    assert not sm.fits(weight(g, (2, 256, 512)))  # stacked experts


@pytest.mark.skipif(DEVICE == "cpu" or not sm.available(),
                    reason="cuBLAS's block-scaled fp8 GEMM: Hopper with torch's scaled_mm recipes")
@pytest.mark.parametrize("m,n,k", SCALED_MM_CASES)
def test_scaled_mm_matches_twin(m: int, n: int, k: int) -> None:
    """The same product as the Triton GEMM's twin (activation codes rounded alike),
    within the fp8 dot bound; ops.linear takes it for weights that fit."""
    g = torch.Generator().manual_seed(m)
    w = weight(g, (n, k))
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEVICE)
    b = torch.randn(n, generator=g).to(torch.bfloat16).to(DEVICE)
    for bias in (None, b):
        want = fp8_linear_ref(x, w, bias, act_quant=True)
        close_fp8_dot(sm.fp8_linear_scaled_mm(x, w, bias), want, magnitude(x, w))
        close_fp8_dot(ops.linear(KernelConfig(backend="triton"), x, w, bias), want, magnitude(x, w))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,n,k,bn,bk", GEMV_CASES)
def test_gemv_matches_exact_reference(dtype: torch.dtype, t: int, n: int, k: int, bn: int, bk: int) -> None:
    """w8a16: the decode rows are not rounded, the twin is the exact reference."""
    g = torch.Generator().manual_seed(t)
    w = weight(g, (n, k), bn, bk)
    x = torch.randn(t, k, generator=g).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE)
    close(fv.fp8_gemv_triton(x, w, b), fp8_linear_ref(x, w, b))
    close(fv.fp8_gemv_triton(x, w), fp8_linear_ref(x, w))


@pytest.mark.parametrize("t,n,k,bk,config", GEMV_TILE_CASES)
def test_gemv_tiles_against_scale_blocks(t: int, n: int, k: int, bk: int, config: tuple[int, int]) -> None:
    """The CUDA tiles' K steps (512 codes) against 128-column scale blocks, at the
    interpreter's sizes: every code gets its own block's scale."""
    g = torch.Generator().manual_seed(n)
    w = weight(g, (n, k), GEMV_TILE_BN, bk)
    x = torch.randn(t, k, generator=g).to(DEVICE)
    close(fv.fp8_gemv_triton(x, w, config=GemvConfig(*config, 1, 1)), fp8_linear_ref(x, w))


# ------------------------------------------------------------------ experts


def experts(g: torch.Generator, e: int, h: int, inter: int, bn13: int) -> tuple[Fp8Weight, Fp8Weight]:
    """bn13 = 0: per-channel scales (compressed-tensors), one per row of both weights."""
    if bn13 == 0:
        return weight(g, (e, 2 * inter, h), 1, h), weight(g, (e, h, inter), 1, inter)
    return weight(g, (e, 2 * inter, h), bn13), weight(g, (e, h, inter))


def routing(g: torch.Generator, t: int, e: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).int().to(DEVICE)
    return torch.softmax(torch.randn(t, k, generator=g), -1).to(DEVICE), ids


@pytest.mark.parametrize("dtype,t,e,h,inter,k,bn13", GROUPED_MOE_CASES)
def test_grouped_moe_matches_twin(dtype: torch.dtype, t: int, e: int, h: int, inter: int, k: int,
                                  bn13: int) -> None:
    g = torch.Generator().manual_seed(t)
    w13, w2 = experts(g, e, h, inter, bn13)
    wts, ids = routing(g, t, e, k)
    x = torch.randn(t, h, generator=g).to(dtype).to(DEVICE)
    got = fm.fused_moe_fp8_triton(x, w13, w2, wts, ids)
    close_requantized(got, fm.fused_moe_fp8_ref(x, w13, w2, wts, ids, act_quant=True))
    assert rel_err(got, fm.fused_moe_fp8_ref(x, w13, w2, wts, ids)) < 0.06
    emap = torch.randperm(e, generator=g).int().to(DEVICE)  # an expert-slot cache's map
    mapped = fm.fused_moe_fp8_triton(x, w13, w2, wts, ids, expert_map=emap)
    close_requantized(mapped, fm.fused_moe_fp8_ref(x, w13, w2, wts, emap[ids.long()], act_quant=True))


def close_requantized(out: torch.Tensor, ref: torch.Tensor) -> None:
    """A path that quantizes an intermediate again (the SiLU product): a last-bit
    difference before it can move an e4m3 code a step (2^-3 relative)."""
    assert out.dtype == ref.dtype
    if DEVICE == "cuda":  # fp32 summation order (wgmma vs torch): a rare code moves
        assert rel_err(out, ref) < 0.01
    elif out.dtype == torch.float32:
        close(out, ref)
    else:  # see the module docstring: ~1/32 of the codes a step off: ~2% relative
        assert rel_err(out, ref) < 0.03


def close_experts(out: torch.Tensor, x: torch.Tensor, w13: Fp8Weight, w2: Fp8Weight, wts: torch.Tensor,
                  ids: torch.Tensor) -> None:
    """The expert GEMV pair against fused_moe_fp8_ref (exact products; SiLU(gate) * up
    and each weighted down row y_j rounded to x's dtype, as the kernels round them).
    fp32, and bf16 interpreted: close(..., True). bf16 on the GPU: the kernels' fp32
    values differ from the twin's by summation order and SiLU's exp (a few fp32
    ulps), so an intermediate that close to a bf16 rounding tie rounds the other
    way: a row y_j by its ulp (<= 2^-7 |y_j|), and an act element h_i by its ulp,
    which moves its rows by <= 2^-7 |w_j W2[n, i] h_i| (a few fp32 ulps from a tie
    is some 2^-14 of a bf16 ulp: one such element in a pair's I is already rare,
    two are left out). The output is within its ulp plus those:
    2^-7 (|out| + sum_j |y_j| + |w_j| max_i |W2[n, i] h_i|), a few output ulps. One
    block scale 1.25x off, or a lost K block, puts most outputs 20-100x past it."""
    ref = fm.fused_moe_fp8_ref(x, w13, w2, wts, ids)
    if DEVICE == "cpu" or out.dtype == torch.float32:
        close(out, ref, True)
        return
    assert out.dtype == ref.dtype and out.shape == ref.shape
    inter = w2.codes.shape[2]
    sel = ids.long()
    gate_up = torch.einsum("tkoh,th->tko", dequantize(w13)[sel], x.float())  # [T, k, 2I]
    h = (torch.nn.functional.silu(gate_up[..., :inter]) * gate_up[..., inter:]).to(x.dtype).float()  # [T, k, I]
    terms = dequantize(w2)[sel] * h[:, :, None, :]  # [T, k, H, I]
    wk = wts.float()[..., None]  # [T, k, 1]
    rows = (terms.sum(-1) * wk).to(x.dtype).float()  # y_j [T, k, H]
    tol = 2.0 ** -7 * (ref.float().abs() + (rows.abs() + wk.abs() * terms.abs().amax(-1)).sum(1)) + 1e-6
    err = (out.float() - ref.float()).abs()
    assert (err <= tol).all(), float((err / tol).max())


@pytest.mark.parametrize("dtype,t,bn13", MOE_GEMV_CASES)
def test_moe_gemv_matches_exact_reference(dtype: torch.dtype, t: int, bn13: int) -> None:
    g = torch.Generator().manual_seed(10 + t)
    e, h, inter, k = MOE_GEMV_SHAPE
    w13, w2 = experts(g, e, h, inter, bn13)
    wts, ids = routing(g, t, e, k)
    x = torch.randn(t, h, generator=g).to(dtype).to(DEVICE)
    close_experts(fmg.fused_moe_fp8_gemv_triton(x, w13, w2, wts, ids), x, w13, w2, wts, ids)
    emap = torch.randperm(e, generator=g).int().to(DEVICE)
    close_experts(fmg.fused_moe_fp8_gemv_triton(x, w13, w2, wts, ids, emap), x, w13, w2, wts, emap[ids.long()])


@pytest.mark.parametrize("t", NORM_NEXT_TOKENS)
def test_moe_gemv_folds_the_next_norm(t: int) -> None:
    """The down epilogue folds the next layer's input norm (NormNext): normed by
    the grid's last program as fused_add_rms_norm rounds it, or left pending
    (weight * sum and the partial sums of squares) for the next fp8 GEMV, which
    applies the 1/rms to its dots."""
    from ftserve_kernels.moe_down_gemv_triton import NormNext
    from ftserve_kernels.norm_rope import fused_add_rms_norm_ref

    g = torch.Generator().manual_seed(20 + t)
    (e, h, inter, k), eps = MOE_GEMV_SHAPE, 1e-6
    w13, w2 = experts(g, e, h, inter, 64)
    wts, ids = routing(g, t, e, k)
    x = torch.randn(t, h, generator=g).to(DEVICE)
    residual = torch.randn(t, h, generator=g).to(DEVICE)
    nw = (1 + 0.1 * torch.randn(h, generator=g)).to(DEVICE)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    want, want_sum = fused_add_rms_norm_ref(fm.fused_moe_fp8_ref(x, w13, w2, wts, ids), residual, nw, eps)
    normed, summed, parts = fmg.fused_moe_fp8_add_norm_gemv_triton(x, w13, w2, wts, ids,
                                                                   NormNext(residual, nw, eps, counter))
    assert parts is None and int(counter.item()) == 0  # the last program re-zeroed it
    close(summed, want_sum)
    close(normed, want)
    scaled, summed, parts = fmg.fused_moe_fp8_add_norm_gemv_triton(
        x, w13, w2, wts, ids, NormNext(residual, nw, eps, counter, deferred=True))
    close(summed, want_sum)
    close(scaled, nw * summed)
    assert parts is not None and parts.dtype == torch.float32
    torch.testing.assert_close(parts.sum(1), summed.float().pow(2).sum(1), rtol=1e-5, atol=1e-5)
    wq = weight(g, (96, h))
    close(fv.fp8_gemv_triton(scaled, wq, parts=parts, eps=eps), fp8_linear_ref(want, wq))


def wide_tiles() -> tuple[GemvConfig, GemvConfig]:
    """Expert GEMV tiles whose gate/up K steps span 256 codes (as the CUDA
    default's 512: several scale columns a step)."""
    return GemvConfig(*WIDE_TILES[0]), GemvConfig(*WIDE_TILES[1])


@pytest.mark.parametrize("dtype,h", WIDE_CASES)
def test_moe_gemv_gate_up_steps_across_scale_blocks(dtype: torch.dtype, h: int) -> None:
    """Gate/up K steps of 256 codes over 128-column scale blocks (at 384: a
    partial last step): every code gets its own block's scale."""
    g = torch.Generator().manual_seed(h)
    e, inter, k = WIDE_SHAPE
    w13, w2 = experts(g, e, h, inter, 64)
    wts, ids = routing(g, 1, e, k)
    x = torch.randn(1, h, generator=g).to(dtype).to(DEVICE)
    close_experts(fmg.fused_moe_fp8_gemv_triton(x, w13, w2, wts, ids, tiles=wide_tiles()), x, w13, w2, wts, ids)


@pytest.mark.parametrize("t,h,wide", [(1, 128, False), (2, 128, False), (1, 256, True)])
def test_read_through_from_an_fp8_bank(t: int, h: int, wide: bool) -> None:
    """Misses read from the fp8 bank (codes and scales, byte offsets of Fp8Row)
    compute what fill + the plain GEMVs compute, and leave every missed slot
    holding its whole bank row (``wide``: gate/up steps of two scale columns)."""
    if DEVICE == "cuda":
        pytest.skip("the gpu tests read a pinned bank over UVA")
    from ftserve.moe.kernels import fill_rows_ref

    g = torch.Generator().manual_seed(5)
    inter, e, k, s = 64, 8, 4, 7  # 8 experts of layer 1 (ids 8..15), 6 slots + trash
    tiles = wide_tiles() if wide else None
    row = Fp8Row(h, inter, (64, 128), (128, 128))
    bank = torch.zeros(2 * e, row.row_bytes, dtype=torch.uint8)
    for w, src in zip(row.views(bank), experts(g, 2 * e, h, inter, 64)):
        w.codes.copy_(src.codes)
        w.scale.copy_(src.scale)
    slots = bank[torch.randint(0, 2 * e, (s,), generator=g)].clone()
    emap = torch.tensor([3, 0, 5, 1, 2, 4, 0, 1], dtype=torch.int32)  # expert -> slot
    ids = torch.tensor([[0, 2, 3, 5], [2, 1, 4, 0]][:t], dtype=torch.int32)  # t=2: expert 2 twice
    miss_slot = torch.tensor([5, 1, -1, 4][:2 * t], dtype=torch.int32)  # experts 2 and 3 miss
    miss_id = torch.tensor([e + 2, e + 3, -1, e + 5][:2 * t], dtype=torch.int32)
    poisoned = slots.clone()
    poisoned[miss_slot[miss_slot >= 0].long()] = 0x7F  # e4m3 NaN codes, NaN scales: never read
    x = torch.randn(t, h, generator=g)
    wts = torch.softmax(torch.randn(t, k, generator=g), -1)
    want_slots = poisoned.clone()
    fill_rows_ref(bank, want_slots, miss_id, miss_slot)
    want = fm.fused_moe_fp8_ref(x, *row.views(want_slots), wts, emap[ids.long()])
    got_slots = poisoned.clone()
    rt = fmg.Fp8ReadThrough(bank, miss_slot, miss_id, row.row_bytes, 0, row.w2_col, row.w13_scale_col,
                            row.w2_scale_col)
    got = fmg.fused_moe_fp8_gemv_triton(x, *row.views(got_slots), wts, ids, emap, read_through=rt, tiles=tiles)
    close(got, want)
    used = sorted({int(emap[i]) for i in ids.reshape(-1).tolist()})
    end = row.w2_scale_col + 4 * row.w2_scale_shape[0] * row.w2_scale_shape[1]  # the row's padding after
    for slot in used:  # every slot the step read: missed rows whole (codes, scales), the rest untouched
        assert torch.equal(got_slots[slot, :end], want_slots[slot, :end]), slot
    plain = fmg.fused_moe_fp8_gemv_triton(x, *row.views(want_slots), wts, ids, emap, tiles=tiles)
    assert torch.equal(got, plain)  # the same sums as reading the filled slots


# ------------------------------------------------------------------ o_proj + router (oproj_route_triton)


def close_rounded_twice(out: torch.Tensor, ref: torch.Tensor) -> None:
    """o_proj's row rounded, then its sum with the residual (and w * sum): in
    bf16 a last-bit difference in o, where o and the residual cancel, is more
    than an ulp of the sum; by relative error there (2^-6, as close()'s
    interpreted bound), fp32 as close()."""
    if out.dtype == torch.float32:
        close(out, ref)
    else:
        assert out.dtype == ref.dtype and rel_err(out, ref) < 2.0 ** -6, rel_err(out, ref)


def _route_case(g: torch.Generator, e: int, h: int, q: int, bn: int, bk: int, bias: bool,
                dtype: torch.dtype) -> dict[str, Any]:
    """One decode row of a MoE layer with an fp8 o_proj [h, q] in bn x bk blocks."""
    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)

    return dict(a=rnd(1, q), o_w=weight(g, (h, q), bn, bk), o_b=rnd(h) if bias else None, r=rnd(1, h),
                nw=(1.0 + 0.1 * torch.randn(h, generator=g)).to(dtype).to(DEVICE), gate=rnd(e, h, scale=h**-0.5))


@pytest.mark.parametrize("dtype,h,q,bn,bk,bias,config", ROUTE_CASES)
def test_oproj_route_fp8_matches_its_twin(dtype: torch.dtype, h: int, q: int, bn: int, bk: int, bias: bool,
                                          config: tuple[int, int]) -> None:
    """The fused o_proj + router launch over an fp8 o_proj (e4m3 codes, block
    scales applied per tile as the dense fp8 GEMV does): the o_proj rows, their
    sum with the residual, w * sum and its partial sums of squares, the top-k of
    the pre-logits, as the twin (whose o_proj is the exact fp8 reference), over
    two launches that share the counter. The router folds from the dequantized
    weight."""
    g = torch.Generator().manual_seed(h + q)
    e, k = ROUTE_E_K
    c = _route_case(g, e, h, q, bn, bk, bias, dtype)
    folded = orr.fold_router(c["gate"], c["nw"], c["o_w"], c["o_b"])
    want_ro = ((c["gate"].float() * c["nw"].float()[None, :]) @ dequantize(c["o_w"])).to(dtype)
    torch.testing.assert_close(folded.r_o, want_ro)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    ref = orr.oproj_route_ref(c["a"], c["o_w"], c["o_b"], c["r"], c["nw"], folded, k)
    tiles = GemvConfig(*config, 4, 1)
    for _ in range(2):
        got = orr.oproj_route_triton(c["a"], c["o_w"], c["o_b"], c["r"], c["nw"], folded, k, counter,
                                     config=tiles)
        assert int(counter.item()) == 0
        close_rounded_twice(got.summed, ref.summed)
        close_rounded_twice(got.scaled, ref.scaled)
        # The parts are of the sum the kernel wrote (the twin's, up to the rounding above).
        torch.testing.assert_close(got.parts.sum(-1, keepdim=True), got.summed.float().pow(2).sum(-1, keepdim=True),
                                   rtol=1e-5, atol=1e-5)
        assert torch.equal(got.ids, ref.ids)
        torch.testing.assert_close(got.pre_sel, ref.pre_sel, rtol=1e-5, atol=1e-5)
    # The sum is the unfused fp8 path's: the dense fp8 GEMV's o_proj plus the residual.
    o = fv.fp8_gemv_triton(c["a"], c["o_w"], c["o_b"], config=tiles)
    close_rounded_twice(got.summed, (o.float() + c["r"].float()).to(dtype))


def test_fold_router_follows_fp8_codes_and_scales() -> None:
    """An fp8 o_proj's fold is stale once its codes or its scales change in place."""
    g = torch.Generator().manual_seed(2)
    c = _route_case(g, 8, 128, 128, 128, 128, False, torch.float32)
    f = orr.fold_router(c["gate"], c["nw"], c["o_w"])
    assert f.versions == orr.fold_versions(c["gate"], c["nw"], c["o_w"])
    c["o_w"].scale.mul_(2.0)
    assert orr.fold_versions(c["gate"], c["nw"], c["o_w"]) != f.versions
    torch.testing.assert_close(orr.fold_router(c["gate"], c["nw"], c["o_w"]).r_o, 2.0 * f.r_o)
    v = orr.fold_versions(c["gate"], c["nw"], c["o_w"])
    c["o_w"].codes.copy_(c["o_w"].codes.flip(0))
    assert orr.fold_versions(c["gate"], c["nw"], c["o_w"]) != v


@pytest.mark.parametrize("defer", [False, True])
def test_fp8_experts_take_the_route_parts(defer: bool) -> None:
    """fp8 o_proj routes, the fp8 expert GEMV pair applies the pending
    post-attention norm and weighs the chosen experts (RouteParts): as routing
    and normalizing the sum first and running the pair unfused (float32:
    summation order only); the next norm folded or left pending alike."""
    g = torch.Generator().manual_seed(7)
    (e, h, q, inter, k), eps = ROUTED_SHAPE, 1e-6
    c = _route_case(g, e, h, q, 128, 128, False, torch.float32)
    w13, w2 = experts(g, e, h, inter, 64)
    folded = orr.fold_router(c["gate"], c["nw"], c["o_w"])
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    route = orr.oproj_route_triton(c["a"], c["o_w"], None, c["r"], c["nw"], folded, k, counter)
    next_w = (1.0 + 0.1 * torch.randn(h, generator=g)).to(DEVICE)
    weights = torch.full((1, k), float("nan"), device=DEVICE)
    got = fmg.fused_moe_fp8_add_norm_gemv_triton(
        route.scaled, w13, w2, weights, route.ids, NormNext(route.summed, next_w, eps, counter, deferred=defer),
        route=RouteParts(route.parts, route.pre_sel, eps))
    assert int(counter.item()) == 0
    s = route.summed.float()
    x = c["nw"] * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps))  # the post-attention norm
    logits = torch.nn.functional.linear(x, c["gate"])
    assert torch.equal(torch.topk(logits, k).indices.to(torch.int32), route.ids)
    ref_w = torch.softmax(logits.gather(1, route.ids.long()), -1)
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6)
    want = fmg.fused_moe_fp8_add_norm_gemv_triton(
        x, w13, w2, ref_w, route.ids, NormNext(route.summed, next_w, eps, counter, deferred=defer))
    for o, r in zip(got[:2], want[:2]):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-5)
    moe_sum = fm.fused_moe_fp8_ref(x, w13, w2, ref_w, route.ids) + s
    torch.testing.assert_close(got[1], moe_sum, rtol=1e-4, atol=1e-5)
    if defer:
        assert got[2] is not None and want[2] is not None
        torch.testing.assert_close(got[2].sum(-1), moe_sum.pow(2).sum(-1), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ dispatch and the model


def test_ops_dispatch_fp8_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """ops on an Fp8Weight: the torch twin (exact) unless the KernelConfig runs Triton; on Triton
    the GEMV up to 4 rows, the w8a8 GEMM past it; experts the GEMV pair up to 2
    tokens, the grouped GEMMs past it."""
    g = torch.Generator().manual_seed(3)
    n, h, e, inter, k = DISPATCH_SHAPE
    w = weight(g, (n, h))
    w13, w2 = experts(g, e, h, inter, 128)
    calls: list[str] = []
    for mod, name in ((fv, "fp8_gemv_triton"), (fg, "fp8_linear_triton"), (fmg, "fused_moe_fp8_gemv_triton"),
                      (fm, "fused_moe_fp8_triton")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=name, **kw: calls.append(_n) or _r(*a, **kw))
    for backend in ("torch", "triton"):
        kernels = KernelConfig(backend=backend)
        for t in DISPATCH_TOKENS:
            x = torch.randn(t, h, generator=g).to(DEVICE)
            y = ops.linear(kernels, x, w, None)
            if backend == "triton" and t > 4:  # the w8a8 GEMM
                close_fp8_dot(y, fp8_linear_ref(x, w, None, act_quant=True), magnitude(x, w))
            else:
                close(y, fp8_linear_ref(x, w, None))
            wts, ids = routing(g, t, e, k)
            z = ops.fused_moe(kernels, x, w13, w2, wts, ids)
            if backend == "triton" and t > 2:  # the grouped GEMMs
                close_requantized(z, fm.fused_moe_fp8_ref(x, w13, w2, wts, ids, act_quant=True))
            else:
                close_experts(z, x, w13, w2, wts, ids)
    assert calls == ["fp8_gemv_triton", "fused_moe_fp8_gemv_triton", "fp8_gemv_triton", "fused_moe_fp8_triton",
                     "fp8_linear_triton", "fused_moe_fp8_triton"]
    assert fp8_ops.GEMV_MAX_ROWS == fv.GEMV_MAX_ROWS == 4


@pytest.mark.skipif(DEVICE == "cuda", reason="the CPU model on the interpreter; test_gpu_fp8 runs it on the GPU")
def test_fp8_model_on_triton_kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tiny-moe-fp8 on the Triton kernels (interpreted) against the torch path
    (the exact reference): a packed prefill and an extend (w8a8 GEMMs: the
    activations rounded to e4m3 per token and 128 columns, relative error up to
    2^-4 per element, which leaves the logits within a few percent), then a
    decode step (w8a16 GEMVs: the same products, up to fp32 order, over a KV
    cache the prefill wrote with those rounded activations; layer 0's experts
    leave layer 1's input norm pending for its qkv GEMV)."""
    from ftserve.models.checkpoint import write_checkpoint
    from ftserve_kernels.attention_triton import TritonAttentionBackend
    from ftserve_kernels.paged_attention import TorchAttentionBackend
    from tests.test_kernels_model import run_steps

    write_checkpoint("tiny-moe-fp8", tmp_path, seed=5, layers=2)  # layer 1's qkv takes layer 0's pending norm
    ref = run_steps(tmp_path, TorchAttentionBackend(), KernelConfig(backend="torch"))
    pending: list[int] = []
    real = fp8_ops.pending_linear
    monkeypatch.setattr(fp8_ops, "pending_linear", lambda *a, **kw: pending.append(1) or real(*a, **kw))
    got = run_steps(tmp_path, TritonAttentionBackend(), KernelConfig(backend="triton"))
    assert pending == [1]  # the decode step: layer 1's qkv applied the norm layer 0 left pending
    errs = [rel_err(o, r) for o, r in zip(got, ref)]
    assert all(torch.isfinite(o).all() for o in got)
    assert max(errs) < 0.05, errs
    assert errs[0] > 1e-4  # the prefill did quantize its activations


@pytest.mark.skipif(DEVICE == "cuda", reason="the CPU model on the interpreter; test_gpu_fp8 runs it on the GPU")
def test_one_row_fp8_decode_routed_by_o_proj(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A small tiny-moe-fp8 (o_proj and experts in e4m3, two layers), one
    sequence: every MoE layer of a one-row decode step routes in its fp8 o_proj
    launch (no norm + route launch) and its fp8 expert pair takes the route
    parts (layer 0 leaving layer 1's input norm pending, layer 1 folding the
    final norm). The logits match the unfused fp8 path's (the same Triton
    kernels, oproj_route_applies off) and the torch path's (the exact fp8
    reference) within float32 summation order over the same KV (a torch
    prefill): the pre-logits pick the same experts (a near-tie could pick
    others, as oproj_route_triton says; none at this seed). Small shapes and
    vocabulary: the interpreter runs each GEMV program by program."""
    from ftserve.kvcache.pool import KVPool
    from ftserve.models.checkpoint import write_checkpoint
    from ftserve.models.forward_batch import build_forward_batch
    from ftserve.models.loader import load_model
    from ftserve_kernels.attention_triton import TritonAttentionBackend
    from ftserve_kernels.paged_attention import TorchAttentionBackend

    write_checkpoint("tiny-moe-fp8", tmp_path, seed=8, overrides=dict(
        vocab_size=128, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, moe_intermediate_size=64,
        num_experts=8, num_experts_per_tok=2))
    model, cfg = load_model(tmp_path, dtype="float32", device="cpu")
    assert isinstance(model.layers[0].self_attn.o_proj.w, Fp8Weight) and model.layers[0].mlp.is_fp8
    pool = KVPool(cfg.num_layers, 4, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    toks = torch.randint(3, cfg.vocab_size, (11,), generator=torch.Generator().manual_seed(9)).tolist()
    torch_k, triton_k = KernelConfig(backend="torch"), KernelConfig(backend="triton")

    def step(new: list[int], prefix: int, kernels: KernelConfig) -> torch.Tensor:
        backend = TritonAttentionBackend() if kernels is triton_k else TorchAttentionBackend()
        batch = build_forward_batch([new], [prefix], [[1]], pool, backend, is_decode=len(new) == 1,
                                    kernels=kernels)
        with torch.no_grad():
            return model(batch)

    calls: dict[str, list[Any]] = {"oproj_route": [], "fused_moe_routed": [], "add_rms_norm_route": []}
    for name in calls:
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _r=real, _n=name, **kw: calls[_n].append(a) or _r(*a, **kw))
    step(toks[:10], 0, torch_k)
    ref = step(toks[10:], 10, torch_k)
    calls = {name: [] for name in calls}
    fused = step(toks[10:], 10, triton_k)
    assert {n: len(c) for n, c in calls.items()} == {"oproj_route": 2, "fused_moe_routed": 2,
                                                     "add_rms_norm_route": 0}
    assert all(isinstance(c[2], Fp8Weight) for c in calls["oproj_route"])  # o_proj's codes and scales
    assert all(isinstance(c[3], Fp8Weight) and isinstance(c[4], Fp8Weight) for c in calls["fused_moe_routed"])
    monkeypatch.setattr(ops, "oproj_route_applies", lambda *a: False)
    unfused = step(toks[10:], 10, triton_k)
    assert len(calls["oproj_route"]) == 2 and len(calls["add_rms_norm_route"]) == 2  # both layers' route launch
    assert torch.isfinite(fused).all()
    errs = rel_err(fused, unfused), rel_err(fused, ref), rel_err(unfused, ref)
    assert max(errs) < 1e-4, errs


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="the CUDA launches at qwen3-30b-a3b's shapes")
@pytest.mark.parametrize("t", [1, 2, 3, 4])
def test_gpu_decode_gemvs_at_real_shapes(t: int) -> None:
    """The decode GEMVs at their CUDA defaults (dense_fp8: qkv 5120 x 2048, o_proj
    2048 x 4096; the expert pair at E 128, H 2048, I 768, k 8) against the exact
    references, with a pending norm on qkv as the experts leave it."""
    g = torch.Generator().manual_seed(40 + t)
    for n, k in ((5120, 2048), (2048, 4096)):
        w = weight(g, (n, k))
        x = torch.randn(t, k, generator=g).bfloat16().to(DEVICE)
        assert rel_err(fv.fp8_gemv_triton(x, w), fp8_linear_ref(x, w)) < 4e-3
    s = torch.randn(t, 2048, generator=g).bfloat16().to(DEVICE)  # the residual sum of a pending norm
    nw = (1 + 0.1 * torch.randn(2048, generator=g)).bfloat16().to(DEVICE)
    parts = s.float().pow(2).reshape(t, 512, 4).sum(-1).contiguous()  # as 512 down programs leave them
    want = (nw.float() * s.float() * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    w = weight(g, (5120, 2048))
    got = fv.fp8_gemv_triton((nw * s).bfloat16(), w, parts=parts, eps=1e-6)
    assert rel_err(got, fp8_linear_ref(want, w)) < 8e-3
    if t <= fp8_ops.MOE_GEMV_MAX_TOKENS:
        w13, w2 = weight(g, (128, 1536, 2048)), weight(g, (128, 2048, 768))
        wts, ids = routing(g, t, 128, 8)
        x = torch.randn(t, 2048, generator=g).bfloat16().to(DEVICE)
        got = fmg.fused_moe_fp8_gemv_triton(x, w13, w2, wts, ids)
        assert rel_err(got, fm.fused_moe_fp8_ref(x, w13, w2, wts, ids)) < 8e-3
