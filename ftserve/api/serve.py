"""Process life: listen, load the engine (health 503 meanwhile), warm up, banner, and on
SIGTERM/SIGINT stop accepting, drain in-flight requests, shut the engine down.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ftserve.api.app import ROUTES, make_app
from ftserve.api.connections import Runner
from ftserve.api.generation import Generation
from ftserve.api.metrics import Metrics
from ftserve.api.state import ServerState, served_name
from ftserve.api.workers import LaneExecutor
from ftserve.chat.text import TextCodec, make_text_codec
from ftserve.config import EngineConfig, ServerConfig
from ftserve.engine.sampling_params import SamplingParams

log = logging.getLogger("ftserve.api")


@dataclass
class RunningServer:
    state: ServerState
    runner: web.AppRunner
    site: web.TCPSite
    port: int


async def start_http(state: ServerState, host: str, port: int) -> RunningServer:
    # handler_cancellation: a dropped connection cancels its handler, whose finally
    # aborts the engine request, so pages come back within one engine step.
    runner = Runner(
        make_app(state),
        handler_cancellation=True,
        access_log=log if state.cfg.log_requests else None,
        shutdown_timeout=1.0,
        keepalive_timeout=state.cfg.http_keepalive_timeout,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return RunningServer(state, runner, site, site.port)


def load_engine(engine_cfg: EngineConfig,
                chat_template: str | None = None) -> tuple[Any, TextCodec]:
    """Blocking: run in a worker thread while the HTTP server already answers 503.
    ``chat_template`` (--chat-template) replaces the checkpoint's."""
    from ftserve.engine.engine import Engine

    engine = Engine.from_config(engine_cfg)
    return engine, make_text_codec(engine.model_dir, chat_template)


async def warm_up(state: ServerState) -> None:
    """One tiny request through the whole path (submit -> step -> callback)."""
    engine, text = state.ready()
    ids = (await text.encode_async("Hello", add_special_tokens=True))[:8] or [0]
    # Its own Metrics: the warm-up must not show up in the served latency histograms.
    gen = Generation(engine, state.tracker, Metrics(lambda: None), f"warmup-{uuid.uuid4().hex}",
                     ids, SamplingParams(max_tokens=2, temperature=0.0),
                     text.detokenizer(ids, (), True), time.monotonic())
    try:
        while not gen.finished:
            await gen.next()
    finally:
        gen.close()


def banner(state: ServerState, host: str, port: int) -> str:
    engine = state.engine
    assert engine is not None
    lines = [f"ftserve ready: serving '{state.model_name}' at http://{host}:{port} "
             f"(max context {engine.max_model_len} tokens per request; KV capacity "
             f"{engine.summary.get('kv_tokens', 0)} tokens on the device, "
             f"{engine.summary.get('kv_host_tokens', 0)} in the host tier)"]
    lines += [f"  {method:<4} http://{host}:{port}{path}" for method, path in ROUTES]
    if engine.is_demo:
        lines.append("  WARNING: this is the embedded demo model with RANDOM DEMO WEIGHTS; its "
                     "output is gibberish. Pass --model DIR, --model FILE.gguf or --model "
                     "smollm2-135m to serve a real model.")
    else:
        from ftserve.models.fetch import describe

        origin = describe(engine.model_dir)
        if origin is not None:
            lines.append(f"  model: {origin}")
    if state.cfg.api_key:
        lines.append("  API key required: Authorization: Bearer <key>"
                     + (" (on /metrics too)" if state.cfg.metrics_require_key else ""))
    if not _loopback(host) and not state.cfg.metrics_require_key:
        lines.append(f"  NOTE: /metrics is open to anyone who reaches {host}:{port} "
                     "(--metrics-require-key asks for the API key there)")
    return "\n".join(lines)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


async def drain(server: RunningServer, timeout: float) -> None:
    """Stop accepting, let in-flight requests finish (up to timeout), abort the rest."""
    state = server.state
    state.draining = True
    await server.site.stop()  # closes the listening socket; open connections continue
    deadline = time.monotonic() + timeout
    while len(state.tracker) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if len(state.tracker) and state.engine is not None:
        # Generation turns the engine's "abort" into "length", a reason clients know.
        log.warning("drain timeout: ending %d in-flight requests early; their replies finish "
                    "as cut short (finish_reason 'length', stop_reason 'max_tokens' on "
                    "/v1/messages, status 'incomplete' on /v1/responses)", len(state.tracker))
        for rid in state.tracker.ids():
            state.engine.abort(rid)
        end = time.monotonic() + 5.0
        while len(state.tracker) and time.monotonic() < end:
            await asyncio.sleep(0.05)
    await server.runner.cleanup()


def raise_fd_limit() -> None:
    """Each connection is a file descriptor; a soft limit of 1,024 (a common default)
    is reached by a thousand idle clients. Raise it to the hard limit."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 65536 if hard == resource.RLIM_INFINITY else hard  # the kernel caps "unlimited"
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as err:
            log.info("open-file limit stays %d (raising it to %d failed: %s)", soft, target, err)


async def serve(engine_cfg: EngineConfig, server_cfg: ServerConfig) -> int:
    loop = asyncio.get_running_loop()
    loop.set_default_executor(LaneExecutor())  # light and heavy requests' threads: workers.py
    state = ServerState(server_cfg, served_name(server_cfg, engine_cfg.model))
    try:
        server = await start_http(state, server_cfg.host, server_cfg.port)
    except OSError as err:  # taken port, unknown host, no permission: a start-up error
        log.error("cannot listen on %s:%d (--host/--port): %s", server_cfg.host,
                  server_cfg.port, err.strerror or err)
        return 1
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("listening on http://%s:%d; loading the model (health answers 503 until ready)",
             server_cfg.host, server.port)
    load = asyncio.ensure_future(asyncio.to_thread(load_engine, engine_cfg, server_cfg.chat_template))
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({load, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if not load.done():  # signalled while loading: nothing to drain
        await server.runner.cleanup()
        return 0
    stopper.cancel()
    try:
        engine, text = load.result()
    except Exception as exc:  # a bad flag or checkpoint: say so and exit non-zero
        state.load_error = f"{type(exc).__name__}: {exc}"
        log.error("failed to load the model: %s", state.load_error)
        await server.runner.cleanup()
        return 1
    state.attach(engine, text, loop)
    try:
        try:
            await warm_up(state)
        except Exception as exc:  # the engine cannot serve at all: do not pretend
            log.error("warm-up request failed: %s: %s", type(exc).__name__, exc)
            await server.runner.cleanup()
            return 1
        print(banner(state, server_cfg.host, server.port), file=sys.stderr, flush=True)
        await stop.wait()
        log.info("signal received: draining in-flight requests (up to %.0fs)",
                 server_cfg.drain_timeout)
        await drain(server, server_cfg.drain_timeout)
    finally:
        await asyncio.to_thread(engine.shutdown)
    log.info("shut down cleanly")
    return 0


def run(engine_cfg: EngineConfig, server_cfg: ServerConfig) -> int:
    raise_fd_limit()
    try:
        import uvloop
    except ImportError:  # uvloop is optional off Linux/macOS
        return asyncio.run(serve(engine_cfg, server_cfg))
    return uvloop.run(serve(engine_cfg, server_cfg))
