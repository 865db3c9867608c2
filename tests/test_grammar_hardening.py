"""Hostile structure against a real server: rule chains, $ref chains, deep nesting
and huge choice lists in every field that reaches the grammar library (llguidance)
or the prompt's escaping helper. Each is a 4xx naming the field, the process stays
up (a native stack overflow in the library would kill it and every request in
flight), and grammar work stays off the event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
from typing import Any

import aiohttp
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftserve.chat.response_format import MAX_BYTES
from tests.server_harness import TEST_SERVER, Live
from tests.test_server_errors import call

MODEL = "ftserve-demo"
MSGS = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"


def lark_chain(n: int) -> str:
    """r0 -> r1 -> ... -> rn: each rule's only non-terminal is the next rule."""
    return "start: r0\n" + "".join(f'r{i}: r{i + 1} | "x"\n' for i in range(n)) + f'r{n}: "y"\n'


def ref_chain(n: int) -> dict[str, Any]:
    """A schema whose $refs go d0 -> d1 -> ... -> dn."""
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def nested(depth: int) -> str:
    """A JSON value nested ``depth`` containers deep, as a placeholder that ``encode``
    writes out (the JSON encoders stop far earlier: orjson at 255 levels)."""
    return f"__nested_{depth}__"


def nested_text(depth: int) -> str:
    """JSON text of an object nested ``depth`` containers deep (objects and arrays by turns)."""
    opens = "".join('{"a":' if i % 2 == 0 else "[" for i in range(depth))
    return opens + "1" + "".join("}" if i % 2 == 0 else "]" for i in reversed(range(depth)))


def encode(body: Any) -> bytes:
    return re.sub(r'"__nested_(\d+)__"', lambda m: nested_text(int(m[1])), json.dumps(body)).encode()


def chat_error(live: Live, body: dict[str, Any], path: str = CHAT) -> tuple[int, dict[str, Any]]:
    limit = {"max_output_tokens": 16} if path == "/v1/responses" else {"max_tokens": 1}
    status, _, out = call(live, path, raw=encode({"model": MODEL, **limit, **body}))
    return status, out


def assert_400(live: Live, body: dict[str, Any], param: str, path: str = CHAT) -> str:
    status, out = chat_error(live, body, path)
    assert status == 400, out
    if path.startswith("/v1/messages"):  # Anthropic's shape names the field in the message
        message = out["error"]["message"]
        assert f"'{param}'" in message, message
        return message
    assert out["error"]["param"] == param, out
    return out["error"]["message"]


def assert_serving(live: Live) -> None:
    """The process survived: health is ok and a plain request still generates."""
    status, _, body = call(live, "/health", method="GET", raw=b"")
    assert status == 200, body
    status, out = chat_error(live, {"messages": MSGS})
    assert status == 200 and out["choices"][0]["finish_reason"] in ("stop", "length"), out


# --- 1: what overflowed the library's stack ---------------------------------------------


@pytest.mark.parametrize("field", ["guided_grammar", "grammar"])
def test_a_3000_rule_chain_is_a_400_naming_the_field(live: Live, field: str) -> None:
    message = assert_400(live, {"messages": MSGS, field: lark_chain(3000)}, field)
    assert "rules" in message, message
    assert_serving(live)


