"""ftserve/server/tool_calls.py: finding tool calls in model output, whole and streamed."""

from __future__ import annotations

import json

import pytest

from ftserve.server.tool_calls import ToolStream, format_of, parse


def test_format_from_the_template() -> None:
    assert format_of("{% for t in tools %}...<tool_call>\n{{ t | tojson }}</tool_call>") == "hermes"
    assert format_of("{{ '[TOOL_CALLS]' + calls | tojson }}") == "mistral"
    assert format_of("{% for m in messages %}{{ m.content }}{% endfor %}") is None


def test_hermes_calls_and_content() -> None:
    text = ('Let me look.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n'
            '</tool_call>\n<tool_call>{"name": "grep", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>')
    p = parse(text, "hermes")
    assert p.content == "Let me look."
    assert [c["function"]["name"] for c in p.tool_calls] == ["read_file", "grep"]
    assert json.loads(p.tool_calls[0]["function"]["arguments"]) == {"path": "a.py"}
    assert json.loads(p.tool_calls[1]["function"]["arguments"]) == {"q": "x"}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in p.tool_calls)
    assert len({c["id"] for c in p.tool_calls}) == 2
    only = parse('<tool_call>{"name": "ls", "arguments": {}}</tool_call>', "hermes")
    assert only.content is None and only.tool_calls[0]["function"]["arguments"] == "{}"


@pytest.mark.parametrize("text", [
    "no calls at all",
    '<tool_call>{"name": "ls", "arguments": {}}',  # cut off by max_tokens: no closing tag
    '<tool_call>{"name": "ls", "arguments": {</tool_call>',  # bad JSON
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "ls", "arguments": "{not json"}</tool_call>',  # arguments string not JSON
    '<tool_call>{"name": "ls"}</tool_call> and then more prose',  # text after the calls
])
def test_hermes_anything_unclean_stays_content(text: str) -> None:
    p = parse(text, "hermes")
    assert p.content == text and p.tool_calls == []


def test_mistral_calls() -> None:
    text = 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now"}]'
    p = parse(text, "mistral")
    assert p.content == "Sure."
    assert [c["function"]["name"] for c in p.tool_calls] == ["get_weather", "now"]
    assert json.loads(p.tool_calls[1]["function"]["arguments"]) == {}
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in p.tool_calls)
    bad = '[TOOL_CALLS][{"name": "get_weather", "argu'
    assert parse(bad, "mistral").tool_calls == [] and parse(bad, "mistral").content == bad


def test_stream_sends_plain_text_at_once() -> None:
    ts = ToolStream("hermes")
    assert ts.push("hello world") == ("hello world", [])
    assert ts.push(" a <to") == (" a ", [])  # "<to" could start a call: held
    assert ts.push("day") == ("<today", [])  # it did not
    assert ts.finish() == ("", []) and not ts.called


def test_chat_choice_with_tool_calls() -> None:
    from ftserve.server.completions import with_tool_calls

    text = 'Checking.\n<tool_call>{"name": "ls", "arguments": {"dir": "."}}</tool_call>'
    choice = {"index": 1, "message": {"role": "assistant", "content": text}, "logprobs": None,
              "finish_reason": "stop"}
    with_tool_calls(choice, text, "hermes")
    assert choice["finish_reason"] == "tool_calls" and choice["index"] == 1
    msg = choice["message"]
    assert msg["content"] == "Checking." and msg["role"] == "assistant"
    (call,) = msg["tool_calls"]
    assert call["function"] == {"name": "ls", "arguments": '{"dir": "."}'}
    two = text + '<tool_call>{"name": "cat", "arguments": {"f": "a"}}</tool_call>'
    single = {"message": {"role": "assistant", "content": two}, "finish_reason": "stop"}
    with_tool_calls(single, two, "hermes", parallel=False)  # parallel_tool_calls: false
    assert [c["function"]["name"] for c in single["message"]["tool_calls"]] == ["ls"]
    both = {"message": {"role": "assistant", "content": two}, "finish_reason": "stop"}
    with_tool_calls(both, two, "hermes")
    assert [c["function"]["name"] for c in both["message"]["tool_calls"]] == ["ls", "cat"]
    plain = {"message": {"role": "assistant", "content": "hi"}, "finish_reason": "length"}
    with_tool_calls(plain, "hi", "hermes")
    assert plain == {"message": {"role": "assistant", "content": "hi"}, "finish_reason": "length"}


def test_streamed_choice_sends_calls_as_they_arrive(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The SSE side: content through the filter, then a call's start and its
    argument fragments as tool_calls deltas with the choice's index."""
    from ftserve.models.checkpoint import write_checkpoint
    from ftserve.server.completions import _ChoiceChunks
    from ftserve.server.protocol import parse_chat
    from ftserve.server.text import make_text_codec

    ckpt = write_checkpoint("tiny-moe", tmp_path / "m", layers=1, seed=0)
    text = make_text_codec(str(ckpt))
    assert text.tool_format() == "mistral"  # the demo template renders Mistral-style tools
    body = {"messages": [{"role": "user", "content": "x"}], "stream": True,
            "tools": [{"type": "function", "function": {"name": "ls"}}]}
    parsed = parse_chat(body)
    st = _ChoiceChunks(parsed, "chatcmpl-1", 0, "m", None, 2, text, None)  # type: ignore[arg-type]
    out = 'Sure [TOOL_CALLS] [{"name": "ls", "arguments": {"d": 1}}]'
    parts = [st.split(out[i:i + 5]) for i in range(0, len(out), 5)] + [st.finish()]
    assert "".join(p[1] for p in parts).strip() == "Sure"
    deltas = [d for p in parts for d in p[2]]
    assert deltas[0]["function"] == {"name": "ls", "arguments": ""} and deltas[0]["index"] == 0
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"d": 1}'
    assert all(set(d) == {"index", "function"} for d in deltas[1:])
    (choice,) = st.call_chunk(deltas[0])["choices"]
    assert choice["index"] == 2 and choice["finish_reason"] is None
    (tc,) = choice["delta"]["tool_calls"]
    assert tc["index"] == 0 and tc["type"] == "function" and len(tc["id"]) == 9
    # parallel_tool_calls false: the stream also sends only the first call.
    one = _ChoiceChunks(parse_chat({**body, "parallel_tool_calls": False}), "chatcmpl-2", 0, "m",
                        None, 0, text, None)  # type: ignore[arg-type]
    twice = 'x [TOOL_CALLS] [{"name": "ls", "arguments": {}}, {"name": "cat", "arguments": {}}]'
    sent = one.split(twice)[2] + one.finish()[2]
    assert {d["index"] for d in sent} == {0} and [d["function"].get("name") for d in sent] == ["ls", None]
