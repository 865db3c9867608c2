"""ftserve/chat/tool_calls.py: finding tool calls in model output, whole and streamed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ftserve.chat.tool_calls import ToolStream, format_of, param_types, parse

CODER_TEMPLATE = Path(__file__).parent / "templates" / "qwen3_coder.jinja"
LLAMA_TEMPLATE = Path(__file__).parent / "templates" / "llama3_json.jinja"


def test_format_from_the_template() -> None:
    assert format_of("{% for t in tools %}...<tool_call>\n{{ t | tojson }}</tool_call>") == "hermes"
    assert format_of("{{ '[TOOL_CALLS]' + calls | tojson }}") == "mistral"
    assert format_of("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    # Qwen3-Coder's template holds <tool_call> too: its <function= / <parameter= decide.
    assert format_of(CODER_TEMPLATE.read_text()) == "qwen3_coder"
    assert format_of("<tool_call>\n<function=x>\n</function>") == "hermes"  # no <parameter=
    # Llama 3: header tokens and a JSON call ("parameters") or the python tag.
    assert format_of(LLAMA_TEMPLATE.read_text()) == "llama3"
    head = "<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    assert format_of(head + "<|python_tag|>{{ call }}") == "llama3"
    assert format_of(head + "{{ m.content }}<|eot_id|>") is None  # renders no calls
    assert format_of('{"name": "f", "parameters": {}}') is None  # no Llama header
    # A Llama fine-tune speaking hermes stays hermes; the others never read as llama3.
    assert format_of(head + '<tool_call>{"name": "f", "parameters": {}}</tool_call>') == "hermes"
    assert format_of(CODER_TEMPLATE.read_text()) == "qwen3_coder"


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
    # arguments nested past what Python's json parses (a RecursionError was a 500)
    pytest.param('<tool_call>{"name": "ls", "arguments": {"a": ' + "[" * 3000 + "]" * 3000 + "}}</tool_call>",
                 id="nested 3000 deep"),
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


def test_whole_output_with_tool_calls() -> None:
    from ftserve.chat.output import split_whole

    text = 'Checking.\n<tool_call>{"name": "ls", "arguments": {"dir": "."}}</tool_call>'
    out = split_whole(text, "hermes", True, None, None)
    assert out.content == "Checking." and out.thought is None
    (call,) = out.calls
    assert call["function"] == {"name": "ls", "arguments": '{"dir": "."}'}
    two = text + '<tool_call>{"name": "cat", "arguments": {"f": "a"}}</tool_call>'
    single = split_whole(two, "hermes", False, None, None)  # parallel_tool_calls: false
    assert [c["function"]["name"] for c in single.calls] == ["ls"]
    both = split_whole(two, "hermes", True, None, None)
    assert [c["function"]["name"] for c in both.calls] == ["ls", "cat"]
    assert split_whole("hi", "hermes", True, None, None).calls == []
    assert split_whole("hi", "hermes", True, None, None).content == "hi"
    # Reasoning first, then calls in what remains; the forced text is parsed with the output.
    mixed = split_whole('a</think>\n\n<tool_call>{"name": "ls"}</tool_call>', "hermes", True,
                        None, True)
    assert mixed.thought == "a" and mixed.content is None and len(mixed.calls) == 1
    forced = split_whole('ls"}</tool_call>', "hermes", True, None, None, '<tool_call>\n{"name": "')
    assert [c["function"]["name"] for c in forced.calls] == ["ls"]
    bad = split_whole('oops', "hermes", True, None, None, '<tool_call>\n{"name": "')
    assert bad.calls == [] and bad.content == '<tool_call>\n{"name": "oops'


def test_streamed_choice_sends_calls_as_they_arrive(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The SSE side: content through the output split, then a call's start and its
    argument fragments as tool_calls deltas with the choice's index."""
    from ftserve.api.driver import Choice
    from ftserve.api.openai.chat import ChatStream
    from ftserve.api.openai.models import parse_chat
    from ftserve.chat.output import OutputSpec
    from ftserve.chat.text import make_text_codec
    from ftserve.models.checkpoint import write_checkpoint

    ckpt = write_checkpoint("tiny-moe", tmp_path / "m", layers=1, seed=0)
    text = make_text_codec(str(ckpt))
    assert text.tool_format() == "mistral"  # the demo template renders Mistral-style tools
    body = {"messages": [{"role": "user", "content": "x"}], "stream": True,
            "tools": [{"type": "function", "function": {"name": "ls"}}]}
    req = parse_chat(body)
    split = OutputSpec(text.tool_format(), req.parallel_tool_calls).stream()
    choice = Choice(2, None, split)  # type: ignore[arg-type]
    st = ChatStream(req, "chatcmpl-1", 0, "m", [choice], text)
    out = 'Sure [TOOL_CALLS] [{"name": "ls", "arguments": {"d": 1}}]'
    parts = [split.push(out[i:i + 5]) for i in range(0, len(out), 5)] + [split.finish()]
    assert "".join(p[1] for p in parts).strip() == "Sure"
    deltas = [d for p in parts for d in p[2]]
    assert deltas[0]["function"] == {"name": "ls", "arguments": ""} and deltas[0]["index"] == 0
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"d": 1}'
    assert all(set(d) == {"index", "function"} for d in deltas[1:])
    (chunk,) = st.call_chunk(choice, deltas[0])["choices"]
    assert chunk["index"] == 2 and chunk["finish_reason"] is None
    (tc,) = chunk["delta"]["tool_calls"]
    assert tc["index"] == 0 and tc["type"] == "function" and len(tc["id"]) == 9
    # parallel_tool_calls false: the stream also sends only the first call.
    one_req = parse_chat({**body, "parallel_tool_calls": False})
    one = OutputSpec(text.tool_format(), one_req.parallel_tool_calls).stream()
    twice = 'x [TOOL_CALLS] [{"name": "ls", "arguments": {}}, {"name": "cat", "arguments": {}}]'
    sent = one.push(twice)[2] + one.finish()[2]
    assert {d["index"] for d in sent} == {0} and [d["function"].get("name") for d in sent] == ["ls", None]


