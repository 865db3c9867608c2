"""One request's life on the event loop: submit, collect per-step outputs, detokenize,
apply stop strings, record latency metrics, abort when the client goes away.

    engine thread --call_soon_threadsafe(on_outputs, [RequestOutput...])--> Tracker
    Tracker --queue per request--> Generation.next() --> the stream driver (driver.py)

The engine knows nothing about stop strings: when the detokenizer finds one, the
Generation aborts the engine request itself and reports finish_reason "stop".
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ftserve.api.metrics import Metrics
from ftserve.chat.text import StreamDetokenizer
from ftserve.engine.grammar import GrammarMatcher
from ftserve.engine.messages import GenerateRequest, RequestOutput, TokenLogprob
from ftserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # state.py imports this module
    from ftserve.api.state import EngineAPI


class EngineRequestError(Exception):
    """The engine could not run the request (finish_reason "error"). ``internal``: the
    server's own fault (already logged with ``request_id``), not the request's."""

    def __init__(self, message: str, request_id: str = "", internal: bool = False) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.internal = internal


class Tracker:
    """Routes each engine step's outputs to the waiting requests' queues (loop thread only)."""

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}

    def __len__(self) -> int:
        return len(self._queues)

    def ids(self) -> list[str]:
        return list(self._queues)

    def open(self, request_id: str) -> asyncio.Queue[RequestOutput]:
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:  # None: the request already ended on our side (stop string)
                queue.put_nowait(out)


@dataclass
class Step:
    """What one engine step produced, ready for the client."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # "stop" | "length" once finished ("abort": closed by us)
    # The first step of a request with prompt logprobs: one per prompt token (None first).
    prompt_logprobs: list[TokenLogprob | None] | None = None


class Generation:
    def __init__(
        self,
        engine: EngineAPI,
        tracker: Tracker,
        metrics: Metrics,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        detok: StreamDetokenizer,
        arrival_time: float,
        grammar: GrammarMatcher | None = None,
        score_only: bool = False,
    ) -> None:
        """``score_only``: the request scores its prompt (completions echo with
        max_tokens 0): the engine runs one token, which no step shows or counts."""
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.prompt_tokens = len(prompt_ids)
        self.params = params
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self._engine = engine
        self._tracker = tracker
        self._metrics = metrics
        self._detok = detok
        self._arrival = arrival_time
        self._last_token_time: float | None = None
        self._score_only = score_only
        self._queue = tracker.open(request_id)
        engine.submit(GenerateRequest(request_id, prompt_ids, params, arrival_time, grammar))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the output, if one did."""
        return self._detok.matched

    async def next(self, timeout: float | None = None) -> Step | None:
        """The next step, or None if nothing arrived within ``timeout`` seconds."""
        assert not self.finished, "next() after the request finished"
        try:
            out = await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            return None
        return self._consume(out)

    def close(self) -> None:
        """Always called by the handler (finally): frees the engine request if still live."""
        if not self.finished:
            self.finish_reason = "abort"
            self._metrics.finished.labels("abort").inc()
            self._engine.abort(self.request_id)
        self._tracker.close(self.request_id)

    def _consume(self, out: RequestOutput) -> Step:
        if out.finish_reason == "error":
            self.finish_reason = "error"
            self._metrics.finished.labels("error").inc()
            self._tracker.close(self.request_id)
            raise EngineRequestError(out.error or "the engine could not run this request",
                                     self.request_id, out.internal_error)
        now = time.monotonic()
        self.cached_tokens = out.cached_tokens
        self._observe(out, now)
        if self._score_only:
            if out.finished:
                self._finish("length", now)  # cut at its one token, which is dropped
            return Step("", [], None, self.finish_reason, out.prompt_logprobs)
        new_ids = list(out.new_token_ids)
        self.completion_tokens += len(new_ids)
        text = self._detok.push(new_ids)
        if self._detok.stopped:
            # Stop string: the engine keeps generating until told, so tell it now.
            if not out.finished:
                self._engine.abort(self.request_id)
            self._finish("stop", now)
        elif out.finished:
            text += self._detok.finish()
            if out.finish_reason == "abort":
                # The engine ended it early (a drain that timed out, a shutdown): the
                # client sees "length", the reason its API has for a cut-short reply
                # ("abort" is no OpenAI finish_reason); /metrics still counts an abort.
                self._finish("length", now, counted="abort")
            else:
                self._finish("stop" if out.finish_reason == "stop" else out.finish_reason, now)
        return Step(text, new_ids, out.logprobs, self.finish_reason, out.prompt_logprobs)

    def _finish(self, reason: str | None, now: float, counted: str | None = None) -> None:
        self.finish_reason = reason
        self._tracker.close(self.request_id)
        self._metrics.e2e.observe(now - self._arrival)
        self._metrics.finished.labels(counted or reason or "stop").inc()

    def _observe(self, out: RequestOutput, now: float) -> None:
        if not out.new_token_ids:
            return
        if self._last_token_time is None:
            first = out.first_token_time if out.first_token_time is not None else now
            self._metrics.ttft.observe(max(first - self._arrival, 0.0))
            if out.first_scheduled_time is not None:
                self._metrics.queue_time.observe(max(out.first_scheduled_time - self._arrival, 0.0))
            extra = len(out.new_token_ids) - 1
        else:
            extra = len(out.new_token_ids)
            gap = (now - self._last_token_time) / max(extra, 1)
            for _ in range(extra):
                self._metrics.itl.observe(gap)
        self._last_token_time = now
