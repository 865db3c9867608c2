"""Batch-1 decode pieces at qwen3-30b-a3b shapes: the fused kernels against the
launches they replace, as CUDA-graph replay times and fractions of the device
copy bandwidth measured in the same run (issue 5).

Usage (CUDA only): python -m tools.bench.decode_layer --out bench_decode_layer.json

Rows (each checked against its unfused twin before it is timed):
  route   fused_add_rms_norm + router F.linear + route_topk   vs  add_norm_route (one launch)
  qkv     F.linear(qkv) (its input normed)                    vs  gemv (block sweep)
  o_proj  F.linear                                            vs  gemv (block sweep)
  moe     fused_moe_gemv, block_n sweep
  lm_head F.linear(...).float()                               vs  gemv writing fp32
A config that fails its check or its launch is reported and skipped. Each timed
call cycles over enough weight copies (160 MB) that weights stream from HBM, as
they do in a decode step, not from an L2 warmed by the previous replay.
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
from tools.bench.kernel_harness import bench, bench_graph, rel_err

H, E, TOPK, INTER, QKV, Q, V = 2048, 128, 8, 768, 5120, 4096, 151_936
OUT: dict[str, Any] = {"rows": {}, "failed": {}}


L2_FLUSH_BYTES = 160 << 20  # > the H200's L2: rotating over this many weight bytes defeats it


def copies(nbytes: int) -> int:
    """How many weight copies a timed call cycles through so that, as in a real
    decode step, weights come from HBM and not from an L2 warmed by the last replay."""
    return max(1, -(-L2_FLUSH_BYTES // nbytes))


def rotate(fns: list[Callable[[], Any]]) -> Callable[[], Any]:
    def run() -> None:
        for f in fns:
            f()
    return run


def row(name: str, fn: Callable[[], Any], nbytes: float, copy_gbps: float, per: int = 1) -> None:
    """Times ``fn`` (``per`` calls of the kernel under test, over distinct weights)."""
    try:
        secs = bench_graph(fn, replays=10) / per
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
    nc = copies(E * H * 2)
    gws = [(torch.randn(E, H, device="cuda") / H**0.5).bfloat16() for _ in range(nc)]
    cnt = torch.zeros(1, dtype=torch.int32, device="cuda")

    def unfused(gw: torch.Tensor = gws[0]) -> tuple[torch.Tensor, torch.Tensor]:
        n, _ = nt.fused_add_rms_norm_triton(x, r, nw, 1e-6)
        return mt.route_topk_triton(F.linear(n, gw), TOPK, True)

    def fused(gw: torch.Tensor = gws[0]) -> tuple[torch.Tensor, torch.Tensor]:
        out = df.add_norm_route_triton(x, r, nw, 1e-6, gw, TOPK, True, cnt)
        return out[2], out[3]

    if check(f"route T={t}", rel_err(fused()[0], unfused()[0]), 5e-2):  # weights [T, k]
        nbytes = E * H * 2 + 3 * t * H * 2
        row(f"route T={t} [norm + F.linear + topk: 3 launches]",
            rotate([lambda g=g: unfused(g) for g in gws]), nbytes, bw, nc)
        row(f"route T={t} [add_norm_route: 1 launch]",
            rotate([lambda g=g: fused(g) for g in gws]), nbytes, bw, nc)


def bench_qkv_o(t: int, bw: float, blocks: list[tuple[int, int]]) -> None:
    x = torch.randn(t, H, device="cuda").bfloat16()
    nq, no = copies(QKV * H * 2), copies(H * Q * 2)
    wqkvs = [(torch.randn(QKV, H, device="cuda") / H**0.5).bfloat16() for _ in range(nq)]
    wos = [(torch.randn(H, Q, device="cuda") / Q**0.5).bfloat16() for _ in range(no)]
    xo = torch.randn(t, Q, device="cuda").bfloat16()

    ref = F.linear(x, wqkvs[0])
    row(f"qkv T={t} [cuBLAS]", rotate([lambda w=w: F.linear(x, w) for w in wqkvs]), QKV * H * 2, bw, nq)
    for blk in blocks:
        def fused(w: torch.Tensor, blk: tuple[int, int] = blk) -> torch.Tensor:
            return gv.gemv_triton(x, w, block=blk)

        try:
            err = rel_err(fused(wqkvs[0]), ref)
        except Exception as exc:
            OUT["failed"][f"qkv {blk}"] = str(exc)[:300]
            continue
        if check(f"qkv T={t} {blk}", err, 2e-2):
            row(f"qkv T={t} [gemv, block {blk}]",
                rotate([lambda w=w, blk=blk: fused(w, blk) for w in wqkvs]), QKV * H * 2, bw, nq)
    ref_o = F.linear(xo, wos[0])
    row(f"o_proj T={t} [cuBLAS]", rotate([lambda w=w: F.linear(xo, w) for w in wos]), H * Q * 2, bw, no)
    for blk in blocks:
        def go(w: torch.Tensor, blk: tuple[int, int] = blk) -> torch.Tensor:
            return gv.gemv_triton(xo, w, block=blk)

        try:
            err = rel_err(go(wos[0]), ref_o)
        except Exception as exc:
            OUT["failed"][f"o {blk}"] = str(exc)[:300]
            continue
        if check(f"o_proj T={t} {blk}", err, 2e-2):
            row(f"o_proj T={t} [gemv, block {blk}]",
                rotate([lambda w=w, blk=blk: go(w, blk) for w in wos]), H * Q * 2, bw, no)


def bench_moe(t: int, bw: float) -> None:
    x = torch.randn(t, H, device="cuda").bfloat16()
    w13 = (torch.randn(E, 2 * INTER, H, device="cuda") / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, INTER, device="cuda") / INTER**0.5).bfloat16()
    # Three routings over distinct experts: 3 x 75 MB per timed call, past the L2.
    perm = torch.randperm(E, device="cuda").to(torch.int32)
    routes = []
    for i in range(3):
        w_i, _ = mt.route_topk_triton(torch.randn(t, E, device="cuda"), TOPK, True)
        routes.append((w_i, perm[i * TOPK * t:(i + 1) * TOPK * t].reshape(t, TOPK).contiguous()))
    weights, ids = routes[0]
    nbytes = TOPK * t * 3 * INTER * H * 2  # distinct experts per token and per routing
    ref = mt.fused_moe_triton(x, w13, w2, weights, ids)  # the grouped GEMMs
    for bn in ((16, 8), (16, 4), (8, 8), (8, 16), (32, 8)):
        def run(bn: tuple[int, int] = bn,
                route: tuple[torch.Tensor, torch.Tensor] = routes[0]) -> torch.Tensor:
            return mg.fused_moe_gemv_triton(x, w13, w2, route[0], route[1], block_n=bn)

        name = f"moe gemv T={t} [block_n {bn}]"
        try:
            ok = check(name, rel_err(run(), ref), 1e-2)
        except Exception as exc:
            OUT["failed"][name] = str(exc)[:300]
            continue
        if ok:
            row(name, rotate([lambda run=run, rt=rt: run(route=rt) for rt in routes]), nbytes, bw,
                len(routes))


def bench_lm_head(t: int, bw: float) -> None:
    x = torch.randn(t, H, device="cuda").bfloat16()
    head = (torch.randn(V, H, device="cuda") / H**0.5).bfloat16()
    row(f"lm_head T={t} [F.linear + .float()]", lambda: F.linear(x, head).float(), V * H * 2, bw)
    got = gv.gemv_triton(x, head, out_dtype=torch.float32)
    if check(f"lm_head T={t} gemv", rel_err(got, F.linear(x, head).float()), 1e-2):
        row(f"lm_head T={t} [gemv writing fp32]",
            lambda: gv.gemv_triton(x, head, out_dtype=torch.float32), V * H * 2, bw)


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
