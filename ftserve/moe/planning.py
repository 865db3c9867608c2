"""Start-up planning for offload mode: how many expert slots, checked against
what one decode step can need, logged as a split of where the weights live.

    --moe-cache-size N   N slots (global across layers)
    --moe-cache-auto     N from --memory-ratio: free VRAM after the resident
                         weights, minus activations, the two layer buffers and
                         the KV reserve (the explicit KV size, or AUTO_KV_SHARE
                         of what is left); capped at every expert.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ftserve.config import ConfigError, EngineConfig
from ftserve.models.config import ModelConfig
from ftserve.models.decoder import DecoderForCausalLM
from ftserve.moe.banks import HostBank, load_offloaded_model
from ftserve.moe.cache import ExpertCache

log = logging.getLogger(__name__)

AUTO_KV_SHARE = 0.25  # of the auto budget kept for the KV pool when its size is not given
# Same headroom as ftserve.engine.setup (activations per prefill token).
ACTIVATION_BYTES_PER_TOKEN = 64 * 1024


def offload_requested(cfg: EngineConfig) -> bool:
    return cfg.moe_cache_size is not None or cfg.moe_cache_auto


def required_slots(cfg: EngineConfig, mcfg: ModelConfig) -> int:
    """Distinct experts one decode step of one layer may need: min(batch * k, E)."""
    return min(cfg.max_running_requests * mcfg.num_experts_per_tok, mcfg.num_experts)


def plan_num_slots(cfg: EngineConfig, mcfg: ModelConfig, bank: HostBank, device: torch.device,
                   kv_bytes_per_token: int, reserve_bytes: int = 0) -> int:
    need = required_slots(cfg, mcfg)
    total = bank.num_layers * bank.num_experts
    if cfg.moe_cache_size is not None:
        n = cfg.moe_cache_size
        how = "--moe-cache-size"
    elif device.type != "cuda":
        n, how = total, "--moe-cache-auto (CPU: device memory is host memory)"
    else:
        free, _ = torch.cuda.mem_get_info(device)
        n = auto_slots(free, cfg, bank, kv_bytes_per_token, reserve_bytes)
        how = f"--moe-cache-auto ({free / 2**30:.1f} GiB free, --memory-ratio {cfg.memory_ratio})"
    if n < need:
        raise ConfigError(
            f"{how} gives {n} expert slots, but one decode step can need {need} distinct experts "
            f"in a layer (min(--max-running-requests {cfg.max_running_requests} x top-k "
            f"{mcfg.num_experts_per_tok}, {mcfg.num_experts} experts)); raise --moe-cache-size "
            f"to at least {need}, free memory (--memory-ratio, a smaller KV cache) or lower "
            f"--max-running-requests")
    return min(n, total)


def auto_slots(free_bytes: int, cfg: EngineConfig, bank: HostBank, kv_bytes_per_token: int,
               reserve_bytes: int = 0) -> int:
    """Slots that fit in ``free_bytes`` of VRAM (after the resident weights and
    ``reserve_bytes``: a hybrid model's recurrent-state pool, allocated later)."""
    total = bank.num_layers * bank.num_experts
    budget = (free_bytes * cfg.memory_ratio - cfg.max_prefill_length * ACTIVATION_BYTES_PER_TOKEN
              - reserve_bytes)
    if cfg.num_pages is not None:
        kv = cfg.num_pages * cfg.page_size * kv_bytes_per_token
    elif cfg.kv_cache_tokens is not None:
        kv = cfg.kv_cache_tokens * kv_bytes_per_token
    else:
        kv = budget * AUTO_KV_SHARE
    if (budget - kv) // bank.row_bytes >= total:
        return total  # everything fits: full mode, no layer buffers needed
    budget -= 2 * bank.num_experts * bank.row_bytes  # the two prefill layer buffers
    return max(0, min(total, int((budget - kv) // bank.row_bytes)))


def load_with_expert_cache(
    model_dir: str | Path, cfg: EngineConfig, device: torch.device, load_format: str,
    kv_bytes_per_token: int | None = None, reserve_bytes: int = 0,
) -> tuple[DecoderForCausalLM, ModelConfig, ExpertCache]:
    """Offload mode start-up: experts into host banks, the rest onto ``device``,
    then N slots + maps on the device. Called before the KV pool is sized, so
    the pool plans around the cache; ``reserve_bytes`` (a hybrid's state pool)
    stays free for what is allocated after it."""
    model, mcfg, bank = load_offloaded_model(model_dir, cfg.dtype, device, load_format, seed=cfg.seed)
    if kv_bytes_per_token is None:
        from ftserve.kvcache.pool import KVPool, kv_cache_torch_dtype
        from ftserve.models.loader import resolve_dtype

        # The model's dtype, not the bank's (an fp8 bank holds bytes); fp8 KV counts scales.
        kv_dtype = kv_cache_torch_dtype(cfg.kv_cache_dtype, resolve_dtype(cfg.dtype, device))
        kv_bytes_per_token = KVPool.bytes_per_token(len(mcfg.kv_layers), mcfg.num_kv_heads, mcfg.head_dim,
                                                    kv_dtype)
    n = plan_num_slots(cfg, mcfg, bank, device, kv_bytes_per_token, reserve_bytes)
    cache = ExpertCache(model, bank, n, mcfg.num_experts_per_tok, device)
    model.expert_cache = cache  # reachable from the runner's model (tests, benchmarks)
    s = cache.summary()
    resident = sum(p.numel() * p.element_size() for p in model.parameters() if not _is_bank_view(p, bank))
    log.info("MoE offload: resident weights %.2f GiB on %s; expert cache %d of %d experts (%.1f%%, "
             "%.2f GiB)%s; host banks %.2f GiB%s",
             resident / 2**30, device, s["slots"], s["experts"], 100 * s["slot_fraction"],
             s["slot_gib"], "" if cache.full else f" + 2 layer buffers ({s['buffer_gib']:.2f} GiB)",
             s["host_gib"], " pinned" if device.type == "cuda" else "")
    return model, mcfg, cache


def _is_bank_view(p: torch.Tensor, bank: HostBank) -> bool:
    return p.untyped_storage().data_ptr() == bank.data.untyped_storage().data_ptr()
