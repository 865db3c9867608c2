"""A hybrid model (tiny Qwen3-Next, dummy weights) behind the real server, driven
over HTTP by the official client as an agentic client drives it: every turn
resends the whole conversation. Each turn resumes from the state checkpoint at
the end of the previous turn's prompt (usage.cached_tokens within a page of
it), and a turn's greedy tokens equal those of the same turn with the prefix
cache flushed (a full prefill). Behind a Qwen3-style template (hermes tool calls,
a <think> block opened by the prompt): reasoning comes back as reasoning_content,
a forced tool call is well-formed (the grammar's masks on the hybrid's steps), and
the turn carrying its result resumes from the checkpoint saved before that
prompt's generation prompt (which the next turn does not resend), with a full
prefill's tokens."""

from __future__ import annotations

import dataclasses
import json
import random
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server_harness import (
    TEST_ENGINE,
    TEST_SERVER,
    Live,
    openai_client,
    start_live,
    stop_live,
)

PAGE = TEST_ENGINE.page_size


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    from ftserve.models.checkpoint import write_checkpoint

    ckpt = write_checkpoint("tiny-qwen3-next", tmp_path_factory.mktemp("qwen3-next") / "m", config_only=True)
    server = start_live(dataclasses.replace(TEST_ENGINE, model=str(ckpt), load_format="dummy"))
    yield server
    stop_live(server)


@pytest.fixture(scope="module")
def qwen3_live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    from ftserve.models.checkpoint import write_checkpoint

    ckpt = write_checkpoint("tiny-qwen3-next", tmp_path_factory.mktemp("qwen3-next-t") / "m", config_only=True)
    template = Path(__file__).parent / "templates" / "hermes_think.jinja"
    server = start_live(dataclasses.replace(TEST_ENGINE, model=str(ckpt), load_format="dummy"),
                        dataclasses.replace(TEST_SERVER, chat_template=str(template)))
    assert server.text.tool_format() == "hermes" and server.text.marks_reasoning()
    yield server
    stop_live(server)


def _reset_prefix_cache(live: Live) -> None:
    live.wait_idle()
    req = urllib.request.Request(live.url + "/reset_prefix_cache", data=b"{}", method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200


def _turn(client: Any, messages: list[dict[str, str]]) -> tuple[str, list[int], Any]:
    r = client.chat.completions.create(
        model="ftserve-demo", messages=messages, max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    return r.choices[0].message.content or "", r.choices[0].token_ids, r.usage


def test_agentic_turns_resume_at_the_previous_prompts_end(live: Live) -> None:
    assert live.engine.scheduler.state_pool is not None, "a hybrid model, with its state pool"
    client = openai_client(live)
    words = "read write file path tool call result error test patch the a of and to in".split()
    rng = random.Random(3)

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    messages = [{"role": "system", "content": "You are a coding agent. " + text(60)},
                {"role": "user", "content": text(30)}]
    prev_prompt = 0
    for turn in range(4):
        content, ids, usage = _turn(client, messages)
        cached = usage.prompt_tokens_details.cached_tokens
        assert len(ids) == 8
        if turn == 0:
            assert cached == 0
        else:
            # The checkpoint at the previous prompt's last page boundary before its
            # final token: within one page of where that prompt ended.
            assert prev_prompt - PAGE <= cached < prev_prompt, (turn, cached, prev_prompt)
        prev_prompt = usage.prompt_tokens
        messages += [{"role": "assistant", "content": content}, {"role": "user", "content": text(20)}]
    live.wait_idle()
    # The last turn again from a flushed cache: a full prefill, the same tokens.
    messages = messages[:-2]
    _, hit_ids, hit_usage = _turn(client, messages)
    assert hit_usage.prompt_tokens_details.cached_tokens > 0
    _reset_prefix_cache(live)
    _, cold_ids, cold_usage = _turn(client, messages)
    assert cold_usage.prompt_tokens_details.cached_tokens == 0
    assert cold_ids == hit_ids
    live.wait_idle()
    with urllib.request.urlopen(live.url + "/metrics", timeout=30) as resp:
        metrics = dict(line.rsplit(" ", 1) for line in resp.read().decode().splitlines()
                       if line.startswith("ftserve_state_"))
    assert float(metrics["ftserve_state_checkpoints_saved_total"]) >= 5
    assert float(metrics["ftserve_state_checkpoints_cached"]) == live.engine.scheduler.radix.cached_states > 0
    assert float(metrics["ftserve_state_checkpoints_skipped_total"]) == 0


WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 14}},
    "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


def test_reasoning_and_tools_through_the_qwen3_template(qwen3_live: Live) -> None:
    import jsonschema

    live, client = qwen3_live, openai_client(qwen3_live)
    assert live.text.generation_prompt({}) == "<|im_start|>assistant\n<think>\n"
    assert live.text.generation_prompt({"enable_thinking": False}).endswith("</think>\n\n")
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a weather agent. " + "Answer briefly. " * 12},
        {"role": "user", "content": "Weather in Paris for three days?"}]
    # The prompt opens <think>; random weights never close it: all of it is reasoning.
    r = client.chat.completions.create(model="ftserve-demo", messages=messages, max_tokens=10,
                                       temperature=0, extra_body={"ignore_eos": True})
    msg = r.choices[0].message
    thought = (msg.model_extra or {}).get("reasoning_content")
    assert thought and msg.content is None
    assert r.usage.completion_tokens_details.reasoning_tokens == r.usage.completion_tokens == 10
    streamed = []
    for chunk in client.chat.completions.create(model="ftserve-demo", messages=messages, max_tokens=10,
                                                temperature=0, extra_body={"ignore_eos": True},
                                                stream=True):
        if chunk.choices:
            assert not chunk.choices[0].delta.content
            streamed.append((chunk.choices[0].delta.model_extra or {}).get("reasoning_content") or "")
    assert "".join(streamed) == thought
    # A forced call: the grammar masks every step of the hybrid's decode.
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model="ftserve-demo", messages=messages, tools=TOOLS,
                                       tool_choice=named, max_tokens=64, temperature=0)
    (call,) = r.choices[0].message.tool_calls or []
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    # The next turn carries the call and its result; it resumes from a checkpoint of
    # the conversation so far and answers as a full prefill does.
    messages += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": call.id, "type": "function",
                      "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                 {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny", "high": 24}'}]
    turn = dict(model="ftserve-demo", messages=messages, tools=TOOLS, max_tokens=8, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True})
    live.wait_idle()
    hit = client.chat.completions.create(**turn)
    # The reply stands where the generation prompt (<|im_start|>assistant\n<think>\n) and
    # the forced call's start stood: the turn resumes before them (the checkpoint the
    # server asked for with unsent_tail), within a page more of the previous prompt's end.
    tail = 56  # those two (~35 tokens in this tokenizer), a token of margin and a page
    cached = hit.usage.prompt_tokens_details.cached_tokens
    assert r.usage.prompt_tokens - tail <= cached < r.usage.prompt_tokens, (cached, r.usage.prompt_tokens)
    _reset_prefix_cache(live)
    cold = client.chat.completions.create(**turn)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert cold.choices[0].token_ids == hit.choices[0].token_ids  # type: ignore[attr-defined]
    live.wait_idle()
