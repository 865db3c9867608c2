"""What validating a request body costs: the declared pydantic models of each protocol
(ftserve/api/*/models.py), on a typical agentic chat body: a system prompt, a few
turns with an earlier tool call and its result, two tools, the usual sampling fields.

For each protocol: the model's validation alone, and the whole parse into the
internal request (validation + mapping + cross-field checks), beside the peer every
request pays first: decoding the body's JSON with orjson (not counted in the
others: the body arrives as a dict, as read_json hands it over). Target: under
100 us per request for the OpenAI chat body.

    OMP_NUM_THREADS=1 python -m tools.bench.api_parse [--n 20000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import orjson

from ftserve.api.anthropic.models import MessagesRequest, parse_messages_request
from ftserve.api.openai.models import ChatCompletionRequest, parse_chat
from ftserve.api.responses.models import ResponsesRequest, parse_responses_request

SCHEMA = {"type": "object", "properties": {"path": {"type": "string"},
                                           "line": {"type": "integer", "minimum": 1}},
          "required": ["path"]}
SYSTEM = "You are a coding agent. Use the tools to read and edit files. " * 8
CHAT = {
    "model": "ftserve-demo",
    "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "The tests in tests/test_cache.py fail; fix them."},
        {"role": "assistant", "content": "Let me read the file first.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "read_file", "arguments": '{"path": "ftserve/cache.py"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "def evict(self):\n    ...\n" * 20},
        {"role": "user", "content": "Go on."},
    ],
    "tools": [
        {"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                          "parameters": SCHEMA}},
        {"type": "function", "function": {"name": "edit_file", "description": "Edit a file",
                                          "parameters": SCHEMA}},
    ],
    "tool_choice": "auto",
    "temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 4096, "seed": 7,
    "stream": True, "stream_options": {"include_usage": True},
}
ANTHROPIC = {
    "model": "ftserve-demo", "system": SYSTEM, "max_tokens": 4096, "temperature": 0.6,
    "top_p": 0.95, "top_k": 20, "stream": True,
    "messages": [
        {"role": "user", "content": "The tests in tests/test_cache.py fail; fix them."},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me read the file first."},
            {"type": "tool_use", "id": "toolu_1", "name": "read_file",
             "input": {"path": "ftserve/cache.py"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": "def evict(self):\n    ...\n" * 20},
            {"type": "text", "text": "Go on."}]},
    ],
    "tools": [{"name": "read_file", "description": "Read a file", "input_schema": SCHEMA},
              {"name": "edit_file", "description": "Edit a file", "input_schema": SCHEMA}],
    "tool_choice": {"type": "auto"},
}
RESPONSES = {
    "model": "ftserve-demo", "instructions": SYSTEM, "max_output_tokens": 4096,
    "temperature": 0.6, "top_p": 0.95, "stream": True, "store": False,
    "input": [
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "The tests in tests/test_cache.py fail."}]},
        {"type": "function_call", "call_id": "call_1", "name": "read_file",
         "arguments": '{"path": "ftserve/cache.py"}'},
        {"type": "function_call_output", "call_id": "call_1",
         "output": "def evict(self):\n    ...\n" * 20},
        {"type": "message", "role": "user", "content": "Go on."},
    ],
    "tools": [{"type": "function", "name": "read_file", "description": "Read a file",
               "parameters": SCHEMA},
              {"type": "function", "name": "edit_file", "description": "Edit a file",
               "parameters": SCHEMA}],
    "tool_choice": "auto",
}


def per_call_us(fn: Callable[[], Any], n: int, repeats: int) -> float:
    """The median over ``repeats`` runs of n calls, in microseconds per call."""
    for _ in range(min(n, 1000)):  # warm caches and the allocator
        fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cases: list[tuple[str, Callable[[], Any], Callable[[], Any]]] = [
        ("openai chat", lambda: ChatCompletionRequest.model_validate(CHAT),
         lambda: parse_chat(CHAT)),
        ("anthropic messages", lambda: MessagesRequest.model_validate(ANTHROPIC),
         lambda: parse_messages_request(ANTHROPIC)),
        ("openai responses", lambda: ResponsesRequest.model_validate(RESPONSES),
         lambda: parse_responses_request(RESPONSES)),
    ]
    raw = {"openai chat": orjson.dumps(CHAT), "anthropic messages": orjson.dumps(ANTHROPIC),
           "openai responses": orjson.dumps(RESPONSES)}
    print(f"{'body':<20} {'bytes':>6} {'json us':>8} {'validate us':>12} {'parse us':>9} "
          f"{'parse/json':>10}   (median of {args.repeats} x {args.n})")
    for name, validate, whole in cases:
        data = raw[name]
        decode = per_call_us(lambda data=data: orjson.loads(data), args.n, args.repeats)
        check = per_call_us(validate, args.n, args.repeats)
        parse = per_call_us(whole, args.n, args.repeats)
        print(f"{name:<20} {len(data):>6} {decode:>8.1f} {check:>12.1f} {parse:>9.1f} "
              f"{parse / decode:>9.1f}x")


if __name__ == "__main__":
    main()
