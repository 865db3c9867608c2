"""POST /v1/chat/completions and POST /v1/completions, streaming (SSE) and not."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from ftserve.api import sse, workers
from ftserve.api.errors import APIError
from ftserve.api.generation import EngineRequestError, Generation, Step
from ftserve.api.openai import batch
from ftserve.api.openai import objects as R
from ftserve.api.openai.models import parse_chat, parse_completion
from ftserve.api.state import STATE_KEY, ServerState
from ftserve.chat import limits, reasoning, tool_calls, tool_choice, tool_grammar
from ftserve.chat.errors import bad_request
from ftserve.chat.output import ChatOutputFilter, split_whole
from ftserve.chat.request import ChatRequest
from ftserve.chat.response_format import ResponseFormat
from ftserve.chat.text import TemplateError, TextCodec
from ftserve.engine.grammar import GrammarMatcher
from ftserve.engine.messages import TokenLogprob


async def read_json(request: web.Request) -> Any:
    """The body as JSON. It must arrive within --request-read-timeout (408), decode
    as its Content-Encoding says (gzip / deflate that does not: 400) and stay within
    --max-body-bytes (aiohttp's 413). A body past workers.HEAVY_BODY_BYTES moves the
    request's blocking work to the heavy lane, its JSON parsing included."""
    timeout = request.app[STATE_KEY].cfg.request_read_timeout
    try:
        async with asyncio.timeout(timeout):
            raw = await request.read()
    except TimeoutError:
        _abandon_body(request)
        raise APIError(408, f"the request body did not arrive within {timeout:g} s "
                       "(the server's --request-read-timeout)", code="request_timeout",
                       close=True) from None
    except web.RequestPayloadError as err:
        _abandon_body(request)
        cause = err.args[0] if err.args else err
        raise APIError(400, "the request body could not be read: "
                       f"{getattr(cause, 'message', cause)}", code="invalid_body",
                       close=True) from None
    try:
        if workers.mark_heavy(len(raw)):
            # Megabytes of JSON take tens of milliseconds to parse and walk: not on the loop.
            return await asyncio.get_running_loop().run_in_executor(None, _parse_checked, raw)
        return _parse_checked(raw)
    except orjson.JSONDecodeError as err:
        raise bad_request(f"invalid JSON body: {err}") from None


def _parse_checked(raw: bytes) -> Any:
    body = orjson.loads(raw)
    limits.check_body(body)  # a 400 naming the field that nests too deep
    return body


def _abandon_body(request: web.Request) -> None:
    """The rest of the body will not be read: aiohttp would otherwise read on after
    the answer (and, for a body that failed to decode, log the failure again as an
    unhandled exception and reset the connection before the client reads the answer).
    The answer closes the connection instead (APIError ``close``)."""
    request.content.feed_eof()


@dataclass(frozen=True)
class ChatPrompt:
    """A chat request's prompt as the engine gets it (what count_tokens counts)."""

    ids: list[int]  # the rendered conversation and the forced call's start, if any
    think: bool | None  # reasoning split: None = off, else whether the prompt opened it
    forced: str  # the forced tool_choice's start of a call, in the prompt (tool_choice.py)
    # The output constraint: the request's response_format, or a forced call's grammar
    # (tool_grammar.py).
    constraint: ResponseFormat | None = None


async def chat_prompt(state: ServerState, text: TextCodec, parsed: ChatRequest) -> ChatPrompt:
    """Render and encode a chat request (the OpenAI and the Anthropic routes share it)."""
    assert parsed.messages is not None
    if parsed.tools and text.tool_format() is None:
        raise bad_request("this model's chat template does not render tools, so it cannot "
                          "be given any", param="tools")
    kwargs = parsed.template_kwargs
    if parsed.thinking is not None and text.template_reads("enable_thinking"):
        kwargs = {**kwargs, "enable_thinking": parsed.thinking}
    try:
        # Rendering a 170k-token conversation is real work: keep it off the loop too.
        prompt = await asyncio.to_thread(
            text.render_chat, parsed.messages, parsed.add_generation_prompt, parsed.tools,
            kwargs, parsed.continue_final,
        )
    except TemplateError as err:
        raise bad_request(f"chat template error: {err}", param=parsed.prompt_field) from None
    # A forced tool_choice: the start of the call is prompt (after a reasoning block the
    # prompt opened is closed); the parser reads it first; a grammar holds the rest.
    fmt = text.tool_format()
    forced, constraint = "", parsed.response_format
    if parsed.forced is not None and fmt is not None:
        forced = tool_choice.forced_text(fmt, parsed.forced, text.escape_special)
        prompt += tool_choice.before_call(prompt, text.marks_reasoning())
        assert parsed.tools is not None  # request.offered_tools checked it
        constraint = tool_grammar.constraint(fmt, parsed.forced, parsed.tools,
                                             parsed.parallel_tool_calls)
    ids = await text.encode_async(prompt + forced, add_special_tokens=False)  # template adds them
    # Reasoning split (server/reasoning.py): None = off, else whether the prompt opened it.
    # Off under a forced call: the output continues the call, not a reasoning block;
    # off under a JSON response_format: the grammar makes all of the output the JSON.
    think = (reasoning.opens_in_prompt(prompt) if state.cfg.reasoning_parser != "none"
             and text.marks_reasoning() and not forced and parsed.response_format is None
             else None)
    return ChatPrompt(ids, think, forced, constraint)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE_KEY]
    with state.admit() as ticket:  # the door, before the body is read (state.py)
        parsed = parse_chat(await read_json(request))
        ticket.choices(parsed.n)
        state.check_model(parsed.model)
        engine, text = state.ready()
        cp = await chat_prompt(state, text, parsed)
        ids = batch.truncate(parsed, cp.ids, engine.max_model_len)  # the end stays: think, forced
        return await _run(request, state, parsed, [ids], arrival, "chatcmpl-", cp.think, cp.forced,
                              constraint=cp.constraint)


