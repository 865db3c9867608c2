"""Command line: ``ftserve serve`` (the OpenAI-compatible server), ``ftserve fleet`` (replicas
behind a cache-aware router: fleet.py) and ``ftserve chat``."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from ftserve import envs
from ftserve.config import ConfigError, EngineConfig, ServerConfig

_TYPES = {"int": int, "float": float, "str": str}


def _flag_dest(f: dataclasses.Field[Any]) -> tuple[str, str]:
    """(flag, argparse dest) for a config field; True-by-default bools become --disable-X."""
    if f.type == "bool" and f.default is True:
        name = f.name.removeprefix("enable_")
        return f"--disable-{name.replace('_', '-')}", f"disable_{name}"
    return f"--{f.name.replace('_', '-')}", f.name


def _add_config_flags(group: argparse._ArgumentGroup, cls: type) -> None:
    """One flag per field of a frozen config dataclass, so a new field is never forgotten."""
    for f in dataclasses.fields(cls):
        flag, dest = _flag_dest(f)
        text = f.metadata["help"]  # every field has one (config._opt)
        if f.type == "bool":
            group.add_argument(flag, dest=dest, action="store_true", help=text)
            continue
        base = str(f.type).replace(" | None", "")
        if f.default is not None and not text.startswith(f"{f.default} "):
            text += f" (default: {f.default})"
        group.add_argument(flag, dest=dest, type=_TYPES.get(base, str), default=f.default,
                           help=text)


def _config_from(cls: type, args: argparse.Namespace) -> Any:
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        _, dest = _flag_dest(f)
        value = getattr(args, dest)
        values[f.name] = (not value) if dest.startswith("disable_") else value
    return cls(**values)


def _api_key(server: ServerConfig) -> str | None:
    """The key from --api-key, --api-key-file or FTSERVE_API_KEY (in that order of
    preference; the first two exclude each other). Empty is an error wherever it comes
    from: an unset variable in a script must not serve without auth silently."""
    if server.api_key is not None and server.api_key_file is not None:
        raise ConfigError("give --api-key or --api-key-file, not both")
    if server.api_key is not None:
        if not server.api_key.strip():
            raise ConfigError("--api-key is empty: give a key, or omit the flag to serve without auth")
        return server.api_key
    if server.api_key_file is not None:
        try:
            with open(server.api_key_file, encoding="utf-8") as f:
                key = f.readline().strip()
        except OSError as err:
            raise ConfigError(f"--api-key-file: cannot read {server.api_key_file!r}: "
                              f"{err.strerror or err}") from None
        if not key:
            raise ConfigError(f"--api-key-file: {server.api_key_file!r} holds no key (its first "
                              "line is empty)")
        return key
    key = envs.api_key()
    if key is not None and not key.strip():
        raise ConfigError("FTSERVE_API_KEY is set but empty: give a key, or unset it to serve "
                          "without auth")
    return key.strip() if key is not None else None


def configs_from_args(a: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    engine: EngineConfig = _config_from(EngineConfig, a)
    server: ServerConfig = _config_from(ServerConfig, a)
    engine.validate()
    if engine.model is not None and not _model_arg_ok(engine.model):
        raise ConfigError(f"--model {engine.model!r} is neither a checkpoint directory, a .gguf "
                          f"file nor a model name ({', '.join(model_names())})")
    if not 0 <= server.port < 65536:
        raise ConfigError("--port must be in [0, 65535]")
    if server.max_queued_requests < 0:
        raise ConfigError("--max-queued-requests must be >= 0")
    if server.keepalive_interval <= 0:
        raise ConfigError("--keepalive-interval must be > 0")
    if server.max_body_bytes < 1024:
        raise ConfigError("--max-body-bytes must be at least 1024")
    if server.drain_timeout < 0:
        raise ConfigError("--drain-timeout must be >= 0")
    if not server.http_keepalive_timeout > 0:
        raise ConfigError("--http-keepalive-timeout must be > 0")
    if not server.request_read_timeout > 0:
        raise ConfigError("--request-read-timeout must be > 0")
    server = dataclasses.replace(server, api_key=_api_key(server))
    if server.metrics_require_key and server.api_key is None:
        raise ConfigError("--metrics-require-key needs an API key (--api-key-file, "
                          "FTSERVE_API_KEY or --api-key)")
    if server.served_model_name is not None and not server.served_model_name.strip():
        raise ConfigError("--served-model-name is empty: give a name, or omit the flag")
    if server.chat_template is not None:
        from ftserve.chat.text import chat_template_text
        from ftserve.tokenizer import ChatTemplate, ChatTemplateError

        try:  # compiled now: a typo fails here, not on every chat request
            ChatTemplate(chat_template_text(server.chat_template)).compile()
        except (OSError, ChatTemplateError) as err:
            raise ConfigError(f"--chat-template: {err}") from None
    if server.generation_config not in ("auto", "none"):
        raise ConfigError(f"--generation-config must be auto or none, got {server.generation_config!r}")
    if server.reasoning_parser not in ("auto", "none"):
        raise ConfigError(f"--reasoning-parser must be auto or none, got {server.reasoning_parser!r}")
    return engine, server


def model_names() -> list[str]:
    from ftserve.models.fetch import ALIASES, DEMO_ALIAS

    return [*ALIASES, DEMO_ALIAS]


def _model_arg_ok(model: str) -> bool:
    return os.path.isdir(model) or (os.path.isfile(model) and model.endswith(".gguf")) or (
        model in model_names())


def resolve_model(engine: EngineConfig, server: ServerConfig) -> tuple[EngineConfig, ServerConfig]:
    """A model name -> its fetched file (FetchError if it cannot be fetched); no --model ->
    the default real model when cached or fetchable, else the demo model (logged)."""
    from ftserve.models.fetch import resolve

    resolved = resolve(engine.model)
    if resolved.fallback_reason is not None:
        logging.getLogger("ftserve").warning(
            "no --model given and the default real model is unavailable: %s. Serving the "
            "embedded demo model (random weights) instead", resolved.fallback_reason)
    engine = dataclasses.replace(engine, model=resolved.path)
    if resolved.name is not None and server.served_model_name is None:
        server = dataclasses.replace(server, served_model_name=resolved.name)
    return engine, server


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ftserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    _add_config_flags(serve.add_argument_group("model and engine"), EngineConfig)
    _add_config_flags(serve.add_argument_group("server"), ServerConfig)
    fleet = sub.add_parser(
        "fleet", help="N serve replicas (one per GPU, or on the CPU) behind a cache-aware router",
        description="Starts --replicas `ftserve serve` processes and sglang-router in front "
                    "(pip install -e \".[fleet]\"); --host/--port are the router's, every other "
                    "serve flag goes to each replica.")
    from ftserve.fleet import add_fleet_flags

    add_fleet_flags(fleet)
    _add_config_flags(fleet.add_argument_group("model and engine (every replica)"), EngineConfig)
    _add_config_flags(fleet.add_argument_group("server (--host/--port: the router's; the rest: "
                                               "every replica's)"), ServerConfig)
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
        from ftserve.models.fetch import FetchError

        try:
            engine_cfg, server_cfg = resolve_model(*configs_from_args(args))
        except (ConfigError, FetchError) as err:
            print(f"ftserve: error: {err}", file=sys.stderr)
            return 2
        from ftserve.api.serve import run

        return run(engine_cfg, server_cfg)
    if args.command == "fleet":
        from ftserve.fleet import run as run_fleet

        return run_fleet(args)
    from ftserve.cli_chat import ChatClient, chat_loop

    client = ChatClient(args.url, args.model, args.api_key, args.max_tokens, args.temperature)
    return chat_loop(client, args.system, sys.stdin, sys.stdout)
