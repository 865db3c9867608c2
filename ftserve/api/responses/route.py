"""POST /v1/responses: OpenAI's Responses API over the chat path of
/v1/chat/completions (stateless: see models.py).

The request (models.py) becomes the internal chat request, is rendered and
encoded as a chat request is (chat/prompt.py), runs as one ``Generation`` on the
stream driver (driver.py), and its output is split as a chat choice's is
(chat/output.py) into output items, in this order::

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

import orjson
from aiohttp import web

from ftserve.api import driver, sse
from ftserve.api.body import read_json
from ftserve.api.driver import Choice, Frame
from ftserve.api.errors import APIError
from ftserve.api.generation import Generation, Step
from ftserve.api.parts import PartStream
from ftserve.api.responses.models import parse_responses_request
from ftserve.api.state import STATE_KEY, ServerState
from ftserve.chat.output import Piece, StreamSplit, WholeOutput
from ftserve.chat.prompt import chat_prompt
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
    req = parse_responses_request(await read_json(request))
    state.check_model(req.model)
    _, text = state.ready()
    prompt = await chat_prompt(text, req, state.cfg.reasoning_parser != "none")
    rid = _id("resp")
    async with driver.running(state, req, [prompt.ids], arrival, rid, prompt.output,
                              prompt.constraint) as choices:
        (choice,) = choices
        shell = _Shell(rid, int(time.time()), state.model_name, req, choice.gen.params.max_tokens)
        if req.stream:
            return await driver.stream(request, state, choices, ResponsesStream(shell))
        (whole,) = await driver.collect(state, choices)
        assert whole.output is not None
        items = whole_items(whole.output)
        status = _status(choice.gen, bool(whole.output.calls), True)
        if status == "incomplete" and items:
            items[-1]["status"] = "incomplete"  # the item max_output_tokens cut off
        body = shell.body(items, status, _usage(choice))
        return web.Response(body=orjson.dumps(body), content_type="application/json")


class _Shell:
    """The response object's fields besides output, status and usage."""

    def __init__(self, rid: str, created: int, model: str, req: ChatRequest,
                 max_tokens: int) -> None:
        self.rid, self.created, self.model = rid, created, model
        self.req, self.max_tokens = req, max_tokens

    def body(self, output: list[Item], status: str, usage: dict[str, Any] | None) -> dict[str, Any]:
        p = self.req
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


def _usage(choice: Choice) -> dict[str, Any]:
    gen = choice.gen
    cached = min(gen.cached_tokens, gen.prompt_tokens)
    return {"input_tokens": gen.prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": gen.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": choice.reasoning_tokens},
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


class StreamItems(PartStream):
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


class ResponsesStream(driver.Shaper):
    """The Responses API's events of one reply, each with its sequence_number:
    response.created and response.in_progress once the first step arrived, its
    output items (StreamItems), response.completed or response.incomplete last."""

    def __init__(self, shell: _Shell) -> None:
        self.shell = shell
        self.items = StreamItems()
        self.started = False
        self.seq = 0

    def step(self, choice: Choice, step: Step, piece: Piece) -> list[Frame]:
        events: list[Frame] = []
        if not self.started:
            # The first step carries the prefix-cache hit that usage reports.
            self.started = True
            now = self.shell.body([], "in_progress", None)
            events += [{"type": "response.created", "response": now},
                       {"type": "response.in_progress", "response": now}]
            assert isinstance(choice.split, StreamSplit)
            events += self.items.push("", "", choice.split.opening)  # a named call's start
        return events + self.items.push(*piece)

    def finish(self, choice: Choice, step: Step, piece: Piece) -> list[Frame]:
        events: list[Frame] = list(self.items.push(*piece))
        split = choice.split
        assert isinstance(split, StreamSplit)
        status = _status(choice.gen, split.called, split.clean)
        self.items.last_status = status
        events += self.items.finish()
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [*events, {"type": kind,
                          "response": self.shell.body(self.items.items, status, _usage(choice))}]

    def error(self, err: APIError) -> list[Frame]:
        return [{"type": "error", "code": err.code, "message": err.message, "param": err.param}]

    def encode(self, event: dict[str, Any]) -> bytes:
        frame = sse.event({**event, "sequence_number": self.seq})
        self.seq += 1
        return frame