async def completions(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE_KEY]
    with state.admit() as ticket:  # the door, before the body is read (state.py)
        parsed = parse_completion(await read_json(request))
        ticket.choices(len(parsed.prompts) * parsed.n)
        return await _complete(request, state, parsed, arrival)


async def _complete(request: web.Request, state: ServerState, parsed: ChatRequest,
                    arrival: float) -> web.StreamResponse:
    state.check_model(parsed.model)
    engine, text = state.ready()
    prompts = await batch.encode_prompts(parsed, engine, text)  # a batch: prompt_index * n + j
    full_lens = [len(p) for p in prompts]
    prompts = [batch.truncate(parsed, p, engine.max_model_len) for p in prompts]
    return await _run(request, state, parsed, prompts, arrival, "cmpl-",
                      heads=batch.echo_heads(parsed, text, prompts, full_lens),
                      constraint=parsed.response_format)


async def _run(
    request: web.Request,
    state: ServerState,
    parsed: ChatRequest,
    prompts: list[list[int]],
    arrival: float,
    prefix: str,
    think: bool | None = None,
    forced: str = "",
    heads: list[str] | None = None,
    constraint: ResponseFormat | None = None,
) -> web.StreamResponse:
    engine, text = state.ready()
    # Every prompt is checked before anything is submitted (batch.py), and so is the
    # output constraint's grammar: one matcher per choice.
    params = batch.build_all(parsed, prompts, engine, state.sampling_defaults)
    grammars: list[GrammarMatcher | None] = [None] * (len(prompts) * parsed.n)
    if constraint is not None:
        grammars = list(await state.grammars.matchers(constraint, text, engine.vocab_size,
                                                      len(grammars)))
    rid = prefix + uuid.uuid4().hex
    # One engine request per choice (more than one: ids rid-0, rid-1, ... in choice order,
    # prompt_index * n + j; the response keeps rid). The engine prefills a shared prompt
    # once: the other choices wait for choice 0's prefill and reuse its pages
    # (engine/prefix_sharing.py).
    gens: list[Generation] = []
    one = len(prompts) * parsed.n == 1
    try:
        for p, ids in enumerate(prompts):
            for i in range(parsed.n):
                detok = text.detokenizer(ids, parsed.stop, parsed.skip_special_tokens,
                                         parsed.include_stop)
                gid = rid if one else f"{rid}-{p * parsed.n + i}"
                gens.append(Generation(engine, state.tracker, state.metrics, gid, ids,
                                       parsed.choice_params(params[p], i), detok, arrival,
                                       grammars[p * parsed.n + i], parsed.score_only, think))
        # echo: each choice's text starts with its prompt's.
        per_choice = [h for h in heads for _ in range(parsed.n)] if heads else None
        if parsed.stream:
            return await _stream(request, state, parsed, rid, gens, text, think, forced,
                                 per_choice)
        return await _collect(state, parsed, rid, gens, text, think, forced, per_choice)
    finally:
        for gen in gens:
            gen.close()  # a cancelled handler (client gone) aborts the engine requests here


