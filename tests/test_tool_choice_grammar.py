"""A forced tool_choice ("required", a named function; Anthropic any / tool; the
Responses API's) constrains the output to well-formed calls (chat/tool_grammar.py),
in each call syntax the project reads: a real server per syntax (the demo's own
Mistral-style template, and hermes / Qwen3-Coder / Llama 3 templates given with
--chat-template) over a random-weights model, sampled at temperature 1 over several
seeds, read with the official openai and anthropic clients. Whatever the random
model prefers, every reply is calls whose arguments validate against their tool's
schema, no content, finish_reason "tool_calls", and a stream gives the same calls."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from tests.server_harness import (
    TEST_ENGINE,
    TEST_SERVER,
    Live,
    openai_client,
    start_live,
    stop_live,
)
from tests.test_tool_choice import _tokens

TEMPLATES = Path(__file__).parent / "templates"
SYNTAXES = {"mistral": None,  # the checkpoint's own template
            "hermes": TEMPLATES / "hermes_think.jinja",  # opens <think> in the prompt
            "qwen3_coder": TEMPLATES / "qwen3_coder.jinja",
            "llama3": TEMPLATES / "llama3_json.jinja"}
# Bounded schemas: a random model writes any string it may, so every value here has
# an end the grammar can force (enums, lengths, ranges, item counts).
SCHEMAS: dict[str, dict[str, Any]] = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "São Paulo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "metric": {"type": "boolean"}},
        "required": ["city", "days"], "additionalProperties": False},
    "note": {"type": "object", "properties": {
        "text": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 2}},
        "required": ["text"], "additionalProperties": False},
    "now": {"type": "object", "properties": {}, "additionalProperties": False},  # no parameters given
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                           "parameters": SCHEMAS["get_weather"]}},
         {"type": "function", "function": {"name": "note", "parameters": SCHEMAS["note"]}},
         {"type": "function", "function": {"name": "now"}}]
MSGS = [{"role": "user", "content": "Weather in Paris for three days?"}]
SEEDS = range(2)
MAX_TOKENS = 400
# Random weights seldom end a turn: after each call "required" lets the model write
# another, and it goes on until max_tokens cuts a call (the whole reply is then
# content, finish_reason "length", as tool_calls.py has it). A frequency penalty on
# the call syntax it repeats makes it stop after a few calls, as real models do.
SAMPLING = {"temperature": 1.0, "frequency_penalty": 1.0}
ENGINE = dataclasses.replace(TEST_ENGINE, max_model_len=1024, num_pages=256)


@pytest.fixture(scope="module", params=list(SYNTAXES))
def live(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    from ftserve.models.checkpoint import write_checkpoint

    template = SYNTAXES[request.param]
    ckpt = write_checkpoint("tiny-moe", tmp_path_factory.mktemp(request.param) / "m", layers=1, seed=0)
    server = start_live(dataclasses.replace(ENGINE, model=str(ckpt)),
                        dataclasses.replace(TEST_SERVER, chat_template=str(template) if template else None))
    assert server.text.tool_format() == request.param
    try:
        yield server
    finally:
        stop_live(server)


def _valid(calls: list[tuple[str, str]], named: str | None) -> None:
    """At least one call; each names an offered tool (``named``: that one) and its
    arguments are JSON that validates against that tool's schema."""
    assert calls
    for name, args in calls:
        assert name == named if named else name in SCHEMAS, calls
        jsonschema.validate(json.loads(args), SCHEMAS[name])


def _chat_stream(client: openai.OpenAI, req: dict[str, Any]) -> tuple[list[tuple[str, str]], str, str]:
    """(calls, all content, finish_reason) of a streamed reply, from its raw chunks."""
    calls: dict[int, list[str]] = {}
    content, reason = "", ""
    for chunk in client.chat.completions.create(**req, stream=True):
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or []:
            if tc.id:
                calls[tc.index] = [tc.function.name, ""]
            calls[tc.index][1] += tc.function.arguments or ""
        reason = choice.finish_reason or reason
    return [(n, a) for n, a in (calls[i] for i in sorted(calls))], content, reason


