"""POST /v1/responses: OpenAI's Responses API over the chat path of
/v1/chat/completions (stateless: see responses_protocol.py).

The request becomes the server's chat request, is rendered and encoded as a
chat request is (completions.chat_prompt), runs as one ``Generation``, and its
output is split by the same filter (chat_output.py) into output items, in this
order::

    reasoning {content: [reasoning_text]}     the reasoning the template marks (reasoning.py)
    message {content: [output_text]}          the text outside tool calls
    function_call {call_id, name, arguments}  each call, arguments a JSON string

status "incomplete" (incomplete_details.reason "max_output_tokens") when the
output hit max_output_tokens, unless every call was complete; else "completed".
usage: ``input_tokens`` is the prompt, ``input_tokens_details.cached_tokens``
the part the prefix cache held; ``output_tokens_details.reasoning_tokens`` the
output tokens inside the reasoning block, its tags included (Generation counts them).

Streamed, the events are the Responses API's, each with a ``sequence_number``:
``response.created`` and ``response.in_progress`` once the first step arrived
(before it, SSE keep-alive comments), then per item ``response.output_item.added``,
its deltas (``response.reasoning_text.delta``; ``response.content_part.added``
then ``response.output_text.delta``; ``response.function_call_arguments.delta``),
their ``.done`` events with the whole text, ``response.output_item.done``, and
last ``response.completed`` (or ``response.incomplete``) with the whole
response; an engine failure is an ``error`` event. A message never ends with
whitespace that a call follows, as the whole response strips it.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from aiohttp import web

from ftserve.api import driver, sse
from ftserve.api.generation import EngineRequestError, Generation
from ftserve.api.openai.completions import ChatPrompt, chat_prompt, engine_error, read_json
from ftserve.api.responses.models import parse_responses_request
from ftserve.api.state import STATE_KEY, ServerState
from ftserve.chat.output import WholeOutput
from ftserve.chat.request import ChatRequest

Item = dict[str, Any]
Event = dict[str, Any]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


async def responses(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE_KEY]
    with state.admit():  # the door, before the body is read (state.py)
        return await _respond(request, state, arrival)


async def _respond(request: web.Request, state: ServerState, arrival: float) -> web.StreamResponse:
    parsed = parse_responses_request(await read_json(request))
    state.check_model(parsed.model)
    _, text = state.ready()
    prompt = await chat_prompt(state, text, parsed)
    rid = _id("resp")
    gen = await driver.start(state, parsed, prompt, rid, arrival)
    shell = _Shell(rid, int(time.time()), state.model_name, parsed, gen.params.max_tokens)
    try:
        if parsed.stream:
            return await _stream(request, state, parsed, prompt, shell, gen)
        return await _whole(state, parsed, prompt, shell, gen)
    finally:
        gen.close()  # a cancelled handler (client gone) aborts the engine request here


class _Shell:
    """The response object's fields besides output, status and usage."""

    def __init__(self, rid: str, created: int, model: str, parsed: ChatRequest,
                 max_tokens: int) -> None:
        self.rid, self.created, self.model = rid, created, model
        self.parsed, self.max_tokens = parsed, max_tokens

    def body(self, output: list[Item], status: str, usage: dict[str, Any] | None) -> dict[str, Any]:
        p = self.parsed
        tools = [{"type": "function", "name": t["function"]["name"],
                  "description": t["function"].get("description"),
                  "parameters": t["function"].get("parameters"), "strict": False}
                 for t in p.tools or []]
        choice: Any = "auto" if p.tools else "none"
        if p.forced is not None:
            choice = "required" if p.forced.name is None else {"type": "function", "name": p.forced.name}
        return {
            "id": self.rid, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": output, "parallel_tool_calls": p.parallel_tool_calls,
            "tool_choice": choice, "tools": tools, "max_output_tokens": self.max_tokens,
            "temperature": p.sampling.get("temperature"), "top_p": p.sampling.get("top_p"),
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete" else None),
            "error": None, "previous_response_id": None, "store": False, "usage": usage,
            "text": {"format": {"type": "text"}},
        }


def _usage(gen: Generation) -> dict[str, Any]:
    cached = min(gen.cached_tokens, gen.prompt_tokens)
    return {"input_tokens": gen.prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": gen.completion_tokens, "output_tokens_details": {"reasoning_tokens": gen.reasoning_tokens},
            "total_tokens": gen.prompt_tokens + gen.completion_tokens}


def _status(gen: Generation, called: bool, complete: bool) -> str:
    return "incomplete" if gen.finish_reason == "length" and not (called and complete) else "completed"


def _reasoning(item_id: str, text: str) -> Item:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": "completed",
            "content": [{"type": "reasoning_text", "text": text}]}


def _message(item_id: str, text: str | None, status: str = "completed") -> Item:
    parts = [] if text is None else [{"type": "output_text", "text": text, "annotations": [],
                                      "logprobs": []}]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": parts}


