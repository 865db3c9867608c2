"""Start-up: resolve the config, load the model, size the KV pool (and a hybrid
model's state pool), build the engine."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from ftserve import envs
from ftserve.config import ConfigError, EngineConfig
from ftserve.engine.engine import Engine
from ftserve.engine.runner import ModelRunner
from ftserve.engine.sampler import Sampler
from ftserve.engine.scheduler import Scheduler
from ftserve.engine.spec.gate import SpecGate
from ftserve.engine.spec.speculator import Speculator
from ftserve.kvcache.host_tier import HostKVTier
from ftserve.kvcache.pool import KVPool, kv_cache_torch_dtype
from ftserve.kvcache.state_pool import StateLayout, StatePool
from ftserve_kernels.config import KernelConfig

log = logging.getLogger(__name__)

DEMO_PRESET = "tiny-moe"
CPU_DEFAULT_KV_TOKENS = 65536
# A hybrid's recurrent states accumulate over the whole sequence: fp32, as the
# reference implementation keeps them (the conv states take the model's dtype).
STATE_DTYPE = torch.float32


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda was asked for but no CUDA device is available")
        if dev.index is None:  # an explicit index: set_device and mem_get_info need one
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def demo_model_dir() -> str:
    """Write (once) the embedded demo checkpoint: config + real tokenizer, no weights."""
    from ftserve.models.checkpoint import write_checkpoint

    root = envs.cache_dir()
    out = root / f"demo-{DEMO_PRESET}"
    if not (out / "config.json").exists() or not (out / "tokenizer_config.json").exists():
        write_checkpoint(DEMO_PRESET, out, config_only=True)
    return str(out)


def read_eos_ids(model_dir: str, model_config: Any) -> list[int]:
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        p = Path(model_dir) / name
        if p.exists():
            val = json.loads(p.read_text()).get("eos_token_id")
            if isinstance(val, int):
                ids.append(val)
            elif isinstance(val, list):
                ids.extend(int(v) for v in val)
        if ids:
            break
    if not ids:  # a GGUF has no side files: its metadata's end-of-generation ids
        ids = list(getattr(model_config, "eos_token_ids", ()))
    return sorted(set(ids))


def kernel_config(cfg: EngineConfig, device: torch.device) -> KernelConfig:
    """The engine's kernel choices, fixed for its life and logged once: --kernels,
    --disable-pdl and the table files FTSERVE_GEMV_CONFIG_FILE /
    FTSERVE_MOE_CONFIG_FILE name (read here, nowhere else). The tables load
    now: a bad one fails at start-up, not at the first launch that needs it."""
    gemv, moe = envs.gemv_config_file(), envs.moe_config_file()
    kernels = KernelConfig(backend=cfg.kernels, pdl=cfg.pdl, gemv_table=None if gemv is None else str(gemv),
                           moe_table=None if moe is None else str(moe))
    try:
        entries = kernels.check_tables(device)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    log.info("kernels: %s; table entries %s", kernels.summary(), entries)
    return kernels


def build_engine(cfg: EngineConfig) -> Engine:
    from ftserve.models.config import ModelConfig
    from ftserve.models.loader import load_model, resolve_dtype

    cfg.validate()
    device = resolve_device(cfg.device)
    kernels = kernel_config(cfg, device)
    is_demo = cfg.model is None
    model_dir = demo_model_dir() if is_demo else cfg.model
    assert model_dir is not None
    load_format = cfg.load_format
    if load_format == "auto":
        load_format = "dummy" if is_demo else "safetensors"
    # The config alone first: a hybrid's state pool (with a verify step's log under
    # --speculative) is known before the expert cache is sized.
    plan_cfg = ModelConfig.from_pretrained(model_dir)
    state_slots, checkpoints = _state_slots(cfg, plan_cfg)
    verify_tokens = _verify_tokens(cfg) if state_slots else 0
    state_bytes = (StateLayout.from_config(plan_cfg).pool_bytes(
        state_slots, resolve_dtype(cfg.dtype, device), STATE_DTYPE, verify_tokens) if state_slots else 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(cfg.seed)
    use_mtp = _wants_mtp(cfg, model_dir, plan_cfg, load_format)
    moe_cache = None
    if cfg.moe_cache_size is not None or cfg.moe_cache_auto:
        # Offload mode: experts in host banks, N slots in VRAM (sized before the KV
        # pool, leaving room for the state pool).
        from ftserve.moe.planning import load_with_expert_cache

        model, mcfg, moe_cache = load_with_expert_cache(model_dir, cfg, device, load_format,
                                                        reserve_bytes=state_bytes)
    else:
        model, mcfg = load_model(model_dir, dtype=cfg.dtype, device=device, load_format=load_format,
                                 mtp=use_mtp)
    dtype = next(model.parameters()).dtype
    model_limit = int(mcfg.max_context_len)
    if cfg.max_model_len is not None and cfg.max_model_len > model_limit:
        raise ConfigError(
            f"--max-model-len {cfg.max_model_len} exceeds the model's rope table "
            f"({model_limit} positions); serving past it would read out of bounds. Lower "
            f"--max-model-len or extend the checkpoint's rope_scaling")

    # --kv-cache-dtype: the pool's dtype (fp8: codes + scales, both counted per token).
    # A hybrid's pool holds its full-attention layers only (ModelConfig.kv_layers).
    kv_dtype = kv_cache_torch_dtype(cfg.kv_cache_dtype, dtype)
    # The MTP layer keeps its K/V as one more pool layer (spec/mtp.py).
    pool_layers = len(mcfg.kv_layers) + (1 if use_mtp else 0)
    per_token = KVPool.bytes_per_token(pool_layers, mcfg.num_kv_heads, mcfg.head_dim, kv_dtype)
    num_pages = _plan_pages(cfg, device, per_token, model, mcfg, kernels, state_bytes)
    pool = KVPool(pool_layers, num_pages, cfg.page_size, mcfg.num_kv_heads, mcfg.head_dim,
                  kv_dtype, device)
    state_pool = (StatePool.for_model(mcfg, state_slots, dtype, STATE_DTYPE, device, verify_tokens)
                  if state_slots else None)
    pool_tokens = pool.usable_pages * cfg.page_size
    max_model_len = min(model_limit, cfg.max_model_len or model_limit, pool_tokens)
    eos = read_eos_ids(model_dir, mcfg)
    host_tier = _host_tier(cfg, pool, state_pool, checkpoints)
    scheduler = Scheduler(
        page_size=cfg.page_size, num_pages=num_pages, max_running=cfg.max_running_requests,
        max_prefill_length=cfg.max_prefill_length, max_model_len=max_model_len,
        eos_token_ids=eos, enable_prefix_cache=cfg.enable_prefix_cache, host_tier=host_tier,
        state_pool=state_pool, max_checkpoints=checkpoints, checkpoint_pages=cfg.state_checkpoint_pages,
        speculator=_speculator(cfg, max_model_len),
    )
    sampler = Sampler(mcfg.vocab_size, cfg.max_running_requests, device, seed=cfg.seed, kernels=kernels)
    backend = _attention_backend(cfg, device)
    runner = ModelRunner(model, pool, backend, sampler, device,
                         max_running=cfg.max_running_requests, max_model_len=max_model_len,
                         eos_token_ids=eos, kernels=kernels)
    runner.kv_host = host_tier
    runner.state_pool = state_pool
    if use_mtp and scheduler.spec is not None:
        from ftserve.engine.spec.mtp import MTPDrafter

        # Tracks every request that may draft, not only those drafting now: one
        # in back-off still needs its MTP KV for its later drafts (spec/mtp.py).
        runner.mtp = MTPDrafter(runner, cfg.num_speculative_tokens, scheduler.spec.supports)
    graph_bs = min(cfg.cuda_graph_max_bs, cfg.max_running_requests)
    if device.type == "cuda" and graph_bs > 0 and getattr(backend, "name", "") == "triton":
        from ftserve.engine.cuda_graph import DecodeGraphs

        runner.graphs = DecodeGraphs(runner, graph_bs)
        runner.graphs.capture()
        if cfg.cuda_graph_prefill and moe_cache is None:
            # Offload mode streams expert layers on a side stream during prefill,
            # which a captured graph cannot follow: it stays eager there. Hybrids
            # capture both kinds: their slots are a static index input, and the
            # state work that is not fixed-shape runs around the replay (a chunk's
            # checkpoint loads before it, saves after it; a verify step's commit
            # after its sampling: prefill_graph.py).
            from ftserve.engine.prefill_graph import PrefillGraphs

            runner.prefill_graphs = PrefillGraphs(
                runner, cfg.max_prefill_length, min(cfg.max_running_requests, 16))
            runner.prefill_graphs.capture()
            if scheduler.spec is not None:
                # Verify steps: up to 16 sequences, each with a full draft at most
                # (with MTP, the draft chain and the MTP pass beside the replay run
                # eagerly: spec/mtp.py).
                from ftserve.engine.prefill_graph import verify_buckets

                seqs = min(cfg.max_running_requests, 16)
                buckets = verify_buckets(seqs, cfg.num_speculative_tokens)
                runner.verify_graphs = PrefillGraphs(runner, buckets[-1], seqs, buckets=buckets,
                                                     all_rows=True,
                                                     seq_tokens=cfg.num_speculative_tokens + 1)
                runner.verify_graphs.capture()
    # Device-resident only (offload mode keeps the experts in host memory).
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()
                       if p.device.type == device.type)
    summary = {
        "device": str(device), "dtype": str(dtype).removeprefix("torch."),
        # An fp8 checkpoint's projections and experts stay e4m3 (ftserve/models/fp8.py).
        "weights_format": "fp8" if mcfg.quant is not None else str(dtype).removeprefix("torch."),
        "kv_cache_dtype": str(kv_dtype).removeprefix("torch."),
        "weights_gib": weight_bytes / 2**30, "kv_pages": num_pages, "page_size": cfg.page_size,
        "kv_tokens": pool_tokens, "kv_gib": num_pages * pool.bytes_per_page() / 2**30,
        "max_model_len": max_model_len, "model_limit": model_limit,
        "attention_backend": getattr(backend, "name", type(backend).__name__),
        "kernels": kernels.summary(),
        "cuda_graph_batch_sizes": runner.graphs.sizes if runner.graphs is not None else [],
        "cuda_graph_prefill_tokens": (runner.prefill_graphs.buckets
                                      if runner.prefill_graphs is not None else []),
        "cuda_graph_verify_tokens": (runner.verify_graphs.buckets
                                     if runner.verify_graphs is not None else []),
        "moe_cache": moe_cache.summary() if moe_cache is not None else None,
        # The host tier adds prefix-cache capacity, not single-request context.
        "kv_host_pages": host_tier.num_total if host_tier is not None else 0,
        "kv_host_tokens": host_tier.num_total * cfg.page_size if host_tier is not None else 0,
        "kv_host_gib": host_tier.bytes_total() / 2**30 if host_tier is not None else 0.0,
        # Hybrid models: recurrent-state slots (running requests + prefix-cache checkpoints),
        # the verify log's tokens (speculative decoding) counted in state_gib.
        "state_slots": state_slots, "state_checkpoints": checkpoints, "state_gib": state_bytes / 2**30,
        "state_verify_tokens": verify_tokens,
        "state_host_checkpoints": host_tier.num_state_slots if host_tier is not None else 0,
        "state_host_gib": host_tier.state_bytes_total() / 2**30 if host_tier is not None else 0.0,
        "speculative": cfg.speculative if scheduler.spec is not None else "off",
    }
    log.info("model %s: %s on %s, weights %.2f GiB%s", model_dir, summary["dtype"], device,
             summary["weights_gib"], " (projections and experts in fp8 e4m3)" if mcfg.quant is not None else "")
    log.info("context: single-request limit %d tokens (rope table %d, device KV %d); KV capacity "
             "for all requests and the prefix cache: device %d pages x %d = %d tokens (%.2f GiB), "
             "host tier %d tokens (%.2f GiB)", max_model_len, model_limit, pool_tokens,
             num_pages, cfg.page_size, pool_tokens, summary["kv_gib"],
             summary["kv_host_tokens"], summary["kv_host_gib"])
    if state_pool is not None:
        log.info("recurrent state: %d slots (%d running + %d prefix-cache checkpoints, one every %d "
                 "pages of a prefill and at each prompt's end) and a verify log of %d tokens, %.2f GiB; "
                 "host tier: %d checkpoints, %.2f GiB", state_slots, cfg.max_running_requests, checkpoints,
                 cfg.state_checkpoint_pages, verify_tokens, summary["state_gib"],
                 summary["state_host_checkpoints"], summary["state_host_gib"])
        log.info("recurrent state in CUDA graphs: decode %s, prefill %s, verify %s (checkpoint loads "
                 "and saves and the verify commit run beside the replays)",
                 "captured" if runner.graphs is not None else "eager",
                 "captured" if runner.prefill_graphs is not None else "eager",
                 "captured" if runner.verify_graphs is not None else
                 ("eager" if scheduler.spec is not None else "off"))
    return Engine(
        dict(scheduler=scheduler, runner=runner, status_log_interval=cfg.status_log_interval,
             overlap=cfg.overlap_schedule),
        model_dir=model_dir, is_demo=is_demo, max_model_len=max_model_len,
        vocab_size=mcfg.vocab_size, eos_token_ids=eos, model_config=mcfg, summary=summary,
    )


def _state_slots(cfg: EngineConfig, mcfg: Any) -> tuple[int, int]:
    """(state-pool slots, of which prefix-cache checkpoints) of a hybrid model; (0, 0)
    for others. One slot per running request, so the pool caps running requests."""
    if not mcfg.is_hybrid:
        return 0, 0
    checkpoints = 0
    if cfg.enable_prefix_cache:
        checkpoints = (cfg.state_checkpoints if cfg.state_checkpoints is not None
                       else 2 * cfg.max_running_requests)
    return cfg.max_running_requests + checkpoints, checkpoints


def _verify_tokens(cfg: EngineConfig) -> int:
    """A hybrid's verify log (kvcache/state_pool.py): the inputs of the largest
    verify step, every running request with a full draft; 0 without speculation."""
    if cfg.speculative == "off":
        return 0
    return cfg.max_running_requests * (cfg.num_speculative_tokens + 1)


def _speculator(cfg: EngineConfig, max_model_len: int) -> Speculator | None:
    """--speculative's per-request drafting with its gate (spec/gate.py), or None."""
    spec = _drafting(cfg, max_model_len)
    if spec is not None and cfg.speculative_gate:
        spec.gate = SpecGate()
    return spec


