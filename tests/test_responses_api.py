"""OpenAI's Responses API (/v1/responses; ftserve/api/responses/route.py and
models.py) against a real server (the demo model, Mistral-style
template: system prompt, tools), read with the official ``openai`` client.
Engine steps are scripted where the output must be function calls."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.server_harness import Live
from tests.test_anthropic_api import OPENAI_HISTORY, OPENAI_TOOLS, USER, _tokenize
from tests.test_anthropic_thinking import think_live as think_live  # the thinking-template server
from tests.test_server_errors import call
from tests.test_tool_choice import script as script  # the scripted-generations fixture

MODEL = "ftserve-demo"
TOOLS = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"],
          **({"description": t["function"]["description"]} if "description" in t["function"] else {})}
         for t in OPENAI_TOOLS]
# OPENAI_HISTORY (a call round, then a question) as Responses input items.
HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": USER[0]["content"]},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
    {"type": "function_call", "call_id": "toolu_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
    {"type": "function_call_output", "call_id": "toolu_1", "output": "sunny, 21C"},
    {"role": "user", "content": [{"type": "input_text", "text": "And in Rome?"}]},
]
EXTRA = {"ignore_eos": True}


@pytest.fixture(scope="module")
def client(live: Live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _items(response: Any) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for item in response.output:
        if item.type == "message":
            out.append(("message", "".join(p.text for p in item.content)))
        elif item.type == "function_call":
            out.append(("function_call", item.name, json.loads(item.arguments)))
        else:
            out.append(("reasoning", "".join(c.text for c in item.content or [])))
    return out


def _streamed(client: openai.OpenAI, **req: Any) -> tuple[Any, list[Any]]:
    """The streamed events, and the response the last one (response.completed or
    response.incomplete) carries. Not the stream helper: its final response
    comes from response.completed only."""
    events = list(client.responses.create(**req, stream=True))
    assert events[-1].type in ("response.completed", "response.incomplete")
    return events[-1].response, events


def _same(whole: Any, streamed: Any) -> None:
    """Equal but for the ids the server draws and the prefix-cache share."""
    def norm(r: Any) -> dict[str, Any]:
        d = r.model_dump(exclude={"id", "created_at"})
        d["usage"]["input_tokens_details"].pop("cached_tokens")
        for item in d["output"]:
            item.pop("id")
            item.pop("call_id", None)  # drawn per call
            item.pop("parsed_arguments", None)
            for part in item.get("content") or []:
                part.pop("parsed", None)
        return d
    assert norm(whole) == norm(streamed)


def _sequence(events: list[Any]) -> list[str]:
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return [e.type for e in events]


# ----------------------------------------------------------------- items


OUTPUTS = [  # (output, the prompt opened reasoning, tools given)
    ("Plain text, no tools.", False, False),
    ("  padded text \n", False, True),
    ("Checking. [TOOL_CALLS] [{\"name\": \"ls\", \"arguments\": {\"d\": [1, 2]}}]", False, True),
    ("a plan\n</think>\n\nThe answer.  ", True, False),
    ("plan</think>\n\n[TOOL_CALLS] [{\"name\": \"ls\", \"arguments\": {}}, "
     "{\"name\": \"cat\", \"arguments\": {\"f\": \"x y\"}}]", True, True),
]


def _assemble(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items from stream events, as a client puts them together; every
    item's done event must hold what its deltas added up to."""
    items: list[dict[str, Any]] = []
    text: dict[int, str] = {}
    for ev in events:
        kind, at = ev["type"], ev.get("output_index")
        if kind == "response.output_item.added":
            assert at == len(items)
            items.append(ev["item"])
            text[at] = ""
        elif kind.endswith(".delta"):
            assert at == len(items) - 1 and ev["item_id"] == items[at]["id"]
            text[at] += ev["delta"]
        elif kind == "response.output_item.done":
            done = ev["item"]
            if done["type"] == "message":
                assert done["content"][0]["text"] == text[at]
            elif done["type"] == "reasoning":
                assert done["content"][0]["text"] == text[at]
            else:
                assert done["arguments"] == (text[at] or "{}")
            items[at] = done
    return items


@pytest.mark.parametrize("output,think,tools", OUTPUTS)
def test_stream_items_equal_whole_items_at_every_cut(output: str, think: bool, tools: bool) -> None:
    from ftserve.api.responses.route import StreamItems, whole_items
    from ftserve.chat.output import StreamSplit, split_whole

    fmt = "mistral" if tools else None

    def norm(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in items]

    want = norm(whole_items(split_whole(output, fmt, True, None, think)))
    assert want
    for cut in range(len(output) + 1):
        filt, items = StreamSplit(fmt, True, None, think), StreamItems()
        events = [*items.push(*filt.push(output[:cut])), *items.push(*filt.push(output[cut:])),
                  *items.push(*filt.finish()), *items.finish()]
        assert norm(_assemble(events)) == want, cut
        assert norm(items.items) == want, cut


