"""The sampler's device time per decode step, by stage set, in CUDA graphs
(what a decode graph replays after the lm_head). CUDA only.

    python -m tools.bench.sampler --out bench_sampler.json

The engine captures a graph per batch size for each stage set in
``cuda_graph.SAMPLER_VARIANTS`` and replays the smallest that covers the
step's rows. This times ``Sampler.sample`` over [B, V] fp32 logits
(V = 151,936, Qwen3's vocabulary) for each stage set below at B = 1, 8, 64,
each captured once in a graph and replayed back to back (median us per replay),
next to the greedy fast path, so the cost of each stage is visible.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import torch

from ftserve.engine.sampler import Sampler, SamplerFeatures
from ftserve.engine.sampling_params import SamplingParams

VOCAB = 151_936
SETS = {
    "greedy (fused)": SamplerFeatures(),
    "temperature": SamplerFeatures(sampling=True),
    "temperature + top-k (<= 256) / top-p / min-p (sort-free, fused)": SamplerFeatures(sampling=True,
                                                                               filtering=True),
    "short filters + penalties (fused: Qwen3-Coder's defaults)": SamplerFeatures(
        sampling=True, filtering=True, penalties=True),
    "temperature + top-p alone or a long top-k (sorted)": SamplerFeatures(sampling=True, filtering=True,
                                                                           wide_filter=True),
    "+ penalties": SamplerFeatures(sampling=True, filtering=True, penalties=True, wide_filter=True),
    "+ logprobs": SamplerFeatures(sampling=True, filtering=True, penalties=True, logprobs=True,
                                  wide_filter=True),
    "all stages": SamplerFeatures.all(),
}


def replay_us(fn: Any, reps: int = 100, chain: int = 1) -> float:
    """Median device us of ``fn`` replayed in a CUDA graph; with ``chain`` > 1 the
    graph holds that many calls back to back and the time is per call (one
    in-graph launch gap each, as in a decode step)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(chain):
            fn()
    for _ in range(5):
        g.replay()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    ev[0].record()
    for e in ev[1:]:
        g.replay()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in zip(ev, ev[1:])) * 1e3 / chain


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench_sampler.json")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--top-k", type=int, default=20, help="every row's top_k (0 = off)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--logit-scale", type=float, default=1.0,
                   help="logits = scale * N(0, 1): larger is more peaked (a smaller nucleus)")
    args = p.parse_args()
    dev = torch.device("cuda")
    batches = [int(b) for b in args.batches.split(",")]
    sampler = Sampler(VOCAB, max(batches), dev, seed=0)
    for slot in range(max(batches)):
        sampler.admit(slot, SamplingParams(temperature=args.temperature, top_p=0.95, top_k=args.top_k, seed=slot),
                      list(range(50)), [2])
    g = torch.Generator(device=dev).manual_seed(0)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "vocab": VOCAB, "args": vars(args),
                           "rows": {}}
    print(f"| stages | {' | '.join(f'B={b} us' for b in batches)} |")
    print(f"|---|{'---|' * len(batches)}")
    for name, feats in SETS.items():
        row = {}
        for b in batches:
            logits = torch.randn(b, VOCAB, device=dev, generator=g) * args.logit_scale
            slots = torch.arange(b, device=dev)
            steps = torch.zeros(b, dtype=torch.int64, device=dev)
            active = torch.zeros(b, dtype=torch.bool, device=dev)
            last = torch.zeros(max(batches) + 1, dtype=torch.int64, device=dev)
            with torch.inference_mode(), sampler.forced_features(feats):
                row[b] = replay_us(lambda x=logits, s=slots, t=steps, a=active, o=last:
                                   sampler.sample(x, s, t, a, last=o))
        out["rows"][name] = row
        print(f"| {name} | {' | '.join(f'{row[b]:.1f}' for b in batches)} |", flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
