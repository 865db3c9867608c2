"""fp8 e4m3 KV on the GPU (issue 7 item 1) at real shapes: the Triton store is
bit-exact with the torch twin, decode (split-K) and
extend match the twin on fp8 pages, a captured decode
graph replays like eager, and the engine (scaled tiny-moe, Triton, CUDA graphs)
runs with an fp8 pool without hidden syncs and close to bf16 KV.

CPU twins of these tests: tests/test_kv_fp8.py.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from ftserve.config import EngineConfig
from ftserve.engine.engine import Engine
from ftserve.kvcache.pool import KVPool
from ftserve.models.checkpoint import write_config
from ftserve.models.forward_batch import build_forward_batch
from ftserve_kernels import attention_triton as at
from ftserve_kernels.paged_attention import (
    FP8_DTYPE,
    dequantize_fp8_ref,
    paged_attention_ref,
    quantize_fp8_ref,
    store_kv_ref,
)
from tests.engine_util import make_context_sensitive
from tests.test_gpu_engine import CHUNK, SCALE, run_greedy, scenario

pytestmark = pytest.mark.gpu
DEV = "cuda"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))


def fp8_pool(num_pages: int, page_size: int, hkv: int, d: int, seed: int = 0) -> KVPool:
    g = torch.Generator(device=DEV).manual_seed(seed)
    pool = KVPool(1, num_pages, page_size, hkv, d, FP8_DTYPE, DEV)
    assert pool.k_scale is not None and pool.v_scale is not None
    for codes, scales in ((pool.k, pool.k_scale), (pool.v, pool.v_scale)):
        x = torch.randn(codes.shape, generator=g, device=DEV)
        x *= torch.rand(codes.shape[:3] + (1,), generator=g, device=DEV) * 8
        c, s = quantize_fp8_ref(x)
        codes.copy_(c)
        scales.copy_(s)
    return pool


def tables_for(lens: list[int], page_size: int, seed: int = 0) -> tuple[list[list[int]], int]:
    need = [-(-n // page_size) for n in lens]
    g = torch.Generator().manual_seed(seed)
    perm = (torch.randperm(sum(need), generator=g) + 1).tolist()
    out, at_ = [], 0
    for n in need:
        out.append(perm[at_: at_ + n])
        at_ += n
    return out, sum(need) + 1


def test_store_bit_exact_real_shape() -> None:
    """4096 tokens x 4 KV heads x 128, bf16 input: scales equal the twin's, codes
    too except at float-rounding ties."""
    g = torch.Generator(device=DEV).manual_seed(1)
    t, hkv, d = 4096, 4, 128
    k = (torch.randn(t, hkv, d, generator=g, device=DEV)
         * torch.logspace(-3, 2, t, device=DEV)[:, None, None]).bfloat16()
    v = torch.randn(t, hkv, d, generator=g, device=DEV).bfloat16()
    a = KVPool(1, 300, 16, hkv, d, FP8_DTYPE, DEV)
    b = KVPool(1, 300, 16, hkv, d, FP8_DTYPE, DEV)
    loc = torch.randperm(299 * 16, generator=g, device=DEV)[:t] + 16
    at.store_kv_triton(a.k[0], a.v[0], k, v, loc, *a.scales(0))
    store_kv_ref(b.k[0], b.v[0], k, v, loc, *b.scales(0))
    # Measured on the H200 (2026-11-30): 8 of 2,457,600 codes came out one e4m3
    # step from the twin's (values within float rounding of a tie: the GPU fuses
    # the scale multiply). Allow that, and nothing larger.
    for x, y in ((a.k, b.k), (a.v, b.v)):
        diff = int((x.view(torch.uint8) != y.view(torch.uint8)).sum())
        assert diff <= x.numel() // 100_000, f"{diff} of {x.numel()} codes differ"
        step = (x.float() - y.float()).abs()
        ulp = torch.maximum(x.float().abs(), y.float().abs()) * 2.0**-3 + 2.0**-9
        assert bool((step <= ulp).all()), "a code differs by more than one e4m3 step"
    assert torch.equal(a.k_scale, b.k_scale) and torch.equal(a.v_scale, b.v_scale)


def test_decode_fp8_real_shapes() -> None:
    """B=4, 32/4 heads, d 128, pages of 16, contexts up to 32k; bf16 queries."""
    lens = [4096, 17, 32768, 1000]
    tables, pages = tables_for(lens, 16)
    pool = fp8_pool(pages + 1, 16, 4, 128)
    g = torch.Generator(device=DEV).manual_seed(2)
    q = (3 * torch.randn(4, 32, 128, generator=g, device=DEV)).bfloat16()
    fb = build_forward_batch([[1]] * 4, [n - 1 for n in lens], tables, pool,
                             at.TritonAttentionBackend(), is_decode=True)
    cfg = at.AttnKernelConfig()
    be = at.TritonAttentionBackend(cfg=cfg)
    splits = be.num_splits(4, 4, q.device)
    out = at.decode_attention_triton(q, pool.k[0], pool.v[0], fb.attn.page_table, fb.attn.seq_lens,
                                     16, 128**-0.5, splits, cfg, k_scale=pool.k_scale[0],
                                     v_scale=pool.v_scale[0])
    ref = paged_attention_ref(q, pool.k[0], pool.v[0], fb.attn.page_table, [0, 1, 2, 3, 4], lens,
                              16, 128**-0.5, pool.k_scale[0], pool.v_scale[0])
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 2e-2


def test_extend_fp8_real_shapes() -> None:
    """512 new tokens over a 3000-token prefix plus a cold 100-token prompt."""
    new, pre = [512, 100], [3000, 0]
    tables, pages = tables_for([n + p for n, p in zip(new, pre)], 16)
    pool = fp8_pool(pages + 1, 16, 4, 128)
    g = torch.Generator(device=DEV).manual_seed(3)
    t = sum(new)
    q = (3 * torch.randn(t, 32, 128, generator=g, device=DEV)).bfloat16()
    k = torch.randn(t, 4, 128, generator=g, device=DEV).bfloat16()
    v = torch.randn(t, 4, 128, generator=g, device=DEV).bfloat16()
    be = at.TritonAttentionBackend(cfg=at.AttnKernelConfig())
    fb = build_forward_batch([[1] * n for n in new], pre, tables, pool, be)
    out = be.forward(q, k, v, 0, fb)  # stores (quantizes) the new tokens, then attends
    seq = [n + p for n, p in zip(new, pre)]
    ref = paged_attention_ref(q, pool.k[0], pool.v[0], fb.attn.page_table, [0, new[0], t], seq,
                              16, 128**-0.5, pool.k_scale[0], pool.v_scale[0])
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 2e-2
    # What fp8 costs against exact new-token KV (prefix stays as stored).
    full = KVPool(1, pool.num_pages, 16, 4, 128, torch.float32, DEV)
    full.k.copy_(dequantize_fp8_ref(pool.k, pool.k_scale))
    full.v.copy_(dequantize_fp8_ref(pool.v, pool.v_scale))
    full.k[0, fb.attn.out_cache_loc] = k.float()
    full.v[0, fb.attn.out_cache_loc] = v.float()
    exact = paged_attention_ref(q, full.k[0], full.v[0], fb.attn.page_table, [0, new[0], t], seq,
                                16, 128**-0.5)
    print(f"fp8 new-token KV vs exact: rel err {rel_err(ref, exact):.2e}")
    assert rel_err(ref, exact) < 5e-2


def test_decode_fp8_graph_replay_equals_eager() -> None:
    lens = [300, 2000, 45]
    tables, pages = tables_for([4096] * 3, 16)
    pool = fp8_pool(pages + 1, 16, 4, 128)
    be = at.TritonAttentionBackend()
    fb = build_forward_batch([[1]] * 3, [n - 1 for n in lens], tables, pool, be, is_decode=True)
    g = torch.Generator(device=DEV).manual_seed(4)
    q = torch.randn(3, 32, 128, generator=g, device=DEV).bfloat16()
    k = torch.randn(3, 4, 128, generator=g, device=DEV).bfloat16()
    v = torch.randn(3, 4, 128, generator=g, device=DEV).bfloat16()
    out = be.forward(q, k, v, 0, fb)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = be.forward(q, k, v, 0, fb)
    for new_lens in ([301, 2001, 46], [4000, 17, 1]):
        fb2 = build_forward_batch([[1]] * 3, [n - 1 for n in new_lens], tables, pool, be,
                                  is_decode=True)
        fb.attn.seq_lens.copy_(fb2.attn.seq_lens)
        fb.attn.out_cache_loc.copy_(fb2.attn.out_cache_loc)
        q.normal_()
        graph.replay()
        eager = be.forward(q, k, v, 0, fb2)
        assert torch.equal(out, eager)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_config("tiny-moe", Path(tmp_path_factory.mktemp("gpu-fp8")), layers=2,
                              **SCALE)


def make_engine(model_dir: str, kv: str) -> Engine:
    from ftserve.engine.setup import build_engine

    eng = build_engine(EngineConfig(
        model=model_dir, load_format="dummy", device=DEV, dtype="bfloat16", kv_cache_dtype=kv,
        attention_backend="triton", page_size=16, num_pages=1024, max_prefill_length=CHUNK,
        max_running_requests=8, cuda_graph_max_bs=8, status_log_interval=0.0))
    make_context_sensitive(eng.runner.model)  # else greedy tokens cannot see wrong KV
    return eng


def test_engine_fp8_no_hidden_syncs_and_close_to_bf16(model_dir: str) -> None:
    """The fp8 engine passes the no-hidden-sync scenario (prefill chunks, prefix
    hits, graph decode at 1/3/8), and its greedy tokens match the bf16-KV engine
    on 8 prompts x 16 tokens up to the first divergence (fraction printed; floor
    0.45). With the attention gain (make_context_sensitive) one changed token
    changes the rest, so the count is a strict one: 69/128 on the H200
    (2026-12-01; 109/128 in fp32 on the CPU, tests/test_kv_fp8.py)."""
    e8 = make_engine(model_dir, "fp8_e4m3")
    try:
        assert e8.runner.kv_pool.dtype == FP8_DTYPE and e8.runner.graphs is not None
        scenario(e8, seed=0, check=False)
        drv = scenario(e8, seed=1, check=True)
        for kind, bs, n in drv.log:
            assert n == (0 if kind == "prefill_chunk" else 1), (kind, bs, n)
        rng = random.Random(11)
        prompts = [[rng.randrange(100, 32000) for _ in range(rng.randint(20, 300))] for _ in range(8)]
        got = run_greedy(e8, prompts, 16)
    finally:
        e8.shutdown()
    torch.cuda.empty_cache()
    e16 = make_engine(model_dir, "auto")
    try:
        want = run_greedy(e16, prompts, 16)
    finally:
        e16.shutdown()
    same = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
               for a, b in zip(want, got))
    total = sum(len(a) for a in want)
    print(f"fp8 vs bf16 KV greedy tokens identical (to first divergence): {same}/{total}")
    assert same / total >= 0.45
