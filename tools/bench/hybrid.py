"""Hybrid models in the engine (issue 33 item 7): Qwen3-Next's shape, its targets.

    python -m tools.bench.hybrid --out bench_hybrid.json          # H200, ~150 s
    python -m tools.bench.hybrid --smoke --out /tmp/hybrid.json   # CPU, tiny-qwen3-next

The qwen3-next-80b-a3b config cut to 8 layers (6 Gated DeltaNet + 2 gated
attention layers, each with 512 experts, top-10, and a shared expert), bf16,
dummy weights, 16-token pages, a decode CUDA graph for batch 1; driven step by
step on this thread (ftserve.engine.driver.EngineDriver, the engine of
tools/bench/engine_driver.py), every timed region bracketed by synchronizes.

Sections (each recorded, or its error recorded, in the JSON; the run goes on):
    limits    bf16 matmul TFLOP/s and device copy GB/s, the rates the targets read against
    base      a 102,400-token conversation prefilled chunk by chunk (not a target):
              it leaves its pages and state checkpoints in the prefix cache
    cold      time to first token of a cold 4,096-token prompt: every prefill step
              (one chunk: the state checkpoint at its last page boundary is saved
              inside it), synchronized; median of reps
    cached    the same for a 4,096-token turn over the cached conversation: it resumes
              at 102,400 (the checkpoint every 256 pages its warm-up turn saved there)
              and computes the 4,096 new tokens
    decode    batch 1 at 2k and 100k contexts, steps overlapped as the engine runs
              them, against the HBM roofline of what one step moves: every weight
              but the routed experts not chosen (10 a layer, counted from the
              routing), the attention layers' KV, each linear layer's recurrent and
              conv state read and written (tools/bench/engine_measure.bench_decode,
              bytes recounted here for the hybrid)

Targets (issue 33 item 7), printed with the measured ratios:
    cached turn <= 1.5 x the cold one (one layer in four attends over the prefix)
    cold prefill >= 35% of the matmul rate (useful FLOPs: every projection, the
        chosen and shared experts, causal attention, the chunked delta rule)
    decode batch 1 >= 65% of the HBM roofline, state bytes included
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from ftserve.engine.driver import EngineDriver
from ftserve.engine.engine import Engine
from ftserve.engine.setup import STATE_DTYPE
from ftserve.kvcache.state_pool import StateLayout
from ftserve.models.layers import Linear, MoEBlock
from tools.bench.common import (
    gpu_kernel_seconds,
    markdown_table,
    physical_limits,
    run_section,
    say,
    start_run,
    timed,
    write_json,
)
from tools.bench.engine_driver import build
from tools.bench.engine_measure import bench_decode, prefill_base
from tools.bench.gated_delta import Shape, chunk_flops

SECTIONS = ("cold", "cached", "decode")
TARGETS = {"cached_over_cold": 1.5, "cold_frac_of_matmul": 0.35, "decode_b1_frac_of_roofline": 0.65}


# ----------------------------------------------------------------- accounting


def weight_counts(model: torch.nn.Module) -> dict[str, Any]:
    """Matmul weight elements of the model: what every token multiplies by outside
    the routed experts and the lm_head (projections, routers, shared experts), one
    routed expert's, the number of MoE layers and their top-k."""
    lm_head = getattr(model, "lm_head", None)
    dense = expert = moe_layers = top_k = num_experts = 0
    for mod in model.modules():
        if isinstance(mod, Linear) and mod is not lm_head:
            dense += mod.weight.numel()
        elif isinstance(mod, MoEBlock):
            expert = mod.w13[0].numel() + mod.w2[0].numel()
            moe_layers += 1
            top_k, num_experts = mod.top_k, mod.num_experts
    return {"dense": dense, "expert": expert, "moe_layers": moe_layers, "top_k": top_k,
            "num_experts": num_experts}


def rule_shape(mcfg: Any) -> Shape:
    la = mcfg.linear_attn
    return Shape(la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim,
                 la.conv_dim, la.conv_kernel - 1)


