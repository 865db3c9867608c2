"""o_proj with the router folded in (ftserve_kernels/oproj_route_triton.py) and
the gate/up launch that applies its pending norm, against their torch twins
(the CPU interpreter at small shapes), and a one-row decode step of a tiny
MoE model through them against the torch path. Over an fp8 o_proj and fp8
experts: tests/test_kernels_fp8.py (interpreted), tests/test_gpu_fp8.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from ftserve.models.checkpoint import write_checkpoint
from ftserve.models.forward_batch import AttentionBackend
from ftserve.models.loader import load_model
from ftserve_kernels import oproj_route_triton as orr
from ftserve_kernels import ops
from ftserve_kernels.attention_triton import TritonAttentionBackend
from ftserve_kernels.config import KernelConfig
from ftserve_kernels.moe import fused_moe_ref
from ftserve_kernels.moe_down_gemv_triton import NormNext
from ftserve_kernels.moe_gemv_triton import RouteParts, fused_moe_add_norm_gemv_triton
from ftserve_kernels.paged_attention import TorchAttentionBackend
from tests.test_kernels_model import prefill_then_decode

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The model test builds a CPU model for the Triton interpreter.
interpreter_only = pytest.mark.skipif(torch.cuda.is_available(), reason="an interpreter test: CPU tensors")


def _case(e: int, h: int, q: int, seed: int, bias: bool) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(DEVICE)

    return dict(a=rnd(1, q), o_w=rnd(h, q, scale=q**-0.5), o_b=rnd(h) if bias else None, r=rnd(1, h),
                nw=1.0 + rnd(h, scale=0.1), gate=rnd(e, h, scale=h**-0.5))


@pytest.mark.parametrize("block_e", [1, 2, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_oproj_route_matches_its_twin(block_e: int, bias: bool) -> None:
    """The o_proj rows, the sum, w * sum and its partial sums of squares, the
    pre-logits' top-k (ids in order, their values): as the torch twin, over
    two launches that share the counter (left at zero)."""
    c = _case(16, 64, 128, seed=block_e, bias=bias)
    folded = orr.fold_router(c["gate"], c["nw"], c["o_w"], c["o_b"])
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    ref = orr.oproj_route_ref(c["a"], c["o_w"], c["o_b"], c["r"], c["nw"], folded, 4)
    for _ in range(2):
        got = orr.oproj_route_triton(c["a"], c["o_w"], c["o_b"], c["r"], c["nw"], folded, 4, counter,
                                     block_e=block_e)
        assert counter.item() == 0
        torch.testing.assert_close(got.summed, ref.summed, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.scaled, ref.scaled, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.parts.sum(-1, keepdim=True), ref.parts, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.ids, ref.ids)
        torch.testing.assert_close(got.pre_sel, ref.pre_sel, rtol=1e-5, atol=1e-5)
    # The pre-logits are the router's logits times rms(sum): the same experts as
    # routing the normed sum.
    s = ref.summed.float()
    normed = c["nw"] * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6))
    logits = F.linear(normed, c["gate"])
    assert torch.equal(torch.topk(logits, 4).indices.to(torch.int32), ref.ids)


def test_oproj_route_top_k_skips_nan_and_breaks_ties_low() -> None:
    """NaN pre-logits (garbage rows) never win and ids stay in range; equal
    ones go to the lowest index."""
    c = _case(8, 32, 64, seed=3, bias=False)
    folded = orr.fold_router(c["gate"], c["nw"], c["o_w"])
    r_o = folded.r_o.clone()
    r_o[5] = float("nan")  # expert 5's pre-logit is NaN
    r_o[6] = r_o[2]  # experts 2 and 6 tie
    rr = folded.r_r.clone()
    rr[6] = rr[2]
    rr[2] += 10.0 * c["r"][0]  # ... and rank first
    rr[6] += 10.0 * c["r"][0]
    f = orr.FoldedRouter(r_o, rr, None, folded.versions)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    got = orr.oproj_route_triton(c["a"], c["o_w"], None, c["r"], c["nw"], f, 8, counter)
    ids = got.ids[0].tolist()
    assert ids[:2] == [2, 6], ids
    assert sorted(ids[:7]) == [0, 1, 2, 3, 4, 6, 7] and 0 <= ids[7] < 8, ids
    assert torch.isfinite(got.pre_sel[0, :7]).all()


def test_fold_router_follows_the_weights() -> None:
    """The decoder refolds when a folded weight changed in place (its version)."""
    c = _case(8, 32, 64, seed=4, bias=False)
    f = orr.fold_router(c["gate"], c["nw"], c["o_w"])
    torch.testing.assert_close(f.r_o, (c["gate"] * c["nw"][None, :]) @ c["o_w"])
    c["gate"].mul_(2.0)
    assert orr.fold_router(c["gate"], c["nw"], c["o_w"]).versions != f.versions


def test_gate_up_applies_the_pending_norm_and_weighs_the_experts() -> None:
    """The MoE pair over a routed row (RouteParts): as normalizing the sum first
    and routing with the softmax of the k chosen logits."""
    e, h, inter, k = 8, 64, 32, 2
    g = torch.Generator().manual_seed(5)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) * h**-0.5).to(DEVICE)
    w2 = (torch.randn(e, h, inter, generator=g) * inter**-0.5).to(DEVICE)
    c = _case(e, h, 48, seed=6, bias=False)
    folded = orr.fold_router(c["gate"], c["nw"], c["o_w"])
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    route = orr.oproj_route_triton(c["a"], c["o_w"], None, c["r"], c["nw"], folded, k, counter)
    eps = 1e-6
    next_w = 1.0 + 0.1 * torch.randn(h, generator=g).to(DEVICE)
    weights = torch.full((1, k), float("nan"), device=DEVICE)
    nn = NormNext(route.summed, next_w, eps, counter)
    normed, summed, _ = fused_moe_add_norm_gemv_triton(
        route.scaled, w13, w2, weights, route.ids, nn, route=RouteParts(route.parts, route.pre_sel, eps))
    assert counter.item() == 0
    s = route.summed.float()
    x = c["nw"] * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps))  # the post-attention norm
    logits = F.linear(x, c["gate"])
    ref_w = torch.softmax(logits.gather(1, route.ids.long()), -1)
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6)
    moe = fused_moe_ref(x, w13, w2, ref_w, route.ids)
    ref_sum = moe + s
    torch.testing.assert_close(summed, ref_sum, rtol=1e-4, atol=1e-5)
    ref_normed = next_w * (ref_sum * torch.rsqrt(ref_sum.pow(2).mean(-1, keepdim=True) + eps))
    torch.testing.assert_close(normed, ref_normed, rtol=1e-4, atol=1e-5)


@interpreter_only
def test_one_row_decode_routed_by_o_proj_matches_torch_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every MoE layer of a one-row decode step routes in its o_proj launch (no
    norm + route launch); the logits match the torch path's, with the next norm
    pending (layer 0) or folded (the last layer's final norm). A small
    vocabulary: the interpreter runs the one-row lm_head GEMV program by program."""
    write_checkpoint("tiny-moe", tmp_path, seed=8, dtype="float32", overrides={"vocab_size": 256})

    def run(backend: AttentionBackend, kernels: KernelConfig) -> list[torch.Tensor]:
        return prefill_then_decode(tmp_path, backend, kernels, token_seed=9)

    ref = run(TorchAttentionBackend(), KernelConfig(backend="torch"))
    calls = {"oproj_route": 0, "route": 0}
    real_or, real_route = ops.oproj_route, ops.add_rms_norm_route

    def counting_or(*a: Any, **kw: Any) -> Any:
        calls["oproj_route"] += 1
        return real_or(*a, **kw)

    def counting_route(*a: Any, **kw: Any) -> Any:
        calls["route"] += 1
        return real_route(*a, **kw)

    monkeypatch.setattr(ops, "oproj_route", counting_or)
    monkeypatch.setattr(ops, "add_rms_norm_route", counting_route)
    ops._triton_table.cache_clear()
    try:
        got = run(TritonAttentionBackend(), KernelConfig(backend="triton"))
    finally:
        ops._triton_table.cache_clear()
    assert calls == {"oproj_route": 2, "route": 2}, calls  # decode: both layers; prefill: the route launch
    for r, o in zip(ref, got):
        assert o.shape == r.shape and torch.isfinite(o).all()
        err = float((o - r).norm() / r.norm())
        assert err < 1e-4, err


