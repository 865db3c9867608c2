"""Gated DeltaNet kernels at Qwen3-Next-80B's shapes (16 key / 32 value heads of
128, conv over 8192 channels of window 3, bf16 activations, fp32 state pool):
ftserve's Triton kernels (ftserve_kernels/gated_delta_triton.py) against
flash-linear-attention's (``fla-core``, when importable) behind the same seam,
and the torch reference, each read against the limits measured in the same run.

Usage (CUDA; `--smoke`: tiny shapes on the CPU through the interpreter, for CI):
    python -m tools.bench.gated_delta --out bench_gated_delta.json

fla-core is no dependency of ftserve: to compare it on a box without the index,
carry its wheel and einops' and put them on the path first (see the device notes
on carrying wheels). Its absence is recorded, not an error.

Sections:
- prefill: packed chunks of ``--prefill-tokens`` tokens split into 1, 4 and 16
  sequences (``--layouts``), every sequence continuing a state from its slot.
  fla runs behind our seam: the slots' states gathered into its initial_state,
  its final states scattered back (that copy is part of what it would cost us).
  Reported: device ms, % of the bf16 matmul rate for the chunked algorithm's
  matmul FLOPs (``chunk_flops``, one count for every candidate), % of the HBM
  roofline for the bytes every candidate must move (``prefill_bytes``).
- decode: one token for each of ``--batches`` sequences, slots scattered over a
  pool of ``--slots``, timed as CUDA-graph replay (how the engine runs decode);
  reported against the HBM roofline of reading and writing each state once.
- conv: the short conv's prefill and decode against their HBM rooflines.

The Triton rows also sweep the launch shapes (LOCAL_WARPS, SCAN_SHAPES, the
decode V block; ``--no-sweep`` skips them): the fastest correct one is what
gated_delta_triton's constants and decode_block_v should say.

Every timed candidate is first compared with the torch reference (fp32 math
over the same bf16 inputs): max abs error of the outputs and of the states.
Every candidate also runs once under ``torch.cuda.set_sync_debug_mode("error")``
(column sync-free: whether it did so without a host sync).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch

from tools.bench.common import (
    machine_info,
    markdown_table,
    measure_copy_gbps,
    measure_matmul_tflops,
    say,
)

CHUNK = 64


class Shape:
    def __init__(self, hk: int, hv: int, dk: int, dv: int, conv_dim: int, width: int) -> None:
        self.hk, self.hv, self.dk, self.dv, self.conv_dim, self.width = hk, hv, dk, dv, conv_dim, width


QWEN3_NEXT_80B = Shape(16, 32, 128, 128, 2 * 16 * 128 + 32 * 128, 3)
TINY = Shape(2, 4, 16, 16, 2 * 2 * 16 + 4 * 16, 3)


def chunk_flops(tokens: int, s: Shape) -> float:
    """Matmul FLOPs of the chunked gated delta rule, per value head and chunk of C:
    K K^T and Q K^T (2 x 2C^2 dk), the triangular system's products with V and K
    (2C^2 (dk + dv)), the state's products K S, Q S and K^T U (3 x 2C dk dv) and
    the intra-chunk attention times U (2C^2 dv). Whole chunks, every candidate alike."""
    c = CHUNK
    per_chunk = 4 * c * c * s.dk + 2 * c * c * (s.dk + s.dv) + 6 * c * s.dk * s.dv + 2 * c * c * s.dv
    return per_chunk * s.hv * tokens / c


def prefill_bytes(tokens: int, seqs: int, s: Shape, elem: int = 2) -> float:
    """What any implementation reads and writes once: q, k, v, beta (elem bytes), g
    (fp32), the output, and each sequence's fp32 state read and written."""
    per_token = (2 * s.hk * s.dk + 2 * s.hv * s.dv + s.hv) * elem + 4 * s.hv
    return tokens * per_token + seqs * 2 * s.hv * s.dk * s.dv * 4


def decode_bytes(batch: int, s: Shape, elem: int = 2) -> float:
    return batch * (2 * s.hv * s.dk * s.dv * 4 + (2 * s.hk * s.dk + 2 * s.hv * s.dv + s.hv) * elem + 4 * s.hv)


def conv_bytes(tokens: int, seqs: int, s: Shape, elem: int = 2) -> float:
    """x read and the output written per token; each sequence's window read and written."""
    return tokens * 2 * s.conv_dim * elem + seqs * 2 * s.conv_dim * s.width * elem


