"""fp8 against bf16 at the same shape, measured in one run (issue 32 item 6).

    python -m tools.bench.fp8 --out bench_fp8.json           # H200, about 200 s (--budget-s 180)
    python -m tools.bench.fp8 --smoke --out /tmp/fp8.json    # CPU, tiny-moe(-fp8)

Formats: bf16 = qwen3-30b-a3b, fp8 = qwen3-30b-a3b-fp8 (HF's block-scaled e4m3
checkpoint layout), 8 layers, dummy weights; each format in turn:

    <fmt>_build     engine start-up summary; weights_gib is the memory plan's
                    weights, layer_weights_gib the decoder layers' part of it
    <fmt>_cold      one cold 4,096-token chunk (tools/bench/engine_measure.bench_prefill)
    <fmt>_decode    tokens/s at batch 1 and 8 over a 2k context, the HBM bytes one
                    step must read (an fp8 weight: one byte + its block scale) and
                    the fraction of that roofline (engine_measure.bench_decode)
    <fmt>_offload   --cache-frac of the experts in VRAM slots (the same fraction for
                    both): decode tokens/s at batch 1 and 8 from the same seeded
                    prompts and an emptied cache, hit rate, bytes copied per step
                    (tools/bench/moe_cache.bench_decode)

Targets (results["targets"], printed with what was measured): fp8 decode at
batch 1 >= 1.6x bf16's tokens/s and >= 70% of the fp8 roofline; the cold chunk
>= 1.3x bf16's speed; offload decode at batch 1 and 8 >= 1.8x the bf16 bank's
tokens/s; fp8 weights <= 55% of bf16's bytes. The weights are checked twice:
for the whole model (the memory plan) and for the decoder layers alone. The
embeddings and lm_head stay bf16 as the issue asks, and at 8 layers they alone
hold the whole-model ratio at about 55.6% (the published 48-layer model: about
51%, reported as weights_ratio_full_depth), so that target cannot be met at
this depth; the layers' ratio (about 50%) is the one the format decides.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ftserve.engine.driver import EngineDriver
from ftserve.models.checkpoint import write_config
from ftserve.models.config import ModelConfig
from tools.bench import moe_cache as bmc
from tools.bench.common import (
    markdown_table,
    param_bytes,
    physical_limits,
    run_section,
    say,
    start_run,
    write_json,
)
from tools.bench.engine_driver import build
from tools.bench.engine_measure import bench_decode, bench_prefill, prefill_base

FORMATS = ("bf16", "fp8")
SECTIONS = ("resident", "offload")
TARGETS = {"decode_b1_speedup": 1.6, "decode_b1_fp8_roofline_frac": 0.70, "cold_speedup": 1.3,
           "offload_b1_speedup": 1.8, "offload_b8_speedup": 1.8, "weights_ratio_max": 0.55,
           "layer_weights_ratio_max": 0.55}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.bench.fp8", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_fp8.json", help="JSON results path")
    p.add_argument("--smoke", action="store_true", help="tiny-moe and tiny-moe-fp8 on the CPU")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--cache-frac", type=float, default=0.25, help="offload: experts in VRAM slots")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"subset of {','.join(SECTIONS)}")
    p.add_argument("--budget-s", type=float, default=None,
                   help="skip sections that would start after this many seconds (default 180, so a run "
                        "ends near 200 s; smoke 120)")
    args = p.parse_args(argv)
    args.presets = {"bf16": ("qwen3-30b-a3b", {}), "fp8": ("qwen3-30b-a3b-fp8", {})}
    args.dtype, args.device, args.num_experts = "bfloat16", "cuda", 128
    args.chunk, args.reps, args.max_len, args.kv_tokens = 4096, 2, 8192, 65536
    args.context, args.batches, args.tail = 2048, [1, 8], 16
    args.decode_warmup, args.decode_steps = 4, 32
    args.decode_prompt = 256  # offload decode (moe_cache's)
    if args.smoke:
        # tiny-moe-fp8's shape in both formats (hidden 128: whole 128-column blocks).
        wide = {"hidden_size": 128, "moe_intermediate_size": 256}
        args.presets = {"bf16": ("tiny-moe", wide), "fp8": ("tiny-moe-fp8", {})}
        args.dtype, args.device, args.num_experts, args.layers = "float32", "cpu", 16, 3
        args.chunk, args.reps, args.max_len, args.kv_tokens = 32, 1, 512, 2048
        args.context, args.batches, args.tail = 48, [1, 3], 8
        args.decode_warmup, args.decode_steps, args.decode_prompt = 1, 2, 8
    args.preset = args.presets["bf16"][0]  # start_run's config (the bf16 one, rewritten below)
    if args.budget_s is None:
        args.budget_s = 120.0 if args.smoke else 180.0
    return args


def _model_dir(args: argparse.Namespace, fmt: str, root: Path) -> str:
    preset, overrides = args.presets[fmt]
    return write_config(preset, root / fmt, layers=args.layers, max_position_embeddings=args.max_len,
                        **overrides)


def _build_summary(engine: Any) -> dict[str, Any]:
    """The start-up summary, with the decoder layers' share of the weights (the
    part fp8 quantizes: embeddings, final norm and lm_head stay in the model dtype)."""
    out = dict(engine.summary)
    model = engine.runner.model
    out["layer_weights_gib"] = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                                   if n.startswith("layers.")) / 2**30
    return out


def run_resident(fmt: str, args: argparse.Namespace, model_dir: str, device: torch.device,
                 limits: dict[str, Any], results: dict[str, Any], section: Any) -> None:
    engine = section(f"{fmt}_build", lambda: build(args, model_dir, device))
    if engine is None:
        return
    results[f"{fmt}_build"] = _build_summary(engine)
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


def computed_weights_ratio(preset: str, fp8_preset: str, layers: int | None = None) -> float:
    """fp8 / bf16 weight bytes at ``layers`` (None: the published depth), computed
    from the shapes (tools/bench/common.param_bytes), not measured: at the
    published depth the bf16 embeddings and lm_head weigh less against the layers."""
    from ftserve.models.checkpoint import preset_config

    def total(name: str) -> float:
        cfg = ModelConfig.from_hf(preset_config(name, layers))
        b = param_bytes(cfg, 2)
        body = (b["attn_per_layer"] * cfg.num_layers + b["router_per_layer"] * b["sparse_layers"]
                  + b["expert"] * cfg.num_experts * b["sparse_layers"]
                  + b["dense_mlp_per_layer"] * b["dense_layers"])
        return body + b["lm_head"] * (1 if cfg.tie_word_embeddings else 2)  # + the embeddings

    return total(fp8_preset) / total(preset)


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
    build_f, build_b = res.get("fp8_build") or {}, res.get("bf16_build") or {}
    out["weights_ratio"] = _ratio(build_f.get("weights_gib"), build_b.get("weights_gib"))
    out["layer_weights_ratio"] = _ratio(build_f.get("layer_weights_gib"), build_b.get("layer_weights_gib"))
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
             "reproduce: `python -m tools.bench.fp8 --out bench_fp8.json`", ""]
    rows = []
    for fmt in FORMATS:
        d1, d8 = _row(res.get(f"{fmt}_decode"), 1), _row(res.get(f"{fmt}_decode"), 8)
        o1, o8 = _row(res.get(f"{fmt}_offload"), 1), _row(res.get(f"{fmt}_offload"), 8)
        build = res.get(f"{fmt}_build") or {}
        rows.append([fmt, build.get("weights_gib"), build.get("layer_weights_gib"),
                     (res.get(f"{fmt}_cold") or {}).get("wall_s"), d1.get("tokens_per_s"),
                     d1.get("frac_of_roofline"), d8.get("tokens_per_s"), o1.get("tokens_per_s"),
                     o8.get("tokens_per_s"), o1.get("hit_rate")])
    lines += [markdown_table(["format", "weights GiB", "layers GiB", "cold 4k chunk s", "decode b1 tok/s",
                              "of roofline", "decode b8 tok/s", "offload b1 tok/s", "offload b8 tok/s",
                              "offload b1 hit rate"], rows), ""]
    t = res.get("targets") or {}
    lines += [markdown_table(["target", "want", "got", "met"],
                             [[k, v["want"], v["got"], v["ok"]] for k, v in t.items()]), ""]
    lines.append(f"expert row (one miss) fp8 / bf16 bytes: {s.get('expert_row_ratio')}")
    lines.append(f"weights_ratio_max is the whole model's: the bf16 embeddings and lm_head hold it near "
                 f"0.556 at 8 layers (computed at the published depth: {s.get('weights_ratio_full_depth')}); "
                 f"layer_weights_ratio_max is the decoder layers' alone")
    skipped = res.get("skipped") or []
    if skipped or res.get("errors"):
        lines.append(f"skipped (budget): {', '.join(skipped) or '-'}; errors: {', '.join(res.get('errors') or {}) or '-'}")
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

    limits = section("limits", lambda: physical_limits(device, args.smoke)) or {}
    dirs = {fmt: _model_dir(args, fmt, root) for fmt in args.formats.split(",")}
    # Section by section, both formats in turn: a run cut by the budget still
    # compares the formats on what it measured.
    for name in (n for n in SECTIONS if n in wanted):
        for fmt, model_dir in dirs.items():
            if name == "resident":
                run_resident(fmt, args, model_dir, device, limits, results, section)
            else:
                run_offload(fmt, args, model_dir, device, results, section)
            gc.collect()  # the engine is unreachable now: free its VRAM and pinned bank
            if device.type == "cuda":
                torch.cuda.empty_cache()
    results["summary"] = summarize(results)
    results["summary"]["weights_ratio_full_depth"] = (
        None if args.smoke else computed_weights_ratio(args.presets["bf16"][0], args.presets["fp8"][0]))
    results["targets"] = check_targets(results["summary"])
    results["total_s"] = time.perf_counter() - t_start
    write_json(args.out, results)
    print(render(results), flush=True)
    say(f"wrote {args.out} in {results['total_s']:.0f} s")
    return results


if __name__ == "__main__":
    main()