@pytest.mark.parametrize(("path", "body", "param"), [
    (CHAT, {"messages": MSGS, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": ref_chain(5000)}}},
     "response_format"),
    (CHAT, {"messages": MSGS, "guided_json": json.dumps(ref_chain(5000))}, "guided_json"),
    ("/v1/messages", {"messages": MSGS, "output_config": {
        "format": {"type": "json_schema", "schema": ref_chain(5000)}}}, "output_config.format"),
    ("/v1/responses", {"input": "hi", "text": {
        "format": {"type": "json_schema", "name": "x", "schema": ref_chain(5000)}}}, "text.format"),
], ids=["response_format", "guided_json", "anthropic", "responses"])
def test_a_5000_ref_chain_is_a_400_naming_the_field(live: Live, path: str, body: dict[str, Any],
                                                     param: str) -> None:
    message = assert_400(live, body, param, path)
    assert "$ref" in message, message
    assert_serving(live)


def test_chains_under_the_bounds_still_work(live: Live) -> None:
    """The bounds are far from what real grammars need: a 300-rule chain and a
    300-$ref chain compile, constrain the output and finish."""
    status, out = chat_error(live, {"messages": MSGS, "max_tokens": 8, "guided_grammar": lark_chain(300)})
    assert status == 200 and out["choices"][0]["message"]["content"] in ("x", "y"), out
    status, out = chat_error(live, {"messages": MSGS, "max_tokens": 8, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": ref_chain(300)}}})
    assert status == 200, out
    assert isinstance(json.loads(out["choices"][0]["message"]["content"]), int), out


def test_a_grammar_the_sandbox_accepts_compiles_on_a_deep_stack(live: Live) -> None:
    """400 rules of 15 nested groups each: the library's recursion to build it
    overflows a default 8 MiB thread stack (it did, in the server's worker threads)
    and fits the sandbox's 16 MiB check, so it compiles on the grammar workers'
    deeper stacks and constrains the output."""
    status, out = chat_error(live, {"messages": MSGS, "max_tokens": 8, "guided_grammar": paren_rules(400)})
    assert status == 200, out
    assert re.fullmatch(r"a*[xy]?", out["choices"][0]["message"]["content"]), out
    assert_serving(live)


def test_a_grammar_the_library_crashes_on_is_a_400_once(live: Live, monkeypatch: pytest.MonkeyPatch) -> None:
    """1,500 rules of 15 nested groups (within every bound) overflow even the
    sandbox's stack: the child dies, the client gets a 400, the server serves on,
    and the same grammar again is answered from what was kept, without a child."""
    from ftserve.chat.grammar_sandbox import Sandbox

    checks: list[str] = []
    real = Sandbox.check

    def counted(self: Sandbox, kind: str, value: bytes) -> str:
        checks.append(kind)
        return real(self, kind, value)

    monkeypatch.setattr(Sandbox, "check", counted)
    grammar = paren_rules(1500, parens=16)  # not one the fuzz below sends
    for _ in range(2):
        message = assert_400(live, {"messages": MSGS, "guided_grammar": grammar}, "guided_grammar")
        assert "too complex" in message, message
    assert checks == ["grammar"]
    assert_serving(live)


def test_a_check_past_its_timeout_is_a_400_and_not_kept(tmp_path: Any) -> None:
    from ftserve.chat.errors import RequestError
    from ftserve.chat.grammar_service import GrammarService
    from ftserve.chat.response_format import constraint
    from ftserve.chat.text import TokenizerCodec
    from ftserve.models.checkpoint import write_checkpoint
    from ftserve.tokenizer import load_tokenizer

    write_checkpoint("tiny-moe", tmp_path, config_only=True)
    text = TokenizerCodec(load_tokenizer(tmp_path))
    vocab = text.tokenizer.vocab_size
    fmt = constraint("regex", "[0-9]+", "guided_regex")
    slow = GrammarService(workers=1, timeout=1e-4)  # less than the child takes to start
    try:
        with pytest.raises(RequestError) as err:
            asyncio.run(slow.matchers(fmt, text, vocab, 1))
        assert err.value.param == "guided_regex" and "took over" in err.value.message
        assert not slow._checked  # the machine may have been busy: not remembered
    finally:
        slow.close()
    fine = GrammarService(workers=1)
    try:
        assert len(asyncio.run(fine.matchers(fmt, text, vocab, 2))) == 2
    finally:
        fine.close()


# --- 6: what raised RecursionError (a 500) ----------------------------------------------


def _tool(parameters: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def _called(arguments: str) -> list[dict[str, Any]]:
    return [*MSGS, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": MSGS, "tools": [_tool({"type": "object", "properties": nested(500)})]}, "tools"),
    ({"messages": MSGS, "chat_template_kwargs": {"x": nested(500)}}, "chat_template_kwargs"),
    ({"messages": _called(nested_text(500)), "tools": [_tool({"type": "object"})]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": MSGS, "grammar": "root ::= " + "(" * 500 + '"x"' + ")" * 500}, "grammar"),
    ({"messages": MSGS, "guided_json": "[" * 5000 + "]" * 5000}, "guided_json"),
    ({"messages": MSGS, "structured_outputs": {"json": '{"a":' * 5000 + "1" + "}" * 5000}},
     "structured_outputs"),
], ids=["tool parameters", "chat_template_kwargs", "tool-call arguments", "GBNF parentheses",
        "guided_json text", "structured_outputs.json text"])
def test_deep_nesting_is_a_400_naming_the_field(live: Live, body: dict[str, Any], param: str) -> None:
    message = assert_400(live, body, param)
    assert "nest" in message, message
    assert_serving(live)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": nested(500)}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}]}, "messages"),
    ("/v1/responses", {"input": [{"type": "function_call", "call_id": "c", "name": "f",
                                  "arguments": nested_text(5000)},
                                 {"type": "function_call_output", "call_id": "c", "output": "ok"}]},
     "input[0].arguments"),
], ids=["anthropic tool_use input", "responses arguments"])
def test_deep_nesting_on_the_other_apis(live: Live, path: str, body: dict[str, Any], param: str) -> None:
    message = assert_400(live, body, param, path)
    assert "nest" in message, message
    assert_serving(live)


# --- 5: grammar work off the event loop ------------------------------------------------


async def _thread_time() -> float:
    return time.thread_time()


def loop_cpu(live: Live) -> float:
    """CPU seconds the server's event-loop thread has used: what it spent on the
    requests, whatever else runs on the machine (wall-clock lag would count the
    other processes too)."""
    return asyncio.run_coroutine_threadsafe(_thread_time(), live.loop).result(10)


async def _post_all(url: str, bodies: list[bytes]) -> list[int]:
    async def one(session: aiohttp.ClientSession, data: bytes) -> int:
        async with session.post(url + CHAT, data=data) as resp:
            await resp.read()
            return resp.status

    async with aiohttp.ClientSession() as s:
        return list(await asyncio.gather(*(one(s, d) for d in bodies)))


def test_choice_grammars_are_compiled_off_the_event_loop(live: Live) -> None:
    """16 requests, each a distinct guided_choice of 4,096 options: the loop only
    reads and routes them; building, checking and compiling the grammars runs
    elsewhere (on the loop it stalled every other request for over a second)."""
    url = live.listen(dataclasses.replace(TEST_SERVER, max_queued_requests=64))
    bodies = [orjson.dumps({"model": MODEL, "messages": MSGS, "max_tokens": 1, "guided_choice": [
        f"request {r} option {i} with some words" for i in range(4096)]}) for r in range(16)]
    before = loop_cpu(live)
    statuses = asyncio.run(_post_all(url, bodies))
    used = loop_cpu(live) - before
    assert statuses == [200] * 16
    # On the loop, checking these grammars cost it 0.3 s of its own CPU (and 1.3 s
    # of wall time, blocked on the library's threads); off it, ~0.04 s.
    assert used < 0.12, f"the event loop spent {used:.2f} s of CPU on 16 choice requests"
    live.wait_idle()


# --- the fuzz: every field, hostile shapes, never a 5xx, never a crash ------------------

# Each field that reaches the grammar library or the escaping helper, as a function
# of what it takes: (route, body fields).
_SCHEMA_FIELDS: dict[str, Any] = {
    "response_format": lambda s: (CHAT, {"response_format": {"type": "json_schema",
                                                             "json_schema": {"name": "x", "schema": s}}}),
    "guided_json": lambda s: (CHAT, {"guided_json": s}),
    "structured_outputs.json": lambda s: (CHAT, {"structured_outputs": {"json": s}}),
    "json_schema": lambda s: (CHAT, {"json_schema": s}),
    "output_config.format": lambda s: ("/v1/messages", {"output_config": {
        "format": {"type": "json_schema", "schema": s}}}),
    "output_format": lambda s: ("/v1/messages", {"output_format": {"type": "json_schema", "schema": s}}),
    "text.format": lambda s: ("/v1/responses", {"text": {"format": {"type": "json_schema",
                                                                    "name": "x", "schema": s}}}),
}
_GRAMMAR_FIELDS: dict[str, Any] = {
    "guided_grammar": lambda g: (CHAT, {"guided_grammar": g}),
    "grammar": lambda g: (CHAT, {"grammar": g}),
    "structured_outputs.grammar": lambda g: (CHAT, {"structured_outputs": {"grammar": g}}),
}
_REGEX_FIELDS: dict[str, Any] = {
    "guided_regex": lambda r: (CHAT, {"guided_regex": r}),
    "structured_outputs.regex": lambda r: (CHAT, {"structured_outputs": {"regex": r}}),
}
_CHOICE_FIELDS: dict[str, Any] = {
    "guided_choice": lambda c: (CHAT, {"guided_choice": c}),
    "structured_outputs.choice": lambda c: (CHAT, {"structured_outputs": {"choice": c}}),
}
_VALUE_FIELDS: dict[str, Any] = {  # what the escaping helper and the template walk
    "tools": lambda v: (CHAT, {"tools": [_tool({"type": "object", "properties": {"p": nested(v)}})]}),
    "chat_template_kwargs": lambda v: (CHAT, {"chat_template_kwargs": {"x": nested(v)}}),
    "arguments": lambda v: (CHAT, {"messages": _called(nested_text(v)), "tools": [_tool({"type": "object"})]}),
    "guided_json text": lambda v: (CHAT, {"guided_json": nested_text(v)}),
    "anthropic tool_use": lambda v: ("/v1/messages", {"messages": [
        *MSGS, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                  "input": {"a": nested(v)}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}]}]}),
    "responses arguments": lambda v: ("/v1/responses", {"input": [
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": nested_text(v)},
        {"type": "function_call_output", "call_id": "c", "output": "ok"}]}),
}