# ----------------------------------------------------------------- inputs


def rule_inputs(tokens: int, s: Shape, device: torch.device, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """q, k, v as the layer's split leaves them (column views of one row), g, beta."""
    g = torch.Generator(device=device).manual_seed(seed)
    mixed = torch.randn(tokens, 2 * s.hk * s.dk + s.hv * s.dv, device=device, generator=g).to(dtype)
    q, k, v = mixed.split([s.hk * s.dk, s.hk * s.dk, s.hv * s.dv], dim=-1)
    a = torch.randn(tokens, s.hv, device=device, generator=g)
    logdecay = -torch.nn.functional.softplus(a - 2.0)  # the layer's form: -exp(A_log) * softplus(a + dt_bias)
    beta = torch.rand(tokens, s.hv, device=device, generator=g).to(dtype)
    return [q.reshape(tokens, s.hk, s.dk), k.reshape(tokens, s.hk, s.dk), v.reshape(tokens, s.hv, s.dv),
            logdecay, beta]


def pool_slots(batch: int, pool: int, device: torch.device, seed: int) -> torch.Tensor:
    """``batch`` distinct slots scattered over [1, pool] (slot 0 is the sink)."""
    return (torch.randperm(pool, generator=torch.Generator().manual_seed(seed))[:batch] + 1).to(device)


# ----------------------------------------------------------------- candidates


def fla_ops() -> Any:
    try:
        from fla.ops.gated_delta_rule import (
            chunk_gated_delta_rule,
            fused_recurrent_gated_delta_rule,
        )
    except Exception as exc:  # noqa: BLE001 - recorded: fla is optional
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def _start(states: torch.Tensor, slots: torch.Tensor, has: torch.Tensor) -> torch.Tensor:
    s = states.index_select(0, slots)
    return torch.where(has[:, None, None, None], s, torch.zeros((), dtype=s.dtype, device=s.device))


def fla_prefill(chunk_fn: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                g: torch.Tensor, beta: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                has: torch.Tensor, cu64: torch.Tensor, cu_cpu: torch.Tensor) -> torch.Tensor:
    """fla's chunked rule behind our seam: gather the slots' states, run, scatter back."""
    o, final = chunk_fn(q[None], k[None], v[None], g[None], beta[None], scale=q.shape[-1] ** -0.5,
                        initial_state=_start(states, slots, has), output_final_state=True,
                        cu_seqlens=cu64, cu_seqlens_cpu=cu_cpu, use_qk_l2norm_in_kernel=True)
    states.index_copy_(0, slots, final.to(states.dtype))
    return o[0]


def fla_decode(rec_fn: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               g: torch.Tensor, beta: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
               has: torch.Tensor) -> torch.Tensor:
    o, final = rec_fn(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], scale=q.shape[-1] ** -0.5,
                      initial_state=_start(states, slots, has), output_final_state=True,
                      use_qk_l2norm_in_kernel=True)
    states.index_copy_(0, slots, final.to(states.dtype))
    return o[:, 0]


# Launch shapes the prefill sweep tries besides the module's own (gated_delta_triton's
# constants): chunk_local's warps, chunk_scan's (V block, warps, stages).
LOCAL_WARPS = (8, 16)
SCAN_SHAPES = ((32, 4, 2), (32, 8, 3), (16, 8, 2), (32, 8, 2), (64, 8, 2))


@contextmanager
def launch_constants(module: Any, **values: int) -> Iterator[None]:
    """The module's launch constants set to ``values`` inside the block."""
    saved = {k: getattr(module, k) for k in values}
    try:
        for k, v in values.items():
            setattr(module, k, v)
        yield
    finally:
        for k, v in saved.items():
            setattr(module, k, v)


