"""fp8 e4m3 KV pages (issue 7 item 1): codes + per-(token, KV head) scales.

Triton kernels (store, split-K decode, extend) against the torch twins, which
quantize and dequantize the same way; page moves carry the scales; the pool's
memory plan counts them; and the real engine (tiny-moe, dummy weights) with an
fp8 KV cache stays close to an fp32 one: logits within a stated bound, most
greedy tokens identical (the fraction is printed and floored).
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # Kernels pick the interpreter when decorated (see test_kernels_attention.py).
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in ("ftserve_kernels.attention_common", "ftserve_kernels.attention_decode_triton",
                  "ftserve_kernels.attention_triton"):
        if _name in sys.modules:
            importlib.reload(sys.modules[_name])

from ftserve.kvcache.pool import KVPool  # noqa: E402
from ftserve.models.forward_batch import build_forward_batch  # noqa: E402
from ftserve_kernels import attention_triton as at  # noqa: E402
from ftserve_kernels.paged_attention import (  # noqa: E402
    FP8_DTYPE,
    TorchAttentionBackend,
    dequantize_fp8_ref,
    quantize_fp8_ref,
)

FP8 = FP8_DTYPE


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))


def fp8_case(
    new_lens: list[int], prefix_lens: list[int], hq: int, hkv: int, d: int, page_size: int,
    qdtype: torch.dtype, device: str, seed: int = 0,
) -> tuple[KVPool, list[list[int]], torch.Tensor, torch.Tensor, torch.Tensor]:
    """An fp8 pool whose pages hold quantized random prefixes (shuffled page
    tables), and new q/k/v in ``qdtype``."""
    g = torch.Generator().manual_seed(seed)
    need = [(p + n + page_size - 1) // page_size for p, n in zip(prefix_lens, new_lens)]
    num_pages = sum(need) + 3
    pool = KVPool(1, num_pages, page_size, hkv, d, FP8, device)
    assert pool.k_scale is not None and pool.v_scale is not None
    for codes, scales in ((pool.k, pool.k_scale), (pool.v, pool.v_scale)):
        # Rows of very different magnitudes: a shared scale would lose the small ones.
        x = torch.randn(codes.shape, generator=g) * torch.rand(codes.shape[:3] + (1,), generator=g) * 8
        c, s = quantize_fp8_ref(x)
        codes.copy_(c.to(device))
        scales.copy_(s.to(device))
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    tables, at_ = [], 0
    for n in need:
        tables.append(perm[at_: at_ + n])
        at_ += n
    t = sum(new_lens)
    q = (3 * torch.randn(t, hq, d, generator=g)).to(qdtype).to(device)
    k = torch.randn(t, hkv, d, generator=g).to(qdtype).to(device)
    v = torch.randn(t, hkv, d, generator=g).to(qdtype).to(device)
    return pool, tables, q, k, v


def clone_pool(pool: KVPool) -> KVPool:
    out = KVPool(pool.num_layers, pool.num_pages, pool.page_size, pool.num_kv_heads,
                 pool.head_dim, pool.dtype, pool.device)
    out.k.view(torch.uint8).copy_(pool.k.view(torch.uint8))
    out.v.view(torch.uint8).copy_(pool.v.view(torch.uint8))
    assert out.k_scale is not None and out.v_scale is not None
    assert pool.k_scale is not None and pool.v_scale is not None
    out.k_scale.copy_(pool.k_scale)
    out.v_scale.copy_(pool.v_scale)
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ----------------------------------------------------------- quantization


def test_quantize_error_bound() -> None:
    """e4m3 keeps 3 mantissa bits: relative error <= 2**-4 on normal codes, and
    the absolute error below the normal range is at most half a subnormal step."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, 32, generator=g) * torch.logspace(-4, 3, 64)[:, None, None]
    x[0, 0] = 0.0  # an all-zero row: finite scale, exact zeros
    codes, scale = quantize_fp8_ref(x)
    assert codes.dtype == FP8 and scale.shape == (64, 4) and torch.isfinite(scale).all()
    back = dequantize_fp8_ref(codes, scale)
    assert torch.equal(back[0, 0], torch.zeros(32))
    amax = x.abs().amax(-1)
    # The largest element of every row maps to +-448 exactly.
    assert torch.allclose(back.abs().amax(-1), amax, rtol=1e-6)
    err = (back - x).abs()
    bound = torch.maximum(x.abs() * 2**-4, scale[..., None] * 2**-10)
    assert (err <= bound * 1.0001).all()


# ----------------------------------------------------------- kernels vs twins


