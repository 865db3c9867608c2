"""Frozen configuration, resolved once at start-up.

"auto" values are replaced with ``dataclasses.replace`` by ``resolve()``;
validation errors name the flag to change.
"""

from __future__ import annotations

from dataclasses import dataclass


class ConfigError(ValueError):
    """A start-up setting is invalid; the message names the flag to change."""


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # checkpoint dir; None = embedded demo model
    load_format: str = "auto"  # auto | safetensors | dummy
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32
    # fp8_e4m3 (alias fp8): e4m3 codes + one fp32 scale per token and KV head, ~half of bf16.
    kv_cache_dtype: str = "auto"  # auto (= the model dtype) | bfloat16 | float16 | float32 | fp8_e4m3
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    page_size: int = 16
    num_pages: int | None = None  # KV pool pages (incl. the dummy page)
    kv_cache_tokens: int | None = None  # alternative to num_pages
    memory_ratio: float = 0.9  # of total device memory: weights + activations + KV (CUDA)
    max_prefill_length: int = 4096  # tokens per prefill chunk per step
    max_running_requests: int = 64
    max_model_len: int | None = None  # None = the model's limit
    attention_backend: str = "auto"  # auto | torch | triton
    cuda_graph_max_bs: int = 64  # 0 disables CUDA graphs
    cuda_graph_prefill: bool = True  # also capture prefill steps per token budget (CUDA)
    enable_prefix_cache: bool = True
    overlap_schedule: bool = True  # plan step N+1 while step N runs on the device
    seed: int = 0
    status_log_interval: float = 10.0  # seconds between one-line status logs; 0 = off
    moe_cache_size: int | None = None  # expert slots in VRAM (offload mode); None = resident
    moe_cache_auto: bool = False  # offload mode, slots sized from --memory-ratio
    kv_host_pages: int | None = None  # host-tier KV pages (pinned); None = no host tier
    kv_host_gib: float | None = None  # alternative to kv_host_pages, in GiB of host memory

    def validate(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ConfigError("--page-size must be a power of two >= 1")
        if self.max_prefill_length < self.page_size:
            raise ConfigError("--max-prefill-length must be at least --page-size")
        if self.max_running_requests < 1:
            raise ConfigError("--max-running-requests must be at least 1")
        if not 0.0 < self.memory_ratio <= 1.0:
            raise ConfigError("--memory-ratio must be in (0, 1]")
        if self.num_pages is not None and self.num_pages < 2:
            raise ConfigError("--num-pages must be at least 2")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ConfigError("--dtype must be auto, bfloat16, float16 or float32")
        if self.kv_cache_dtype not in ("auto", "bfloat16", "float16", "float32", "fp8_e4m3", "fp8"):
            raise ConfigError("--kv-cache-dtype must be auto, bfloat16, float16, float32 or fp8_e4m3")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ConfigError("--load-format must be auto, safetensors or dummy")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ConfigError("--attention-backend must be auto, torch or triton")
        if self.moe_cache_size is not None and self.moe_cache_size < 1:
            raise ConfigError("--moe-cache-size must be at least 1")
        if self.moe_cache_size is not None and self.moe_cache_auto:
            raise ConfigError("give --moe-cache-size or --moe-cache-auto, not both")
        if self.kv_host_pages is not None and self.kv_host_gib is not None:
            raise ConfigError("give --kv-host-pages or --kv-host-gib, not both")
        if self.kv_host_pages is not None and self.kv_host_pages < 1:
            raise ConfigError("--kv-host-pages must be at least 1")
        if self.kv_host_gib is not None and not self.kv_host_gib > 0:
            raise ConfigError("--kv-host-gib must be > 0")
        if (self.kv_host_pages is not None or self.kv_host_gib is not None) and (
                not self.enable_prefix_cache):
            raise ConfigError("the KV host tier keeps prefix-cache pages: drop "
                              "--disable-prefix-cache or the --kv-host-* flag")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # default: the model dir's name
    api_key: str | None = None
    max_queued_requests: int = 256
    max_body_bytes: int = 32 * 1024 * 1024
    drain_timeout: float = 30.0  # seconds SIGTERM waits for in-flight requests
    keepalive_interval: float = 5.0  # seconds between SSE keep-alive comments
    # "auto": a chat template with think tags gets the model's reasoning back as
    # reasoning_content (server/reasoning.py); "none": it stays in the content.
    reasoning_parser: str = "auto"
    log_requests: bool = False
