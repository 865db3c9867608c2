"""The aiohttp application: routes, auth and error middlewares.

    POST /v1/chat/completions  POST /v1/completions  GET /v1/models  GET /v1/models/{model}
    POST /v1/messages  POST /v1/messages/count_tokens  (Anthropic's API: anthropic_api.py)
    POST /v1/responses  (OpenAI's Responses API, stateless: responses_api.py)
    GET /health  GET /metrics  POST /tokenize  POST /detokenize  POST /reset_prefix_cache
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

from ftserve.api.anthropic.messages import count_tokens, messages
from ftserve.api.errors import (
    ANTHROPIC_PREFIX,
    APIError,
    Handler,
    bad_request,
    error_middleware,
)
from ftserve.api.metrics import CONTENT_TYPE
from ftserve.api.openai.completions import chat_completions, completions, read_json
from ftserve.api.responses.route import responses
from ftserve.api.state import STATE_KEY, ServerState
from ftserve.chat import tool_choice
from ftserve.chat.request import (
    parse_continuation,
    parse_messages,
    parse_template_kwargs,
    parse_tools,
)
from ftserve.chat.text import TemplateError

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


async def tokenize(request: web.Request) -> web.Response:
    """vLLM-style: {"prompt": str} or {"messages": [...]} -> {"tokens", "count", ...}."""
    state = request.app[STATE_KEY]
    body = await read_json(request)
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    state.check_model(body.get("model") if isinstance(body.get("model"), str) else None)
    engine, text = state.ready()
    special = not isinstance(body.get("messages"), list)  # a template adds its own
    special_flag = body.get("add_special_tokens", special)
    if not isinstance(special_flag, bool):
        raise bad_request("'add_special_tokens' must be a boolean", param="add_special_tokens")
    if "messages" in body:
        messages = parse_messages(body)
        add_gen, cont = parse_continuation(body, messages)
        tools = parse_tools(body)  # counted in the prompt, as the chat endpoint renders them
        if tools and text.tool_format() is None:
            raise bad_request("this model's chat template does not render tools", param="tools")
        try:
            prompt = await asyncio.to_thread(text.render_chat, messages, add_gen,
                                             tools, parse_template_kwargs(body), cont)
        except TemplateError as err:
            raise bad_request(f"chat template error: {err}", param="messages") from None
        forced = tool_choice.forced_call(body, tools)
        fmt = text.tool_format()
        if forced is not None and fmt is not None:  # the chat endpoint's prompt carries it too
            prompt += tool_choice.before_call(prompt, text.marks_reasoning())
            prompt += tool_choice.forced_text(fmt, forced, text.escape_special)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad_request("'prompt' (a string) or 'messages' is required", param="prompt")
    ids = await text.encode_async(prompt, add_special_tokens=special_flag)
    if len(ids) > engine.max_model_len:
        # The reply is bounded as a prompt is: a 25 MB text's ids are a 130 MB reply.
        raise APIError(400, f"the text is {len(ids)} tokens, more than this model's maximum "
                       f"context length of {engine.max_model_len} tokens, the most /tokenize "
                       "returns", param="messages" if "messages" in body else "prompt",
                       code="context_length_exceeded")
    return _json({"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len})


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = await read_json(request)
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    engine, text = state.ready()
    ids = body.get("tokens")
    if isinstance(ids, list) and len(ids) > engine.max_model_len:
        raise bad_request(f"'tokens' holds {len(ids)} ids; /detokenize takes at most this "
                          f"model's maximum context length, {engine.max_model_len}",
                          param="tokens", code="context_length_exceeded")
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < engine.vocab_size for t in ids
    ):
        raise bad_request(f"'tokens' must be a list of token ids in [0, {engine.vocab_size})",
                          param="tokens")
    return _json({"prompt": text.decode(ids, skip_special_tokens=False)})


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
    return app
