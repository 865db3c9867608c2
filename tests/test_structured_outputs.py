"""response_format (structured outputs) end to end: the official client against a real
server (real engine, demo model with random weights, so only the constraint makes the
output valid JSON), whole and streamed, n=2, chat and completions; bad formats are
400s naming response_format that never reach the engine."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.server_harness import Live

MSGS = [{"role": "user", "content": "Describe a user account as JSON."}]
# Bounded (string lengths, integer range, item count, no extra keys): every output
# completes well within max_tokens, so finish_reason is "stop" whatever the weights.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "admin", "color", "tags"],
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "admin": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    },
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "account", "schema": SCHEMA,
                                                      "strict": True}}


def validate(value: Any, schema: dict[str, Any], where: str = "$") -> None:
    """The JSON-schema subset SCHEMA uses (no jsonschema dependency)."""
    if "enum" in schema:
        assert value in schema["enum"], (where, value)
        return
    kind = schema["type"]
    types = {"object": dict, "array": list, "string": str, "boolean": bool}
    if kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), (where, value)
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), (where, value)
        return
    assert isinstance(value, types[kind]), (where, value)
    if kind == "string":
        assert len(value) <= schema.get("maxLength", len(value)), (where, value)
    elif kind == "array":
        assert len(value) <= schema.get("maxItems", len(value)), (where, value)
        for i, item in enumerate(value):
            validate(item, schema["items"], f"{where}[{i}]")
    elif kind == "object":
        assert set(schema.get("required", ())) <= set(value), (where, value)
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(schema["properties"]), (where, value)
        for key, item in value.items():
            validate(item, schema["properties"][key], f"{where}.{key}")


def is_json_prefix(text: str) -> bool:
    """Whether ``text`` can be completed into one JSON object: close any open string
    (or escape) and containers, with a few value stubs for a dangling key, colon,
    comma or literal, and see if json.loads takes one of them."""
    stack: list[str] = []
    in_str = esc = False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            stack.append(ch)
        elif ch in "}]":
            if not stack or "{[".index(stack.pop()) != "}]".index(ch):
                return False
    close = "".join("}" if c == "{" else "]" for c in reversed(stack))
    if in_str:
        heads = ["n" if esc else "0" * k for k in range(5)]
        stubs = [h + '"' + tail for h in heads for tail in ("", ":0")]
    else:
        stubs = ["", "0", ":0", '"":0', "rue", "ue", "e", "alse", "lse", "se", "ull", "ll", "l"]
    for stub in stubs:
        try:
            if isinstance(json.loads(text + stub + close), dict):
                return True
        except json.JSONDecodeError:
            pass
    return False


def test_json_prefix_check_itself() -> None:
    for ok in ('{', '{"a', '{"a":', '{"a":[1,tr', '{"a":"x\\', '{"a":"\\u12', '{"a":1,', '{}'):
        assert is_json_prefix(ok), ok
    for bad in ('[', '{"a"}', '{]', 'x', '{"a":1}}', '{"a" 1'):
        assert not is_json_prefix(bad), bad




def test_json_object_whole(live: Live, client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="ftserve-demo", messages=MSGS, max_tokens=200,
                                       temperature=0, response_format={"type": "json_object"})
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content), dict)
    live.wait_idle()


def test_json_object_truncated_is_a_json_prefix(live: Live, client: openai.OpenAI) -> None:
    # Sampled, a random model writes long keys and strings: max_tokens ends it first.
    r = client.chat.completions.create(model="ftserve-demo", messages=MSGS, max_tokens=12,
                                       temperature=1.0, seed=4, n=2,
                                       response_format={"type": "json_object"})
    for choice in r.choices:
        text = choice.message.content
        assert text.startswith("{") and is_json_prefix(text), text
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert choice.finish_reason == "length"
    live.wait_idle()


def test_json_schema_whole_n2(live: Live, client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="ftserve-demo", messages=MSGS, max_tokens=200,
                                       temperature=1.0, seed=1, n=2, logprobs=True,
                                       response_format=JSON_SCHEMA)
    assert [c.index for c in r.choices] == [0, 1]
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        validate(json.loads(choice.message.content), SCHEMA)
        assert choice.logprobs is not None and choice.logprobs.content  # raw model logprobs
    live.wait_idle()


def test_json_schema_streamed_n2(live: Live, client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model="ftserve-demo", messages=MSGS, max_tokens=200,
                                            temperature=0.7, seed=2, n=2, stream=True,
                                            response_format=JSON_SCHEMA)
    texts, reasons = ["", ""], [None, None]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert reasons == ["stop", "stop"]
    for text in texts:
        validate(json.loads(text), SCHEMA)
    live.wait_idle()


def test_completions_json_schema_whole_and_streamed(live: Live, client: openai.OpenAI) -> None:
    extra = {"response_format": JSON_SCHEMA}
    r = client.completions.create(model="ftserve-demo", prompt="An account:", max_tokens=200,
                                  temperature=1.0, seed=3, extra_body=extra)
    assert r.choices[0].finish_reason == "stop"
    validate(json.loads(r.choices[0].text), SCHEMA)
    text, reason = "", None
    for chunk in client.completions.create(model="ftserve-demo", prompt="An account:",
                                           max_tokens=200, temperature=0, stream=True,
                                           extra_body=extra):
        text += chunk.choices[0].text
        reason = chunk.choices[0].finish_reason or reason
    assert reason == "stop"
    validate(json.loads(text), SCHEMA)
    live.wait_idle()


def test_text_format_and_tool_choice_none_are_accepted(live: Live, client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="ftserve-demo", messages=MSGS, max_tokens=3,
                                       temperature=0, response_format={"type": "text"})
    assert r.choices[0].finish_reason in ("stop", "length")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = client.chat.completions.create(model="ftserve-demo", messages=MSGS, max_tokens=200,
                                       temperature=0, tools=tools, tool_choice="none",
                                       response_format=JSON_SCHEMA)
    validate(json.loads(r.choices[0].message.content), SCHEMA)
    live.wait_idle()


_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
BAD: list[tuple[str, dict[str, Any]]] = [
    ("not an object", {"response_format": "json_object"}),
    ("unknown type", {"response_format": {"type": "xml"}}),
    ("no json_schema", {"response_format": {"type": "json_schema"}}),
    ("no name", {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}),
    ("no schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
    ("schema not an object", {"response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "x", "schema": "{}"}}}),
    ("strict not a bool", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA, "strict": "yes"}}}),
    ("bad type in schema", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strin"}}}}),
    ("bad regex", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "(("}}}}),
    ("dangling $ref", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}}),
    ("with tools", {"response_format": {"type": "json_object"}, "tools": _TOOLS}),
    ("with a forced tool", {"response_format": JSON_SCHEMA, "tools": _TOOLS,
                            "tool_choice": "required"}),
]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_bad_response_format_is_400_and_nothing_runs(live: Live, client: openai.OpenAI,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     endpoint: str) -> None:
    submitted: list[Any] = []
    monkeypatch.setattr(live.engine, "submit", submitted.append)
    for why, extra in BAD:
        if endpoint == "completions" and "tools" in extra:
            continue
        with pytest.raises(openai.BadRequestError) as info:
            if endpoint == "chat":
                client.chat.completions.create(model="ftserve-demo", messages=MSGS,
                                               max_tokens=4, extra_body=extra)
            else:
                client.completions.create(model="ftserve-demo", prompt="x", max_tokens=4,
                                          extra_body=extra)
        assert info.value.status_code == 400, why
        assert info.value.body["param"] == "response_format", (why, info.value.body)
    assert submitted == []
    monkeypatch.undo()
    st = live.wait_idle()
    assert st.running == 0 and st.waiting == 0


# --- the other servers' fields: regex, choice, grammar, schema ------------------------

CONSTRAINTS: list[tuple[str, dict[str, Any], str]] = [
    # (why, extra body, a regex the whole output must match)
    ("vLLM regex", {"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}}, r"[0-9]{3}-[a-z]{2}"),
    ("vLLM choice", {"structured_outputs": {"choice": ["yes", "no", "a \"quoted\"\nline"]}},
     r'yes|no|a "quoted"\nline'),
    ("vLLM GBNF grammar", {"structured_outputs": {
        "grammar": 'root ::= ("ab" | "cd") ("ab" | "cd") "!"'}}, r"(ab|cd)(ab|cd)!"),
    ("vLLM Lark grammar", {"structured_outputs": {"grammar": 'start: "x" /[0-9]{2}/ "."'}},
     r"x[0-9]{2}\."),
    ("legacy guided_regex", {"guided_regex": r"(red|blue)-[0-9]"}, r"(red|blue)-[0-9]"),
    ("legacy guided_choice", {"guided_choice": ["alpha", "beta"]}, r"alpha|beta"),
    ("llama.cpp grammar", {"grammar": 'root ::= "<" [a-c] [a-c] ">"'}, r"<[a-c][a-c]>"),
    # SGLang's names, which sglang-router passes on to a worker (tests/test_fleet.py)
    ("SGLang regex", {"regex": r"[xyz]{2}-[0-9]"}, r"[xyz]{2}-[0-9]"),
    ("SGLang ebnf", {"ebnf": 'root ::= "(" [0-9] ")"'}, r"\([0-9]\)"),
]


@pytest.mark.parametrize("why, extra, pattern", CONSTRAINTS, ids=[c[0] for c in CONSTRAINTS])
def test_regex_choice_and_grammar_constrain_the_output(live: Live, client: openai.OpenAI, why: str,
                                                       extra: dict[str, Any], pattern: str) -> None:
    """The random model writes gibberish; only the constraint makes each output match,
    whole and streamed, and the output ends ("stop") where the grammar is complete."""
    import re

    r = client.chat.completions.create(model="ftserve-demo", messages=MSGS, max_tokens=40,
                                       temperature=1.0, seed=5, n=2, extra_body=extra)
    for c in r.choices:
        assert c.finish_reason == "stop" and re.fullmatch(pattern, c.message.content), (why, c)
    text = "".join(ch.choices[0].text for ch in client.completions.create(
        model="ftserve-demo", prompt="x", max_tokens=40, temperature=0.8, seed=6, stream=True,
        extra_body=extra))
    assert re.fullmatch(pattern, text), (why, text)
    live.wait_idle()


def test_json_schema_from_other_fields(live: Live, client: openai.OpenAI) -> None:
    for extra in ({"structured_outputs": {"json": SCHEMA}}, {"guided_json": json.dumps(SCHEMA)},
                  {"json_schema": SCHEMA}, {"structured_outputs": {"json_object": True}}):
        bare = "json_object" in extra.get("structured_outputs", {})  # unbounded: greedy ends it
        r = client.chat.completions.create(model="ftserve-demo", messages=MSGS, max_tokens=200,
                                           temperature=0.0 if bare else 1.0, seed=7, extra_body=extra)
        assert r.choices[0].finish_reason == "stop", extra
        value = json.loads(r.choices[0].message.content)
        if bare:
            assert isinstance(value, dict)
        else:
            validate(value, SCHEMA)
    live.wait_idle()


BAD_OTHER: list[tuple[str, dict[str, Any], str]] = [
    ("two constraints", {"response_format": {"type": "json_object"}, "guided_regex": "a"},
     "guided_regex"),
    ("two in structured_outputs", {"structured_outputs": {"regex": "a", "choice": ["b"]}},
     "structured_outputs"),
    ("unknown structured_outputs key", {"structured_outputs": {"structural_tag": "x"}},
     "structured_outputs"),
    ("bad regex", {"guided_regex": "(("}, "guided_regex"),
    ("bad SGLang ebnf", {"ebnf": 'root ::= ("ab" | '}, "ebnf"),
    ("empty choice", {"structured_outputs": {"choice": []}}, "structured_outputs"),
    ("choice of non-strings", {"guided_choice": ["a", 1]}, "guided_choice"),
    ("bad GBNF", {"grammar": 'root ::= ("ab" | '}, "grammar"),
    ("bad Lark", {"guided_grammar": 'start: "a" ('}, "guided_grammar"),
    ("schema text not JSON", {"guided_json": "{nope"}, "guided_json"),
    ("with tools", {"guided_regex": "a", "tools": _TOOLS}, "guided_regex"),
]


@pytest.mark.parametrize("why, extra, param", BAD_OTHER, ids=[b[0] for b in BAD_OTHER])
def test_bad_constraint_fields_are_400s_naming_them(live: Live, client: openai.OpenAI,
                                                    monkeypatch: pytest.MonkeyPatch, why: str,
                                                    extra: dict[str, Any], param: str) -> None:
    submitted: list[Any] = []
    monkeypatch.setattr(live.engine, "submit", submitted.append)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="ftserve-demo", messages=MSGS, max_tokens=4,
                                       extra_body=extra)
    assert info.value.body["param"] == param, (why, info.value.body)
    assert submitted == []
