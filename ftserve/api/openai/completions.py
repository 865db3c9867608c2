"""POST /v1/completions, streamed (SSE) and not, with prompt batches and echo as
OpenAI and vLLM do them.

A batch of P prompts with n choices each is P x n engine requests (at most
MAX_CHOICES); choice index = prompt_index * n + j. Every prompt is encoded and
validated (ids in range, not empty, fits the context) before any is submitted, so a
bad batch is a 400 naming the prompt index and leaves nothing running. With
``echo`` each choice's text starts with its prompt's text (a string prompt as sent,
token ids decoded); with ``logprobs`` too, the choice's logprobs start with the
prompt's tokens (the engine's prompt logprobs; the first token has none). The text
is the model's as it is: no chat output split.
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
from ftserve.api.openai.models import parse_completion
from ftserve.api.openai.stream import OpenAIStream
from ftserve.api.state import STATE_KEY, EngineAPI, ServerState
from ftserve.chat.errors import bad_request
from ftserve.chat.output import Piece
from ftserve.chat.request import ChatRequest
from ftserve.chat.text import TextCodec
from ftserve.engine.messages import TokenLogprob


async def completions(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE_KEY]
    with state.admit() as ticket:  # the door, before the body is read (state.py)
        req = parse_completion(await read_json(request))
        ticket.choices(len(req.prompts) * req.n)
        return await _complete(request, state, req, arrival)


async def _complete(request: web.Request, state: ServerState, req: ChatRequest,
                    arrival: float) -> web.StreamResponse:
    state.check_model(req.model)
    engine, text = state.ready()
    prompts = await encode_prompts(req, engine, text)  # a batch: prompt_index * n + j
    full_lens = [len(p) for p in prompts]
    prompts = [req.truncated(p, engine.max_model_len) for p in prompts]
    heads = echo_heads(req, text, prompts, full_lens)
    rid = "cmpl-" + uuid.uuid4().hex
    async with driver.running(state, req, prompts, arrival, rid,
                              constraint=req.response_format) as choices:
        # echo: each choice's text starts with its prompt's.
        per_choice = [h for h in heads for _ in range(req.n)] if heads else None
        if req.stream:
            shaper = CompletionStream(req, rid, int(time.time()), state.model_name, choices,
                                      text, per_choice)
            return await driver.stream(request, state, choices, shaper)
        created = int(time.time())
        wholes = await driver.collect(state, choices)
        body = whole_body(req, rid, created, state.model_name, choices, wholes, text, per_choice)
        return web.Response(body=orjson.dumps(body), content_type="application/json")


def _where(index: int, count: int) -> str:
    return f"prompt[{index}]: " if count > 1 else ""


async def encode_prompts(req: ChatRequest, engine: EngineAPI, text: TextCodec) -> list[list[int]]:
    """Each prompt of a completion request as token ids, checked; errors name the index."""
    count = len(req.prompts)
    out: list[list[int]] = []
    for i, prompt in enumerate(req.prompts):
        if isinstance(prompt, str):
            ids = await text.encode_async(prompt, add_special_tokens=True)
            if not ids:
                raise bad_request(f"{_where(i, count)}the prompt encodes to zero tokens",
                                  param="prompt")
        else:
            ids = prompt
            bad = next((t for t in ids if not 0 <= t < engine.vocab_size), None)
            if bad is not None:
                raise bad_request(f"{_where(i, count)}prompt token id {bad} is out of range "
                                  f"[0, {engine.vocab_size})", param="prompt")
        out.append(ids)
    return out


def echo_heads(req: ChatRequest, text: TextCodec, prompts: list[list[int]],
               full_lens: list[int]) -> list[str] | None:
    """With echo: each prompt's text, else None. A string prompt as sent, unless
    truncate_prompt_tokens cut it (``full_lens``: the lengths before); token ids decoded."""
    if not req.echo:
        return None
    return [p if isinstance(p, str) and len(ids) == n else text.decode(ids, req.skip_special_tokens)
            for p, ids, n in zip(req.prompts, prompts, full_lens)]


def _offsets(req: ChatRequest, choice: Choice, text: TextCodec, start: int = 0) -> R.TextOffsets:
    """A choice's text_offset counter: its tokens detokenized as its text is, from
    ``start`` (echo: the length of the prompt's text before them)."""
    return R.TextOffsets(text.detokenizer(choice.gen.prompt_ids, (), req.skip_special_tokens),
                         start)


def _echo_part(req: ChatRequest, choice: Choice, text: TextCodec,
               prompt_lps: list[TokenLogprob | None]) -> dict[str, Any]:
    """echo + logprobs: the prompt tokens' logprobs, offsets into their decoded text."""
    offsets = R.TextOffsets(text.detokenizer([], (), req.skip_special_tokens))
    return R.echo_logprobs(choice.gen.prompt_ids, prompt_lps, text.token_text, offsets)


def whole_body(req: ChatRequest, rid: str, created: int, model: str, choices: list[Choice],
               wholes: list[Whole], text: TextCodec, heads: list[str] | None) -> dict[str, Any]:
    """The text_completion object of whole replies."""
    body: dict[str, Any] = {}
    out_choices = []
    for choice, whole in zip(choices, wholes):
        gen = choice.gen
        head = heads[choice.index] if heads else ""
        logprobs = (R.completion_logprobs(whole.logprobs, text.token_text,
                                          _offsets(req, choice, text, len(head)))
                    if req.logprobs is not None else None)
        if req.echo_logprobs and whole.prompt_logprobs is not None:
            logprobs = R.join_logprobs(_echo_part(req, choice, text, whole.prompt_logprobs),
                                       logprobs)
        body = R.completion_response(rid, created, model, head + whole.text,
                                     gen.finish_reason or "stop", {}, logprobs,
                                     whole.token_ids if req.return_token_ids else None,
                                     gen.prompt_ids if req.return_token_ids else None)
        out_choices.append(R.whole_choice(body, choice.index, req.prompt_logprobs is not None,
                                          gen.prompt_ids, whole.prompt_logprobs, text.token_text))
    body["choices"] = out_choices
    body["usage"] = R.usage_of(choices, req.n)
    return body


class CompletionStream(OpenAIStream):
    """A completion's chunks: per choice, its text offsets (logprobs), its
    prompt_token_ids and the echoed prompt text (and its logprobs) on its first chunk."""

    object_name = "text_completion"

    def __init__(self, req: ChatRequest, rid: str, created: int, model: str,
                 choices: list[Choice], text: TextCodec, heads: list[str] | None) -> None:
        super().__init__(req, rid, created, model, choices, text)
        self._heads = list(heads) if heads else [""] * len(choices)  # sent with the first chunk
        self._ids_pending = [req.return_token_ids] * len(choices)
        self._offsets = [(_offsets(req, c, text, len(self._heads[c.index]))
                          if req.logprobs is not None else None) for c in choices]

    def step(self, choice: Choice, step: Step, piece: Piece) -> list[Frame]:
        lp = step.logprobs if self.req.logprobs is not None else None
        ids = step.token_ids if self.req.return_token_ids else None
        content = piece[1]
        if content or lp or ids or self._heads[choice.index]:  # echo's prompt goes first
            return [self._chunk(choice, content, None, lp, ids, step.prompt_logprobs)]
        return []

    def finish(self, choice: Choice, step: Step, piece: Piece) -> list[Frame]:
        frames: list[Frame] = []
        if piece[1]:
            frames.append(self._chunk(choice, piece[1], None, None, None))
        frames.append(self._chunk(choice, "", step.finish_reason, None,
                                  [] if self.req.return_token_ids else None))
        return frames

    def _chunk(self, choice: Choice, content: str, reason: str | None,
               lp: list[TokenLogprob] | None, ids: list[int] | None,
               prompt_lps: list[TokenLogprob | None] | None = None) -> dict[str, Any]:
        at = choice.index
        if self._heads[at]:
            content, self._heads[at] = self._heads[at] + content, ""
        offsets = self._offsets[at]
        lp_obj = (R.completion_logprobs(lp, self.text.token_text, offsets)
                  if lp and offsets is not None else None)
        if self.req.echo_logprobs and prompt_lps is not None:  # the first chunk: the prompt's
            lp_obj = R.join_logprobs(_echo_part(self.req, choice, self.text, prompt_lps), lp_obj)
        prompt_ids = choice.gen.prompt_ids if self._ids_pending[at] else None
        self._ids_pending[at] = False
        chunk = R.completion_chunk(self.rid, self.created, self.model, content, reason, lp_obj,
                                   ids, prompt_ids)
        return self.indexed(chunk, choice)
