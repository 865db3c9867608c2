"""Gated DeltaNet (Qwen3-Next's linear attention): torch reference twins.

Per value head, with a state S [dk, dv] and, per token t, a decay
a_t = exp(g_t) (g_t <= 0) and a write strength beta_t in (0, 1)::

    S_t = a_t S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - a_t S_{t-1}^T k_t)    (the delta rule)
    o_t = S_t^T q_t

q and k are L2-normalized per head and q is scaled by dk^-0.5 first; value
head h reads key head h // (Hv / Hk). The short causal conv before it (depthwise,
kernel K, SiLU) remembers the last K - 1 inputs of a sequence.

Two forms of the same recurrence:

- ``recurrent_gated_delta_rule_ref``: token by token (decode, and the oracle);
- ``chunk_gated_delta_rule_ref``: chunks of C tokens, each a few matmuls plus
  one unit-lower-triangular solve, then a scan over chunks carrying S (prefill).

Within a chunk starting from S_0, with gamma_t = exp(sum_{s<=t} g_s) and
D[t, s] = gamma_t / gamma_s (s <= t)::

    S_t = gamma_t S_0 + sum_{s<=t} D[t, s] k_s u_s^T
    u_t + beta_t sum_{s<t} D[t, s] (k_t . k_s) u_s = beta_t v_t - beta_t gamma_t S_0^T k_t
    =>  (I + A) U = beta V - (beta gamma K) S_0,   A[t, s] = beta_t D[t, s] k_t . k_s  (s < t)
    =>  U = U0 - W S_0  with U0 = (I + A)^-1 beta V,  W = (I + A)^-1 (beta gamma K)
        O = (gamma Q) S_0 + ((Q K^T) * D) U
        S_C = gamma_C S_0 + ((gamma_C / gamma) K)^T U

Everything but the scan over chunks is batched over chunks and heads.

The pool-level entry points (what the model layer calls) read each sequence's
starting state from its slot of the state pool (ftserve/kvcache/state_pool.py)
and write the final state back, by slot index tensors: ``conv_prefill`` /
``gated_delta_prefill`` for packed sequences of any lengths (a host loop over
sequences here: prefill is eager), ``conv_decode`` / ``gated_delta_decode`` for
one token per sequence (fixed shapes, gather / scatter, no sync: capturable);
``gated_delta_decode_fused`` is the decode step from the layer's raw gate
inputs a, b (``gate_params``), which the Triton launch turns into g and beta itself.

A speculative verify step (a request's last token and its draft, a few tokens
per sequence) may keep only some of its tokens, so it must not leave the state
after all of them. ``conv_verify`` / ``gated_delta_verify`` compute the outputs
(the rule token by token, as decode steps would) and leave every slot as it
was; the layer logs their inputs (StatePool.verify_log), and once the kept
counts are known on the device ``conv_commit`` / ``gated_delta_commit`` redo
the updates of each sequence's first kept[b] tokens from the log into its slot,
every linear layer in one call (fixed shapes, no sync)::

    slot:   S_L ----------------------------------------------> S_L  (verify: read only)
    tokens: t_L  d_1  d_2  d_3      sampled y_0 y_1 y_2 y_3, kept 2 (d_1 == y_0, d_2 != y_1)
    commit: S_L -> S_L+1 -> S_L+2  into the slot (the state after t_L, d_1)

A captured CUDA graph (engine/prefill_graph.py: prefill chunks and verify
steps of hybrids) cannot hold host bounds that change per step: its layers
pass ``seq_bounds=None`` and ``static_len``, a bound on every sequence's
tokens, and each sequence's tokens are read from ``cu_seqlens`` on the device
(one per slot row; empty sequences keep their state). The Triton kernels size
their grids from the bound; the twins here run a masked token-by-token loop of
``static_len`` steps (``_graph_tokens``), fixed shapes, no host read.

gated_delta_triton.py has Triton kernels with the same signatures;
ops.gated_delta picks them on CUDA tensors and this module, their reference
twin, elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

CHUNK = 64
L2_EPS = 1e-6


@dataclass(frozen=True)
class InnerSaves:
    """States saved inside a prefill chunk (engine/state_checkpoints.py): sequence
    b's conv window and rule state after its first ``offsets[b, i]`` tokens go
    into pool slot ``slots[b, i]``, besides its final ones into its own slot. A
    row's saves come first, offsets ascending strictly inside (0, its length);
    the rest of the row is slot -1 (none). The Triton kernels cut each sequence
    into K + 1 segments there and carry the state through them, so the result is
    the one the sequence gives as K + 1 prefill chunks: the same chunks, the same
    math."""

    offsets: torch.Tensor  # [B, K] int64, device
    slots: torch.Tensor  # [B, K] int64, device
    host: list[list[tuple[int, int]]] | None = None  # eager: each sequence's (offset, slot); None in a graph

    @property
    def per_seq(self) -> int:
        return int(self.slots.shape[1])

    def host_rows(self, nseq: int) -> list[list[tuple[int, int]]]:
        assert self.host is not None and len(self.host) == nseq, "a graph's saves are read on the device"
        return self.host


def segment_bounds(cu: torch.Tensor, saves: InnerSaves) -> torch.Tensor:
    """cu_seqlens [B + 1] -> the segments' bounds [B (K + 1) + 1] int32 on the
    device (sequence b's segments are b (K + 1) ... b (K + 1) + K; the ones after
    its last save are empty). No host read."""
    lo = cu[:-1].long()
    n = (cu[1:].long() - lo)[:, None]
    off = torch.minimum(torch.where(saves.slots >= 0, saves.offsets, n).clamp(min=0), n)
    segs = torch.cat([lo[:, None], lo[:, None] + off], dim=1).reshape(-1)
    return torch.cat([segs, cu[-1:].long()]).to(torch.int32)


def _save_rows(pool: torch.Tensor, slot: torch.Tensor | int, value: torch.Tensor) -> None:
    """pool[slot] = value for a slot index or a [B] tensor of them (value [B, ...])."""
    dst = slot if isinstance(slot, torch.Tensor) else torch.tensor([slot], device=pool.device)
    pool.index_copy_(0, dst.reshape(-1), value.reshape(-1, *pool.shape[1:]).to(pool.dtype))


def l2norm(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_gated_delta_rule_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., L, H, dk] (normalized, q scaled), v [..., L, H, dv], g, beta [..., L, H],
    state [..., H, dk, dv], all fp32 -> (o [..., L, H, dv], final state)."""
    s = state
    out = []
    for t in range(q.shape[-3]):
        s = _delta_step(s, k[..., t, :, :], v[..., t, :, :], g[..., t, :], beta[..., t, :])
        out.append(torch.einsum("...hk,...hkv->...hv", q[..., t, :, :], s))
    return torch.stack(out, dim=-3), s