# ------------------------------------------------------------- qwen3_coder

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"},
        "metric": {"type": "boolean"}, "opts": {"type": "object"}, "hours": {"type": "array"},
        "note": {"type": ["string", "null"]}, "limit": {"anyOf": [{"type": "integer"},
                                                                  {"type": "null"}]}}}}}
TYPES = param_types([WEATHER, {"type": "function", "function": {"name": "now"}}])


def _xml(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def _args(text: str) -> list[tuple[str, Any]]:
    p = parse(text, "qwen3_coder", TYPES)
    assert p.tool_calls, text
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in p.tool_calls]


def test_qwen3_coder_calls_and_content() -> None:
    one = _xml("get_weather", city="Paris", days="3")
    p = parse(one, "qwen3_coder", TYPES)
    assert p.content is None
    (call,) = p.tool_calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    # arguments: the typed parameters in the order written, as JSON object text
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}
    several = "Let me check both.\n\n" + one + "\n" + _xml("now") + "\n" + _xml("get_weather", city="Rome")
    p = parse(several, "qwen3_coder", TYPES)
    assert p.content == "Let me check both."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in p.tool_calls] == [
        ("get_weather", '{"city": "Paris", "days": 3}'), ("now", "{}"),
        ("get_weather", '{"city": "Rome"}')]
    assert len({c["id"] for c in p.tool_calls}) == 3


def test_qwen3_coder_string_values_are_raw_text() -> None:
    code = 'def f(x):\n    return "</p>" + x\n\n# {"not": json}\\n'
    (call,) = _args(_xml("get_weather", city=code))  # one leading, one trailing newline are markup
    assert call == ("get_weather", {"city": code})
    assert _args(_xml("get_weather", city="\nParis\n")) == [("get_weather", {"city": "\nParis\n"})]
    assert _args(_xml("get_weather", city="")) == [("get_weather", {"city": ""})]
    assert _args(_xml("get_weather", city="42")) == [("get_weather", {"city": "42"})]
    # No newline around the value at all: still the value.
    tight = "<tool_call><function=get_weather><parameter=city>Oslo</parameter></function></tool_call>"
    assert _args(tight) == [("get_weather", {"city": "Oslo"})]
    (c,) = parse(_xml("get_weather", city='é "q"\t'), "qwen3_coder", TYPES).tool_calls
    assert c["function"]["arguments"] == '{"city": "é \\"q\\"\\t"}'  # JSON-escaped, not ASCII-escaped


@pytest.mark.parametrize("param,raw,want", [
    ("days", "3", 3), ("days", " 7 ", 7), ("days", "3.5", 3.5), ("days", "three", "three"),
    ("days", "NaN", "NaN"), ("days", "1e999", "1e999"), ("days", "true", "true"),
    ("temp", "-1.25", -1.25), ("temp", "2e3", 2000.0), ("temp", "warm", "warm"),
    ("metric", "true", True), ("metric", "False", False), ("metric", "TRUE", True),
    ("metric", "yes", "yes"), ("metric", "1", "1"),
    ("opts", '{"a": [1, {"b": null}]}', {"a": [1, {"b": None}]}), ("opts", "[1]", "[1]"),
    ("opts", "{'a': 1}", "{'a': 1}"),
    ("hours", "[1, 2,\n 3]", [1, 2, 3]), ("hours", '{"a": 1}', '{"a": 1}'), ("hours", "[1,", "[1,"),
    ("note", "null", "null"),  # a type list with "string": the text as written
    ("limit", "5", 5), ("limit", "null", None), ("limit", "x", "x"),
    ("unknown", "5", "5"), ("unknown", '{"a": 1}', '{"a": 1}'),  # not in the schema: the text
])
def test_qwen3_coder_values_are_typed_by_the_schema(param: str, raw: str, want: Any) -> None:
    ((_, args),) = _args(_xml("get_weather", **{param: raw}))
    assert args == {param: want} and type(args[param]) is type(want)


