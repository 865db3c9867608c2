"""The Gated DeltaNet Triton kernels (ftserve_kernels/gated_delta_triton.py and
short_conv_triton.py) against
their torch reference twins (gated_delta.py), on the CPU through the interpreter:
slot-indexed decode with sink padding, packed varlen prefill (partial, exact and
empty chunks, sequences continuing a state or starting fresh), strong decay, bf16
inputs, and prefill handing its state to decode steps. Every slot the batch does
not own must come out untouched."""

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
    for _name in ("ftserve_kernels.short_conv_triton", "ftserve_kernels.gated_delta_verify_triton",
                  "ftserve_kernels.gated_delta_triton"):
        if _name in sys.modules:
            importlib.reload(sys.modules[_name])

from ftserve_kernels import gated_delta as ref  # noqa: E402
from ftserve_kernels import gated_delta_triton as tri  # noqa: E402
from ftserve_kernels import ops  # noqa: E402
from ftserve_kernels.config import KernelConfig  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

EXACT = 2e-5  # fp32: the same sums in another order
HK, HV = 2, 4  # grouped: two value heads per key head, as 16 / 32 in Qwen3-Next


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rule(n: int, dk: int, dv: int, seed: int, dtype: torch.dtype = torch.float32,
          decay: float = 0.3, hk: int = HK, hv: int = HV) -> list[torch.Tensor]:
    """Model-layout inputs: q, k [n, hk, dk], v [n, hv, dv] (q|k|v as column views of
    one row, as the layer's split leaves them), g [n, hv] fp32, beta [n, hv]."""
    g = _gen(seed)
    mixed = torch.randn(n, 2 * hk * dk + hv * dv, generator=g).to(dtype).to(DEVICE)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    logdecay = (-torch.rand(n, hv, generator=g) * decay).to(DEVICE)
    beta = torch.rand(n, hv, generator=g).to(dtype).to(DEVICE)
    return [q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv), logdecay, beta]


