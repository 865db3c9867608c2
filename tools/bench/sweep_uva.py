"""How fast SM loads read pinned host memory over UVA (issue 6), against
cudaMemcpy's pinned host->device rate measured in the same run:

- ``fill``: the expert-cache row copy (moe.kernels.fill_rows) over chunk sizes
  and warps, copying 64 expert rows (a prefill-sized fallback / batch-8
  decode) and 3 rows (one layer's misses at batch-1 decode);
- ``read_through``: decode's expert GEMVs reading a layer's misses themselves
  (moe_read_through.ReadThrough), gate/up and down apart, over their launch
  parameters, at batch 1 with 3 of the 8 chosen experts missing; GB/s = the
  missed experts' bytes of that kernel / its time (the hits' HBM reads ride along).

Usage (CUDA): python -m tools.bench.sweep_uva --out sweep_uva.json [--budget-s 90]
       (CPU):  python -m tools.bench.sweep_uva --smoke   (tiny shapes, interpreter: a code check only)
"""

from __future__ import annotations

import argparse
import itertools
import time
from typing import Any

import torch

from tools.bench.common import markdown_table, measure_h2d_gbps, median_time, say, write_json

H, INTER, EXPERTS, TOP_K, MISSES = 2048, 768, 128, 8, 3


def sweep_fill(bank: torch.Tensor, device: torch.device, reps: int, deadline: float,
               grid: dict[str, list[Any]], row_counts: list[int]) -> list[dict[str, Any]]:
    from ftserve.moe.kernels import fill_rows

    slots = torch.empty(bank.shape[0] + 1, bank.shape[1], dtype=bank.dtype, device=device)
    rows_out = []
    for rows in row_counts:
        ids = torch.arange(rows, dtype=torch.int32, device=device)
        nbytes = rows * bank.shape[1] * bank.element_size()
        for words, warps in itertools.product(grid["block_words"], grid["warps"]):
            if time.perf_counter() > deadline:
                return rows_out
            slots.zero_()
            def fn(ids: torch.Tensor = ids, words: int = words, warps: int = warps) -> None:
                fill_rows(bank, slots, ids, ids, block_words=words, num_warps=warps)

            t = median_time(fn, device, reps)
            ok = bool(torch.equal(slots[:rows].cpu(), bank[:rows].cpu()))
            rows_out.append({"rows": rows, "block_words": words, "warps": warps,
                             "s": t, "gbps": nbytes / t / 1e9, "correct": ok})
    return rows_out