def engine_error(state: ServerState, err: EngineRequestError) -> APIError:
    if err.internal:  # details are in the server's log under the request id
        return APIError(500, f"{err} (request {err.request_id})", err_type="server_error",
                        code="internal_error")
    if state.health_problem() is not None:
        return APIError(503, str(err), err_type="server_error", code="unavailable")
    return APIError(400, str(err), code="request_rejected")


async def _collect(
    state: ServerState, parsed: ChatRequest, rid: str, gens: list[Generation], text: TextCodec,
    think: bool | None, forced: str = "", heads: list[str] | None = None,
) -> web.Response:
    created = int(time.time())
    choices: list[dict[str, Any]] = []
    body: dict[str, Any] = {}
    types = tool_calls.param_types(parsed.tools)  # qwen3_coder values are typed by these
    for index, gen in enumerate(gens):  # the engine runs them all at once; read in turn
        pieces: list[str] = []
        out_ids: list[int] = []
        lps: list[TokenLogprob] = []
        prompt_lps: list[TokenLogprob | None] | None = None
        try:
            while not gen.finished:
                step = await gen.next()
                assert step is not None
                if step.prompt_logprobs is not None:
                    prompt_lps = step.prompt_logprobs
                pieces.append(step.text)
                out_ids.extend(step.token_ids)
                if step.logprobs:
                    lps.extend(step.logprobs)
        except EngineRequestError as err:
            raise engine_error(state, err) from None
        content = "".join(pieces)
        reason = gen.finish_reason or "stop"
        tok_ids = out_ids if parsed.return_token_ids else None
        prompt_ids = gen.prompt_ids if parsed.return_token_ids else None
        if parsed.kind == "chat":
            # Reasoning split off, then calls (only if all parse clean): chat_output.py.
            fmt = text.tool_format() if parsed.tools else None
            out = split_whole(content, fmt, parsed.parallel_tool_calls, types, think, forced)
            logprobs = R.chat_logprobs(lps, text.token_text, text.token_bytes) if parsed.logprobs is not None else None
            body = R.chat_response(rid, created, state.model_name, out.content, reason,
                                   {}, logprobs, tok_ids, prompt_ids)
            message = body["choices"][0]["message"]
            if out.calls:
                message["tool_calls"] = out.calls
                body["choices"][0]["finish_reason"] = "tool_calls"
            if out.thought is not None:
                message["reasoning_content"] = out.thought
                message["content"] = message["content"] or None
        else:
            head = heads[index] if heads else ""
            content = head + content
            logprobs = (R.completion_logprobs(lps, text.token_text,
                                              _offsets(parsed, gen, text, len(head)))
                        if parsed.logprobs is not None else None)
            if parsed.echo_logprobs and prompt_lps is not None:
                logprobs = R.join_logprobs(_echo_part(parsed, gen, text, prompt_lps), logprobs)
            body = R.completion_response(rid, created, state.model_name, content, reason,
                                         {}, logprobs, tok_ids, prompt_ids)
        choice = {**body["choices"][0], "index": index}
        if parsed.prompt_logprobs is not None and prompt_lps is not None:
            choice["prompt_logprobs"] = R.vllm_prompt_logprobs(gen.prompt_ids, prompt_lps, text.token_text)
        choices.append(choice)
    body["choices"] = choices
    body["usage"] = batch.usage(gens, parsed.n)
    return web.Response(body=orjson.dumps(body), content_type="application/json")


