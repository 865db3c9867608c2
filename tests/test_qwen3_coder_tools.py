"""Qwen3-Coder's XML-style tool calls end to end (ftserve/chat/tool_calls_xml.py):
a real server given a Qwen3-Coder-style chat template (--chat-template), whose
engine steps are scripted to write calls, read with the official openai client,
streamed and not, with tool_choice auto, a named function and "required"."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ftserve.api.openai.models import parse_chat
from ftserve.chat.tool_choice import ForcedCall, forced_text
from tests.server_harness import openai_client, template_live
from tests.test_tool_choice import _assert_name_first, _calls, _streamed, _tokens
from tests.test_tool_choice import script as script  # the scripted-generations fixture

TEMPLATE = Path(__file__).parent / "templates" / "qwen3_coder.jinja"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}}}}},
         {"type": "function", "function": {"name": "now"}}]
# A finished turn with a call and its result: the template renders both.
MSGS = [{"role": "user", "content": "Time?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
        {"role": "user", "content": "Weather in São Paulo and Rome?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CALLS = ["Checking", " both.\n<tool", "_call>\n<func", "tion=get_weather>\n<param", "eter=city>\nSão",
         " Paulo\n</parameter>\n<parameter=days>\n", "3\n</parameter>\n<parameter=metric>\nfalse",
         "\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n",
         "<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>"]
WANT = [("get_weather", '{"city": "São Paulo", "days": 3, "metric": false}'),
        ("get_weather", '{"city": "Rome"}')]


live = template_live(TEMPLATE)  # a server over this module's chat template


def _req(max_tokens: int, **kw: Any) -> dict[str, Any]:
    return {"model": "ftserve-demo", "tools": TOOLS, "messages": MSGS, "max_tokens": max_tokens,
            "temperature": 0, "extra_body": {"ignore_eos": True}, **kw}


def test_chat_with_tools_returns_the_calls(live: Any, script: list[str]) -> None:
    assert live.text.tool_format() == "qwen3_coder"
    script[:] = CALLS
    client = openai_client(live)
    req = _req(len(CALLS))
    whole = client.chat.completions.create(**req)
    (choice,) = whole.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking both."
    assert _calls(choice.message) == WANT and len({c.id for c in choice.message.tool_calls}) == 2
    chunks = list(client.chat.completions.create(**req, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert deltas[0].function.name == "get_weather" and deltas[0].function.arguments == ""
    first_args = [d.function.arguments for d in deltas if d.index == 0][1:]
    assert len(first_args) > 3 and "".join(first_args) == WANT[0][1]  # fragments as they came
    final = _streamed(client, req)
    (choice,) = final.choices
    assert choice.finish_reason == "tool_calls" and (choice.message.content or "").strip() == "Checking both."
    assert _calls(choice.message) == WANT
    one = _streamed(client, {**req, "parallel_tool_calls": False}).choices[0]
    assert _calls(one.message) == WANT[:1] and one.finish_reason == "tool_calls"
    single = client.chat.completions.create(**req, parallel_tool_calls=False).choices[0]
    assert _calls(single.message) == WANT[:1]
    # Without tools the same output is plain content.
    plain = client.chat.completions.create(**{**req, "tools": None, "messages": MSGS[-1:]})
    assert plain.choices[0].message.content == "".join(CALLS) and not plain.choices[0].message.tool_calls
    live.wait_idle()


def _prompt_tokens(live: Any, forced: str) -> int:
    """What the prompt with ``forced`` appended counts; /tokenize agrees."""
    messages = parse_chat({"messages": MSGS}).messages  # earlier calls' arguments as objects
    assert messages is not None
    rendered = live.text.render_chat(messages, True, TOOLS, {})
    return _tokens(live, {"prompt": rendered + forced, "add_special_tokens": False})


def test_named_function_is_forced(live: Any, script: list[str]) -> None:
    # The model continues after "<function=get_weather>\n"; a second call is dropped.
    script[:] = ["<parameter=city>\nPa", "ris\n</parameter>\n<parameter=days>\n2\n</parameter>\n",
                 "</function>\n</tool_call>\n<tool_call>\n<function=now>\n</function>\n</tool_call>"]
    client = openai_client(live)
    req = _req(len(script), tool_choice=NAMED)
    want = [("get_weather", '{"city": "Paris", "days": 2}')]
    whole = client.chat.completions.create(**req)
    (choice,) = whole.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert _calls(choice.message) == want
    forced = forced_text("qwen3_coder", ForcedCall("get_weather"))
    assert forced == "<tool_call>\n<function=get_weather>\n"
    assert whole.usage.prompt_tokens == _prompt_tokens(live, forced)  # the forced text is prompt
    assert whole.usage.prompt_tokens == _tokens(live, {"messages": MSGS, "tools": TOOLS,
                                                       "tool_choice": NAMED})
    final = _streamed(client, req)
    assert _calls(final.choices[0].message) == want
    assert final.choices[0].finish_reason == "tool_calls"
    _assert_name_first(client, req, "get_weather")  # the name is in the prompt
    live.wait_idle()


def test_required_lets_the_model_name_the_calls(live: Any, script: list[str]) -> None:
    script[:] = ["=now>\n</function>\n</tool_call>\n", "<tool_call>\n<function=get_weather>\n",
                 "<parameter=days>\n", "5\n</parameter>\n</function>\n</tool_call>"]
    client = openai_client(live)
    req = _req(len(script), tool_choice="required")
    want = [("now", "{}"), ("get_weather", '{"days": 5}')]
    whole = client.chat.completions.create(**req)
    assert _calls(whole.choices[0].message) == want and whole.choices[0].message.content is None
    assert whole.usage.prompt_tokens == _prompt_tokens(live, forced_text("qwen3_coder", ForcedCall()))
    final = _streamed(client, req)
    assert _calls(final.choices[0].message) == want
    assert final.choices[0].finish_reason == "tool_calls"
    one = client.chat.completions.create(**req, parallel_tool_calls=False)
    assert _calls(one.choices[0].message) == want[:1]
    assert json.loads(want[1][1]) == {"days": 5}  # typed by the schema: an integer
    live.wait_idle()


def test_unparseable_forced_output_is_content_with_the_forced_text(live: Any,
                                                                   script: list[str]) -> None:
    script[:] = [" oops", " no call"]
    client = openai_client(live)
    req = _req(len(script), tool_choice="required")
    forced = forced_text("qwen3_coder", ForcedCall())
    (choice,) = client.chat.completions.create(**req).choices
    assert choice.message.content == forced + " oops no call" and not choice.message.tool_calls
    assert choice.finish_reason == "length"
    chunks = [c for c in client.chat.completions.create(**req, stream=True) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == forced + " oops no call"
    assert not any(c.choices[0].delta.tool_calls for c in chunks)
    live.wait_idle()