@pytest.mark.gpu
def test_gpu_oproj_route_at_the_real_shape() -> None:
    """qwen3-30b-a3b's layer shape in bf16 (E 128, H 2048, q 4096, k 8), outputs
    poisoned first: the o_proj rows and the pending norm within bf16 rounding of
    the twin, the pre-logits within fp32 summation order, and the ids the
    twin's wherever the pre-logits around the k-th are not near-tied."""
    e, h, q, k = 128, 2048, 4096, 8
    g = torch.Generator(device="cuda").manual_seed(12)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    a, o_w, r = rnd(1, q), rnd(h, q, scale=q**-0.5), rnd(1, h)
    nw, gate = (1.0 + rnd(h, scale=0.1).float()).to(torch.bfloat16), rnd(e, h, scale=h**-0.5)
    folded = orr.fold_router(gate, nw, o_w)
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    ref = orr.oproj_route_ref(a, o_w, None, r, nw, folded, k)
    for block_e in (1, 2, 4):
        torch.cuda.synchronize()
        got = orr.oproj_route_triton(a, o_w, None, r, nw, folded, k, counter, block_e=block_e)
        torch.cuda.synchronize()
        assert counter.item() == 0
        assert_route_close(got, ref, a, r, folded, k)


def assert_route_close(got: orr.OprojRoute, ref: orr.OprojRoute, a: torch.Tensor, r: torch.Tensor,
                       folded: Any, k: int) -> None:
    """A one-row CUDA OprojRoute against its twin: the sums within bf16, the norm's
    parts and the chosen logits, and the top-k ids unless the k-th and (k+1)-th
    folded logits are near-tied."""
    for name in ("summed", "scaled"):
        x, y = getattr(got, name).float(), getattr(ref, name).float()
        assert float((x - y).norm() / y.norm()) < 1e-2, name
    torch.testing.assert_close(got.parts.sum(-1, keepdim=True), ref.parts, rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(got.pre_sel, ref.pre_sel, rtol=1e-3, atol=1e-3)
    pre = a.float() @ folded.r_o.float().t() + r.float() @ folded.r_r.float().t()
    top = torch.topk(pre, k + 1).values[0]
    if float(top[k - 1] - top[k]) > 1e-3:  # no near-tie at the boundary
        assert set(got.ids[0].tolist()) == set(ref.ids[0].tolist())


def test_refresh_derived_refolds_in_place(tmp_path: Path) -> None:
    """Loading folds every MoE layer's router; a weight changed in place and
    refresh_derived() (or load_state_dict, through its hook) refold into the
    same tensors, which captured graphs read."""
    write_checkpoint("tiny-moe", tmp_path, seed=10, dtype="float32")
    model, _ = load_model(tmp_path, dtype="float32", device="cpu")
    layer = model.layers[0]
    f = layer._folded
    assert f is not None and all(lay._folded is not None for lay in model.layers)
    ptr = f.r_o.data_ptr()
    with torch.no_grad():
        layer.self_attn.o_proj.weight.mul_(3.0)
    model.refresh_derived()
    g = layer._folded
    assert g.r_o.data_ptr() == ptr
    torch.testing.assert_close(g.r_o, orr.fold_router(layer.mlp.gate.weight, layer.post_attention_layernorm.weight,
                                                      layer.self_attn.o_proj.weight).r_o)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["layers.0.mlp.gate.weight"].mul_(-1.0)
    model.load_state_dict(state)
    h = layer._folded
    assert h.r_o.data_ptr() == ptr and h.versions != g.versions
    torch.testing.assert_close(h.r_r, layer.mlp.gate.weight * layer.post_attention_layernorm.weight[None, :])


def test_oproj_route_top_k_orders_signs_zeros_and_ties() -> None:
    """Pre-logits set directly (a one-hot attention row through R_o, no
    residual): negative values, +0 and -0 (equal: the lower index first),
    exact ties, a NaN (never picked while a number is left): the ids sorted
    by value, ties to the lowest index, and the values."""
    e, h, q, k = 16, 32, 48, 12
    vals = [-3.0, 0.0, -0.0, 5.0, 5.0, float("nan"), -1e30, 2.0, -2.0, 2.0, 0.5, -0.5, 7.0, -7.0, 0.0, 1.0]
    r_o = torch.zeros(e, q, device=DEVICE)
    r_o[:, 0] = torch.tensor(vals, device=DEVICE)
    f = orr.FoldedRouter(r_o, torch.zeros(e, h, device=DEVICE), None, ())
    a = torch.zeros(1, q, device=DEVICE)
    a[0, 0] = 1.0
    o_w = torch.zeros(h, q, device=DEVICE)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    got = orr.oproj_route_triton(a, o_w, None, torch.zeros(1, h, device=DEVICE), torch.ones(h, device=DEVICE),
                                 f, k, counter)
    order = sorted((i for i in range(e) if vals[i] == vals[i]), key=lambda i: (-vals[i], i))[:k]
    assert got.ids[0].tolist() == order
    assert got.pre_sel[0].tolist() == [vals[i] for i in order]