def _delta_step(s: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor) -> torch.Tensor:
    """One token's update: s [..., H, dk, dv], k [..., H, dk], v [..., H, dv], g, beta [..., H]."""
    s = s * g.exp()[..., None, None]
    pred = torch.einsum("...hk,...hkv->...hv", k, s)  # what S already says for k
    u = (v - pred) * beta[..., None]  # [..., H, dv]
    return s + k[..., :, None] * u[..., None, :]


def chunk_gated_delta_rule_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked form (module docstring) of one sequence; same arguments and
    result as recurrent_gated_delta_rule_ref without the leading batch dims:
    q, k [L, H, dk], v [L, H, dv], g, beta [L, H], state [H, dk, dv], fp32."""
    n_tok = q.shape[0]
    pad = -n_tok % chunk
    # Padding tokens have k = v = q = 0, beta = 0, g = 0: they change neither the
    # state nor the decay, and they come after every real token.
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1) for x in (q, k, v))  # [H, Lp, d]
    g, beta = (F.pad(x, (0, 0, 0, pad)).transpose(0, 1) for x in (g, beta))  # [H, Lp]
    h = q.shape[0]
    q, k, v = (x.reshape(h, -1, chunk, x.shape[-1]) for x in (q, k, v))  # [H, N, C, d]
    g, beta = g.reshape(h, -1, chunk), beta.reshape(h, -1, chunk)  # [H, N, C]

    cum = g.cumsum(-1)  # log gamma_t within each chunk
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # D[t, s] = gamma_t / gamma_s for s <= t; masked before exp (s > t would overflow).
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [H,N,C,C]
    kb = k * beta[..., None]
    a = ((kb @ k.transpose(-1, -2)) * decay).tril(-1)  # [H, N, C, C], strictly lower
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    system = a + eye
    u0 = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * cum.exp()[..., None], upper=False, unitriangular=True)
    qk = (q @ k.transpose(-1, -2)) * decay  # [H, N, C, C], causal incl. the diagonal
    q_decayed = q * cum.exp()[..., None]  # gamma_t q_t
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]  # (gamma_C / gamma_s) k_s
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [H, N, 1, 1]

    s = state
    out = torch.empty_like(v)
    for i in range(q.shape[1]):
        u = u0[:, i] - w[:, i] @ s  # [H, C, dv]
        out[:, i] = q_decayed[:, i] @ s + qk[:, i] @ u
        s = s * chunk_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ u
    out = out.reshape(h, -1, out.shape[-1])[:, :n_tok].transpose(0, 1)  # [L, H, dv]
    return out, s


def _prepare(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """Model-layout inputs -> the rule's: q, k [T, Hk, dk] normalized (q scaled)
    and repeated to the value heads, everything fp32."""
    rep = v.shape[-2] // q.shape[-2]
    q = l2norm(q) * q.shape[-1] ** -0.5
    k = l2norm(k)
    if rep > 1:
        q = q.repeat_interleave(rep, dim=-2)
        k = k.repeat_interleave(rep, dim=-2)
    return q, k, v.float(), g.float(), beta.float()


def _start(states: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor) -> torch.Tensor:
    """The slots' states (zeros where a sequence has no prefix) [B, ...], fp32.
    has_state: bool, or any integers (a prefix length: nonzero = has one)."""
    s = states.index_select(0, slots).float()
    keep = has_state.reshape(-1, *([1] * (s.dim() - 1))) != 0
    return torch.where(keep, s, torch.zeros((), dtype=s.dtype, device=s.device))


def gated_delta_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    states: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor, seq_bounds: Sequence[int] | None,
    chunk: int = CHUNK, cu_seqlens: torch.Tensor | None = None, static_len: int | None = None,
    saves: InnerSaves | None = None,
) -> torch.Tensor:
    """Packed sequences b = [seq_bounds[b], seq_bounds[b+1]) of q, k [T, Hk, dk],
    v [T, Hv, dv], g [T, Hv] (log decay), beta [T, Hv]; each starts from
    states[slots[b]] (zeros unless has_state[b]) and leaves its final state
    there. states: one layer's pool tensor [S+1, Hv, dk, dv]. -> o [T, Hv, dv]
    in v's dtype. cu_seqlens: seq_bounds on the device (the batch's qo_indptr),
    which the Triton twin reads; the reference loops over the host bounds.
    seq_bounds None: a captured graph's (module docstring). ``saves``: states
    inside the sequences too (InnerSaves: each sequence is run as its segments)."""
    if seq_bounds is None:
        return _rule_graph(q, k, v, g, beta, states, slots, has_state, cu_seqlens, static_len, store=True,
                           saves=saves)
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta)
    start = _start(states, slots, has_state)  # [B, Hv, dk, dv]
    out = torch.empty(vf.shape, dtype=v.dtype, device=v.device)
    rows = saves.host_rows(len(seq_bounds) - 1) if saves is not None else None
    for b in range(len(seq_bounds) - 1):
        lo, hi = seq_bounds[b], seq_bounds[b + 1]
        s = start[b]
        cuts = rows[b] if rows is not None else []
        for a, z, dst in zip([0] + [o for o, _ in cuts], [o for o, _ in cuts] + [hi - lo],
                             [d for _, d in cuts] + [None]):
            o, s = chunk_gated_delta_rule_ref(qf[lo + a:lo + z], kf[lo + a:lo + z], vf[lo + a:lo + z],
                                              gf[lo + a:lo + z], bf[lo + a:lo + z], s, chunk)
            out[lo + a:lo + z] = o.to(v.dtype)
            if dst is not None:
                _save_rows(states, dst, s)
        states.index_copy_(0, slots[b : b + 1], s[None].to(states.dtype))
    return out


def gated_delta_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    states: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor,
) -> torch.Tensor:
    """One token per sequence: q, k [B, Hk, dk], v [B, Hv, dv], g, beta [B, Hv];
    state gathered from and scattered back to states[slots] -> o [B, Hv, dv]."""
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta)
    o, s = recurrent_gated_delta_rule_ref(qf[:, None], kf[:, None], vf[:, None], gf[:, None],
                                          bf[:, None], _start(states, slots, has_state))
    states.index_copy_(0, slots, s.to(states.dtype))
    return o[:, 0].to(v.dtype)


def gate_params(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule's per-token, per-value-head gates from the layer's projections a, b
    [..., Hv] and its parameters A_log, dt_bias [Hv] (Qwen3-Next):
    (g = -exp(A_log) softplus(a + dt_bias) fp32, the log decay; beta = sigmoid(b)
    in b's dtype, the write strength)."""
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.sigmoid()


