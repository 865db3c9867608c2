"""Worker threads for the blocking part of requests: chat-template rendering, long
tokenizations, parsing a big JSON body. Two lanes, so one kind of request cannot
starve the other:

    light lane (LIGHT_THREADS)   requests with a body up to HEAVY_BODY_BYTES, and the
                                 server's own work (model load, prefix-cache reset)
    heavy lane (HEAVY_THREADS)   requests with a bigger body (read_json marks them)

A small request then waits at most for other small requests' work, never behind
a handful of 25 MB /tokenize calls; a huge request waits for the heavy lane, whose
jobs are as big as the body limit allows. Each request's work is sequential, so
one request holds at most one thread of its lane at a time.

The lane is a context variable of the request's handler task. ``LaneExecutor``
is the loop's default executor and reads it in ``submit``, which runs on the
loop thread in the submitting task's context: ``asyncio.to_thread`` and
``run_in_executor(None, ...)`` (the tokenizer cache's) need no lane argument.
Few threads in all: tokenizers release the GIL, and each thread costs its own
malloc arena.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

LIGHT_THREADS = 2
HEAVY_THREADS = 2
# A 250k-token conversation: the agentic requests this server is for stay light.
HEAVY_BODY_BYTES = 1 << 20

_HEAVY: contextvars.ContextVar[bool] = contextvars.ContextVar("ftserve_heavy_request",
                                                              default=False)


def mark_heavy(body_bytes: int) -> bool:
    """Called by a request's handler once its body size is known; True if this
    request's blocking work now goes to the heavy lane."""
    if body_bytes > HEAVY_BODY_BYTES:
        _HEAVY.set(True)
    return _HEAVY.get()


class LaneExecutor(ThreadPoolExecutor):
    """The light lane itself (so it is a ThreadPoolExecutor, as asyncio requires of
    a default executor); work submitted from a heavy request's task goes to the
    heavy lane instead."""

    def __init__(self, light: int = LIGHT_THREADS, heavy: int = HEAVY_THREADS) -> None:
        super().__init__(light, thread_name_prefix="ftserve-work")
        self.heavy = ThreadPoolExecutor(heavy, thread_name_prefix="ftserve-heavy")

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        if _HEAVY.get():
            return self.heavy.submit(fn, *args, **kwargs)
        return super().submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.heavy.shutdown(wait, cancel_futures=cancel_futures)
        super().shutdown(wait, cancel_futures=cancel_futures)