def _states(slots: int, *shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(slots, *shape, generator=_gen(seed)).to(dtype).to(DEVICE)


def _dev(*xs: list[int] | list[bool]) -> list[torch.Tensor]:
    return [torch.tensor(x, device=DEVICE) for x in xs]


def _max(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _close(out: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: the same sums in another order; bf16: a bf16 rounding apart (the
    kernels round once, the reference twice)."""
    assert out.dtype == want.dtype and out.shape == want.shape
    if out.dtype == torch.float32:
        assert _max(out, want) <= EXACT
    else:
        torch.testing.assert_close(out.float(), want.float(), rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("dk,dv,block_v", [(16, 32, 16), (24, 16, 16)])  # several V blocks; a masked dk
def test_decode_matches_reference(dk: int, dv: int, block_v: int) -> None:
    """Rows 0-1 continue / start in slots 3 and 1; rows 2-3 are graph padding on the sink."""
    q, k, v, g, beta = _rule(4, dk, dv, seed=1)
    slots, has = _dev([3, 1, 0, 0], [True, False, False, False])
    base = _states(5, HV, dk, dv, seed=2)
    want, got = base.clone(), base.clone()
    o_ref = ref.gated_delta_decode(q, k, v, g, beta, want, slots, has)
    o = tri.gated_delta_decode(q, k, v, g, beta, got, slots, has, block_v=block_v)
    assert _max(o[:2], o_ref[:2]) <= EXACT
    assert _max(got[1:], want[1:]) <= EXACT
    assert torch.equal(got[2], base[2]) and torch.equal(got[4], base[4])  # nobody's slots


def test_decode_bf16_inputs() -> None:
    q, k, v, g, beta = _rule(3, 16, 16, seed=3, dtype=torch.bfloat16)
    slots, has = _dev([2, 1, 3], [True, True, False])
    want = _states(4, HV, 16, 16, seed=4)
    got = want.clone()
    o_ref = ref.gated_delta_decode(q, k, v, g, beta, want, slots, has)
    o = tri.gated_delta_decode(q, k, v, g, beta, got, slots, has)
    assert o.dtype == torch.bfloat16
    assert _max(o, o_ref) <= 2e-2 and _max(got, want) <= 1e-5  # the state is fp32 either way


# Packed sequences: a fresh one of 17 tokens (one partial chunk), one continuing its
# slot over 83 (a full and a partial chunk), an empty one, a fresh one of exactly 64.
BOUNDS = [0, 17, 100, 100, 164]
SLOTS = [3, 1, 4, 2]
HAS = [False, True, False, False]


@pytest.mark.parametrize("decay", [0.3, 6.0])  # 6: exp(cumsum) underflows within a chunk
def test_prefill_matches_reference(decay: float) -> None:
    dk, dv = 16, 32
    q, k, v, g, beta = _rule(BOUNDS[-1], dk, dv, seed=5, decay=decay)
    slots, has = _dev(SLOTS, HAS)
    cu = torch.tensor(BOUNDS, dtype=torch.int32, device=DEVICE)
    base = _states(6, HV, dk, dv, seed=6)
    want, got = base.clone(), base.clone()
    o_ref = ref.gated_delta_prefill(q, k, v, g, beta, want, slots, has, BOUNDS)
    o = tri.gated_delta_prefill(q, k, v, g, beta, got, slots, has, BOUNDS, cu_seqlens=cu, block_v=16)
    assert torch.isfinite(o).all()
    assert _max(o, o_ref) <= EXACT
    assert _max(got[1:5], want[1:5]) <= EXACT  # slot 4: the empty fresh sequence leaves zeros
    assert not got[4].any()
    assert torch.equal(got[0], base[0]) and torch.equal(got[5], base[5])


def test_prefill_bf16_inputs_close_to_fp32_reference() -> None:
    """bf16 q/k/v/beta: the kernels' matmuls take bf16 operands (fp32 sums, fp32
    state); the error stays at the size of the inputs' own rounding."""
    dk, dv = 16, 16
    q, k, v, g, beta = _rule(BOUNDS[-1], dk, dv, seed=7, dtype=torch.bfloat16)
    slots, has = _dev(SLOTS, HAS)
    want = _states(6, HV, dk, dv, seed=8)
    got = want.clone()
    o_ref = ref.gated_delta_prefill(*[t.float() for t in (q, k, v)], g, beta.float(), want, slots, has, BOUNDS)
    o = tri.gated_delta_prefill(q, k, v, g, beta, got, slots, has, BOUNDS)  # cu_seqlens from the bounds
    assert o.dtype == torch.bfloat16
    scale = o_ref.abs().max().item()
    assert _max(o, o_ref) <= 3e-2 * scale, (_max(o, o_ref), scale)
    assert _max(got, want) <= 3e-2 * want.abs().max().item()


def test_prefill_then_decode_steps_equal_one_reference_prefill() -> None:
    """70 tokens as a Triton prefill (fresh), 3 Triton decode steps continuing in the
    slot: the outputs and the final state of the reference over all 73."""
    dk, dv, n = 16, 16, 73
    q, k, v, g, beta = _rule(n, dk, dv, seed=9)
    slot, no, yes = _dev([2], [False], [True])
    want = torch.zeros(3, HV, dk, dv, device=DEVICE)
    o_ref = ref.gated_delta_prefill(q, k, v, g, beta, want, slot, no, [0, n])
    got = torch.full((3, HV, dk, dv), 7.0, device=DEVICE)  # stale: a fresh sequence must not read it
    outs = [tri.gated_delta_prefill(q[:70], k[:70], v[:70], g[:70], beta[:70], got, slot, no, [0, 70])]
    for t in range(70, n):
        s = slice(t, t + 1)
        outs.append(tri.gated_delta_decode(q[s], k[s], v[s], g[s], beta[s], got, slot, yes))
    assert _max(torch.cat(outs), o_ref) <= EXACT
    assert _max(got[2], want[2]) <= EXACT


def _conv(t: int, c: int, kernel: int, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(seed)
    return (torch.randn(t, c, generator=g).to(dtype).to(DEVICE),
            torch.randn(c, kernel, generator=g).to(dtype).to(DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_decode_matches_reference(dtype: torch.dtype) -> None:
    x, w = _conv(4, 40, 4, seed=10, dtype=dtype)  # 40 channels: a masked block tail
    slots, has = _dev([2, 1, 0, 0], [True, False, False, False])
    base = _states(4, 40, 3, seed=11, dtype=dtype)
    want, got = base.clone(), base.clone()
    o_ref = ref.conv_decode(x, w, want, slots, has)
    o = tri.conv_decode(x, w, got, slots, has)
    _close(o[:2], o_ref[:2])
    assert torch.equal(got[1:], want[1:])  # the shifted windows, bit for bit


def _projection(n: int, dk: int, dv: int, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Views into an in_proj output as the layer splits it (value heads grouped by
    key head): q, k [n, Hk, dk], v [n, Hk, r dv] (z between the groups), b, a [n, Hk, r]."""
    r = HV // HK
    g = _gen(seed)
    qkvz = torch.randn(n, HK, 2 * dk + 2 * r * dv, generator=g).to(dtype).to(DEVICE)
    ba = (3 * torch.randn(n, HK, 2 * r, generator=g)).to(dtype).to(DEVICE)
    q, k, v, _ = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
    b, a = ba.split([r, r], dim=-1)
    return q, k, v, b, a


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_fused_gates_from_projection_views(dtype: torch.dtype) -> None:
    """The decode launch that computes g = -exp(A_log) softplus(a + dt_bias) and
    beta = sigmoid(b) itself, a and b read as [B, Hk, r] views of the projection;
    dt_bias puts one head past softplus's linear threshold and one deep in its
    tail. has_state as the layer passes it: the prefix lengths (rows 2-3: padding
    on the sink)."""
    dk, dv = 16, 32
    q, k, v, _, _ = _rule(4, dk, dv, seed=50, dtype=dtype)
    _, _, _, b, a = _projection(4, dk, dv, seed=51, dtype=dtype)
    a_log = torch.tensor([0.5, -1.0, 0.0, 1.2]).to(dtype).to(DEVICE)
    dt_bias = torch.tensor([25.0, -30.0, 0.3, -1.0]).to(dtype).to(DEVICE)
    slots, prefix = _dev([3, 1, 0, 0], [7, 0, 0, 0])
    base = _states(5, HV, dk, dv, seed=52)
    want, got = base.clone(), base.clone()
    o_ref = ref.gated_delta_decode_fused(q, k, v, a, b, a_log, dt_bias, want, slots, prefix)
    o = tri.gated_delta_decode_fused(q, k, v, a, b, a_log, dt_bias, got, slots, prefix, block_v=16)
    g, beta = ref.gate_params(a.reshape(4, -1), b.reshape(4, -1), a_log, dt_bias)
    assert (g[:, 0] < -20).all() and (g[:, 1] > -1e-10).all(), "the two softplus branches"
    plain = base.clone()
    torch.testing.assert_close(ref.gated_delta_decode(q, k, v, g, beta, plain, slots, prefix != 0), o_ref)
    if dtype == torch.float32:
        assert _max(o[:2], o_ref[:2]) <= EXACT
    else:  # beta rounded to bf16 by both; the interpreter truncates where torch rounds
        assert _max(o[:2], o_ref[:2]) <= 3e-2, _max(o[:2], o_ref[:2])
    assert _max(got[1:4], want[1:4]) <= (EXACT if dtype == torch.float32 else 2e-2)
    assert torch.equal(got[2], base[2]) and torch.equal(got[4], base[4])  # nobody's slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_decode_reads_q_k_v_in_place(dtype: torch.dtype) -> None:
    """The decode conv over (q, k, v) views into the projection (no concatenated
    copy): the reference's outputs and windows of the concatenated channels, 288
    of them (two channel blocks, a masked tail)."""
    dk, dv = 24, 48
    q, k, v, _, _ = _projection(4, dk, dv, seed=53, dtype=dtype)
    c = HK * (2 * dk + HV // HK * dv)
    w = _conv(1, c, 4, seed=54, dtype=dtype)[1]
    slots, prefix = _dev([2, 1, 0, 0], [5, 0, 0, 0])
    base = _states(4, c, 3, seed=55, dtype=dtype)
    want, got, cat = base.clone(), base.clone(), base.clone()
    o_ref = ref.conv_decode((q, k, v), w, want, slots, prefix)
    x = torch.cat([p.reshape(4, -1) for p in (q, k, v)], dim=-1)
    assert torch.equal(ref.conv_decode(x, w, cat, slots, prefix), o_ref) and torch.equal(cat, want)
    o = tri.conv_decode((q, k, v), w, got, slots, prefix)
    _close(o[:2], o_ref[:2])
    assert torch.equal(got[1:], want[1:])  # the shifted windows, bit for bit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_prefill_matches_reference(dtype: torch.dtype) -> None:
    """Sequences of 2 (shorter than the window: old entries move within it), 0, 45
    (two token blocks) and 1 token, fresh and continuing."""
    bounds, slots_l, has_l = [0, 2, 2, 47, 48], [3, 4, 1, 2], [True, False, False, True]
    x, w = _conv(48, 24, 4, seed=12, dtype=dtype)
    slots, has = _dev(slots_l, has_l)
    base = _states(6, 24, 3, seed=13, dtype=dtype)
    want, got = base.clone(), base.clone()
    o_ref = ref.conv_prefill(x, w, want, slots, has, bounds)
    o = tri.conv_prefill(x, w, got, slots, has, bounds,
                         cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=DEVICE))
    _close(o, o_ref)
    assert torch.equal(got[1:5], want[1:5])
    assert torch.equal(got[0], base[0]) and torch.equal(got[5], base[5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_and_commit_match_reference(dtype: torch.dtype) -> None:
    """A verify step's packed sequences (4, 1 and 3 tokens continuing slots 3, 1, 2;
    one masked dk and two V blocks): the outputs of the reference, no slot
    written; then the commit over two layers' logs keeping 2, 1 and 3 tokens:
    the reference's states and windows, the other slots untouched."""
    dk, dv, c = 24, 32, 40
    bounds, slots_l, kept_l = [0, 4, 5, 8], [3, 1, 2], [2, 1, 3]
    slots, has = _dev(slots_l, [True] * 3)
    cu = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    kept = torch.tensor(kept_l, device=DEVICE)
    logs = [_rule(8, dk, dv, seed=40 + j, dtype=dtype) for j in range(2)]
    rec = torch.stack([_states(5, HV, dk, dv, seed=42 + j) for j in range(2)])  # [layers, slots + 1, ...]
    xs = torch.stack([_conv(8, c, 4, seed=44 + j, dtype=dtype)[0] for j in range(2)])
    w = _conv(1, c, 4, seed=46, dtype=dtype)[1]
    conv = torch.stack([_states(5, c, 3, seed=47 + j, dtype=dtype) for j in range(2)])
    got_rec, got_conv = rec.clone(), conv.clone()
    for j in range(2):
        o_ref = ref.gated_delta_verify(*logs[j], rec[j], slots, has, bounds)
        o = tri.gated_delta_verify(*logs[j], got_rec[j], slots, has, bounds, cu_seqlens=cu, block_v=16)
        if dtype == torch.float32:
            _close(o, o_ref)
        else:  # the kernel rounds the output once, the reference its fp32 sums too
            torch.testing.assert_close(o, o_ref, rtol=2e-2, atol=2e-2)
        _close(tri.conv_verify(xs[j], w, got_conv[j], slots, has, bounds, cu_seqlens=cu),
               ref.conv_verify(xs[j], w, conv[j], slots, has, bounds))
    assert torch.equal(got_rec, rec) and torch.equal(got_conv, conv)
    # The log as the layer keeps it: contiguous [layers, tokens, ...] copies.
    k_log, v_log, g_log, b_log = (torch.stack([lg[i] for lg in logs]).contiguous() for i in (1, 2, 3, 4))
    starts = cu[:-1]
    ref.gated_delta_commit(k_log, v_log, g_log, b_log, rec, slots, has, starts, kept, 4)
    tri.gated_delta_commit(k_log, v_log, g_log, b_log, got_rec, slots, has, starts, kept, 4, block_v=16)
    ref.conv_commit(xs, conv, slots, has, starts, kept, 4)
    tri.conv_commit(xs, got_conv, slots, has, starts, kept, 4)
    assert _max(got_rec, rec) <= 1e-5  # the state is fp32 either way
    assert torch.equal(got_conv, conv)  # windows of copied inputs, bit for bit
    base = torch.stack([_states(5, HV, dk, dv, seed=42 + j) for j in range(2)])
    assert torch.equal(got_rec[:, [0, 4]], base[:, [0, 4]])


def test_dispatch_picks_triton_on_request() -> None:
    x = torch.zeros(2, 2)
    assert ops.gated_delta(KernelConfig(backend="torch"), x) is ref
    triton_mod = ops.gated_delta(KernelConfig(backend="triton"), x)
    assert triton_mod is sys.modules["ftserve_kernels.gated_delta_triton"]
    assert (ops.gated_delta(KernelConfig(backend="auto"), x) is ref) == (not x.is_cuda)


def _rel(out: torch.Tensor, want: torch.Tensor) -> float:
    return ((out.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_real_shapes_sync_free_and_decode_capturable() -> None:
    """Qwen3-Next-80B's heads (16 key / 32 value of 128) in bf16 over an fp32 pool: a
    packed prefill (1100 tokens continuing a state, 5 fresh, 195 continuing) close to
    the fp32 reference; prefill and decode launch without a host sync; the decode
    pair (conv, rule) replays from a CUDA graph with the eager step's results."""
    hk, hv, d, width = 16, 32, 128, 3
    bounds, slots_l, has_l = [0, 1100, 1105, 1300], [5, 2, 7], [True, False, True]
    q, k, v, g, beta = _rule(bounds[-1], d, d, seed=20, dtype=torch.bfloat16, hk=hk, hv=hv)
    slots, has = _dev(slots_l, has_l)
    cu = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    base = _states(9, hv, d, d, seed=21) * 0.1
    want, got = base.clone(), base.clone()
    o_ref = ref.gated_delta_prefill(*[t.float() for t in (q, k, v)], g, beta.float(), want, slots, has, bounds)
    tri.gated_delta_prefill(q, k, v, g, beta, base.clone(), slots, has, bounds, cu_seqlens=cu)  # compile
    conv_dim = 2 * hk * d + hv * d
    x, w = _conv(bounds[-1], conv_dim, width + 1, seed=22, dtype=torch.bfloat16)
    conv_states = _states(9, conv_dim, width, seed=23, dtype=torch.bfloat16)
    tri.conv_prefill(x, w, conv_states.clone(), slots, has, bounds, cu_seqlens=cu)  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        o = tri.gated_delta_prefill(q, k, v, g, beta, got, slots, has, bounds, cu_seqlens=cu)
        tri.conv_prefill(x, w, conv_states, slots, has, bounds, cu_seqlens=cu)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # bf16 matmul operands in the scan (as flash-linear-attention rounds): about 1.5% on the
    # output, 0.5% on the state in the interpreter's emulation of this case's rounding
    assert _rel(o, o_ref) <= 3e-2 and _rel(got, want) <= 1.5e-2, (_rel(o, o_ref), _rel(got, want))

    # Decode: rows 0-2 continue their slots, row 3 is graph padding on the sink.
    dq, dk_, dv_, dg, db = _rule(4, d, d, seed=24, dtype=torch.bfloat16, hk=hk, hv=hv)
    dx = x[:4].clone()
    dslots, dhas = _dev(slots_l + [0], has_l + [False])
    dhas[:3] = True

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        return (tri.conv_decode(dx, w, conv_states, dslots, dhas),
                tri.gated_delta_decode(dq, dk_, dv_, dg, db, got, dslots, dhas))

    live = (conv_states, got)
    saved = [t.clone() for t in live]
    step()  # compile
    for t, s0 in zip(live, saved):
        t.copy_(s0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    after = [t.clone() for t in live]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for t, s0 in zip(live, saved):
        t.copy_(s0)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(out, eager):
        assert torch.equal(a[:3], b[:3])
    for t, ref_t in zip(live, after):
        assert torch.equal(t[1:], ref_t[1:])


def test_chunk_grid_may_be_a_bound() -> None:
    """chunk_local over more programs than chunks (a grid sized for a token budget, as
    a captured prefill would launch it): the real chunks' tiles are the same, the
    programs past them find no sequence and leave identity systems."""
    dk = 16
    q, k, _, g, beta = _rule(BOUNDS[-1], dk, dk, seed=30)
    cu = torch.tensor(BOUNDS, dtype=torch.int32, device=DEVICE)
    chunks = sum(-(-(hi - lo) // tri.CHUNK) for lo, hi in zip(BOUNDS[:-1], BOUNDS[1:]))

    def local(grid: int) -> tuple[torch.Tensor, torch.Tensor]:
        tinv = torch.full((grid, HV, 64, 64), 9.0, device=DEVICE)
        aqk = torch.full((grid, HV, 64, 64), 9.0, device=DEVICE)
        tri._chunk_local_kernel[(grid, HV)](
            q, k, g, beta, cu, tinv, aqk, len(BOUNDS) - 1, q.stride(0), k.stride(0), g.stride(0), beta.stride(0),
            dk**-0.5, 1e-6, HK=HK, HV=HV, DK=dk, BLOCK_K=16, C=tri.CHUNK, SB=tri.SUB)
        return tinv, aqk

    exact, bound = local(chunks), local(chunks + 2)
    assert torch.equal(bound[0][:chunks], exact[0]) and torch.equal(bound[1][:chunks], exact[1])
    assert torch.equal(bound[0][chunks:], torch.eye(64, device=DEVICE).expand(2, HV, 64, 64))
    assert not bound[1][chunks:].any()


@pytest.mark.parametrize("kind", ["prefill", "verify"])
def test_graph_forms_equal_the_host_bounded_step(kind: str) -> None:
    """What a captured prefill / verify graph launches (prefill_graph.py): no host
    bounds (seq_bounds None), one sequence per slot row read from cu_seqlens, a
    static bound per sequence, two empty padding sequences on the sink and
    padding tokens past the last sequence. The reference's graph twin and the
    Triton kernels both give the eager step's outputs and slots: the real
    sequences' rows and states; the sink takes the padding's garbage, and no
    other slot is written."""
    dk, dv, c = 16, 32, 24
    if kind == "prefill":  # 17 fresh, 83 continuing (a full and a partial chunk), 1 continuing
        bounds, slots_l, has_l, bound = [0, 17, 100, 101], [3, 1, 2], [False, True, True], 128
    else:  # 4, 1 and 3 tokens continuing their slots; the bound: the verify width
        bounds, slots_l, has_l, bound = [0, 4, 5, 8], [3, 1, 2], [True, True, True], 4
    n, pad_tok = bounds[-1], 6
    cu_g = torch.tensor(bounds + [n, n], dtype=torch.int32, device=DEVICE)  # + 2 empty sequences
    slots_g, has_g = _dev(slots_l + [0, 0], has_l + [False, False])
    slots, has = _dev(slots_l, has_l)
    rule = _rule(n + pad_tok, dk, dv, seed=60)
    x, w = _conv(n + pad_tok, c, 4, seed=61, dtype=torch.float32)
    rec0, conv0 = _states(5, HV, dk, dv, seed=62), _states(5, c, 3, seed=63)
    run_rule = ref.gated_delta_prefill if kind == "prefill" else ref.gated_delta_verify
    run_conv = ref.conv_prefill if kind == "prefill" else ref.conv_verify
    want_rec, want_conv = rec0.clone(), conv0.clone()
    o_want = run_rule(*[t[:n] for t in rule], want_rec, slots, has, bounds)
    y_want = run_conv(x[:n], w, want_conv, slots, has, bounds)
    for mod in (ref, tri):
        rule_fn = mod.gated_delta_prefill if kind == "prefill" else mod.gated_delta_verify
        conv_fn = mod.conv_prefill if kind == "prefill" else mod.conv_verify
        rec, conv = rec0.clone(), conv0.clone()
        o = rule_fn(*rule, rec, slots_g, has_g, None, cu_seqlens=cu_g, static_len=bound)
        y = conv_fn(x, w, conv, slots_g, has_g, None, cu_seqlens=cu_g, static_len=bound)
        assert o.shape[0] == y.shape[0] == n + pad_tok
        assert _max(o[:n], o_want) <= EXACT and _max(y[:n], y_want) <= EXACT, mod.__name__
        assert _max(rec[1:], want_rec[1:]) <= EXACT and torch.equal(conv[1:], want_conv[1:]), mod.__name__
        assert torch.equal(rec[4], rec0[4]) and torch.equal(conv[4], conv0[4])  # nobody's slot
        if kind == "verify":
            assert torch.equal(rec, rec0) and torch.equal(conv, conv0)  # no slot written, not even the sink


@pytest.mark.parametrize("graph", [False, True])
def test_inner_saves_equal_the_chunks_split_there(graph: bool) -> None:
    """States saved inside a prefill chunk (gated_delta.InnerSaves: a hybrid's
    checkpoints at a page boundary inside the step, engine/state_checkpoints.py):
    a sequence with saves after 16 and 80 of its 100 tokens, one with a save after
    5 of 7 (inside the conv window's reach of its start: the old window is read),
    one with none. Outputs, final slots and the saved slots equal running each
    sequence as separate chunks cut at its saves, for the reference twin and the
    Triton kernels, eagerly and as a captured graph launches them (static shapes,
    the saves' offsets on the device; the sink takes the padding's writes)."""
    dk, dv, c = 16, 32, 24
    bounds, slots_l, has_l = [0, 100, 107, 130], [3, 1, 2], [False, True, True]
    cuts = [[(16, 5), (80, 6)], [(5, 7)], []]
    n = bounds[-1]
    rule = _rule(n, dk, dv, seed=70)
    x, w = _conv(n, c, 4, seed=71, dtype=torch.float32)
    rec0, conv0 = _states(9, HV, dk, dv, seed=72), _states(9, c, 3, seed=73)
    # The split run: each sequence's pieces as consecutive prefill chunks.
    want_rec, want_conv = rec0.clone(), conv0.clone()
    o_want, y_want = torch.empty(n, HV, dv, device=DEVICE), torch.empty(n, c, device=DEVICE)
    for b in range(3):
        lo, hi = bounds[b], bounds[b + 1]
        edges = [0] + [off for off, _ in cuts[b]] + [hi - lo]
        for i, (a, z) in enumerate(zip(edges, edges[1:])):
            slot, has = _dev([slots_l[b]], [has_l[b] or i > 0])
            part = [t[lo + a:lo + z] for t in rule]
            o_want[lo + a:lo + z] = ref.gated_delta_prefill(*part, want_rec, slot, has, [0, z - a])
            y_want[lo + a:lo + z] = ref.conv_prefill(x[lo + a:lo + z], w, want_conv, slot, has, [0, z - a])
            if i < len(cuts[b]):
                dst = cuts[b][i][1]
                want_rec[dst], want_conv[dst] = want_rec[slots_l[b]], want_conv[slots_l[b]]
    k = 2
    offs = torch.tensor([[o for o, _ in r] + [0] * (k - len(r)) for r in cuts], device=DEVICE)
    dsts = torch.tensor([[d for _, d in r] + [-1] * (k - len(r)) for r in cuts], device=DEVICE)
    if graph:  # + an empty padding sequence on the sink, padding tokens, a static bound
        pad = 6
        rule = [torch.cat([t, t[:pad]]) for t in rule]
        x = torch.cat([x, x[:pad]])
        cu = torch.tensor(bounds + [n], dtype=torch.int32, device=DEVICE)
        slots, has = _dev(slots_l + [0], has_l + [False])
        saves = ref.InnerSaves(torch.cat([offs, offs[:1] * 0]), torch.cat([dsts, dsts[:1] * 0 - 1]))
        host, static = None, 128
    else:
        cu, (slots, has) = torch.tensor(bounds, dtype=torch.int32, device=DEVICE), _dev(slots_l, has_l)
        saves, host, static = ref.InnerSaves(offs, dsts, cuts), bounds, None
    for mod in (ref, tri):
        rec, conv = rec0.clone(), conv0.clone()
        o = mod.gated_delta_prefill(*rule, rec, slots, has, host, cu_seqlens=cu, static_len=static, saves=saves)
        y = mod.conv_prefill(x, w, conv, slots, has, host, cu_seqlens=cu, static_len=static, saves=saves)
        assert _max(o[:n], o_want) <= EXACT and _max(y[:n], y_want) <= EXACT, mod.__name__
        assert _max(rec[1:], want_rec[1:]) <= EXACT and _max(conv[1:], want_conv[1:]) <= EXACT, mod.__name__
        assert torch.equal(rec[4], rec0[4]) and torch.equal(conv[8], conv0[8])  # nobody's slots