def gated_delta_decode_fused(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    a_log: torch.Tensor, dt_bias: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
    has_state: torch.Tensor,
) -> torch.Tensor:
    """gated_delta_decode with its gates from the layer's raw projections
    (gate_params, inside the Triton launch): a, b [B, Hv], or [B, Hk, Hv / Hk]
    views into the input projection (value heads grouped by key head)."""
    n = q.shape[0]
    g, beta = gate_params(a.reshape(n, -1), b.reshape(n, -1), a_log, dt_bias)
    return gated_delta_decode(q, k, v, g, beta, states, slots, has_state)


def conv_prefill(
    x: torch.Tensor, w: torch.Tensor, conv_states: torch.Tensor, slots: torch.Tensor,
    has_state: torch.Tensor, seq_bounds: Sequence[int] | None, cu_seqlens: torch.Tensor | None = None,
    static_len: int | None = None, saves: InnerSaves | None = None,
) -> torch.Tensor:
    """SiLU(causal depthwise conv) of packed sequences x [T, C] with weights w [C, K];
    sequence b continues from conv_states[slots[b]] [C, K-1] (zeros unless
    has_state[b]: the zero padding of a fresh sequence) and leaves its last K-1
    inputs there. -> [T, C] in x's dtype. cu_seqlens, static_len: as gated_delta_prefill's;
    ``saves``: the window after each saved offset also goes into its slot."""
    if seq_bounds is None:
        return _conv_graph(x, w, conv_states, slots, has_state, cu_seqlens, static_len, store=True, saves=saves)
    width = w.shape[1] - 1
    start = _start(conv_states, slots, has_state).to(x.dtype)  # [B, C, K-1]
    out = torch.empty_like(x)
    rows = saves.host_rows(len(seq_bounds) - 1) if saves is not None else None
    for b in range(len(seq_bounds) - 1):
        lo, hi = seq_bounds[b], seq_bounds[b + 1]
        ext = torch.cat([start[b], x[lo:hi].t()], dim=1)  # [C, K-1+L]
        if hi > lo:  # an empty sequence (padding) only keeps its window
            y = F.conv1d(ext[None].to(w.dtype), w[:, None, :], groups=w.shape[0])[0]  # [C, L]
            out[lo:hi] = F.silu(y).t().to(x.dtype)
        for off, dst in (rows[b] if rows is not None else []):
            _save_rows(conv_states, dst, ext[:, off:off + width])  # the window after off tokens
        conv_states.index_copy_(0, slots[b : b + 1], ext[None, :, ext.shape[1] - width:].to(conv_states.dtype))
    return out


