"""A request's life inside the engine (host-side state only).

    tokens:   [ prompt ............................ | output ....... ]
    KV:       [ cached (prefix hit) | computed here ]  not yet computed
              0             cached_len        computed_len        len(tokens)

(After a preemption the request may resume on a shorter prefix hit than its
first, so computed_len can then restart below cached_len.)

Pages: ``pages[i]`` holds tokens [i * page_size, (i + 1) * page_size).
``pages[:num_tree_pages]`` belong to the radix tree (locked through
``tree_node`` while the request lives); the rest are private to the request.

Hybrid models (linear-attention layers) also give an admitted request a
state-pool slot (``state_slot``) holding its recurrent state after
``computed_len`` tokens (engine/state_checkpoints.py): copied in from a
prefix-cache checkpoint at admission (``state_restore``), saved out at
checkpoint boundaries of its prefill (``checkpoints``, the request's until it
hands them to the prefix cache with its pages).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from ftserve.engine.grammar import GrammarMatcher
from ftserve.engine.messages import GenerateRequest, TokenLogprob
from ftserve.engine.sampling_params import SamplingParams


class ReqState(enum.Enum):
    WAITING = "waiting"  # queued (new or preempted), holds no pages
    PREFILL = "prefill"  # admitted, prompt KV partly computed
    DECODE = "decode"  # prompt done, generating
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float
    # Constrained decoding (response_format): advanced by every committed token.
    grammar: GrammarMatcher | None = None
    # GenerateRequest.unsent_tail: prompt tokens at its end a later turn will not resend.
    unsent_tail: int = 0
    # Set by the scheduler:
    tokens: list[int] = field(init=False)  # prompt + output
    output_ids: list[int] = field(default_factory=list, init=False)
    state: ReqState = field(default=ReqState.WAITING, init=False)
    pages: list[int] = field(default_factory=list, init=False)
    num_tree_pages: int = field(default=0, init=False)
    tree_node: Any = field(default=None, init=False)  # radix node locked by this request
    cached_len: int = field(default=0, init=False)  # prefix-cache hit at first admission
    computed_len: int = field(default=0, init=False)  # tokens whose KV is in pages
    slot: int = field(default=-1, init=False)  # sampler row, -1 when not admitted
    # Hybrid models: the request's state-pool slot while admitted (-1: none); the
    # checkpoint slot to copy into it before its next chunk (-1: none); the
    # checkpoints (tokens, slot) its chunks saved and the prefix cache has not
    # taken yet.
    state_slot: int = field(default=-1, init=False)
    state_restore: int = field(default=-1, init=False)
    checkpoints: list[tuple[int, int]] = field(default_factory=list, init=False)
    # Bumped at every admission (Scheduler._admit). A preempted request that is
    # admitted again may get its old slot back with other pages: the runner keys
    # its per-slot mirrors (page-table row, sampler parameters) on (req, admissions).
    admissions: int = field(default=0, init=False)
    num_preemptions: int = field(default=0, init=False)
    # Overlap scheduling: the latest launched step holding this request whose
    # results are not committed yet (-1: none), and the request's row in that
    # step's sampled tokens (-1: it samples nothing); the next decode step takes
    # its input token from there.
    inflight_step: int = field(default=-1, init=False)
    inflight_row: int = field(default=-1, init=False)
    # Speculative decoding (spec/speculator.py): its n-gram index and back-off, or
    # None until it first looks for a draft.
    spec: Any = field(default=None, init=False)
    # Set by the scheduler when it drops trailing private pages (a verify step's
    # rejected KV): the lowest page index whose page may differ from what the
    # runner mirrored; the runner re-mirrors from there and clears it.
    pages_trimmed_to: int | None = field(default=None, init=False)
    finish_reason: str | None = field(default=None, init=False)
    error: str | None = field(default=None, init=False)  # why, when finish_reason == "error"
    # The error is the server's own fault, not the request's (logged where it arose).
    internal_error: bool = field(default=False, init=False)
    # Outputs produced since the last report (drained by the engine each step).
    pending_ids: list[int] = field(default_factory=list, init=False)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list, init=False)
    # params.prompt_logprobs: the runner's device->host copies of the prompt
    # logprobs, one per prefill chunk (prompt_logprobs.Part), until the first output
    # carries them; then prompt_logprobs_sent.
    prompt_logprob_parts: list[Any] = field(default_factory=list, init=False)
    prompt_logprobs_sent: bool = field(default=False, init=False)
    # Timings (time.monotonic()).
    first_scheduled_time: float | None = field(default=None, init=False)
    first_token_time: float | None = field(default=None, init=False)
    finished_time: float | None = field(default=None, init=False)
    counted: bool = field(default=False, init=False)  # in the prompt / prefix-hit counters
    finish_reported: bool = field(default=False, init=False)  # its finished output went out

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt_ids)

    @classmethod
    def from_message(cls, msg: GenerateRequest) -> Req:
        return cls(msg.request_id, list(msg.prompt_ids), msg.params, msg.arrival_time,
                   msg.grammar, msg.unsent_tail)

    def check(self) -> None:
        # cached_len is the prefix hit of the first admission (what usage reports);
        # a preempted request can resume on less of that prefix (evicted meanwhile)
        # and recompute it, so only until a preemption does computed_len bound it.
        bound = self.computed_len if self.num_preemptions == 0 else self.prompt_len
        assert 0 <= self.cached_len <= bound and self.computed_len <= len(self.tokens), (
            self.request_id, self.cached_len, self.computed_len, len(self.tokens))
        assert 0 <= self.num_tree_pages <= len(self.pages)
        if self.checkpoints:  # (checked per committed token: no generator where there are none)
            # A checkpoint saved by a step still in flight lies past computed_len.
            done = len(self.tokens) if self.inflight else self.computed_len
            assert all(0 < n <= done for n, _ in self.checkpoints), (
                self.request_id, self.checkpoints, self.computed_len)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prefill chunks still compute prompt logprobs."""
        return self.params.prompt_logprobs is not None and not self.prompt_logprobs_sent

    @property
    def constrained(self) -> bool:
        return self.grammar is not None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_outputs(self) -> int:
        return len(self.output_ids)

    @property
    def num_inflight_tokens(self) -> int:
        """Tokens sampled on the device but not yet committed on the host (0 or 1)."""
        return 1 if self.inflight and self.inflight_row >= 0 else 0

    @property
    def inflight(self) -> bool:
        return self.inflight_step >= 0

    @property
    def remaining_prefill(self) -> int:
        """Tokens whose KV must be computed before the next token can be sampled."""
        return len(self.tokens) - self.computed_len

    @property
    def private_pages(self) -> list[int]:
        return self.pages[self.num_tree_pages:]

    @property
    def finished(self) -> bool:
        return self.state is ReqState.FINISHED