def prefill_candidates(rule: list[torch.Tensor], slots: torch.Tensor, has: torch.Tensor, bounds: list[int],
                       fla: Any, args: argparse.Namespace) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """name -> fn(states) -> o, each running the packed prefill on a pool tensor;
    also the Triton kernels at the launch shapes args.local_warps and args.scan_shapes."""
    from ftserve_kernels import gated_delta as ref
    from ftserve_kernels import gated_delta_triton as tri

    cu = torch.tensor(bounds, dtype=torch.int32, device=slots.device)

    def triton_at(**consts: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def fn(st: torch.Tensor) -> torch.Tensor:
            with launch_constants(tri, **consts):
                return tri.gated_delta_prefill(*rule, st, slots, has, bounds, cu_seqlens=cu)
        return fn

    cands: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"triton": triton_at()}
    for w in args.local_warps:
        cands[f"triton local_warps={w}"] = triton_at(LOCAL_WARPS=w)
    for bv, w, st in args.scan_shapes:
        cands[f"triton scan={bv}/{w}/{st}"] = triton_at(SCAN_BLOCK_V=bv, SCAN_WARPS=w, SCAN_STAGES=st)
    if not isinstance(fla, str):
        cu64, cu_cpu = cu.long(), torch.tensor(bounds, dtype=torch.long)
        cands["fla"] = lambda st: fla_prefill(fla[0], *rule, st, slots, has, cu64, cu_cpu)
    if args.torch_times:
        cands["torch"] = lambda st: ref.gated_delta_prefill(*rule, st, slots, has, bounds)
    return cands


def decode_candidates(rule: list[torch.Tensor], slots: torch.Tensor, has: torch.Tensor, fla: Any,
                      args: argparse.Namespace) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    from ftserve_kernels import gated_delta as ref
    from ftserve_kernels import gated_delta_triton as tri

    cands: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "triton": lambda st: tri.gated_delta_decode(*rule, st, slots, has)}
    picked = tri.decode_block_v(slots.shape[0], rule[2].shape[1], rule[2].shape[2])
    for bv in args.block_vs:  # the V blocks decode_block_v did not pick
        if bv != picked:
            cands[f"triton block_v={bv}"] = partial(_tri_decode, tri.gated_delta_decode, rule, slots, has, bv)
    if not isinstance(fla, str):
        cands["fla"] = lambda st: fla_decode(fla[1], *rule, st, slots, has)
    if args.torch_times:
        cands["torch"] = lambda st: ref.gated_delta_decode(*rule, st, slots, has)
    return cands


def _tri_decode(fn: Callable[..., torch.Tensor], rule: list[torch.Tensor], slots: torch.Tensor,
                has: torch.Tensor, block_v: int, st: torch.Tensor) -> torch.Tensor:
    return fn(*rule, st, slots, has, block_v=block_v)


def _conv_prefill(fn: Callable[..., torch.Tensor], x: torch.Tensor, w: torch.Tensor, slots: torch.Tensor,
                  has: torch.Tensor, bounds: list[int], cu: torch.Tensor, st: torch.Tensor) -> torch.Tensor:
    return fn(x, w, st, slots, has, bounds, cu_seqlens=cu)


def _conv_decode(fn: Callable[..., torch.Tensor], x: torch.Tensor, w: torch.Tensor, slots: torch.Tensor,
                 has: torch.Tensor, st: torch.Tensor) -> torch.Tensor:
    return fn(x, w, st, slots, has)


# ----------------------------------------------------------------- timing


def eager_time(fn: Callable[[], Any], device: torch.device, iters: int) -> float:
    """Median device seconds of fn (CUDA events; wall time on the CPU)."""
    fn()
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    from tools.bench.kernel_harness import bench

    return bench(fn, iters=iters, warmup=2)


def graph_time(fn: Callable[[], Any], device: torch.device, iters: int) -> tuple[float, str]:
    """CUDA-graph replay seconds per call, or eager where the call cannot be captured."""
    if device.type != "cuda":
        return eager_time(fn, device, iters), "eager"
    from tools.bench.kernel_harness import bench_graph

    try:
        return bench_graph(fn, replays=max(iters, 20)), "graph"
    except Exception as exc:  # noqa: BLE001 - not capturable: time it eagerly, say so
        torch.cuda.synchronize()
        say(f"  capture failed ({type(exc).__name__}: {str(exc)[:120]}); eager")
        return eager_time(fn, device, iters), "eager"


def sync_clean(fn: Callable[[], Any], device: torch.device) -> bool | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        ok = True
    except RuntimeError:
        ok = False
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return ok


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


# ----------------------------------------------------------------- sections


