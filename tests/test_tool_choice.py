"""Forced tool_choice ("required", a named function; ftserve/chat/tool_choice.py):
the prefix builder and the parser over forced text + output, then end to end on a
real server whose engine steps are scripted, read with the official openai client."""

from __future__ import annotations

import dataclasses
import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from ftserve.api.openai.models import parse_chat
from ftserve.chat.errors import RequestError
from ftserve.chat.tool_calls import parse, tool_stream
from ftserve.chat.tool_choice import ForcedCall, forced_text


def test_forced_text_per_format() -> None:
    assert forced_text("hermes", ForcedCall("f")) == '<tool_call>\n{"name": "f", "arguments":'
    assert forced_text("hermes", ForcedCall()) == '<tool_call>\n{"name": "'
    assert forced_text("mistral", ForcedCall("get_weather")) == (
        '[TOOL_CALLS] [{"name": "get_weather", "arguments":')
    assert forced_text("mistral", ForcedCall()) == '[TOOL_CALLS] [{"name": "'
    assert forced_text("hermes", ForcedCall('a"b')).startswith('<tool_call>\n{"name": "a\\"b", ')
    # qwen3_coder: the name is bare text; "required" stops before "=", the model writes "=name>".
    assert forced_text("qwen3_coder", ForcedCall("get_weather")) == "<tool_call>\n<function=get_weather>\n"
    assert forced_text("qwen3_coder", ForcedCall()) == "<tool_call>\n<function"
    assert forced_text("llama3", ForcedCall("f")) == '{"name": "f", "parameters":'
    assert forced_text("llama3", ForcedCall()) == '{"name": "'
    assert forced_text("qwen3_coder", ForcedCall("x<|im_end|>"), lambda t: t.upper()) == (
        "<tool_call>\n<function=X<|IM_END|>>\n")  # the client's name goes through escape


@pytest.mark.parametrize("fmt,call,output,want", [
    ("hermes", ForcedCall("ls"), ' {"dir": "."}}\n</tool_call>', [("ls", '{"dir": "."}')]),
    ("hermes", ForcedCall(), 'ls", "arguments": {}}</tool_call>', [("ls", "{}")]),
    ("mistral", ForcedCall("f"), ' {"a": [1]}}]', [("f", '{"a": [1]}')]),
    ("mistral", ForcedCall(), 'f"}, {"name": "g", "arguments": {}}]', [("f", "{}"), ("g", "{}")]),
    ("qwen3_coder", ForcedCall("ls"), "<parameter=dir>\n.\n</parameter>\n</function>\n</tool_call>",
     [("ls", '{"dir": "."}')]),
    ("qwen3_coder", ForcedCall(), "=ls>\n</function>\n</tool_call>\n<tool_call>\n<function=cat>\n"
     "<parameter=f>\na\n</parameter>\n</function>\n</tool_call>", [("ls", "{}"), ("cat", '{"f": "a"}')]),
    ("llama3", ForcedCall("ls"), ' {"dir": "."}}', [("ls", '{"dir": "."}')]),
    ("llama3", ForcedCall(), 'ls", "parameters": {}}; {"name": "cat"}', [("ls", "{}"), ("cat", "{}")]),
])
def test_forced_text_then_output_parses_as_a_call(fmt: Any, call: ForcedCall, output: str,
                                                  want: list[tuple[str, str]]) -> None:
    text = forced_text(fmt, call) + output
    whole = parse(text, fmt)
    assert whole.content is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls] == want
    ts = tool_stream(fmt)
    sent, calls = ts.push(forced_text(fmt, call)), []
    assert sent[0] == ""  # the forced text is never content
    outs = [sent] + [ts.push(ch) for ch in output] + [ts.finish()]
    assert "".join(o[0] for o in outs).strip() == ""
    for d in (d for o in outs for d in o[1]):
        if "id" in d:
            calls.append([d["function"]["name"], ""])
        calls[d["index"]][1] += d["function"]["arguments"]
    assert [tuple(c) for c in calls] == want
    if call.name is not None:  # the name is in the prompt: its delta is ready at once
        assert sent[1] and sent[1][0]["function"]["name"] == call.name


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "now"}}]
MSGS = [{"role": "user", "content": "Weather?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("body", [
    {"tool_choice": "required"},
    {"tool_choice": NAMED},
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    {"tools": TOOLS, "tool_choice": "any"},
    {"tools": TOOLS, "tool_choice": {"type": "function"}},
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": 3}}},
])
def test_bad_tool_choice_is_400_naming_it(body: dict[str, Any]) -> None:
    with pytest.raises(RequestError) as err:
        parse_chat({"messages": MSGS, **body})
    assert err.value.status == 400 and err.value.param == "tool_choice"


