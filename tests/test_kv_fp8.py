"""fp8 e4m3 KV pages (issue 7 item 1): codes + per-(token, KV head) scales.

Triton kernels (store, split-K decode, extend) against the torch twins, which
quantize and dequantize the same way; page moves carry the scales; the pool's
memory plan counts them; and the real engine (tiny-moe, dummy weights made
context-sensitive with engine_util.make_context_sensitive, so that wrong KV
moves the tokens) with an fp8 KV cache stays close to an fp32 one: logits
within a stated bound, most greedy tokens identical (the fraction is printed
and floored).
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
                  "ftserve_kernels.attention_extend_triton", "ftserve_kernels.attention_triton"):
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


def test_store_rounds_ties_to_even_like_torch() -> None:
    """Rows whose amax is 448 (scale exactly 1) holding every e4m3 value and every
    midpoint between neighbours: the kernel's own rounding equals torch's cast."""
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique()  # [127] ascending
    mids = (grid[1:] + grid[:-1]) / 2
    vals = torch.cat([grid, mids, -grid, -mids])
    d = 32
    n = -(-vals.numel() // (d - 1))
    rows = torch.zeros(n * (d - 1))
    rows[: vals.numel()] = vals
    x = torch.cat([torch.full((n, 1), 448.0), rows.view(n, d - 1)], dim=1)  # [n, D]
    x = x.view(n, 1, d).to(DEVICE)
    pool = KVPool(1, 2 + n // 4, 4, 1, d, FP8, DEVICE)
    loc = torch.arange(4, 4 + n, device=DEVICE)
    at.store_kv_triton(pool.k[0], pool.v[0], x, x, loc, *pool.scales(0))
    assert pool.k_scale is not None and bool((pool.k_scale[0, loc] == 1.0).all())
    want = x.to(FP8)
    assert same_bits(pool.k[0, loc], want) and same_bits(pool.v[0, loc], want)


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


@pytest.mark.parametrize("splits", [2, 5])
def test_extend_split_fp8_matches_reference(splits: int) -> None:
    """The split-K extend (TritonAttentionBackend with forced splits) on fp8
    pages: the same codes, scales and dequantization as the plain kernel."""
    out, ref, exact = run_both([5, 1, 9], [40, 0, 21], 4, 2, 32, 4, torch.float32, False,
                               at.TritonAttentionBackend(extend_splits=splits))
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 1e-4
    assert rel_err(ref, exact) < 0.05


def test_decode_fp8_matches_reference() -> None:
    cfg = at.AttnKernelConfig.for_device(torch.device(DEVICE), 32)
    out, ref, exact = run_both([1, 1, 1], [0, 37, 12], 8, 2, 32, 8, torch.float32, True,
                               at.TritonAttentionBackend(cfg=cfg))
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 1e-4
    assert rel_err(ref, exact) < 0.05


# ----------------------------------------------------------- pool, config, page moves


def test_pool_counts_codes_and_scales() -> None:
    """bytes_per_token (the memory plan) and bytes_per_page count the fp32 scales:
    fp8 at D=128 costs (128 + 4) / 256 of bf16."""
    bf16 = KVPool.bytes_per_token(4, 8, 128, torch.bfloat16)
    fp8 = KVPool.bytes_per_token(4, 8, 128, FP8)
    assert bf16 == 2 * 4 * 8 * 128 * 2 and fp8 == 2 * 4 * 8 * (128 + 4)
    pool = KVPool(2, 3, 4, 2, 8, FP8, "cpu")
    assert pool.k_scale is not None and pool.v_scale is not None
    assert pool.k_scale.shape == (2, 12, 2) and pool.k.dtype == FP8
    real = sum(t.numel() * t.element_size() for t in (pool.k, pool.v, pool.k_scale, pool.v_scale))
    assert pool.bytes_per_page() * pool.num_pages == real
    assert KVPool(2, 3, 4, 2, 8, torch.float32, "cpu").scales(0) == (None, None)


def test_config_validates_kv_cache_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    from ftserve.cli import build_parser, configs_from_args
    from ftserve.config import ConfigError, EngineConfig
    from ftserve.kvcache.pool import kv_cache_torch_dtype

    EngineConfig(kv_cache_dtype="fp8_e4m3").validate()
    with pytest.raises(ConfigError, match="--kv-cache-dtype"):
        EngineConfig(kv_cache_dtype="int8").validate()
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_torch_dtype("fp8", torch.bfloat16) == FP8
    assert kv_cache_torch_dtype("float16", torch.bfloat16) == torch.float16
    ecfg, _ = configs_from_args(build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8"]))
    assert ecfg.kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    assert "--kv-cache-dtype" in capsys.readouterr().out


def test_host_tier_moves_scales_with_pages() -> None:
    """Offload to the host tier and load back to other device pages (CPU path):
    codes and scales come back bit for bit; the host tier counts scale bytes."""
    from ftserve.kvcache.host_tier import HostKVTier

    g = torch.Generator().manual_seed(3)
    pool = KVPool(2, 6, 4, 2, 8, FP8, "cpu")
    assert pool.k_scale is not None and pool.v_scale is not None
    for layer in range(2):
        x = torch.randn(24, 2, 8, generator=g)
        at.store_kv_triton(pool.k[layer], pool.v[layer], x, -x, torch.arange(24), *pool.scales(layer))
    want = [t.clone() for t in (pool.k, pool.v, pool.k_scale, pool.v_scale)]
    host = HostKVTier(pool, 3)
    assert host.k_scale is not None and host.k_scale.shape == (2, 16, 2)
    assert host.bytes_total() == 3 * pool.bytes_per_page()
    host.queue_offload([2, 4], [1, 3])
    host.flush()
    for t in (pool.k, pool.v, pool.k_scale, pool.v_scale):
        t.view(torch.uint8).zero_()
    host.queue_load([1, 3], [5, 1])
    host.flush()
    for got, ref in zip((pool.k, pool.v, pool.k_scale, pool.v_scale), want):
        assert same_bits(got[:, 20:24], ref[:, 8:12])  # device page 2 -> host 1 -> device 5
        assert same_bits(got[:, 4:8], ref[:, 16:20])  # device page 4 -> host 3 -> device 1
    assert float(pool.k_scale[:, 20:24].abs().min()) > 0


def test_copy_kv_pages_moves_scales() -> None:
    """copy_kv_pages (the host tier's CUDA path) takes the [L, slots, Hkv] scale
    tensors as well as the codes; checked against its reference."""
    from ftserve_kernels import bookkeeping as bk

    g = torch.Generator().manual_seed(4)
    src = [torch.randn(2, 16, 3, generator=g) for _ in range(2)]  # scales: [L, slots, Hkv]
    dst = [torch.zeros(2, 16, 3) for _ in range(4)]
    sp = torch.tensor([3, -1, 1], dtype=torch.int32)
    dp = torch.tensor([0, 2, 2], dtype=torch.int32)
    bk.copy_kv_pages(src[0], src[1], dst[0], dst[1], sp, dp, 4)
    bk.copy_kv_pages_ref(src[0], src[1], dst[2], dst[3], sp, dp, 4)
    assert torch.equal(dst[0], dst[2]) and torch.equal(dst[1], dst[3])
    assert torch.equal(dst[0][:, 0:4], src[0][:, 12:16]) and torch.equal(dst[1][:, 8:12], src[1][:, 4:8])
    codes = torch.randn(2, 16, 3, 8, generator=g).to(FP8)
    out = torch.zeros_like(codes)
    bk.copy_kv_pages(codes, codes, out, out, sp, dp, 4)
    assert same_bits(out[:, 8:12], codes[:, 4:8])


# ----------------------------------------------------------- through the engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from ftserve.models.checkpoint import write_checkpoint

    out = tmp_path_factory.mktemp("tiny-moe-fp8")
    write_checkpoint("tiny-moe", out, config_only=True)
    return str(out)


def make_engine(model_dir: str, **kw: object):  # type: ignore[no-untyped-def]
    from ftserve.config import EngineConfig
    from ftserve.engine.setup import build_engine
    from tests.engine_util import make_context_sensitive

    base = dict(model=model_dir, load_format="dummy", device="cpu", dtype="float32",
                page_size=4, num_pages=512, max_prefill_length=32, max_running_requests=16,
                status_log_interval=0.0)
    base.update(kw)
    eng = build_engine(EngineConfig(**base))  # type: ignore[arg-type]
    eng.check_integrity = True
    make_context_sensitive(eng.runner.model)  # else greedy tokens cannot see wrong KV
    return eng


@torch.inference_mode()
def chunked_logits(model: torch.nn.Module, mcfg: object, tokens: list[int], split: int,
                   kv_dtype: torch.dtype) -> torch.Tensor:
    """Logits of tokens[split:] after tokens[:split] went through the cache as an
    earlier chunk: the second chunk reads the first one's stored (quantized) KV."""
    ps = 4
    pool = KVPool(mcfg.num_layers, 2 + len(tokens) // ps, ps, mcfg.num_kv_heads,  # type: ignore[attr-defined]
                  mcfg.head_dim, kv_dtype, "cpu")  # type: ignore[attr-defined]
    pages = list(range(1, 1 + -(-len(tokens) // ps)))
    be = TorchAttentionBackend()
    model(build_forward_batch([tokens[:split]], [0], [pages], pool, be))
    return model(build_forward_batch([tokens[split:]], [split], [pages], pool, be, all_logits=True))


def test_engine_fp8_kv_accuracy(model_dir: str) -> None:
    """Same weights, KV in fp32 vs fp8 e4m3: logits of the same prompts within
    3% (relative L2) and not identical (the fp8 path really ran); greedy
    continuations of 16 prompts x 8 tokens agree on at least 75% of the tokens
    (counted up to each prompt's first divergence).

    The bounds are for the context-sensitive model (make_engine): there the
    attention output, and so the fp8 rounding of K and V, really moves the
    logits. Measured: 1.1e-2 and 85% (109/128). On plain dummy weights it was
    4e-4 and 100%, but there KV read with another layer's scales (a real bug,
    TorchAttentionBackend taking pool.scales(0) for every layer) still gave
    4e-3 and 100% and passed the old 1%/90% bounds; on this model it gives
    8.1e-2 and 59% and fails both."""
    import random

    from tests.engine_util import collect, greedy, tokens_of

    e32, e8 = make_engine(model_dir), make_engine(model_dir, kv_cache_dtype="fp8_e4m3")
    try:
        assert e8.runner.kv_pool.dtype == FP8 and e8.summary["kv_cache_dtype"] == "float8_e4m3fn"
        assert e32.runner.kv_pool.dtype == torch.float32
        for a, b in zip(e32.runner.model.parameters(), e8.runner.model.parameters()):
            assert torch.equal(a, b)
        rng = random.Random(0)
        prompts = [[rng.randrange(10, 32000) for _ in range(rng.randint(8, 40))] for _ in range(16)]
        model, mcfg = e32.runner.model, e32.model_config
        errs = []
        for p in prompts[:4]:
            seq = p + prompts[-1]
            ref = chunked_logits(model, mcfg, seq, len(p), torch.float32)
            got = chunked_logits(model, mcfg, seq, len(p), FP8)
            errs.append(rel_err(got, ref))
        print(f"fp8 vs fp32 KV logits: relative L2 error max {max(errs):.2e}")
        assert 0.0 < max(errs) < 3e-2
        reqs = [(f"r{i}", p, greedy(8)) for i, p in enumerate(prompts)]
        o32, o8 = collect(e32, reqs), collect(e8, reqs)
        same = total = 0
        for rid, _, _ in reqs:
            a, b = tokens_of(o32[rid]), tokens_of(o8[rid])
            same += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
            total += len(a)
        print(f"fp8 vs fp32 KV greedy tokens identical: {same}/{total} = {same / total:.3f}")
        assert same / total >= 0.75
        e8.scheduler.check_integrity()
    finally:
        e32.shutdown()
        e8.shutdown()


def test_engine_fp8_conversation_resumes_from_host_tier(model_dir: str) -> None:
    """fp8 pages pushed to the host tier come back with their scales: turn 2
    served from host pages gives the tokens of an fp8 engine that never evicted."""
    import random

    from tests.engine_util import collect, greedy, tokens_of

    rng = random.Random(7)
    turn1 = [rng.randrange(10, 32000) for _ in range(45)]
    fillers = [[rng.randrange(10, 32000) for _ in range(60)] for _ in range(3)]
    tail = [rng.randrange(10, 32000) for _ in range(9)]
    small = make_engine(model_dir, kv_cache_dtype="fp8", num_pages=41, max_running_requests=4,
                        kv_host_pages=64)
    try:
        assert small.runner.kv_host.k_scale is not None
        out1 = tokens_of(collect(small, [("t1", turn1, greedy(6))])["t1"])
        for k, f in enumerate(fillers):
            collect(small, [(f"f{k}", f, greedy(2))])
        turn2 = turn1 + out1 + tail
        r = small.scheduler.radix
        m = r.match_prefix(turn2, count_stats=False)
        assert m.host_tokens >= 40, "turn 1's prefix should sit in the host tier now"
        outs = collect(small, [("t2", turn2, greedy(8))])["t2"]
        assert outs[-1].cached_tokens >= 48
        small.scheduler.check_integrity()
    finally:
        small.shutdown()
    big = make_engine(model_dir, kv_cache_dtype="fp8", kv_host_pages=None)
    try:
        assert tokens_of(collect(big, [("t1", turn1, greedy(6))])["t1"]) == out1
        assert tokens_of(collect(big, [("t2", turn2, greedy(8))])["t2"]) == tokens_of(outs)
    finally:
        big.shutdown()
