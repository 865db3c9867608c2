"""Does the bulk L2 prefetch land, and how many programs must issue it?

    python -m tools.bench_l2_prefetch --out l2_prefetch.json    # sm_90+, ~10 s

One weight-sized buffer (--mb, 16 MB: o_proj at qwen3-30b-a3b) is read by a
streaming kernel that fills every SM. Each trial first evicts L2 (writes a
256 MB buffer), then optionally has P programs prefetch the buffer
(ftserve_kernels/l2_prefetch.issue), waits a fixed time on the GPU
(torch.cuda._sleep), and times only the read (CUDA events, median of
--iters). The read's GB/s against the cold read says whether the bytes were in
L2; P = 1 .. 4 x SMs says how spread the issue must be; the wait, how soon they
land.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch
import triton
import triton.language as tl

from ftserve_kernels import l2_prefetch
from tools.bench_common import machine_info, say, write_json


@triton.jit
def _prefetch_kernel(x_ptr, nbytes, NT: tl.constexpr):
    l2_prefetch.issue(x_ptr, nbytes, tl.program_id(0), tl.num_programs(0), NT, True)


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # Each program sums a contiguous stripe; one float out per program.
    p = tl.program_id(0)
    per = tl.cdiv(n, tl.num_programs(0))
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(p * per, tl.minimum((p + 1) * per, n), BLOCK):
        offs = i + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < tl.minimum((p + 1) * per, n), other=0.0).to(tl.float32)
    tl.store(out_ptr + p, tl.sum(acc, 0))


def run(mb: int, iters: int, waits_us: list[float]) -> dict[str, Any]:
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    x = torch.randn(mb << 19, device=dev, dtype=torch.bfloat16)  # mb MB
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    out = torch.empty(4 * sms, device=dev)
    nbytes = x.numel() * 2 // 16 * 16
    hz = getattr(torch.cuda.get_device_properties(dev), "clock_rate", 0) * 1e3 or 1.98e9  # kHz -> Hz

    def trial(programs: int, wait_us: float) -> float:
        flush.fill_(1)
        if programs:
            _prefetch_kernel[(programs,)](x, nbytes, NT=128, num_warps=4)
        if wait_us:
            torch.cuda._sleep(int(wait_us * 1e-6 * hz))
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        _read_kernel[(4 * sms,)](x, out, x.numel(), BLOCK=2048, num_warps=8)
        b.record()
        b.synchronize()
        return a.elapsed_time(b) * 1e3  # us

    rows = []
    for wait in waits_us:
        for programs in (0, 1, 8, 32, sms, 4 * sms):
            trial(programs, wait)  # warm-up / compile
            us = statistics.median(trial(programs, wait) for _ in range(iters))
            rows.append({"programs": programs, "wait_us": wait, "read_us": us, "gbps": nbytes / us / 1e3})
            say(f"wait {wait:5.1f} us  programs {programs:4d}  read {us:6.2f} us  {nbytes / us / 1e3:7.0f} GB/s")
    return {"mb": mb, "sms": sms, "clock_hz": hz, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="l2_prefetch.json")
    p.add_argument("--mb", type=int, default=16)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--waits-us", default="0,5,20")
    args = p.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        raise SystemExit("bench_l2_prefetch needs an sm_90+ GPU")
    res = {"machine": machine_info(torch.device("cuda")),
           **run(args.mb, args.iters, [float(w) for w in args.waits_us.split(",")])}
    write_json(args.out, res)


if __name__ == "__main__":
    main()
