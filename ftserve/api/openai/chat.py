"""POST /v1/chat/completions, streamed (SSE) and not.

The request (models.py) is rendered and encoded (chat/prompt.py) and runs on the
stream driver (driver.py), one Generation per choice. Each choice's output is split
into reasoning (``reasoning_content``), content and ``tool_calls`` (chat/output.py);
a choice that called a tool finishes with "tool_calls".

Streamed: a role chunk per choice before any token (with a forced named call, its
start as a tool_calls delta too), then per step a chunk of the choice's content
and reasoning (with its logprobs and token ids when asked), a tool_calls delta per
call start or argument fragment, and a last chunk with the finish_reason.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson
from aiohttp import web

from ftserve.api import driver
from ftserve.api.body import read_json
from ftserve.api.driver import Choice, Frame, Whole
from ftserve.api.generation import Step
from ftserve.api.openai import objects as R
from ftserve.api.openai.models import parse_chat
from ftserve.api.openai.stream import OpenAIStream
from ftserve.api.state import STATE_KEY
from ftserve.chat.output import Piece, StreamSplit
from ftserve.chat.prompt import chat_prompt
from ftserve.chat.request import ChatRequest
from ftserve.chat.text import TextCodec
from ftserve.engine.messages import TokenLogprob


async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE_KEY]
    with state.admit() as ticket:  # the door, before the body is read (state.py)
        req = parse_chat(await read_json(request))
        ticket.choices(req.n)
        state.check_model(req.model)
        engine, text = state.ready()
        prompt = await chat_prompt(text, req, state.cfg.reasoning_parser != "none")
        ids = req.truncated(prompt.ids, engine.max_model_len)  # the end stays: think, forced
        rid = "chatcmpl-" + uuid.uuid4().hex
        async with driver.running(state, req, [ids], arrival, rid, prompt.output,
                                  prompt.constraint) as choices:
            if req.stream:
                shaper = ChatStream(req, rid, int(time.time()), state.model_name, choices, text)
                return await driver.stream(request, state, choices, shaper)
            created = int(time.time())
            wholes = await driver.collect(state, choices)
            body = whole_body(req, rid, created, state.model_name, choices, wholes, text)
            return web.Response(body=orjson.dumps(body), content_type="application/json")


def whole_body(req: ChatRequest, rid: str, created: int, model: str, choices: list[Choice],
               wholes: list[Whole], text: TextCodec) -> dict[str, Any]:
    """The chat.completion object of whole replies."""
    body: dict[str, Any] = {}
    out_choices = []
    for choice, whole in zip(choices, wholes):
        gen, out = choice.gen, whole.output
        assert out is not None
        logprobs = (R.chat_logprobs(whole.logprobs, text.token_text, text.token_bytes)
                    if req.logprobs is not None else None)
        body = R.chat_response(rid, created, model, out.content, gen.finish_reason or "stop", {},
                               logprobs, whole.token_ids if req.return_token_ids else None,
                               gen.prompt_ids if req.return_token_ids else None)
        message = body["choices"][0]["message"]
        if out.calls:
            message["tool_calls"] = out.calls
            body["choices"][0]["finish_reason"] = "tool_calls"
        if out.thought is not None:
            message["reasoning_content"] = out.thought
            message["content"] = message["content"] or None
        out_choices.append(R.whole_choice(body, choice.index, req.prompt_logprobs is not None,
                                          gen.prompt_ids, whole.prompt_logprobs, text.token_text))
    body["choices"] = out_choices
    body["usage"] = R.usage_of(choices, req.n)
    return body


class ChatStream(OpenAIStream):
    """A chat completion's chunks."""

    object_name = "chat.completion.chunk"

    def open(self) -> list[Frame]:
        # The role chunk goes out at once, as OpenAI does, before any token exists.
        frames: list[Frame] = []
        for choice in self.choices:
            role = self._chunk(choice, {"role": "assistant", "content": ""})
            if self.req.return_token_ids:
                role["prompt_token_ids"] = choice.gen.prompt_ids
            frames.append(role)
            assert isinstance(choice.split, StreamSplit)
            frames += [self.call_chunk(choice, d) for d in choice.split.opening]
        return frames

    def step(self, choice: Choice, step: Step, piece: Piece) -> list[Frame]:
        thought, content, deltas = piece
        lp = step.logprobs if self.req.logprobs is not None else None
        ids = step.token_ids if self.req.return_token_ids else None
        frames: list[Frame] = []
        if content or thought or lp or ids:
            frames.append(self._text_chunk(choice, content, thought, lp, ids))
        return frames + [self.call_chunk(choice, d) for d in deltas]

    def finish(self, choice: Choice, step: Step, piece: Piece) -> list[Frame]:
        thought, tail, deltas = piece
        frames: list[Frame] = []
        if tail or thought:
            frames.append(self._text_chunk(choice, tail, thought))
        frames += [self.call_chunk(choice, d) for d in deltas]
        assert isinstance(choice.split, StreamSplit)
        reason = "tool_calls" if choice.split.called else step.finish_reason
        frames.append(self._chunk(choice, {}, reason,
                                  token_ids=[] if self.req.return_token_ids else None))
        return frames

    def call_chunk(self, choice: Choice, call_delta: dict[str, Any]) -> dict[str, Any]:
        """One tool_calls delta: a call's start (index, id, type, name, arguments "")
        or a fragment of its arguments (index, function.arguments)."""
        return self._chunk(choice, {"tool_calls": [call_delta]})

    def _text_chunk(self, choice: Choice, content: str, thought: str,
                    lp: list[TokenLogprob] | None = None,
                    ids: list[int] | None = None) -> dict[str, Any]:
        delta: dict[str, Any] = {"reasoning_content": thought} if thought else {}
        if content or not thought:
            delta["content"] = content
        lp_obj = R.chat_logprobs(lp, self.text.token_text, self.text.token_bytes) if lp else None
        return self._chunk(choice, delta, logprobs=lp_obj, token_ids=ids)

    def _chunk(self, choice: Choice, delta: dict[str, Any], reason: str | None = None,
               logprobs: dict[str, Any] | None = None,
               token_ids: list[int] | None = None) -> dict[str, Any]:
        chunk = R.chat_chunk(self.rid, self.created, self.model, delta, reason, logprobs,
                             token_ids)
        return self.indexed(chunk, choice)
