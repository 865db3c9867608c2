"""Triton paged attention (store, split-K decode, extend) against the torch twin.

On the CPU the kernels run under TRITON_INTERPRET=1 at tiny shapes; on CUDA the
same tests run natively, and ``gpu``-marked tests use real shapes.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from typing import Any

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # The interpreter is chosen when a kernel is decorated: set it before import,
    # and re-decorate if another test imported the module without it.
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in ("ftserve_kernels.attention_common", "ftserve_kernels.attention_decode_triton",
                  "ftserve_kernels.attention_extend_triton", "ftserve_kernels.attention_triton"):
        if _name in sys.modules:
            importlib.reload(sys.modules[_name])

from ftserve.kvcache.pool import KVPool  # noqa: E402
from ftserve.models.forward_batch import build_forward_batch  # noqa: E402
from ftserve_kernels import attention_extend_triton as ate  # noqa: E402
from ftserve_kernels import attention_triton as at  # noqa: E402
from ftserve_kernels.paged_attention import TorchAttentionBackend, paged_attention_ref  # noqa: E402

# fp32 attention against the torch twin: fp32 dots under the interpreter and on
# the GPU alike (attention_common.mma multiplies fp32 operands in fp32, not TF32).
FP32_TOL = 1e-4


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))


def make_case(
    new_lens: list[int], prefix_lens: list[int], hq: int, hkv: int, d: int, page_size: int,
    dtype: torch.dtype, device: str, seed: int = 0,
) -> tuple[KVPool, list[list[int]], torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pool whose pages hold random prefixes, shuffled page tables, new q/k/v."""
    g = torch.Generator().manual_seed(seed)
    need = [(p + n + page_size - 1) // page_size for p, n in zip(prefix_lens, new_lens)]
    num_pages = sum(need) + 3
    pool = KVPool(1, num_pages, page_size, hkv, d, dtype, device)
    pool.k.copy_(torch.randn(pool.k.shape, generator=g).to(dtype))
    pool.v.copy_(torch.randn(pool.v.shape, generator=g).to(dtype))
    # The dummy page may hold garbage (padding writes): poison it.
    pool.k[:, :page_size] = float("nan")
    pool.v[:, :page_size] = float("nan")
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    tables, at_ = [], 0
    for n in need:
        tables.append(perm[at_ : at_ + n])
        at_ += n
    t = sum(new_lens)
    # Scaled queries make the softmax peaky, so a wrong key shows up in the output.
    q = (3 * torch.randn(t, hq, d, generator=g)).to(dtype).to(device)
    k = torch.randn(t, hkv, d, generator=g).to(dtype).to(device)
    v = torch.randn(t, hkv, d, generator=g).to(dtype).to(device)
    return pool, tables, q, k, v


def run_both(
    new_lens: list[int], prefix_lens: list[int], hq: int, hkv: int, d: int, page_size: int,
    dtype: torch.dtype, device: str, is_decode: bool,
    backend: at.TritonAttentionBackend | None = None,
) -> tuple[torch.Tensor, torch.Tensor, KVPool, KVPool]:
    pool, tables, q, k, v = make_case(new_lens, prefix_lens, hq, hkv, d, page_size, dtype, device)
    ref_pool = KVPool(1, pool.num_pages, page_size, hkv, d, dtype, device)
    ref_pool.k.copy_(pool.k)
    ref_pool.v.copy_(pool.v)
    toks = [[1] * n for n in new_lens]
    backend = backend or at.TritonAttentionBackend()
    fb = build_forward_batch(toks, prefix_lens, tables, pool, backend, is_decode=is_decode)
    out = backend.forward(q, k, v, 0, fb)
    # Again into a NaN-poisoned output: every row must be written, and the same.
    meta, scale = fb.attn, d**-0.5
    poisoned = torch.full_like(q, float("nan"))
    bound = backend.extend_token_bound
    if is_decode or (bound is None and meta.max_extend_len == 1):
        splits = backend.num_splits(len(new_lens), hkv, q.device)
        at.decode_attention_triton(q, pool.k[0], pool.v[0], meta.page_table, meta.seq_lens,
                                   page_size, scale, splits, cfg=backend.cfg, out=poisoned)
    else:
        ate.extend_attention_triton(q, pool.k[0], pool.v[0], meta.page_table, meta.qo_indptr,
                                   meta.prefix_lens, bound or meta.max_extend_len, page_size,
                                   scale, cfg=backend.cfg, out=poisoned)
    assert torch.equal(poisoned, out)
    ref_fb = build_forward_batch(toks, prefix_lens, tables, ref_pool, TorchAttentionBackend())
    ref = ref_fb.attn_backend.forward(q, k, v, 0, ref_fb)
    return out, ref, pool, ref_pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_matches_reference(dtype: torch.dtype) -> None:
    # Cold prefill, chunk over a cached prefix, a single-token row, unaligned lengths.
    out, ref, pool, ref_pool = run_both(
        [7, 1, 20, 3], [0, 5, 13, 31], hq=4, hkv=2, d=32, page_size=4,
        dtype=dtype, device=DEVICE, is_decode=False,
    )
    assert torch.equal(pool.k, ref_pool.k.to(pool.k.dtype)) or torch.allclose(
        pool.k.nan_to_num(7.0), ref_pool.k.nan_to_num(7.0)
    )
    assert torch.equal(pool.v.nan_to_num(7.0), ref_pool.v.nan_to_num(7.0))
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < (FP32_TOL if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 4)])
def test_extend_group_sizes_match_reference(hq: int, hkv: int) -> None:
    """Query heads sharing a KV head 4 to 1, and 1 to 1 (no GQA)."""
    out, ref, _, _ = run_both(
        [7, 1, 20, 3], [0, 5, 13, 31], hq=hq, hkv=hkv, d=32, page_size=4,
        dtype=torch.float32, device=DEVICE, is_decode=False,
    )
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < FP32_TOL


def test_extend_static_grid_bound() -> None:
    """A grid sized from an upper bound (the CUDA-graph mode) gives the same rows,
    including a batch padded with empty sequences (equal qo_indptr entries)."""
    cfg = at.AttnKernelConfig.for_device(torch.device(DEVICE), 32)
    pool, tables, q, k, v = make_case([9, 20], [5, 0], 4, 2, 32, 4, torch.float32, DEVICE)
    fb = build_forward_batch([[1] * 9, [1] * 20], [5, 0], tables, pool, TorchAttentionBackend())
    meta = fb.attn
    at.store_kv_triton(pool.k[0], pool.v[0], k, v, meta.out_cache_loc)
    args = (q, pool.k[0], pool.v[0])
    exact = ate.extend_attention_triton(*args, meta.page_table, meta.qo_indptr, meta.prefix_lens,
                                       20, 4, 32**-0.5, cfg)
    bounded = torch.full_like(q, float("nan"))
    ate.extend_attention_triton(*args, meta.page_table, meta.qo_indptr, meta.prefix_lens,
                               64, 4, 32**-0.5, cfg, out=bounded)
    assert torch.equal(exact, bounded)
    # Two padding sequences after the real ones: zero new tokens, dummy page rows.
    table = torch.cat([meta.page_table, torch.zeros_like(meta.page_table)])
    indptr = torch.cat([meta.qo_indptr, meta.qo_indptr[-1:].repeat(2)])
    prefix = torch.cat([meta.prefix_lens, torch.tensor([0, 3], dtype=torch.int32, device=DEVICE)])
    padded = torch.full_like(q, float("nan"))
    ate.extend_attention_triton(*args, table, indptr, prefix, 64, 4, 32**-0.5, cfg, out=padded)
    assert torch.equal(exact, padded)
    ref = paged_attention_ref(q, pool.k[0], pool.v[0], meta.page_table, [0, 9, 29], [14, 20],
                              4, 32**-0.5)
    assert rel_err(exact, ref) < FP32_TOL