def prefill_flops(model: torch.nn.Module, mcfg: Any, new: int, prefix: int) -> dict[str, float]:
    """Useful FLOPs of prefilling ``new`` tokens over ``prefix`` cached ones (one
    sequence, one sampled row): matmuls (2 per weight element and token; top-k
    routed experts a token), causal attention in the attention layers (4 D FLOPs
    per query head and key), the chunked delta rule in the linear ones
    (tools/bench/gated_delta.chunk_flops)."""
    w = weight_counts(model)
    matmul = 2.0 * new * (w["dense"] + w["moe_layers"] * w["top_k"] * w["expert"])
    matmul += 2.0 * mcfg.hidden_size * mcfg.vocab_size
    pairs = new * prefix + new * (new + 1) / 2
    attention = len(mcfg.kv_layers) * 4.0 * mcfg.head_dim * mcfg.num_heads * pairs
    rule = len(mcfg.linear_layers) * chunk_flops(new, rule_shape(mcfg))
    return {"matmul_flops": matmul, "attention_flops": attention, "delta_rule_flops": rule,
            "total_flops": matmul + attention + rule}


def decode_bytes(engine: Engine, batch: int, contexts: list[int], experts_per_layer: float) -> dict[str, float]:
    """HBM bytes one decode step of ``batch`` sequences moves at least: every
    weight read once (of the routed experts only ``experts_per_layer`` a layer;
    of the embedding table the batch's rows), the KV of every attention layer
    over each context, and each sequence's state of every linear layer read and
    written."""
    model, mcfg = engine.runner.model, engine.model_config
    elem = next(model.parameters()).element_size()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed_tokens.weight
    weights = float(total)
    if getattr(model, "lm_head", None) is not None:  # else the table is the lm_head: read whole
        weights -= embed.numel() * embed.element_size() - batch * mcfg.hidden_size * elem
    for mod in model.modules():
        if isinstance(mod, MoEBlock):
            stacked = (mod.w13.numel() + mod.w2.numel()) * mod.w13.element_size()
            weights -= stacked * (1.0 - min(experts_per_layer, mod.num_experts) / mod.num_experts)
    pool = engine.runner.kv_pool
    kv_elem = pool.bytes_per_page() / (pool.page_size * pool.num_layers * 2 * mcfg.num_kv_heads
                                       * mcfg.head_dim)  # codes (+ scales) per element
    kv = sum(contexts) * 2 * len(mcfg.kv_layers) * mcfg.num_kv_heads * mcfg.head_dim * kv_elem
    state = batch * 2 * StateLayout.from_config(mcfg).bytes_per_slot(embed.dtype, STATE_DTYPE)
    return {"weight_bytes": weights, "kv_bytes": float(kv), "state_bytes": float(state),
            "total_bytes": weights + kv + state}


# ----------------------------------------------------------------- turns


def run_turn(drv: EngineDriver, prompt: list[int]) -> tuple[Any, list[tuple[int, int]]]:
    """A closure that prefills ``prompt`` to its first token as the engine thread
    steps (non-final chunks launch back to back, the final one is read back),
    and the (prefix, new tokens) of every step it took."""
    drv.flush()
    req = drv.add(prompt, max_tokens=1)
    steps: list[tuple[int, int]] = []

    def go() -> Any:
        while not req.finished:
            batch = drv.step()
            if batch is not None:
                assert batch.reqs == [req], "the turn must run alone"
                steps.append((batch.prefix_lens[0], len(batch.new_tokens[0])))
            elif drv.idle:
                break
        drv.flush()
        assert req.finished
        return req

    return go, steps


def bench_turn(drv: EngineDriver, device: torch.device, limits: dict[str, Any], base: list[int],
               prefix: int, new: int, reps: int) -> dict[str, Any]:
    """Time to first token of ``base[:prefix]`` + ``new`` fresh tokens (the prefix
    cached): one warm-up, median of ``reps``, then one profiled turn."""
    mcfg, model = drv.engine.model_config, drv.runner.model
    walls: list[float] = []
    steps: list[tuple[int, int]] = []
    cached = 0
    for i in range(reps + 1):
        go, steps = run_turn(drv, base[:prefix] + drv.tokens(new))
        wall, _, req = timed(go, device)
        cached = req.cached_len
        if i:
            walls.append(wall)
    go, _ = run_turn(drv, base[:prefix] + drv.tokens(new))
    prof = gpu_kernel_seconds(go, device, ("gated_delta", "extend", "moe"))
    wall = statistics.median(walls)
    computed = sum(n for _, n in steps)
    fl = prefill_flops(model, mcfg, computed, cached)
    out: dict[str, Any] = {
        "prefix": prefix, "new": new, "cached_tokens": cached, "computed_tokens": computed,
        "steps": steps, "wall_s": wall, "walls_s": walls, "tokens_per_s": computed / wall, **fl,
        "tflops": fl["total_flops"] / wall / 1e12, "kernel_s": prof["kernel_s"],
        "kernels_by_filter_s": prof["by_filter"], "top_kernels": prof["top"],
    }
    if prof["kernel_s"] is not None:
        out["gpu_busy"] = prof["kernel_s"] / wall
    mm = (limits or {}).get("matmul", {}).get("tflops")
    if mm:
        out["frac_of_matmul"] = out["tflops"] / mm
        out["matmul_only_frac_of_matmul"] = fl["matmul_flops"] / wall / 1e12 / mm
    return out


