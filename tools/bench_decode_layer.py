"""Batch-1 decode pieces at qwen3-30b-a3b shapes: the fused kernels against the
launches they replace, as CUDA-graph replay times and fractions of the device
copy bandwidth measured in the same run (issue 5).

Usage (CUDA only): python -m tools.bench_decode_layer --out bench_decode_layer.json

Rows (each checked against its unfused twin before it is timed):
  route   fused_add_rms_norm + router F.linear + route_topk   vs  add_norm_route (one launch)
  qkv     fused_add_rms_norm + F.linear(qkv)                   vs  gemv with norm prologue
  o_proj  F.linear                                            vs  gemv (block sweep)
  moe     fused_moe_gemv: 2-D vs 3-D down kernel, block_n sweep
  lm_head F.linear(...).float()                               vs  mm with out_dtype fp32 (if supported)
A config that fails its check or its launch is reported and skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ftserve_kernels import decode_fused_triton as df
from ftserve_kernels import gemv_triton as gv
from ftserve_kernels import moe_gemv_triton as mg
from ftserve_kernels import moe_triton as mt
from ftserve_kernels import norm_triton as nt
from tools.bench_kernels import bench, bench_graph, rel_err

H, E, TOPK, INTER, QKV, Q, V = 2048, 128, 8, 768, 5120, 4096, 151_936
OUT: dict[str, Any] = {"rows": {}, "failed": {}}


def row(name: str, fn: Callable[[], Any], nbytes: float, copy_gbps: float) -> None:
    try:
        secs = bench_graph(fn)
    except Exception as exc:  # a config that does not compile must not hide the rest
        OUT["failed"][name] = f"{type(exc).__name__}: {exc}"[:300]
        print(f"{name:56s} FAILED {OUT['failed'][name]}")
        return
    gbps = nbytes / secs / 1e9
    OUT["rows"][name] = {"us": secs * 1e6, "gbps": gbps, "of_copy_bw": gbps / copy_gbps}
    print(f"{name:56s} {secs * 1e6:8.1f} us  {gbps:7.0f} GB/s  {gbps / copy_gbps:5.0%} of copy")


def check(name: str, err: float, tol: float) -> bool:
    ok = err < tol
    if not ok:
        OUT["failed"][name] = f"rel err {err:.2e} >= {tol}"
    print(f"  check {name}: {'ok' if ok else 'FAILED'} (rel err {err:.2e})")
    return ok


def bench_route(t: int, bw: float) -> None:
    x, r = (torch.randn(t, H, device="cuda").bfloat16() for _ in range(2))
    nw = torch.ones(H, device="cuda").bfloat16()
    gw = (torch.randn(E, H, device="cuda") / H**0.5).bfloat16()
    cnt = torch.zeros(1, dtype=torch.int32, device="cuda")

    def unfused() -> tuple[torch.Tensor, torch.Tensor]:
        n, _ = nt.fused_add_rms_norm_triton(x, r, nw, 1e-6)
        return mt.route_topk_triton(F.linear(n, gw), TOPK, True)

    def fused() -> tuple[torch.Tensor, torch.Tensor]:
        out = df.add_norm_route_triton(x, r, nw, 1e-6, gw, TOPK, True, cnt)
        return out[2], out[3]

    if check(f"route T={t}", rel_err(fused()[0], unfused()[0]), 5e-2):  # weights [T, k]
        nbytes = E * H * 2 + 3 * t * H * 2
        row(f"route T={t} [norm + F.linear + topk: 3 launches]", unfused, nbytes, bw)
        row(f"route T={t} [add_norm_route: 1 launch]", fused, nbytes, bw)


def bench_qkv_o(t: int, bw: float, blocks: list[tuple[int, int]]) -> None:
    x, r = (torch.randn(t, H, device="cuda").bfloat16() for _ in range(2))
    nw = torch.ones(H, device="cuda").bfloat16()
    wqkv = (torch.randn(QKV, H, device="cuda") / H**0.5).bfloat16()
    wo = (torch.randn(H, Q, device="cuda") / Q**0.5).bfloat16()
    xo = torch.randn(t, Q, device="cuda").bfloat16()

    def qkv_unfused() -> torch.Tensor:
        return F.linear(nt.fused_add_rms_norm_triton(x, r, nw, 1e-6)[0], wqkv)

    ref = qkv_unfused()
    row(f"qkv T={t} [norm + cuBLAS]", qkv_unfused, QKV * H * 2, bw)
    for blk in blocks:
        def fused(blk: tuple[int, int] = blk) -> torch.Tensor:
            return gv.gemv_triton(x, wqkv, None, nw, r, 1e-6, block=blk)[0]

        try:
            err = rel_err(fused(), ref)
        except Exception as exc:
            OUT["failed"][f"qkv {blk}"] = str(exc)[:300]
            continue
        if check(f"qkv T={t} {blk}", err, 2e-2):
            row(f"qkv T={t} [gemv + norm prologue, block {blk}]", fused, QKV * H * 2, bw)
    ref_o = F.linear(xo, wo)
    row(f"o_proj T={t} [cuBLAS]", lambda: F.linear(xo, wo), H * Q * 2, bw)
    for blk in blocks:
        def go(blk: tuple[int, int] = blk) -> torch.Tensor:
            return gv.gemv_triton(xo, wo, block=blk)[0]

        try:
            err = rel_err(go(), ref_o)
        except Exception as exc:
            OUT["failed"][f"o {blk}"] = str(exc)[:300]
            continue
        if check(f"o_proj T={t} {blk}", err, 2e-2):
            row(f"o_proj T={t} [gemv, block {blk}]", go, H * Q * 2, bw)


def bench_moe(t: int, bw: float) -> None:
    x = torch.randn(t, H, device="cuda").bfloat16()
    w13 = (torch.randn(E, 2 * INTER, H, device="cuda") / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, INTER, device="cuda") / INTER**0.5).bfloat16()
    weights, ids = mt.route_topk_triton(torch.randn(t, E, device="cuda"), TOPK, True)
    nbytes = len(set(ids.flatten().tolist())) * 3 * INTER * H * 2
    ref = mg.fused_moe_gemv_triton(x, w13, w2, weights, ids, down3d=False)
    variants = [(False, False, (16, 8))] + [(True, acc, bn) for acc in (False, True)
                                             for bn in ((16, 8), (16, 4), (8, 8), (8, 16), (32, 8))]
    for d3, acc, bn in variants:
        def run(d3: bool = d3, acc: bool = acc, bn: tuple[int, int] = bn) -> torch.Tensor:
            return mg.fused_moe_gemv_triton(x, w13, w2, weights, ids, block_n=bn, down3d=d3,
                                            gate_up_acc=acc)

        name = (f"moe gemv T={t} [{'acc' if acc else 'sum'} gate/up, "
                f"{'3-D' if d3 else '2-D'} down, block_n {bn}]")
        try:
            ok = check(name, rel_err(run(), ref), 1e-2)
        except Exception as exc:
            OUT["failed"][name] = str(exc)[:300]
            continue
        if ok:
            row(name, run, nbytes, bw)


def bench_lm_head(t: int, bw: float) -> None:
    x = torch.randn(t, H, device="cuda").bfloat16()
    head = (torch.randn(V, H, device="cuda") / H**0.5).bfloat16()
    row(f"lm_head T={t} [F.linear + .float()]", lambda: F.linear(x, head).float(), V * H * 2, bw)
    try:
        got = torch.mm(x, head.t(), out_dtype=torch.float32)  # type: ignore[call-arg]
    except (TypeError, RuntimeError) as exc:
        print(f"  mm out_dtype unsupported here: {exc}"[:200])
        return
    if check(f"lm_head T={t} out_dtype", rel_err(got, F.linear(x, head).float()), 1e-2):
        row(f"lm_head T={t} [mm out_dtype fp32]",
            lambda: torch.mm(x, head.t(), out_dtype=torch.float32),  # type: ignore[call-arg]
            V * H * 2, bw)


def copy_gbps() -> float:
    """Device copy bandwidth, read + write (the roofline bench_engine uses)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / bench(lambda: dst.copy_(src)) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_decode_layer needs CUDA", file=sys.stderr)
        return 2
    bw = copy_gbps()
    OUT["copy_gbps"] = bw
    OUT["device"] = torch.cuda.get_device_name()
    OUT["date"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    print(f"copy bandwidth (read + write) {bw:.0f} GB/s")
    blocks = [(16, 256), (8, 256), (32, 256), (4, 256), (8, 512), (16, 128)]
    for t in (1, 2):
        sections: list[tuple[str, Callable[[], None]]] = [
            ("route", lambda t=t: bench_route(t, bw)),  # type: ignore[misc]
            ("qkv_o", lambda t=t: bench_qkv_o(t, bw, blocks)),  # type: ignore[misc]
            ("moe", lambda t=t: bench_moe(t, bw)),  # type: ignore[misc]
            ("lm_head", lambda t=t: bench_lm_head(t, bw)),  # type: ignore[misc]
        ]
        for name, fn in sections:
            try:
                fn()
            except Exception as exc:
                OUT["failed"][f"{name} T={t}"] = f"{type(exc).__name__}: {exc}"[:300]
                print(f"section {name} T={t} FAILED: {exc}")
    bench_route(4, bw)
    with open(args.out, "w") as f:
        json.dump(OUT, f, indent=2)
    print(f"wrote {args.out}; failed: {list(OUT['failed']) or 'none'}")
    return 1 if OUT["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
