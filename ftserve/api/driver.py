"""What the routes that run another API over the chat path share (Anthropic's
/v1/messages: anthropic_api.py; OpenAI's /v1/responses: responses_api.py): one
``Generation`` for a rendered chat request, with its output constraint, and its
output split whole or as a stream (chat_output.py) for the route to dress."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from ftserve.api.generation import EngineRequestError, Generation
from ftserve.api.openai import batch
from ftserve.api.openai.completions import ChatPrompt, engine_error
from ftserve.api.state import ServerState
from ftserve.chat import tool_calls
from ftserve.chat.output import ChatOutputFilter, WholeOutput, split_whole
from ftserve.chat.request import ChatRequest

Event = dict[str, Any]


async def start(state: ServerState, parsed: ChatRequest, prompt: ChatPrompt, rid: str,
                arrival: float) -> Generation:
    """The request's Generation (submitted)."""
    engine, text = state.ready()
    (params,) = batch.build_all(parsed, [prompt.ids], engine, state.sampling_defaults)
    grammar = None
    if prompt.constraint is not None:  # a response_format or a forced call's (chat_prompt)
        (grammar,) = await state.grammars.matchers(prompt.constraint, text, engine.vocab_size, 1)
    detok = text.detokenizer(prompt.ids, parsed.stop, parsed.skip_special_tokens)
    return Generation(engine, state.tracker, state.metrics, rid, prompt.ids, params, detok, arrival,
                      grammar, think=prompt.think)


def _fmt(state: ServerState, parsed: ChatRequest) -> tool_calls.Format | None:
    assert state.text is not None
    return state.text.tool_format() if parsed.tools else None


async def whole_output(state: ServerState, parsed: ChatRequest, prompt: ChatPrompt,
                       gen: Generation) -> WholeOutput:
    """Wait for the whole output and split it (reasoning, text, calls)."""
    pieces: list[str] = []
    try:
        while not gen.finished:
            step = await gen.next()
            assert step is not None
            pieces.append(step.text)
    except EngineRequestError as err:
        raise engine_error(state, err) from None
    return split_whole("".join(pieces), _fmt(state, parsed), parsed.parallel_tool_calls,
                       tool_calls.param_types(parsed.tools), prompt.think, prompt.forced)


def output_filter(state: ServerState, parsed: ChatRequest, prompt: ChatPrompt) -> ChatOutputFilter:
    """The filter that splits a stream's steps as whole_output splits the whole."""
    return ChatOutputFilter(_fmt(state, parsed), parsed.parallel_tool_calls,
                            tool_calls.param_types(parsed.tools), prompt.think, prompt.forced)


def json_response(obj: object) -> web.Response:
    return web.Response(body=orjson.dumps(obj), content_type="application/json")


class StreamShaper:
    """Turns a stream filter's pieces (reasoning, text, call deltas) into a route's
    events; a route implements the hooks (thought, text, call_start, call_args,
    close). Whitespace after text is held until more text comes: if a call comes
    instead it is dropped, as the whole response strips it."""

    def __init__(self) -> None:
        self._ws = ""  # held whitespace of the text

    def push(self, thought: str, content: str, deltas: list[dict[str, Any]]) -> list[Event]:
        events = self.thought(thought) if thought else []
        text = self._ws + content
        body = text.rstrip()
        self._ws = text[len(body):]
        if body:
            events += self.text(body)
        for d in deltas:
            if "id" in d:  # a call's start: its name; held whitespace before it is dropped
                self._ws = ""
                events += self.call_start(d["id"], d["function"]["name"])
            frag = d["function"].get("arguments", "")
            if frag:
                events += self.call_args(frag)
        return events

    def finish(self) -> list[Event]:
        """The held whitespace (no call followed it) and the last part's closing events."""
        return self.flush() + self.close()

    def flush(self) -> list[Event]:
        """The held whitespace: no call followed it."""
        events = self.text(self._ws) if self._ws else []
        self._ws = ""
        return events

    def thought(self, text: str) -> list[Event]:
        raise NotImplementedError

    def text(self, body: str) -> list[Event]:
        raise NotImplementedError

    def call_start(self, call_id: str, name: str) -> list[Event]:
        raise NotImplementedError

    def call_args(self, frag: str) -> list[Event]:
        raise NotImplementedError

    def close(self) -> list[Event]:
        raise NotImplementedError
