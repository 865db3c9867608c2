"""L2 prefetch hints (ftserve_kernels/l2_prefetch.py): which bytes each
program's threads name (under the interpreter), the FTSERVE_L2_PREFETCH
switch, and on the GPU that launches with the hint compute exactly what they
compute without it. tests/test_kernels_sm90_compile.py checks that the
instruction is compiled in where PF is on, and only there."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from ftserve import envs
from ftserve_kernels import l2_prefetch

interpreter_only = pytest.mark.skipif(torch.cuda.is_available(), reason="an interpreter test: CPU tensors")


@triton.jit
def _ranges_kernel(lo_ptr, size_ptr, nbytes, NT: tl.constexpr):
    p = tl.program_id(0)
    lo, size = l2_prefetch._thread_range(p, tl.num_programs(0), nbytes, NT)
    t = tl.arange(0, NT)
    tl.store(lo_ptr + p * NT + t, lo)
    tl.store(size_ptr + p * NT + t, size)


@pytest.mark.parametrize("nbytes,parts,nt", [
    (16 * 1000, 7, 32),
    (18_350_080, 512, 128),  # o_proj + the folded router at qwen3-30b-a3b, over 512 split programs
    (16, 3, 32),  # fewer bytes than programs: most name nothing
    (48 << 20, 2, 32),  # more than NT x MIN_CHUNK a program: the chunks grow
    (21 * 4096 * 16, 128, 128),
])
@interpreter_only
def test_thread_ranges_tile_the_bytes(nbytes: int, parts: int, nt: int) -> None:
    lo = torch.full((parts, nt), -1, dtype=torch.int64)
    size = torch.full((parts, nt), -1, dtype=torch.int32)
    _ranges_kernel[(parts,)](lo, size, nbytes, NT=nt)
    spans = sorted((int(a), int(a) + int(n)) for a, n in zip(lo.flatten(), size.flatten()) if n > 0)
    assert (size >= 0).all()
    # Disjoint, in order, covering [0, nbytes) exactly; every start and size 16-byte granular.
    pos = 0
    for a, b in spans:
        assert a == pos and a % l2_prefetch.ALIGN == 0 and (b - a) % l2_prefetch.ALIGN == 0
        pos = b
    assert pos == nbytes
    # A program's ranges lie inside its own share, in thread order.
    per = triton.cdiv(triton.cdiv(nbytes, parts), 16) * 16
    for p in range(parts):
        live = [(int(a), int(n)) for a, n in zip(lo[p], size[p]) if n > 0]
        assert all(p * per <= a and a + n <= (p + 1) * per for a, n in live)
        assert [a for a, _ in live] == sorted(a for a, _ in live)


def test_sites_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTSERVE_L2_PREFETCH", "oproj, qkv")
    assert envs.l2_prefetch() == {"oproj", "qkv"}
    monkeypatch.setenv("FTSERVE_L2_PREFETCH", "qkv+oproj")  # a name bench_decode_variants --only can hold
    assert envs.l2_prefetch() == {"oproj", "qkv"}
    monkeypatch.setenv("FTSERVE_L2_PREFETCH", "0")
    assert envs.l2_prefetch() == frozenset()
    monkeypatch.setenv("FTSERVE_L2_PREFETCH", "oproj,lm_head")
    with pytest.raises(ValueError, match="lm_head.*oproj, qkv"):
        envs.l2_prefetch()


def test_regions_arguments() -> None:
    w = torch.zeros(10, 7, dtype=torch.bfloat16)
    assert l2_prefetch.regions((w,), w.device) is None  # no sm_90 here: off
    assert l2_prefetch.regions((), torch.device("cuda")) is None  # nothing to prefetch
    off = l2_prefetch.kernel_args(None, w)
    assert off["PF"] is False and off["pf_a_n"] == off["pf_b_n"] == 0
    on = l2_prefetch.kernel_args((l2_prefetch.Region(w, 128), l2_prefetch.Region(w, 0)), w)
    assert on["PF"] is True and on["pf_a_n"] == 128 and on["pf_b_n"] == 0


@pytest.mark.gpu
def test_gpu_prefetching_launches_compute_the_same() -> None:
    """The split-K decode attention (raw q/k folded in) and the MoE down kernel
    leaving the next norm pending, with and without their prefetch of a 20 MB
    weight: bit-identical outputs, the K/V stores included."""
    from ftserve.models.forward_batch import build_forward_batch
    from ftserve_kernels import attention_triton as at
    from ftserve_kernels import moe_down_gemv_triton as md
    from ftserve_kernels import moe_gemv_triton as mg
    from ftserve_kernels.attention_decode_triton import DecodeQK
    from ftserve_kernels.moe import route_topk_ref
    from tests.test_kernels_attention import _rope_table, make_case

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the bulk L2 prefetch needs sm_90")
    weight = torch.randn(2048 * 5, 1024, device="cuda", dtype=torch.bfloat16)  # 20 MB
    router = torch.randn(128, 4096, device="cuda", dtype=torch.bfloat16)
    d, page = 128, 16
    prefix = [2048, 17]
    outs = []
    for pf in ((), (weight, router)):
        pool, tables, q, k, v = make_case([1] * 2, prefix, 32, 4, d, page, torch.bfloat16, "cuda", seed=3)
        g = torch.Generator().manual_seed(1)
        q_w = (1 + 0.2 * torch.randn(d, generator=g)).to(torch.bfloat16).cuda()
        k_w = (1 + 0.2 * torch.randn(d, generator=g)).to(torch.bfloat16).cuda()
        backend = at.TritonAttentionBackend()
        fb = build_forward_batch([[1]] * 2, prefix, tables, pool, backend, is_decode=True)
        out = torch.full_like(q, float("nan"))
        at.decode_attention_triton(q, pool.k[0], pool.v[0], fb.attn.page_table, fb.attn.seq_lens, page,
                                   d**-0.5, backend.num_splits(2, 4, q.device), out=out,
                                   qk=DecodeQK(k, v, q_w, k_w, 1e-6, fb.positions, _rope_table(4096, d).cuda(),
                                               fb.attn.out_cache_loc), prefetch=pf)
        outs.append((out, pool.k.clone(), pool.v.clone()))
    for a, b in zip(*outs):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    assert torch.isfinite(outs[0][0]).all()

    gen = torch.Generator(device="cuda").manual_seed(5)
    e, top_k, h, inter = 128, 8, 2048, 768
    x = torch.randn(1, h, device="cuda", generator=gen).to(torch.bfloat16)
    r = torch.randn(1, h, device="cuda", generator=gen).to(torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(h, device="cuda", generator=gen)).to(torch.bfloat16)
    w13 = (torch.randn(e, 2 * inter, h, device="cuda", generator=gen) / h**0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, inter, device="cuda", generator=gen) / inter**0.5).to(torch.bfloat16)
    weights, ids = route_topk_ref(torch.randn(1, e, device="cuda", generator=gen), top_k, True)
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    res = [mg.fused_moe_add_norm_gemv_triton(x, w13, w2, weights, ids,
                                             md.NormNext(r, nw, 1e-6, counter, deferred=True, prefetch=pf))
           for pf in ((), (weight,))]
    for a, b in zip(*res):
        assert torch.equal(a, b)
