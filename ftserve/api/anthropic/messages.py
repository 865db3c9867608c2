"""POST /v1/messages and POST /v1/messages/count_tokens: Anthropic's Messages API
over the chat path of /v1/chat/completions.

The request becomes the server's chat request (anthropic_protocol.py), is
rendered and encoded as a chat request is (completions.chat_prompt), runs as one
``Generation``, and its output is split by the same filter (chat_output.py) into
Anthropic's content blocks, in this order::

    thinking {thinking, signature: ""}   the reasoning the template marks (reasoning.py);
                                         the signature is empty: nothing here signs it,
                                         and clients send it back unread
    text {text}                          the content outside tool calls
    tool_use {id: "toolu_...", name, input}   each call, input the parsed arguments

stop_reason: "tool_use" when calls came back (unless max_tokens cut one off),
"max_tokens", "model_context_window_exceeded" (max_tokens is a ceiling here:
a reply that would not fit the context window gets the room left, and this
when it fills it), "stop_sequence" (with the ``stop_sequence`` that matched),
else "end_turn". usage: ``input_tokens`` are the prompt tokens the prefix cache did
not hold, ``cache_read_input_tokens`` those it did (Anthropic's split: the
prompt is their sum), ``cache_creation_input_tokens`` 0 (caching costs nothing).

Streamed, the events are Anthropic's: ``message_start`` once the first step
arrived (it carries the prefix-cache hit; before it, SSE keep-alive comments),
then per block ``content_block_start`` / ``content_block_delta`` (text_delta,
thinking_delta, input_json_delta) / ``content_block_stop``, ``ping`` events as
keep-alives, ``message_delta`` (stop_reason, stop_sequence, usage) and
``message_stop``; an engine failure is an ``error`` event. A text block never
starts or ends with whitespace that a tool call follows, as the whole response
strips it (tool_calls.parse).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any

import orjson
from aiohttp import web

from ftserve.api import driver, sse
from ftserve.api.anthropic.models import parse_messages_request
from ftserve.api.generation import EngineRequestError, Generation
from ftserve.api.openai.completions import ChatPrompt, chat_prompt, engine_error, read_json
from ftserve.api.state import STATE_KEY, ServerState
from ftserve.chat.output import WholeOutput
from ftserve.chat.request import ChatRequest

Event = dict[str, Any]


def _json(obj: Any) -> web.Response:
    return web.Response(body=orjson.dumps(obj), content_type="application/json")


async def count_tokens(request: web.Request) -> web.Response:
    """{"input_tokens": N}: the prompt a /v1/messages request with this body prefills."""
    state = request.app[STATE_KEY]
    parsed = parse_messages_request(await read_json(request), count_only=True)
    state.check_model(parsed.model)
    _, text = state.ready()
    prompt = await chat_prompt(state, text, parsed)
    return _json({"input_tokens": len(prompt.ids)})


async def messages(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE_KEY]
    with state.admit():  # the door, before the body is read (state.py); full: 529
        return await _respond(request, state, arrival)


async def _respond(request: web.Request, state: ServerState, arrival: float) -> web.StreamResponse:
    parsed = parse_messages_request(await read_json(request))
    state.check_model(parsed.model)
    engine, text = state.ready()
    prompt = await chat_prompt(state, text, parsed)
    # max_tokens is a ceiling, as Anthropic's newer models take it (agents ask for 32k
    # every turn): a reply that would pass the context window gets what room is left
    # and, if it fills it, stop_reason "model_context_window_exceeded".
    room = engine.max_model_len - len(prompt.ids)
    window = parsed.max_tokens is not None and 0 < room < parsed.max_tokens
    if window:
        parsed = dataclasses.replace(parsed, max_tokens=room)
    rid = "msg_" + uuid.uuid4().hex
    gen = await driver.start(state, parsed, prompt, rid, arrival)
    try:
        if parsed.stream:
            return await _stream(request, state, parsed, prompt, rid, gen, window)
        return await _whole(state, parsed, prompt, rid, gen, window)
    finally:
        gen.close()  # a cancelled handler (client gone) aborts the engine request here


def _usage(gen: Generation) -> dict[str, int]:
    cached = min(gen.cached_tokens, gen.prompt_tokens)
    return {"input_tokens": gen.prompt_tokens - cached, "output_tokens": gen.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _stop_reason(gen: Generation, called: bool, complete: bool,
                 window: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence). ``complete``: every call sent parsed whole;
    ``window``: max_tokens was cut to the room the context window left."""
    if gen.finish_reason == "length" and not (called and complete):
        return ("model_context_window_exceeded" if window else "max_tokens"), None
    if called:
        return "tool_use", None
    if gen.stop_string is not None:
        return "stop_sequence", gen.stop_string
    return "end_turn", None