def test_store_matches_reference() -> None:
    """The Triton store's codes and scales equal the twin's bit for bit (the
    kernel rounds to the e4m3 grid itself), padded lanes included (D=24, Hkv=3)."""
    pool, _, _, k, v = fp8_case([9], [0], 3, 3, 24, 4, torch.float32, DEVICE)
    k = k * torch.logspace(-3, 2, 9, device=DEVICE)[:, None, None]
    ref = clone_pool(pool)
    loc = torch.tensor([5, 6, 7, 17, 18, 22, 23, 1, 2], dtype=torch.int64, device=DEVICE)
    at.store_kv_triton(pool.k[0], pool.v[0], k, v, loc, *pool.scales(0))
    from ftserve_kernels.paged_attention import store_kv_ref

    store_kv_ref(ref.k[0], ref.v[0], k, v, loc, *ref.scales(0))
    assert pool.k_scale is not None and ref.k_scale is not None
    assert pool.v_scale is not None and ref.v_scale is not None
    assert torch.equal(pool.k_scale, ref.k_scale) and torch.equal(pool.v_scale, ref.v_scale)
    assert same_bits(pool.k, ref.k) and same_bits(pool.v, ref.v)
    back = dequantize_fp8_ref(pool.k[0, loc], pool.k_scale[0, loc])
    assert rel_err(back, k) < 0.04


def run_both(new_lens: list[int], prefix_lens: list[int], hq: int, hkv: int, d: int,
             page_size: int, qdtype: torch.dtype, is_decode: bool,
             backend: at.TritonAttentionBackend | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Triton out, torch-twin out on the same fp8 pool, fp32-math out on the
    dequantized-but-unquantized inputs: what fp8 costs)."""
    pool, tables, q, k, v = fp8_case(new_lens, prefix_lens, hq, hkv, d, page_size, qdtype, DEVICE)
    ref_pool = clone_pool(pool)
    toks = [[1] * n for n in new_lens]
    backend = backend or at.TritonAttentionBackend()
    fb = build_forward_batch(toks, prefix_lens, tables, pool, backend, is_decode=is_decode)
    out = backend.forward(q, k, v, 0, fb)
    ref_fb = build_forward_batch(toks, prefix_lens, tables, ref_pool, TorchAttentionBackend())
    ref = ref_fb.attn_backend.forward(q, k, v, 0, ref_fb)
    assert same_bits(pool.k, ref_pool.k) and same_bits(pool.v, ref_pool.v)
    # Exact-KV peer: the same cache contents in fp32 (prefix dequantized, new tokens exact).
    full = KVPool(1, pool.num_pages, page_size, hkv, d, torch.float32, DEVICE)
    full.k.copy_(dequantize_fp8_ref(pool.k, pool.k_scale))  # type: ignore[arg-type]
    full.v.copy_(dequantize_fp8_ref(pool.v, pool.v_scale))  # type: ignore[arg-type]
    exact_fb = build_forward_batch(toks, prefix_lens, tables, full, TorchAttentionBackend())
    exact = exact_fb.attn_backend.forward(q, k, v, 0, exact_fb)
    return out, ref, exact


@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
def test_extend_fp8_matches_reference(qdtype: torch.dtype) -> None:
    out, ref, exact = run_both([7, 1, 20, 3], [0, 5, 13, 31], 4, 2, 32, 4, qdtype, False)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < (1e-4 if qdtype == torch.float32 else 2e-2)
    assert rel_err(ref, exact) < 0.05  # only the new tokens' quantization differs


def test_extend_fp8_packed_gqa() -> None:
    cpu = DEVICE == "cpu"
    cfg = at.AttnKernelConfig(16, 16, 4, 1, 16, 4, 1, 8, extend_pack_gqa=True) if cpu else \
        at.AttnKernelConfig(extend_block_m=64, extend_pack_gqa=True)
    out, ref, _ = run_both([7, 20], [0, 13], 8, 2, 32, 4, torch.float32, False,
                           at.TritonAttentionBackend(cfg=cfg))
    assert rel_err(out, ref) < 1e-4


@pytest.mark.parametrize("fused", [False, True])
def test_decode_fp8_matches_reference(fused: bool) -> None:
    cfg = at.AttnKernelConfig.for_device(torch.device(DEVICE), 32)
    cfg = at.AttnKernelConfig(**{**cfg.__dict__, "decode_fused_reduce": fused})
    out, ref, exact = run_both([1, 1, 1], [0, 37, 12], 8, 2, 32, 8, torch.float32, True,
                               at.TritonAttentionBackend(cfg=cfg))
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 1e-4
    assert rel_err(ref, exact) < 0.05