def test_grammar_takes_the_calls_the_template_writes(live: Live) -> None:
    """The grammar after the forced text accepts the calls as the chat template
    renders them in an earlier turn (the syntax the model learned), and is complete
    right after them: "required" from after the call's opening, a named function
    from after its name."""
    import orjson

    from ftserve.api.openai.models import parse_chat
    from ftserve.chat.grammar_sandbox import build
    from ftserve.chat.tool_calls import param_types, parse
    from ftserve.chat.tool_choice import ForcedCall, forced_text
    from ftserve.chat.tool_grammar import constraint

    fmt = live.text.tool_format()
    assert fmt is not None
    args = [("get_weather", {"city": "São Paulo", "days": 3, "metric": False}), ("note", {"text": "a\nb"})]
    types = param_types(TOOLS)
    for call, parallel, want in ((ForcedCall(), True, args), (ForcedCall("get_weather"), False, args[:1])):
        # No ids: the Mistral template writes a call's id into it, which the model never does.
        turn = {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": n, "arguments": json.dumps(a)}} for n, a in want]}
        messages = parse_chat({"messages": [*MSGS, turn]}).messages
        assert messages is not None
        rendered = live.text.render_chat(messages, False, TOOLS, {})
        opening = forced_text(fmt, call)
        at = rendered.index(opening, rendered.rindex(MSGS[0]["content"])) + len(opening)
        # The shortest rendered text after the opening that parses clean as the calls.
        end = next(k for k in range(at, len(rendered) + 1)
                   if (p := parse(opening + rendered[at:k], fmt, types)).content is None
                   and [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                        for c in p.tool_calls] == want)
        c = constraint(fmt, call, TOOLS, parallel)
        (m,) = live.text.grammar_matchers(build(c.kind, orjson.loads(c.value)),
                                          live.engine.vocab_size, 1)
        ids = live.text.tokenizer.encode_continuation(rendered[at:end])  # type: ignore[attr-defined]
        assert all(m.accept(t) for t in ids), (fmt, call, rendered[at:end], m.error)
        assert m._m.is_accepting(), (fmt, call, rendered[at:end])


CHOICES = [("required", None), ({"type": "function", "function": {"name": "get_weather"}}, "get_weather"),
           ({"type": "function", "function": {"name": "note"}}, "note")]


@pytest.mark.parametrize("choice,named", CHOICES)
def test_forced_choice_always_calls(live: Live, choice: Any, named: str | None) -> None:
    client = openai_client(live)
    for seed in SEEDS:
        req = {"model": "ftserve-demo", "messages": MSGS, "tools": TOOLS, "tool_choice": choice,
               "seed": seed, "max_tokens": MAX_TOKENS, **SAMPLING}
        (whole,) = client.chat.completions.create(**req).choices
        calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
        assert whole.message.content is None, (seed, whole.message.content)
        _valid(calls, named)
        assert whole.finish_reason == "tool_calls"
        if named:
            assert len(calls) == 1
        streamed, content, reason = _chat_stream(client, req)
        assert streamed == calls and content == "" and reason == "tool_calls", seed
    live.wait_idle()


def test_required_one_call_without_parallel_calls(live: Live) -> None:
    client = openai_client(live)
    for seed in SEEDS:
        req = {"model": "ftserve-demo", "messages": MSGS, "tools": TOOLS, "tool_choice": "required",
               "parallel_tool_calls": False, "seed": seed, "max_tokens": MAX_TOKENS, **SAMPLING}
        (whole,) = client.chat.completions.create(**req).choices
        calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
        assert len(calls) == 1 and whole.message.content is None and whole.finish_reason == "tool_calls"
        _valid(calls, None)
    live.wait_idle()


def test_reasoning_closes_before_a_forced_call(live: Live) -> None:
    """A prompt that opens <think>: a forced call comes right after an empty
    reasoning block, as the template writes one with thinking off (the call is
    never inside the reasoning, and reasoning cannot use up max_tokens first)."""
    if not live.text.marks_reasoning():
        pytest.skip("this syntax's template has no reasoning block")
    client = openai_client(live)
    named = {"type": "function", "function": {"name": "get_weather"}}
    req = {"model": "ftserve-demo", "messages": MSGS, "tools": TOOLS, "tool_choice": named,
           "seed": 7, "max_tokens": MAX_TOKENS, **SAMPLING}
    whole = client.chat.completions.create(**req)
    msg = whole.choices[0].message
    _valid([(c.function.name, c.function.arguments) for c in msg.tool_calls or []], "get_weather")
    assert msg.content is None and getattr(msg, "reasoning_content", None) is None
    rendered = live.text.render_chat(MSGS, True, TOOLS, {})
    assert rendered.endswith("<think>\n")
    forced = '</think>\n\n<tool_call>\n{"name": "get_weather", "arguments":'
    assert whole.usage.prompt_tokens == _tokens(live, {"prompt": rendered + forced,
                                                       "add_special_tokens": False})
    assert whole.usage.prompt_tokens == _tokens(live, {"messages": MSGS, "tools": TOOLS,
                                                       "tool_choice": named})
    # Thinking off: the template closed the block itself; nothing more is added.
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    whole = client.chat.completions.create(**req, extra_body=off)
    rendered = live.text.render_chat(MSGS, True, TOOLS, off["chat_template_kwargs"])
    assert whole.usage.prompt_tokens == _tokens(live, {"prompt": rendered + forced[len("</think>\n\n"):],
                                                       "add_special_tokens": False})
    _valid([(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls or []],
           "get_weather")
    live.wait_idle()


ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "input_schema": SCHEMAS[t["function"]["name"]]}
                   for t in TOOLS]


