"""Device time of the candidate selection for the sort-free filters: torch.topk
against select_triton's radix select, by level width (bits), counting mode
block and grid size, at [B, 151,936] fp32;
each variant's result is checked against torch.topk's value set first.

    python -m tools.probe_select [OUT.json]
"""

from __future__ import annotations

import json
import sys

import torch

from ftserve_kernels.select_triton import top_candidates_triton
from tools.bench_sampler import VOCAB, replay_us

N = 272  # SHORT_K + the sampler's stop-id columns
VARIANTS = {  # name -> top_candidates_triton keywords
    "8 bits, 264 programs": dict(bits=8),
    "8 bits, 132 programs": dict(bits=8, target_programs=132),
    "8 bits, block 512, 600 programs": dict(bits=8, block=512, target_programs=600),
    "8 bits, 2048 programs": dict(bits=8, target_programs=2048),
    "4 bits, 264 programs": dict(bits=4),
}


def same_values(x: torch.Tensor, ids: torch.Tensor) -> bool:
    want = x.topk(N, dim=-1).values.sort(dim=-1).values
    return bool(torch.equal(x.gather(1, ids).sort(dim=-1).values, want))


def main() -> None:
    out: dict[str, float | str] = {}
    for b in (1, 8, 64):
        x = torch.randn(b, VOCAB, device="cuda") * 3.0
        us = replay_us(lambda x=x: x.topk(N, dim=-1, sorted=False))
        out[f"B={b} torch.topk"] = us
        print(f"B={b} torch.topk: {us:.1f} us", flush=True)
        for name, kw in VARIANTS.items():
            try:
                ok = same_values(x, top_candidates_triton(x, N, **kw))
                us = replay_us(lambda x=x, kw=kw: top_candidates_triton(x, N, **kw))
            except Exception as e:  # a variant that does not compile here: report, go on
                out[f"B={b} {name}"] = f"error: {type(e).__name__}: {str(e)[:200]}"
                print(f"B={b} {name}: {out[f'B={b} {name}']}", flush=True)
                continue
            out[f"B={b} {name}"] = us
            print(f"B={b} {name}: {us:.1f} us{'' if ok else '  WRONG VALUES'}", flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