def _size(most: int, marks: list[int]) -> st.SearchStrategy[int]:
    """Any size up to ``most``, or one of ``marks`` (at the bounds, and well past them)."""
    return st.one_of(st.sampled_from(marks), st.integers(1, most))


def _nested_schema(depth: int) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "integer"}
    for i in range(depth):
        s = {"type": "object", "properties": {"a": s}} if i % 2 else {"type": "array", "items": s}
    return s


def paren_rules(n: int, parens: int = 15) -> str:
    """A chain of n rules, each nesting ``parens`` groups: few rules, deep for the library."""
    return "start: r0\n" + "".join(
        f"r{i}: " + '("a" ' * parens + f"r{i + 1}" + ")" * parens + ' | "x"\n' for i in range(n)) + f'r{n}: "y"\n'


def _pointer_chain(n: int) -> dict[str, Any]:
    """$refs through JSON pointers into the schema itself, no $defs."""
    props: dict[str, Any] = {f"p{i}": {"$ref": f"#/properties/p{i + 1}"} for i in range(n)}
    return {"type": "object", "properties": {**props, f"p{n}": {"type": "null"}}}


_REFS = _size(6000, [999, 1000, 1001, 5000])
_PARENS = _size(4000, [20, 40, 300, 500, 1000])
# (fields, values): one family of hostile values and the fields that take it.
_FAMILIES: list[tuple[dict[str, Any], st.SearchStrategy[Any]]] = [
    (_SCHEMA_FIELDS, _REFS.map(ref_chain)),
    (_SCHEMA_FIELDS, _REFS.map(_pointer_chain)),
    (_SCHEMA_FIELDS, _size(200, [31, 32, 33, 64]).map(_nested_schema)),
    (_SCHEMA_FIELDS, _size(1000, [62, 63, 64, 65]).map(lambda k: {"type": "object", "properties": {"a": nested(k)}})),
    (_SCHEMA_FIELDS, _PARENS.map(lambda k: {"type": "string", "pattern": "(" * k + "a" + ")" * k})),
    (_GRAMMAR_FIELDS, _size(4000, [1999, 2000, 2001, 3000]).map(lark_chain)),
    (_GRAMMAR_FIELDS, _size(1500, [300, 400, 700, 1500]).map(paren_rules)),
    (_GRAMMAR_FIELDS, _PARENS.map(lambda k: "start: " + "(" * k + '"x"' + ")" * k)),
    (_GRAMMAR_FIELDS, _PARENS.map(lambda k: "root ::= " + "(" * k + '"x"' + ")" * k)),
    (_GRAMMAR_FIELDS, _size(300_000, [MAX_BYTES - 16, MAX_BYTES]).map(lambda k: 'start: "' + "a" * k + '"')),
    (_REGEX_FIELDS, _PARENS.map(lambda k: "(" * k + "a" + ")" * k)),
    (_CHOICE_FIELDS, st.tuples(_size(5000, [4096, 4097]), _size(200, [1, 64])).map(
        lambda nk: [f"{i:05d}" + "c" * nk[1] for i in range(nk[0])])),
    (_VALUE_FIELDS, _size(2000, [62, 63, 64, 65, 500, 1100])),
]


@st.composite
def _cases(draw: st.DrawFn) -> tuple[str, str, dict[str, Any]]:
    fields, values = draw(st.sampled_from(_FAMILIES))
    field = draw(st.sampled_from(sorted(fields)))
    route, extra = fields[field](draw(values))
    return field, route, extra


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(case=_cases())
def test_fuzz_hostile_structure_is_never_a_5xx(live: Live, case: tuple[str, str, dict[str, Any]]) -> None:
    field, route, extra = case
    body = {"input": "hi", **extra} if route == "/v1/responses" else {"messages": MSGS, **extra}
    status, out = chat_error(live, body, route)
    assert status in (200, 400), (field, status, out)
    message = out["error"]["message"] if status == 400 else ""
    if message and not message.startswith("invalid JSON body"):  # past orjson's depth limit: no field
        assert any(f"'{key}" in message for key in extra), (field, out)  # names what the client sent
    status, _, health = call(live, "/health", method="GET", raw=b"")
    assert status == 200, health
