"""Output constraints become grammar matchers here: off the event loop, on a few
workers with deep stacks, each with its own sandbox child (grammar_sandbox.py).

    event loop             worker thread (COMPILE_STACK stack)            child
    matchers(fmt) ─job─▶   the checked grammar: kept, or ──────────────▶  build + validate
                  FIFO     compiled against the vocabulary               (may crash: 400)
                           (text.grammar_matchers keeps compiled ones)
                ◀───────   n matchers, or a 400 naming the field

``WORKERS`` jobs run at once whatever a burst brings; the others wait their turn in
order, and requests without a constraint never wait on them. Each job is bounded:
what reaches the library (response_format.py, limits.py), its fuel
(grammar_sandbox.LIMITS) and the child's time (``CHECK_TIMEOUT``). Checked grammars
are kept per constraint, and so are rejections: a client that resends a grammar the
library crashed on costs a lookup, not another child.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import queue
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ftserve.chat.errors import bad_request
from ftserve.chat.grammar_sandbox import COMPILE_STACK, Crashed, Rejected, Sandbox, TimedOut
from ftserve.engine.grammar import GrammarMatcher

if TYPE_CHECKING:
    from ftserve.chat.response_format import ResponseFormat
    from ftserve.chat.text import TextCodec

log = logging.getLogger(__name__)

WORKERS = 2
CHECK_TIMEOUT = 30.0  # seconds for the child to build and check one grammar
CHECKED_CACHE_SIZE = 64  # a grammar is at most a few hundred KB (response_format.MAX_BYTES)

_Job = tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...]]
_stack_size = threading.Lock()  # threading.stack_size is process-wide: set it for our threads only


def _work(jobs: queue.SimpleQueue[_Job | None], timeout: float) -> None:
    sandbox = Sandbox(timeout)
    try:
        while (job := jobs.get()) is not None:
            fut, fn, args = job
            if not fut.set_running_or_notify_cancel():
                continue  # its client went away while it waited
            try:
                fut.set_result(fn(sandbox, *args))
            except BaseException as err:  # noqa: BLE001 - handed to the waiting request
                fut.set_exception(err)
    finally:
        sandbox.close()


def _stop(jobs: queue.SimpleQueue[_Job | None], workers: int) -> None:
    for _ in range(workers):
        jobs.put(None)


class GrammarService:
    """Builds, checks and compiles requests' output constraints (one per server
    process and its listeners; workers and children start with the first one)."""

    def __init__(self, workers: int = WORKERS, timeout: float = CHECK_TIMEOUT) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._workers, self._timeout, self._started = workers, timeout, False
        self._lock = threading.Lock()
        self._checked: OrderedDict[bytes, tuple[bool, str]] = OrderedDict()  # key -> (ok, grammar | why)
        # The workers hold no reference to the service: when it goes, they stop
        # and their children with them.
        self._finalizer = weakref.finalize(self, _stop, self._jobs, workers)

    async def matchers(self, fmt: ResponseFormat, text: TextCodec, vocab_size: int,
                       n: int) -> list[GrammarMatcher]:
        """n fresh matchers of ``fmt`` (one per choice); a 400 naming its field when
        the grammar library refuses it, crashes on it or runs out of time."""
        self._start()
        fut: concurrent.futures.Future[list[GrammarMatcher]] = concurrent.futures.Future()
        self._jobs.put((fut, self._job, (fmt, text, vocab_size, n)))
        try:
            return await asyncio.wrap_future(fut)
        except Rejected as err:
            raise bad_request(f"'{fmt.param}' {err}", param=fmt.param) from None

    def close(self) -> None:
        """Stop the workers and their children (after the jobs already queued)."""
        self._finalizer()

    def _start(self) -> None:
        with self._lock:
            if self._started:
                return
            self._started = True
        with _stack_size:
            old = threading.stack_size(COMPILE_STACK)
            try:
                for i in range(self._workers):
                    threading.Thread(target=_work, args=(self._jobs, self._timeout), daemon=True,
                                     name=f"ftserve-grammar-{i}").start()
            finally:
                threading.stack_size(old)

    def _job(self, sandbox: Sandbox, fmt: ResponseFormat, text: TextCodec, vocab_size: int,
             n: int) -> list[GrammarMatcher]:
        grammar = self._checked_grammar(sandbox, fmt)
        try:
            return text.grammar_matchers(grammar, vocab_size, n)
        except ValueError as err:
            raise Rejected(f"cannot be used: {err}") from None

    def _checked_grammar(self, sandbox: Sandbox, fmt: ResponseFormat) -> str:
        key = hashlib.blake2b(fmt.kind.encode() + b"\n" + fmt.value, digest_size=16).digest()
        with self._lock:
            found = self._checked.get(key)
            if found is not None:
                self._checked.move_to_end(key)
        if found is None:
            try:
                found = (True, sandbox.check(fmt.kind, fmt.value))
            except TimedOut as err:  # maybe the machine's load: not kept
                log.warning("'%s' (%s, %d bytes): %s", fmt.param, fmt.kind, len(fmt.value), err)
                raise
            except Rejected as err:
                if isinstance(err, Crashed):
                    log.warning("'%s' (%s, %d bytes): %s", fmt.param, fmt.kind, len(fmt.value), err)
                found = (False, str(err))
            with self._lock:
                self._checked[key] = found
                while len(self._checked) > CHECKED_CACHE_SIZE:
                    self._checked.popitem(last=False)
        ok, out = found
        if not ok:
            raise Rejected(out)
        return out
