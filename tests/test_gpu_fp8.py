"""fp8 checkpoints on the GPU (issue 32), bf16 activations, CUDA graphs on:

- the no-hidden-sync scenario of test_gpu_engine on an fp8 model: prefill
  chunks (activation quantization + w8a8 GEMMs, grouped fp8 experts) read
  nothing back, decode (fp8 GEMVs inside the graphs) exactly once;
- graph decode equals eager decode, token for token, over the same (eager) prefill;
  prefill graphs' logits, like the eager forward's, track the exact reference;
- logits against the exact fp32 reference on the CPU (the same fp8 weights,
  dequantized): within the bound of bf16 plus the prefill's activation rounding;
- against transformers on tiny fp8 presets (the checkpoint dequantized, fp32 CPU);
- offload with an fp8 bank equals resident fp8 exactly, at decode batch 1, 3 and
  8 (read-through GEMVs) and across streamed prefills;
- the read-through GEMVs reading a pinned fp8 bank over UVA equal fill + GEMV,
  also replayed in a graph;
- a one-row decode routed in the fp8 o_proj launch (oproj_route_triton) and the
  fp8 experts taking its route parts: at qwen3-30b-a3b's shape against the
  twins, the unfused pair and a graph replay; in the model against the
  unfused fp8 path.

Bounds: decode GEMVs multiply the dequantized weights by the bf16 rows in fp32
(w8a16), as the reference does; the prefill GEMMs round each activation to e4m3
per token and 128 columns (relative error <= 2^-4 per element), which moved
tiny models' logits by 1-3% relative under the interpreter
(test_kernels_fp8.test_fp8_model_on_triton_kernels); bf16 alone stays under 5%
(test_gpu_engine.test_cuda_bf16_logits_track_cpu_fp32). Hence: relative error
< 8%, every row's cosine > 0.99, top-1 agreement >= 85%.

Tokens are compared only where both sides run the same kernels. A prefill graph
replays the expert tiles picked for its bucket's padded pair count (256 tokens x 4
choices over 16 experts: 64 rows a tile, the fp8 wgmma); an eager chunk of a short
prompt takes the tiles of its real count (under 24 pairs an expert: 16 rows, which
Triton multiplies on mma.sync as f16, the codes converted exactly, with fp32 sums:
test_kernels_fp8_sm90_compile). Hopper's fp8 wgmma keeps about 14 bits of its running sum
(test_kernels_fp8.FP8_DOT_REL: within 2^-11 of sum |a||b| over a dot), so the two
tilings' expert outputs differ by up to that much, and the SiLU product's e4m3
requantization turns a few such differences into a whole code step. Greedy tokens
then part at near-ties: on the CPU, noise of 0.2% (0.4%) of each prefill expert
output alone parted 1 (2) of test_graph_decode_equals_eager_fp8's 12 rows. (bf16
experts accumulate in fp32 on either tiling: test_gpu_engine compares its graph
engine, prefill graphs on, with the eager one token for token.)
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ftserve.engine.engine import Engine
from ftserve.models.checkpoint import write_config
from tests.engine_util import make_context_sensitive
from tests.test_gpu_engine import CHUNK, SCALE, cpu_twin, run_greedy, scenario

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    # q 8 x 64 and k / v 2 x 64 rows: the fused projection's parts meet the 128-row grid.
    return write_config("tiny-moe-fp8", Path(tmp_path_factory.mktemp("gpu-fp8")), layers=2, **SCALE)


def make_engine(model_dir: str, graphs: bool = True, slots: int | None = None) -> Engine:
    from ftserve.config import EngineConfig
    from ftserve.engine.setup import build_engine

    cfg = EngineConfig(
        model=model_dir, load_format="dummy", device="cuda", dtype="bfloat16", attention_backend="triton",
        page_size=16, num_pages=1024, max_prefill_length=CHUNK, max_running_requests=8,
        cuda_graph_max_bs=8 if graphs else 0, status_log_interval=0.0, moe_cache_size=slots,
    )
    return build_engine(cfg)


@pytest.fixture(scope="module")
def engine(model_dir: str) -> Iterator[Engine]:
    eng = make_engine(model_dir)
    assert eng.runner.graphs is not None, "CUDA graphs must be on for this test"
    assert eng.runner.model.layers[0].mlp.is_fp8 and eng.runner.model.layers[0].self_attn.qkv_proj.weight_scale is not None
    make_context_sensitive(eng.runner.model)  # through o_proj's scales
    yield eng
    eng.shutdown()


def test_no_hidden_syncs_fp8(engine: Engine) -> None:
    scenario(engine, seed=0, check=False)  # compile every kernel shape once
    drv = scenario(engine, seed=1, check=True)
    for kind, bs, n in drv.log:
        if kind == "prefill_chunk":
            assert n == 0, f"a non-final prefill chunk read the device back {n} times"
        else:
            assert n == 1, f"a {kind} step of batch {bs} made {n} read-backs, expected exactly 1"
    assert {1, 3, 8} <= {bs for kind, bs, _ in drv.log if kind == "decode"}


def test_graph_decode_equals_eager_fp8(engine: Engine, model_dir: str) -> None:
    """Decode graphs against eager decode steps, token for token, both engines
    prefilling eagerly (the graph engine's prefill graphs off for the comparison:
    their expert tiles are not an eager short chunk's, module docstring). Decode
    runs the same kernels at each batch size in both (3 rows padded to the graph's
    4): the dense GEMVs up to 4 rows, the expert GEMV pair up to 2, grouped tiles
    from at most 32 pairs over 16 experts (16 rows either way), the fused norm and
    route up to 4 rows, attention's split count from the same bound."""
    eager = make_engine(model_dir, graphs=False)
    prefill_graphs = engine.runner.prefill_graphs
    assert prefill_graphs is not None
    try:
        eager.runner.model.load_state_dict(engine.runner.model.state_dict())
        engine.runner.prefill_graphs = None
        rng = random.Random(7)
        for bs in (1, 3, 8):
            prompts = [[rng.randrange(100, 32000) for _ in range(rng.randint(10, 60))] for _ in range(bs)]
            assert run_greedy(engine, prompts, 16) == run_greedy(eager, prompts, 16), bs
    finally:
        engine.runner.prefill_graphs = prefill_graphs
        eager.shutdown()


@torch.inference_mode()
def test_fp8_logits_track_the_exact_reference(engine: Engine) -> None:
    from ftserve.engine.request import Req
    from ftserve.engine.sampling_params import SamplingParams
    from ftserve.kvcache.pool import KVPool
    from ftserve.models.forward_batch import build_forward_batch
    from ftserve_kernels.attention_triton import TritonAttentionBackend
    from ftserve_kernels.paged_attention import TorchAttentionBackend

    cfg = engine.model_config
    cpu_model = cpu_twin(engine)  # fp8 codes copied as they are, fp32 elsewhere
    rng = random.Random(11)
    prompt = [rng.randrange(100, 32000) for _ in range(100)]
    pages = list(range(1, 8))

    def pool(dtype: torch.dtype, device: str) -> KVPool:
        return KVPool(cfg.num_layers, 8, 16, cfg.num_kv_heads, cfg.head_dim, dtype, device)

    ref = cpu_model(build_forward_batch([prompt], [0], [pages], pool(torch.float32, "cpu"),
                                        TorchAttentionBackend(), all_logits=True))
    gpool, backend = pool(torch.bfloat16, "cuda"), TritonAttentionBackend()
    a = engine.runner.model(build_forward_batch([prompt[:64]], [0], [pages], gpool, backend, all_logits=True))
    b = engine.runner.model(build_forward_batch([prompt[64:]], [64], [pages], gpool, backend, all_logits=True))
    dec = engine.runner.model(build_forward_batch([[prompt[-1]]], [100], [pages], gpool, backend,
                                                  is_decode=True))  # GEMV path over the cache
    got = torch.cat([a, b]).float().cpu()
    rel = float((got - ref).norm() / ref.norm())
    assert rel < 0.08, f"relative logit error {rel:.4f}"
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    assert cos.min() > 0.99, f"worst row cosine {cos.min():.4f}"
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.85
    ref_dec = cpu_model(build_forward_batch([prompt + [prompt[-1]]], [0], [pages], pool(torch.float32, "cpu"),
                                            TorchAttentionBackend()))
    assert float((dec.float().cpu() - ref_dec).norm() / ref_dec.norm()) < 0.08
    # A prefill graph's replay: 8 prompts in one chunk, each one's last-token logits.
    graphs, sched = engine.runner.prefill_graphs, engine.scheduler
    assert graphs is not None
    prompts = [[rng.randrange(100, 32000) for _ in range(rng.randint(5, 30))] for _ in range(8)]
    for i, p in enumerate(prompts):
        sched.add(Req(f"pg{i}", p, SamplingParams(max_tokens=1, temperature=0.0), 0.0))
    batch = sched.schedule()
    try:
        assert batch is not None and graphs.can_run(batch) and len(batch.reqs) == 8 and all(batch.samples)
        engine.runner.prepare_slots(batch.reqs)
        got = graphs.replay(batch)[:8].float().cpu()  # [8, V]: row i = prompts[i]'s last token
    finally:
        for r in list(sched.running) + list(sched.waiting):
            sched.finish(r, "abort")
        sched.finished_reqs.clear()
    ref_pages = [list(range(1 + 2 * i, 3 + 2 * i)) for i in range(8)]  # 2 x 16 slots >= 30 tokens
    cpu_pool = KVPool(cfg.num_layers, 17, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    ref = cpu_model(build_forward_batch(prompts, [0] * 8, ref_pages, cpu_pool, TorchAttentionBackend()))  # [8, V]
    rel = float((got - ref).norm() / ref.norm())
    assert rel < 0.08, f"prefill graph: relative logit error {rel:.4f}"
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    assert cos.min() > 0.99, f"prefill graph: worst row cosine {cos.min():.4f}"


@pytest.mark.parametrize("preset", ["tiny-qwen3-fp8", "tiny-moe-fp8"])
def test_fp8_presets_vs_transformers(preset: str, tmp_path: Path) -> None:
    """The GPU engine's bf16 logits on a tiny fp8 checkpoint against transformers'
    fp32 CPU forward of the same checkpoint, dequantized (bound: module docstring)."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    from ftserve.kvcache.pool import KVPool
    from ftserve.models.checkpoint import write_checkpoint
    from ftserve.models.forward_batch import build_forward_batch
    from ftserve.models.loader import load_model
    from ftserve_kernels.attention_triton import TritonAttentionBackend

    write_checkpoint(preset, tmp_path, seed=7)
    # With a GPU present transformers would keep the fp8 layers; the reference is the dequantized model.
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                              quantization_config=FineGrainedFP8Config(dequantize=True)).eval()
    model, cfg = load_model(tmp_path, dtype="bfloat16", device="cuda")
    prompts = [[random.Random(s).randrange(3, 32768) for _ in range(n)] for s, n in ((1, 13), (2, 64))]
    pool = KVPool(cfg.num_layers, 16, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cuda")
    with torch.inference_mode():
        got = model(build_forward_batch(prompts, [0, 0], [[1], [2, 3, 4, 5]], pool, TritonAttentionBackend(),
                                        all_logits=True)).float().cpu()
        ref = torch.cat([hf(torch.tensor([p])).logits[0].float() for p in prompts])
    rel = float((got - ref).norm() / ref.norm())
    assert rel < 0.08, rel
    assert torch.nn.functional.cosine_similarity(got, ref, dim=-1).min() > 0.99


def test_offload_fp8_bank_equals_resident(engine: Engine, model_dir: str) -> None:
    """Half the experts in slots (one layer's worth: what batch 8 x top-4 can need)
    over an fp8 bank: greedy tokens equal resident fp8's at decode batch 1, 3 and
    8, prompts streaming layers. Like for like (as test_gpu_moe_cache): the
    resident engine's experts run through the MoE block's expert_compute hook
    over its own weights, so it applies the next input norm as the cache's
    layers round it (not folded into the down GEMV, not left pending), and it
    prefills eagerly, as offload mode does."""
    import functools

    from ftserve.moe.banks import moe_blocks
    from ftserve.moe.cache import ExpertCache
    from ftserve_kernels import ops

    def own_experts(block: Any, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    kernels: Any) -> torch.Tensor:
        return ops.fused_moe(kernels, x, *block.expert_weights(), weights, ids)

    resident = make_engine(model_dir)
    off = make_engine(model_dir, slots=SCALE["num_experts"])
    try:
        # Offload mode prefills eagerly: so does the resident engine here (a prefill
        # graph's expert tiles are not an eager chunk's: module docstring).
        resident.runner.prefill_graphs = None
        for block in moe_blocks(resident.runner.model):
            block.expert_compute = functools.partial(own_experts, block)
        assert resident.runner.graphs is not None
        resident.runner.graphs.capture()
        cache = off.runner.model.expert_cache
        assert isinstance(cache, ExpertCache) and cache.bank.fp8 is not None and not cache.full
        with torch.no_grad():
            theirs = dict(engine.runner.model.named_parameters())  # the context-sensitive weights
            for dst in (resident, off):
                for name, p in dst.runner.model.named_parameters():
                    p.copy_(theirs[name])
        torch.cuda.synchronize()
        cache.reset()
        rng = random.Random(3)
        for bs in (1, 3, 8):
            prompts = [[rng.randrange(100, 32000) for _ in range(rng.randint(10, 2 * CHUNK))] for _ in range(bs)]
            assert run_greedy(off, prompts, 16) == run_greedy(resident, prompts, 16), bs
        st = cache.stats()
        assert st["experts_streamed"] > 0 and 0 < st["misses"] < st["lookups"], st
    finally:
        off.shutdown()
        resident.shutdown()


@pytest.mark.parametrize("graph", [False, True])
def test_read_through_from_a_pinned_fp8_bank(graph: bool) -> None:
    from ftserve.moe.banks import Fp8Row
    from ftserve_kernels import fp8_moe_gemv_triton as fmg
    from ftserve_kernels.fp8_quant import quantize_weight

    g = torch.Generator().manual_seed(5)
    h, inter, e, k, s = 2048, 768, 8, 8, 12
    row = Fp8Row(h, inter, (128, 128), (128, 128))
    bank = torch.zeros(e, row.row_bytes, dtype=torch.uint8, pin_memory=True)
    for w, shape in zip(row.views(bank), ((e, 2 * inter, h), (e, h, inter))):
        q = quantize_weight(torch.randn(shape, generator=g) * shape[-1] ** -0.5)
        w.codes.copy_(q.codes)
        w.scale.copy_(q.scale)
    slots = bank[torch.randint(0, e, (s,), generator=g)].cuda()
    emap = torch.arange(e, dtype=torch.int32, device="cuda")  # expert i in slot i
    ids = torch.randperm(e, generator=g)[:k].int().view(1, k).cuda()
    miss_slot = torch.tensor([1, 4, 6, -1], dtype=torch.int32, device="cuda")
    miss_id = torch.tensor([1, 4, 6, -1], dtype=torch.int32, device="cuda")
    x = torch.randn(1, h, generator=g).bfloat16().cuda()
    wts = torch.softmax(torch.randn(1, k, generator=g), -1).cuda()
    want_slots = slots.clone()
    want_slots[[1, 4, 6]] = bank[[1, 4, 6]].cuda()
    want = fmg.fused_moe_fp8_gemv_triton(x, *row.views(want_slots), wts, ids, emap)
    got_slots = slots.clone()
    rt = fmg.Fp8ReadThrough(bank, miss_slot, miss_id, row.row_bytes, 0, row.w2_col, row.w13_scale_col,
                            row.w2_scale_col)
    run = lambda: fmg.fused_moe_fp8_gemv_triton(x, *row.views(got_slots), wts, ids, emap, read_through=rt)  # noqa: E731
    if graph:
        run()
        got_slots.copy_(slots)
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            out = run()
        got_slots.copy_(slots)
        gr.replay()
    else:
        out = run()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    end = row.w2_scale_col + 4 * row.w2_scale_shape[0] * row.w2_scale_shape[1]
    for slot in ids.reshape(-1).tolist():
        assert torch.equal(got_slots[slot, :end], want_slots[slot, :end]), slot


def test_fp8_oproj_route_at_the_real_shape() -> None:
    """qwen3-30b-a3b's layer in fp8 (o_proj 2048 x 4096 and the experts E 128,
    I 768 in e4m3 with 128 x 128 block scales; k 8), outputs poisoned first:
    the fused o_proj + router against its twin (the o_proj rows and the pending
    norm within bf16 rounding, the pre-logits within fp32 summation order, the
    ids the twin's wherever the pre-logits around the k-th are not near-tied);
    the fp8 expert pair taking its route parts against the unfused pair over
    the normed row; and both launches replayed from a CUDA graph equal to eager."""
    from ftserve_kernels import fp8_moe_gemv_triton as fmg
    from ftserve_kernels import oproj_route_triton as orr
    from ftserve_kernels.fp8_gemv_triton import fp8_gemv_triton
    from ftserve_kernels.fp8_quant import quantize_weight
    from ftserve_kernels.moe_down_gemv_triton import NormNext
    from ftserve_kernels.moe_gemv_triton import RouteParts
    from tests.test_kernels_oproj_route import assert_route_close

    e, h, q, inter, k, eps = 128, 2048, 4096, 768, 8, 1e-6
    g = torch.Generator(device="cuda").manual_seed(12)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device="cuda") * scale

    def rel(x: torch.Tensor, y: torch.Tensor) -> float:
        return float((x.float() - y.float()).norm() / y.float().norm())

    a, r = rnd(1, q).bfloat16(), rnd(1, h).bfloat16()
    o_w = quantize_weight(rnd(h, q, scale=q**-0.5))
    nw, next_w = (1.0 + rnd(h, scale=0.1)).bfloat16(), (1.0 + rnd(h, scale=0.1)).bfloat16()
    gate = rnd(e, h, scale=h**-0.5).bfloat16()
    w13 = quantize_weight(rnd(e, 2 * inter, h, scale=h**-0.5))
    w2 = quantize_weight(rnd(e, h, inter, scale=inter**-0.5))
    folded = orr.fold_router(gate, nw, o_w)
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    weights = torch.full((1, k), float("nan"), device="cuda")

    def run() -> tuple[orr.OprojRoute, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        route = orr.oproj_route_triton(a, o_w, None, r, nw, folded, k, counter)
        out = fmg.fused_moe_fp8_add_norm_gemv_triton(
            route.scaled, w13, w2, weights, route.ids, NormNext(route.summed, next_w, eps, counter, deferred=True),
            route=RouteParts(route.parts, route.pre_sel, eps))
        return route, out

    torch.cuda.synchronize()
    got, (scaled, summed, parts) = run()
    torch.cuda.synchronize()
    assert counter.item() == 0
    assert_route_close(got, orr.oproj_route_ref(a, o_w, None, r, nw, folded, k), a, r, folded, k)
    assert rel(got.summed, (fp8_gemv_triton(a, o_w).float() + r.float()).bfloat16()) < 1e-2  # the unfused o_proj
    # The experts over the routed row, as the unfused pair over the normed row and the router's weights.
    s = got.summed.float()
    x = (nw.float() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)).bfloat16()
    ref_w = torch.softmax((x.float() @ gate.float().t()).gather(1, got.ids.long()), -1)
    torch.testing.assert_close(weights, ref_w, rtol=2e-2, atol=2e-3)
    want_scaled, want_summed, _ = fmg.fused_moe_fp8_add_norm_gemv_triton(
        x, w13, w2, ref_w, got.ids, NormNext(got.summed, next_w, eps, counter, deferred=True))
    assert rel(summed, want_summed) < 1e-2 and rel(scaled, want_scaled) < 1e-2
    assert parts is not None
    torch.testing.assert_close(parts.sum(-1), summed.float().pow(2).sum(-1), rtol=1e-3, atol=1e-3)
    # Graph-capturable: the replay writes what the eager launches wrote.
    eager = [t.clone() for t in (got.summed, got.ids, weights, scaled, summed)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_route, (g_scaled, g_summed, _) = run()
    for t in (g_route.summed, g_route.ids, weights, g_scaled, g_summed):
        t.fill_(0)
    graph.replay()
    torch.cuda.synchronize()
    assert counter.item() == 0
    for x_, y_ in zip((g_route.summed, g_route.ids, weights, g_scaled, g_summed), eager):
        assert torch.equal(x_, y_)


@torch.inference_mode()
def test_fp8_decode_row_routes_in_o_proj(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-row decode step of the fp8 model on CUDA routes in its fp8 o_proj
    launch in every layer (no norm + route launch), the fp8 experts taking the
    route parts; its logits match the unfused fp8 path's (oproj_route_applies
    off) within bf16 rounding where both picked the same experts in every layer
    (the pre-logits are not rounded through the normed row: a near-tie may pick
    another expert, oproj_route_triton's docstring). In the decode graphs this
    path runs in test_no_hidden_syncs_fp8 and test_graph_decode_equals_eager_fp8
    (batch 1)."""
    from ftserve.kvcache.pool import KVPool
    from ftserve.models.forward_batch import build_forward_batch
    from ftserve_kernels import ops
    from ftserve_kernels.attention_triton import TritonAttentionBackend
    from ftserve_kernels.fp8_quant import Fp8Weight

    cfg = engine.model_config
    model = engine.runner.model
    rng = random.Random(13)
    prompt = [rng.randrange(100, 32000) for _ in range(40)]
    pool = KVPool(cfg.num_layers, 4, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cuda")
    backend, kernels = TritonAttentionBackend(), engine.runner.kernels
    model(build_forward_batch([prompt], [0], [[1, 2, 3]], pool, backend, kernels=kernels))
    picked: dict[str, list[Any]] = {"oproj_route": [], "add_rms_norm_route": []}
    real_or, real_route = ops.oproj_route, ops.add_rms_norm_route

    def spy_or(*a: Any, **kw: Any) -> Any:
        assert isinstance(a[2], Fp8Weight)  # o_proj's codes and scales
        out = real_or(*a, **kw)
        picked["oproj_route"].append(out.ids)
        return out

    def spy_route(*a: Any, **kw: Any) -> Any:
        out = real_route(*a, **kw)
        picked["add_rms_norm_route"].append(out[3])
        return out

    monkeypatch.setattr(ops, "oproj_route", spy_or)
    monkeypatch.setattr(ops, "add_rms_norm_route", spy_route)

    def decode() -> torch.Tensor:
        return model(build_forward_batch([[prompt[-1]]], [40], [[1, 2, 3]], pool, backend, is_decode=True,
                                         kernels=kernels)).float()

    fused = decode()
    assert len(picked["oproj_route"]) == cfg.num_layers and not picked["add_rms_norm_route"], picked
    monkeypatch.setattr(ops, "oproj_route_applies", lambda *a: False)
    unfused = decode()
    assert len(picked["add_rms_norm_route"]) == cfg.num_layers
    same = all(set(f[0].tolist()) == set(u[0].tolist())
               for f, u in zip(picked["oproj_route"], picked["add_rms_norm_route"]))
    rel = float((fused - unfused).norm() / unfused.norm())
    assert torch.isfinite(fused).all()
    assert rel < (0.02 if same else 0.1), (rel, same)
