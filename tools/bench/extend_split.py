"""Device time of the split-K extend against the plain extend kernel, CUDA only.

A chunk of few new tokens over a long cached prefix (an agentic turn, a hybrid
model's 16-token tail chunk) gives the plain extend grid, one program per
(query head, 64-row block, sequence), a handful of programs that each walk the
whole prefix alone. The split-K launch deals each program's KV tiles to S
programs and combines their partials in a reduce launch
(attention_extend_triton.extend_split_attention_triton); the backend picks S from
host values (TritonAttentionBackend.extend_splits, policy extend_num_splits).

Per (head shape, new tokens, prefix), one sequence, page 16, bf16, timed per
layer call by CUDA-graph replay (device time):

    plain     extend_attention_triton (the path when S = 1)
    split     extend_split_attention_triton at the policy's S (S = 1: at
              --probe-splits, to show what splitting would cost there)
    ratio     plain / split (> 1: split-K is faster)
    grouped   the split-K launch with group_heads (a program per KV head serves
              all its query heads: K/V read once per group), S from the same
              policy over its grid; the backend takes the per-head launch

and checks the two agree (bf16 tolerance).

    python -m tools.bench.extend_split --out bench_extend_split.json
"""

from __future__ import annotations

import argparse
import math

import torch
import triton

from ftserve.models.forward_batch import AttentionMetadata
from ftserve_kernels import attention_extend_triton as ate
from ftserve_kernels import attention_triton as at
from tools.bench.common import write_json
from tools.bench.kernel_harness import bench_graph, rel_err

PAGE = 16


def case(hq: int, hkv: int, d: int, new: int, prefix: int, probe: int) -> dict[str, float | int]:
    g = torch.Generator(device="cuda").manual_seed(new + prefix)
    kv = prefix + new
    need = math.ceil(kv / PAGE)
    kc = torch.randn((need + 1) * PAGE, hkv, d, device="cuda", generator=g).bfloat16()
    vc = torch.randn_like(kc)
    table = (torch.randperm(need, device="cuda", generator=g).int() + 1).view(1, need)  # [1, W]
    q = torch.randn(new, hq, d, device="cuda", generator=g).bfloat16()
    qo = torch.tensor([0, new], dtype=torch.int32, device="cuda")
    pre = torch.tensor([prefix], dtype=torch.int32, device="cuda")
    scale = d ** -0.5
    cfg = at.AttnKernelConfig.for_device(q.device, d)
    meta = AttentionMetadata(page_size=PAGE, qo_indptr=qo, seq_lens=pre + new, prefix_lens=pre, page_table=table,
                             out_cache_loc=torch.zeros(new, dtype=torch.int64, device="cuda"),
                             seq_lens_host=[kv], prefix_lens_host=[prefix], max_seq_len=kv, max_extend_len=new)
    policy = at.TritonAttentionBackend().extend_splits(hq, meta, cfg, q.device)
    splits = policy if policy > 1 else probe
    out_p, out_s = torch.empty_like(q), torch.empty_like(q)

    def plain() -> None:
        ate.extend_attention_triton(q, kc, vc, table, qo, pre, new, PAGE, scale, cfg, out=out_p)

    def split() -> None:
        ate.extend_split_attention_triton(q, kc, vc, table, qo, pre, new, PAGE, scale, splits, cfg, out=out_s)

    # Grouped: a program serves the GQA group's query heads (rows = tokens x group), so
    # each K/V tile is read once per KV head; S from the same policy over its own grid.
    bg = triton.next_power_of_2(hq // hkv)
    rows_g = max(ate.extend_split_block_m(new * bg, cfg), bg)
    pol_g = ate.extend_num_splits(hkv * triton.cdiv(new, rows_g // bg), triton.cdiv(kv, cfg.extend_block_n),
                                 at._num_sms(q.device), cfg)
    splits_g = pol_g if pol_g > 1 else probe
    out_g = torch.empty_like(q)

    def grouped() -> None:
        ate.extend_split_attention_triton(q, kc, vc, table, qo, pre, new, PAGE, scale, splits_g, cfg, out=out_g,
                                         group_heads=True)

    plain_us, split_us, grouped_us = (bench_graph(f) * 1e6 for f in (plain, split, grouped))
    err = max(rel_err(out_s, out_p), rel_err(out_g, out_p))
    assert err < 2e-2, f"split-K disagrees with the plain kernel: rel err {err:.2e}"
    # K and V bytes the chunk must read at least once (every KV head, the whole range).
    mib = 2 * kv * hkv * d * 2 / 2**20
    return {"heads": f"{hq}/{hkv}x{d}", "new": new, "prefix": prefix, "policy_splits": policy,
            "splits": splits, "plain_us": plain_us, "split_us": split_us, "ratio": plain_us / split_us,
            "grouped_splits": splits_g, "grouped_probe": pol_g == 1, "grouped_us": grouped_us, "grouped_ratio": plain_us / grouped_us,
            "kv_mib": mib, "rel_err": err}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new", default="16,64,256,4096", help="new tokens per chunk")
    ap.add_argument("--prefix", default="0,8192,100000", help="cached prefix lengths")
    ap.add_argument("--heads", default="16,2,256;32,4,128", help="q heads,kv heads,head_dim; ...")
    ap.add_argument("--probe-splits", type=int, default=8, help="S timed where the policy keeps 1")
    ap.add_argument("--out", default=None, help="write the rows here as JSON")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("CUDA only (the kernels' CPU interpreter is not what this times)")
    rows = []
    for shape in args.heads.split(";"):
        hq, hkv, d = (int(x) for x in shape.split(","))
        for prefix in (int(x) for x in args.prefix.split(",")):
            for new in (int(x) for x in args.new.split(",")):
                rows.append(case(hq, hkv, d, new, prefix, args.probe_splits))
                torch.cuda.empty_cache()
    print(f"extend attention, us per layer call (CUDA-graph replay), {torch.cuda.get_device_name()}, page {PAGE}")
    print()
    print("| heads | new | prefix | K+V MiB | S (policy) | plain us | split-K us | plain / split "
          "| grouped S | grouped us | plain / grouped |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        s = f"{r['policy_splits']}" if r["policy_splits"] > 1 else f"1 (probe {r['splits']})"
        print(f"| {r['heads']} | {r['new']} | {r['prefix']} | {r['kv_mib']:.0f} | {s} | {r['plain_us']:.1f} | "
              f"{r['split_us']:.1f} | {r['ratio']:.2f} | {r['grouped_splits']}{' (probe)' if r['grouped_probe'] else ''} "
              f"| {r['grouped_us']:.1f} "
              f"| {r['grouped_ratio']:.2f} |")
    if args.out:
        write_json(args.out, {"args": vars(args), "device": torch.cuda.get_device_name(), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
