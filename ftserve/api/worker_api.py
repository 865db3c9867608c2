"""What a cache-aware router asks of a worker, beside the OpenAI routes.

sglang-router (sglang_router, the "model gateway") and vllm-router keep a session on the
replica that holds its prefix; ftserve is a worker behind them (docs/scaling.md). What
they call on a worker, and what ftserve answers:

    GET  /health                          (app.py) 200 when the engine serves
    GET  /server_info, /get_server_info   who serves what: ``served_model_name`` becomes
                                          the router's model id; limits, dp_size 1
    GET  /model_info, /get_model_info     the model: path, HF model_type, architectures
    GET  /get_load                        this replica's load: one entry (no data
                                          parallelism inside a replica), sglang's fields
    POST /flush_cache                     drop the prefix cache (the router fans its own
                                          /flush_cache out to every worker)
    GET  /health_generate                 a deeper health check: one greedy token through
                                          the engine
    POST /tokenize                        (app.py) vllm-router's cache-aware policy
                                          tokenizes chats there

sglang-router asks ``/server_info`` first and falls back to ``/get_server_info`` on a
404 (a warning each time), so both names answer. Every response carries
``X-Ftserve-Replica`` (``--replica-id``, else host:port), which the routers pass on to
the client: loadgen records it to show which replica served each turn of a session.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import orjson
from aiohttp import web

import ftserve
from ftserve.api.errors import APIError
from ftserve.api.state import STATE_KEY, ServerState

REPLICA_HEADER = "X-Ftserve-Replica"
HEALTH_GENERATE_TIMEOUT_S = 30.0


def _json(obj: Any) -> web.Response:
    return web.Response(body=orjson.dumps(obj), content_type="application/json")


async def server_info(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    engine, _ = state.ready()
    return _json({
        "served_model_name": state.model_name,
        "model_path": engine.model_dir,
        "version": ftserve.__version__,
        "replica_id": replica_id(request),
        "dp_size": 1,  # one engine per process: replicas scale out behind the router
        "tp_size": 1,
        "context_length": engine.max_model_len,
        "max_total_tokens": int(engine.summary.get("kv_tokens", 0)),
        "max_running_requests": engine.max_running_requests,
        "max_queued_requests": state.cfg.max_queued_requests,
        "page_size": int(engine.summary.get("page_size", 0)),
    })


async def model_info(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    engine, _ = state.ready()
    mcfg = engine.model_config
    return _json({
        "model_path": engine.model_dir,
        "tokenizer_path": engine.model_dir,
        "served_model_name": state.model_name,
        "is_generation": True,
        "model_type": mcfg.model_type,
        "architectures": [mcfg.architecture],
        "max_model_len": engine.max_model_len,
    })


async def get_load(request: web.Request) -> web.Response:
    """sglang's shape: a list with one entry per data-parallel rank. ``num_tokens`` is
    what sglang-router's load monitor sums (power_of_two): the KV tokens live requests
    hold; a waiting request holds none yet, ``num_waiting_reqs`` counts it."""
    engine, _ = request.app[STATE_KEY].ready()
    st = engine.stats()
    page_size = int(engine.summary.get("page_size", 1))
    return _json([{
        "dp_rank": 0,
        "num_reqs": st.running + st.waiting,
        "num_running_reqs": st.running,
        "num_waiting_reqs": st.waiting,
        "num_tokens": st.kv_pages_used * page_size,
        "kv_cache_usage": st.kv_pages_used / max(1, st.kv_pages_total),
    }])


async def flush_cache(request: web.Request) -> web.Response:
    engine, _ = request.app[STATE_KEY].ready()
    if not await asyncio.to_thread(engine.reset_prefix_cache):
        raise APIError(409, "the prefix cache is in use by running requests: flush it when "
                       "they have finished", err_type="server_error", code="cache_in_use")
    return _json({"success": True, "message": "prefix cache flushed"})


async def health_generate(request: web.Request) -> web.Response:
    """200 once the engine has generated a token for a tiny greedy request; counted at the
    door like any request, so a full server answers 503 here too."""
    from ftserve.api.serve import warm_up  # serve.py imports the app: import at call time

    state = request.app[STATE_KEY]
    with state.admit():
        try:
            await asyncio.wait_for(warm_up(state), HEALTH_GENERATE_TIMEOUT_S)
        except TimeoutError:
            raise APIError(503, f"the engine generated no token in {HEALTH_GENERATE_TIMEOUT_S:.0f}s",
                           err_type="server_error", code="unavailable") from None
    return _json({"status": "ok"})


def replica_id(request: web.Request) -> str:
    state: ServerState = request.app[STATE_KEY]
    if state.cfg.replica_id:
        return state.cfg.replica_id
    sock = request.transport.get_extra_info("sockname") if request.transport else None
    port = sock[1] if isinstance(sock, tuple) and len(sock) >= 2 else state.cfg.port
    return f"{socket.gethostname()}:{port}"


async def _tag_replica(request: web.Request, response: web.StreamResponse) -> None:
    response.headers[REPLICA_HEADER] = replica_id(request)


ROUTES: tuple[tuple[str, str, Any], ...] = (
    ("GET", "/server_info", server_info),
    ("GET", "/get_server_info", server_info),
    ("GET", "/model_info", model_info),
    ("GET", "/get_model_info", model_info),
    ("GET", "/get_load", get_load),
    ("POST", "/flush_cache", flush_cache),
    ("GET", "/health_generate", health_generate),
)


def install(app: web.Application) -> None:
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)
    app.on_response_prepare.append(_tag_replica)
