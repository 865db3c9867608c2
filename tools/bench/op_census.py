"""Census of the torch ops a decode step launches beside the Triton kernels.

On a GPU every torch op that is not a view or an allocation is a kernel launch
(a copy, a cast, an elementwise op, a reduction, a cuBLAS GEMM); at batch 1 each
costs a few microseconds of device time whatever it moves, so a decode step
that should be a handful of Triton launches a layer is measured here by what
else it runs. The census runs one decode forward of a hybrid model (Qwen3-Next)
under a TorchDispatchMode that logs every aten op, on the CPU:

    interpret   tiny-qwen3-next, dummy weights, the Triton kernels under
                TRITON_INTERPRET=1 (the ops inside an interpreted launch are the
                interpreter's, not the step's: they are not counted)
    meta        a real shape (qwen3-next-80b-a3b cut to --layers) on the meta
                device: the Triton launches are recorded and skipped, the torch
                ops run on shapes alone, so the bytes are the real shape's

    python -m tools.bench.op_census --meta --preset qwen3-next-80b-a3b --layers 8
    TRITON_INTERPRET=1 python -m tools.bench.op_census --vocab 512     # tiny-qwen3-next, interpreted

Bytes are what an op reads and writes (its tensor arguments and results; a
gather or scatter counts the rows it moves, not the whole table it indexes).
tests/test_op_census.py pins the count of non-Triton ops of a decode step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that launch nothing: allocations and metadata (views are told by their schema).
_FREE = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh", "detach",
         "alias", "set_", "resize_", "_unsafe_view"}
# Ops that read only the rows they pick (bytes: the result, twice) or write only the rows given.
_GATHERS = {"index_select", "embedding", "index", "gather", "_embedding_bag"}
_SCATTERS = {"index_copy_", "index_copy", "index_put_", "index_put", "scatter_", "scatter", "_index_put_impl_"}
_ROOTS = ("ftserve/", "ftserve_kernels/", "tools/", "tests/")


@dataclass
class Op:
    name: str  # aten op, e.g. "mul.Tensor"
    site: str  # the innermost ftserve frame that called it: file:line function
    shapes: list[list[int]]  # results
    dtypes: list[str]
    bytes: int


@dataclass
class Census:
    ops: list[Op] = field(default_factory=list)
    triton: list[str] = field(default_factory=list)  # launched kernels, in order

    @property
    def count(self) -> int:
        return len(self.ops)

    @property
    def bytes(self) -> int:
        return sum(o.bytes for o in self.ops)

    def by_site(self) -> list[tuple[str, str, int, int]]:
        """(op, site, calls, bytes) grouped, heaviest count first."""
        calls: Counter[tuple[str, str]] = Counter()
        nbytes: Counter[tuple[str, str]] = Counter()
        for o in self.ops:
            calls[(o.name, o.site)] += 1
            nbytes[(o.name, o.site)] += o.bytes
        return sorted(((n, s, c, nbytes[(n, s)]) for (n, s), c in calls.items()), key=lambda r: (-r[2], r[1]))

    def summary(self) -> dict[str, Any]:
        return {"torch_ops": self.count, "torch_bytes": self.bytes, "triton_launches": len(self.triton),
                "by_op": dict(Counter(o.name for o in self.ops).most_common()),
                "triton": dict(Counter(self.triton).most_common())}


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _site() -> str:
    for fr in reversed(traceback.extract_stack()[:-3]):
        f = fr.filename.replace(os.sep, "/")
        if any(r in f for r in _ROOTS) and "op_census" not in f:
            root = next(r for r in _ROOTS if r in f)
            return f"{root}{f.split(root, 1)[1]}:{fr.lineno} {fr.name}"
    return "?"


class _Log(TorchDispatchMode):
    def __init__(self, census: Census, depth: list[int]) -> None:
        super().__init__()
        self.census = census
        self.depth = depth

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.depth[0] or func.is_view:
            return out
        base = func.overloadpacket.__name__
        if base in _FREE:
            return out
        res = list(_tensors(out))
        if base in _GATHERS:
            moved = 2 * sum(map(_nbytes, res))
        elif base in _SCATTERS:
            src = [t for t in _tensors(args[1:]) if t.is_floating_point()]
            moved = 2 * sum(map(_nbytes, src))
        else:
            ins = {id(t): t for t in _tensors((args, kwargs))}
            outs = [t for t in res if id(t) not in ins]  # an in-place op's result is its input
            moved = sum(map(_nbytes, ins.values())) + sum(map(_nbytes, outs))
        name = f"{base}.{func._overloadname}"
        self.census.ops.append(Op(name, _site(), [list(t.shape) for t in res], [str(t.dtype) for t in res],
                                  moved))
        return out


@contextlib.contextmanager
def census(skip_launches: bool = False) -> Iterator[Census]:
    """Log the torch ops run inside the block (Census.ops) and the Triton
    launches (Census.triton; interpreted ones, and with ``skip_launches``
    compiled ones too). ``skip_launches``: record the launches without running
    them (meta tensors)."""
    from triton.runtime import interpreter, jit

    result = Census()
    depth = [0]
    interpreted, compiled = interpreter.GridExecutor.__call__, jit.JITFunction.run

    def run_interpreted(self: Any, *args: Any, **kwargs: Any) -> Any:
        result.triton.append(self.fn.__name__)
        if skip_launches:
            return None
        depth[0] += 1  # the interpreter's own torch ops are not the step's
        try:
            return interpreted(self, *args, **kwargs)
        finally:
            depth[0] -= 1

    def run_compiled(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not skip_launches:
            result.triton.append(self.fn.__name__)
            return compiled(self, *args, **kwargs)
        result.triton.append(self.fn.__name__)
        return None

    interpreter.GridExecutor.__call__ = run_interpreted  # type: ignore[method-assign]
    jit.JITFunction.run = run_compiled  # type: ignore[method-assign]
    try:
        with _Log(result, depth):
            yield result
    finally:
        interpreter.GridExecutor.__call__ = interpreted  # type: ignore[method-assign]
        jit.JITFunction.run = compiled  # type: ignore[method-assign]


# ----------------------------------------------------------------- the hybrid decode step


def hybrid_decode_step(preset: str = "tiny-qwen3-next", layers: int | None = None, device: str = "cpu",
                       dtype: torch.dtype = torch.bfloat16, context: int = 9, batch: int = 1,
                       overrides: dict[str, Any] | None = None) -> tuple[Callable[[], torch.Tensor], Any]:
    """(one decode forward of ``batch`` sequences ``context`` tokens in, its model):
    the model built with uninitialized weights on ``device`` (meta: shapes only),
    the Triton kernels and attention backend. On a real device the weights are
    random and the state a short prefill left."""
    from ftserve.kvcache.pool import KVPool
    from ftserve.kvcache.state_pool import StatePool
    from ftserve.models.checkpoint import preset_config
    from ftserve.models.config import ModelConfig
    from ftserve.models.forward_batch import build_forward_batch
    from ftserve.models.loader import build_model
    from ftserve_kernels.attention_triton import TritonAttentionBackend
    from ftserve_kernels.config import KernelConfig

    cfg = ModelConfig.from_hf(preset_config(preset, layers=layers, overrides=overrides))
    model = build_model(cfg, dtype, torch.device(device))
    if device != "meta":
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
            model.init_buffers()
    page = 16
    per_seq = (context + page) // page + 1
    pages = [list(range(1 + b * per_seq, 1 + (b + 1) * per_seq)) for b in range(batch)]
    kv = KVPool(len(cfg.kv_layers), batch * per_seq + 1, page, cfg.num_kv_heads, cfg.head_dim, dtype, device)
    states = StatePool.for_model(cfg, batch + 1, dtype, torch.float32, device)
    slots = [states.alloc() for _ in range(batch)]
    backend = TritonAttentionBackend()
    kernels = KernelConfig(backend="triton", pdl=False)
    if device != "meta":  # a prefill leaves real state and KV
        pre = build_forward_batch([list(range(3, 3 + context))] * batch, [0] * batch, pages, kv, backend,
                                  device=device, state_pool=states, state_slots=slots, kernels=kernels)
        model(pre)
    step = build_forward_batch([[7]] * batch, [context] * batch, pages, kv, backend, is_decode=True,
                               device=device, state_pool=states, state_slots=slots, kernels=kernels)
    return (lambda: model(step)), model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny-qwen3-next")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--meta", action="store_true", help="shapes only (real presets): launches recorded, not run")
    p.add_argument("--vocab", type=int, default=None, help="a smaller vocabulary (the interpreted lm_head is slow)")
    p.add_argument("--out", default=None, help="JSON: the summary and every op")
    args = p.parse_args()
    if not args.meta and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1: the kernels interpreted on the CPU (or --meta)")
    step, _ = hybrid_decode_step(args.preset, args.layers, "meta" if args.meta else "cpu", batch=args.batch,
                                 overrides={"vocab_size": args.vocab} if args.vocab else None)
    with torch.no_grad():
        with census(skip_launches=args.meta):
            step()  # a first step makes what layers keep between steps (the routers' counters)
        with census(skip_launches=args.meta) as c:
            step()
    s = c.summary()
    print(f"{args.preset} x {args.layers or 'all'} layers, batch {args.batch}: {s['torch_ops']} torch ops, "
          f"{s['torch_bytes'] / 1e6:.2f} MB; {s['triton_launches']} Triton launches")
    print(f"{'calls':>5} {'MB':>8}  op  site")
    for name, site, calls, nbytes in c.by_site():
        print(f"{calls:5d} {nbytes / 1e6:8.3f}  {name}  {site}")
    print("triton:", s["triton"])
    if args.out:
        Path(args.out).write_text(json.dumps({**s, "ops": [asdict(o) for o in c.ops]}, indent=1))


if __name__ == "__main__":
    main()
