"""Every FTSERVE_* environment variable, typed, in one place.

Read at call time (not import time) so tests and benchmarks can flip them per
run. Kernel switches that are off by default exist until the H200 numbers say
which variant wins; see BENCHMARKS.md.
"""

from __future__ import annotations

import os
from pathlib import Path


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value not in ("0", "false", "False", "no")


def cache_dir() -> Path:
    """FTSERVE_CACHE_DIR: where the embedded demo checkpoint is written
    (default ~/.cache/ftserve)."""
    return Path(os.environ.get("FTSERVE_CACHE_DIR", Path.home() / ".cache" / "ftserve"))


def kernels() -> str:
    """FTSERVE_KERNELS: auto (Triton on CUDA tensors, torch elsewhere) | triton | torch."""
    return os.environ.get("FTSERVE_KERNELS", "auto")


def decode_fusion() -> bool:
    """FTSERVE_DECODE_FUSION (default on): residual add + RMSNorm + router +
    top-k in one launch for decode-sized batches."""
    return _flag("FTSERVE_DECODE_FUSION", True)


def decode_down_norm() -> bool:
    """FTSERVE_DECODE_DOWN_NORM (default on): at decode GEMV sizes the MoE down
    kernel also adds the residual and applies the next layer's input norm (or
    the final norm) in its epilogue (moe_down_gemv_triton._add_then_norm_last), one
    launch fewer per layer. H200 (tools.bench_decode_variants, 2026-12-01 17:23
    UTC): batch-1 graph replay 0.606 ms with it, 0.614 without, same tokens."""
    return _flag("FTSERVE_DECODE_DOWN_NORM", True)


def decode_defer_norm() -> bool:
    """FTSERVE_DECODE_DEFER_NORM (default on): where the MoE down kernel folds
    the next layer's input norm (FTSERVE_DECODE_DOWN_NORM) and that layer's qkv
    runs on the Triton GEMV, the norm is left pending: each down program stores
    its columns of weight * sum and their sum of squares, and the qkv GEMV adds
    those up and scales its dot by 1/rms at the end (the normed row is never
    rounded to bf16 on its own).
    Without it the down kernel's last program norms the whole row, a serial
    tail (1.9 us a layer on the H200, 2026-12-01). H200, 2026-12-02, 32k
    context, batch 1: replay 0.694 ms with it, 0.701 without (down 8.5 us
    instead of 10.8, qkv 7.2 instead of 6.6). The rounding differs from
    fused_add_rms_norm's (within bf16 tolerance), so greedy tokens may differ
    from a path that rounds the normed row (an expert cache's layers)."""
    return _flag("FTSERVE_DECODE_DEFER_NORM", True)


def route_block_e() -> int:
    """FTSERVE_ROUTE_BLOCK_E (default 1): router experts per program of the fused
    norm + router + top-k kernel (decode_fused_triton): E / it one-warp programs,
    each streaming that many router rows (a power of two). H200, 2026-12-02,
    batch-1 replay (tools.bench_decode_variants --trace): the kernel took 6.3 us
    a layer at 4 (32 programs of 16 KB), 5.8 at 2, 5.4 at 1, 29 at 8; replay
    2k 0.577 / 0.574 / 0.570 ms at 4 / 2 / 1, 32k 0.696 / 0.690 at 4 / 1."""
    value = int(os.environ.get("FTSERVE_ROUTE_BLOCK_E", "1") or 1)
    if value < 1 or value & (value - 1):
        raise ValueError(f"FTSERVE_ROUTE_BLOCK_E={value}: a power of two, at least 1")
    return value


def decode_route_in_oproj() -> bool:
    """FTSERVE_DECODE_ROUTE_IN_OPROJ (default on): at one decode row, a MoE
    layer's o_proj launch also computes its router logits (times rms, from
    weights folded at load: ftserve_kernels/oproj_route_triton.py) and their
    top-k, and leaves the post-attention norm pending for the expert gate/up
    launch, which also weighs the chosen experts: no norm + route launch.
    H200, 2026-12-02, batch-1 graph replay (tools.bench_decode_variants
    --trace): 2k 0.563 -> 0.546 ms, 32k 0.680 -> 0.663 (o_proj 6.0 -> 7.9 us,
    gate/up 14.3 -> 16.3, the 5.5 us route launch and its gap gone). The
    logits are not rounded through the normed row, so near-ties may pick
    other experts than the unfused path (greedy tokens differ from it after a
    few steps, within bf16 tolerance). Folded tensors: 1.5 MB a layer at
    qwen3-30b-a3b's shape; after changing weights in place with graphs
    captured, call the model's refresh_derived()."""
    return _flag("FTSERVE_DECODE_ROUTE_IN_OPROJ", True)


def oproj_route_block_e() -> int:
    """FTSERVE_OPROJ_ROUTE_BLOCK_E (default 2): router rows per program of the
    o_proj + route launch (FTSERVE_DECODE_ROUTE_IN_OPROJ); a power of two."""
    value = int(os.environ.get("FTSERVE_OPROJ_ROUTE_BLOCK_E", "2"))
    if value < 1 or value & (value - 1):
        raise ValueError(f"FTSERVE_OPROJ_ROUTE_BLOCK_E must be a power of two >= 1, got {value}")
    return value


