"""The grammar library's first look at a request's constraint, in a child process
where a crash cannot take the server down.

llguidance builds a grammar by recursing over it in native code: a long enough
chain of rules or $refs overflows the stack of the thread that builds it, and a
native stack overflow is a SIGSEGV that kills the process and every request in it.
Python's recursion limit does not reach into it. The library guards some depths
itself (a Lark expression's nesting, a regex's, the JSON it reads: 128 levels) but
not chains of rules or $refs, and its ``LLParserLimits`` (``LIMITS``) bound size
and time, not depth. The server bounds what it sends (response_format.py: bytes,
rules, $refs; limits.py: nesting), but no bound on text can promise a stack depth
for every shape of grammar (400 rules of 15 nested groups each overflow 8 MiB), so
every new constraint is first built and checked here:

    server (a grammar worker)                 child (this file, run by path)
      frame: kind, value (JSON)   ─────────▶   build the llguidance grammar
                                               validate it (a thread of CHECK_STACK)
      frame: {"grammar"} | {"error"} ◀──────
      EOF: the child died (SIGSEGV)  ->  rejected as too complex; a new child next time
      no answer within the timeout   ->  killed, rejected as too complex

The server then compiles the checked grammar against the model's vocabulary on
threads with ``COMPILE_STACK`` = 8 x ``CHECK_STACK`` (grammar_service.py).
Compiling recurses exactly as deep as checking (the same chain lengths overflow
both at a given stack size), so what fitted the child fits there with room to spare.

This file imports nothing from ftserve: the child runs it by path, so it starts
without torch or aiohttp.
"""

from __future__ import annotations

import json
import os
import select
import struct
import subprocess
import sys
import threading
import time
from typing import IO, Any

import llguidance
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

CHECK_STACK = 16 << 20  # the child's checking thread
COMPILE_STACK = 8 * CHECK_STACK  # the server's compiling threads (virtual: touched as used)

# llguidance's own limits (LLParserLimits), the same for checking and compiling so
# that a grammar the child accepts compiles. Their defaults, written out: a grammar
# of at most 500k symbols, 1M fuel to build the lexer, and per token mask at most
# 200k lexer fuel and 50k Earley items (the library's estimates: ~20 ms, ~15 ms and
# ~2.5 ms), which bound the host work a constrained request adds to an engine step.
LIMITS: dict[str, int] = {"max_grammar_size": 500_000, "initial_lexer_fuel": 1_000_000,
                          "step_lexer_fuel": 200_000, "step_max_items": 50_000,
                          "max_items_in_row": 2_000, "max_lexer_states": 250_000}

# JSON is generated compact (response_format.py says why); applied before the
# schema's own "x-guidance" options, so a schema can override it.
_JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False}


def parser_limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**LIMITS)


class Rejected(Exception):
    """The constraint cannot be used; the message completes "'<field>' ..."."""


class Crashed(Rejected):
    """The child died building or checking the grammar (a native stack overflow)."""


class TimedOut(Rejected):
    """The child took longer than its timeout (and was killed)."""


def build(kind: str, value: Any) -> str:
    """The checked llguidance grammar of a constraint (response_format.Kind and its
    value: a schema, a regex, a list of choices, a Lark or GBNF text); Rejected
    with the reason when the library refuses it."""
    if kind in ("json_object", "json_schema"):
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(value, defaults=_JSON_DEFAULTS)
        except (ValueError, TypeError, RecursionError) as err:
            raise Rejected(f"schema is invalid: {err}") from None
    elif kind == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(value)
    elif kind == "choice":
        # JSON string escapes are Lark's.
        grammar = llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    elif kind == "grammar":
        try:
            lark = any_to_lark(value)
        except GbnfToLarkError as err:
            raise Rejected(f"is not a valid grammar: {err}") from None
        except RecursionError:
            raise Rejected("nests too deeply to be converted from GBNF") from None
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    else:
        raise Rejected(f"has an unknown kind {kind!r}")
    problem = llguidance.LLMatcher.validate_grammar(grammar, limits=parser_limits())
    if problem:
        raise Rejected(f"is not valid: {problem.strip()}")
    return grammar


# --- the frames: 4-byte big-endian length, then the bytes -----------------------------


def _write(out: IO[bytes], data: bytes) -> None:
    out.write(struct.pack(">I", len(data)) + data)
    out.flush()


def _read_exactly(fd: int, n: int, deadline: float | None = None) -> bytes:
    """n bytes from ``fd``; b"" at EOF; TimeoutError past ``deadline`` (monotonic)."""
    parts, left = [], n
    while left:
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise TimeoutError
        chunk = os.read(fd, left)
        if not chunk:
            return b""
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _read(fd: int, deadline: float | None = None) -> bytes | None:
    head = _read_exactly(fd, 4, deadline)
    if not head:
        return None
    (size,) = struct.unpack(">I", head)
    body = _read_exactly(fd, size, deadline)
    if len(body) != size:
        return None
    return body


# --- the child -------------------------------------------------------------------------


def _serve(inp: int, out: IO[bytes]) -> None:
    while (frame := _read(inp)) is not None:
        kind, _, value = frame.partition(b"\n")
        try:
            reply = {"grammar": build(kind.decode(), json.loads(value))}
        except Rejected as err:
            reply = {"error": str(err)}
        except RecursionError:
            reply = {"error": "nests too deeply"}
        try:
            _write(out, json.dumps(reply).encode())
        except BrokenPipeError:  # the server went away mid-check
            return


def _child_main() -> None:
    out = os.fdopen(os.dup(1), "wb")  # the frames; anything else printed goes to stderr
    os.dup2(2, 1)
    threading.stack_size(CHECK_STACK)  # the same whatever `ulimit -s` says
    worker = threading.Thread(target=_serve, args=(0, out), name="grammar-check")
    worker.start()
    worker.join()


# --- the server's handle on one child --------------------------------------------------


class Sandbox:
    """One child process, used by one thread at a time: started on first use and
    again after it died or was killed."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._proc: subprocess.Popen[bytes] | None = None

    def check(self, kind: str, value: bytes) -> str:
        """The checked grammar of constraint ``kind`` whose JSON value is ``value``;
        Rejected when the library refuses it, crashes on it or takes too long."""
        proc = self._start()
        assert proc.stdin is not None and proc.stdout is not None
        try:
            _write(proc.stdin, kind.encode() + b"\n" + value)
            frame = _read(proc.stdout.fileno(), time.monotonic() + self.timeout)
        except TimeoutError:
            self.close()
            raise TimedOut(f"is too complex: checking its grammar took over {self.timeout:g} s") from None
        except (BrokenPipeError, ConnectionResetError):
            frame = None
        if frame is None:  # the child died: the library overflowed its stack, or worse
            self.close()
            raise Crashed("is too complex for the grammar library (building its grammar "
                          "overflowed the library's stack)")
        reply = json.loads(frame)
        if "error" in reply:
            raise Rejected(reply["error"])
        return str(reply["grammar"])

    def _start(self) -> subprocess.Popen[bytes]:
        if self._proc is None or self._proc.poll() is not None:
            # -P: the script's folder (ftserve/chat, whose module names are not the
            # standard library's but need not stay so) is not put on sys.path.
            self._proc = subprocess.Popen([sys.executable, "-P", os.path.abspath(__file__)],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        return self._proc

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()


if __name__ == "__main__":
    _child_main()
