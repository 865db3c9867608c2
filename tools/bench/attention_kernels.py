"""Attention kernel benchmarks for tools/bench/kernels: paged extend (prefill)
against SDPA flash, split-K decode by CUDA-graph replay with a config sweep, and
the KV store. Shapes: 32 q heads / 4 kv heads / head_dim 128, page 16.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F

from ftserve_kernels import attention_extend_triton as ate
from ftserve_kernels import attention_triton as at
from ftserve_kernels.paged_attention import paged_attention_ref
from tools.bench.kernel_harness import (
    HKV,
    HQ,
    PAGE,
    RESULTS,
    D,
    bench,
    bench_graph,
    check,
    record,
    rel_err,
)


def causal_flops(n_new: int, prefix: int, heads: int = HQ, d: int = D) -> float:
    # QK^T and PV: 2 * 2 * d per visible (query, key) pair.
    pairs = n_new * prefix + n_new * (n_new + 1) / 2
    return 4.0 * d * heads * pairs


def paged_case(kv_lens: list[int], seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A one-layer pool holding random KV for sequences of ``kv_lens`` on shuffled pages."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    need = [math.ceil(n / PAGE) for n in kv_lens]
    num_pages = sum(need) + 1
    kc = torch.randn(num_pages * PAGE, HKV, D, device="cuda", generator=g).bfloat16()
    vc = torch.randn(num_pages * PAGE, HKV, D, device="cuda", generator=g).bfloat16()
    perm = torch.randperm(num_pages - 1, device="cuda", generator=g).int() + 1
    table = torch.zeros(len(kv_lens), max(need), dtype=torch.int32, device="cuda")
    at_ = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[at_ : at_ + n]
        at_ += n
    return kc, vc, table


def gather(kc: torch.Tensor, table_row: torch.Tensor, n: int) -> torch.Tensor:
    slots = (table_row.long()[:, None] * PAGE + torch.arange(PAGE, device="cuda")).reshape(-1)
    return kc[slots[:n]]  # [n, Hkv, D]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lower_right: bool) -> torch.Tensor:
    """q [n, Hq, D], k/v [L, Hkv, D] contiguous; flash backend, causal aligned bottom-right."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    group = HQ // HKV
    qh = q.transpose(0, 1)[None]  # [1, Hq, n, D]
    kh = k.repeat_interleave(group, 1).transpose(0, 1)[None]  # [1, Hq, L, D]
    vh = v.repeat_interleave(group, 1).transpose(0, 1)[None]
    mask = causal_lower_right(q.shape[0], k.shape[0]) if lower_right else None
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
    except RuntimeError:  # flash unavailable for this case: let torch pick
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
    return out[0].transpose(0, 1)  # [n, Hq, D]