def bench_hybrid_decode(drv: EngineDriver, device: torch.device, limits: dict[str, Any],
                        base: list[int], context: int, args: argparse.Namespace) -> dict[str, Any]:
    row = bench_decode(drv, device, drv.engine.model_config, limits, base, context, 1,
                       args.decode_warmup, args.decode_steps, args.tail)
    # bench_decode's byte count is a transformer's (every layer attends): recount.
    for key in ("weight_bytes", "kv_bytes", "total_bytes", "roofline_tokens_per_s", "frac_of_roofline"):
        row.pop(key, None)
    experts = row.get("experts_per_layer_measured") or row["experts_per_layer_expected"]
    row.update(decode_bytes(drv.engine, 1, [int(row["mean_context"])], experts))
    bw = (limits or {}).get("copy", {}).get("gbps_read_plus_write")
    if bw:
        row["roofline_tokens_per_s"] = bw * 1e9 / row["total_bytes"]
        row["frac_of_roofline"] = row["tokens_per_s"] / row["roofline_tokens_per_s"]
    return row


# ----------------------------------------------------------------- report


def check_targets(res: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met) for the targets this run measured."""
    out: list[tuple[str, str, bool | None]] = []
    cold, cached = res.get("cold") or {}, res.get("cached") or {}
    if cold.get("wall_s") and cached.get("wall_s"):
        r = cached["wall_s"] / cold["wall_s"]
        res["cached_over_cold"] = r
        out.append((f"{cached['new']}-token turn over {cached['cached_tokens']} cached tokens <= "
                    f"{TARGETS['cached_over_cold']}x the cold {cold['new']}-token prompt",
                    f"{r:.2f}x ({1e3 * cached['wall_s']:.1f} / {1e3 * cold['wall_s']:.1f} ms; "
                    f"FLOPs {cached['total_flops'] / cold['total_flops']:.1f}x)",
                    r <= TARGETS["cached_over_cold"]))
    if "frac_of_matmul" in cold:
        f = cold["frac_of_matmul"]
        out.append((f"cold prefill >= {TARGETS['cold_frac_of_matmul']:.0%} of the matmul rate",
                    f"{f:.0%} (matmuls alone: {cold['matmul_only_frac_of_matmul']:.0%})",
                    f >= TARGETS["cold_frac_of_matmul"]))
    b1 = [r["frac_of_roofline"] for r in res.get("decode") or [] if "frac_of_roofline" in r]
    if b1:
        out.append((f"decode batch 1 >= {TARGETS['decode_b1_frac_of_roofline']:.0%} of the HBM roofline "
                    "(state bytes included)", ", ".join(f"{x:.0%}" for x in b1),
                    min(b1) >= TARGETS["decode_b1_frac_of_roofline"]))
    return out


def render(res: dict[str, Any]) -> str:
    m = res.get("machine", {})
    lim = res.get("limits") or {}
    lines = [f"# Hybrid engine benchmark ({res['args']['preset']} x {res['args']['layers']} layers, "
             f"{res['args']['dtype']}, {m.get('gpu')})", ""]
    if lim:
        lines.append(f"Limits: matmul {lim['matmul']['tflops']:.0f} TFLOP/s, copy "
                     f"{lim['copy']['gbps_read_plus_write']:.0f} GB/s.")
        lines.append("")
    rows = [[name, r["cached_tokens"], r["computed_tokens"], len(r["steps"]), 1e3 * r["wall_s"],
             r["tflops"], r.get("frac_of_matmul"), r.get("gpu_busy")]
            for name in ("cold", "cached") if (r := res.get(name))]
    if rows:
        lines += [markdown_table(["turn", "cached", "computed", "steps", "TTFT ms", "TFLOP/s",
                                  "of matmul", "GPU busy"], rows), ""]
    dec = res.get("decode") or []
    if dec:
        lines += [markdown_table(["context", "tok/s", "step ms", "MB / step", "state MB", "roofline tok/s",
                                  "of roofline"],
                                 [[r["context"], r["tokens_per_s"], r["step_ms"], r["total_bytes"] / 1e6,
                                   r["state_bytes"] / 1e6, r.get("roofline_tokens_per_s"),
                                   r.get("frac_of_roofline")] for r in dec]), ""]
    targets = res.get("targets") or []
    if targets:
        lines += [markdown_table(["target", "measured", "met"],
                                 [[t, v, "yes" if ok else "NO"] for t, v, ok in targets]), ""]
    for name, err in (res.get("errors") or {}).items():
        lines.append(f"ERROR in {name}: {err.splitlines()[0]}")
    if res.get("skipped"):
        lines.append(f"skipped (time budget): {', '.join(res['skipped'])}")
    return "\n".join(lines)


# ----------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_hybrid.json", help="JSON results path")
    p.add_argument("--smoke", action="store_true", help="tiny-qwen3-next on the CPU, tiny lengths")
    p.add_argument("--preset", default="qwen3-next-80b-a3b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"subset of {','.join(SECTIONS)}")
    p.add_argument("--budget-s", type=float, default=None,
                   help="skip sections that would start after this many seconds (default 150; smoke 60)")
    args = p.parse_args(argv)
    args.chunk, args.prefix, args.reps, args.max_len = 4096, 102400, 3, 131072
    args.contexts, args.batches = [2048, 102400], [1]
    args.decode_warmup, args.decode_steps, args.tail = 4, 32, 16
    args.kv_tokens, args.checkpoints = 1 << 18, 64
    if args.smoke:
        args.preset, args.layers, args.dtype, args.device = "tiny-qwen3-next", 4, "float32", "cpu"
        args.chunk, args.prefix, args.reps, args.max_len = 64, 256, 1, 1024
        args.contexts = [48, 256]
        args.decode_warmup, args.decode_steps = 1, 3
        args.kv_tokens = 8192
    if args.budget_s is None:
        args.budget_s = 60.0 if args.smoke else 150.0
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device, results, t_start, deadline, model_dir = start_run(args, "ftserve-bench-hybrid-")
    wanted = set(args.sections.split(","))

    def section(name: str, fn: Any, budgeted: bool = True) -> Any:
        out = run_section(results, name, fn, deadline if budgeted else None)
        write_json(args.out, results)  # a run killed later still leaves what it measured
        return out

    limits = section("limits", lambda: physical_limits(device, args.smoke), False) or {}
    # Enough checkpoint slots for every boundary of the conversation's prefill (one
    # every 4,096 tokens and its prompt end), so its prompt-end state is kept.
    engine = section("engine_build", lambda: build(args, model_dir, device,
                                                   state_checkpoints=args.checkpoints), False)
    if engine is not None:
        results["engine_build"] = dict(engine.summary)
        if engine.runner.state_pool is None:
            raise SystemExit(f"{args.preset} is no hybrid model")
        if device.type == "cuda" and engine.runner.graphs is None:
            results.setdefault("errors", {})["cuda_graphs"] = "CUDA graphs are OFF: numbers are not valid"
        drv = EngineDriver(engine)
        base = drv.tokens(max(args.prefix, max(args.contexts)))

        def turn(name: str, fn: Any) -> Any:
            out = section(name, fn)
            if out is None:  # a failed turn leaves its request in the scheduler: the next one starts clean
                drv.abort_all()
            return out

        if "cold" in wanted:
            turn("cold", lambda: bench_turn(drv, device, limits, base, 0, args.chunk, args.reps))
        if wanted & {"cached", "decode"}:
            turn("base", lambda: prefill_base(drv, base[:args.prefix], device))
        if "cached" in wanted:
            turn("cached", lambda: bench_turn(drv, device, limits, base, args.prefix, args.chunk, args.reps))
        if "decode" in wanted:
            rows = []
            for ctx in args.contexts:
                r = section(f"decode_{ctx}", lambda c=ctx: bench_hybrid_decode(drv, device, limits, base, c, args))
                drv.abort_all()
                if r is not None:
                    rows.append(r)
                    results.pop(f"decode_{ctx}")
            results["decode"] = rows
        results["state_checkpoints_saved"] = engine.scheduler.counters.state_checkpoints_saved_total
        engine.shutdown()
    results["total_s"] = time.perf_counter() - t_start
    results["targets"] = check_targets(results)
    write_json(args.out, results)
    print(render(results), flush=True)
    say(f"wrote {args.out} in {results['total_s']:.0f} s")
    return results


if __name__ == "__main__":
    main()
