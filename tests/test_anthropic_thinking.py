"""Anthropic thinking blocks (/v1/messages; ftserve/api/anthropic/messages.py) on a
real server whose tiny model has a Qwen3-style thinking template, read with the
official ``anthropic`` client; the reasoning is scripted."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server_harness import TEST_ENGINE, Live, start_live, stop_live
from tests.test_anthropic_api import (
    GREEDY,
    MODEL,
    USER,
    _blocks,
    _client,
    _same,
    _streamed,
    _tokenize,
)
from tests.test_reasoning import THINKING_TEMPLATE
from tests.test_tool_choice import script as script  # the scripted-generations fixture


@pytest.fixture(scope="module")
def think_live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    from ftserve.models.checkpoint import write_checkpoint

    ckpt = write_checkpoint("tiny-moe", tmp_path_factory.mktemp("think") / "m", layers=1, seed=0)
    (Path(ckpt) / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    server = start_live(dataclasses.replace(TEST_ENGINE, model=str(ckpt)))
    try:
        yield server
    finally:
        stop_live(server)


def test_thinking_blocks(think_live: Live, script: list[str]) -> None:
    client = _client(think_live)
    assert think_live.text.marks_reasoning() and think_live.text.template_reads("enable_thinking")
    script[:] = ["plan it", "\n</think>", "\n\nThe answer."]
    req = {"model": MODEL, "max_tokens": len(script), "messages": USER,
           "thinking": {"type": "enabled", "budget_tokens": 1024},
           "extra_body": {**GREEDY, "ignore_eos": True}}
    whole = client.messages.create(**req)
    assert _blocks(whole) == [("thinking", "plan it\n", ""), ("text", "The answer.")]
    streamed, events = _streamed(client, **req)
    _same(whole, streamed)
    assert [e.thinking for e in events if e.type == "thinking"] == ["plan it", "\n"]


def test_thinking_disabled_and_earlier_thinking(think_live: Live, script: list[str]) -> None:
    client = _client(think_live)
    on = client.messages.count_tokens(model=MODEL, messages=USER,
                                      thinking={"type": "enabled", "budget_tokens": 1024})
    off = client.messages.count_tokens(model=MODEL, messages=USER, thinking={"type": "disabled"})
    assert off.input_tokens == _tokenize(think_live, {
        "messages": USER, "chat_template_kwargs": {"enable_thinking": False}})
    assert off.input_tokens > on.input_tokens  # the empty think block the template renders
    script[:] = ["plain ", "answer"]
    reply = client.messages.create(model=MODEL, max_tokens=2, messages=USER,
                                   thinking={"type": "disabled"},
                                   extra_body={**GREEDY, "ignore_eos": True})
    assert _blocks(reply) == [("text", "plain answer")]
    # An earlier turn's thinking block is that turn's reasoning_content.
    turn = [*USER, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "It is warm.", "signature": ""},
        {"type": "text", "text": "Sunny."}]}, {"role": "user", "content": "And Rome?"}]
    twin = [*USER, {"role": "assistant", "content": "Sunny.", "reasoning_content": "It is warm."},
            {"role": "user", "content": "And Rome?"}]
    got = client.messages.count_tokens(model=MODEL, messages=turn).input_tokens
    assert got == _tokenize(think_live, {"messages": twin})
    assert got > _tokenize(think_live, {"messages": [*USER, {"role": "assistant", "content": "Sunny."},
                                                    {"role": "user", "content": "And Rome?"}]})
    think_live.wait_idle()