def _call(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> Item:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def whole_items(out: WholeOutput) -> list[Item]:
    """A whole reply's output items: reasoning, message, then each call."""
    items: list[Item] = []
    if out.thought:
        items.append(_reasoning(_id("rs"), out.thought))
    if out.content:
        items.append(_message(_id("msg"), out.content))
    for call in out.calls:
        fn = call["function"]
        items.append(_call(_id("fc"), call["id"], fn["name"], fn["arguments"] or "{}"))
    return items


async def _whole(state: ServerState, parsed: ChatRequest, prompt: ChatPrompt, shell: _Shell,
                 gen: Generation) -> web.Response:
    out = await driver.whole_output(state, parsed, prompt, gen)
    items, status = whole_items(out), _status(gen, bool(out.calls), True)
    if status == "incomplete" and items:
        items[-1]["status"] = "incomplete"  # the item max_output_tokens cut off
    return driver.json_response(shell.body(items, status, _usage(gen)))


class StreamItems(driver.StreamShaper):
    """A stream's output items: which one is open, what it holds so far, and the
    events that open, extend and close them."""

    def __init__(self) -> None:
        super().__init__()
        self.items: list[Item] = []  # closed and open items, in output order
        self.kind: str | None = None  # the open item's type
        self._text = ""  # the open item's text (or arguments) so far
        self.last_status = "completed"  # "incomplete": the last item was cut off

    @property
    def _index(self) -> int:
        return len(self.items) - 1

    def _open(self, item: Item) -> list[Event]:
        events = self.close()
        self.items.append(item)
        self.kind, self._text = item["type"], ""
        events.append({"type": "response.output_item.added", "output_index": self._index, "item": dict(item)})
        if item["type"] == "message":
            events.append({"type": "response.content_part.added", "item_id": item["id"],
                           "output_index": self._index, "content_index": 0,
                           "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}})
        return events

    def close(self) -> list[Event]:
        if self.kind is None:
            return []
        item, at = self.items[-1], self._index
        ref = {"item_id": item["id"], "output_index": at}
        if self.kind == "reasoning":
            done = _reasoning(item["id"], self._text)
            events = [{"type": "response.reasoning_text.done", **ref, "content_index": 0, "text": self._text}]
        elif self.kind == "message":
            done = _message(item["id"], self._text)
            part = done["content"][0]
            events = [{"type": "response.output_text.done", **ref, "content_index": 0, "text": self._text,
                       "logprobs": []},
                      {"type": "response.content_part.done", **ref, "content_index": 0, "part": part}]
        else:
            done = _call(item["id"], item["call_id"], item["name"], self._text or "{}")
            events = [{"type": "response.function_call_arguments.done", **ref, "arguments": done["arguments"]}]
        done["status"] = item.get("status") if item.get("status") == "incomplete" else "completed"
        self.items[-1] = done
        self.kind = None
        return [*events, {"type": "response.output_item.done", "output_index": at, "item": done}]

    def finish(self) -> list[Event]:
        events = self.flush()
        if self.kind is not None:
            self.items[-1]["status"] = self.last_status  # close() keeps it: the last item's
        return events + self.close()

    def _delta(self, kind: str, delta: str, **extra: Any) -> Event:
        self._text += delta
        return {"type": kind, "item_id": self.items[-1]["id"], "output_index": self._index,
                "delta": delta, **extra}

    def thought(self, text: str) -> list[Event]:
        events = []
        if self.kind != "reasoning":
            events = self._open({"type": "reasoning", "id": _id("rs"), "summary": [], "content": [],
                                 "status": "in_progress"})
        return [*events, self._delta("response.reasoning_text.delta", text, content_index=0)]

    def text(self, body: str) -> list[Event]:
        events = self._open(_message(_id("msg"), None, "in_progress")) if self.kind != "message" else []
        return [*events, self._delta("response.output_text.delta", body, content_index=0, logprobs=[])]

    def call_start(self, call_id: str, name: str) -> list[Event]:
        return self._open(_call(_id("fc"), call_id, name, "", "in_progress"))

    def call_args(self, frag: str) -> list[Event]:
        return [self._delta("response.function_call_arguments.delta", frag)]


async def _stream(request: web.Request, state: ServerState, parsed: ChatRequest,
                  prompt: ChatPrompt, shell: _Shell, gen: Generation) -> web.StreamResponse:
    filt = driver.output_filter(state, parsed, prompt)
    items = StreamItems()
    resp = await sse.open_stream(request)
    seq = 0

    async def send(events: list[Event]) -> None:
        nonlocal seq
        for ev in events:
            await resp.write(sse.event({**ev, "sequence_number": seq}))
            seq += 1

    started = False
    try:
        while not gen.finished:
            try:
                step = await gen.next(state.cfg.keepalive_interval)
            except EngineRequestError as err:
                e = engine_error(state, err)
                await send([{"type": "error", "code": e.code, "message": e.message, "param": e.param}])
                break
            if step is None:  # long prefill or a slow step: keep proxies and clients patient
                await resp.write(sse.KEEPALIVE)
                continue
            if not started:
                # The first step carries the prefix-cache hit that usage reports.
                started = True
                shell_now = shell.body([], "in_progress", None)
                await send([{"type": "response.created", "response": shell_now},
                            {"type": "response.in_progress", "response": shell_now}])
                await send(items.push("", "", filt.opening))  # a named call's start
            await send(items.push(*filt.push(step.text)))
            if step.finish_reason is not None:
                await send(items.push(*filt.finish()))
                tools = filt.tools
                status = _status(gen, tools is not None and tools.called,
                                 tools is not None and tools.clean)
                items.last_status = status
                await send(items.finish())
                kind = "response.completed" if status == "completed" else "response.incomplete"
                await send([{"type": kind, "response": shell.body(items.items, status, _usage(gen))}])
        await resp.write_eof()
    except ConnectionError:
        pass  # the client left; the caller's finally aborts the engine request
    return resp