def sweep_read_through(bank: torch.Tensor, device: torch.device, reps: int, deadline: float,
                       h: int, inter: int, grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    from ftserve_kernels import gemv_configs as gc
    from ftserve_kernels import moe_down_gemv_triton as md
    from ftserve_kernels import moe_gemv_triton as mg
    from ftserve_kernels.moe_read_through import ReadThrough

    g = torch.Generator(device="cpu").manual_seed(0)
    r = bank.shape[1]
    s = 2 * TOP_K + 1
    slots = torch.zeros(s, r, dtype=bank.dtype, device=device)
    w13 = slots[:, : 2 * inter * h].view(s, 2 * inter, h)
    w2 = slots[:, 2 * inter * h:].view(s, h, inter)
    experts = bank.shape[0]
    chosen = torch.randperm(experts, generator=g)[:TOP_K]
    emap = torch.full((experts,), s - 1, dtype=torch.int32)
    emap[chosen] = torch.arange(TOP_K, dtype=torch.int32)
    emap = emap.to(device)
    ids = chosen.view(1, TOP_K).int().to(device)
    miss_slot = torch.full((TOP_K,), -1, dtype=torch.int32)
    miss_id = torch.full((TOP_K,), -1, dtype=torch.int32)
    miss_slot[:MISSES] = torch.arange(MISSES, dtype=torch.int32)
    miss_id[:MISSES] = chosen[:MISSES].int()
    rt = ReadThrough(bank, miss_slot.to(device), miss_id.to(device), 0, 2 * inter * h)
    x = torch.randn(1, h, generator=g).to(bank.dtype).to(device)
    act = torch.empty(TOP_K, inter, dtype=bank.dtype, device=device)
    out = torch.empty(1, h, dtype=bank.dtype, device=device)
    weights = torch.full((TOP_K,), 1.0 / TOP_K, device=device)
    flat = ids.reshape(-1)
    elem = bank.element_size()
    kinds = {"gate_up": (2 * inter * h * elem, grid["gate_up"]), "down": (h * inter * elem, grid["down"])}
    rows_out = []
    for kind, (per_expert, configs) in kinds.items():
        for bn, bk, warps, stages in configs:
            if time.perf_counter() > deadline:
                return rows_out
            cfg = gc.GemvConfig(bn, bk, warps, stages)
            if kind == "gate_up":
                def fn(cfg: gc.GemvConfig = cfg, rt: Any = rt) -> None:
                    mg.moe_gate_up_gemv(x, w13, act, flat, TOP_K, cfg, emap, rt)
            else:
                def fn(cfg: gc.GemvConfig = cfg, rt: Any = rt) -> None:
                    md.moe_down_gemv(act, w2, out, weights, flat, TOP_K, cfg, emap, rt)
            try:
                t = median_time(fn, device, reps)
            except Exception as exc:  # a launch that does not fit is reported, not fatal
                rows_out.append({"kernel": kind, "config": [bn, bk, warps, stages], "error": repr(exc)[:200]})
                continue
            rows_out.append({"kernel": kind, "config": [bn, bk, warps, stages], "s": t,
                             "miss_gbps": MISSES * per_expert / t / 1e9})
    return rows_out


def grids(smoke: bool) -> dict[str, Any]:
    if smoke:
        return {"fill": {"block_words": [64, 256], "warps": [4]}, "rows": [3],
                "gate_up": [(16, 16, 4, 1)], "down": [(16, 16, 4, 1)]}
    return {"fill": {"block_words": [2048, 4096, 8192, 16384], "warps": [4, 8, 16]},
            "rows": [64, 3],
            "gate_up": [(bn, bk, w, st) for bn in (8, 16, 32) for bk in (256, 512, 1024) for w in (4, 8)
                        for st in (1, 2)],
            "down": [(bn, bk, w, 2) for bn in (4, 8, 16, 32) for bk in (128, 256) for w in (4, 8)]}


def render(res: dict[str, Any]) -> str:
    h2d = res["h2d"].get("h2d_gbps")

    def frac(gbps: float | None) -> float | None:
        return gbps / h2d if gbps and h2d else None

    fill = sorted(res["fill"], key=lambda r: (r["rows"], -r["gbps"]))
    top_fill = [r for rows in {r["rows"] for r in fill} for r in [x for x in fill if x["rows"] == rows][:5]]
    rt = sorted([r for r in res["read_through"] if "s" in r], key=lambda r: (r["kernel"], r["s"]))
    top_rt = [r for k in ("down", "gate_up") for r in [x for x in rt if x["kernel"] == k][:6]]
    return (f"pinned H2D (cudaMemcpy): {h2d} GB/s\n\n"
            + markdown_table(["rows", "block words", "warps", "GB/s", "of H2D", "correct"],
                             [[r["rows"], r["block_words"], r["warps"], r["gbps"], frac(r["gbps"]),
                               r["correct"]] for r in top_fill])
            + "\n\n"
            + markdown_table(["kernel", "block_n, block_k, warps, stages", "us", "miss GB/s", "of H2D"],
                             [[r["kernel"], r["config"], r["s"] * 1e6, r["miss_gbps"], frac(r["miss_gbps"])]
                              for r in top_rt])
            + "\n")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="sweep_uva.json")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--budget-s", type=float, default=90.0)
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    deadline = time.perf_counter() + args.budget_s
    h, inter, experts = (32, 16, 8) if args.smoke else (H, INTER, EXPERTS)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    grid = grids(args.smoke)
    bank = torch.randn(max(experts, max(grid["rows"])), 3 * inter * h).to(dtype)
    if device.type == "cuda":
        bank = bank.pin_memory()
    res: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                           "h2d": measure_h2d_gbps(device, 1 << 30)}
    reps = 1 if args.smoke else 5
    # Half the budget each: the fill sweep must leave time for the GEMVs.
    mid = time.perf_counter() + (deadline - time.perf_counter()) / 2
    res["fill"] = sweep_fill(bank, device, reps, mid, grid["fill"], grid["rows"])
    say(f"fill: {len(res['fill'])} configs")
    res["read_through"] = sweep_read_through(bank[:experts], device, reps, deadline, h, inter, grid)
    say(f"read-through: {len(res['read_through'])} configs")
    write_json(args.out, res)
    print(render(res), flush=True)
    return res


if __name__ == "__main__":
    main()