# ----------------------------------------------------------------- text


def test_text_whole_and_streamed_are_the_chat_reply(live: Live, client: openai.OpenAI) -> None:
    req = {"model": MODEL, "input": USER[0]["content"], "max_output_tokens": 6, "temperature": 0,
           "extra_body": EXTRA}
    whole = client.responses.create(**req)
    assert whole.object == "response" and whole.model == MODEL and whole.id.startswith("resp_")
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output[-1].status == "incomplete"  # the item the limit cut off
    assert whole.usage.output_tokens == 6 and whole.usage.total_tokens == whole.usage.input_tokens + 6
    status, _, chat = call(live, "/v1/chat/completions", {
        "messages": USER, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert status == 200
    assert _items(whole) == [("message", chat["choices"][0]["message"]["content"])]
    assert whole.output_text == chat["choices"][0]["message"]["content"]
    assert whole.usage.input_tokens == chat["usage"]["prompt_tokens"]
    streamed, events = _streamed(client, **req)
    _same(whole, streamed)
    kinds = _sequence(events)
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert {"response.output_item.added", "response.content_part.added", "response.output_text.delta",
            "response.output_text.done", "response.content_part.done", "response.output_item.done"} <= set(kinds)
    # Ended before max_output_tokens (here by a stop string, an extension): completed.
    stop = whole.output_text.strip()[-3:]
    done = client.responses.create(**{**req, "max_output_tokens": 50, "extra_body": {**EXTRA, "stop": [stop]}})
    assert done.status == "completed" and done.incomplete_details is None
    assert done.output[-1].status == "completed"
    assert done.usage.output_tokens < 50
    live.wait_idle()


def test_instructions_and_input_messages(live: Live, client: openai.OpenAI) -> None:
    system = "You are terse."
    r = client.responses.create(model=MODEL, instructions=system, input=USER[0]["content"],
                                max_output_tokens=2, temperature=0)
    assert r.usage.input_tokens == _tokenize(live, {"messages": [{"role": "system", "content": system}, *USER]})
    # A developer message as an input item, parts joined by newlines.
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": system}]},
             {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]}]
    r = client.responses.create(model=MODEL, input=items, max_output_tokens=2, temperature=0)
    assert r.usage.input_tokens == _tokenize(live, {"messages": [
        {"role": "developer", "content": system}, {"role": "user", "content": "a\nb"}]})
    # The same conversation again: the prefix cache holds most of it.
    story = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper " * 6}]
    first = client.responses.create(model=MODEL, input=story, max_output_tokens=2, temperature=0)
    again = client.responses.create(model=MODEL, input=story, max_output_tokens=2, temperature=0)
    assert again.usage.input_tokens == first.usage.input_tokens
    assert again.usage.input_tokens_details.cached_tokens > first.usage.input_tokens_details.cached_tokens
    live.wait_idle()


def test_json_schema_text_format(live: Live, client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"],
              "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Give an id.", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "x", "schema": schema}})
    obj = json.loads(r.output_text)
    assert set(obj) == {"id"} and isinstance(obj["id"], int)
    live.wait_idle()


# ----------------------------------------------------------------- tools


def test_function_call_round_trip(live: Live, client: openai.OpenAI, script: list[str]) -> None:
    assert live.text.tool_format() == "mistral"
    script[:] = ["Checking. ", '[TOOL_CALLS] [{"name": "get_weather", ',
                 '"arguments": {"city": "Ro', 'me"}}, {"name": "now", "arguments": {}}]']
    req = {"model": MODEL, "input": HISTORY, "tools": TOOLS, "max_output_tokens": len(script),
           "temperature": 0, "extra_body": EXTRA}
    whole = client.responses.create(**req)
    # The history renders as its chat twin does.
    assert whole.usage.input_tokens == _tokenize(live, {"messages": OPENAI_HISTORY, "tools": OPENAI_TOOLS})
    want = [("message", "Checking."), ("function_call", "get_weather", {"city": "Rome"}),
            ("function_call", "now", {})]
    assert _items(whole) == want and whole.status == "completed"
    calls = [i for i in whole.output if i.type == "function_call"]
    assert all(c.id.startswith("fc_") and c.call_id and c.status == "completed" for c in calls)
    assert len({c.call_id for c in calls}) == 2
    streamed, events = _streamed(client, **req)
    _same(whole, streamed)
    kinds = _sequence(events)
    assert kinds[-1] == "response.completed"
    args = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(args) >= 2 and "".join(args) == '{"city": "Rome"}{}'
    one = client.responses.create(**req, parallel_tool_calls=False)
    assert _items(one) == want[:2]
    # The reply to a call: the function_call_output and the calls before it as input.
    follow = [*HISTORY, *[c.model_dump(include={"type", "call_id", "name", "arguments"}) for c in calls],
              {"type": "function_call_output", "call_id": calls[0].call_id, "output": "rain"},
              {"type": "function_call_output", "call_id": calls[1].call_id, "output": "noon"}]
    script[:] = ["It rains."]
    reply = client.responses.create(model=MODEL, input=follow, tools=TOOLS, max_output_tokens=1,
                                    temperature=0, extra_body=EXTRA)
    assert _items(reply) == [("message", "It rains.")]
    live.wait_idle()