def conv_decode(
    x: torch.Tensor | tuple[torch.Tensor, ...], w: torch.Tensor, conv_states: torch.Tensor,
    slots: torch.Tensor, has_state: torch.Tensor,
) -> torch.Tensor:
    """conv_prefill of one token per sequence, x [B, C]: gather, one K-tap dot
    product per channel, scatter the shifted window back. x may also be given
    as the parts whose rows, flattened and concatenated, are its rows (up to
    three [B, N, D] views, e.g. q, k, v [B, Hk, d] into the input projection:
    the Triton kernel reads them in place)."""
    if isinstance(x, tuple):
        x = torch.cat([p.reshape(p.shape[0], -1) for p in x], dim=-1)  # [B, C]
    ext = torch.cat([_start(conv_states, slots, has_state).to(x.dtype), x[:, :, None]], dim=2)  # [B, C, K]
    y = (ext.float() * w.float()).sum(-1)  # [B, C]
    conv_states.index_copy_(0, slots, ext[:, :, 1:].to(conv_states.dtype))
    return F.silu(y).to(x.dtype)


# ------------------------------------------------------------------ speculative verify steps


def conv_verify(
    x: torch.Tensor, w: torch.Tensor, conv_states: torch.Tensor, slots: torch.Tensor,
    has_state: torch.Tensor, seq_bounds: Sequence[int] | None, cu_seqlens: torch.Tensor | None = None,
    static_len: int | None = None,
) -> torch.Tensor:
    """conv_prefill's outputs, every slot's window left as it was (module
    docstring: conv_commit moves it on by the kept tokens)."""
    if seq_bounds is None:
        return _conv_graph(x, w, conv_states, slots, has_state, cu_seqlens, static_len, store=False)
    start = _start(conv_states, slots, has_state)  # [B, C, K-1]: a scratch copy the prefill may overwrite
    rows = torch.arange(start.shape[0], device=x.device)
    return conv_prefill(x, w, start, rows, torch.ones_like(has_state), seq_bounds)