def bench_extend(n_new: int, total: int, quick: bool) -> None:
    prefix = total - n_new
    kc, vc, table = paged_case([total])
    q = torch.randn(n_new, HQ, D, device="cuda").bfloat16()
    indptr = torch.tensor([0, n_new], dtype=torch.int32, device="cuda")
    pre = torch.tensor([prefix], dtype=torch.int32, device="cuda")
    flops = causal_flops(n_new, prefix)
    # Oracle: the torch twin for the last 256 queries (fp32; the full problem would
    # need a 50 GB score matrix).
    tail = 256
    ref = paged_attention_ref(q[-tail:], kc, vc, table, [0, tail], [total], PAGE, D**-0.5)
    peer_key = f"sdpa_extend_{n_new}x{total}_tflops"
    try:
        k_full, v_full = gather(kc, table[0], total), gather(vc, table[0], total)
        secs = bench(lambda: sdpa(q, k_full, v_full, lower_right=True), 5)
        RESULTS["limits"][peer_key] = flops / secs / 1e12
        record(f"sdpa flash (contiguous) {n_new} over {total}", secs, tflops=flops / secs / 1e12)
    except RuntimeError as exc:  # the peer is optional; the kernel is still timed
        print(f"  SDPA peer unavailable: {str(exc)[:200]}")
    base = at.AttnKernelConfig()
    configs = [base]
    if not quick:
        configs += [
            replace(base, extend_block_n=128, extend_stages=2),
            replace(base, extend_stages=4),
            replace(base, extend_block_m=128, extend_warps=8),
            replace(base, extend_block_m=128, extend_block_n=128, extend_warps=8, extend_stages=2),
        ]
    for cfg in configs:
        tag = cfg.tag()
        out = torch.full_like(q, float("nan"))

        def run(cfg: at.AttnKernelConfig = cfg, out: torch.Tensor = out) -> torch.Tensor:
            return ate.extend_attention_triton(
                q, kc, vc, table, indptr, pre, n_new, PAGE, D**-0.5, cfg, out=out)

        try:
            run()
        except Exception as exc:  # a config that does not fit this GPU's shared memory
            print(f"  config {tag} failed: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        err = rel_err(out[-tail:], ref)
        check(f"extend_{n_new}x{total}_{tag}", bool(torch.isfinite(out).all()) and err < 2e-2,
              f"rel err vs torch twin (last {tail} queries) {err:.2e}")
        secs = bench(run, 5)
        tf = flops / secs / 1e12
        ratios = {"vs_matmul": tf / RESULTS["limits"]["matmul_tflops"]}
        if peer_key in RESULTS["limits"]:
            ratios["vs_sdpa"] = tf / RESULTS["limits"][peer_key]
        record(f"triton extend {n_new} over {total} [{tag}]", secs, tflops=tf, **ratios)


def bench_decode(batch: int, kv_len: int, quick: bool) -> None:
    """Split-K decode, timed by CUDA-graph replay (device time, as the engine runs
    it) for the default config and a sweep of tiles / stages / split targets."""
    kc, vc, table = paged_case([kv_len] * batch, seed=batch)
    q = torch.randn(batch, HQ, D, device="cuda").bfloat16()
    seq_lens = torch.full((batch,), kv_len, dtype=torch.int32, device="cuda")
    kv_bytes = 2 * batch * kv_len * HKV * D * 2
    rows = min(batch, 4)
    ref = paged_attention_ref(q[:rows], kc, vc, table, list(range(rows + 1)), [kv_len] * rows,
                              PAGE, D**-0.5)
    base = at.AttnKernelConfig()
    configs = [base]
    if not quick:
        configs += [
            replace(base, decode_block_n=128),
            replace(base, decode_stages=4),
            replace(base, decode_block_n=128, decode_warps=8),
            replace(base, decode_block_n=32, decode_stages=4),
            replace(base, decode_programs_per_sm=2),
            replace(base, decode_programs_per_sm=8, max_splits=256),
        ]
    for cfg in configs:
        be = at.TritonAttentionBackend(cfg=cfg)
        splits = be.num_splits(batch, HKV, q.device)
        tag = f"bn{cfg.decode_block_n}_w{cfg.decode_warps}_s{cfg.decode_stages}_sp{splits}"
        out = torch.full_like(q, float("nan"))

        def run(cfg: at.AttnKernelConfig = cfg, splits: int = splits,
                out: torch.Tensor = out) -> torch.Tensor:
            return at.decode_attention_triton(q, kc, vc, table, seq_lens, PAGE, D**-0.5, splits,
                                              cfg, out=out)

        try:
            run()
        except Exception as exc:  # a config this GPU cannot run: report, keep sweeping
            print(f"  config {tag} failed: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        err = rel_err(out[:rows], ref)
        check(f"decode_b{batch}_{kv_len}_{tag}", bool(torch.isfinite(out).all()) and err < 2e-2,
              f"rel err vs torch twin {err:.2e}")
        secs = bench_graph(run)
        gbps = kv_bytes / secs / 1e9
        record(f"triton decode b{batch} kv{kv_len} graph [{tag}]", secs, kv_gbps=gbps,
               vs_copy_read=gbps / (RESULTS["limits"]["copy_gbps"] / 2))
        if cfg is base:
            secs = bench(run, 20)
            record(f"triton decode b{batch} kv{kv_len} eager (incl. launch)", secs,
                   kv_gbps=kv_bytes / secs / 1e9)
    if batch == 1:
        # Peer: SDPA over contiguous MHA KV (32 heads) of the same length, graph-timed.
        km = torch.randn(1, HQ, kv_len, D, device="cuda").bfloat16()
        vm = torch.randn_like(km)
        qm = q[:1].transpose(0, 1)[None].contiguous()
        try:
            s2 = bench_graph(lambda: F.scaled_dot_product_attention(qm, km, vm))
        except RuntimeError as exc:  # the peer is optional
            print(f"  SDPA decode peer unavailable: {str(exc)[:200]}")
            return
        peer = 2 * km.numel() * 2 / s2 / 1e9
        RESULTS["limits"][f"sdpa_decode_{kv_len}_gbps"] = peer
        record(f"sdpa decode (MHA, contiguous) kv{kv_len} graph", s2, kv_gbps=peer)


def bench_store() -> None:
    t = 4096
    kc = torch.zeros(t * 4, HKV, D, device="cuda").bfloat16()
    vc = torch.zeros_like(kc)
    k = torch.randn(t, HKV, D, device="cuda").bfloat16()
    v = torch.randn_like(k)
    loc = torch.randperm(t * 4, device="cuda")[:t]
    at.store_kv_triton(kc, vc, k, v, loc)
    check("store_kv", torch.equal(kc[loc], k) and torch.equal(vc[loc], v), "exact")
    secs = bench(lambda: at.store_kv_triton(kc, vc, k, v, loc), 20)
    gbps = 4 * k.numel() * 2 / secs / 1e9
    record(f"store_kv T={t}", secs, gbps=gbps, vs_copy=gbps / RESULTS["limits"]["copy_gbps"])
