"""Helpers for driving a real Engine from tests (thread + asyncio loop), and
for checking a decode graph's step words as the engine reads them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ftserve.engine.engine import Engine
from ftserve.engine.messages import GenerateRequest, RequestOutput, TokenLogprob
from ftserve.engine.sampling_params import SamplingParams
from ftserve.kvcache.pool import KVPool
from ftserve.kvcache.state_pool import StatePool
from ftserve.models.forward_batch import build_forward_batch
from ftserve_kernels.paged_attention import TorchAttentionBackend


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)  # type: ignore[arg-type]


async def run_requests(
    engine: Engine, reqs: list[tuple[str, list[int], SamplingParams]],
    abort_after: dict[str, int] | None = None, timeout: float = 120.0,
    start_after: dict[str, str] | None = None,
) -> dict[str, list[RequestOutput]]:
    """Submit all requests, collect every output until each one finishes.
    ``start_after[rid] = other``: submit rid once other's first output arrived."""
    loop = asyncio.get_running_loop()
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid, _, _ in reqs}
    done = asyncio.Event()
    remaining = {rid for rid, _, _ in reqs}
    abort_after = abort_after or {}
    held = {rid: (ids, params) for rid, ids, params in reqs if rid in (start_after or {})}

    def on_outputs(batch: list[RequestOutput]) -> None:
        for o in batch:
            outs[o.request_id].append(o)
            for rid, trigger in (start_after or {}).items():
                if trigger == o.request_id and rid in held:
                    ids, params = held.pop(rid)
                    engine.submit(GenerateRequest(rid, ids, params, time.monotonic()))
            n = sum(len(x.new_token_ids) for x in outs[o.request_id])
            if o.request_id in abort_after and n >= abort_after[o.request_id]:
                engine.abort(o.request_id)
                abort_after.pop(o.request_id)
            if o.finished:
                assert o.request_id in remaining, f"{o.request_id} reported finished twice"
                remaining.discard(o.request_id)
        if not remaining:
            done.set()

    engine._loop, engine._on_outputs = loop, on_outputs
    if engine._thread is None:
        engine.start(loop, on_outputs)
    for rid, ids, params in reqs:
        if rid not in held:
            engine.submit(GenerateRequest(rid, ids, params, time.monotonic()))
    await asyncio.wait_for(done.wait(), timeout)
    return outs


def collect(engine: Engine, reqs: list[tuple[str, list[int], SamplingParams]],
            **kw: object) -> dict[str, list[RequestOutput]]:
    return asyncio.run(run_requests(engine, reqs, **kw))  # type: ignore[arg-type]