def bench_prefill(args: argparse.Namespace, s: Shape, device: torch.device, limits: dict[str, float],
                  fla: Any) -> list[dict[str, Any]]:
    from ftserve_kernels import gated_delta as ref

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for nseq in args.layouts:
        tokens = args.prefill_tokens
        lens = [tokens // nseq + (1 if i < tokens % nseq else 0) for i in range(nseq)]
        bounds = [0]
        for n in lens:
            bounds.append(bounds[-1] + n)
        q, k, v, g, beta = rule_inputs(tokens, s, device, dtype, seed=nseq)
        slots = pool_slots(nseq, args.slots, device, seed=nseq)
        has = torch.ones(nseq, dtype=torch.bool, device=device)
        base = torch.randn(args.slots + 1, s.hv, s.dk, s.dv, device=device) * 0.1
        want = base.clone()
        o_ref = ref.gated_delta_prefill(q, k, v, g, beta, want, slots, has, bounds)
        flops, nbytes = chunk_flops(tokens, s), prefill_bytes(tokens, nseq, s, q.element_size())
        for name, fn in prefill_candidates([q, k, v, g, beta], slots, has, bounds, fla, args).items():
            row: dict[str, Any] = {"section": "prefill", "candidate": name, "seqs": nseq, "tokens": tokens}
            try:
                st = base.clone()
                o = fn(st)
                row.update(err_out=_err(o, o_ref), err_state=_err(st, want))
                st = base.clone()
                t = eager_time(partial(fn, st), device, args.iters)
                row.update(ms=t * 1e3, of_matmul=flops / t / (limits["tflops"] * 1e12),
                           of_hbm=nbytes / t / (limits["gbps"] * 1e9))
                row["sync_clean"] = sync_clean(partial(fn, st), device)
            except Exception as exc:  # noqa: BLE001 - one candidate's failure is a result
                row["failed"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(row)
            say(json.dumps(row))
    return rows


def bench_decode(args: argparse.Namespace, s: Shape, device: torch.device, limits: dict[str, float],
                 fla: Any) -> list[dict[str, Any]]:
    from ftserve_kernels import gated_delta as ref

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for batch in args.batches:
        q, k, v, g, beta = rule_inputs(batch, s, device, dtype, seed=100 + batch)
        slots = pool_slots(batch, args.slots, device, seed=batch)
        has = torch.ones(batch, dtype=torch.bool, device=device)
        base = torch.randn(args.slots + 1, s.hv, s.dk, s.dv, device=device) * 0.1
        want = base.clone()
        o_ref = ref.gated_delta_decode(q, k, v, g, beta, want, slots, has)
        nbytes = decode_bytes(batch, s, q.element_size())
        for name, fn in decode_candidates([q, k, v, g, beta], slots, has, fla, args).items():
            row: dict[str, Any] = {"section": "decode", "candidate": name, "batch": batch}
            try:
                st = base.clone()
                o = fn(st)
                row.update(err_out=_err(o, o_ref), err_state=_err(st, want))
                t, how = graph_time(partial(fn, st), device, args.iters)
                row.update(us=t * 1e6, timed=how, of_hbm=nbytes / t / (limits["gbps"] * 1e9))
                row["sync_clean"] = sync_clean(partial(fn, st), device)
            except Exception as exc:  # noqa: BLE001
                row["failed"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(row)
            say(json.dumps(row))
    return rows


def bench_conv(args: argparse.Namespace, s: Shape, device: torch.device,
               limits: dict[str, float]) -> list[dict[str, Any]]:
    from ftserve_kernels import gated_delta as ref
    from ftserve_kernels import gated_delta_triton as tri

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(5)
    w = torch.randn(s.conv_dim, s.width + 1, device=device, generator=gen).to(dtype)
    rows = []
    cases: list[tuple[str, int, int]] = [("prefill", args.prefill_tokens, n) for n in args.layouts]
    cases += [("decode", b, b) for b in args.batches]
    for kind, tokens, nseq in cases:
        x = torch.randn(tokens, s.conv_dim, device=device, generator=gen).to(dtype)
        slots = pool_slots(nseq, args.slots, device, seed=nseq)
        has = torch.ones(nseq, dtype=torch.bool, device=device)
        base = torch.randn(args.slots + 1, s.conv_dim, s.width, device=device, generator=gen).to(dtype)
        lens = [tokens // nseq + (1 if i < tokens % nseq else 0) for i in range(nseq)]
        bounds = [0]
        for n in lens:
            bounds.append(bounds[-1] + n)
        cu = torch.tensor(bounds, dtype=torch.int32, device=device)
        want = base.clone()
        if kind == "prefill":
            o_ref = ref.conv_prefill(x, w, want, slots, has, bounds)
            run = partial(_conv_prefill, tri.conv_prefill, x, w, slots, has, bounds, cu)
        else:
            o_ref = ref.conv_decode(x, w, want, slots, has)
            run = partial(_conv_decode, tri.conv_decode, x, w, slots, has)
        row: dict[str, Any] = {"section": f"conv_{kind}", "candidate": "triton", "seqs": nseq, "tokens": tokens}
        try:
            st = base.clone()
            row.update(err_out=_err(run(st), o_ref), err_state=_err(st, want))
            st = base.clone()
            if kind == "prefill":
                t, how = eager_time(partial(run, st), device, args.iters), "eager"
            else:
                t, how = graph_time(partial(run, st), device, args.iters)
            row.update(us=t * 1e6, timed=how,
                       of_hbm=conv_bytes(tokens, nseq, s, x.element_size()) / t / (limits["gbps"] * 1e9),
                       sync_clean=sync_clean(partial(run, st), device))
        except Exception as exc:  # noqa: BLE001
            row["failed"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        rows.append(row)
        say(json.dumps(row))
    return rows


def report(rows: list[dict[str, Any]]) -> str:
    head = ["section", "candidate", "seqs/batch", "tokens", "time", "% matmul", "% HBM", "err out", "err state",
            "sync-free"]
    table = []
    for r in rows:
        t = f"{r['ms']:.3f} ms" if "ms" in r else (f"{r['us']:.1f} us ({r['timed']})" if "us" in r else "-")
        table.append([r["section"], r["candidate"], r.get("seqs", r.get("batch")), r.get("tokens"),
                      r.get("failed", t)[:60], 100 * r["of_matmul"] if "of_matmul" in r else None,
                      100 * r["of_hbm"] if "of_hbm" in r else None, r.get("err_out"), r.get("err_state"),
                      r.get("sync_clean")])
    return markdown_table(head, table)


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here; `--smoke` runs the CPU version")
    s = TINY if args.smoke else QWEN3_NEXT_80B
    results: dict[str, Any] = {"machine": machine_info(device), "args": vars(args)}
    mm = measure_matmul_tflops(device, 256 if args.smoke else 8192, 2 if args.smoke else 10,
                               torch.float32 if args.smoke else torch.bfloat16)
    copy = measure_copy_gbps(device, (16 << 20) if args.smoke else (2 << 30), 2 if args.smoke else 10)
    limits = {"tflops": mm["tflops"], "gbps": copy["gbps_read_plus_write"]}
    results["limits"] = limits
    say(f"limits: matmul {limits['tflops']:.0f} TFLOP/s, copy {limits['gbps']:.0f} GB/s")
    fla = fla_ops()
    results["fla"] = fla if isinstance(fla, str) else "imported"
    say(f"fla: {results['fla']}")
    rows = bench_prefill(args, s, device, limits, fla)
    rows += bench_decode(args, s, device, limits, fla)
    rows += bench_conv(args, s, device, limits)
    results["rows"] = rows
    results["report"] = report(rows)
    print(results["report"])
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    p.add_argument("--prefill-tokens", type=int, default=4096)
    p.add_argument("--layouts", type=ints, default=[1, 4, 16], help="sequences the prefill tokens split into")
    p.add_argument("--batches", type=ints, default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--slots", type=int, default=128, help="state pool slots (the batch's are scattered in it)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--torch-times", action="store_true", help="also time the torch reference")
    p.add_argument("--no-sweep", dest="sweep", action="store_false",
                   help="only the Triton kernels' own launch shapes (default: also the others in SCAN_SHAPES, ...)")
    p.add_argument("--out", default="bench_gated_delta.json")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, Triton interpreted (<30 s)")
    args = p.parse_args(argv)
    args.local_warps, args.scan_shapes, args.block_vs = (LOCAL_WARPS, SCAN_SHAPES, (16, 32, 64)) if args.sweep \
        else ((), (), ())
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module is imported
        args.prefill_tokens, args.layouts, args.batches, args.slots, args.iters = 80, [2], [2], 4, 1
        args.torch_times = True
        args.local_warps, args.scan_shapes, args.block_vs = (), SCAN_SHAPES[:1], (32,)  # one of each
    results = run(args)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2, default=str)
    return results


if __name__ == "__main__":
    main()