@pytest.mark.parametrize("choice,named", [({"type": "any"}, None),
                                          ({"type": "tool", "name": "get_weather"}, "get_weather")])
def test_anthropic_forced_tool_use(live: Live, choice: dict[str, Any], named: str | None) -> None:
    client = anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0, timeout=60)
    for seed in (10, 11):  # other draws than the chat tests' (the prompt may be the same)
        req = {"model": "ftserve-demo", "messages": MSGS, "tools": ANTHROPIC_TOOLS, "tool_choice": choice,
               "max_tokens": MAX_TOKENS, "extra_body": {"seed": seed, **SAMPLING}}
        whole = client.messages.create(**req)
        assert whole.stop_reason == "tool_use", (seed, whole.content)
        assert all(b.type == "tool_use" for b in whole.content), whole.content
        calls = [(b.name, json.dumps(b.input)) for b in whole.content]
        _valid(calls, named)
        with client.messages.stream(**req) as stream:
            for _ in stream:
                pass
            streamed = stream.get_final_message()
        assert streamed.stop_reason == "tool_use"
        assert [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in streamed.content] == [
            ("tool_use", b.name, b.input) for b in whole.content]
    live.wait_idle()


RESPONSES_TOOLS = [{"type": "function", "name": t["function"]["name"], "parameters": SCHEMAS[t["function"]["name"]]}
                   for t in TOOLS]


@pytest.mark.parametrize("choice,named", [("required", None),
                                          ({"type": "function", "name": "note"}, "note")])
def test_responses_forced_function_call(live: Live, choice: Any, named: str | None) -> None:
    client = openai_client(live)
    for seed in (20, 21):
        req = {"model": "ftserve-demo", "input": MSGS[0]["content"], "tools": RESPONSES_TOOLS,
               "tool_choice": choice, "max_output_tokens": MAX_TOKENS, "temperature": 1.0,
               "extra_body": {"seed": seed, "frequency_penalty": SAMPLING["frequency_penalty"]}}
        whole = client.responses.create(**req)
        assert whole.status == "completed"
        assert all(item.type == "function_call" for item in whole.output), whole.output
        calls = [(item.name, item.arguments) for item in whole.output]
        _valid(calls, named)
        events = list(client.responses.create(**req, stream=True))
        assert events[-1].type == "response.completed"
        assert [(i.type, i.name, i.arguments) for i in events[-1].response.output] == [
            ("function_call", n, a) for n, a in calls]
    live.wait_idle()


def test_a_schema_the_grammar_library_refuses_is_a_400(live: Live) -> None:
    """Schemas compile leniently (an unimplemented keyword, "not" here, is ignored);
    one that still cannot compile (no value meets it) is a 400 naming tool_choice,
    before anything runs."""
    odd = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9,
                                                  "not": {"const": 3}}},
           "required": ["x"], "additionalProperties": False}
    broken = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 5, "maximum": 1}},
              "required": ["x"]}
    client = openai_client(live)
    for params in (odd, broken):
        tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
        req = {"model": "ftserve-demo", "messages": MSGS, "tools": tools, "tool_choice": "required",
               "max_tokens": 60, "seed": 0, **SAMPLING}
        if params is odd:
            (choice,) = client.chat.completions.create(**req).choices
            assert {c.function.name for c in choice.message.tool_calls or []} == {"f"}
            continue
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(**req)
        assert err.value.body["param"] == "tool_choice", err.value.body
    live.wait_idle()
