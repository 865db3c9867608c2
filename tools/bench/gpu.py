"""GPU: ftserve's engine against transformers ``generate`` on one checkpoint, both
in this process, bf16, against the HBM roofline (issue 31 point 4; the CPU
counterpart is tools/bench/cpu.py, the contenders are tools/bench/side_by_side.py).

    python -m tools.bench.gpu --out OUT/gpu.json    # H200: SmolLM2-135M's shape, random weights
    python -m tools.bench.gpu --model DIR           # a real checkpoint (safetensors)

Measured in rounds, ftserve and transformers alternating which goes first:

    ttft     one --ttft-tokens prompt (random ids, no prefix-cache hit) to its
             first token on the host
    decode   at each of --batches: that many greedy sequences, each after its own
             --prompt-tokens prompt (equal lengths: transformers' left padding
             pads nothing), --decode-tokens tokens a row after the first;
             tokens/s = every row's tokens after its first / the time they took.
             ftserve: the server's engine (CUDA graphs, overlap scheduling);
             transformers: one batched ``generate`` (sdpa, dynamic cache)

Roofline: a decode step must read every weight once and each row's KV at its
mean context (tools/bench/common.decode_step_bytes); roofline tokens/s =
batch / (those bytes / bandwidth), with the datasheet bandwidth (H200: 4.8 TB/s)
and with the device copy rate measured at the start of the run. ftserve's decode
graph is also replayed back to back (the step's device time with no host work
between steps): what it leaves to the tokens/s above is host time a step.

Rounds stop when the next one would end past --budget-s, counted from the start
(checkpoint, load and graph capture included); the first round always runs.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ftserve.engine.request import ReqState
from tools.bench.common import (
    decode_step_bytes,
    hbm_spec_gbps,
    machine_info,
    measure_copy_gbps,
    say,
    write_json,
)
from tools.bench.engine_measure import time_decode_device
from tools.bench.side_by_side import (
    PRESET,
    Decoded,
    FtserveSide,
    TransformersSide,
    checkpoint,
    leading_agreement,
)

WHO = ("ftserve", "transformers")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help=f"checkpoint dir (default: the {PRESET} preset with random weights in --dtype, "
                        "written to a temporary dir)")
    p.add_argument("--device", default="cuda", help="cuda (cpu: the smoke test's tiny run)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--batches", default="1,64", help="decode batch sizes")
    p.add_argument("--prompt-tokens", type=int, default=32, help="each decode row's prompt")
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens a row after its first")
    p.add_argument("--ttft-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3, help="rounds (fewer if --budget-s runs out)")
    p.add_argument("--budget-s", type=float, default=120.0)
    p.add_argument("--out", default=None, help="write the results here as JSON")
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batches.split(",")]
    return args


# ----------------------------------------------------------------- measure


def graph_step(ft: FtserveSide, prompts: list[list[int]], n: int, device: torch.device) -> dict[str, Any]:
    """ftserve's decode step for len(prompts) rows, its CUDA graph replayed back to
    back (tools/bench/engine_measure.time_decode_device; nothing on the CPU)."""
    drv = ft.driver
    reqs = [drv.add(p, max_tokens=n + 1) for p in prompts]
    while any(r.state is not ReqState.DECODE for r in reqs):
        drv.step()
    drv.flush()
    batch = drv.sched.schedule()
    try:
        if batch is None or not batch.is_decode or len(batch.reqs) != len(prompts):
            raise RuntimeError(f"expected a decode step of {len(prompts)} rows, got {batch}")
        with torch.inference_mode():
            return time_decode_device(drv, batch, device)
    finally:
        drv.abort_all()


def run(args: argparse.Namespace, model_dir: str, t_start: float) -> dict[str, Any]:
    device = torch.device(args.device)
    deadline = t_start + args.budget_s
    machine = machine_info(device)
    cuda = device.type == "cuda"
    bandwidth: dict[str, float | None] = {
        "datasheet_gbps": hbm_spec_gbps(machine["gpu"]) if cuda else None,
        "copy_gbps": measure_copy_gbps(device, (1 << 30) if cuda else (64 << 20),
                                       5 if cuda else 2)["gbps_read_plus_write"],
    }
    vocab = int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
    bmax = max(args.batch_sizes)
    max_len = max(args.ttft_tokens, args.prompt_tokens + args.decode_tokens + 1) + 16
    seconds: dict[str, float] = {}

    t0 = time.perf_counter()
    say(f"loading ftserve ({model_dir})")
    ft = FtserveSide(model_dir, args.dtype, str(device), max_len, max_batch=bmax,
                     kv_tokens=2 * max(bmax * (args.prompt_tokens + args.decode_tokens + 17), max_len))
    seconds["ftserve_build"] = time.perf_counter() - t0
    if cuda and ft.engine.runner.graphs is None:
        raise SystemExit("ftserve built without CUDA graphs: not the production path")
    t0 = time.perf_counter()
    say("loading transformers")
    hf = TransformersSide(model_dir, args.dtype, str(device))
    seconds["transformers_build"] = time.perf_counter() - t0
    sides = {s.name: s for s in (ft, hf)}
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 1) for _ in range(n)]

    ttft: dict[str, list[float]] = {k: [] for k in WHO}
    decode: dict[str, dict[int, list[Decoded]]] = {k: {b: [] for b in args.batch_sizes} for k in WHO}
    agree_first, agree_rows = [], {b: [] for b in args.batch_sizes}
    with torch.inference_mode():
        t0 = time.perf_counter()
        say("warm-up")  # every shape the rounds run, so no kernel compiles inside a timed region
        for side in sides.values():
            side.ttft(prompt(args.ttft_tokens))
            for b in args.batch_sizes:
                side.decode([prompt(args.prompt_tokens) for _ in range(b)], min(8, args.decode_tokens))
        seconds["warmup"] = time.perf_counter() - t0
        round_s, t_rounds = 0.0, time.perf_counter()
        for i in range(args.repeats):
            if i and time.perf_counter() + round_s > deadline:
                say(f"budget: {i} of {args.repeats} rounds")
                break
            t0 = time.perf_counter()
            order = WHO if i % 2 == 0 else WHO[::-1]
            p = prompt(args.ttft_tokens)
            first = {}
            for name in order:
                dt, first[name] = sides[name].ttft(p)
                ttft[name].append(dt)
                say(f"round {i}: ttft {name} {args.ttft_tokens} tokens {dt * 1e3:.1f} ms")
            agree_first.append(first["ftserve"] == first["transformers"])
            for b in args.batch_sizes:
                ps = [prompt(args.prompt_tokens) for _ in range(b)]
                out = {}
                for name in order:
                    out[name] = sides[name].decode(ps, args.decode_tokens)
                    decode[name][b].append(out[name])
                    say(f"round {i}: decode batch {b} {name} {out[name].tokens_per_s:,.0f} tokens/s")
                agree_rows[b].append([leading_agreement(x, y) for x, y in zip(
                    out["ftserve"].tokens, out["transformers"].tokens)])
            round_s = time.perf_counter() - t0
        seconds["rounds"] = time.perf_counter() - t_rounds
        t0 = time.perf_counter()
        replay = {b: graph_step(ft, [prompt(args.prompt_tokens) for _ in range(b)],
                                args.decode_tokens, device) for b in args.batch_sizes}
        seconds["graph_replay"] = time.perf_counter() - t0
    mcfg = ft.engine.model_config
    summary = dict(ft.engine.summary)
    ft.close()
    hf.close()
    elem = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    # Decode step k (1..n after the first token) attends to prompt + k tokens.
    mean_ctx = args.prompt_tokens + (args.decode_tokens + 1) / 2
    rows = []
    for b in args.batch_sizes:
        nbytes = decode_step_bytes(mcfg, elem, b, [mean_ctx] * b)
        row: dict[str, Any] = {"batch": b, "mean_context": mean_ctx, **nbytes}
        for name in WHO:
            rates = [d.tokens_per_s for d in decode[name][b]]
            steps = [s for d in decode[name][b] for s in d.step_s]
            row[name] = {"tokens_per_s": statistics.median(rates), "tokens_per_s_rounds": rates,
                         "median_step_ms": statistics.median(steps) * 1e3}
        row["ftserve_over_transformers"] = row["ftserve"]["tokens_per_s"] / row["transformers"]["tokens_per_s"]
        replay_ms = replay[b].get("graph_replay_ms")
        if replay_ms:
            row["ftserve_graph_replay"] = {"step_ms": replay_ms, "tokens_per_s": b / (replay_ms / 1e3),
                                           "eager_top_kernels": replay[b].get("eager_top_kernels")}
        for key, gbps in bandwidth.items():
            if not gbps:
                continue
            roof = b / (nbytes["total_bytes"] / (gbps * 1e9))
            row[f"roofline_tokens_per_s_{key}"] = roof
            for name in (*WHO, "ftserve_graph_replay"):
                if name in row:
                    row[name][f"frac_of_roofline_{key}"] = row[name]["tokens_per_s"] / roof
        row["agreement_leading_tokens"] = agree_rows[b]
        rows.append(row)
    stats = {k: {"ttft_best_s": min(ttft[k]), "ttft_median_s": statistics.median(ttft[k])} for k in WHO}
    return {
        "machine": {**machine, "transformers": hf.version},
        "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, list, type(None)))},
        "model": model_dir if args.model else f"{PRESET} preset, random {args.dtype} weights",
        "engine": summary,
        "bandwidth": bandwidth,
        "rounds": len(ttft["ftserve"]),
        "ttft": {"tokens": args.ttft_tokens, "runs_s": ttft, "stats": stats,
                 "ftserve_over_transformers": stats["ftserve"]["ttft_best_s"] / stats["transformers"]["ttft_best_s"],
                 "first_token_agreement": agree_first},
        "decode": rows,
        "seconds": seconds,
    }


# ----------------------------------------------------------------- report


def _pct(row: dict[str, Any], name: str, key: str) -> str:
    v = row.get(name, {}).get(f"frac_of_roofline_{key}")
    return "-" if v is None else f"{v:.1%}"


def render(res: dict[str, Any]) -> str:
    m, a, t, bw = res["machine"], res["args"], res["ttft"], res["bandwidth"]
    ts = t["stats"]
    lines = [
        f"model: {res['model']}; {m['date_utc']}; {m['gpu']}, torch {m['torch']}, transformers "
        f"{m['transformers']}, {a['dtype']}; {res['rounds']} rounds; total {res['seconds']['total']:.0f} s",
        "",
        "| | ftserve | transformers | ftserve / transformers |",
        "|---|---|---|---|",
        f"| TTFT, {t['tokens']}-token prompt, best | {ts['ftserve']['ttft_best_s'] * 1e3:.1f} ms | "
        f"{ts['transformers']['ttft_best_s'] * 1e3:.1f} ms | {t['ftserve_over_transformers']:.2f}x |",
    ]
    for r in res["decode"]:
        f, h = r["ftserve"], r["transformers"]
        lines.append(f"| decode batch {r['batch']}, {a['decode_tokens']} tokens after {a['prompt_tokens']}, "
                     f"tokens/s (median round) | {f['tokens_per_s']:,.0f} | {h['tokens_per_s']:,.0f} | "
                     f"{r['ftserve_over_transformers']:.2f}x |")
    names = {"datasheet_gbps": "datasheet", "copy_gbps": "measured copy"}
    keys = [k for k in names if bw.get(k)]
    if keys:
        lines += ["", "HBM roofline (weights once + every row's KV a step), as "
                  + " / ".join(f"{names[k]} {bw[k]:,.0f} GB/s" for k in keys) + ":", "",
                  "| batch | MB a step | roofline tokens/s | ftserve | transformers | ftserve graph replay alone |",
                  "|---|---|---|---|---|---|"]
        for r in res["decode"]:
            roof = " / ".join(f"{r[f'roofline_tokens_per_s_{k}']:,.0f}" for k in keys)
            cells = [" / ".join(_pct(r, n, k) for k in keys) for n in (*WHO, "ftserve_graph_replay")]
            lines.append(f"| {r['batch']} | {r['total_bytes'] / 1e6:.0f} | {roof} | " + " | ".join(cells) + " |")
    agree = ", ".join(f"batch {r['batch']}: " + "/".join(
        str(min(x)) + "-" + str(max(x)) for x in r["agreement_leading_tokens"]) for r in res["decode"])
    lines += ["", f"greedy agreement (leading tokens of {a['decode_tokens'] + 1}, min-max over rows a round): "
              f"{agree}; first TTFT token {sum(t['first_token_agreement'])}/{len(t['first_token_agreement'])}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here (--device cpu runs the smoke version)")
    with checkpoint(args.model, args.dtype) as model_dir:
        res = run(args, model_dir, t_start)
    res["seconds"]["total"] = time.perf_counter() - t_start
    if args.out:
        write_json(args.out, res)
    print(render(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