def gated_delta_verify(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    states: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor, seq_bounds: Sequence[int] | None,
    cu_seqlens: torch.Tensor | None = None, static_len: int | None = None,
) -> torch.Tensor:
    """gated_delta_prefill's outputs (same arguments) by the token-by-token form
    decode steps use, every slot's state left as it was (module docstring)."""
    if seq_bounds is None:
        return _rule_graph(q, k, v, g, beta, states, slots, has_state, cu_seqlens, static_len, store=False)
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta)
    start = _start(states, slots, has_state)  # [B, Hv, dk, dv]
    out = torch.empty(vf.shape, dtype=v.dtype, device=v.device)
    for b in range(len(seq_bounds) - 1):
        lo, hi = seq_bounds[b], seq_bounds[b + 1]
        o, _ = recurrent_gated_delta_rule_ref(qf[lo:hi], kf[lo:hi], vf[lo:hi], gf[lo:hi], bf[lo:hi], start[b])
        out[lo:hi] = o.to(v.dtype)
    return out


def _graph_tokens(cu_seqlens: torch.Tensor | None, n_tok: int, static_len: int | None,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A captured graph's sequences, one per entry of cu_seqlens [B + 1] (device):
    (token rows [B, M], M = static_len, clamped into [0, n_tok); whether each is
    the sequence's [B, M]; its token count [B]). No host read."""
    assert cu_seqlens is not None and static_len is not None, "a graph's step passes cu_seqlens and static_len"
    lo = cu_seqlens[:-1].long()
    n = cu_seqlens[1:].long() - lo
    m = torch.arange(static_len, device=cu_seqlens.device)
    tok = (lo[:, None] + m).clamp(min=0, max=max(n_tok - 1, 0))
    return tok, m < n[:, None], n


def _rule_graph(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    states: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor, cu_seqlens: torch.Tensor | None,
    static_len: int | None, store: bool, saves: InnerSaves | None = None,
) -> torch.Tensor:
    """gated_delta_prefill (store) or _verify in a graph: the rule token by token
    over every sequence at once, masked past each one's length; rows of no
    sequence (padding) get zeros; ``saves``: the state after each saved offset
    into its slot (a row without one rewrites its own slot, which the final
    store overwrites)."""
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta)
    n_tok = q.shape[0]
    tok, real, _ = _graph_tokens(cu_seqlens, n_tok, static_len)
    s = _start(states, slots, has_state)  # [B, Hv, dk, dv]
    out = torch.zeros((n_tok + 1, *vf.shape[1:]), dtype=v.dtype, device=v.device)  # row n_tok: a sink
    for m in range(tok.shape[1]):
        t = tok[:, m]  # [B]
        keep = real[:, m]
        s = torch.where(keep[:, None, None, None], _delta_step(s, kf[t], vf[t], gf[t], bf[t]), s)
        o = torch.einsum("bhk,bhkv->bhv", qf[t], s)
        out.index_copy_(0, torch.where(keep, t, n_tok), o.to(v.dtype))
        if saves is not None:
            for i in range(saves.per_seq):
                hit = (saves.slots[:, i] >= 0) & (saves.offsets[:, i] == m + 1) & keep
                _save_rows(states, torch.where(hit, saves.slots[:, i], slots), s)
    if store:
        states.index_copy_(0, slots, s.to(states.dtype))
    return out[:n_tok]


def _conv_graph(
    x: torch.Tensor, w: torch.Tensor, conv_states: torch.Tensor, slots: torch.Tensor,
    has_state: torch.Tensor, cu_seqlens: torch.Tensor | None, static_len: int | None, store: bool,
    saves: InnerSaves | None = None,
) -> torch.Tensor:
    """conv_prefill (store) or conv_verify in a graph: every sequence's window
    [state | its tokens, padded to static_len] at once; rows of no sequence get zeros;
    ``saves``: the window after each saved offset into its slot (a row without one
    rewrites its own slot, which the final store overwrites)."""
    width = w.shape[1] - 1
    n_tok = x.shape[0]
    tok, real, n = _graph_tokens(cu_seqlens, n_tok, static_len)
    start = _start(conv_states, slots, has_state).to(x.dtype)  # [B, C, W]
    new = torch.where(real[:, :, None], x[tok], torch.zeros((), dtype=x.dtype, device=x.device))  # [B, M, C]
    ext = torch.cat([start, new.transpose(1, 2)], dim=2)  # [B, C, W + M]
    y = F.conv1d(ext.to(w.dtype), w[:, None, :], groups=w.shape[0])  # [B, C, M]
    out = torch.zeros((n_tok + 1, x.shape[1]), dtype=x.dtype, device=x.device)  # row n_tok: a sink
    rows = torch.where(real, tok, n_tok).reshape(-1)
    out.index_copy_(0, rows, F.silu(y).transpose(1, 2).reshape(-1, x.shape[1]).to(x.dtype))
    if saves is not None:
        for i in range(saves.per_seq):
            off = saves.offsets[:, i].clamp(min=0, max=static_len)
            pick = off[:, None] + torch.arange(width, device=x.device)  # [B, W]: ext[off : off + W]
            win = ext.gather(2, pick[:, None, :].expand(-1, ext.shape[1], -1))
            _save_rows(conv_states, torch.where(saves.slots[:, i] >= 0, saves.slots[:, i], slots), win)
    if store:
        pick = n[:, None] + torch.arange(width, device=x.device)  # [B, W]: ext[n : n + W]
        win = ext.gather(2, pick[:, None, :].expand(-1, ext.shape[1], -1))
        conv_states.index_copy_(0, slots, win.to(conv_states.dtype))
    return out[:n_tok]


def _layer_start(states: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor) -> torch.Tensor:
    """[L, S+1, ...] pool tensors -> the slots' states [L, B, ...] (zeros without a prefix)."""
    s = states.index_select(1, slots)
    keep = has_state.reshape(1, -1, *([1] * (s.dim() - 2)))
    return torch.where(keep, s, torch.zeros((), dtype=s.dtype, device=s.device))


def conv_commit(
    x: torch.Tensor, conv_states: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor,
    starts: torch.Tensor, kept: torch.Tensor, max_kept: int,
) -> None:
    """Every linear layer at once: x [L, T, C], the conv inputs a verify step
    logged; conv_states [L, S+1, C, K-1]. Sequence b's window in slots[b] moves
    on by its tokens starts[b] .. starts[b] + kept[b] - 1 (kept [B] on the
    device, 1 <= kept[b] <= max_kept, a host bound), as conv_decode steps over
    them would leave it."""
    n_layers, n_tok, _ = x.shape
    width = conv_states.shape[-1]
    old = _layer_start(conv_states, slots, has_state).to(x.dtype)  # [L, B, C, W]
    steps = torch.arange(max_kept, device=x.device)
    tok = (starts[:, None].long() + steps).clamp(max=n_tok - 1)  # [B, M]; past kept: never picked
    new = x[:, tok].transpose(-1, -2)  # [L, B, C, M]
    ext = torch.cat([old, new], dim=-1)  # window positions: [0, W) the old window, W + j token j
    pick = kept[:, None].long() + torch.arange(width, device=x.device)  # [B, W]: ext[kept : kept + W]
    win = ext.gather(-1, pick[None, :, None, :].expand(n_layers, -1, ext.shape[2], -1))
    conv_states.index_copy_(1, slots, win.to(conv_states.dtype))


def gated_delta_commit(
    k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, states: torch.Tensor,
    slots: torch.Tensor, has_state: torch.Tensor, starts: torch.Tensor, kept: torch.Tensor,
    max_kept: int,
) -> None:
    """Every linear layer at once: k [L, T, Hk, dk], v [L, T, Hv, dv], g, beta
    [L, T, Hv], the rule's inputs a verify step logged; states [L, S+1, Hv, dk, dv].
    Sequence b's state in slots[b] takes the updates of its tokens starts[b] ..
    starts[b] + kept[b] - 1, as gated_delta_decode steps would (a masked loop
    of max_kept steps: no host read of kept)."""
    n_tok = k.shape[1]
    rep = v.shape[-2] // k.shape[-2]
    s = _layer_start(states, slots, has_state).float()  # [L, B, Hv, dk, dv]
    for m in range(max_kept):
        t = (starts.long() + m).clamp(max=n_tok - 1)  # [B]
        kt = l2norm(k[:, t])  # [L, B, Hk, dk] fp32
        if rep > 1:
            kt = kt.repeat_interleave(rep, dim=-2)
        step = _delta_step(s, kt, v[:, t].float(), g[:, t].float(), beta[:, t].float())
        s = torch.where((m < kept).reshape(1, -1, 1, 1, 1), step, s)
    states.index_copy_(1, slots, s.to(states.dtype))
