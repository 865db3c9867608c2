"""ToolStream (ftserve/chat/tool_calls.py): tool calls streamed as they arrive.
The parser at every split of sample outputs against the whole parse, what
unclean output turns into, then end to end: a real server whose engine steps
are scripted, read back by the official openai client's stream assembly."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from ftserve.chat.tool_calls import param_types, parse, tool_stream

# qwen3_coder values are typed by the request's tools; the JSON formats ignore these.
TYPES = param_types([{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "opts": {"type": "object"},
                                     "hours": {"type": "array"}}}}}])

CLEAN = [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py", '
               '"n": [1, {"x": "}]\\""}]}}\n</tool_call>\n<tool_call>{"name": "grep", '
               '"arguments": "{\\"q\\": \\"x\\"}"}</tool_call>\n'),
    ("hermes", '<tool_call>{"arguments": {"a": "é \\u00e9"} , "name": "late"}</tool_call>'),
    ("hermes", '<tool_call>{"name": "echo", "arguments": {"s": "</tool_call>"}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "ls"}</tool_call><tool_call>{"name": "t", "parameters": '
               '{"k": true}}</tool_call><tool_call>{"name": "n", "arguments": null, "x": -1.5}'
               '</tool_call>'),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "now"}]'),
    ("mistral", '[TOOL_CALLS] {"name": "f", "arguments": {"a": [1, 2]}}'),
    ("qwen3_coder", 'Both, then.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão '
                    '"Paulo"\n</param\n<tool_call>\n\n</parameter>\n<parameter=days>\n3\n'
                    '</parameter>\n<parameter=opts>\n{"u": [1, "}"]}\n</parameter>\n'
                    '<parameter=metric>\nTrue\n</parameter>\n<parameter=extra>\n[1]\n</parameter>'
                    '\n</function>\n</tool_call>\n<tool_call>\n<function=now>\n</function>\n'
                    '</tool_call>\n'),
    ("qwen3_coder", '<tool_call><function=get_weather><parameter=hours>[9, 17]</parameter>'
                    '<parameter=city>a</parameter></function></tool_call>'
                    '<tool_call>\n<function=get_weather>\n<parameter=city>\n\n</parameter>\n'
                    '</function>\n</tool_call>'),
    ("llama3", ' <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
               '"n": [1, {"x": "}; {"}]}}; {"name": "now"};{"name": "t", "arguments": {}}\n'),
    ("llama3", '{"parameters": {"a": "é"}, "name": "late"}'),
]
PLAIN = [  # no call is ever sent: all of it is content, streamed or not
    ("hermes", "A < B and <tool but no call; <tool_cal"),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),
    ("hermes", '<tool_call>{"name": 5, "arguments": {}}</tool_call>'),
    ("hermes", "<tool_call>not json</tool_call>"),
    ("hermes", '<tool_call>{"na'),
    ("mistral", "prices in [TOOL brackets] stay"),
    ("mistral", "[TOOL_CALLS] nope"),
    ("mistral", "[TOOL_CALLS][]"),
    ("qwen3_coder", "a < b, <tool_call is not one; <function=x> neither; <tool_cal"),
    ("qwen3_coder", "<tool_call>\n<function=>\n</function>\n</tool_call>"),
    ("qwen3_coder", "<tool_call>\n<function=a\nb>\n</function>\n</tool_call>"),
    ("qwen3_coder", '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'),
    ("qwen3_coder", "<tool_call>\n<functi"),
    ("llama3", 'Sure: {"name": "now", "parameters": {}}'),  # text first
    ("llama3", "  <|python"),  # the start of the tag, then the end
    ("llama3", "<|python_tag|>import os"),
    ("llama3", '\n{"name": 5}'),
    ("llama3", '{"parameters": {}}'),
    ("llama3", "<{not the tag"),
    ("llama3", "\n\n"),
]
# A call whose name went out stays a call; what is not part of it is content.
BROKEN = [  # (fmt, text, [(name, arguments)], content)
    ("hermes", '<tool_call>{"name": "ls", "arguments": {"dir": "sr', [("ls", '{"dir": "sr')], ""),
    ("hermes", '<tool_call>{"name": "ls", "arguments": {}}</tool_call> and then more prose',
     [("ls", "{}")], " and then more prose"),
    ("hermes", '<tool_call>{"name": "a"}</tool_call>\n<tool_call>{"oops": 1}</tool_call>',
     [("a", "{}")], '\n<tool_call>{"oops": 1}</tool_call>'),
    ("hermes", '<tool_call>{"name": "ls" "arguments": {}}</tool_call>', [("ls", "")],
     '"arguments": {}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "q", "arguments": "{\\"a\\": ', [("q", "")], ""),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "argu',
     [("f", '{"a": 1}'), ("g", "")], ""),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
     [("get_weather", '{"city": "Par')], ""),  # cut off in a string: what arrived of it
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</para",
     [("get_weather", '{"city": "Paris\\n</para')], ""),  # the held tail too
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n"
                    "<parameter=days>\n3", [("get_weather", '{"city": "A"')], ""),  # typed: not sent
    ("qwen3_coder", "<tool_call>\n<function=now>\n</tool_call>", [("now", "")], "</tool_call>"),
    ("qwen3_coder", "<tool_call>\n<function=now>\n</function>\nhello",
     [("now", "{}")], "hello"),
    ("qwen3_coder", "<tool_call>\n<function=now>\n</function>\n</tool_call> and then more prose",
     [("now", "{}")], " and then more prose"),
    ("qwen3_coder", "<tool_call>\n<function=now>\n</function>\n</tool_call>\n<tool_call>oops",
     [("now", "{}")], "\n<tool_call>oops"),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=>\nx\n</parameter>",
     [("get_weather", "")], ">\nx\n</parameter>"),
    ("llama3", '{"name": "ls", "parameters": {"dir": "sr', [("ls", '{"dir": "sr')], ""),
    ("llama3", '{"name": "ls"} and then prose', [("ls", "{}")], " and then prose"),
    ("llama3", '{"name": "a"}; {"oops": 1}', [("a", "{}")], '; {"oops": 1}'),
    ("llama3", '{"name": "a"};', [("a", "{}")], ";"),
]


def _run(fmt: str, pieces: list[str], parallel: bool = True) -> tuple[str, list[dict[str, Any]]]:
    """Content sent and calls as a client assembles them, checking delta shapes."""
    ts = tool_stream(fmt, parallel, TYPES)  # type: ignore[arg-type]
    content, calls = "", []
    for out in [ts.push(p) for p in pieces] + [ts.finish()]:
        content += out[0]
        for d in out[1]:
            if "id" in d:  # a call's first delta
                assert d["index"] == len(calls) and d["type"] == "function"
                assert d["function"]["arguments"] == "" and d["function"]["name"]
                calls.append({"id": d["id"], "type": "function", "function": dict(d["function"])})
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                assert d["function"]["arguments"]
                calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    assert ts.called == bool(calls)
    return content, calls


def _splits(text: str) -> Iterator[list[str]]:
    yield [text]
    yield list(text)  # char by char
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]
    rng = random.Random(len(text))
    for _ in range(60):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(rng.randint(2, 12), len(text) - 1)))
        yield [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]


def _fn(calls: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("fmt,text", CLEAN)
def test_clean_calls_stream_as_the_whole_parse(fmt: str, text: str) -> None:
    whole = parse(text, fmt, TYPES)  # type: ignore[arg-type]
    assert whole.tool_calls
    for pieces in _splits(text):
        content, calls = _run(fmt, pieces)
        assert _fn(calls) == _fn(whole.tool_calls), pieces
        assert content.strip() == (whole.content or "")
        first, _ = _run(fmt, pieces, parallel=False)  # parallel_tool_calls: false
        assert first == content


def test_arguments_are_the_model_text() -> None:
    (call,) = parse(CLEAN[1][1], "hermes").tool_calls
    assert call["function"]["arguments"] == '{"a": "é \\u00e9"}'  # as written, escapes kept
    calls = parse(CLEAN[3][1], "hermes").tool_calls
    assert _fn(calls) == [("ls", "{}"), ("t", '{"k": true}'), ("n", "null")]
    assert _fn(parse(CLEAN[2][1], "hermes").tool_calls) == [("echo", '{"s": "</tool_call>"}')]
    assert _fn(parse(CLEAN[0][1], "hermes").tool_calls)[1] == ("grep", '{"q": "x"}')


@pytest.mark.parametrize("fmt,text,first,before", [
    (*CLEAN[4], ("get_weather", '{"city": "Paris"}'), "Sure."),
    (*CLEAN[6], ("get_weather", '{"city": "São \\"Paulo\\"\\n</param\\n<tool_call>\\n", "days": 3, '
                                '"opts": {"u": [1, "}"]}, "metric": true, "extra": "[1]"}'),
     "Both, then."),
    (*CLEAN[8], ("get_weather", '{"city": "Paris", "n": [1, {"x": "}; {"}]}'), ""),
])
def test_parallel_false_streams_the_first_call_only(fmt: str, text: str, first: tuple[str, str],
                                                    before: str) -> None:
    assert _fn(parse(text, fmt, TYPES).tool_calls)[0] == first  # type: ignore[arg-type]
    for pieces in _splits(text):
        content, calls = _run(fmt, pieces, parallel=False)
        assert _fn(calls) == [first] and content.strip() == before


def test_qwen3_coder_sends_the_name_then_string_text_as_it_arrives() -> None:
    ts = tool_stream("qwen3_coder", types=TYPES)
    assert ts.push("Hi <tool_call>\n<function=get_wea") == ("Hi ", [])  # the name is not whole
    (start,) = ts.push("ther>\n")[1]
    assert start["function"] == {"name": "get_weather", "arguments": ""} and start["index"] == 0
    assert ts.push("<parameter=city>\nPa")[1] == [{"index": 0, "function": {"arguments": '{"city": "Pa'}}]
    assert ts.push("ris\n")[1] == [{"index": 0, "function": {"arguments": "ris"}}]  # "\n" held
    assert ts.push("</param")[1] == []
    assert ts.push("eter>\n<parameter=days>\n1")[1] == [{"index": 0, "function": {"arguments": '"'}}]
    assert ts.push("2\n</parameter>\n</function>")[1] == [
        {"index": 0, "function": {"arguments": ', "days": 12}'}}]  # typed: key and value at once
    assert ts.push("\n</tool_call>") == ("", []) and ts.finish() == ("", [])
    assert ts.clean and ts.calls[0]["function"]["arguments"] == '{"city": "Paris", "days": 12}'


@pytest.mark.parametrize("fmt,text", PLAIN)
def test_no_call_sent_means_all_content(fmt: str, text: str) -> None:
    assert parse(text, fmt).content == text  # type: ignore[arg-type]
    for pieces in _splits(text):
        assert _run(fmt, pieces) == (text, []), pieces


@pytest.mark.parametrize("fmt,text,want,content", BROKEN)
def test_a_sent_call_is_finished_with_what_parsed(fmt: str, text: str,
                                                  want: list[tuple[str, str]], content: str) -> None:
    whole = parse(text, fmt, TYPES)  # type: ignore[arg-type]
    assert whole.tool_calls == [] and whole.content == text  # not streamed: all content
    for pieces in _splits(text):
        got, calls = _run(fmt, pieces)
        assert (_fn(calls), got) == (want, content), pieces


# ----------------------------------------------------------------- end to end

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "now"}}]
SCRIPT = ['Sure', '. [TOOL', '_CALLS][{"na', 'me": "get_', 'weather", "arg', 'uments": {"ci',
          'ty": "Pa', 'ris", "days": [1,', ' 2]}}, {"name"', ': "now"}]']


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from ftserve.models.checkpoint import write_checkpoint
    from tests.server_harness import TEST_ENGINE, start_live, stop_live

    ckpt = write_checkpoint("tiny-moe", tmp_path_factory.mktemp("tools") / "m", layers=1, seed=0)
    server = start_live(dataclasses.replace(TEST_ENGINE, model=str(ckpt)))
    try:
        yield server
    finally:
        stop_live(server)


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each generation's step texts become SCRIPT's pieces (the rest on its last step)."""
    from tests.server_harness import script_generations

    script_generations(monkeypatch, SCRIPT)


