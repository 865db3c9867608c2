"""MoE expert offload: host banks, VRAM expert slots with LRU admission for
decode, double-buffered whole-layer streaming for prefill (see cache.py)."""

from ftserve.moe.banks import HostBank, load_offloaded_model
from ftserve.moe.cache import ExpertCache
from ftserve.moe.planning import load_with_expert_cache, offload_requested, plan_num_slots

__all__ = ["ExpertCache", "HostBank", "load_offloaded_model", "load_with_expert_cache",
           "offload_requested", "plan_num_slots"]
