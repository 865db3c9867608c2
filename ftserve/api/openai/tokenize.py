"""POST /tokenize and POST /detokenize, as vLLM has them: the token ids of a text or
of the prompt /v1/chat/completions would render from ``messages``, and back."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from ftserve.api.body import read_json
from ftserve.api.errors import APIError
from ftserve.api.openai.models import TokenizeChat, TokenizePrompt
from ftserve.api.state import STATE_KEY
from ftserve.api.validation import parse
from ftserve.chat.errors import bad_request
from ftserve.chat.prompt import render
from ftserve.chat.request import ChatRequest
from ftserve.chat.text import TextCodec


def _json(obj: Any) -> web.Response:
    return web.Response(body=orjson.dumps(obj), content_type="application/json")


async def tokenize(request: web.Request) -> web.Response:
    """{"prompt": str} or {"messages": [...]} -> {"tokens", "count", "max_model_len"}."""
    state = request.app[STATE_KEY]
    raw = await read_json(request)
    if not isinstance(raw, dict):
        raise bad_request("request body must be a JSON object")
    model = raw.get("model")
    state.check_model(model if isinstance(model, str) else None)
    engine, text = state.ready()
    if "messages" in raw:
        prompt, special = await _chat_prompt(text, parse(TokenizeChat, raw))
    else:
        body = parse(TokenizePrompt, raw)
        prompt, special = body.prompt, body.add_special_tokens is not False
    ids = await text.encode_async(prompt, add_special_tokens=special)
    if len(ids) > engine.max_model_len:
        # The reply is bounded as a prompt is: a 25 MB text's ids are a 130 MB reply.
        raise APIError(400, f"the text is {len(ids)} tokens, more than this model's maximum "
                       f"context length of {engine.max_model_len} tokens, the most /tokenize "
                       "returns", param="messages" if "messages" in raw else "prompt",
                       code="context_length_exceeded")
    return _json({"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len})


async def _chat_prompt(text: TextCodec, body: TokenizeChat) -> tuple[str, bool]:
    """(the prompt the chat endpoint renders, add_special_tokens: false unless asked,
    as a template adds its own)."""
    messages = body.chat_messages()
    add_gen, cont = body.continuation(messages)
    tools, forced = body.offered()  # counted in the prompt, as the chat endpoint renders them
    if tools and text.tool_format() is None:
        raise bad_request("this model's chat template does not render tools", param="tools")
    req = ChatRequest(kind="chat", model=None, messages=messages, add_generation_prompt=add_gen,
                      continue_final=cont, tools=tools,
                      template_kwargs=body.chat_template_kwargs or {}, forced=forced)
    prompt, forced_text = await render(text, req)  # the chat endpoint's prompt carries it too
    return prompt + forced_text, bool(body.add_special_tokens)


async def detokenize(request: web.Request) -> web.Response:
    """{"tokens": [ids]} -> {"prompt": text}."""
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
