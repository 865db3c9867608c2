"""Llama 3.x JSON tool calls end to end (ftserve/chat/tool_calls_llama.py): a real
server given a Llama-3-style chat template (--chat-template), whose engine steps
are scripted to write calls, read with the official openai and anthropic clients,
streamed and not, with tool_choice auto, a named function and "required"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic

from ftserve.api.openai.models import parse_chat
from ftserve.chat.tool_choice import ForcedCall, forced_text
from tests.server_harness import openai_client, template_live
from tests.test_tool_choice import _assert_name_first, _calls, _streamed, _tokens
from tests.test_tool_choice import script as script  # the scripted-generations fixture

TEMPLATE = Path(__file__).parent / "templates" / "llama3_json.jinja"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
         {"type": "function", "function": {"name": "now"}}]
# A finished turn with a call and its result: the template renders both.
MSGS = [{"role": "user", "content": "Time?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
        {"role": "user", "content": "Weather in Paris and Rome?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CALLS = ["<|python", "_tag|>", '{"na', 'me": "get_weather", "param', 'eters": {"city": "Pa',
         'ris", "days": 3}}; {"name": "get_weather", ', '"parameters": {"city": "Rome"}}']
WANT = [("get_weather", '{"city": "Paris", "days": 3}'), ("get_weather", '{"city": "Rome"}')]


live = template_live(TEMPLATE)  # a server over this module's chat template


def _req(max_tokens: int, **kw: Any) -> dict[str, Any]:
    return {"model": "ftserve-demo", "tools": TOOLS, "messages": MSGS, "max_tokens": max_tokens,
            "temperature": 0, "extra_body": {"ignore_eos": True}, **kw}


def test_history_renders_calls_as_json(live: Any) -> None:
    assert live.text.tool_format() == "llama3"
    messages = parse_chat({"messages": MSGS}).messages  # earlier calls' arguments as objects
    assert messages is not None
    rendered = live.text.render_chat(messages, True, TOOLS, {})
    assert '<|end_header_id|>\n\n{"name": "now", "parameters": {}}<|eom_id|>' in rendered
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n12:00<|eot_id|>" in rendered


def test_chat_with_tools_returns_the_calls(live: Any, script: list[str]) -> None:
    script[:] = CALLS
    client = openai_client(live)
    req = _req(len(CALLS))
    (choice,) = client.chat.completions.create(**req).choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert _calls(choice.message) == WANT and len({c.id for c in choice.message.tool_calls}) == 2
    chunks = list(client.chat.completions.create(**req, stream=True))
    assert not any(c.choices and c.choices[0].delta.content for c in chunks)  # the tag is held
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert deltas[0].function.name == "get_weather" and deltas[0].function.arguments == ""
    assert len([d for d in deltas if d.index == 0]) > 2  # arguments as they came
    final = _streamed(client, req)
    assert _calls(final.choices[0].message) == WANT
    assert final.choices[0].finish_reason == "tool_calls"
    one = _streamed(client, {**req, "parallel_tool_calls": False}).choices[0]
    assert _calls(one.message) == WANT[:1] and one.finish_reason == "tool_calls"
    single = client.chat.completions.create(**req, parallel_tool_calls=False).choices[0]
    assert _calls(single.message) == WANT[:1]
    live.wait_idle()


def test_text_before_json_is_content(live: Any, script: list[str]) -> None:
    script[:] = ["  Sure", ': {"name": "now", "parameters": {}}']
    client = openai_client(live)
    req = _req(len(script))
    (choice,) = client.chat.completions.create(**req).choices
    assert choice.message.content == "".join(script) and not choice.message.tool_calls
    chunks = [c for c in client.chat.completions.create(**req, stream=True) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "".join(script)
    assert not any(c.choices[0].delta.tool_calls for c in chunks)
    live.wait_idle()


def test_named_function_is_forced(live: Any, script: list[str]) -> None:
    # The model continues after '{"name": "get_weather", "parameters":'; a second call is dropped.
    script[:] = [' {"city": "Pa', 'ris"}}', '; {"name": "now", "parameters": {}}']
    client = openai_client(live)
    req = _req(len(script), tool_choice=NAMED)
    want = [("get_weather", '{"city": "Paris"}')]
    whole = client.chat.completions.create(**req)
    (choice,) = whole.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert _calls(choice.message) == want
    assert whole.usage.prompt_tokens == _tokens(live, {"messages": MSGS, "tools": TOOLS,
                                                       "tool_choice": NAMED})  # forced text is prompt
    assert whole.usage.prompt_tokens > _tokens(live, {"messages": MSGS, "tools": TOOLS})
    final = _streamed(client, req)
    assert _calls(final.choices[0].message) == want
    _assert_name_first(client, req, "get_weather")
    live.wait_idle()


def test_required_lets_the_model_name_the_calls(live: Any, script: list[str]) -> None:
    script[:] = ['now", "parameters": {}}; ', '{"name": "get_weather", "parameters": {"days": 5}}']
    client = openai_client(live)
    req = _req(len(script), tool_choice="required")
    want = [("now", "{}"), ("get_weather", '{"days": 5}')]
    whole = client.chat.completions.create(**req)
    assert _calls(whole.choices[0].message) == want and whole.choices[0].message.content is None
    final = _streamed(client, req)
    assert _calls(final.choices[0].message) == want
    one = client.chat.completions.create(**req, parallel_tool_calls=False)
    assert _calls(one.choices[0].message) == want[:1]
    # Output that does not continue the call: all content, the forced text in front.
    script[:] = ["oops", " no call"]
    (bad,) = client.chat.completions.create(**_req(len(script), tool_choice="required")).choices
    assert bad.message.content == forced_text("llama3", ForcedCall()) + "oops no call"
    assert not bad.message.tool_calls and bad.finish_reason == "length"
    live.wait_idle()


def test_anthropic_messages_return_tool_use(live: Any, script: list[str]) -> None:
    script[:] = CALLS
    client = anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0, timeout=60)
    tools = [{"name": t["function"]["name"],
              "input_schema": t["function"].get("parameters", {"type": "object"})} for t in TOOLS]
    req = {"model": "ftserve-demo", "max_tokens": len(CALLS), "tools": tools,
           "messages": [{"role": "user", "content": "Weather in Paris and Rome?"}],
           "extra_body": {"temperature": 0, "ignore_eos": True}}
    want = [("tool_use", "get_weather", {"city": "Paris", "days": 3}),
            ("tool_use", "get_weather", {"city": "Rome"})]
    whole = client.messages.create(**req)
    assert whole.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in whole.content] == want
    with client.messages.stream(**req) as stream:
        list(stream)
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in streamed.content] == want
    live.wait_idle()