def tokens_of(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


@torch.inference_mode()
def reference_greedy(model: torch.nn.Module, mcfg: object, prompt: list[int], n: int) -> list[int]:
    """Plain full recompute: every step runs the whole sequence through a fresh pool."""
    seq = list(prompt)
    out: list[int] = []
    ps = 16
    pages_needed = (len(prompt) + n + ps - 1) // ps
    dtype = next(model.parameters()).dtype
    pool = KVPool(len(mcfg.kv_layers), pages_needed + 1, ps, mcfg.num_kv_heads,  # type: ignore[attr-defined]
                  mcfg.head_dim, dtype, "cpu")  # type: ignore[attr-defined]
    # A hybrid's linear layers: one state slot, started from zeros by every full recompute.
    states = StatePool.for_model(mcfg, 1, dtype) if mcfg.is_hybrid else None  # type: ignore[attr-defined,arg-type]
    backend = TorchAttentionBackend()
    for _ in range(n):
        pages = list(range(1, (len(seq) + ps - 1) // ps + 1))
        fb = build_forward_batch([seq], [0], [pages], pool, backend, state_pool=states,
                                 state_slots=[1] if states is not None else None)
        tok = int(model(fb)[0].argmax())
        out.append(tok)
        seq.append(tok)
    return out


@torch.inference_mode()
def reference_logprobs(model: torch.nn.Module, mcfg: object, prompt: list[int],
                       out: list[int]) -> torch.Tensor:
    """[len(out), V]: the model's log-probabilities of each next token while it
    writes ``out`` after ``prompt`` (one full forward of prompt + out[:-1])."""
    seq = list(prompt) + list(out[:-1])
    ps = 16
    n_pages = (len(seq) + ps - 1) // ps
    dtype = next(model.parameters()).dtype
    pool = KVPool(len(mcfg.kv_layers), n_pages + 1, ps, mcfg.num_kv_heads,  # type: ignore[attr-defined]
                  mcfg.head_dim, dtype, "cpu")  # type: ignore[attr-defined]
    fb = build_forward_batch([seq], [0], [list(range(1, n_pages + 1))], pool,
                             TorchAttentionBackend(), all_logits=True)
    return torch.log_softmax(model(fb)[len(prompt) - 1:].float(), dim=-1)


@dataclass
class GreedyTrace:
    """Greedy outputs of a batch of prompts with each token's top-k logprobs."""

    tokens: list[list[int]]
    logprobs: list[list[TokenLogprob]]


def run_greedy_logprobs(engine: Engine, prompts: list[list[int]], max_tokens: int,
                        top: int = 5) -> GreedyTrace:
    """All prompts at once through the engine's own step loop (EngineDriver),
    greedy, ``top`` logprobs per token."""
    from ftserve.engine.driver import EngineDriver

    drv = EngineDriver(engine)
    reqs = [drv.add(p, max_tokens, SamplingParams(temperature=0.0, logprobs=top)) for p in prompts]
    drv.run_all()
    assert all(r.finished for r in reqs)
    trace = GreedyTrace([list(r.output_ids) for r in reqs], [list(r.pending_logprobs) for r in reqs])
    assert all(len(t) == len(lp) == max_tokens for t, lp in zip(trace.tokens, trace.logprobs))
    return trace


def logprob_errors(trace: GreedyTrace, refs: list[torch.Tensor]) -> torch.Tensor:
    """|reported logprob - reference| of every (token, logprob) pair a trace
    reports: the chosen token and its top-k, at every position."""
    errs = [abs(v - float(ref[j, t]))
            for lps, ref in zip(trace.logprobs, refs) for j, lp in enumerate(lps)
            for t, v in ((lp.token_id, lp.logprob), *lp.top)]
    return torch.tensor(errs, dtype=torch.float64)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)


def assert_greedy_equal_up_to_ties(
    prompts: list[list[int]], want: GreedyTrace, got: GreedyTrace,
    reference: Callable[[list[int], list[int]], torch.Tensor],
    min_equal_rows: int, mean_slack: float = 2.0, max_slack: float = 3.0, floor: float = 0.005,
) -> str:
    """``got`` (a second low-precision path, e.g. speculative verify steps in
    bf16) computes the same greedy outputs as ``want`` (plain decoding), up to
    ties within rounding. Returns the measured errors.

    Two correct bf16 paths reduce in different orders, so where the top two
    tokens are near-tied their greedy tokens may differ, and the rows part
    there. ``reference`` (the same weights in fp32) tells rounding from a bug,
    with ``want``'s own distance from it as the measure of rounding:

    1. Each path's reported logprobs (chosen + top-k, every position, along its
       own tokens) are compared with the reference's; ``got``'s errors must be
       no larger than ``want``'s: mean <= mean_slack x want's + floor, max <=
       max_slack x want's + floor. Stale KV of rejected drafts, or wrong
       positions or pages, put later positions off by far more than rounding,
       whether a token flips or not. (A fault smaller than the rounding is
       below what any bf16 test sees: the fp32 CPU tests demand equal tokens.)
    2. Each row equals ``want``'s up to its first divergence d (if any), and
       there the two tokens a (want's) and b (got's) are near-tied: each is in
       the other path's top-k, and the reference's margin |lp(a) - lp(b)| is
       at most 2e, e the larger of the two paths' max errors. (The bound:
       want picked a, so lp_want(a) >= lp_want(b), each within e of the
       reference: lp(a) - lp(b) >= -2e; got picked b: lp(b) - lp(a) >= -2e.)
       A token taken from the wrong position's row is far down the other list.
    3. At least ``min_equal_rows`` rows are equal in full: near-ties are rare.
    """
    ref_want = [reference(p, t) for p, t in zip(prompts, want.tokens)]
    ref_got = [reference(p, t) for p, t in zip(prompts, got.tokens)]
    e_want, e_got = logprob_errors(want, ref_want), logprob_errors(got, ref_got)
    mean_w, max_w = float(e_want.mean()), float(e_want.max())
    mean_g, max_g = float(e_got.mean()), float(e_got.max())
    stats = (f"|logprob - fp32 reference|: plain mean {mean_w:.4f} max {max_w:.4f}, "
             f"other path mean {mean_g:.4f} max {max_g:.4f}")
    assert mean_g <= mean_slack * mean_w + floor and max_g <= max_slack * max_w + floor, stats
    tie = 2 * max(max_w, max_g)
    parted = []
    for i, (a, b) in enumerate(zip(want.tokens, got.tokens)):
        d = first_divergence(a, b)
        if d is None:
            continue
        parted.append((i, d))
        ta, tb = a[d], b[d]
        margin = abs(float(ref_want[i][d, ta] - ref_want[i][d, tb]))
        in_tops = (tb in {t for t, _ in want.logprobs[i][d].top}
                   and ta in {t for t, _ in got.logprobs[i][d].top})
        assert in_tops and margin <= tie, (
            f"row {i} parts at token {d}: plain {ta}, other {tb}; in each other's top-k: {in_tops}, "
            f"fp32 margin {margin:.4f} (tie bound {tie:.4f}); {stats}\nplain {a}\nother {b}")
    assert len(prompts) - len(parted) >= min_equal_rows, f"rows parted (row, token): {parted}; {stats}"
    return f"{stats}; rows parted at near-ties (row, token): {parted}"


def make_context_sensitive(model: torch.nn.Module, gain: float = 20.0) -> None:
    """Scale the attention output projections so greedy tokens depend on the context.

    Dummy weights (N(0, 0.02) projections, N(0, 1) embeddings) leave attention a
    tiny term next to the residual: the tiny models' greedy token is then a
    function of the last input token alone, and a test comparing tokens with the
    reference cannot see KV read from the wrong pages. With the gain, swapping
    two earlier prompt tokens changes most of the following greedy tokens.
    """
    with torch.no_grad():
        for name, p in model.named_parameters():
            # (a hybrid's linear-attention layers too: a wrong recurrent state must show;
            # fp8 projections scale through their block scales, the codes stay)
            if name.endswith(("self_attn.o_proj.weight_scale", "linear_attn.out_proj.weight_scale")) or (
                    name.endswith(("self_attn.o_proj.weight", "linear_attn.out_proj.weight"))
                    and p.dtype != torch.float8_e4m3fn):
                p.mul_(gain)
    refresh = getattr(model, "refresh_derived", None)
    if refresh is not None:  # the folded routers the captured graphs read
        refresh()


class _Direct:
    """Stands in for the event loop when the test thread runs the engine's steps."""

    def call_soon_threadsafe(self, fn: Callable[..., None], *args: object) -> None:
        fn(*args)


def drive(engine: Engine, reqs: list[tuple[str, list[int], SamplingParams]],
          abort_at_step: dict[str, int] | None = None,
          max_steps: int = 10_000) -> dict[str, list[RequestOutput]]:
    """Run requests on the calling thread (no engine thread), step by step: all
    are submitted before the first step, so the schedule is the same every run.
    ``abort_at_step[rid] = k``: abort rid just before step k (0-based)."""
    assert engine._thread is None, "drive() runs an engine whose thread never started"
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid, _, _ in reqs}

    def on_outputs(batch: list[RequestOutput]) -> None:
        for o in batch:
            assert not (outs[o.request_id] and outs[o.request_id][-1].finished), (
                f"{o.request_id} reported after it finished")
            outs[o.request_id].append(o)

    engine._loop, engine._on_outputs = _Direct(), on_outputs  # type: ignore[assignment]
    for rid, ids, params in reqs:
        engine.submit(GenerateRequest(rid, ids, params, time.monotonic()))
    pending = dict(abort_at_step or {})
    for step in range(max_steps):
        for rid in [r for r, k in pending.items() if k == step]:
            engine.abort(rid)
            pending.pop(rid)
        engine._drain_inbox(block=False)
        if not (engine.busy or pending):
            return outs
        engine._step()
    raise AssertionError(f"requests still running after {max_steps} steps")


def read_one_step_late(pending: list[tuple[int, Any]], step: int, h_out: Any, n: int) -> None:
    """An event after step ``step``; the step before's tokens checked behind
    its event, as the overlap scheduler reads them (tokens = 3 * input + 1,
    inputs = i + 1000 * step, in row step % 2 of the pinned pair ``h_out``)."""
    event = torch.cuda.Event()
    event.record()
    pending.append((step, event))
    if len(pending) == 2:
        s, ev = pending.pop(0)
        ev.synchronize()
        assert h_out[s % 2].tolist() == [(i + 1000 * s) * 3 + 1 for i in range(n)], s
