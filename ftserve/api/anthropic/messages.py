"""POST /v1/messages and POST /v1/messages/count_tokens: Anthropic's Messages API
over the chat path of /v1/chat/completions.

The request (models.py) becomes the internal chat request, is rendered and
encoded as a chat request is (chat/prompt.py), runs as one ``Generation`` on the
stream driver (driver.py), and its output is split as a chat choice's is
(chat/output.py) into Anthropic's content blocks, in this order::

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
from ftserve.api.body import read_json
from ftserve.api.driver import Choice, Frame
from ftserve.api.errors import APIError
from ftserve.api.generation import Generation, Step
from ftserve.api.parts import PartStream
from ftserve.api.state import STATE_KEY, ServerState
from ftserve.chat.output import Piece, StreamSplit, WholeOutput
from ftserve.chat.prompt import chat_prompt

Event = dict[str, Any]


def _json(obj: Any) -> web.Response:
    return web.Response(body=orjson.dumps(obj), content_type="application/json")


async def count_tokens(request: web.Request) -> web.Response:
    """{"input_tokens": N}: the prompt a /v1/messages request with this body prefills."""
    state = request.app[STATE_KEY]
    req = parse_messages_request(await read_json(request), count_only=True)
    state.check_model(req.model)
    _, text = state.ready()
    prompt = await chat_prompt(text, req, state.cfg.reasoning_parser != "none")
    return _json({"input_tokens": len(prompt.ids)})


async def messages(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE_KEY]
    with state.admit():  # the door, before the body is read (state.py); full: 529
        return await _respond(request, state, arrival)


async def _respond(request: web.Request, state: ServerState, arrival: float) -> web.StreamResponse:
    req = parse_messages_request(await read_json(request))
    state.check_model(req.model)
    engine, text = state.ready()
    prompt = await chat_prompt(text, req, state.cfg.reasoning_parser != "none")
    # max_tokens is a ceiling, as Anthropic's newer models take it (agents ask for 32k
    # every turn): a reply that would pass the context window gets what room is left
    # and, if it fills it, stop_reason "model_context_window_exceeded".
    room = engine.max_model_len - len(prompt.ids)
    window = req.max_tokens is not None and 0 < room < req.max_tokens
    if window:
        req = dataclasses.replace(req, max_tokens=room)
    rid = "msg_" + uuid.uuid4().hex
    async with driver.running(state, req, [prompt.ids], arrival, rid, prompt.output,
                              prompt.constraint) as choices:
        if req.stream:
            shaper = MessagesStream(rid, state.model_name, window)
            return await driver.stream(request, state, choices, shaper)
        (choice,), (whole,) = choices, await driver.collect(state, choices)
        assert whole.output is not None
        stop = _stop_reason(choice.gen, bool(whole.output.calls), True, window)
        return _json(_message(rid, state.model_name, whole_blocks(whole.output), stop,
                              _usage(choice.gen)))


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


class StreamBlocks(PartStream):
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


class MessagesStream(driver.Shaper):
    """Anthropic's events of one reply: message_start once the first step arrived,
    its content blocks (StreamBlocks), message_delta and message_stop at its end."""

    def __init__(self, rid: str, model: str, window: bool) -> None:
        self.rid, self.model, self.window = rid, model, window
        self.blocks = StreamBlocks()
        self.started = False

    def step(self, choice: Choice, step: Step, piece: Piece) -> list[Frame]:
        events: list[Frame] = []
        if not self.started:
            # The first step carries the prefix-cache hit that usage reports.
            self.started = True
            start = _message(self.rid, self.model, [], (None, None), _usage(choice.gen))
            events.append({"type": "message_start", "message": start})
            assert isinstance(choice.split, StreamSplit)
            events += self.blocks.push("", "", choice.split.opening)  # a named call's start
        return events + self.blocks.push(*piece)

    def finish(self, choice: Choice, step: Step, piece: Piece) -> list[Frame]:
        events: list[Frame] = [*self.blocks.push(*piece), *self.blocks.finish()]
        split = choice.split
        assert isinstance(split, StreamSplit)
        reason, seq = _stop_reason(choice.gen, split.called, split.clean, self.window)
        return [*events, {"type": "message_delta",
                          "delta": {"stop_reason": reason, "stop_sequence": seq},
                          "usage": _usage(choice.gen)},
                {"type": "message_stop"}]

    def idle(self) -> list[Frame]:
        return [sse.PING if self.started else sse.KEEPALIVE]

    def error(self, err: APIError) -> list[Frame]:
        return [sse.event(err.to_anthropic())]

    def encode(self, event: dict[str, Any]) -> bytes:
        return sse.event(event)
