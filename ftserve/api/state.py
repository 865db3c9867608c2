"""The server's shared state: config, engine (once loaded), text codec, tracker, metrics.

The HTTP server starts before the model finishes loading, so ``engine`` is None for a
while; every route that needs it answers 503 until ``attach`` runs.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

from aiohttp import web

from ftserve.api.errors import APIError, overloaded
from ftserve.api.generation import Tracker
from ftserve.api.metrics import Metrics
from ftserve.chat.generation_defaults import sampling_defaults
from ftserve.chat.grammar_service import GrammarService
from ftserve.chat.text import TextCodec
from ftserve.config import ServerConfig
from ftserve.engine.messages import GenerateRequest, RequestOutput

log = logging.getLogger(__name__)

DEMO_MODEL_NAME = "ftserve-demo"


class EngineAPI(Protocol):
    """The engine surface the server uses (ftserve.engine.engine.Engine)."""

    model_dir: str
    is_demo: bool
    max_model_len: int
    max_running_requests: int
    vocab_size: int
    healthy: bool
    error: str | None
    summary: dict[str, Any]  # start-up facts (KV capacity per tier, ...) for banner and cards

    def start(self, loop: asyncio.AbstractEventLoop,
              on_outputs: Callable[[list[RequestOutput]], None]) -> None: ...
    def submit(self, req: GenerateRequest) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def stats(self) -> Any: ...
    def reset_prefix_cache(self) -> bool: ...
    def shutdown(self) -> None: ...


class Door:
    """Generation requests admitted and not yet finished, shared by every listener
    over one engine. Only the event loop thread touches it, and ``ServerState.admit``
    checks and counts with no await in between, so requests that arrive together
    cannot all pass on one stale count (the engine's own waiting count lags by a
    step, and a request spends its template and tokenizer time before it gets
    there)."""

    def __init__(self) -> None:
        self.count = 0  # engine requests: one per choice once the body is parsed


class Ticket:
    """One request's place past the door, held until its handler ends (``with``)."""

    def __init__(self, door: Door) -> None:
        self._door = door
        self._held = 1
        door.count += 1

    def choices(self, n: int) -> None:
        """The request turned out to run ``n`` engine requests (n choices, a prompt
        batch): they all count. It is in already; only later arrivals see them."""
        extra = max(n, 1) - self._held
        self._door.count += extra
        self._held += extra

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc: object) -> None:
        self._door.count -= self._held
        self._held = 0


def served_name(cfg: ServerConfig, model: str | None) -> str:
    if cfg.served_model_name:
        return cfg.served_model_name
    if model is None:
        return DEMO_MODEL_NAME
    return os.path.basename(os.path.normpath(model)) or model


class ServerState:
    def __init__(self, cfg: ServerConfig, model_name: str) -> None:
        self.cfg = cfg
        self.model_name = model_name
        self.engine: EngineAPI | None = None  # set by attach() once loaded
        self.text: TextCodec | None = None
        self.tracker = Tracker()
        self.grammars = GrammarService()  # output constraints -> matchers (workers start on first use)
        self.metrics = Metrics(self._stats)
        self.draining = False
        self.door = Door()  # shared by sharing(): one engine, one count
        self.load_error: str | None = None
        self.created = int(time.time())  # the model card's "created": fixed for the process
        self._checkpoint_sampling: dict[str, Any] = {}  # generation_config.json's, set by attach

    def attach(self, engine: EngineAPI, text: TextCodec, loop: asyncio.AbstractEventLoop) -> None:
        """Runs on the loop: from here on outputs flow to the tracker once per engine step."""
        self.text = text
        self._checkpoint_sampling = sampling_defaults(engine.model_dir)
        if self.sampling_defaults:
            log.info("sampling defaults from the checkpoint's generation_config.json, for "
                     "fields a request leaves out: %s (--generation-config none: neutral)",
                     ", ".join(f"{k} {v}" for k, v in self.sampling_defaults.items()))
        engine.start(loop, self.tracker.on_outputs)
        self.engine = engine

    def sharing(self, cfg: ServerConfig) -> ServerState:
        """Another listener's state over the same engine, codec, tracker and metrics
        (e.g. a second port with other limits)."""
        other = ServerState.__new__(ServerState)
        other.__dict__.update(self.__dict__)
        other.cfg = cfg
        return other

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """What fills the sampling fields a request leaves out (--generation-config)."""
        return self._checkpoint_sampling if self.cfg.generation_config == "auto" else {}

    def _stats(self) -> Any | None:
        return None if self.engine is None else self.engine.stats()

    # --- admission checks (each raises the APIError the client should see) -----------

    def health_problem(self) -> str | None:
        if self.load_error is not None:
            return f"the model failed to load: {self.load_error}"
        if self.engine is None:
            return "the model is still loading"
        if not self.engine.healthy:
            return f"the engine stopped: {self.engine.error or 'unknown error'}"
        if self.draining:
            return "the server is shutting down"
        return None

    def ready(self) -> tuple[EngineAPI, TextCodec]:
        problem = self.health_problem()
        if problem is not None:
            raise APIError(503, problem, err_type="server_error", code="unavailable",
                           headers={"Retry-After": "5"})
        assert self.engine is not None and self.text is not None
        return self.engine, self.text

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves "
                           f"'{self.model_name}'.", param="model", code="model_not_found")

    def admit(self) -> Ticket:
        """The door of the routes that generate, before the body is read: at most
        --max-running-requests + --max-queued-requests requests (their choices
        counted) are past it at once; the next one gets 503 + Retry-After (529 on
        Anthropic's routes). No await between the check and the count."""
        engine, _ = self.ready()
        limit = engine.max_running_requests + self.cfg.max_queued_requests
        if self.door.count >= limit:
            raise overloaded(f"the server is full: {self.door.count} requests admitted "
                             f"(--max-running-requests {engine.max_running_requests} + "
                             f"--max-queued-requests {self.cfg.max_queued_requests}); retry later")
        # The engine may run fewer than its maximum (short of KV pages): its queue
        # still must not grow past the flag (0: no queue, but an empty one admits).
        waiting = engine.stats().waiting
        if waiting and waiting >= self.cfg.max_queued_requests:
            raise overloaded(f"too many queued requests ({waiting}); retry later")
        return Ticket(self.door)

    def authorized(self, header: str | None, x_api_key: str | None = None) -> bool:
        """``header``: Authorization (Bearer); ``x_api_key``: the x-api-key header, which
        Anthropic's clients send (app.py passes it on those routes only)."""
        if self.cfg.api_key is None:
            return True
        key = self.cfg.api_key.encode()
        if x_api_key is not None and hmac.compare_digest(x_api_key.strip().encode(), key):
            return True
        if not header or header[:7].lower() != "bearer ":  # the scheme is case-insensitive
            return False
        return hmac.compare_digest(header[7:].strip().encode(), key)


STATE_KEY: web.AppKey[ServerState] = web.AppKey("ftserve_state", ServerState)
