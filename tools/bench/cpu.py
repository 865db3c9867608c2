"""CPU: ftserve's engine against transformers ``generate`` on the same checkpoint,
both in this process, fp32, on the same number of threads (issue 31 point 4).

    python -m tools.bench.cpu                      # random SmolLM2-135M-shaped weights
    python -m tools.bench.cpu --model DIR          # a real checkpoint (safetensors)
    python -m tools.bench.cpu --quick              # shorter lengths, one repeat

Measured over ``--repeats`` rounds, ftserve and transformers alternating so a
busy neighbour on a shared box slows both alike:

    ttft     one ``--ttft-tokens`` prompt (random ids, no prefix-cache hit) to its
             first sampled token: ftserve = the engine's scheduler + runner
             (prefill, sampling, read-back, commit; tools/bench/engine_driver.py),
             transformers = ``generate(max_new_tokens=1)``
    decode   batch-1 greedy decoding, ``--decode-tokens`` tokens after a
             ``--prompt-tokens`` prompt, each token after the first timed:
             ftserve's steps (launch + read-back + commit), transformers'
             ``generate`` per token by a streamer; tokens/s = 1 / the median
             token time (and the plain mean over the runs)

The greedy tokens of both are compared too (same weights, same math): a
mismatch beyond near-ties means one of them computes another model.
Ratios: decode = ftserve tokens/s / transformers', TTFT = ftserve / transformers
(best of the rounds; the targets: decode >= 1.0, TTFT <= 1.0).

On a box shared with other work the 2-thread times swing by several times
(each parallel region waits for whichever thread was descheduled): run it
alone, or at a high priority for its few minutes.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path
from typing import Any

import torch

from tools.bench.common import machine_info, say, write_json
from tools.bench.side_by_side import (
    PRESET,
    FtserveSide,
    TransformersSide,
    checkpoint,
    leading_agreement,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help=f"checkpoint dir (default: the {PRESET} preset with random fp32 weights, "
                        "written to a temporary dir)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads for both")
    p.add_argument("--ttft-tokens", type=int, default=2048)
    p.add_argument("--prompt-tokens", type=int, default=32, help="the decode run's prompt")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="512-token TTFT, 32 decode tokens, one repeat")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.ttft_tokens, args.decode_tokens, args.repeats = 512, 32, 1
    return args


def run(args: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    vocab = int(cfg["vocab_size"])
    max_len = max(args.ttft_tokens, args.prompt_tokens + args.decode_tokens) + 16
    say(f"loading ftserve ({model_dir})")
    ftserve = FtserveSide(model_dir, "float32", "cpu", max_len, kv_tokens=4 * max_len, overlap=False)
    say("loading transformers")
    hf = TransformersSide(model_dir, "float32", "cpu")
    sides = {s.name: s for s in (ftserve, hf)}
    rng = random.Random(0)
    who = ("ftserve", "transformers")

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 1) for _ in range(n)]

    with torch.inference_mode():
        say("warm-up")
        warm = prompt(args.prompt_tokens)
        for side in sides.values():
            side.ttft(prompt(min(64, args.ttft_tokens)))
            side.decode([warm], args.decode_tokens)
        ttfts: dict[str, list[float]] = {k: [] for k in who}
        steps: dict[str, list[float]] = {k: [] for k in who}  # every decode step's seconds
        agree_first, agree_decode = 0, []
        for i in range(args.repeats):
            # Alternate who goes first, so a slow stretch of the box lands on both.
            order = who if i % 2 == 0 else who[::-1]
            p = prompt(args.ttft_tokens)
            first = {}
            for name in order:
                dt, first[name] = sides[name].ttft(p)
                ttfts[name].append(dt)
                say(f"ttft {name} {args.ttft_tokens} tokens: {dt:.3f} s")
            agree_first += first["ftserve"] == first["transformers"]
            p = prompt(args.prompt_tokens)
            toks = {}
            for name in order:
                out = sides[name].decode([p], args.decode_tokens)
                dts, toks[name] = out.step_s, out.tokens[0]
                steps[name] += dts
                say(f"decode {name}: {len(dts) / sum(dts):.1f} tokens/s (median step "
                    f"{statistics.median(dts) * 1e3:.1f} ms)")
            agree_decode.append(leading_agreement(toks["ftserve"], toks["transformers"]))
    ftserve.close()
    # On a shared box a run is slowed, never sped up, by its neighbours: the
    # headline is the best TTFT and the median decode step (robust to bursts);
    # the medians of whole runs are there for reference.
    stats = {k: {"ttft_best_s": min(ttfts[k]), "ttft_median_s": statistics.median(ttfts[k]),
                 "decode_tokens_per_s": 1.0 / statistics.median(steps[k]),
                 "decode_mean_tokens_per_s": len(steps[k]) / sum(steps[k])} for k in who}
    f, h = stats["ftserve"], stats["transformers"]
    return {
        "machine": {**machine_info(torch.device("cpu")), "threads": args.threads,
                    "transformers": hf.version},
        "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, str, bool, type(None)))},
        "model": model_dir if args.model else f"{PRESET} preset, random fp32 weights",
        "runs": {"ttft_s": ttfts, "decode_step_s": steps},
        "stats": stats,
        "ratios": {
            "decode_ftserve_over_hf": f["decode_tokens_per_s"] / h["decode_tokens_per_s"],
            "decode_mean_ftserve_over_hf": f["decode_mean_tokens_per_s"] / h["decode_mean_tokens_per_s"],
            "ttft_ftserve_over_hf": f["ttft_best_s"] / h["ttft_best_s"],
            "ttft_median_ftserve_over_hf": f["ttft_median_s"] / h["ttft_median_s"],
        },
        "greedy_agreement": {"first_token": f"{agree_first}/{args.repeats}",
                             "decode_leading_tokens": agree_decode, "of": args.decode_tokens + 1},
    }


def render(res: dict[str, Any]) -> str:
    s, r, a, m = res["stats"], res["ratios"], res["args"], res["machine"]
    f, h = s["ftserve"], s["transformers"]
    g = res["greedy_agreement"]
    return "\n".join([
        f"model: {res['model']}; {m['date_utc']}; torch {m['torch']}, transformers "
        f"{m['transformers']}, {m['threads']} threads, fp32, {a['repeats']} repeats",
        "",
        "| | ftserve | transformers | ftserve / transformers (target) |",
        "|---|---|---|---|",
        f"| TTFT, {a['ttft_tokens']}-token prompt, best | {f['ttft_best_s']:.3f} s | "
        f"{h['ttft_best_s']:.3f} s | {r['ttft_ftserve_over_hf']:.2f}x (<= 1.0) |",
        f"| TTFT, median | {f['ttft_median_s']:.3f} s | {h['ttft_median_s']:.3f} s | "
        f"{r['ttft_median_ftserve_over_hf']:.2f}x |",
        f"| decode batch 1 after {a['prompt_tokens']} tokens, median step | "
        f"{f['decode_tokens_per_s']:.1f} tokens/s | {h['decode_tokens_per_s']:.1f} tokens/s | "
        f"{r['decode_ftserve_over_hf']:.2f}x (>= 1.0) |",
        f"| decode, {a['decode_tokens']} tokens a run, mean | {f['decode_mean_tokens_per_s']:.1f} tokens/s | "
        f"{h['decode_mean_tokens_per_s']:.1f} tokens/s | {r['decode_mean_ftserve_over_hf']:.2f}x |",
        "",
        f"greedy agreement: first token {g['first_token']}, decode leading tokens "
        f"{g['decode_leading_tokens']} of {g['of']}",
    ])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with checkpoint(args.model, "float32") as model_dir:
        res = run(args, model_dir)
    if args.json:
        write_json(args.json, res)
    print(render(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
