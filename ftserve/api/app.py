"""The aiohttp application: routes, auth and error middlewares.

    POST /v1/chat/completions  POST /v1/completions  GET /v1/models  GET /v1/models/{model}
    POST /v1/messages  POST /v1/messages/count_tokens  (Anthropic's API: anthropic/messages.py)
    POST /v1/responses  (OpenAI's Responses API, stateless: responses/route.py)
    GET /health  GET /metrics  POST /tokenize  POST /detokenize  POST /reset_prefix_cache
    what a cache-aware router asks of a worker, and the replica header: worker_api.py
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

from ftserve.api import worker_api
from ftserve.api.anthropic.messages import count_tokens, messages
from ftserve.api.errors import ANTHROPIC_PREFIX, APIError, Handler, error_middleware
from ftserve.api.metrics import CONTENT_TYPE
from ftserve.api.openai.chat import chat_completions
from ftserve.api.openai.completions import completions
from ftserve.api.openai.tokenize import detokenize, tokenize
from ftserve.api.responses.route import responses
from ftserve.api.state import STATE_KEY, ServerState

ROUTES: tuple[tuple[str, str], ...] = (
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model}"),
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/reset_prefix_cache"),
)
_OPEN_PATHS = frozenset({"/health", "/metrics"})  # probes and scrapers carry no key


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    # Anthropic's clients send the key as x-api-key; on its routes that header counts too.
    anthropic = request.path.startswith(ANTHROPIC_PREFIX)
    x_api_key = request.headers.get("x-api-key") if anthropic else None
    open_path = request.path in _OPEN_PATHS and not (
        request.path == "/metrics" and state.cfg.metrics_require_key)
    if not open_path and not state.authorized(request.headers.get("Authorization"), x_api_key):
        how = "'x-api-key: <key>' or " if anthropic else ""
        raise APIError(401, f"invalid or missing API key (send {how}'Authorization: Bearer <key>')",
                       code="invalid_api_key")
    return await handler(request)


def _model_card(state: ServerState) -> dict[str, Any]:
    engine, _ = state.ready()
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "ftserve",
        "root": engine.model_dir,
        "max_model_len": engine.max_model_len,
        # Single-request limit above; KV capacity shared by all requests and the
        # prefix cache below, per tier (the host tier only holds evicted prefixes).
        "kv_capacity_tokens": {"device": int(engine.summary.get("kv_tokens", 0)),
                               "host": int(engine.summary.get("kv_host_tokens", 0))},
    }


async def models(request: web.Request) -> web.Response:
    return _json({"object": "list", "data": [_model_card(request.app[STATE_KEY])]})


async def model(request: web.Request) -> web.Response:
    """GET /v1/models/{model}: the card of the served model (OpenAI's retrieve)."""
    state = request.app[STATE_KEY]
    state.check_model(request.match_info["model"])
    return _json(_model_card(state))


async def health(request: web.Request) -> web.Response:
    problem = request.app[STATE_KEY].health_problem()
    if problem is not None:
        raise APIError(503, problem, err_type="server_error", code="unavailable")
    return _json({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE_KEY].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    engine, _ = request.app[STATE_KEY].ready()
    ok = await asyncio.to_thread(engine.reset_prefix_cache)
    return _json({"success": bool(ok)})


def make_app(state: ServerState) -> web.Application:
    app = web.Application(
        client_max_size=state.cfg.max_body_bytes,
        middlewares=[error_middleware, auth_middleware],
    )
    app[STATE_KEY] = state
    handlers: dict[str, Handler] = {
        "/v1/chat/completions": chat_completions,
        "/v1/completions": completions,
        "/v1/messages": messages,
        "/v1/messages/count_tokens": count_tokens,
        "/v1/responses": responses,
        "/v1/models": models,
        "/v1/models/{model}": model,
        "/health": health,
        "/metrics": metrics,
        "/tokenize": tokenize,
        "/detokenize": detokenize,
        "/reset_prefix_cache": reset_prefix_cache,
    }
    for method, path in ROUTES:
        # A served name may hold "/" (--served-model-name org/model): match across it.
        app.router.add_route(method, path.replace("{model}", "{model:.+}"), handlers[path])
    worker_api.install(app)
    return app