def decode_input_norm() -> bool:
    """FTSERVE_DECODE_INPUT_NORM (default on): a decode step applies the first
    layer's input norm where it gathers the embedding rows (the decode graph's
    inputs launch, or one launch for both in an eager step), so layer 0's qkv
    is a plain GEMV like the later layers', and no norm launch of its own runs."""
    return _flag("FTSERVE_DECODE_INPUT_NORM", True)


def radix_select() -> bool:
    """FTSERVE_RADIX_SELECT (default on): the sort-free filters find each row's
    candidates with select_triton's radix select instead of torch.topk at
    batches up to filter_triton.RADIX_MAX_ROWS (where it is faster)."""
    return _flag("FTSERVE_RADIX_SELECT", True)


def lm_head_gemv() -> bool:
    """FTSERVE_LM_HEAD_GEMV (default on): the Triton GEMV for a one-row lm_head
    (batch-1 decode) instead of cuBLAS. H200 (tools.bench_decode_variants,
    2026-11-30 04:53 UTC): batch-1 graph replay 0.673 -> 0.667 ms, same tokens."""
    return _flag("FTSERVE_LM_HEAD_GEMV", True)


def moe_read_through() -> bool:
    """FTSERVE_MOE_READ_THROUGH (default on): with an expert-slot cache, decode's
    expert GEMVs read this step's misses from the host bank themselves (writing
    the slots as they pass) instead of a fill kernel copying them first."""
    return _flag("FTSERVE_MOE_READ_THROUGH", True)


def gemv_entries() -> str:
    """FTSERVE_GEMV_ENTRY: GEMV launch entries laid over the device table, for
    in-context tuning runs (tools.bench_decode_variants): ``KEY@T=BN.BK.W.S``
    joined by ";", KEY the table key with "+" for its commas, e.g.
    "dense:N=2048+K=4096@1=4.512.8.3" (gemv_configs.parse_entries)."""
    return os.environ.get("FTSERVE_GEMV_ENTRY", "")


def moe_config_file() -> Path | None:
    """FTSERVE_MOE_CONFIG_FILE: a MoE tile table (tools/tune_moe.py output) used
    instead of the packaged ftserve_kernels/configs/moe_<device>.json."""
    value = os.environ.get("FTSERVE_MOE_CONFIG_FILE")
    return Path(value) if value else None


def gemv_config_file() -> Path | None:
    """FTSERVE_GEMV_CONFIG_FILE: a decode GEMV launch table (tools/tune_gemv.py
    output) used instead of the packaged ftserve_kernels/configs/gemv_<device>.json."""
    value = os.environ.get("FTSERVE_GEMV_CONFIG_FILE")
    return Path(value) if value else None


def kv_layered_restore() -> bool:
    """FTSERVE_KV_LAYERED_RESTORE (default on): a KV host-tier restore streams
    in layer by layer under the step's compute (HostKVTier.flush(layered=True))
    instead of one batched copy before the step. On the H200 (2026-11-30 02:42,
    tools.bench_kv_tiers turn 8, 114,688 restored tokens) layered took 0.875 s
    TTFT vs 0.896 s batched vs 0.857 s for a device hit: the restore costs
    18 ms instead of 39 ms. Set 0 for the batched copy."""
    return _flag("FTSERVE_KV_LAYERED_RESTORE", True)


def pdl() -> bool:
    """FTSERVE_PDL (default on): decode-path Triton kernels launch with
    programmatic dependent launch on sm_90+ (ftserve_kernels/pdl.py); 0: off."""
    return _flag("FTSERVE_PDL", True)


def fused_kv_store() -> bool:
    """FTSERVE_FUSED_KV_STORE (default on): for q/k-normed models (Qwen3) with a
    float KV cache, the q/k norm + rotary launch also stores K and V into their
    pages, one launch fewer per layer (H200 2026-11-30, decode replay 0.678 ->
    0.674 ms, identical tokens). Set 0 for the backend's own store kernel."""
    return _flag("FTSERVE_FUSED_KV_STORE", True)


def decode_qk_fold() -> bool:
    """FTSERVE_DECODE_QK_FOLD (default on): at decode, Qwen3's per-head q/k norms,
    the rotary and the KV store run inside the split-K attention launch
    (TritonAttentionBackend.decode_qk) instead of a launch of their own before it.
    H200 (tools.bench_decode_variants, 2026-12-01 14:12 and 14:17 UTC): batch-1
    graph replay 0.612 / 0.614 ms with it, 0.627 / 0.627 without."""
    return _flag("FTSERVE_DECODE_QK_FOLD", True)


def step_copy_kernel() -> bool:
    """FTSERVE_STEP_COPY_KERNEL (default on): a decode step's input words go to
    the device, and its sampled tokens to pinned host memory, through a small
    kernel reading / writing the pinned buffer over UVA
    (bookkeeping.copy_host_words) rather than as copy-engine memcpys. Only
    where a CUDA tensor is involved. On (H200, 2026-12-01, batch 1, the engine
    loop's GPU timeline from tools.bench_decode_variants --trace): 11.5 us
    between two decode graphs at 2k context against 17.3 with the memcpys,
    12.2 against 18.1 at 32k."""
    return _flag("FTSERVE_STEP_COPY_KERNEL", True)
