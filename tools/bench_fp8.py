"""fp8 against bf16 at the same shape, measured in one run (issue 32 item 6).

    python -m tools.bench_fp8 --out bench_fp8.json           # H200, ~6 min
    python -m tools.bench_fp8 --smoke --out /tmp/fp8.json    # CPU, tiny-moe(-fp8)

Formats: bf16 = qwen3-30b-a3b, fp8 = qwen3-30b-a3b-fp8 (HF's block-scaled e4m3
checkpoint layout), 8 layers, dummy weights; each format in turn:

    <fmt>_build     engine start-up summary; weights_gib is the memory plan's weights
    <fmt>_cold      one cold 4,096-token chunk (tools/engine_measure.bench_prefill)
    <fmt>_decode    tokens/s at batch 1 and 8 over a 2k context, the HBM bytes one
                    step must read (an fp8 weight: one byte + its block scale) and
                    the fraction of that roofline (tools/engine_measure.bench_decode)
    <fmt>_offload   --cache-frac of the experts in VRAM slots (the same fraction for
                    both): decode tokens/s at batch 1 and 8 from the same seeded
                    prompts and an emptied cache, hit rate, bytes copied per step
                    (tools/bench_moe_cache.bench_decode)

Targets (checked in results["targets"]): fp8 decode at batch 1 >= 1.6x bf16's
tokens/s and >= 70% of the fp8 roofline; the cold chunk >= 1.3x bf16's speed;
offload decode at batch 1 and 8 >= 1.8x the bf16 bank's tokens/s; fp8 weights
<= 55% of bf16's bytes (the embeddings and lm_head stay bf16: at 8 layers they
alone hold the ratio at 55.6%, at 48 layers 51.0%).
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tools import bench_moe_cache as bmc
from tools.bench_common import (
    markdown_table,
    measure_h2d_gbps,
    physical_limits,
    run_section,
    say,
    start_run,
    write_json,
    write_model_config,
)
from tools.engine_driver import EngineDriver, build
from tools.engine_measure import bench_decode, bench_prefill, prefill_base

FORMATS = ("bf16", "fp8")
SECTIONS = ("resident", "offload")
TARGETS = {"decode_b1_speedup": 1.6, "decode_b1_fp8_roofline_frac": 0.70, "cold_speedup": 1.3,
           "offload_b1_speedup": 1.8, "offload_b8_speedup": 1.8, "weights_ratio_max": 0.55}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_fp8.json")
    p.add_argument("--smoke", action="store_true", help="tiny-moe and tiny-moe-fp8 on the CPU (< 60 s)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--cache-frac", type=float, default=0.25, help="offload: experts in VRAM slots")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--budget-s", type=float, default=None, help="skip sections past this (default 420)")
    args = p.parse_args(argv)
    args.presets = {"bf16": ("qwen3-30b-a3b", {}), "fp8": ("qwen3-30b-a3b-fp8", {})}
    args.dtype, args.device, args.num_experts = "bfloat16", "cuda", 128
    args.chunk, args.reps, args.max_len, args.kv_tokens = 4096, 3, 8192, 65536
    args.context, args.batches, args.tail = 2048, [1, 8], 16
    args.decode_warmup, args.decode_steps = 4, 32
    args.decode_prompt = 256  # offload decode (bench_moe_cache's)
    if args.smoke:
        # tiny-moe-fp8's shape in both formats (hidden 128: whole 128-column blocks).
        wide = {"hidden_size": 128, "moe_intermediate_size": 256}
        args.presets = {"bf16": ("tiny-moe", wide), "fp8": ("tiny-moe-fp8", {})}
        args.dtype, args.device, args.num_experts, args.layers = "float32", "cpu", 16, 3
        args.chunk, args.reps, args.max_len, args.kv_tokens = 64, 1, 1024, 4096
        args.context, args.batches, args.tail = 96, [1, 3], 8
        args.decode_warmup, args.decode_steps, args.decode_prompt = 1, 3, 12
    args.preset = args.presets["bf16"][0]  # start_run's (unused) config
    if args.budget_s is None:
        args.budget_s = 50.0 if args.smoke else 420.0
    return args


def _model_dir(args: argparse.Namespace, fmt: str, root: Path) -> str:
    preset, overrides = args.presets[fmt]
    return write_model_config(preset, root / fmt, layers=args.layers, max_position_embeddings=args.max_len,
                              **overrides)


def run_resident(fmt: str, args: argparse.Namespace, model_dir: str, device: torch.device,
                 limits: dict[str, Any], results: dict[str, Any], section: Any) -> None:
    engine = section(f"{fmt}_build", lambda: build(args, model_dir, device))
    if engine is None:
        return
    results[f"{fmt}_build"] = dict(engine.summary)
    drv = EngineDriver(engine)
    mcfg = engine.model_config
    section(f"{fmt}_cold", lambda: bench_prefill(drv, device, mcfg, limits, args.chunk, 0, [], args.reps))
    base = drv.tokens(args.context)

    def decode() -> list[dict[str, Any]]:
        prefill_base(drv, base, device)
        rows = []
        for bs in args.batches:
            rows.append(bench_decode(drv, device, mcfg, limits, base, args.context, bs, args.decode_warmup,
                                     args.decode_steps, args.tail))
            drv.abort_all()
            say(f"  {fmt} decode batch {bs}: {rows[-1]['tokens_per_s']:.0f} tokens/s")
        return rows

    section(f"{fmt}_decode", decode)
    engine.shutdown()


def run_offload(fmt: str, args: argparse.Namespace, model_dir: str, device: torch.device,
                results: dict[str, Any], section: Any) -> None:
    slots = max(1, int(args.layers * args.num_experts * args.cache_frac))
    engine = section(f"{fmt}_offload_build", lambda: bmc.build(args, model_dir, device, slots))
    if engine is None:
        return
    results[f"{fmt}_offload_build"] = dict(engine.summary)
    drv = EngineDriver(engine, seed=1)

    def decode() -> list[dict[str, Any]]:
        rows = [bmc.bench_decode(drv, engine, device, bs, args.decode_prompt, args.decode_warmup,
                                 args.decode_steps, seed=bmc.DECODE_SEED + bs) for bs in args.batches]
        for r in rows:
            say(f"  {fmt} offload decode batch {r['batch']}: {r['tokens_per_s']:.0f} tokens/s, "
                f"hit rate {r.get('hit_rate', float('nan')):.2f}")
        return rows

    section(f"{fmt}_offload", decode)
    engine.shutdown()


def _row(rows: list[dict[str, Any]] | None, batch: int) -> dict[str, Any]:
    return next((r for r in rows or [] if r["batch"] == batch), {})


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for bs in (1, 8):
        f, b = _row(res.get("fp8_decode"), bs), _row(res.get("bf16_decode"), bs)
        out[f"decode_b{bs}_speedup"] = _ratio(f.get("tokens_per_s"), b.get("tokens_per_s"))
        out[f"decode_b{bs}_fp8_roofline_frac"] = f.get("frac_of_roofline")
        f, b = _row(res.get("fp8_offload"), bs), _row(res.get("bf16_offload"), bs)
        out[f"offload_b{bs}_speedup"] = _ratio(f.get("tokens_per_s"), b.get("tokens_per_s"))
    cold_f, cold_b = res.get("fp8_cold") or {}, res.get("bf16_cold") or {}
    out["cold_speedup"] = _ratio(cold_b.get("wall_s"), cold_f.get("wall_s"))
    wf, wb = (res.get("fp8_build") or {}).get("weights_gib"), (res.get("bf16_build") or {}).get("weights_gib")
    out["weights_ratio"] = _ratio(wf, wb)
    ob_f, ob_b = res.get("fp8_offload_build") or {}, res.get("bf16_offload_build") or {}
    out["expert_row_ratio"] = _ratio((ob_f.get("moe_cache") or {}).get("expert_bytes"),
                                     (ob_b.get("moe_cache") or {}).get("expert_bytes"))
    return out


def check_targets(summary: dict[str, Any]) -> dict[str, Any]:
    checks = {}
    for key, want in TARGETS.items():
        got = summary.get(key.removesuffix("_max"))
        ok = None if got is None else (got <= want if key.endswith("_max") else got >= want)
        checks[key] = {"want": want, "got": got, "ok": ok}
    return checks


def render(res: dict[str, Any]) -> str:
    m, s = res["machine"], res["summary"]
    lines = [f"### fp8 vs bf16: {res['presets']['fp8']} x {res['args']['layers']} layers, "
             f"dummy weights -- {m.get('gpu')}, {m['date_utc']}",
             "reproduce: `python -m tools.bench_fp8 --out bench_fp8.json`", ""]
    rows = []
    for fmt in FORMATS:
        d1, d8 = _row(res.get(f"{fmt}_decode"), 1), _row(res.get(f"{fmt}_decode"), 8)
        o1, o8 = _row(res.get(f"{fmt}_offload"), 1), _row(res.get(f"{fmt}_offload"), 8)
        rows.append([fmt, (res.get(f"{fmt}_build") or {}).get("weights_gib"), (res.get(f"{fmt}_cold") or {}).get("wall_s"),
                     d1.get("tokens_per_s"), d1.get("frac_of_roofline"), d8.get("tokens_per_s"),
                     o1.get("tokens_per_s"), o8.get("tokens_per_s"), o1.get("hit_rate")])
    lines += [markdown_table(["format", "weights GiB", "cold 4k chunk s", "decode b1 tok/s", "of roofline",
                              "decode b8 tok/s", "offload b1 tok/s", "offload b8 tok/s", "offload b1 hit rate"],
                             rows), ""]
    t = res.get("targets") or {}
    lines += [markdown_table(["target", "want", "got", "met"],
                             [[k, v["want"], v["got"], v["ok"]] for k, v in t.items()]), ""]
    lines.append(f"expert row (one miss) fp8 / bf16 bytes: {s.get('expert_row_ratio')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device, results, t_start, deadline, _ = start_run(args, "ftserve-fp8-")
    results["presets"] = {fmt: preset for fmt, (preset, _) in args.presets.items()}
    root = Path(tempfile.mkdtemp(prefix="ftserve-fp8-models-"))
    wanted = set(args.sections.split(","))

    def section(name: str, fn: Any) -> Any:
        out = run_section(results, name, fn, deadline)
        write_json(args.out, results)  # a run killed later still leaves what it measured
        return out

    limits = section("limits", lambda: {**physical_limits(device, args.smoke),
                                        "h2d": measure_h2d_gbps(device, 1 << 24 if args.smoke else 1 << 30)}) or {}
    for fmt in args.formats.split(","):
        model_dir = _model_dir(args, fmt, root)
        if "resident" in wanted:
            run_resident(fmt, args, model_dir, device, limits, results, section)
        if "offload" in wanted:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            run_offload(fmt, args, model_dir, device, results, section)
        gc.collect()  # the format's engines are unreachable now: free VRAM and pinned banks
        if device.type == "cuda":
            torch.cuda.empty_cache()
    results["summary"] = summarize(results)
    results["targets"] = check_targets(results["summary"])
    results["total_s"] = time.perf_counter() - t_start
    write_json(args.out, results)
    print(render(results), flush=True)
    say(f"wrote {args.out} in {results['total_s']:.0f} s")
    return results


if __name__ == "__main__":
    main()