def test_qwen3_coder_untyped_without_schemas() -> None:
    # A function the request did not offer, or no types given: every value is text.
    assert _args(_xml("other", days="3")) == [("other", {"days": "3"})]
    (c,) = parse(_xml("get_weather", days="3"), "qwen3_coder").tool_calls
    assert c["function"]["arguments"] == '{"days": "3"}'


@pytest.mark.parametrize("text", [
    "no calls at all, just <b>tags</b> and <function=x>",
    _xml("get_weather", city="Paris")[:-len("</tool_call>")],  # cut off: no </tool_call>
    _xml("get_weather", city="Paris").replace("</function>\n", ""),  # no </function>
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",  # cut off in a value
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
    "<tool_call>\n<function=>\n</function>\n</tool_call>",  # empty name
    "<tool_call>\n<function=get\nweather>\n</function>\n</tool_call>",  # a newline in the name
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call>",  # hermes JSON
    "<tool_call>\n<function=now>\nhello\n</function>\n</tool_call>",  # garbage in the call
    _xml("now") + "\nand then more prose",
    _xml("now") + "\n<tool_call>\n<function=now>",  # the second call cut off
])
def test_qwen3_coder_anything_unclean_stays_content(text: str) -> None:
    p = parse(text, "qwen3_coder", TYPES)
    assert p.content == text and p.tool_calls == []


def test_template_calls_parse_back() -> None:
    """An earlier call rendered by the template is what the parser reads back, typed."""
    from ftserve.api.openai.models import parse_chat
    from ftserve.tokenizer.chat_template import ChatTemplate

    args = {"city": "Paris\nFrance", "days": 3, "metric": False, "opts": {"u": [1, "x"]},
            "hours": [9, 17], "temp": 21.5}
    calls = [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps(args)}}, {"id": "c2", "type": "function",
        "function": {"name": "now", "arguments": "{}"}}]
    msgs = parse_chat({"messages": [  # earlier calls' arguments as objects, for the template
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]}).messages
    prompt = ChatTemplate(CODER_TEMPLATE.read_text()).render(msgs, add_generation_prompt=True,
                                                             tools=[WEATHER])
    assert "<tool_response>\nsunny\n</tool_response>" in prompt
    turn = prompt.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    p = parse(turn, "qwen3_coder", TYPES)
    assert p.content == "Checking."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in p.tool_calls] == [("get_weather", args), ("now", {})]


@pytest.mark.parametrize("text,want", [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', [("get_weather", '{"city": "Paris"}')]),
    ('<|python_tag|>{"name": "now", "parameters": {}}', [("now", "{}")]),
    ('\n <|python_tag|> {"name": "f", "arguments": {"a": [1]}}\n', [("f", '{"a": [1]}')]),
    ('{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": "; {"}}',
     [("a", '{"x": 1}'), ("b", '{"y": "; {"}')]),
    ('{"name": "a"};{"name": "b"} ;  {"name": "c", "parameters": {}}', [("a", "{}"), ("b", "{}"), ("c", "{}")]),
])
def test_llama3_calls(text: str, want: list[tuple[str, str]]) -> None:
    p = parse(text, "llama3")
    assert p.content is None  # the calls are the whole message
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in p.tool_calls] == want
    assert all(c["id"].startswith("call_") for c in p.tool_calls)


@pytest.mark.parametrize("text", [
    "It is sunny.",
    'Let me check: {"name": "get_weather", "parameters": {}}',  # text first: no call
    '<|python_tag|> print("hi")',  # the tag, then not JSON
    '{"name": "f", "parameters": {"city": Paris}}',  # bad JSON
    '{"parameters": {}}',  # no name
    '{"name": "f", "parameters": {"a": 1}',  # cut off by max_tokens
    '{"name": "f"} and some prose',
    '{"name": "f"}; ',  # a separator and no call after it
    '{"name": "f"}; {"oops": 1}',
    "   ",
])
def test_llama3_anything_unclean_stays_content(text: str) -> None:
    p = parse(text, "llama3")
    assert p.content == text and p.tool_calls == []
