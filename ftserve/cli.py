"""Command line: ``ftserve serve`` (the OpenAI-compatible server) and ``ftserve chat``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from ftserve.config import ConfigError, EngineConfig, ServerConfig


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    e, s = EngineConfig(), ServerConfig()
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default=None,
                   help="checkpoint dir (HF layout); omitted = embedded demo model, random weights")
    g.add_argument("--load-format", default=e.load_format, choices=("auto", "safetensors", "dummy"))
    g.add_argument("--dtype", default=e.dtype, choices=("auto", "bfloat16", "float16", "float32"))
    g.add_argument("--device", default=e.device, help="auto | cpu | cuda | cuda:N")
    g.add_argument("--page-size", type=int, default=e.page_size)
    g.add_argument("--num-pages", type=int, default=e.num_pages)
    g.add_argument("--kv-cache-tokens", type=int, default=e.kv_cache_tokens)
    g.add_argument("--memory-ratio", type=float, default=e.memory_ratio)
    g.add_argument("--max-prefill-length", type=int, default=e.max_prefill_length)
    g.add_argument("--max-running-requests", type=int, default=e.max_running_requests)
    g.add_argument("--max-model-len", type=int, default=e.max_model_len)
    g.add_argument("--attention-backend", default=e.attention_backend,
                   choices=("auto", "torch", "triton"))
    g.add_argument("--cuda-graph-max-bs", type=int, default=e.cuda_graph_max_bs)
    g.add_argument("--disable-prefix-cache", action="store_true")
    g.add_argument("--seed", type=int, default=e.seed)
    g.add_argument("--status-log-interval", type=float, default=e.status_log_interval)
    g.add_argument("--moe-cache-size", type=int, default=e.moe_cache_size,
                   help="offload mode: experts in pinned host memory, N expert slots in VRAM")
    g.add_argument("--moe-cache-auto", action="store_true",
                   help="offload mode with the slot count sized from --memory-ratio")
    h = p.add_argument_group("server")
    h.add_argument("--host", default=s.host)
    h.add_argument("--port", type=int, default=s.port)
    h.add_argument("--served-model-name", default=s.served_model_name)
    h.add_argument("--api-key", default=s.api_key)
    h.add_argument("--max-queued-requests", type=int, default=s.max_queued_requests)
    h.add_argument("--max-body-bytes", type=int, default=s.max_body_bytes)
    h.add_argument("--drain-timeout", type=float, default=s.drain_timeout)
    h.add_argument("--keepalive-interval", type=float, default=s.keepalive_interval)
    h.add_argument("--log-requests", action="store_true")


def configs_from_args(a: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    engine = EngineConfig(
        model=a.model, load_format=a.load_format, dtype=a.dtype, device=a.device,
        page_size=a.page_size, num_pages=a.num_pages, kv_cache_tokens=a.kv_cache_tokens,
        memory_ratio=a.memory_ratio, max_prefill_length=a.max_prefill_length,
        max_running_requests=a.max_running_requests, max_model_len=a.max_model_len,
        attention_backend=a.attention_backend, cuda_graph_max_bs=a.cuda_graph_max_bs,
        enable_prefix_cache=not a.disable_prefix_cache, seed=a.seed,
        status_log_interval=a.status_log_interval,
        moe_cache_size=a.moe_cache_size, moe_cache_auto=a.moe_cache_auto,
    )
    server = ServerConfig(
        host=a.host, port=a.port, served_model_name=a.served_model_name, api_key=a.api_key,
        max_queued_requests=a.max_queued_requests, max_body_bytes=a.max_body_bytes,
        drain_timeout=a.drain_timeout, keepalive_interval=a.keepalive_interval,
        log_requests=a.log_requests,
    )
    engine.validate()
    if not 0 <= server.port < 65536:
        raise ConfigError("--port must be in [0, 65535]")
    if server.max_queued_requests < 0:
        raise ConfigError("--max-queued-requests must be >= 0")
    if server.keepalive_interval <= 0:
        raise ConfigError("--keepalive-interval must be > 0")
    return engine, server


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ftserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    _add_serve_args(serve)
    chat = sub.add_parser("chat", help="chat with a running server in the terminal")
    chat.add_argument("--url", default="http://127.0.0.1:8000")
    chat.add_argument("--model", default=None, help="model name (default: the server's first)")
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--api-key", default=None)
    chat.add_argument("--max-tokens", type=int, default=None)
    chat.add_argument("--temperature", type=float, default=None)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        try:
            engine_cfg, server_cfg = configs_from_args(args)
        except ConfigError as err:
            print(f"ftserve: error: {err}", file=sys.stderr)
            return 2
        from ftserve.server.serve import run

        return run(engine_cfg, server_cfg)
    from ftserve.server.chat_client import ChatClient, chat_loop

    client = ChatClient(args.url, args.model, args.api_key, args.max_tokens, args.temperature)
    return chat_loop(client, args.system, sys.stdin, sys.stdout)
