"""Batch-1 decode layers at the qwen3-30b-a3b shape: the one-launch layer kernel
(ftserve_kernels/decode_layer_triton.py) against the unfused layer, as CUDA
graph replay time per layer and as a fraction of the layer's HBM roofline
(its bytes over the copy bandwidth measured in the same run).

Usage (`--smoke`: tiny-moe on the CPU, the fused layer interpreted phase by
phase, for CI; otherwise CUDA):
    python -m tools.bench_decode_layer_kernel --contexts 2048,32768 \
        --configs "default;num_stages=3;attn_block_n=128" --out bench_decode_layer_kernel.json

Each point: ``--layers`` dummy-weight layers (so weights stream from HBM, not
from an L2 warmed by the layer before), one captured graph of all of them,
replayed back to back. Every fused config is first checked against the
unfused layers' output (relative error) and its sync words (zero, no barrier
timeout); a config that fails is reported and not timed.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from typing import Any

import torch

from ftserve.kvcache.pool import KVPool
from ftserve.models.forward_batch import build_forward_batch
from ftserve.models.loader import load_model
from ftserve_kernels import decode_layer_triton as dl
from ftserve_kernels.attention_triton import TritonAttentionBackend
from tools.bench_common import (
    env_applied,
    machine_info,
    measure_copy_gbps,
    median_time,
    say,
    sync,
    write_model_config,
)

PAGE = 16


def layer_bytes(cfg: Any, context: int, elem: int = 2) -> int:
    """Bytes one batch-1 layer reads: attention weights, router, top-k experts, KV."""
    h, d = cfg.hidden_size, cfg.head_dim
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * d * h
    o = cfg.num_heads * d * h
    experts = cfg.num_experts_per_tok * 3 * cfg.moe_intermediate_size * h
    kv = 2 * context * cfg.num_kv_heads * d
    return (qkv + o + cfg.num_experts * h + experts + kv) * elem


def parse_config(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if part == "default":
            continue
        name, _, value = part.partition("=")
        out[name.strip()] = int(value)
    return out


STAMPS = ["A work", "A barrier", "B work", "B barrier", "C work", "C barrier", "D work",
          "D barrier", "E work", "E barrier", "F work"]


def phase_times(model: Any, layers: Any, programs_per_sm: int) -> dict[str, float]:
    """One eager pass with timestamps (the last layer's launch): each phase's work
    (last program done minus last program released into it) and each barrier
    (last release minus last arrival), in microseconds."""
    grid = dl.num_programs(torch.device("cuda")) * programs_per_sm
    last = model.layers[-1]
    last.fused_timing = torch.zeros(grid, 16, dtype=torch.int64, device="cuda")
    try:
        layers()
        torch.cuda.synchronize()
        tm = last.fused_timing.double()
    finally:
        del last.fused_timing
    latest = tm[:, :12].max(0).values
    start = float(tm[:, 0].min())
    out: dict[str, float] = {"first program late": float(latest[0] - start) / 1e3}
    for i, name in enumerate(STAMPS, start=1):
        out[name] = float(latest[i] - latest[i - 1]) / 1e3
    out["total"] = float(latest[11] - start) / 1e3
    return out


def bench_context(model: Any, cfg: Any, backend: Any, context: int, args: argparse.Namespace,
                  results: dict[str, Any], deadline: float) -> None:
    """The unfused layers, then each fused config, at one context length."""
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    pages = [list(range(1, context // PAGE + 3))]
    pool = KVPool(cfg.num_layers, pages[0][-1] + 1, PAGE, cfg.num_kv_heads, cfg.head_dim,
                  model.embed_tokens.weight.dtype, device)
    for t in (*pool.k, *pool.v):
        t.normal_(0.0, 1.0)
    step = build_forward_batch([[11]], [context - 1], pages, pool, backend, is_decode=True)
    x0 = model.embed_tokens(step.input_ids)
    roof_us = layer_bytes(cfg, context) / (results["copy_gbps"] * 1e9) * 1e6

    def layers() -> torch.Tensor:
        x, r = x0, None
        for layer in model.layers:
            x, r, _ = layer(x, r, step, model.cos_sin)
        assert r is not None
        return x + r

    def timed_layers() -> float:
        """Seconds per layer: graph replay on CUDA, eager calls (interpreted) on the CPU."""
        if not cuda:
            return median_time(layers, device, args.iters, warmup=1) / cfg.num_layers
        g = graph_of()
        return median_time(g.replay, device, args.iters, warmup=3) / cfg.num_layers

    def graph_of() -> torch.cuda.CUDAGraph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            layers()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            layers()
        return g

    with torch.no_grad(), env_applied({"FTSERVE_DECODE_LAYER_KERNEL": "0"}):
        ref = layers().float()
        t = timed_layers()
    point = {"context": context, "config": "unfused", "us_per_layer": t * 1e6,
             "of_roofline": roof_us / (t * 1e6), "roofline_us": roof_us}
    results["points"].append(point)
    say(json.dumps(point))
    for text in args.configs.split(";"):
        if time.perf_counter() > deadline:
            say(f"budget spent: {text} skipped")
            break
        env = {"FTSERVE_DECODE_LAYER_KERNEL": "1", "FTSERVE_DECODE_LAYER_CFG": ",".join(
            f"{k}={v}" for k, v in parse_config(text).items())}
        if not cuda:
            env["FTSERVE_KERNELS"] = "triton"  # the interpreter (the unfused reference stays torch)
        point = {"context": context, "config": text}
        try:
            with torch.no_grad(), env_applied(env):
                t0 = time.perf_counter()
                got = layers().float()
                sync(device)
                point["first_call_s"] = time.perf_counter() - t0
                point["rel_err"] = float((got - ref).norm() / ref.norm())
                syncs = [layer._fused_sync.tolist() for layer in model.layers]
                point["sync_clean"] = all(not any(s) for s in syncs)
                kern = model.layers[0].fused_info.get("kernel")
                if kern is not None:
                    point.update(dl.compiled_stats(kern))
                if args.timing and cuda:
                    point["phases_us"] = phase_times(model, layers, parse_config(text).get("programs_per_sm", 1))
                if point["rel_err"] > 5e-2 or not point["sync_clean"]:
                    point["failed"] = f"check: err {point['rel_err']:.3g}, sync {syncs[0]}"
                else:
                    t = timed_layers()
                    point.update(us_per_layer=t * 1e6, of_roofline=roof_us / (t * 1e6))
        except Exception as exc:  # a config that does not compile or launch
            point["failed"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        results["points"].append(point)
        say(json.dumps(point))


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here; `--smoke` runs the CPU version")
    results: dict[str, Any] = {"machine": machine_info(device), "args": vars(args), "points": []}
    copy = measure_copy_gbps(device, nbytes=(64 << 20) if args.smoke else (2 << 30))
    results["copy_gbps"] = copy["gbps_read_plus_write"]
    say(f"copy {copy['gbps_read_plus_write']:.0f} GB/s")
    model_dir = write_model_config(args.preset, tempfile.mkdtemp(prefix="ftserve_dlk_"), layers=args.layers,
                                   max_position_embeddings=max(args.contexts) + 64)
    model, cfg = load_model(model_dir, dtype="float32" if args.smoke else "bfloat16", device=device,
                            load_format="dummy")
    for layer in model.layers:
        layer.fused_info = {}  # receives each fused launch's compiled kernel (registers, spills)
    backend = TritonAttentionBackend()
    deadline = time.perf_counter() + args.budget_s
    for context in args.contexts:
        bench_context(model, cfg, backend, context, args, results, deadline)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--contexts", type=lambda s: [int(v) for v in s.split(",")], default=[2048, 32768])
    p.add_argument("--configs", default="default",
                   help="';'-separated LayerConfig overrides (name=int, ',' between fields)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--timing", action="store_true", help="per-phase times of each fused config (one eager pass)")
    p.add_argument("--budget-s", type=float, default=150.0)
    p.add_argument("--out", default="bench_decode_layer_kernel.json")
    p.add_argument("--smoke", action="store_true",
                   help="tiny-moe on the CPU, the fused layer interpreted phase by phase (<30 s)")
    args = p.parse_args(argv)
    if args.smoke:
        args.preset, args.layers, args.contexts, args.iters = "tiny-moe", 2, [40], 1
        args.configs = "default"
    results = run(args)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
