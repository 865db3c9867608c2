"""Device time per launch of a batch-1 decode fusion against the kernels it
replaces, at the qwen3-30b-a3b shape (bf16, random weights): each candidate is
captured 10 times back to back in one CUDA graph and replayed, so a time
includes one in-graph launch gap, as in the decode step. The weights are read
again and again, so GEMVs of up to ~50 MB run from L2 here (faster than in the
step, where 113 MB of other weights pass in between): compare like with like.

    python -m tools.probe_decode_fusions [OUT.json]

Rows: the MoE GEMVs plus the next input norm, against the down kernel with the
norm in its epilogue (moe_gemv_triton); qkv on cuBLAS and on the GEMV.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ftserve_kernels import gemv_configs as gc
from ftserve_kernels import gemv_triton as gv
from ftserve_kernels import moe_down_gemv_triton as md
from ftserve_kernels import moe_gemv_triton as mg
from ftserve_kernels import norm_triton as nt
from tools.bench_sampler import replay_us

H, Q, KV, E, TOP_K, INTER = 2048, 4096, 512, 128, 8, 768  # qwen3-30b-a3b
CHAIN = 10


def main() -> None:
    dev, bf = "cuda", torch.bfloat16
    torch.manual_seed(0)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device=dev) * scale).to(bf)

    r, nw = rnd(1, H), 1 + rnd(H, scale=0.1)
    wqkv = rnd(Q + 2 * KV, H, scale=H**-0.5)
    w13, w2 = rnd(E, 2 * INTER, H, scale=H**-0.5), rnd(E, H, INTER, scale=INTER**-0.5)
    cnt = torch.zeros(1, dtype=torch.int32, device=dev)
    weights = torch.full((1, TOP_K), 1.0 / TOP_K, device=dev)
    ids = torch.randperm(E, device=dev)[:TOP_K].to(torch.int32)[None, :]
    x = rnd(1, H)
    rows: dict[str, float] = {}

    def row(name: str, fn: Callable[[], Any]) -> None:
        rows[name] = us = replay_us(fn, reps=50, chain=CHAIN)
        print(f"{name}: {us:.2f} us", flush=True)

    row("fused_add_rms_norm", lambda: nt.fused_add_rms_norm_triton(x, r, nw, 1e-6))
    row("moe gemv (gate/up + down)", lambda: mg.fused_moe_gemv_triton(x, w13, w2, weights, ids))
    row("moe gemv + fused_add_rms_norm", lambda: nt.fused_add_rms_norm_triton(
        mg.fused_moe_gemv_triton(x, w13, w2, weights, ids), r, nw, 1e-6))
    row("moe gemv, norm in the down epilogue", lambda: mg.fused_moe_add_norm_gemv_triton(
        x, w13, w2, weights, ids, md.NormNext(r, nw, 1e-6, cnt)))
    row("qkv cuBLAS", lambda: F.linear(x, wqkv))
    row("qkv gemv (default launch)", lambda: gv.gemv_triton(x, wqkv))
    for bn, bk, warps in ((8, 512, 8), (16, 256, 8), (8, 256, 4), (16, 512, 8)):
        cfg = gc.GemvConfig(bn, bk, warps, 3)
        row(f"qkv gemv bn={bn} bk={bk} w={warps}", lambda cfg=cfg: gv.gemv_triton(x, wqkv, config=cfg))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows_us": rows}, f, indent=1)


if __name__ == "__main__":
    main()