def test_forced_tool_choice(live: Live, client: openai.OpenAI, script: list[str]) -> None:
    script[:] = [' {"city": ', '"Oslo"}}]']
    req = {"model": MODEL, "input": USER[0]["content"], "tools": TOOLS, "max_output_tokens": 2,
           "tool_choice": {"type": "function", "name": "get_weather"}, "temperature": 0, "extra_body": EXTRA}
    whole = client.responses.create(**req)
    assert _items(whole) == [("function_call", "get_weather", {"city": "Oslo"})]
    assert whole.tool_choice.name == "get_weather"
    streamed, _ = _streamed(client, **req)
    _same(whole, streamed)
    live.wait_idle()


# ----------------------------------------------------------------- errors


@pytest.mark.parametrize("body,field", [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
     "input[0].arguments"),
    ({"input": [{"type": "web_search_call", "id": "w"}]}, "input[0].type"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": 3}}}},
     "text.format"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "x", "include": "reasoning.encrypted_content"}, "include"),
    ({"input": "x", "top_logprobs": 3}, "top_logprobs"),
    ({"input": "x", "top_logprobs": -1}, "top_logprobs"),
])
def test_bad_fields_are_400_naming_them(live: Live, body: dict[str, Any], field: str) -> None:
    status, _, out = call(live, "/v1/responses", {"model": MODEL, **body})
    assert status == 400, out
    assert out["error"]["param"] == field, out


def test_unknown_model_and_long_input(live: Live, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-5", input="x", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model=MODEL, input="word " * 600, max_output_tokens=2)
    assert "maximum context length" in bad.value.message


# ----------------------------------------------------------------- reasoning


def test_reasoning_items(think_live: Live, script: list[str]) -> None:
    """A Qwen3-style thinking template: the reasoning comes back as a reasoning
    item, and an earlier turn's reasoning item is that turn's reasoning_content."""
    client = openai.OpenAI(base_url=think_live.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    script[:] = ["plan it", "\n</think>", "\n\nThe answer."]
    req = {"model": MODEL, "input": USER[0]["content"], "max_output_tokens": len(script),
           "temperature": 0, "extra_body": EXTRA}
    whole = client.responses.create(**req)
    assert _items(whole) == [("reasoning", "plan it\n"), ("message", "The answer.")]
    streamed, events = _streamed(client, **req)
    _same(whole, streamed)
    assert [e.delta for e in events if e.type == "response.reasoning_text.delta"] == ["plan it", "\n"]
    turn = [{"role": "user", "content": USER[0]["content"]},
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": "It is warm."}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
            {"role": "user", "content": "And Rome?"}]
    twin = [*USER, {"role": "assistant", "content": "Sunny.", "reasoning_content": "It is warm."},
            {"role": "user", "content": "And Rome?"}]
    script[:] = ["ok"]
    r = client.responses.create(model=MODEL, input=turn, max_output_tokens=1, temperature=0, extra_body=EXTRA)
    assert r.usage.input_tokens == _tokenize(think_live, {"messages": twin})
    think_live.wait_idle()


def test_codex_shaped_history_becomes_chat_messages() -> None:
    """Codex's turn shape (store false): reasoning, then calls, then their outputs;
    consecutive calls join one assistant message, the reasoning its reasoning_content;
    reasoning with no assistant turn after it is dropped."""
    from ftserve.api.responses.models import parse_responses_request

    parsed = parse_responses_request({
        "model": MODEL, "instructions": "Be brief.", "store": False, "stream": True,
        "reasoning": {"effort": "medium", "summary": "auto"}, "include": ["reasoning.encrypted_content"],
        "text": {"verbosity": "low"}, "parallel_tool_calls": False, "tools": TOOLS,
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "fix it"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "look first"}],
             "encrypted_content": None},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
            {"type": "function_call", "call_id": "c2", "name": "now", "arguments": ""},
            {"type": "function_call_output", "call_id": "c1", "output": "cold"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
            {"type": "reasoning", "id": "rs_2", "summary": []},
            {"role": "user", "content": "thanks"},
        ]})
    assert parsed.stream and not parsed.parallel_tool_calls and parsed.response_format is None
    assert parsed.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "fix it"},
        {"role": "assistant", "content": "", "reasoning_content": "look first", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
            {"id": "c2", "type": "function", "function": {"name": "now", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "cold"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
        {"role": "user", "content": "thanks"},
    ]