def test_parsed_tool_choice() -> None:
    named = parse_chat({"messages": MSGS, "tools": TOOLS, "tool_choice": NAMED})
    assert named.forced == ForcedCall("get_weather") and not named.parallel_tool_calls
    req = parse_chat({"messages": MSGS, "tools": TOOLS, "tool_choice": "required"})
    assert req.forced == ForcedCall() and req.parallel_tool_calls
    assert parse_chat({"messages": MSGS, "tools": TOOLS, "tool_choice": "auto"}).forced is None
    none = parse_chat({"messages": MSGS, "tools": TOOLS, "tool_choice": "none"})
    assert none.forced is None and none.tools is None


# ----------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from ftserve.models.checkpoint import write_checkpoint
    from tests.server_harness import TEST_ENGINE, start_live, stop_live

    ckpt = write_checkpoint("tiny-moe", tmp_path_factory.mktemp("choice") / "m", layers=1, seed=0)
    server = start_live(dataclasses.replace(TEST_ENGINE, model=str(ckpt)))
    try:
        yield server
    finally:
        stop_live(server)


@pytest.fixture
def script(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each generation's step texts become the pieces put in the returned list
    (the rest on its last step)."""
    from tests.server_harness import script_generations

    pieces: list[str] = []
    script_generations(monkeypatch, pieces)
    return pieces


def _client(live: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _req(choice: Any, max_tokens: int, **kw: Any) -> dict[str, Any]:
    return {"model": "ftserve-demo", "tools": TOOLS, "tool_choice": choice, "messages": MSGS,
            "max_tokens": max_tokens, "temperature": 0, "extra_body": {"ignore_eos": True}, **kw}


def _tokens(live: Any, body: dict[str, Any]) -> int:
    req = urllib.request.Request(live.url + "/tokenize", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())["count"]


def _streamed(client: openai.OpenAI, req: dict[str, Any]) -> Any:
    with client.chat.completions.stream(**req) as stream:
        for _ in stream:
            pass
        return stream.get_final_completion()


def _calls(message: Any) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def _assert_name_first(client: openai.OpenAI, req: dict[str, Any], name: str) -> None:
    """Streamed, a named call's first delta (the name, from the prompt) comes right
    after the role chunk, and no content at all."""
    chunks = list(client.chat.completions.create(**req, stream=True))
    first = chunks[1].choices[0].delta.tool_calls[0]
    assert first.function.name == name and first.id and first.function.arguments == ""
    assert not any(c.choices and c.choices[0].delta.content for c in chunks)


def test_named_function_is_forced(live: Any, script: list[str]) -> None:
    assert live.text.tool_format() == "mistral"
    script[:] = ['{"ci', 'ty": "Pa', 'ris"}', '}, {"name": "now"}]']  # a second call: dropped
    client = _client(live)
    req = _req(NAMED, len(script))
    whole = client.chat.completions.create(**req)
    (choice,) = whole.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert _calls(choice.message) == [("get_weather", '{"city": "Paris"}')]
    # The forced text is prompt: prompt_tokens counts it.
    forced = forced_text("mistral", ForcedCall("get_weather"))
    rendered = live.text.render_chat(MSGS, True, TOOLS, {})
    assert whole.usage.prompt_tokens == _tokens(live, {"prompt": rendered + forced,
                                                       "add_special_tokens": False})
    assert whole.usage.prompt_tokens > _tokens(live, {"messages": MSGS, "tools": TOOLS})
    # /tokenize given the same tool_choice counts the forced text too.
    assert whole.usage.prompt_tokens == _tokens(live, {"messages": MSGS, "tools": TOOLS, "tool_choice": NAMED})
    assert whole.usage.completion_tokens == len(script)
    final = _streamed(client, req)
    (choice,) = final.choices
    assert choice.finish_reason == "tool_calls" and not (choice.message.content or "").strip()
    assert _calls(choice.message) == [("get_weather", '{"city": "Paris"}')]
    _assert_name_first(client, req, "get_weather")
    live.wait_idle()


def test_required_lets_the_model_name_the_calls(live: Any, script: list[str]) -> None:
    script[:] = ['now', '"}, {"name": "get_weather", ', '"arguments": {"city": "Rome"}}]']
    client = _client(live)
    req = _req("required", len(script))
    want = [("now", "{}"), ("get_weather", '{"city": "Rome"}')]
    whole = client.chat.completions.create(**req)
    assert _calls(whole.choices[0].message) == want and whole.choices[0].message.content is None
    forced = forced_text("mistral", ForcedCall())
    rendered = live.text.render_chat(MSGS, True, TOOLS, {})
    assert whole.usage.prompt_tokens == _tokens(live, {"prompt": rendered + forced,
                                                       "add_special_tokens": False})
    final = _streamed(client, req)
    assert _calls(final.choices[0].message) == want
    assert final.choices[0].finish_reason == "tool_calls"
    one = client.chat.completions.create(**req, parallel_tool_calls=False)
    assert _calls(one.choices[0].message) == want[:1]
    live.wait_idle()


def test_unparseable_output_is_content_with_the_forced_text(live: Any, script: list[str]) -> None:
    script[:] = ['oops', ' no call']
    client = _client(live)
    req = _req("required", len(script))
    forced = forced_text("mistral", ForcedCall())
    whole = client.chat.completions.create(**req)
    (choice,) = whole.choices
    assert choice.message.content == forced + "oops no call" and not choice.message.tool_calls
    assert choice.finish_reason == "length"
    chunks = [c for c in client.chat.completions.create(**req, stream=True) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == forced + "oops no call"
    assert not any(c.choices[0].delta.tool_calls for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    # Named, bad JSON: whole, nothing parses, all content; streamed, the call whose
    # name went out stays a call (tool_calls.py's streaming rules).
    script[:] = ['{"city": ', 'Paris}}]']
    whole = client.chat.completions.create(**_req(NAMED, len(script)))
    assert whole.choices[0].message.content == (
        forced_text("mistral", ForcedCall("get_weather")) + '{"city": Paris}}]')
    assert not whole.choices[0].message.tool_calls
    chunks = [c for c in client.chat.completions.create(**_req(NAMED, len(script)), stream=True)
              if c.choices]
    calls = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
    assert calls[0].function.name == "get_weather"
    assert "".join(tc.function.arguments or "" for tc in calls) == '{"city": Paris}'
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    live.wait_idle()


@pytest.mark.parametrize("body", [
    {"tool_choice": "required"},  # no tools
    {"tool_choice": NAMED},
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    {"tools": TOOLS, "tool_choice": "any"},
])
def test_live_400s_name_tool_choice(live: Any, body: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        _client(live).chat.completions.create(model="ftserve-demo", messages=MSGS, max_tokens=1,
                                              **body)
    assert err.value.status_code == 400 and err.value.body["param"] == "tool_choice"