def _drafting(cfg: EngineConfig, max_model_len: int) -> Speculator | None:
    if cfg.speculative == "off":
        return None
    if cfg.speculative == "mtp":
        from ftserve.engine.spec.mtp import MTPSpeculator

        log.info("speculative decoding: mtp, %d draft tokens from the checkpoint's MTP layer",
                 cfg.num_speculative_tokens)
        return MTPSpeculator(cfg.num_speculative_tokens, max_model_len)
    log.info("speculative decoding: %s, %d draft tokens, n-gram match %d..%d tokens",
             cfg.speculative, cfg.num_speculative_tokens, cfg.ngram_min_match, cfg.ngram_max_match)
    return Speculator(cfg.num_speculative_tokens, cfg.ngram_min_match, cfg.ngram_max_match,
                      max_model_len)


def _wants_mtp(cfg: EngineConfig, model_dir: str, mcfg: Any, load_format: str) -> bool:
    """--speculative mtp: build the checkpoint's MTP layers. A checkpoint without
    them is a start-up error."""
    if cfg.speculative != "mtp":
        return False
    from ftserve.models.loader import mtp_layers

    n = mtp_layers(model_dir, mcfg, load_format)
    if n == 0:
        raise ConfigError(f"--speculative mtp needs a checkpoint with MTP layers (mtp.* tensors); "
                          f"{model_dir} has none: use --speculative ngram or off")
    if n > 1:
        raise ConfigError(f"--speculative mtp runs one MTP layer; {model_dir} has {n}")
    return True


