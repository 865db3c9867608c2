"""Typed messages between the event loop and the engine thread.

This is the one place that crosses the thread boundary:

    event loop --submit(GenerateRequest) / abort(request_id)--> engine thread
    engine thread --one call_soon_threadsafe per step: list[RequestOutput]--> event loop
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ftserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ftserve.engine.grammar import GrammarMatcher


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float  # time.monotonic() when the server received it
    # response_format: the request's own matcher (one per choice); from submit on,
    # only the engine thread touches it.
    grammar: GrammarMatcher | None = None
    # Tokens at the prompt's end that a later turn of the conversation will not
    # resend (a chat template's generation prompt, a forced call's start): a
    # hybrid model also saves its state before them (engine/state_checkpoints.py).
    unsent_tail: int = 0


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token_id, logprob) alternatives, best first
    rank: int | None = None  # prompt logprobs: 1 + the tokens scoring above it


@dataclass
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # message when finish_reason == "error"
    # The error is the server's own fault (a bug, logged with the request id and
    # its details): the client gets a 500 with the short ``error``.
    internal_error: bool = False
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    completion_tokens: int = 0  # total generated so far
    logprobs: list[TokenLogprob] | None = None
    # params.prompt_logprobs, on the request's first output: one per prompt token,
    # None for the first (nothing before it), else the token given the ones before.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Timings (seconds, monotonic clock); set when known.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    stop_token_hit: int | None = field(default=None)  # the stop/eos id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
