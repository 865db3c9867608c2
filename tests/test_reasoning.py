"""Reasoning split (chat/reasoning.py) and chat_template_kwargs: the parser on
its own (whole and streamed at every split point), then end to end through a
real server whose model has a Qwen3-style thinking template, with the openai
client."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from ftserve.chat.reasoning import CLOSE, OPEN, ReasoningStream, opens_in_prompt, split, supported

CASES = [  # (output, opened by the prompt, reasoning, content)
    ("<think>\nplan it\n</think>\n\nThe answer.", False, "\nplan it\n", "The answer."),
    ("  \n<think>a</think>b", False, "a", "b"),
    ("plan it\n</think>\n\nThe answer.", True, "plan it\n", "The answer."),
    ("The answer, no thinking.", False, None, "The answer, no thinking."),
    ("<thesis> is not a tag", False, None, "<thesis> is not a tag"),
    ("<", False, None, "<"),
    ("cut off while still thinking </thi", True, "cut off while still thinking </thi", ""),
    ("<think>never closed", False, "never closed", ""),
    ("<think></think>", False, "", ""),
    ("a</think>\n\n<tool_call>{}</tool_call>", True, "a", "<tool_call>{}</tool_call>"),
    ("x </think> y </think> z", True, "x ", " y </think> z"),  # the first close counts; newlines drop
]


@pytest.mark.parametrize("text,opened,thought,content", CASES)
def test_split(text: str, opened: bool, thought: str | None, content: str) -> None:
    assert split(text, opened) == (thought, content)


@pytest.mark.parametrize("text,opened,thought,content", CASES)
def test_stream_equals_split_at_every_cut(text: str, opened: bool, thought: str | None,
                                          content: str) -> None:
    for cut in range(len(text) + 1):
        for second in range(cut, len(text) + 1):
            st = ReasoningStream(opened)
            parts = [st.push(text[:cut]), st.push(text[cut:second]), st.push(text[second:]), st.finish()]
            got_r = "".join(p[0] for p in parts)
            got_c = "".join(p[1] for p in parts)
            assert (got_r if st.reasoned else None, got_c) == (thought, content), (cut, second)


def test_stream_counts_the_tokens_of_the_reasoning() -> None:
    """Tokens count as reasoning while the block is open and in the push that
    closes it (the tags' tokens with it); held whitespace before a block that
    never opens, and everything after the close, do not."""
    st = ReasoningStream(False)
    for piece in ("<think>", "\nplan", " it", "\n</think>", "\n\n", "The", " answer."):
        st.push(piece, 1)
    assert st.tokens == 4
    st = ReasoningStream(True)  # the prompt opened it
    for piece in ("plan", "</th", "ink>", "\n", "done"):
        st.push(piece, 1)
    assert st.tokens == 3
    st = ReasoningStream(False)
    for piece in (" ", "The", " answer"):  # no block at all
        st.push(piece, 1)
    assert st.tokens == 0 and not st.reasoned
    st = ReasoningStream(False)
    st.push("<think>a</think>b", 5)  # one push that opens, closes and goes on
    st.push(" c", 1)
    assert st.tokens == 5
    st = ReasoningStream(True)
    st.push("cut off while", 2)
    st.push("", 1)  # a token the detokenizer still holds: inside the block
    assert st.tokens == 3


def test_stream_sends_plain_content_at_once() -> None:
    st = ReasoningStream(False)
    assert st.push("<th") == ("", "")  # could still open reasoning
    assert st.push("e answer") == ("", "<the answer")
    assert st.push(" goes on") == ("", " goes on")
    st = ReasoningStream(True)
    assert st.push("step one </") == ("step one ", "")  # "</" may start the close tag
    assert st.push("b> two") == ("</b> two", "")


def test_prompt_side_and_template_detection() -> None:
    assert opens_in_prompt("<|im_start|>assistant\n<think>\n")
    assert not opens_in_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_in_prompt("<|im_start|>assistant\n")
    assert not opens_in_prompt("user said <think> ... </think> earlier\nassistant\n")
    assert supported(f"{{{{ '{OPEN}' }}}} ... {CLOSE}") and not supported("[INST] {{ m }} [/INST]")


# ----------------------------------------------------------------- end to end

# Qwen3-style (written for this test): an earlier turn's reasoning_content is
# shown, the generation prompt opens <think> unless enable_thinking is false.
THINKING_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.role == 'assistant' and m.reasoning_content -%}"
    "{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- endif -%}"
    "{{ m.content + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else -%}{{ '<think>\\n' }}{%- endif -%}"
    "{%- endif -%}"
)
MSGS = [{"role": "user", "content": "Think about the number seven."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from ftserve.models.checkpoint import write_checkpoint

    ckpt = write_checkpoint("tiny-moe", tmp_path_factory.mktemp("think") / "m", layers=1, seed=0)
    (Path(ckpt) / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return str(ckpt)


@pytest.fixture(scope="module")
def live(model_dir: str) -> Iterator[Any]:
    from tests.server_harness import TEST_ENGINE, start_live, stop_live

    server = start_live(dataclasses.replace(TEST_ENGINE, model=model_dir))
    try:
        yield server
    finally:
        stop_live(server)


@pytest.fixture(scope="module")
def client(live: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _post(live: Any, path: str, body: Any) -> tuple[int, Any]:
    async def go() -> tuple[int, Any]:
        async with aiohttp.ClientSession() as s, s.post(live.url + path, json=body) as r:
            return r.status, await r.json()

    return live.call(go())


def _raw_completion(live: Any, client: openai.OpenAI, **chat: Any) -> str:
    """What the model writes after the chat prompt, through /v1/completions on
    the same token ids (greedy): the text the reasoning split must account for."""
    status, tok = _post(live, "/tokenize", {"messages": MSGS, **chat})
    assert status == 200, tok
    out = client.completions.create(model="ftserve-demo", prompt=tok["tokens"], max_tokens=10,
                                    temperature=0)
    return out.choices[0].text


def test_reasoning_content_when_the_prompt_opens_thinking(live: Any, client: openai.OpenAI) -> None:
    assert live.text.marks_reasoning()
    raw = _raw_completion(live, client)
    assert raw and CLOSE not in raw  # random weights never close it: all of it is reasoning
    r = client.chat.completions.create(model="ftserve-demo", messages=MSGS, max_tokens=10, temperature=0)
    msg = r.choices[0].message
    assert msg.model_extra.get("reasoning_content") == raw and msg.content is None
    # Every output token is reasoning (the block never closes): usage says so.
    assert r.usage.completion_tokens == 10
    assert r.usage.completion_tokens_details.reasoning_tokens == 10
    stream = client.chat.completions.create(model="ftserve-demo", messages=MSGS, max_tokens=10,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    thought, content, usage = [], [], None
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            thought.append((delta.model_extra or {}).get("reasoning_content") or "")
            content.append(delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(thought) == raw and "".join(content) == ""
    assert usage is not None and usage.completion_tokens_details.reasoning_tokens == 10
    resp = client.responses.create(model="ftserve-demo", input=MSGS[0]["content"], max_output_tokens=10,
                                   temperature=0)
    assert resp.usage.output_tokens_details.reasoning_tokens == resp.usage.output_tokens == 10


def test_each_step_is_split_once(live: Any, client: openai.OpenAI,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The reasoning split runs once per step of a choice, streamed and whole: the
    stream driver's output split both splits it and counts its reasoning tokens."""
    from ftserve.api.generation import Generation
    from ftserve.chat.reasoning import ReasoningStream

    steps, pushes = [0], [0]
    real_next, real_push = Generation.next, ReasoningStream.push

    async def next_(self: Generation, timeout: float | None = None) -> Any:
        step = await real_next(self, timeout)
        steps[0] += step is not None
        return step

    def push(self: ReasoningStream, delta: str, num_tokens: int = 0) -> tuple[str, str]:
        pushes[0] += 1
        return real_push(self, delta, num_tokens)

    monkeypatch.setattr(Generation, "next", next_)
    monkeypatch.setattr(ReasoningStream, "push", push)
    for stream in (False, True):
        steps[0] = pushes[0] = 0
        r = client.chat.completions.create(model="ftserve-demo", messages=MSGS, max_tokens=6,
                                           temperature=0, stream=stream)
        if stream:
            list(r)  # type: ignore[arg-type]
        assert steps[0] >= 2 and pushes[0] == steps[0], (stream, steps, pushes)
    live.wait_idle()


def test_chat_template_kwargs_turn_thinking_off(live: Any, client: openai.OpenAI) -> None:
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    raw = _raw_completion(live, client, **kwargs)
    r = client.chat.completions.create(model="ftserve-demo", messages=MSGS, max_tokens=10,
                                       temperature=0, extra_body=kwargs)
    msg = r.choices[0].message
    assert msg.content == raw and (msg.model_extra or {}).get("reasoning_content") is None
    assert r.usage.completion_tokens_details.reasoning_tokens == 0  # the template marks it; none here
    # The two prompts differ by the empty think block the kwarg renders.
    _, on = _post(live, "/tokenize", {"messages": MSGS})
    _, off = _post(live, "/tokenize", {"messages": MSGS, **kwargs})
    assert off["count"] > on["count"]


def test_earlier_reasoning_reaches_the_template(live: Any) -> None:
    turn = [*MSGS, {"role": "assistant", "content": "Seven.", "reasoning_content": "It is prime."},
            {"role": "user", "content": "And eight?"}]
    prompt = live.text.render_chat(turn, True)
    assert "<think>\nIt is prime.\n</think>\n\nSeven.<|im_end|>" in prompt


@pytest.mark.parametrize("body,param", [
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"not a name": 1}}, "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "x", "reasoning_content": "y"}]}, "messages[0]"),
    ({"messages": [{"role": "assistant", "content": "x", "reasoning_content": 3}]}, "messages[0]"),
])
def test_bad_reasoning_fields_are_400(live: Any, body: dict[str, Any], param: str) -> None:
    status, err = _post(live, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, **body})
    assert status == 400 and err["error"]["param"] == param, err


def test_reasoning_parser_none_keeps_it_in_the_content(model_dir: str, live: Any,
                                                       client: openai.OpenAI) -> None:
    from tests.server_harness import TEST_ENGINE, TEST_SERVER, start_live, stop_live

    raw = _raw_completion(live, client)
    plain = start_live(dataclasses.replace(TEST_ENGINE, model=model_dir),
                       dataclasses.replace(TEST_SERVER, reasoning_parser="none"))
    try:
        other = openai.OpenAI(base_url=plain.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = other.chat.completions.create(model="ftserve-demo", messages=MSGS, max_tokens=10, temperature=0)
        msg = r.choices[0].message
        assert msg.content == raw and (msg.model_extra or {}).get("reasoning_content") is None
    finally:
        stop_live(plain)


def test_reasoning_parser_flag_is_checked() -> None:
    from ftserve.cli import build_parser, configs_from_args
    from ftserve.config import ConfigError

    args = build_parser().parse_args(["serve", "--reasoning-parser", "none"])
    assert configs_from_args(args)[1].reasoning_parser == "none"
    with pytest.raises(ConfigError, match="--reasoning-parser"):
        configs_from_args(build_parser().parse_args(["serve", "--reasoning-parser", "qwen9"]))