def test_backend_extend_token_bound() -> None:
    """The backend's static-bound mode: same output; a one-token-per-sequence
    batch that is not marked decode stays on the extend kernel."""
    be = at.TritonAttentionBackend(extend_token_bound=48)
    out, ref, _, _ = run_both([7, 1, 20], [0, 5, 13], hq=4, hkv=2, d=32, page_size=4,
                              dtype=torch.float32, device=DEVICE, is_decode=False, backend=be)
    assert rel_err(out, ref) < FP32_TOL
    out, ref, _, _ = run_both([1, 1], [3, 17], hq=4, hkv=2, d=32, page_size=4,
                              dtype=torch.float32, device=DEVICE, is_decode=False, backend=be)
    assert rel_err(out, ref) < FP32_TOL


@pytest.mark.parametrize("hq,hkv", [(4, 2), (8, 2)])
def test_verify_queries_as_decode_match_reference(hq: int, hkv: int) -> None:
    """A verify step's layout (query_seq_lens / query_page_table: one split-K
    decode query per token, as the verify graphs attend) gives the extend
    layout's attention: sequences of 1 to 5 new tokens over prefixes that span
    several tiles, then padding tokens that read the NaN-poisoned dummy row at
    length 1 and touch no real row."""
    new, prefix = [5, 1, 3], [70, 9, 33]
    pool, tables, q, k, v = make_case(new, prefix, hq, hkv, 32, 4, torch.float32, DEVICE)
    ref_pool = KVPool(1, pool.num_pages, 4, hkv, 32, torch.float32, DEVICE)
    ref_pool.k.copy_(pool.k)
    ref_pool.v.copy_(pool.v)
    toks = [[1] * n for n in new]
    be = at.TritonAttentionBackend(extend_token_bound=16)
    fb = build_forward_batch(toks, prefix, tables, pool, be)
    t, pad = sum(new), 3
    rows = torch.tensor([i for i, n in enumerate(new) for _ in range(n)] + [len(new)] * pad, device=DEVICE)
    table = torch.cat([fb.attn.page_table, torch.zeros_like(fb.attn.page_table[:1])])  # + the dummy row
    fb.attn.query_page_table = table.index_select(0, rows)
    fb.attn.query_seq_lens = torch.cat([fb.positions + 1, torch.ones(pad, dtype=torch.int64, device=DEVICE)]
                                       ).to(torch.int32)
    qp = torch.cat([q, torch.randn(pad, hq, 32, device=DEVICE)])
    kp, vp = torch.cat([k, k[:pad]]), torch.cat([v, v[:pad]])
    fb.attn.out_cache_loc = torch.cat([fb.attn.out_cache_loc, torch.zeros(pad, dtype=torch.int64, device=DEVICE)])
    out = be.forward(qp, kp, vp, 0, fb)[:t]  # padding K/V lands in the dummy slot 0
    ref_fb = build_forward_batch(toks, prefix, tables, ref_pool, TorchAttentionBackend())
    ref = ref_fb.attn_backend.forward(q, k, v, 0, ref_fb)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < FP32_TOL


