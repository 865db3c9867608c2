"""The Gated DeltaNet references (ftserve_kernels/gated_delta.py): the chunked form
equals the token-by-token recurrence, the pool-level prefill / decode entry points
carry state through slots exactly, and both match transformers' own torch forms."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ftserve_kernels import gated_delta as gd

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

EXACT = 1e-5  # two fp32 orderings of the same sums


def _rule_inputs(n: int, heads: int, dk: int, dv: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = gd.l2norm(torch.randn(n, heads, dk, generator=g)) * dk**-0.5
    k = gd.l2norm(torch.randn(n, heads, dk, generator=g))
    v = torch.randn(n, heads, dv, generator=g)
    decay = -torch.rand(n, heads, generator=g) * 0.3  # log decay <= 0
    beta = torch.rand(n, heads, generator=g)
    return q, k, v, decay, beta


@pytest.mark.parametrize("n", [1, 5, 63, 64, 65, 200])
@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_equals_recurrent(n: int, chunk: int) -> None:
    q, k, v, g, beta = _rule_inputs(n, 3, 16, 8, seed=n)
    for s0 in (torch.zeros(3, 16, 8), torch.randn(3, 16, 8, generator=torch.Generator().manual_seed(9))):
        o_ref, s_ref = gd.recurrent_gated_delta_rule_ref(q, k, v, g, beta, s0)
        o, s = gd.chunk_gated_delta_rule_ref(q, k, v, g, beta, s0, chunk)
        assert (o - o_ref).abs().max().item() <= EXACT
        assert (s - s_ref).abs().max().item() <= EXACT


def test_chunked_handles_strong_decay() -> None:
    """Decays that underflow exp() over a chunk (gamma ~ e^-200) stay finite and exact."""
    q, k, v, _, beta = _rule_inputs(130, 2, 8, 8, seed=1)
    g = torch.full((130, 2), -3.0)
    o_ref, s_ref = gd.recurrent_gated_delta_rule_ref(q, k, v, g, beta, torch.ones(2, 8, 8))
    o, s = gd.chunk_gated_delta_rule_ref(q, k, v, g, beta, torch.ones(2, 8, 8))
    assert torch.isfinite(o).all() and (o - o_ref).abs().max().item() <= EXACT
    assert (s - s_ref).abs().max().item() <= EXACT


def test_matches_transformers_torch_forms() -> None:
    """Normalization, q scaling and grouped heads (2 key heads -> 4 value heads) as in
    transformers' reference Qwen3-Next functions, from a given initial state."""
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    g = torch.Generator().manual_seed(3)
    n, hk, hv, dk, dv = 70, 2, 4, 16, 8
    q, k = torch.randn(n, hk, dk, generator=g), torch.randn(n, hk, dk, generator=g)
    v = torch.randn(n, hv, dv, generator=g)
    decay, beta = -torch.rand(n, hv, generator=g), torch.rand(n, hv, generator=g)
    s0 = torch.randn(hv, dk, dv, generator=g)
    states = torch.zeros(3, hv, dk, dv)
    states[2] = s0
    slots, has = torch.tensor([2]), torch.tensor([True])
    o = gd.gated_delta_prefill(q, k, v, decay, beta, states, slots, has, [0, n])
    o_hf, s_hf = hf.torch_recurrent_gated_delta_rule(
        q[None], k[None], v[None], decay[None], beta[None], initial_state=s0[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert (o - o_hf[0]).abs().max().item() <= EXACT
    assert (states[2] - s_hf[0]).abs().max().item() <= EXACT


def _model_inputs(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(n, 2, 16, generator=g), torch.randn(n, 2, 16, generator=g)
    v = torch.randn(n, 4, 8, generator=g)
    return q, k, v, -torch.rand(n, 4, generator=g) * 0.2, torch.rand(n, 4, generator=g)


def test_prefill_pieces_and_decode_steps_equal_one_prefill() -> None:
    """One sequence as one prefill, as prefill pieces continuing from the slot, and as
    token-by-token decode steps: the same outputs and the same final state."""
    n = 90
    q, k, v, g, beta = _model_inputs(n, seed=4)
    slot, yes, no = torch.tensor([1]), torch.tensor([True]), torch.tensor([False])

    whole = torch.zeros(2, 4, 16, 8)
    o_whole = gd.gated_delta_prefill(q, k, v, g, beta, whole, slot, no, [0, n])

    pieces = torch.full((2, 4, 16, 8), 7.0)  # stale contents: the first piece must not read them
    outs, lo = [], 0
    for m in (30, 1, 40, 19):
        sl = slice(lo, lo + m)
        outs.append(gd.gated_delta_prefill(q[sl], k[sl], v[sl], g[sl], beta[sl], pieces, slot,
                                           no if lo == 0 else yes, [0, m]))
        lo += m
    assert (torch.cat(outs) - o_whole).abs().max().item() <= EXACT
    assert (pieces[1] - whole[1]).abs().max().item() <= EXACT

    steps = torch.full((2, 4, 16, 8), 7.0)
    outs = [gd.gated_delta_decode(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1],
                                  steps, slot, no if t == 0 else yes) for t in range(n)]
    assert (torch.cat(outs) - o_whole).abs().max().item() <= EXACT
    assert (steps[1] - whole[1]).abs().max().item() <= EXACT


def test_packed_sequences_keep_to_their_slots() -> None:
    """Three packed sequences (slots 3, 1, 2; the middle one continuing its state) equal
    each run alone; the sink and the other slots are not written."""
    lens = [17, 5, 40]
    parts = [_model_inputs(n, seed=10 + i) for i, n in enumerate(lens)]
    packed = [torch.cat([p[j] for p in parts]) for j in range(5)]
    bounds = [0, 17, 22, 62]
    start = torch.randn(4, 16, 8, generator=torch.Generator().manual_seed(2))
    states = torch.zeros(5, 4, 16, 8)
    states[1] = start
    slots, has = torch.tensor([3, 1, 2]), torch.tensor([False, True, False])
    o = gd.gated_delta_prefill(*packed, states, slots, has, bounds)
    for i, (p, slot) in enumerate(zip(parts, (3, 1, 2))):
        s0 = start if i == 1 else torch.zeros(4, 16, 8)
        alone = torch.zeros(5, 4, 16, 8)
        alone[0] = s0
        o_alone = gd.gated_delta_prefill(*p, alone, torch.tensor([0]), torch.tensor([i == 1]), [0, lens[i]])
        assert (o[bounds[i] : bounds[i + 1]] - o_alone).abs().max().item() <= EXACT
        assert (states[slot] - alone[0]).abs().max().item() <= EXACT
    assert not states[0].any() and not states[4].any()


def test_decode_batch_with_sink_padding() -> None:
    """A decode batch whose padded rows all point at the sink (slot 0) computes the real
    rows as an unpadded batch and leaves every other slot alone."""
    q, k, v, g, beta = _model_inputs(4, seed=5)
    base = torch.randn(4, 4, 16, 8, generator=torch.Generator().manual_seed(6))
    real = base.clone()
    o_real = gd.gated_delta_decode(q[:2], k[:2], v[:2], g[:2], beta[:2], real, torch.tensor([2, 1]),
                                   torch.tensor([True, True]))
    padded = base.clone()
    o_pad = gd.gated_delta_decode(q, k, v, g, beta, padded, torch.tensor([2, 1, 0, 0]),
                                  torch.tensor([True, True, False, False]))
    assert (o_pad[:2] - o_real).abs().max().item() <= 1e-6
    assert (padded[1:3] - real[1:3]).abs().max().item() <= 1e-6
    assert torch.equal(padded[3], base[3]) and torch.equal(real[3], base[3])  # nobody's slot


def _conv_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """SiLU(depthwise causal conv) of a whole fresh sequence with zero left padding
    (the transformers definition). x [L, C], w [C, K]."""
    y = F.conv1d(x.t()[None], w[:, None, :], padding=w.shape[1] - 1, groups=w.shape[0])[0, :, : x.shape[0]]
    return F.silu(y).t()


def test_conv_pieces_and_decode_equal_whole() -> None:
    g = torch.Generator().manual_seed(7)
    n, c, kernel = 25, 12, 4
    x, w = torch.randn(n, c, generator=g), torch.randn(c, kernel, generator=g)
    ref = _conv_reference(x, w)
    slot, yes, no = torch.tensor([2]), torch.tensor([True]), torch.tensor([False])

    whole = torch.zeros(3, c, kernel - 1)
    assert (gd.conv_prefill(x, w, whole, slot, no, [0, n]) - ref).abs().max().item() <= EXACT
    assert torch.equal(whole[2], x[-3:].t())  # the last K-1 inputs

    pieces = torch.full((3, c, kernel - 1), 5.0)
    outs, lo = [], 0
    for m in (1, 2, 10, 12):  # pieces shorter than the window keep older inputs
        outs.append(gd.conv_prefill(x[lo : lo + m], w, pieces, slot, no if lo == 0 else yes, [0, m]))
        lo += m
    assert (torch.cat(outs) - ref).abs().max().item() <= EXACT
    assert torch.equal(pieces[2], whole[2])

    steps = torch.full((3, c, kernel - 1), 5.0)
    outs = [gd.conv_decode(x[t : t + 1], w, steps, slot, no if t == 0 else yes) for t in range(n)]
    assert (torch.cat(outs) - ref).abs().max().item() <= EXACT
    assert torch.equal(steps[2], whole[2])


def test_verify_leaves_the_slots_and_commit_equals_decode_steps() -> None:
    """A verify step over three packed sequences (4, 1 and 3 tokens, in slots 3, 1,
    2) gives the outputs of decode steps over the same tokens and writes no slot;
    the commit over two layers' logs, keeping 2, 1 and 3 tokens, leaves in each
    slot (of each layer) the state and conv window those decode steps left after
    the kept tokens; the sink and unowned slot 4 are untouched."""
    kept_l, slots_l = [2, 1, 3], [3, 1, 2]
    bounds = [0, 4, 5, 8]
    slots, has = torch.tensor(slots_l), torch.tensor([True] * 3)
    starts, kept = torch.tensor(bounds[:-1]), torch.tensor(kept_l)
    gen = torch.Generator().manual_seed(20)
    c, kernel = 12, 4
    rec = torch.randn(2, 5, 4, 16, 8, generator=gen)  # [layers, slots + 1, Hv, dk, dv]
    conv = torch.randn(2, 5, c, kernel - 1, generator=gen)
    logs = [_model_inputs(8, seed=21 + j) for j in range(2)]  # q, k, v, g, beta per layer
    xs = torch.randn(2, 8, c, generator=gen)
    w = torch.randn(c, kernel, generator=gen)
    want_rec, want_conv = rec.clone(), conv.clone()
    for j in range(2):
        q, k, v, g, beta = logs[j]
        before_rec, before_conv = rec[j].clone(), conv[j].clone()
        o = gd.gated_delta_verify(q, k, v, g, beta, rec[j], slots, has, bounds)
        y = gd.conv_verify(xs[j], w, conv[j], slots, has, bounds)
        assert torch.equal(rec[j], before_rec) and torch.equal(conv[j], before_conv)
        for b, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            steps_rec, steps_conv = before_rec.clone(), before_conv.clone()
            slot = slots[b : b + 1]
            for t in range(lo, hi):
                s = slice(t, t + 1)
                o_t = gd.gated_delta_decode(q[s], k[s], v[s], g[s], beta[s], steps_rec, slot, has[:1])
                y_t = gd.conv_decode(xs[j][s], w, steps_conv, slot, has[:1])
                assert (o[s] - o_t).abs().max().item() <= EXACT and (y[s] - y_t).abs().max().item() <= EXACT
                if t - lo + 1 == kept_l[b]:
                    want_rec[j, slots_l[b]] = steps_rec[slots_l[b]]
                    want_conv[j, slots_l[b]] = steps_conv[slots_l[b]]
    k_log = torch.stack([lg[1] for lg in logs])
    v_log, g_log, b_log = (torch.stack([lg[i] for lg in logs]) for i in (2, 3, 4))
    gd.gated_delta_commit(k_log, v_log, g_log, b_log, rec, slots, has, starts, kept, max_kept=4)
    gd.conv_commit(xs, conv, slots, has, starts, kept, max_kept=4)
    assert (rec - want_rec).abs().max().item() <= EXACT
    assert torch.equal(conv, want_conv)
    assert torch.equal(rec[:, [0, 4]], want_rec[:, [0, 4]]) and torch.equal(conv[:, [0, 4]], want_conv[:, [0, 4]])