def _tool_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


def _message(rid: str, model: str, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
             usage: dict[str, int]) -> dict[str, Any]:
    return {"id": rid, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}


def whole_blocks(out: WholeOutput) -> list[dict[str, Any]]:
    """A whole reply's content blocks: thinking, text, then each call."""
    blocks: list[dict[str, Any]] = []
    if out.thought:
        blocks.append({"type": "thinking", "thinking": out.thought, "signature": ""})
    if out.content:
        blocks.append({"type": "text", "text": out.content})
    for call in out.calls:
        args = call["function"]["arguments"]
        blocks.append({"type": "tool_use", "id": _tool_id(), "name": call["function"]["name"],
                       "input": json.loads(args) if args else {}})
    return blocks


async def _whole(state: ServerState, parsed: ChatRequest, prompt: ChatPrompt, rid: str,
                 gen: Generation, window: bool) -> web.Response:
    out = await driver.whole_output(state, parsed, prompt, gen)
    blocks = whole_blocks(out)
    stop = _stop_reason(gen, bool(out.calls), True, window)
    return _json(_message(rid, state.model_name, blocks, stop, _usage(gen)))


class StreamBlocks(driver.StreamShaper):
    """A stream's content blocks: which one is open, and the events that open,
    extend and close them."""

    def __init__(self) -> None:
        super().__init__()
        self.index = -1
        self.kind: str | None = None  # the open block's type

    def _open(self, block: dict[str, Any]) -> list[Event]:
        events = self.close()
        self.index += 1
        self.kind = block["type"]
        return [*events, {"type": "content_block_start", "index": self.index,
                          "content_block": block}]

    def close(self) -> list[Event]:
        if self.kind is None:
            return []
        self.kind = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _delta(self, delta: dict[str, Any]) -> Event:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def thought(self, text: str) -> list[Event]:
        events = self._open({"type": "thinking", "thinking": "", "signature": ""}) if self.kind != "thinking" else []
        return [*events, self._delta({"type": "thinking_delta", "thinking": text})]

    def text(self, body: str) -> list[Event]:
        events = self._open({"type": "text", "text": ""}) if self.kind != "text" else []
        return [*events, self._delta({"type": "text_delta", "text": body})]

    def call_start(self, call_id: str, name: str) -> list[Event]:
        return self._open({"type": "tool_use", "id": _tool_id(), "name": name, "input": {}})

    def call_args(self, frag: str) -> list[Event]:
        return [self._delta({"type": "input_json_delta", "partial_json": frag})]


async def _stream(request: web.Request, state: ServerState, parsed: ChatRequest,
                  prompt: ChatPrompt, rid: str, gen: Generation,
                  window: bool) -> web.StreamResponse:
    model = state.model_name
    filt = driver.output_filter(state, parsed, prompt)
    blocks = StreamBlocks()
    resp = await sse.open_stream(request)

    async def send(events: list[Event]) -> None:
        for ev in events:
            await resp.write(sse.event(ev))

    started = False
    try:
        while not gen.finished:
            try:
                step = await gen.next(state.cfg.keepalive_interval)
            except EngineRequestError as err:
                await resp.write(sse.event(engine_error(state, err).to_anthropic()))
                break
            if step is None:  # long prefill or a slow step: keep proxies and clients patient
                await resp.write(sse.PING if started else sse.KEEPALIVE)
                continue
            if not started:
                # The first step carries the prefix-cache hit that usage reports.
                started = True
                start = _message(rid, model, [], (None, None), _usage(gen))
                await send([{"type": "message_start", "message": start}])
                await send(blocks.push("", "", filt.opening))  # a named call's start
            await send(blocks.push(*filt.push(step.text)))
            if step.finish_reason is not None:
                await send(blocks.push(*filt.finish()))
                await send(blocks.finish())
                tools = filt.tools
                called = tools is not None and tools.called
                reason, seq = _stop_reason(gen, called, tools is not None and tools.clean,
                                           window)
                await send([{"type": "message_delta",
                             "delta": {"stop_reason": reason, "stop_sequence": seq},
                             "usage": _usage(gen)},
                            {"type": "message_stop"}])
        await resp.write_eof()
    except ConnectionError:
        pass  # the client left; the caller's finally aborts the engine request
    return resp