def _offsets(parsed: ChatRequest, gen: Generation, text: TextCodec, start: int = 0) -> R.TextOffsets:
    """A completion choice's text_offset counter: its tokens detokenized as its text is,
    from ``start`` (echo: the length of the prompt's text before them)."""
    return R.TextOffsets(text.detokenizer(gen.prompt_ids, (), parsed.skip_special_tokens), start)


def _echo_part(parsed: ChatRequest, gen: Generation, text: TextCodec,
               prompt_lps: list[TokenLogprob | None]) -> dict[str, Any]:
    """echo + logprobs: the prompt tokens' logprobs, offsets into their decoded text."""
    offsets = R.TextOffsets(text.detokenizer([], (), parsed.skip_special_tokens))
    return R.echo_logprobs(gen.prompt_ids, prompt_lps, text.token_text, offsets)


class _ChoiceChunks:
    """SSE chunks of one choice: for completions, its text offsets (logprobs),
    prompt_token_ids and the echoed prompt text on its first chunk."""

    def __init__(self, parsed: ChatRequest, rid: str, created: int, model: str,
                 gen: Generation, index: int, text: TextCodec, think: bool | None,
                 forced: str = "", head: str = "",
                 types: tool_calls.ParamTypes | None = None) -> None:
        self.chat = parsed.kind == "chat"
        self.rid, self.created, self.model, self.index = rid, created, model, index
        self.gen, self.text = gen, text
        self.prompt_ids_pending = parsed.return_token_ids and not self.chat
        self.head = head  # echo: the prompt's text, sent with the first chunk
        self.parsed = parsed
        self.offsets = (_offsets(parsed, gen, text, len(head))
                        if not self.chat and parsed.logprobs is not None else None)
        fmt = text.tool_format() if parsed.tools else None
        # With tools, content passes through a filter that turns tool calls into
        # tool_calls deltas; before it, reasoning is split off where the template marks it.
        self.filter = ChatOutputFilter(fmt, parsed.parallel_tool_calls, types,
                                       think if self.chat else None, forced)
        self.tools = self.filter.tools
        # A forced call's start: a named call's first delta is ready before any token.
        self.opening = self.filter.opening

    def split(self, delta: str) -> tuple[str, str, list[dict[str, Any]]]:
        """(reasoning, content safe to send, tool-call deltas) of a step's text."""
        return self.filter.push(delta)

    def finish(self) -> tuple[str, str, list[dict[str, Any]]]:
        """(reasoning, content, tool-call deltas) held back until the choice ended."""
        return self.filter.finish()

    def role(self, want_ids: bool) -> dict[str, Any]:
        # The role chunk goes out at once, as OpenAI does, before any token exists.
        out = self._indexed(R.chat_chunk(self.rid, self.created, self.model,
                                         {"role": "assistant", "content": ""}))
        if want_ids:
            out["prompt_token_ids"] = self.gen.prompt_ids
        return out

    def chunk(self, step_text: str, reason: str | None, lp: list[TokenLogprob] | None,
              ids: list[int] | None, thought: str = "",
              prompt_lps: list[TokenLogprob | None] | None = None) -> dict[str, Any]:
        if self.chat:
            lp_obj = R.chat_logprobs(lp, self.text.token_text, self.text.token_bytes) if lp else None
            delta: dict[str, Any] = {"reasoning_content": thought} if thought else {}
            if reason is None and (step_text or not thought):
                delta["content"] = step_text
            return self._indexed(R.chat_chunk(self.rid, self.created, self.model, delta, reason,
                                              lp_obj, ids))
        if self.head:
            step_text, self.head = self.head + step_text, ""
        lp_obj = (R.completion_logprobs(lp, self.text.token_text, self.offsets)
                  if lp and self.offsets is not None else None)
        if self.parsed.echo_logprobs and prompt_lps is not None:  # the first chunk, with the prompt's text
            lp_obj = R.join_logprobs(_echo_part(self.parsed, self.gen, self.text, prompt_lps), lp_obj)
        p_ids = self.gen.prompt_ids if self.prompt_ids_pending else None
        self.prompt_ids_pending = False
        return self._indexed(R.completion_chunk(self.rid, self.created, self.model, step_text,
                                                reason, lp_obj, ids, p_ids))

    def call_chunk(self, call_delta: dict[str, Any]) -> dict[str, Any]:
        """One tool_calls delta: a call's start (index, id, type, name, arguments "")
        or a fragment of its arguments (index, function.arguments)."""
        delta = {"tool_calls": [call_delta]}
        return self._indexed(R.chat_chunk(self.rid, self.created, self.model, delta))

    def _indexed(self, chunk: dict[str, Any]) -> dict[str, Any]:
        chunk["choices"][0]["index"] = self.index
        return chunk