def _host_tier(cfg: EngineConfig, pool: KVPool, state_pool: StatePool | None = None,
               checkpoints: int = 0) -> HostKVTier | None:
    """The pinned host tier asked for by --kv-host-pages / --kv-host-gib, or None
    (for a hybrid, with --state-host-checkpoints state slots, default as many as
    the device keeps)."""
    if cfg.kv_host_pages is None and cfg.kv_host_gib is None:
        return None
    pages = cfg.kv_host_pages
    if pages is None:
        assert cfg.kv_host_gib is not None
        pages = HostKVTier.pages_for_gib(cfg.kv_host_gib, pool)
        if pages < 1:
            raise ConfigError(
                f"--kv-host-gib {cfg.kv_host_gib} holds no page of "
                f"{pool.bytes_per_page()} bytes; raise it")
    if state_pool is None:
        return HostKVTier(pool, pages)
    host_states = cfg.state_host_checkpoints if cfg.state_host_checkpoints is not None else checkpoints
    return HostKVTier(pool, pages, states=state_pool, state_slots=host_states)


def _plan_pages(cfg: EngineConfig, device: torch.device, per_token: int,
                model: torch.nn.Module, mcfg: Any, kernels: KernelConfig, state_bytes: int = 0) -> int:
    """KV pages for the pool. On CUDA: ``--memory-ratio`` of the device's total
    memory must hold weights + activations of the largest prefill chunk +
    sampler and CUDA-graph workspace + a hybrid's state pool and verify log
    (``state_bytes``, allocated after this) + KV; the activation peak is measured with one dummy
    prefill of ``--max-prefill-length`` tokens (which also compiles the
    prefill kernels), not guessed."""
    page_bytes = per_token * cfg.page_size
    if cfg.num_pages is not None:
        return cfg.num_pages
    if cfg.kv_cache_tokens is not None:
        return 1 + -(-cfg.kv_cache_tokens // cfg.page_size)
    if device.type != "cuda":
        return 1 + CPU_DEFAULT_KV_TOKENS // cfg.page_size
    activation = _profile_prefill_peak(cfg, device, model, mcfg, kernels)
    # Decode-side workspace: logits and sampler sort buffers for a full batch,
    # plus the CUDA-graph pool (intermediates of the largest captured batch).
    vocab = mcfg.vocab_size
    workspace = cfg.max_running_requests * vocab * 16 + 256 * 2**20
    if cfg.speculative != "off" and cfg.cuda_graph_max_bs > 0:
        # Verify graphs: each width's static fp32 logits, one row per token, and
        # sampling rows for every draft position.
        from ftserve.engine.prefill_graph import verify_buckets

        rows = sum(verify_buckets(min(cfg.max_running_requests, 16), cfg.num_speculative_tokens))
        workspace += rows * vocab * 4 + cfg.max_running_requests * cfg.num_speculative_tokens * vocab * 16
    if cfg.speculative == "mtp":
        # The MTP layer's pass after a prefill chunk: the chunk's hidden states, the
        # next tokens' embeddings and their concatenation beside one layer's activations.
        elem = next(model.parameters()).element_size()
        workspace += 8 * cfg.max_prefill_length * mcfg.hidden_size * elem
    free, total = torch.cuda.mem_get_info(device)
    used = total - free  # weights, the CUDA context, anything else on the card
    budget = total * cfg.memory_ratio - used - activation - workspace - state_bytes
    pages = int(budget // page_bytes)
    log.info("memory plan: total %.1f GiB x --memory-ratio %.2f = %.1f GiB: in use %.1f GiB "
             "(weights + context), prefill activations %.2f GiB (measured, %d tokens), "
             "decode/graph workspace %.2f GiB, recurrent-state pool %.2f GiB, KV cache %.1f GiB "
             "(%d pages)",
             total / 2**30, cfg.memory_ratio, total * cfg.memory_ratio / 2**30, used / 2**30,
             activation / 2**30, cfg.max_prefill_length, workspace / 2**30, state_bytes / 2**30,
             max(0, pages) * page_bytes / 2**30, max(0, pages))
    min_pages = 2 + -(-cfg.max_prefill_length // cfg.page_size)
    if pages < min_pages:
        raise ConfigError(
            f"no room for the KV cache: --memory-ratio {cfg.memory_ratio} of "
            f"{total / 2**30:.1f} GiB leaves {budget / 2**30:.2f} GiB after weights "
            f"({used / 2**30:.1f} GiB in use), prefill activations ({activation / 2**30:.2f} GiB for "
            f"--max-prefill-length {cfg.max_prefill_length}), workspace and recurrent state "
            f"({state_bytes / 2**30:.2f} GiB); raise --memory-ratio, lower --max-prefill-length or "
            f"--max-running-requests (or --state-checkpoints), or offload experts with "
            f"--moe-cache-size")
    return pages


def _profile_prefill_peak(cfg: EngineConfig, device: torch.device, model: torch.nn.Module,
                          mcfg: Any, kernels: KernelConfig) -> int:
    """Peak bytes one prefill chunk of max_prefill_length tokens allocates
    beyond what is already resident (its own small KV pool excluded)."""
    from ftserve.models.forward_batch import build_forward_batch

    n = cfg.max_prefill_length
    ps = cfg.page_size
    # The pool's own dtype, so the profiled (and compiled) kernels are the served ones.
    dtype = kv_cache_torch_dtype(cfg.kv_cache_dtype, next(model.parameters()).dtype)
    pages = -(-n // ps)
    pool = KVPool(len(mcfg.kv_layers), pages + 1, ps, mcfg.num_kv_heads, mcfg.head_dim, dtype, device)
    # A hybrid's chunk reads and writes one state slot (counted in the plan's state_bytes).
    states = (StatePool.for_model(mcfg, 1, next(model.parameters()).dtype, STATE_DTYPE, device)
              if mcfg.is_hybrid else None)
    backend = _attention_backend(cfg, device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, mcfg.vocab_size, (n,), generator=gen).tolist()
    fb = build_forward_batch([ids], [0], [list(range(1, pages + 1))], pool, backend, kernels=kernels,
                             state_pool=states, state_slots=[1] if states is not None else None)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        model(fb)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del fb, pool, states
    torch.cuda.empty_cache()
    return int(peak * 1.1)  # headroom for allocator fragmentation


def _attention_backend(cfg: EngineConfig, device: torch.device) -> Any:
    choice = cfg.attention_backend
    if choice == "auto":
        choice = "triton" if device.type == "cuda" else "torch"
    if choice == "triton":
        from ftserve_kernels.attention_triton import TritonAttentionBackend

        return TritonAttentionBackend()
    from ftserve_kernels.paged_attention import TorchAttentionBackend

    return TorchAttentionBackend()
