"""Helpers for driving a real Engine from tests (thread + asyncio loop)."""

from __future__ import annotations

import asyncio
import time

import torch

from ftserve.engine.engine import Engine
from ftserve.engine.messages import GenerateRequest, RequestOutput
from ftserve.engine.sampling_params import SamplingParams
from ftserve.kvcache.pool import KVPool
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
    pool = KVPool(mcfg.num_layers, pages_needed + 1, ps, mcfg.num_kv_heads,  # type: ignore[attr-defined]
                  mcfg.head_dim, dtype, "cpu")  # type: ignore[attr-defined]
    backend = TorchAttentionBackend()
    for _ in range(n):
        pages = list(range(1, (len(seq) + ps - 1) // ps + 1))
        fb = build_forward_batch([seq], [0], [pages], pool, backend)
        tok = int(model(fb)[0].argmax())
        out.append(tok)
        seq.append(tok)
    return out
