"""Device time of a verify step's attention (speculative decoding), CUDA only.

A verify step feeds each sequence its last token and k drafts (k + 1 new
tokens) over a long cached prefix. The verify graphs used to attend with the
extend kernel sized for the bucket, whose grid is one program per (query
head, 64-token block, sequence): at batch 1 a handful of programs, each
walking the whole prefix alone. They now attend with one split-K decode query
per token (AttentionMetadata.query_seq_lens). This times, per layer call, by
CUDA-graph replay (device time, as the graphs run it), at each batch size:

    decode      the plain decode step's attention (batch x 1 token)
    extend      the verify step through the extend kernel (the old path)
    per-query   the verify step as batch x (k + 1) decode queries (the new path)

and checks the two verify layouts agree. Shapes default to SmolLM2-135M's
(9 q heads, 3 kv heads, head_dim 64); ``--heads 32,4 --head-dim 128`` is
Qwen3-30B-A3B's.

    python -m tools.bench.verify_attention --context 2048 --batches 1,16
"""

from __future__ import annotations

import argparse
import math

import torch

from ftserve.engine.prefill_graph import verify_buckets
from ftserve_kernels import attention_extend_triton as ate
from ftserve_kernels import attention_triton as at
from tools.bench.common import write_json
from tools.bench.kernel_harness import bench_graph

PAGE = 16


def case(batch: int, k: int, context: int, hq: int, hkv: int, d: int) -> dict[str, float]:
    g = torch.Generator(device="cuda").manual_seed(batch)
    n = k + 1
    kv = context + n
    need = math.ceil(kv / PAGE)
    num_pages = batch * need + 1
    kc = torch.randn(num_pages * PAGE, hkv, d, device="cuda", generator=g).bfloat16()
    vc = torch.randn_like(kc)
    perm = torch.randperm(num_pages - 1, device="cuda", generator=g).int() + 1
    table = perm.view(batch, need)  # [B, W]
    bucket = next(b for b in verify_buckets(16, k) if b >= batch * n)
    scale = d ** -0.5
    be = at.TritonAttentionBackend()
    cfg = at.AttnKernelConfig.for_device(torch.device("cuda"), d)
    # Verify: bucket tokens, batch * n real ones, padding after (the graphs' layout).
    q = torch.randn(bucket, hq, d, device="cuda", generator=g).bfloat16()
    qo = torch.tensor([i * n for i in range(batch + 1)] + [batch * n] * (16 - batch), dtype=torch.int32,
                      device="cuda")
    prefix = torch.tensor([context] * batch + [0] * (16 - batch), dtype=torch.int32, device="cuda")
    full_table = torch.zeros(16, need, dtype=torch.int32, device="cuda")
    full_table[:batch] = table
    rows = torch.tensor([i for i in range(batch) for _ in range(n)] + [16] * (bucket - batch * n), device="cuda")
    table_dummy = torch.cat([full_table, torch.zeros_like(full_table[:1])])
    q_table = table_dummy.index_select(0, rows)  # [bucket, W]
    q_lens = torch.tensor([context + m + 1 for _ in range(batch) for m in range(n)]
                          + [1] * (bucket - batch * n), dtype=torch.int32, device="cuda")
    max_len = 8192  # the graphs' static bound (no short-context split cap)
    out_e, out_q = torch.empty_like(q), torch.empty_like(q)
    splits_q = be.num_splits(bucket, hkv, q.device, max_len)

    def extend() -> None:
        ate.extend_attention_triton(q, kc, vc, full_table, qo, prefix, bucket, PAGE, scale, cfg, out=out_e)

    def per_query() -> None:
        at.decode_attention_triton(q, kc, vc, q_table, q_lens, PAGE, scale, splits_q, cfg, out=out_q)

    qd = q[:batch].contiguous()
    out_d = torch.empty_like(qd)
    d_lens = torch.full((batch,), kv, dtype=torch.int32, device="cuda")
    splits_d = be.num_splits(batch, hkv, q.device, max_len)

    def decode() -> None:
        at.decode_attention_triton(qd, kc, vc, table, d_lens, PAGE, scale, splits_d, cfg, out=out_d)

    res = {"decode_us": bench_graph(decode) * 1e6, "extend_us": bench_graph(extend) * 1e6,
           "per_query_us": bench_graph(per_query) * 1e6}
    real = batch * n
    err = float((out_e[:real].float() - out_q[:real].float()).norm() / out_e[:real].float().norm())
    assert err < 2e-2, f"the two verify layouts disagree: rel err {err:.2e}"
    return {"batch": batch, "bucket": bucket, "splits": splits_q, "rel_err": err, **res}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--heads", default="9,3", help="q heads, kv heads")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("CUDA only (the kernels' CPU twins are not what this times)")
    hq, hkv = (int(x) for x in args.heads.split(","))
    rows = [case(int(b), args.k, args.context, hq, hkv, args.head_dim) for b in args.batches.split(",")]
    print(f"attention us per layer call (CUDA-graph replay), context {args.context}, k = {args.k}, "
          f"heads {hq}/{hkv} x {args.head_dim}")
    print(f"{'batch':>5} {'bucket':>6} {'decode':>9} {'extend':>9} {'per-query':>9} {'splits':>6}")
    for r in rows:
        print(f"{r['batch']:>5} {r['bucket']:>6} {r['decode_us']:9.1f} {r['extend_us']:9.1f} "
              f"{r['per_query_us']:9.1f} {r['splits']:>6}")
    if args.json:
        write_json(args.json, {"args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