@pytest.mark.parametrize(
    "dtype,is_decode", [(torch.float32, True), (torch.bfloat16, True), (torch.float32, False)]
)
def test_decode_matches_reference(dtype: torch.dtype, is_decode: bool) -> None:
    # is_decode=False with one token per sequence takes the split-K path too.
    out, ref, pool, ref_pool = run_both(
        [1, 1, 1], [0, 16, 39], hq=8, hkv=2, d=32, page_size=4,
        dtype=dtype, device=DEVICE, is_decode=is_decode,
    )
    assert torch.equal(pool.k.nan_to_num(7.0), ref_pool.k.nan_to_num(7.0))
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < (FP32_TOL if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_decode", [True, False])  # False: three tokens of one sequence, extend
def test_backend_output_gate_matches_reference(dtype: torch.dtype, is_decode: bool) -> None:
    """Qwen3-Next's gated attention: out * sigmoid(gate), the gate a [T, Hq, D] view
    strided by q between its heads; on decode in the reduce launch (each product's
    roundings the torch ops'), after the extend kernel otherwise."""
    new, prefix = ([1, 1], [16, 5]) if is_decode else ([3], [6])
    pool, tables, q, k, v = make_case(new, prefix, 4, 2, 32, 4, dtype, DEVICE, seed=3)
    ref_pool = KVPool(1, pool.num_pages, 4, 2, 32, dtype, DEVICE)
    ref_pool.k.copy_(pool.k)
    ref_pool.v.copy_(pool.v)
    g = torch.Generator().manual_seed(4)
    qg = (2 * torch.randn(q.shape[0], 4, 2, 32, generator=g)).to(dtype).to(DEVICE)
    gate = qg[:, :, 1]
    toks = [[1] * n for n in new]
    be = at.TritonAttentionBackend()
    out = be.forward(q, k, v, 0, build_forward_batch(toks, prefix, tables, pool, be, is_decode=is_decode),
                     out_gate=gate)
    ref_fb = build_forward_batch(toks, prefix, tables, ref_pool, TorchAttentionBackend())
    ref = ref_fb.attn_backend.forward(q, k, v, 0, ref_fb, out_gate=gate)
    plain = ref_fb.attn_backend.forward(q, k, v, 0, ref_fb)
    assert torch.equal(ref, plain * torch.sigmoid(gate))
    assert rel_err(out, ref) < (FP32_TOL if dtype == torch.float32 else 2e-2)
    assert rel_err(plain, ref) > 0.1, "the gate changes the output"


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_decode_split_counts_agree(splits: int) -> None:
    """More splits than tiles leaves empty splits; every count gives the same answer."""
    pool, tables, q, k, v = make_case([1, 1], [50, 4], 4, 1, 32, 8, torch.float32, DEVICE)
    toks = [[1], [1]]
    fb = build_forward_batch(toks, [50, 4], tables, pool, TorchAttentionBackend(), is_decode=True)
    at.store_kv_triton(pool.k[0], pool.v[0], k, v, fb.attn.out_cache_loc)
    out = torch.full_like(q, float("nan"))
    at.decode_attention_triton(
        q, pool.k[0], pool.v[0], fb.attn.page_table, fb.attn.seq_lens, 8, 32**-0.5, splits, out=out
    )
    ref = paged_attention_ref(q, pool.k[0], pool.v[0], fb.attn.page_table, [0, 1, 2],
                              fb.attn.seq_lens_host, 8, 32**-0.5)
    assert rel_err(out, ref) < FP32_TOL


@pytest.mark.parametrize("splits", [1, 2, 8])
@pytest.mark.parametrize("fold", [False, True])
def test_decode_over_several_tiles_a_split_with_poisoned_scratch(splits: int, fold: bool,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The device config's split kernel (tiles dealt out in turn, each tile's
    page entries loaded one iteration ahead) against the reference, on the plain and the
    q/k-folding paths, with one, two or more tiles a split, empty splits (8),
    and the new token alone in its split or beside tiles. Every scratch buffer
    starts as NaN: nothing an empty split leaves unwritten may reach the output."""
    from ftserve_kernels.attention_decode_triton import DecodeQK
    from ftserve_kernels.norm_rope import qk_norm_rotary_ref

    d, page = 32, 4
    cfg = at.AttnKernelConfig.for_device(torch.device(DEVICE), d)
    bn = cfg.decode_block_n
    prefix = [4 * bn + 6, 4, 2 * bn + 1, bn]  # up to 5 tiles: two or more a split; bn: one full tile
    pool, tables, q, k, v = make_case([1] * 4, prefix, 8, 2, d, page, torch.float32, DEVICE, seed=splits)
    fb = build_forward_batch([[1]] * 4, prefix, tables, pool, TorchAttentionBackend(), is_decode=True)
    meta = fb.attn
    kc, vc = pool.k[0].clone(), pool.v[0].clone()
    ref_kc, ref_vc = pool.k[0].clone(), pool.v[0].clone()
    w = torch.ones(d, device=DEVICE)
    cos_sin = _rope_table(8 * bn, d).to(DEVICE)
    qk, ref_q = None, q
    if fold:
        qk = DecodeQK(k, v, w, w, 1e-6, fb.positions, cos_sin, meta.out_cache_loc)
        ref_q, _ = qk_norm_rotary_ref(q, k, w, w, 1e-6, fb.positions, cos_sin, (ref_kc, ref_vc, v, meta.out_cache_loc))
    else:
        at.store_kv_triton(kc, vc, k, v, meta.out_cache_loc)
        at.store_kv_triton(ref_kc, ref_vc, k, v, meta.out_cache_loc)
    ref = paged_attention_ref(ref_q, ref_kc, ref_vc, meta.page_table, [0, 1, 2, 3, 4], meta.seq_lens_host,
                              page, d**-0.5)
    empty = torch.empty

    def poisoned(*args: object, **kwargs: object) -> torch.Tensor:
        t = empty(*args, **kwargs)  # type: ignore[call-overload]
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)
    out = torch.full_like(q, float("nan"))
    at.decode_attention_triton(q, kc, vc, meta.page_table, meta.seq_lens, page, d**-0.5, splits,
                               cfg=cfg, out=out, qk=qk)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < (1e-5 if DEVICE == "cpu" else FP32_TOL), rel_err(out, ref)
    if fold:  # the new K/V as the reference stores them (K up to the norm's summation order)
        torch.testing.assert_close(kc.nan_to_num(7.0), ref_kc.nan_to_num(7.0), rtol=1e-6, atol=1e-6)
        assert torch.equal(vc.nan_to_num(7.0), ref_vc.nan_to_num(7.0))


def test_decode_reduce_block_d_splits_the_head() -> None:
    """decode_reduce_block_d: reduce programs of part of a head each; the same
    attention as whole-head programs."""
    d, page = 32, 4
    base = at.AttnKernelConfig.for_device(torch.device(DEVICE), d)
    pool, tables, q, k, v = make_case([1, 1], [37, 5], 4, 2, d, page, torch.float32, DEVICE, seed=3)
    fb = build_forward_batch([[1]] * 2, [37, 5], tables, pool, TorchAttentionBackend(), is_decode=True)
    at.store_kv_triton(pool.k[0], pool.v[0], k, v, fb.attn.out_cache_loc)
    outs = []
    for block in (0, 16, 8):
        cfg = at.AttnKernelConfig(**{**base.__dict__, "decode_reduce_block_d": block})
        outs.append(at.decode_attention_triton(q, pool.k[0], pool.v[0], fb.attn.page_table, fb.attn.seq_lens,
                                               page, d**-0.5, 4, cfg=cfg, out=torch.full_like(q, float("nan"))))
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=1e-6, atol=1e-6)


def test_decode_empty_sequence_gives_zeros() -> None:
    """CUDA-graph padding rows may carry seq_len 0: output must be finite (zeros)."""
    pool, tables, q, k, v = make_case([1], [9], 2, 1, 16, 4, torch.float32, DEVICE)
    table = torch.tensor([tables[0], [0] * len(tables[0])], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([10, 0], dtype=torch.int32, device=DEVICE)
    q2 = torch.cat([q, q])
    out = at.decode_attention_triton(q2, pool.k[0], pool.v[0], table, seq_lens, 4, 0.25, 4)
    assert torch.isfinite(out).all()
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_decode_reduce_drops_the_rows_of_empty_splits() -> None:
    """The rows of empty splits (lse -inf) were never stored and may hold
    anything, NaN included: none of it may reach the reduce kernel's output."""
    from ftserve_kernels.attention_decode_triton import _decode_reduce_kernel

    g = torch.Generator().manual_seed(5)
    b, h, s, d = 2, 3, 8, 16
    mid_o = torch.randn(b, h, s, d, generator=g)
    mid_lse = torch.randn(b, h, s, generator=g) * 3
    empty = torch.rand(b, h, s, generator=g) < 0.5
    empty[1, 2] = True  # a row with no split at all (graph padding): zeros
    mid_lse[empty] = float("-inf")
    want_o = mid_o.clone()
    mid_o[empty] = float("nan")
    w = torch.exp2(mid_lse - mid_lse.amax(-1, keepdim=True).nan_to_num(neginf=0.0))  # [b, h, s]
    want = (want_o * w[..., None]).sum(2) / w.sum(-1, keepdim=True).clamp_min(1e-30)
    want[1, 2] = 0.0
    mid_o, mid_lse = mid_o.to(DEVICE), mid_lse.to(DEVICE)
    for block_d in (d, d // 2):  # the whole head a program, or half of it
        out = torch.full((b, h, d), float("nan"), device=DEVICE)
        _decode_reduce_kernel[(b, h, d // block_d)](
            mid_o, mid_lse, out,
            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
            out.stride(0), out.stride(1), out, 0, 0, NUM_SPLITS=s, BLOCK_S=s, D=d, BLOCK_D=block_d, PDL=False,
        )
        assert not out.isnan().any()
        torch.testing.assert_close(out.cpu(), want, rtol=1e-5, atol=1e-6)


def test_backend_num_splits_depends_on_batch_size_only() -> None:
    be = at.TritonAttentionBackend()
    dev = torch.device(DEVICE)
    assert be.num_splits(1, 4, dev) >= be.num_splits(8, 4, dev) >= be.num_splits(64, 4, dev) >= 1


def test_num_splits_short_context_cap() -> None:
    """Below short_context_splits tiles of its longest sequence a decode batch
    takes at most that many splits (each then holds one tile at most, the new
    token's alone); at the limit's next token and without a bound, the
    batch-size rule alone."""
    cfg = at.AttnKernelConfig(decode_programs_per_sm=512, max_splits=128, decode_block_n=64,
                              short_context_splits=64)
    be = at.TritonAttentionBackend(cfg=cfg)
    dev = torch.device("cpu")
    limit = be.short_context_limit(dev)
    assert limit == 63 * 64
    assert be.num_splits(1, 4, dev) == be.num_splits(1, 4, dev, limit + 1) == 128
    assert be.num_splits(1, 4, dev, limit) == be.num_splits(1, 4, dev, 1) == 64
    small = be.num_splits(64, 4, dev)  # below the cap already: unchanged
    assert small < 64 and be.num_splits(64, 4, dev, 100) == small
    off = at.TritonAttentionBackend(cfg=dataclasses.replace(cfg, short_context_splits=0))
    assert off.short_context_limit(dev) == 0 and off.num_splits(1, 4, dev, 100) == 128


@pytest.mark.parametrize("prefix", [[1000, 3], [4030, 7]])
def test_decode_at_the_short_context_cap_is_attention(prefix: list[int]) -> None:
    """At the cap's split count every split holds at most one tile: decode over
    the backend's cap (long enough that it binds) equals the reference."""
    d, page = 32, 16
    cfg = dataclasses.replace(at.AttnKernelConfig.for_device(torch.device(DEVICE), d),
                              decode_block_n=64, short_context_splits=64, max_splits=128,
                              decode_programs_per_sm=512)
    pool, tables, q, k, v = make_case([1] * len(prefix), prefix, 4, 2, d, page, torch.float32, DEVICE, seed=5)
    be = at.TritonAttentionBackend(cfg=cfg)
    fb = build_forward_batch([[1]] * len(prefix), prefix, tables, pool, be, is_decode=True)
    assert be.num_splits(len(prefix), 2, q.device, fb.attn.max_seq_len) == 64
    out = be.forward(q, k, v, 0, fb)
    ref = TorchAttentionBackend().forward(q, k, v, 0, build_forward_batch(
        [[1]] * len(prefix), prefix, tables, pool, TorchAttentionBackend(), is_decode=True), kv_stored=True)
    assert rel_err(out, ref) < 1e-5, rel_err(out, ref)


# ---------------------------------------------------------------- split-K extend


def _split_case(new_lens: list[int], prefix_lens: list[int], hq: int, hkv: int, pad_seqs: int = 0,
                pad_tokens: int = 0):  # type: ignore[no-untyped-def]
    """make_case's pool with the new K/V stored, and the extend arguments of a
    batch padded as prefill graphs pad: ``pad_seqs`` empty sequences (qo_indptr
    repeats, the dummy page row) and ``pad_tokens`` q rows past qo_indptr[B]."""
    pool, tables, q, k, v = make_case(new_lens, prefix_lens, hq, hkv, 32, 4, torch.float32, DEVICE)
    fb = build_forward_batch([[1] * n for n in new_lens], prefix_lens, tables, pool, TorchAttentionBackend())
    meta = fb.attn
    at.store_kv_triton(pool.k[0], pool.v[0], k, v, meta.out_cache_loc)
    table = torch.cat([meta.page_table, torch.zeros_like(meta.page_table[:1]).repeat(pad_seqs, 1)])
    indptr = torch.cat([meta.qo_indptr, meta.qo_indptr[-1:].repeat(pad_seqs)])
    prefix = torch.cat([meta.prefix_lens, torch.full((pad_seqs,), 3, dtype=torch.int32, device=DEVICE)])
    q = torch.cat([q, torch.randn(pad_tokens, hq, 32, device=DEVICE)])
    ref = paged_attention_ref(q[: sum(new_lens)], pool.k[0], pool.v[0], meta.page_table, meta.qo_indptr.tolist(),
                              meta.seq_lens.tolist(), 4, 32**-0.5)
    return pool, (q, pool.k[0], pool.v[0], table, indptr, prefix), ref


@pytest.mark.parametrize("splits,hq,grouped", [(1, 4, False), (2, 4, False), (3, 4, False), (4, 4, False),
                                                (3, 8, False), (3, 4, True), (4, 8, True), (2, 6, True)])
def test_extend_split_matches_extend_and_reference(splits: int, hq: int, grouped: bool) -> None:
    """Several sequences (a cold one, a single new token, a prefix of 0, prefixes
    longer than a split's share of tiles, more splits than a sequence has
    tiles), two empty padding sequences and padding rows: the split-K launch
    equals the plain extend kernel and the torch twin, and leaves the padding
    rows alone. ``grouped``: a program serves all query heads of a KV head
    (GQA groups of 2, 4 and 3, padded to 4)."""
    new, pre = [7, 1, 20, 3, 1], [0, 5, 13, 70, 0]
    t = sum(new)
    _, args, ref = _split_case(new, pre, hq, 2, pad_seqs=2, pad_tokens=5)
    bound = 24  # a static bound above the longest chunk, as in a graph
    plain = torch.full_like(args[0], float("nan"))
    ate.extend_attention_triton(*args, bound, 4, 32**-0.5, out=plain)
    split = torch.full_like(args[0], float("nan"))
    ate.extend_split_attention_triton(*args, bound, 4, 32**-0.5, splits, out=split, group_heads=grouped)
    assert torch.isfinite(split[:t]).all() and split[t:].isnan().all()
    assert rel_err(split[:t], plain[:t]) < FP32_TOL
    assert rel_err(split[:t], ref) < FP32_TOL


def test_extend_split_rows_past_their_keys() -> None:
    """32 new tokens in 16-row blocks over a 2-token prefix, 8 splits: the
    split holding a block's last masked tile has no key visible to its first
    rows (their partial is empty, lse -inf, and the reduce weighs it 0), and
    the result is still attention; so with 64-row blocks, 2 and 3 splits."""
    _, args, ref = _split_case([32], [2], 4, 2)
    for splits, bm, grouped in ((8, 16, False), (2, 64, False), (3, 64, False), (3, 64, True)):
        out = ate.extend_split_attention_triton(*args, 32, 4, 32**-0.5, splits, block_m=bm, group_heads=grouped)
        assert torch.isfinite(out).all()
        assert rel_err(out, ref) < FP32_TOL


def test_extend_num_splits_policy() -> None:
    """H100 (132 SMs), Qwen3-Next's attention (16 q heads, head_dim 256) and
    Qwen3-30B-A3B's (32 q heads, 128): few new tokens over a long prefix get
    many splits; a grid that fills the GPU, or a context too short to share,
    keeps the plain kernel (S = 1)."""
    sms = 132
    for hq, d in ((16, 256), (32, 128)):
        cfg = at.AttnKernelConfig.for_device(torch.device("cuda"), d)
        bm, bn = cfg.extend_block_m, cfg.extend_block_n

        def splits(new: int, kv: int, cfg: at.AttnKernelConfig = cfg, hq: int = hq,
                   bm: int = bm, bn: int = bn) -> int:
            return ate.extend_num_splits(hq * -(-new // bm), -(-kv // bn), sms, cfg)

        s16 = splits(16, 106_000 + 16)  # the agentic turn / hybrid tail chunk
        assert 1 < s16 <= cfg.extend_max_splits and hq * s16 >= cfg.extend_programs_per_sm * sms
        s200 = splits(200, 100_000 + 200)
        assert 1 < s200 < cfg.extend_max_splits and hq * 4 * s200 >= 2 * sms
        assert 1 < splits(16, 8_192 + 16) <= cfg.extend_max_splits
        assert splits(4096, 4096) == 1 and splits(4096, 100_000 + 4096) == 1  # the cold chunk's path
        assert splits(16, 16) == 1 and splits(200, 200) == 1  # nothing worth sharing
        for new, kv in ((16, 300), (64, 2000), (256, 50_000)):  # powers of two, capped, >= min tiles each
            s = splits(new, kv)
            assert s & (s - 1) == 0 and s <= cfg.extend_max_splits
            assert s == 1 or s * cfg.extend_split_min_tiles <= -(-kv // bn)


def test_backend_extend_splits_from_host_values() -> None:
    """The backend asks the policy with the step's host values (eager: each
    sequence's new tokens) or the graph's static bound; an explicit count wins."""
    cfg = at.AttnKernelConfig.for_device(torch.device(DEVICE), 32)
    dev = torch.device(DEVICE)
    pool = KVPool(1, 80, 4, 2, 32, torch.float32, DEVICE)
    meta = build_forward_batch([[1] * 5], [300], [list(range(1, 78))], pool, TorchAttentionBackend()).attn
    sms = at._num_sms(dev)
    blocks = -(-5 // cfg.extend_block_m)
    want = ate.extend_num_splits(2 * blocks, -(-305 // cfg.extend_block_n), sms, cfg)
    assert at.TritonAttentionBackend().extend_splits(2, meta, cfg, dev) == want > 1
    # A graph bucket of 16 blocks per head fills these SMs: the plain kernel.
    graph = at.TritonAttentionBackend(extend_token_bound=16 * cfg.extend_block_m)
    assert graph.extend_splits(2, meta, cfg, dev) == (1 if 2 * 16 >= sms else want)
    assert at.TritonAttentionBackend(extend_splits=3).extend_splits(2, meta, cfg, dev) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_split_extend_matches_reference(dtype: torch.dtype) -> None:
    """TritonAttentionBackend.forward on the split-K path (store + split + reduce)
    against the torch backend, and with an output gate."""
    new, pre = [3, 1, 9], [40, 0, 21]
    pool, tables, q, k, v = make_case(new, pre, 4, 2, 32, 4, dtype, DEVICE)
    ref_pool = KVPool(1, pool.num_pages, 4, 2, 32, dtype, DEVICE)
    ref_pool.k.copy_(pool.k)
    ref_pool.v.copy_(pool.v)
    toks = [[1] * n for n in new]
    be = at.TritonAttentionBackend(extend_splits=4)
    gate = torch.randn_like(q)
    out = be.forward(q, k, v, 0, build_forward_batch(toks, pre, tables, pool, be), out_gate=gate)
    ref_fb = build_forward_batch(toks, pre, tables, ref_pool, TorchAttentionBackend())
    ref = ref_fb.attn_backend.forward(q, k, v, 0, ref_fb, out_gate=gate)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < (FP32_TOL if dtype == torch.float32 else 2e-2)


def test_model_greedy_with_split_extend_over_a_prefix_hit(tmp_path: object) -> None:
    """The real model path: a prompt's KV cached (torch backend), then a short
    turn over it through the split-K extend (4 splits, both layers), then decode:
    the greedy tokens equal a full recompute's."""
    from ftserve.models.checkpoint import write_checkpoint
    from ftserve.models.loader import load_model
    from tests.engine_util import make_context_sensitive, reference_greedy

    write_checkpoint("tiny-moe", tmp_path, config_only=True)  # type: ignore[arg-type]
    model, mcfg = load_model(tmp_path, "float32", "cpu", "dummy")  # type: ignore[arg-type]
    make_context_sensitive(model)
    g = torch.Generator().manual_seed(5)
    first = torch.randint(10, 32000, (45,), generator=g).tolist()
    turn = torch.randint(10, 32000, (6,), generator=g).tolist()
    pool = KVPool(len(mcfg.kv_layers), 8, 16, mcfg.num_kv_heads, mcfg.head_dim, torch.float32, "cpu")
    pages = list(range(1, 8))
    seq = first + turn
    with torch.inference_mode():
        model(build_forward_batch([first], [0], [pages], pool, TorchAttentionBackend()))
        split = at.TritonAttentionBackend(extend_splits=4)
        out = [int(model(build_forward_batch([turn], [len(first)], [pages], pool, split))[0].argmax())]
        for _ in range(2):
            fb = build_forward_batch([[out[-1]]], [len(seq) + len(out) - 1], [pages], pool,
                                     TorchAttentionBackend())
            out.append(int(model(fb)[0].argmax()))
    assert out == reference_greedy(model, mcfg, seq, 3)


# ---------------------------------------------------------------- GPU, real shapes

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_gpu_extend_real_shape(page_size: int) -> None:
    out, ref, _, _ = run_both(
        [700, 1, 129], [5000, 0, 300], hq=32, hkv=4, d=128, page_size=page_size,
        dtype=torch.bfloat16, device="cuda", is_decode=False,
    )
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 2e-2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("prefix", [[100_000], [5, 2047, 30_000, 0, 1, 16, 63, 64]])
def test_gpu_decode_real_shape(prefix: list[int]) -> None:
    out, ref, _, _ = run_both(
        [1] * len(prefix), prefix, hq=32, hkv=4, d=128, page_size=16,
        dtype=torch.bfloat16, device="cuda", is_decode=True,
    )
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 2e-2


@pytest.mark.gpu
@gpu
def test_gpu_decode_poisoned_output_and_graph_replay() -> None:
    """Capture decode in a CUDA graph, change seq_lens/page table in place, replay."""
    pool, tables, q, k, v = make_case([1, 1], [3000, 70], 32, 4, 128, 16, torch.bfloat16, "cuda")
    fb = build_forward_batch([[1], [1]], [3000, 70], tables, pool, TorchAttentionBackend(),
                             is_decode=True)
    meta = fb.attn
    kc, vc = pool.k[0], pool.v[0]
    at.store_kv_triton(kc, vc, k, v, meta.out_cache_loc)
    be = at.TritonAttentionBackend()
    splits = be.num_splits(2, 4, q.device)
    out = torch.full_like(q, float("nan"))
    seq_lens = meta.seq_lens.clone()
    table = meta.page_table.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up compiles outside the capture
        at.decode_attention_triton(q, kc, vc, table, seq_lens, 16, 128**-0.5, splits, out=out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        at.decode_attention_triton(q, kc, vc, table, seq_lens, 16, 128**-0.5, splits, out=out)
    for lens in ([3001, 71], [17, 80]):  # within each table's pages (80 = 5 pages of 16)
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        ref = paged_attention_ref(q, kc, vc, table, [0, 1, 2], lens, 16, 128**-0.5)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        assert rel_err(out, ref) < 2e-2


@pytest.mark.gpu
@gpu
def test_gpu_extend_graph_replay_static_bound() -> None:
    """Capture extend once with a grid sized from a 1024-token budget, then replay
    with different sequence counts, lengths and prefixes refilled in place."""
    budget, bsz, width = 1024, 3, 160
    cfg = at.AttnKernelConfig()
    pool, tables, q, k, v = make_case([budget], [1400], 32, 4, 128, 16, torch.bfloat16, "cuda")
    kc, vc = pool.k[0], pool.v[0]
    pages = torch.tensor(tables[0], dtype=torch.int32, device="cuda")
    table = torch.zeros(bsz, width, dtype=torch.int32, device="cuda")
    indptr = torch.zeros(bsz + 1, dtype=torch.int32, device="cuda")
    prefix = torch.zeros(bsz, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)

    def run() -> None:
        ate.extend_attention_triton(q, kc, vc, table, indptr, prefix, budget, 16, 128**-0.5,
                                   cfg, out=out)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    # (new tokens, prefix) per sequence; every sequence reads the same pages.
    for case in ([(1024, 1400)], [(300, 0), (700, 1400), (24, 77)], [(1, 5), (1000, 1)]):
        table.zero_()
        indptr.zero_()
        prefix.zero_()
        for b, (n, p) in enumerate(case):
            table[b, : pages.numel()] = pages
            indptr[b + 1] = indptr[b] + n
            prefix[b] = p
        indptr[len(case) + 1 :] = indptr[len(case)]
        out.fill_(float("nan"))
        graph.replay()
        bounds = [0]
        for n, _ in case:
            bounds.append(bounds[-1] + n)
        ref = paged_attention_ref(q[: bounds[-1]], kc, vc, table[: len(case)], bounds,
                                  [n + p for n, p in case], 16, 128**-0.5)
        torch.cuda.synchronize()
        assert torch.isfinite(out[: bounds[-1]]).all()
        assert rel_err(out[: bounds[-1]], ref) < 2e-2


def _rope_table(max_pos: int, d: int) -> torch.Tensor:
    inv = 1.0 / (10000.0 ** (torch.arange(0, d // 2, dtype=torch.float64) / (d // 2)))
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=1).float()  # [max_pos, d]: cos | sin


@pytest.mark.parametrize("dtype,splits,norm", [(torch.float32, 1, True), (torch.float32, 3, True),
                                               (torch.float32, 8, True), (torch.bfloat16, 5, True),
                                               (torch.float32, 3, False), (torch.bfloat16, 1, False)])
def test_decode_qk_fold_matches_norm_rotary_then_attention(dtype: torch.dtype, splits: int, norm: bool) -> None:
    """DecodeQK: the split kernel normalizes and rotates raw q/k itself and stores
    K/V: same pages as qk_norm_rotary_ref's store, same output as attention over
    its rotated q. The new token goes to split n_tiles % splits: prefixes 0,
    16, 39 put it alone in its split or, with one split, beside the tiles.
    Without norm weights (a model without q/k norms) the rotary and the store alone."""
    from ftserve_kernels.attention_decode_triton import DecodeQK
    from ftserve_kernels.norm_rope import qk_norm_rotary_ref

    prefix, d, hq, hkv, page = [0, 16, 39], 32, 8, 2, 4
    pool, tables, q, k, v = make_case([1, 1, 1], prefix, hq, hkv, d, page, dtype, DEVICE, seed=splits)
    ref_pool = KVPool(1, pool.num_pages, page, hkv, d, dtype, DEVICE)
    ref_pool.k.copy_(pool.k)
    ref_pool.v.copy_(pool.v)
    g = torch.Generator().manual_seed(11)
    q_w = (1 + 0.2 * torch.randn(d, generator=g)).to(dtype).to(DEVICE) if norm else None
    k_w = (1 + 0.2 * torch.randn(d, generator=g)).to(dtype).to(DEVICE) if norm else None
    cos_sin = _rope_table(64, d).to(DEVICE)
    toks = [[1]] * 3
    fb = build_forward_batch(toks, prefix, tables, pool, TorchAttentionBackend(), is_decode=True)
    meta = fb.attn
    cfg = at.AttnKernelConfig()
    qo, _ = qk_norm_rotary_ref(q, k, q_w, k_w, 1e-6, fb.positions, cos_sin,
                               (ref_pool.k[0], ref_pool.v[0], v, meta.out_cache_loc))
    ref = at.decode_attention_triton(qo, ref_pool.k[0], ref_pool.v[0], meta.page_table, meta.seq_lens,
                                     page, d**-0.5, splits, cfg=cfg)
    out = torch.full_like(q, float("nan"))
    before_k = pool.k.clone()
    qk = DecodeQK(k, v, q_w, k_w, 1e-6, fb.positions, cos_sin, meta.out_cache_loc)
    at.decode_attention_triton(q, pool.k[0], pool.v[0], meta.page_table, meta.seq_lens, page,
                               d**-0.5, splits, cfg=cfg, out=out, qk=qk)
    # K as the reference stores it, up to the norm's summation order (an fp32 ulp,
    # or a bf16 rounding flip); V exactly; nothing else written.
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(pool.k.nan_to_num(7.0), ref_pool.k.nan_to_num(7.0), **tol)
    assert torch.equal(pool.v.nan_to_num(7.0), ref_pool.v.nan_to_num(7.0))
    loc = meta.out_cache_loc
    assert not torch.equal(pool.k[0, loc], before_k[0, loc])
    pool.k[0, loc] = before_k[0, loc]
    assert torch.equal(pool.k.nan_to_num(7.0), before_k.nan_to_num(7.0)), "a write outside the new slots"
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < ((1e-5 if DEVICE == "cpu" else FP32_TOL) if dtype == torch.float32 else 2e-2), rel_err(out, ref)


def test_backend_decode_qk_applies_to_decode_only() -> None:
    pool, tables, q, k, v = make_case([1, 2], [5, 3], 4, 2, 32, 4, torch.float32, DEVICE)
    backend = at.TritonAttentionBackend()
    w = torch.ones(32, device=DEVICE)
    fb = build_forward_batch([[1], [1, 1]], [5, 3], tables, pool, backend, is_decode=False)
    assert backend.decode_qk(q, k, v, 0, fb, w, w, 1e-6, _rope_table(16, 32).to(DEVICE)) is None
    fb = build_forward_batch([[1], [1]], [5, 3], tables, pool, backend, is_decode=True)
    half = _rope_table(16, 16).to(DEVICE)  # partial rotary
    assert backend.decode_qk(q[:2], k[:2], v[:2], 0, fb, w, w, 1e-6, half) is None
    assert backend.decode_qk(q[:2], k[:2], v[:2], 0, fb, w, w, 1e-6, _rope_table(16, 32).to(DEVICE)) is not None
    # No q/k norms (Llama): the same fold, the rotary and the store alone.
    assert backend.decode_qk(q[:2], k[:2], v[:2], 0, fb, None, None, 0.0, _rope_table(16, 32).to(DEVICE)) is not None
    # A head dim not a power of two (the kernel's halves are aranges): the usual path.
    pool, tables, q, k, v = make_case([1, 1], [5, 3], 4, 2, 24, 4, torch.float32, DEVICE)
    fb = build_forward_batch([[1], [1]], [5, 3], tables, pool, backend, is_decode=True)
    assert backend.decode_qk(q, k, v, 0, fb, None, None, 0.0, _rope_table(16, 24).to(DEVICE)) is None


def _verify_case(new: list[int], prefix: list[int], hq: int, hkv: int, d: int, page: int, dtype: torch.dtype,
                 seed: int, backend: Any = None, pad: int = 2,
                 ) -> tuple[KVPool, Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A verify step's layout as the verify graphs attend (one decode query per
    token, its sequence's first row), then ``pad`` padding tokens reading the
    NaN-poisoned dummy row at length 1 and writing the dummy slot 0."""
    pool, tables, q, k, v = make_case(new, prefix, hq, hkv, d, page, dtype, DEVICE, seed=seed)
    fb = build_forward_batch([[1] * n for n in new], prefix, tables, pool, backend or TorchAttentionBackend())
    meta = fb.attn
    rows = [i for i, n in enumerate(new) for _ in range(n)]
    table = torch.cat([meta.page_table, torch.zeros_like(meta.page_table[:1])])  # + the dummy row
    t = sum(new)
    g = torch.Generator().manual_seed(seed + 100)
    meta.query_page_table = table.index_select(0, torch.tensor(rows + [len(new)] * pad, device=DEVICE))
    fb.positions = torch.cat([fb.positions, torch.zeros(pad, dtype=torch.int64, device=DEVICE)])
    meta.query_seq_lens = (fb.positions + 1).to(torch.int32)
    starts = [sum(new[:i]) for i in range(len(new))]
    meta.query_first_rows = torch.tensor([starts[i] for i in rows] + list(range(t, t + pad)), device=DEVICE)
    meta.query_rows_bound = max(new)
    meta.out_cache_loc = torch.cat([meta.out_cache_loc, torch.zeros(pad, dtype=torch.int64, device=DEVICE)])
    extra = [(3 * torch.randn(pad, hq, d, generator=g)).to(dtype).to(DEVICE),
             torch.randn(pad, hkv, d, generator=g).to(dtype).to(DEVICE),
             torch.randn(pad, hkv, d, generator=g).to(dtype).to(DEVICE)]
    q, k, v = (torch.cat([x, e]) for x, e in zip((q, k, v), extra))
    return pool, fb, q, k, v


@pytest.mark.parametrize("dtype,splits,norm", [(torch.float32, 1, True), (torch.float32, 3, True),
                                               (torch.float32, 8, False), (torch.bfloat16, 5, True),
                                               (torch.bfloat16, 2, False)])
def test_verify_qk_fold_matches_norm_rotary_then_attention(dtype: torch.dtype, splits: int, norm: bool) -> None:
    """DecodeQK with first_rows (a verify step: 4, 1 and 3 new tokens over
    prefixes of 70, 0 and 130, one to three 64-token tiles dealt to the splits,
    or none): each query rotates its sequence's new keys up to its own from k
    and stores only its own. The pages equal qk_norm_rotary_ref's store of
    every new token, the output attention over the rotated q with every key
    read from the pages; padding rows attend to their own key alone."""
    from ftserve_kernels.attention_decode_triton import DecodeQK
    from ftserve_kernels.norm_rope import qk_norm_rotary_ref

    new, prefix, d, hq, hkv, page = [4, 1, 3], [70, 0, 130], 32, 8, 2, 4
    pool, fb, q, k, v = _verify_case(new, prefix, hq, hkv, d, page, dtype, seed=splits)
    meta = fb.attn
    ref_pool = KVPool(1, pool.num_pages, page, hkv, d, dtype, DEVICE)
    ref_pool.k.copy_(pool.k)
    ref_pool.v.copy_(pool.v)
    g = torch.Generator().manual_seed(12)
    q_w = (1 + 0.2 * torch.randn(d, generator=g)).to(dtype).to(DEVICE) if norm else None
    k_w = (1 + 0.2 * torch.randn(d, generator=g)).to(dtype).to(DEVICE) if norm else None
    cos_sin = _rope_table(256, d).to(DEVICE)
    cfg = at.AttnKernelConfig()
    qo, _ = qk_norm_rotary_ref(q, k, q_w, k_w, 1e-6, fb.positions, cos_sin,
                               (ref_pool.k[0], ref_pool.v[0], v, meta.out_cache_loc))
    ref = at.decode_attention_triton(qo, ref_pool.k[0], ref_pool.v[0], meta.query_page_table,
                                     meta.query_seq_lens, page, d**-0.5, splits, cfg=cfg)
    out = torch.full_like(q, float("nan"))
    before_k = pool.k.clone()
    qk = DecodeQK(k, v, q_w, k_w, 1e-6, fb.positions, cos_sin, meta.out_cache_loc, meta.query_first_rows,
                  meta.query_rows_bound)
    at.decode_attention_triton(q, pool.k[0], pool.v[0], meta.query_page_table, meta.query_seq_lens, page,
                               d**-0.5, splits, cfg=cfg, out=out, qk=qk)
    # The real pages (the dummy page takes every padding token's store: the last one wins).
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(pool.k[:, page:], ref_pool.k[:, page:], **tol)
    assert torch.equal(pool.v[:, page:], ref_pool.v[:, page:])
    loc = meta.out_cache_loc
    pool.k[0, loc] = before_k[0, loc]
    assert torch.equal(pool.k.nan_to_num(7.0), before_k.nan_to_num(7.0)), "a write outside the new slots"
    # Real rows as the reference; a padding row attends to its own key (the
    # reference's read the dummy slot after the last padding store), finite.
    t = sum(new)
    assert torch.isfinite(out).all()
    assert rel_err(out[:t], ref[:t]) < ((1e-5 if DEVICE == "cpu" else FP32_TOL) if dtype == torch.float32
                                        else 2e-2), rel_err(out[:t], ref[:t])


def test_backend_decode_qk_takes_verify_steps() -> None:
    """The backend folds a verify step (query_first_rows set, at most
    MAX_VERIFY_ROWS tokens a sequence) into the split kernel, as its forward
    would attend after qk_norm_rotary's store; past the bound, the usual path."""
    from ftserve_kernels.norm_rope import qk_norm_rotary_ref

    new, prefix, d, page = [3, 2], [9, 21], 32, 4
    backend = at.TritonAttentionBackend(extend_token_bound=8)
    pool, fb, q, k, v = _verify_case(new, prefix, 4, 2, d, page, torch.float32, seed=4, backend=backend)
    meta = fb.attn
    ref_pool = KVPool(1, pool.num_pages, page, 2, d, torch.float32, DEVICE)
    ref_pool.k.copy_(pool.k)
    ref_pool.v.copy_(pool.v)
    cos_sin = _rope_table(64, d).to(DEVICE)
    w = (1 + 0.1 * torch.arange(d, dtype=torch.float32)).to(DEVICE)
    out = backend.decode_qk(q, k, v, 0, fb, w, w, 1e-6, cos_sin)
    assert out is not None
    out = out[:sum(new)]  # padding rows: see the test above
    qo, ko = qk_norm_rotary_ref(q, k, w, w, 1e-6, fb.positions, cos_sin,
                                (ref_pool.k[0], ref_pool.v[0], v, meta.out_cache_loc))
    ref_fb = dataclasses.replace(fb, kv_pool=ref_pool)
    ref = backend.forward(qo, ko, v, 0, ref_fb, kv_stored=True)[:sum(new)]
    assert rel_err(out, ref) < FP32_TOL
    meta.query_rows_bound = at.MAX_VERIFY_ROWS + 1
    assert backend.decode_qk(q, k, v, 0, fb, w, w, 1e-6, cos_sin) is None
    meta.query_rows_bound, meta.query_first_rows = 3, None
    assert backend.decode_qk(q, k, v, 0, fb, w, w, 1e-6, cos_sin) is None


@pytest.mark.gpu
def test_gpu_decode_qk_fold_real_shape() -> None:
    """qwen3-30b-a3b heads (32 q, 4 kv, d 128), bf16, contexts to 3,000 at the
    backend's own split count: the fold against qk_norm_rotary + attention."""
    from ftserve_kernels.attention_decode_triton import DecodeQK
    from ftserve_kernels.rope_triton import qk_norm_rotary_triton

    prefix, d, page = [3000, 17, 1024, 64], 128, 16
    pool, tables, q, k, v = make_case([1] * 4, prefix, 32, 4, d, page, torch.bfloat16, "cuda", seed=3)
    ref_pool = KVPool(1, pool.num_pages, page, 4, d, torch.bfloat16, "cuda")
    ref_pool.k.copy_(pool.k)
    ref_pool.v.copy_(pool.v)
    g = torch.Generator().manual_seed(1)
    q_w = (1 + 0.2 * torch.randn(d, generator=g)).to(torch.bfloat16).cuda()
    k_w = (1 + 0.2 * torch.randn(d, generator=g)).to(torch.bfloat16).cuda()
    cos_sin = _rope_table(4096, d).cuda()
    backend = at.TritonAttentionBackend()
    fb = build_forward_batch([[1]] * 4, prefix, tables, pool, backend, is_decode=True)
    meta = fb.attn
    qo, _ = qk_norm_rotary_triton(q, k, q_w, k_w, 1e-6, fb.positions, cos_sin,
                                  (ref_pool.k[0], ref_pool.v[0], v, meta.out_cache_loc))
    splits = backend.num_splits(4, 4, q.device)
    ref = at.decode_attention_triton(qo, ref_pool.k[0], ref_pool.v[0], meta.page_table,
                                     meta.seq_lens, page, d**-0.5, splits)
    out = torch.full_like(q, float("nan"))
    at.decode_attention_triton(q, pool.k[0], pool.v[0], meta.page_table, meta.seq_lens, page, d**-0.5,
                               splits, out=out,
                               qk=DecodeQK(k, v, q_w, k_w, 1e-6, fb.positions, cos_sin, meta.out_cache_loc))
    torch.cuda.synchronize()
    torch.testing.assert_close(pool.k.nan_to_num(7.0), ref_pool.k.nan_to_num(7.0), rtol=2e-2, atol=2e-2)
    assert torch.equal(pool.v.nan_to_num(7.0), ref_pool.v.nan_to_num(7.0))
    assert torch.isfinite(out).all() and rel_err(out, ref) < 1e-2, rel_err(out, ref)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("hq,hkv,d,norm", [(9, 3, 64, False), (32, 4, 128, True)])  # SmolLM2's, Qwen3-30B-A3B's
def test_gpu_verify_qk_fold_real_shape(hq: int, hkv: int, d: int, norm: bool) -> None:
    """A verify step (4, 4 and 2 new tokens over 2,000, 37 and 3,000 cached) at
    the backend's split count, bf16: the fold against qk_norm_rotary's store,
    then attention over the pages; outputs within bf16, pages as stored."""
    from ftserve_kernels.attention_decode_triton import DecodeQK
    from ftserve_kernels.rope_triton import qk_norm_rotary_triton

    new, prefix, page = [4, 4, 2], [2000, 37, 3000], 16
    pool, fb, q, k, v = _verify_case(new, prefix, hq, hkv, d, page, torch.bfloat16, seed=5)
    meta = fb.attn
    ref_pool = KVPool(1, pool.num_pages, page, hkv, d, torch.bfloat16, "cuda")
    ref_pool.k.copy_(pool.k)
    ref_pool.v.copy_(pool.v)
    g = torch.Generator().manual_seed(2)
    q_w = (1 + 0.2 * torch.randn(d, generator=g)).to(torch.bfloat16).cuda() if norm else None
    k_w = (1 + 0.2 * torch.randn(d, generator=g)).to(torch.bfloat16).cuda() if norm else None
    cos_sin = _rope_table(4096, d).cuda()
    splits = at.TritonAttentionBackend().num_splits(q.shape[0], hkv, q.device)
    if norm:
        qo, _ = qk_norm_rotary_triton(q, k, q_w, k_w, 1e-6, fb.positions, cos_sin,
                                      (ref_pool.k[0], ref_pool.v[0], v, meta.out_cache_loc))
    else:
        from ftserve_kernels.norm_rope import qk_norm_rotary_ref

        qo, _ = qk_norm_rotary_ref(q, k, None, None, 1e-6, fb.positions, cos_sin,
                                   (ref_pool.k[0], ref_pool.v[0], v, meta.out_cache_loc))
    ref = at.decode_attention_triton(qo, ref_pool.k[0], ref_pool.v[0], meta.query_page_table,
                                     meta.query_seq_lens, page, d**-0.5, splits)
    out = torch.full_like(q, float("nan"))
    at.decode_attention_triton(q, pool.k[0], pool.v[0], meta.query_page_table, meta.query_seq_lens, page,
                               d**-0.5, splits, out=out,
                               qk=DecodeQK(k, v, q_w, k_w, 1e-6, fb.positions, cos_sin, meta.out_cache_loc,
                                           meta.query_first_rows, meta.query_rows_bound))
    torch.cuda.synchronize()
    t = sum(new)
    torch.testing.assert_close(pool.k[:, page:], ref_pool.k[:, page:], rtol=2e-2, atol=2e-2)
    assert torch.equal(pool.v[:, page:], ref_pool.v[:, page:])
    assert torch.isfinite(out).all() and rel_err(out[:t], ref[:t]) < 1e-2, rel_err(out[:t], ref[:t])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("hq,hkv,d", [(16, 2, 256), (32, 4, 128)])  # Qwen3-Next's, Qwen3-30B-A3B's
def test_gpu_extend_split_real_shape(hq: int, hkv: int, d: int) -> None:
    """16 and 200 new tokens over a 32k prefix (page 16): the split-K extend at
    the policy's split count equals the plain extend kernel, eagerly and in a
    CUDA graph captured as prefill graphs capture it (a 256-token bucket, the
    table's context as the static bound, an empty padding sequence), replayed
    with each chunk refilled in place; rows past the chunk stay untouched."""
    from ftserve.engine.cuda_graph import capture_graph

    prefix, budget, ps = 32_768, 256, 16
    dev = torch.device("cuda")
    pool, tables, q, k, v = make_case([budget], [prefix], hq, hkv, d, ps, torch.bfloat16, "cuda")
    kc, vc = pool.k[0], pool.v[0]
    cfg = at.AttnKernelConfig.for_device(dev, d)
    scale = d**-0.5
    full = build_forward_batch([[1] * budget], [prefix], tables, pool, TorchAttentionBackend()).attn
    at.store_kv_triton(kc, vc, k, v, full.out_cache_loc)

    def plain(n: int) -> torch.Tensor:
        meta = build_forward_batch([[1] * n], [prefix], tables, pool, TorchAttentionBackend()).attn
        return ate.extend_attention_triton(q[:n], kc, vc, meta.page_table, meta.qo_indptr, meta.prefix_lens,
                                          n, ps, scale, cfg)

    for n in (16, 200):  # eager: the step's own host values
        meta = build_forward_batch([[1] * n], [prefix], tables, pool, TorchAttentionBackend()).attn
        s = at.TritonAttentionBackend().extend_splits(hq, meta, cfg, dev)
        assert s > 1, (n, s)
        split = ate.extend_split_attention_triton(q[:n], kc, vc, meta.page_table, meta.qo_indptr,
                                                 meta.prefix_lens, n, ps, scale, s, cfg)
        grouped = ate.extend_split_attention_triton(q[:n], kc, vc, meta.page_table, meta.qo_indptr,
                                                   meta.prefix_lens, n, ps, scale, s, cfg, group_heads=True)
        want = plain(n)
        torch.cuda.synchronize()
        assert torch.isfinite(split).all() and torch.isfinite(grouped).all()
        assert rel_err(split, want) < 1e-2, (n, s)
        assert rel_err(grouped, want) < 1e-2, (n, s)

    table = torch.cat([full.page_table, torch.zeros_like(full.page_table)])  # + an empty sequence
    indptr = torch.zeros(3, dtype=torch.int32, device="cuda")
    prefix_t = torch.tensor([prefix, 0], dtype=torch.int32, device="cuda")
    gmeta = dataclasses.replace(full, max_seq_len=table.shape[1] * ps, max_extend_len=budget)
    s = at.TritonAttentionBackend(extend_token_bound=budget).extend_splits(hq, gmeta, cfg, dev)
    assert s > 1
    out = torch.empty_like(q)

    def run() -> None:
        ate.extend_split_attention_triton(q, kc, vc, table, indptr, prefix_t, budget, ps, scale, s, cfg, out=out)

    indptr.copy_(torch.tensor([0, budget, budget]))
    graph, _ = capture_graph(run, None)  # compiled outside the capture
    for n in (16, 200):
        indptr.copy_(torch.tensor([0, n, n]))
        out.fill_(float("nan"))
        graph.replay()
        want = plain(n)
        torch.cuda.synchronize()
        assert torch.isfinite(out[:n]).all() and out[n:].isnan().all()
        assert rel_err(out[:n], want) < 1e-2, (n, s)
