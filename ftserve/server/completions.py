"""POST /v1/chat/completions and POST /v1/completions, streaming (SSE) and not."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import orjson
from aiohttp import web

from ftserve.engine.messages import TokenLogprob
from ftserve.server import responses as R
from ftserve.server import sse
from ftserve.server.errors import APIError, bad_request
from ftserve.server.generation import EngineRequestError, Generation
from ftserve.server.protocol import ParsedRequest, parse_chat, parse_completion
from ftserve.server.state import STATE_KEY, ServerState
from ftserve.server.text import TemplateError, TextCodec


async def read_json(request: web.Request) -> Any:
    raw = await request.read()  # over client_max_size: HTTPRequestEntityTooLarge -> 413
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        raise bad_request(f"invalid JSON body: {err}") from None


async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE_KEY]
    parsed = parse_chat(await read_json(request))
    state.check_model(parsed.model)
    engine, text = state.ready()
    state.check_queue(engine)
    assert parsed.messages is not None
    try:
        # Rendering a 170k-token conversation is real work: keep it off the loop too.
        prompt = await asyncio.to_thread(
            text.render_chat, parsed.messages, parsed.add_generation_prompt
        )
    except TemplateError as err:
        raise bad_request(f"chat template error: {err}", param="messages") from None
    ids = await text.encode_async(prompt, add_special_tokens=False)  # template adds them
    return await _run(request, state, parsed, ids, arrival, "chatcmpl-")


async def completions(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE_KEY]
    parsed = parse_completion(await read_json(request))
    state.check_model(parsed.model)
    engine, text = state.ready()
    state.check_queue(engine)
    if parsed.prompt_ids is not None:
        ids = parsed.prompt_ids
        bad = next((t for t in ids if not 0 <= t < engine.vocab_size), None)
        if bad is not None:
            raise bad_request(f"prompt token id {bad} is out of range [0, {engine.vocab_size})",
                              param="prompt")
    else:
        assert parsed.prompt_text is not None
        ids = await text.encode_async(parsed.prompt_text, add_special_tokens=True)
        if not ids:
            raise bad_request("the prompt encodes to zero tokens", param="prompt")
    return await _run(request, state, parsed, ids, arrival, "cmpl-")


async def _run(
    request: web.Request,
    state: ServerState,
    parsed: ParsedRequest,
    ids: list[int],
    arrival: float,
    prefix: str,
) -> web.StreamResponse:
    engine, text = state.ready()
    params = parsed.build_params(len(ids), engine.max_model_len, engine.vocab_size)
    rid = prefix + uuid.uuid4().hex
    detok = text.detokenizer(ids, parsed.stop, parsed.skip_special_tokens)
    gen = Generation(engine, state.tracker, state.metrics, rid, ids, params, detok, arrival)
    try:
        if parsed.stream:
            return await _stream(request, state, parsed, gen, text)
        return await _collect(state, parsed, gen, text)
    finally:
        gen.close()  # a cancelled handler (client gone) aborts the engine request here


def _engine_error(state: ServerState, err: EngineRequestError) -> APIError:
    if state.health_problem() is not None:
        return APIError(503, str(err), err_type="server_error", code="unavailable")
    return bad_request(str(err), code="request_rejected")


def _usage(gen: Generation) -> dict[str, Any]:
    return R.usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens)


async def _collect(
    state: ServerState, parsed: ParsedRequest, gen: Generation, text: TextCodec
) -> web.Response:
    pieces: list[str] = []
    out_ids: list[int] = []
    lps: list[TokenLogprob] = []
    try:
        while not gen.finished:
            step = await gen.next()
            assert step is not None
            pieces.append(step.text)
            out_ids.extend(step.token_ids)
            if step.logprobs:
                lps.extend(step.logprobs)
    except EngineRequestError as err:
        raise _engine_error(state, err) from None
    content = "".join(pieces)
    reason = gen.finish_reason or "stop"
    tok_ids = out_ids if parsed.return_token_ids else None
    prompt_ids = gen.prompt_ids if parsed.return_token_ids else None
    created = int(time.time())
    if parsed.kind == "chat":
        logprobs = R.chat_logprobs(lps, text.token_text) if parsed.logprobs is not None else None
        body = R.chat_response(gen.request_id, created, state.model_name, content, reason,
                               _usage(gen), logprobs, tok_ids, prompt_ids)
    else:
        logprobs = (R.completion_logprobs(lps, text.token_text, 0)
                    if parsed.logprobs is not None else None)
        body = R.completion_response(gen.request_id, created, state.model_name, content, reason,
                                     _usage(gen), logprobs, tok_ids, prompt_ids)
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def _stream(
    request: web.Request,
    state: ServerState,
    parsed: ParsedRequest,
    gen: Generation,
    text: TextCodec,
) -> web.StreamResponse:
    rid, model, created = gen.request_id, state.model_name, int(time.time())
    chat = parsed.kind == "chat"
    want_ids = parsed.return_token_ids
    resp = await sse.open_stream(request)
    # Completions carry prompt_token_ids on their first choice; chat on the role chunk.
    prompt_ids_pending = want_ids and not chat
    text_offset = 0

    def chunk(step_text: str, reason: str | None, lp: list[TokenLogprob] | None,
              ids: list[int] | None) -> dict[str, Any]:
        nonlocal prompt_ids_pending, text_offset
        if chat:
            lp_obj = R.chat_logprobs(lp, text.token_text) if lp else None
            delta = {"content": step_text} if reason is None else {}
            return R.chat_chunk(rid, created, model, delta, reason, lp_obj, ids)
        lp_obj = R.completion_logprobs(lp, text.token_text, text_offset) if lp else None
        text_offset += len(step_text)
        p_ids = gen.prompt_ids if prompt_ids_pending else None
        prompt_ids_pending = False
        return R.completion_chunk(rid, created, model, step_text, reason, lp_obj, ids, p_ids)

    try:
        if chat:
            # The role chunk goes out at once, as OpenAI does, before any token exists.
            role = R.chat_chunk(rid, created, model, {"role": "assistant", "content": ""})
            if want_ids:
                role["prompt_token_ids"] = gen.prompt_ids
            await resp.write(sse.frame(role))
        while not gen.finished:
            try:
                step = await gen.next(timeout=state.cfg.keepalive_interval)
            except EngineRequestError as err:
                await resp.write(sse.frame(_engine_error(state, err).to_dict()))
                break
            if step is None:
                await resp.write(sse.KEEPALIVE)  # long prefill: keep proxies and clients patient
                continue
            lp = step.logprobs if parsed.logprobs is not None else None
            ids = step.token_ids if want_ids else None
            if step.text or lp or ids:
                await resp.write(sse.frame(chunk(step.text, None, lp, ids)))
            if step.finish_reason is not None:
                await resp.write(sse.frame(chunk("", step.finish_reason, None,
                                                 [] if want_ids else None)))
        if parsed.include_usage and gen.finish_reason not in (None, "error"):
            obj = "chat.completion.chunk" if chat else "text_completion"
            await resp.write(sse.frame(R.usage_chunk(rid, created, model, obj, _usage(gen))))
        await resp.write(sse.DONE)
        await resp.write_eof()
    except ConnectionError:
        pass  # the client left; the caller's finally aborts the engine request
    return resp
