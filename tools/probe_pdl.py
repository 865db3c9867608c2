"""What programmatic dependent launch (PDL) buys inside a CUDA graph on this
GPU, measured on synthetic chains (issue 5: batch-1 decode). CUDA sm_90+ only.

    python -m tools.probe_pdl --out probe_pdl.json

Three questions, each a graph replayed back to back (median us per replay):

1. launch gap: a chain of 64 tiny dependent kernels (132 programs, each reads
   the previous kernel's output): no PDL / wait-then-release / release-then-wait.
2. a latency-bound kernel (132 programs spinning ``--spin-us`` on the global
   timer, reading nothing) followed by an o_proj-shaped GEMV (N 2048, K 4096,
   16.8 MB of weights; 8 pairs over 8 weight copies, so weights come from HBM):
   the table's GEMV, and the whole-slice GEMV (every program loads its rows'
   full K before it waits, ``gemv_triton`` with ``preload``), with and without
   PDL. With PDL the spin kernel releases its dependants at its start, so the
   GEMV's weight reads can run under the spin.
3. two bandwidth-bound GEMVs back to back (a o_proj-shaped N 2048, K 4096, then a
   qkv-shaped N 5120, K 2048 with the residual add + RMSNorm prologue): the
   second preloading its weights while the first streams.

Every PDL variant's outputs are checked against the no-PDL outputs of the same
inputs (bit-identical: the same kernel with the launch attribute only).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from ftserve_kernels import gemv_triton as gv
from ftserve_kernels import pdl
from tools.bench_common import env_applied


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _tiny_kernel(src, dst, MODE: tl.constexpr):
    # MODE 0: no PDL; 1: wait, then release; 2: release, then wait.
    if MODE == 2:
        pdl.gdc_launch_dependents()
    if MODE != 0:
        pdl.gdc_wait()
    if MODE == 1:
        pdl.gdc_launch_dependents()
    i = tl.program_id(0)
    tl.store(dst + i, tl.load(src + i) + 1.0)


@triton.jit
def _spin_kernel(src, dst, ns, MODE: tl.constexpr):
    """Spins ns nanoseconds; then dst = src (bf16, 4096 values over the grid)."""
    if MODE == 2:
        pdl.gdc_launch_dependents()
    if MODE != 0:
        pdl.gdc_wait()
    if MODE == 1:
        pdl.gdc_launch_dependents()
    t0 = _now()
    while _now() - t0 < ns:
        pass
    i = tl.program_id(0)
    offs = i * 32 + tl.arange(0, 32)
    m = offs < 4096
    tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


def graph_us(fn: Callable[[], Any], replays: int = 200) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(replays + 1)]
    ev[0].record()
    for e in ev[1:]:
        g.replay()
        e.record()
    torch.cuda.synchronize()
    ms = [a.elapsed_time(b) for a, b in zip(ev, ev[1:])]
    del g
    return statistics.median(ms) * 1e3


def launch_gap(out: dict[str, Any]) -> None:
    n = 64
    bufs = [torch.zeros(132, device="cuda") for _ in range(2)]
    res = {}
    for mode, name in ((0, "no PDL"), (1, "wait, release"), (2, "release, wait")):
        def run(mode: int = mode) -> None:
            for i in range(n):
                _tiny_kernel[(132,)](bufs[i % 2], bufs[(i + 1) % 2], MODE=mode,
                                     **pdl.launch(mode))
        us = graph_us(run)
        res[name] = {"us_per_kernel": us / n, "graph_us": us}
        print(f"  tiny chain x{n}, {name:14s}: {us / n:6.2f} us per kernel", flush=True)
    out["launch_gap"] = res


def spin_then_gemv(out: dict[str, Any], spin_us: float) -> None:
    n, k, copies = 2048, 4096, 8
    g = torch.Generator(device="cuda").manual_seed(1)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
          for _ in range(copies)]
    src = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    xs = [torch.empty(1, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    ns = int(spin_us * 1e3)
    res: dict[str, Any] = {}
    ref: list[torch.Tensor] | None = None
    for name, preload, mode in (("table GEMV", False, 0), ("table GEMV, PDL", False, 1),
                                ("whole-slice GEMV", True, 0), ("whole-slice GEMV, PDL", True, 1),
                                ("spin only", None, 0)):
        ys: list[torch.Tensor] = []

        def run(preload: bool | None = preload, mode: int = mode, ys: list = ys) -> None:
            ys.clear()
            for i in range(copies):
                _spin_kernel[(128,)](src, xs[i], ns, MODE=2 if mode else 0, **pdl.launch(mode))
                if preload is None:
                    continue
                with env_applied({"FTSERVE_PDL": str(mode)}):
                    ys.append(gv.gemv_triton(xs[i], ws[i], preload=preload)[0])
        try:
            us = graph_us(run)
        except Exception as exc:  # noqa: BLE001 - report and go on
            res[name] = {"error": repr(exc)[:300]}
            print(f"  {name}: FAILED {exc!r}"[:300], flush=True)
            continue
        ok = None
        if ys:
            run()
            torch.cuda.synchronize()
            if ref is None:
                ref = [y.clone() for y in ys]
            ok = all(torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2) for a, b in zip(ys, ref))
        res[name] = {"us_per_pair": us / copies, "matches_table_gemv": ok}
        print(f"  spin {spin_us:4.1f} us + o_proj GEMV, {name:22s}: {us / copies:6.2f} us per pair"
              f" (ok {ok})", flush=True)
    out[f"spin_then_gemv_{spin_us:g}us"] = res


def gemv_then_gemv(out: dict[str, Any]) -> None:
    copies = 4
    g = torch.Generator(device="cuda").manual_seed(2)
    w1 = [torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
          for _ in range(copies)]
    w2 = [torch.randn(5120, 2048, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
          for _ in range(copies)]
    nw = 1 + 0.1 * torch.randn(2048, device="cuda", dtype=torch.bfloat16, generator=g)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    r = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16, generator=g)
    res: dict[str, Any] = {}
    ref: list[torch.Tensor] | None = None
    for name, preload, mode in (("table GEMVs", False, 0), ("table GEMVs, PDL", False, 1),
                                ("whole-slice GEMVs", True, 0), ("whole-slice GEMVs, PDL", True, 1)):
        ys: list[torch.Tensor] = []

        def run(preload: bool = preload, mode: int = mode, ys: list = ys) -> None:
            ys.clear()
            with env_applied({"FTSERVE_PDL": str(mode)}):
                for i in range(copies):
                    h = gv.gemv_triton(x, w1[i], preload=preload)[0]
                    ys.append(gv.gemv_triton(h, w2[i], None, nw, r, preload=preload)[0])
        try:
            us = graph_us(run)
        except Exception as exc:  # noqa: BLE001
            res[name] = {"error": repr(exc)[:300]}
            print(f"  {name}: FAILED {exc!r}"[:300], flush=True)
            continue
        run()
        torch.cuda.synchronize()
        if ref is None:
            ref = [y.clone() for y in ys]
        ok = all(torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2) for a, b in zip(ys, ref))
        res[name] = {"us_per_pair": us / copies, "matches": ok}
        print(f"  first + qkv-shaped GEMV, {name:24s}: {us / copies:6.2f} us per pair (ok {ok})",
              flush=True)
    # each GEMV alone, for the sum
    for name, preload in (("table", False), ("whole-slice", True)):
        a = graph_us(lambda p=preload: [gv.gemv_triton(x, w1[i], preload=p) for i in range(copies)])
        b = graph_us(lambda p=preload: [gv.gemv_triton(r, w2[i], None, nw, r, preload=p)
                                        for i in range(copies)])
        res[f"{name} alone"] = {"first_us": a / copies, "qkv_us": b / copies}
        print(f"  alone ({name}): first {a / copies:6.2f} us, qkv-shaped {b / copies:6.2f} us",
              flush=True)
    out["gemv_then_gemv"] = res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="probe_pdl.json")
    p.add_argument("--spin-us", default="0,8")
    args = p.parse_args()
    out: dict[str, Any] = {"device": torch.cuda.get_device_name()}
    for step in (lambda: launch_gap(out),
                 *(lambda s=float(s): spin_then_gemv(out, s) for s in args.spin_us.split(",")),
                 lambda: gemv_then_gemv(out)):
        try:
            step()
        except Exception as exc:  # noqa: BLE001
            print(f"step failed: {exc!r}", flush=True)
            out.setdefault("errors", []).append(repr(exc)[:500])
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
