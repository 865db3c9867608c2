"""Device time of torch.topk over a [B, 151,936] row set, by dtype and k (a
probe for the sampler's sort-free filter, ftserve_kernels/filter_triton.py).

    python -m tools.probe_topk
"""

from __future__ import annotations

import json
import sys

import torch

from tools.bench_sampler import VOCAB, replay_us


def main() -> None:
    out = {}
    for b in (1, 8, 64):
        x = torch.randn(b, VOCAB, device="cuda")
        keys = x.view(torch.int32).to(torch.int64) * (1 << 32)
        for name, t in (("fp32", x), ("int64", keys)):
            for k in (64, 256):
                out[f"B={b} {name} k={k}"] = us = replay_us(lambda t=t, k=k: t.topk(k, dim=-1, sorted=True))
                print(f"B={b} {name} k={k}: {us:.1f} us", flush=True)
        out[f"B={b} sort fp32 stable"] = us = replay_us(lambda x=x: x.sort(dim=-1, descending=True, stable=True))
        print(f"B={b} sort fp32 stable: {us:.1f} us", flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