async def _stream(
    request: web.Request,
    state: ServerState,
    parsed: ChatRequest,
    rid: str,
    gens: list[Generation],
    text: TextCodec,
    think: bool | None,
    forced: str = "",
    heads: list[str] | None = None,
) -> web.StreamResponse:
    model, created = state.model_name, int(time.time())
    chat = parsed.kind == "chat"
    want_ids = parsed.return_token_ids
    types = tool_calls.param_types(parsed.tools)  # qwen3_coder values are typed by these
    streams = [_ChoiceChunks(parsed, rid, created, model, g, i, text, think, forced,
                             heads[i] if heads else "", types) for i, g in enumerate(gens)]
    resp = await sse.open_stream(request)
    # Every choice's steps go through one queue, in the order they arrive.
    merged: asyncio.Queue[tuple[int, Step | EngineRequestError]] = asyncio.Queue()

    async def pump(index: int, gen: Generation) -> None:
        while not gen.finished:
            try:
                step = await gen.next()
            except EngineRequestError as err:
                merged.put_nowait((index, err))
                return
            assert step is not None
            merged.put_nowait((index, step))

    async def send(chunk: dict[str, Any]) -> None:
        if parsed.continuous_usage:  # vLLM's continuous_usage_stats: the counts so far, every chunk
            chunk["usage"] = batch.usage(gens, parsed.n)
        await resp.write(sse.frame(chunk))

    pumps = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        if chat:
            for st in streams:
                await send(st.role(want_ids))
                for d in st.opening:
                    await send(st.call_chunk(d))
        failed = False
        while not all(g.finished for g in gens) or not merged.empty():
            try:
                index, item = await asyncio.wait_for(merged.get(), state.cfg.keepalive_interval)
            except TimeoutError:
                await resp.write(sse.KEEPALIVE)  # long prefill: keep proxies and clients patient
                continue
            if isinstance(item, EngineRequestError):
                await resp.write(sse.frame(engine_error(state, item).to_dict()))
                failed = True
                break
            st = streams[index]
            lp = item.logprobs if parsed.logprobs is not None else None
            ids = item.token_ids if want_ids else None
            thought, step_text, deltas = st.split(item.text)
            if step_text or thought or lp or ids or st.head:  # st.head: echo's prompt, first
                await send(st.chunk(step_text, None, lp, ids, thought, item.prompt_logprobs))
            for d in deltas:
                await send(st.call_chunk(d))
            if item.finish_reason is not None:
                reason = item.finish_reason
                thought, tail, deltas = st.finish()
                if tail or thought:
                    await send(st.chunk(tail, None, None, None, thought))
                for d in deltas:
                    await send(st.call_chunk(d))
                if st.tools is not None and st.tools.called:
                    reason = "tool_calls"
                await send(st.chunk("", reason, None, [] if want_ids else None))
        if parsed.include_usage and not failed:
            obj = "chat.completion.chunk" if chat else "text_completion"
            await resp.write(sse.frame(R.usage_chunk(rid, created, model, obj,
                                                     batch.usage(gens, parsed.n))))
        await resp.write(sse.DONE)
        await resp.write_eof()
    except ConnectionError:
        pass  # the client left; the caller's finally aborts the engine requests
    finally:
        for task in pumps:
            task.cancel()
    return resp