def test_openai_client_assembles_streamed_calls(live: Any, scripted: None) -> None:
    assert live.text.tool_format() == "mistral"
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    req: dict[str, Any] = {"model": "ftserve-demo", "tools": TOOLS, "max_tokens": len(SCRIPT),
                           "messages": [{"role": "user", "content": "Weather?"}],
                           "temperature": 0, "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(**req)
    want = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert want == [("get_weather", '{"city": "Paris", "days": [1, 2]}'), ("now", "{}")]
    assert whole.choices[0].finish_reason == "tool_calls"
    chunks = list(client.chat.completions.create(**req, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert len(deltas) > 4 and deltas[0].function.arguments == "" and deltas[0].id
    with client.chat.completions.stream(**req) as stream:  # the client's own assembly
        for _ in stream:
            pass
        final = stream.get_final_completion()
    (choice,) = final.choices
    assert choice.finish_reason == "tool_calls" and (choice.message.content or "").strip() == "Sure."
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == want
    assert len({c.id for c in choice.message.tool_calls}) == 2
    with client.chat.completions.stream(**req, parallel_tool_calls=False) as stream:
        for _ in stream:
            pass
        one = stream.get_final_completion().choices[0]
    assert [c.function.name for c in one.message.tool_calls] == ["get_weather"]
    assert one.finish_reason == "tool_calls"
    live.wait_idle()
