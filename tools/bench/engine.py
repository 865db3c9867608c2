"""Engine benchmarks at a real model shape with dummy weights (issue 5 item 5).

    python -m tools.bench.engine --out bench_engine.json          # H200, ~4 min
    python -m tools.bench.engine --smoke --out /tmp/smoke.json    # CPU, tiny-moe

Sections (each one recorded, or its error recorded, in the JSON; the run goes on):
    limits   bf16 matmul TFLOP/s, device copy GB/s, pinned H2D GB/s
    engine   start-up summary (CUDA graphs must be on)
    cold     cold prefill of one 4,096-token prompt
    cached   one 4,096-token chunk over 0 / 8k / 32k / 100k cached tokens:
             FLOPs, TFLOP/s, attention TFLOP/s, GPU-busy fraction (profiler)
    decode   tokens/s at batch 1/8/32/64 x context 2k/32k vs the HBM roofline
    hf       the same config through transformers (random weights, sdpa)

The Scheduler and ModelRunner are driven directly on this thread
(tools/bench/engine_driver.py; the timed regions are tools/bench/engine_measure.py), so every
measured region is exactly one runner.step (or N decode steps, overlapped as
the engine thread runs them, and again without overlap for reference),
bracketed by torch.cuda.synchronize and CUDA events. The rope table is stretched to 131,072
positions (max_position_embeddings) so a 100k prefix fits; that changes no
FLOP or byte count.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from ftserve.engine.driver import EngineDriver
from ftserve.engine.sampling_params import SamplingParams
from tools.bench.common import physical_limits, run_section, say, start_run, timed, write_json
from tools.bench.engine_driver import build
from tools.bench.engine_measure import bench_decode, bench_prefill, prefill_base
from tools.bench.engine_report import check_targets, render_markdown

SECTIONS = ("limits", "cold", "cached", "decode", "hf")
# --decode-sampling: the generation_config.json settings of Qwen3 and Qwen3-Coder.
DECODE_SAMPLING = {
    "greedy": None,
    "qwen3": SamplingParams(temperature=0.6, top_p=0.95, top_k=20),
    "qwen3-coder": SamplingParams(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05),
}


# ----------------------------------------------------------------- transformers peer


def bench_hf(model_dir: str, device: torch.device, dtype: torch.dtype, prefill_len: int,
             decode_ctx: int, decode_steps: int, reps: int) -> dict[str, Any]:
    import transformers

    hf_cfg = transformers.AutoConfig.from_pretrained(model_dir)
    cls = getattr(transformers, hf_cfg.architectures[0])
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls._from_config(hf_cfg, attn_implementation="sdpa")
    finally:
        torch.set_default_dtype(old)
    model = model.to(device=device, dtype=dtype).eval()
    with torch.no_grad():
        # Same scales as ftserve's dummy fill: HF's init (router std 0.02)
        # gives near-tied router logits, every token would pick the same
        # experts and the expert loop would look cheaper than real routing.
        for name, p in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                p.normal_(0.0, 1.0)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, hf_cfg.hidden_size ** -0.5)
    gen = torch.Generator(device="cpu").manual_seed(0)
    vocab = hf_cfg.vocab_size
    out: dict[str, Any] = {"transformers": transformers.__version__, "attn_implementation": "sdpa",
                           "experts_implementation": getattr(model.config, "_experts_implementation", None)}

    def fwd(ids: torch.Tensor, **kw: Any) -> Any:
        try:
            return model(input_ids=ids, logits_to_keep=1, **kw)
        except TypeError:
            return model(input_ids=ids, **kw)

    with torch.inference_mode():
        times = []
        for i in range(reps + 1):
            ids = torch.randint(100, vocab - 1, (1, prefill_len), generator=gen).to(device)
            wall, _, _ = timed(lambda ids=ids: fwd(ids, use_cache=False), device)
            if i:
                times.append(wall)
        out["prefill_tokens"] = prefill_len
        out["prefill_s"] = statistics.median(times)
        out["prefill_tokens_per_s"] = prefill_len / out["prefill_s"]
        ids = torch.randint(100, vocab - 1, (1, decode_ctx), generator=gen).to(device)
        res = fwd(ids, use_cache=True)
        past, nxt = res.past_key_values, res.logits[:, -1:].argmax(-1)
        for _ in range(2):  # warm-up steps
            res = fwd(nxt, past_key_values=past, use_cache=True)
            past, nxt = res.past_key_values, res.logits[:, -1:].argmax(-1)

        def run() -> None:
            nonlocal past, nxt
            for _ in range(decode_steps):
                r = fwd(nxt, past_key_values=past, use_cache=True)
                past, nxt = r.past_key_values, r.logits[:, -1:].argmax(-1)

        wall, _, _ = timed(run, device)
    out.update(decode_context=decode_ctx, decode_steps=decode_steps, decode_b1_tokens_per_s=decode_steps / wall)
    return out


# ----------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_engine.json", help="JSON results path")
    p.add_argument("--smoke", action="store_true", help="tiny-moe on the CPU, tiny lengths (<60 s)")
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--load-format", default="dummy", choices=["dummy"])
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"subset of {','.join(SECTIONS)}")
    p.add_argument("--batches", dest="batches_arg", default=None, help="decode batch sizes, e.g. 1,8 (default 1,8,32,64)")
    p.add_argument("--contexts", dest="contexts_arg", default=None, help="decode contexts, e.g. 2048 (default 2048,32768)")
    p.add_argument("--decode-sampling", default="greedy", choices=sorted(DECODE_SAMPLING),
                   help="the decode requests' sampling settings (a model card's recommended ones)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="skip sections that would start after this many seconds (default 330; smoke 50)")
    args = p.parse_args(argv)
    args.chunk, args.reps, args.max_len = 4096, 3, 131072
    args.cached = [0, 8192, 32768, 102400]
    args.contexts, args.batches = [2048, 32768], [1, 8, 32, 64]
    args.decode_warmup, args.decode_steps, args.tail = 4, 32, 16
    args.kv_tokens = 1 << 19
    if args.smoke:
        args.preset, args.layers, args.dtype, args.device = "tiny-moe", 2, "float32", "cpu"
        args.chunk, args.reps, args.max_len = 64, 1, 1024
        args.cached = [0, 64, 256]
        args.contexts, args.batches = [48, 160], [1, 3]
        args.decode_warmup, args.decode_steps, args.tail = 1, 3, 16
        args.kv_tokens = 8192
    if args.batches_arg:
        args.batches = [int(x) for x in args.batches_arg.split(",")]
    if args.contexts_arg:
        args.contexts = [int(x) for x in args.contexts_arg.split(",")]
    if args.budget_s is None:
        args.budget_s = 50.0 if args.smoke else 330.0
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device, results, t_start, deadline, model_dir = start_run(args, "ftserve-bench-")
    wanted = set(args.sections.split(","))

    def section(name: str, fn: Any, budgeted: bool = True) -> Any:
        out = run_section(results, name, fn, deadline if budgeted else None)
        write_json(args.out, results)  # a run killed later still leaves what it measured
        return out

    limits = section("limits", lambda: physical_limits(device, args.smoke), False) or {}
    engine = section("engine_build", lambda: build(args, model_dir, device), False)
    if engine is not None:
        results["engine_build"] = dict(engine.summary)
        if device.type == "cuda" and engine.runner.graphs is None:
            results.setdefault("errors", {})["cuda_graphs"] = "CUDA graphs are OFF: numbers are not valid"
        drv = EngineDriver(engine)
        mcfg = engine.model_config
        base = drv.tokens(max(max(args.cached), max(args.contexts)))
        if "cold" in wanted:
            section("cold_prefill", lambda: bench_prefill(
                drv, device, mcfg, limits, args.chunk, 0, [], args.reps))
        if wanted & {"cached", "decode"}:
            section("base_prefill", lambda: prefill_base(drv, base, device))
        if "cached" in wanted:
            rows = []
            for prefix in args.cached:
                r = section(f"cached_{prefix}", lambda p=prefix: bench_prefill(
                    drv, device, mcfg, limits, args.chunk, p, base, args.reps))
                drv.abort_all()
                if r is not None:
                    rows.append(r)
                    results.pop(f"cached_{prefix}")
            results["cached_prefill"] = rows
        if "decode" in wanted:
            rows = []
            for ctx in args.contexts:
                for bs in args.batches:
                    r = section(f"decode_{ctx}_{bs}", lambda c=ctx, b=bs: bench_decode(
                        drv, device, mcfg, limits, base, c, b, args.decode_warmup, args.decode_steps,
                        args.tail, DECODE_SAMPLING[args.decode_sampling]))
                    drv.abort_all()
                    if r is not None:
                        rows.append(r)
                        results.pop(f"decode_{ctx}_{bs}")
            results["decode"] = rows
            results["decode_sampling"] = args.decode_sampling
        engine.shutdown()
        del drv, engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "hf" in wanted:
        dtype = getattr(torch, args.dtype)
        section("hf", lambda: bench_hf(
            model_dir, device, dtype, args.chunk, args.contexts[0], args.decode_steps, args.reps))
    results["total_s"] = time.perf_counter() - t_start
    results["targets"] = check_targets(results)
    write_json(args.out, results)
    print(render_markdown(results), flush=True)
    say(f"wrote {args.out} in {results['total_s']:.0f} s")
    return results


if __name__ == "__main__":
    main()
