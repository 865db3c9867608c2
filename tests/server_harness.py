"""A real ftserve server (real engine, demo model, uvloop) in a background thread.

Shared by the server test modules; each module starts one and reuses it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import weakref
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import openai
import pytest
import uvloop

from ftserve.api.serve import RunningServer, load_engine, start_http, warm_up
from ftserve.api.state import ServerState
from ftserve.api.workers import LaneExecutor
from ftserve.chat.text import TextCodec
from ftserve.config import EngineConfig, ServerConfig
from tests.engine_util import make_context_sensitive

T = TypeVar("T")

# Small on purpose: tests exercise queueing, and CPU decode steps must stay cheap.
TEST_ENGINE = EngineConfig(device="cpu", max_running_requests=2, max_model_len=512,
                           num_pages=192, page_size=16, max_prefill_length=256,
                           cuda_graph_max_bs=0, status_log_interval=0.0)
# make_context_sensitive's gain for the demo model (2 layers, hidden 64): at 20
# (tuned for tiny-moe) swapping two early prompt tokens changed 12 of 72 greedy
# tokens, at 100 it changes 62.
DEMO_ATTENTION_GAIN = 100.0
TEST_SERVER = ServerConfig(port=0, max_queued_requests=2, max_body_bytes=4 * 1024 * 1024,
                           drain_timeout=5.0, keepalive_interval=0.2)


@dataclass
class Live:
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    engine: Any
    text: TextCodec
    state: ServerState
    server: RunningServer
    extra: list[RunningServer]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def listen(self, cfg: ServerConfig) -> str:
        """A second listener on the same engine with another ServerConfig."""
        extra = self.call(start_http(self.state.sharing(cfg), "127.0.0.1", 0))
        self.extra.append(extra)
        return f"http://127.0.0.1:{extra.port}"

    def wait_idle(self, timeout: float = 10.0) -> Any:
        """Poll engine.stats() until nothing runs, waits or holds pages; return the stats."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.engine.stats()
            if st.running == 0 and st.waiting == 0 and st.kv_pages_used == 0:
                return st
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle after {timeout}s: {st}")
            time.sleep(0.02)


def start_live(engine_cfg: EngineConfig = TEST_ENGINE,
               server_cfg: ServerConfig = TEST_SERVER, *,
               attention_gain: float | None = DEMO_ATTENTION_GAIN) -> Live:
    """``attention_gain``: see below; None for real weights (tests/real_model.py)."""
    engine, text = load_engine(engine_cfg, server_cfg.chat_template)
    # Demo weights are dummy weights: without the attention gain the greedy token
    # depends on the last input token alone, and a wrong prefix-cache hit (or any
    # wrong KV) could not change what the server returns. CPU only: the gpu tests
    # keep the model as loaded (their kernels may hold weight copies made at load).
    if engine_cfg.device == "cpu" and attention_gain is not None:
        make_context_sensitive(engine.runner.model, attention_gain)
    loop = uvloop.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-server-loop", daemon=True)
    thread.start()
    state = ServerState(server_cfg, server_cfg.served_model_name or "ftserve-demo")

    async def boot() -> RunningServer:
        # serve()'s worker threads, so tests see the lanes the server runs with.
        asyncio.get_running_loop().set_default_executor(LaneExecutor())
        state.attach(engine, text, asyncio.get_running_loop())
        server = await start_http(state, "127.0.0.1", 0)
        await warm_up(state)
        return server

    server = asyncio.run_coroutine_threadsafe(boot(), loop).result(120)
    return Live(loop, thread, engine, text, state, server, [])


def template_server(tmp_path_factory: pytest.TempPathFactory, template: Path) -> Live:
    """A one-layer tiny-moe server whose chat template is ``template`` (--chat-template):
    for the tool-call syntaxes the demo's own template does not write."""
    from ftserve.models.checkpoint import write_checkpoint

    ckpt = write_checkpoint("tiny-moe", tmp_path_factory.mktemp(template.stem) / "m", layers=1, seed=0)
    return start_live(dataclasses.replace(TEST_ENGINE, model=str(ckpt)),
                      dataclasses.replace(TEST_SERVER, chat_template=str(template)))


def template_live(template: Path) -> Any:
    """A module's ``live`` fixture: template_server over ``template``, stopped after
    the module (``live = template_live(TEMPLATE)`` at module level)."""
    @pytest.fixture(scope="module")
    def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
        server = template_server(tmp_path_factory, template)
        try:
            yield server
        finally:
            stop_live(server)

    return live


def stop_live(live: Live) -> None:
    for srv in [*live.extra, live.server]:
        live.call(srv.runner.cleanup())
    live.engine.shutdown()
    live.loop.call_soon_threadsafe(live.loop.stop)
    live.thread.join(10)


def script_generations(monkeypatch: Any, pieces: list[str]) -> None:
    """Replace each generation's step texts with ``pieces`` in order (the rest on
    its last step): end-to-end tests of output parsing, which a random tiny model
    never writes. ``pieces`` is read when a generation starts, so a test may refill it."""
    from ftserve.api.generation import Generation

    real, left = Generation.next, {}

    async def next_(self: Generation, timeout: float | None = None) -> Any:
        step = await real(self, timeout)
        if step is None:
            return step
        # Keyed by id() and checked by weak reference: a finished generation's id is
        # reused by a later one, which must start the script afresh.
        ref, rest = left.get(id(self), (None, []))
        if ref is None or ref() is not self:
            ref, rest = left[id(self)] = (weakref.ref(self), list(pieces))
        text = rest.pop(0) if rest else ""
        if step.finish_reason is not None:
            text += "".join(rest)
            rest.clear()
        return dataclasses.replace(step, text=text)

    monkeypatch.setattr(Generation, "next", next_)


def openai_client(live: Live) -> openai.OpenAI:
    """The official client against ``live``, no retries (a failure shows as it is)."""
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    """The demo server on TEST_ENGINE, one per test module that imports this fixture."""
    server = start_live()
    yield server
    stop_live(server)


@pytest.fixture(scope="module")
def client(live: Live) -> openai.OpenAI:
    return openai_client(live)
