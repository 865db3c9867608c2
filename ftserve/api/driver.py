"""The one stream driver every protocol's route runs on: it starts the engine
requests of an internal request (one ``Generation`` per choice), feeds each step
of a choice through that choice's output split once (chat/output.py: reasoning,
then tool calls), and hands the pieces to the protocol's ``Shaper``, which alone
knows the protocol's events; whole replies too (``collect``).

    ChatRequest + prompt ids --running()--> Choices (Generations submitted)
    stream:  steps --Choice.split, once per step--> Shaper.step / finish --> SSE bytes
    whole:   steps of each choice in turn --the split--> Whole --> the route's body

At n = 1 the driver awaits the one Generation itself; with more choices a task per
choice pumps its steps into one queue, read in arrival order (the stream
interleaves the choices by index). A step that does not come within
--keepalive-interval gets the shaper's keep-alive.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from ftserve.api import sse
from ftserve.api.errors import APIError
from ftserve.api.generation import EngineRequestError, Generation, Step
from ftserve.api.state import ServerState
from ftserve.chat.errors import RequestError
from ftserve.chat.output import OutputSpec, Piece, StreamSplit, WholeOutput, WholeSplit
from ftserve.chat.request import ChatRequest
from ftserve.chat.response_format import ResponseFormat
from ftserve.engine.grammar import GrammarMatcher
from ftserve.engine.messages import TokenLogprob
from ftserve.engine.sampling_params import SamplingParams

Frame = bytes | dict[str, Any]  # raw SSE bytes, or an event the shaper encodes when written


@dataclass
class Choice:
    """One choice of a request: its engine request and its output split (None: a
    completion, whose text is the output as it is)."""

    index: int
    gen: Generation
    split: StreamSplit | WholeSplit | None = None

    @property
    def tracks_reasoning(self) -> bool:
        return self.split is not None and self.split.tracks_reasoning

    @property
    def reasoning_tokens(self) -> int:
        return self.split.reasoning_tokens if self.split is not None else 0


class Shaper:
    """A protocol's stream: the frames for each moment of the driver's loop."""

    def open(self) -> list[Frame]:
        """Before any step (OpenAI's chat: a role chunk per choice)."""
        return []

    def step(self, choice: Choice, step: Step, piece: Piece) -> list[Frame]:
        """A step of ``choice``: its text split into ``piece``."""
        raise NotImplementedError

    def finish(self, choice: Choice, step: Step, piece: Piece) -> list[Frame]:
        """``choice`` ended with ``step``; ``piece``: what its split held back."""
        raise NotImplementedError

    def idle(self) -> list[Frame]:
        """No step within the keep-alive interval (a long prefill, a slow step)."""
        return [sse.KEEPALIVE]

    def error(self, err: APIError) -> list[Frame]:
        """The engine could not run a choice: the stream ends after this."""
        raise NotImplementedError

    def close(self, failed: bool) -> list[Frame]:
        """After the last choice ended (``failed``: after an error)."""
        return []

    def encode(self, event: dict[str, Any]) -> bytes:
        """An event's bytes, made when it is written."""
        raise NotImplementedError


@contextlib.asynccontextmanager
async def running(state: ServerState, req: ChatRequest, prompts: list[list[int]], arrival: float,
                  rid: str, output: OutputSpec | None = None,
                  constraint: ResponseFormat | None = None) -> AsyncIterator[list[Choice]]:
    """The request's choices, their engine requests submitted: one per prompt and
    choice (prompt_index * n + j; engine ids rid-0, rid-1, ... when there is more
    than one, else rid). Every prompt and the output ``constraint`` are checked
    before anything is submitted. ``output``: how a chat choice's output is split
    (None: a completion). On the way out every engine request still running is
    aborted (a handler cancelled when its client left ends here too)."""
    engine, text = state.ready()
    params = _params(req, prompts, state)
    grammars: list[GrammarMatcher | None] = [None] * (len(prompts) * req.n)
    if constraint is not None:  # one matcher per choice
        grammars = list(await state.grammars.matchers(constraint, text, engine.vocab_size,
                                                      len(grammars)))
    # The engine prefills a shared prompt once: the other choices wait for choice 0's
    # prefill and reuse its pages (engine/prefix_sharing.py).
    one = len(grammars) == 1
    choices: list[Choice] = []
    try:
        for p, ids in enumerate(prompts):
            for i in range(req.n):
                index = p * req.n + i
                detok = text.detokenizer(ids, req.stop, req.skip_special_tokens, req.include_stop)
                gen = Generation(engine, state.tracker, state.metrics,
                                 rid if one else f"{rid}-{index}", ids,
                                 req.choice_params(params[p], i), detok, arrival,
                                 grammars[index], req.score_only)
                split = None
                if output is not None:
                    split = output.stream() if req.stream else output.whole()
                choices.append(Choice(index, gen, split))
        yield choices
    finally:
        for choice in choices:
            choice.gen.close()


def _params(req: ChatRequest, prompts: list[list[int]], state: ServerState) -> list[SamplingParams]:
    """Sampling params per prompt (the checkpoint's defaults for fields the request
    leaves out); a prompt too long for the context is a 400 naming its index."""
    engine, _ = state.ready()
    out: list[SamplingParams] = []
    for i, ids in enumerate(prompts):
        try:
            out.append(req.build_params(len(ids), engine.max_model_len, engine.vocab_size,
                                        state.sampling_defaults))
        except RequestError as err:
            if len(prompts) == 1 or err.param != "prompt":
                raise
            raise RequestError(f"prompt[{i}]: {err.message}", err.param, err.code,
                               err.status) from None
    return out


def engine_error(state: ServerState, err: EngineRequestError) -> APIError:
    """What the client hears when the engine could not run a choice."""
    if err.internal:  # details are in the server's log under the request id
        return APIError(500, f"{err} (request {err.request_id})", err_type="server_error",
                        code="internal_error")
    if state.health_problem() is not None:
        return APIError(503, str(err), err_type="server_error", code="unavailable")
    return APIError(400, str(err), code="request_rejected")


# --- whole replies -------------------------------------------------------------------------


@dataclass
class Whole:
    """A choice's whole output."""

    text: str  # as generated (a completion's text)
    output: WholeOutput | None  # a chat choice's text split (reasoning, content, calls)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (None first)


async def collect(state: ServerState, choices: list[Choice]) -> list[Whole]:
    """Every choice's whole output (the engine runs them all at once; read in turn)."""
    out = []
    for choice in choices:
        gen, split = choice.gen, choice.split
        assert split is None or isinstance(split, WholeSplit)
        whole = Whole("", None)
        pieces: list[str] = []
        try:
            while not gen.finished:
                step = await gen.next()
                assert step is not None
                if step.prompt_logprobs is not None:
                    whole.prompt_logprobs = step.prompt_logprobs
                pieces.append(step.text)
                whole.token_ids.extend(step.token_ids)
                if step.logprobs:
                    whole.logprobs.extend(step.logprobs)
                if split is not None:
                    split.push(step.text, len(step.token_ids))
        except EngineRequestError as err:
            raise engine_error(state, err) from None
        whole.text = "".join(pieces)
        whole.output = split.finish() if split is not None else None
        out.append(whole)
    return out


# --- streams -----------------------------------------------------------------------------


async def stream(request: web.Request, state: ServerState, choices: list[Choice],
                 shaper: Shaper) -> web.StreamResponse:
    """Stream the choices' steps through ``shaper`` (see the module docstring)."""
    resp = await sse.open_stream(request)
    steps = _One(choices[0]) if len(choices) == 1 else _Merged(choices)

    async def write(frames: list[Frame]) -> None:
        for frame in frames:
            await resp.write(frame if isinstance(frame, bytes) else shaper.encode(frame))

    failed = False
    try:
        await write(shaper.open())
        while not steps.done():
            got = await steps.next(state.cfg.keepalive_interval)
            if got is None:
                await write(shaper.idle())
                continue
            choice, item = got
            if isinstance(item, EngineRequestError):
                await write(shaper.error(engine_error(state, item)))
                failed = True
                break
            split = choice.split
            assert split is None or isinstance(split, StreamSplit)
            # The one split of this step's text (reasoning tokens counted here).
            piece = split.push(item.text, len(item.token_ids)) if split is not None \
                else ("", item.text, [])
            frames = shaper.step(choice, item, piece)
            if item.finish_reason is not None:
                frames += shaper.finish(choice, item, split.finish() if split is not None
                                        else ("", "", []))
            await write(frames)
        await write(shaper.close(failed))
        await resp.write_eof()
    except ConnectionError:
        pass  # the client left; running() aborts the engine requests
    finally:
        steps.close()
    return resp


Got = tuple[Choice, Step | EngineRequestError]


class _One:
    """The steps of a single choice: its Generation, awaited directly."""

    def __init__(self, choice: Choice) -> None:
        self._choice = choice

    def done(self) -> bool:
        return self._choice.gen.finished

    async def next(self, timeout: float) -> Got | None:
        try:
            step = await self._choice.gen.next(timeout)
        except EngineRequestError as err:
            return self._choice, err
        return None if step is None else (self._choice, step)

    def close(self) -> None:
        pass


class _Merged:
    """The steps of several choices, in the order they arrive: a task per choice
    pumps its steps into one queue."""

    def __init__(self, choices: list[Choice]) -> None:
        self._choices = choices
        self._queue: asyncio.Queue[Got] = asyncio.Queue()
        self._pumps = [asyncio.create_task(self._pump(c)) for c in choices]

    async def _pump(self, choice: Choice) -> None:
        while not choice.gen.finished:
            try:
                step = await choice.gen.next()
            except EngineRequestError as err:
                self._queue.put_nowait((choice, err))
                return
            assert step is not None
            self._queue.put_nowait((choice, step))

    def done(self) -> bool:
        return all(c.gen.finished for c in self._choices) and self._queue.empty()

    async def next(self, timeout: float) -> Got | None:
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            return None

    def close(self) -> None:
        for task in self._pumps:
            task.cancel()
