"""A hybrid model (tiny Qwen3-Next, dummy weights) behind the real server, driven
over HTTP by the official client as an agentic client drives it: every turn
resends the whole conversation. Each turn resumes from the state checkpoint at
the end of the previous turn's prompt (usage.cached_tokens within a page of
it), and a turn's greedy tokens equal those of the same turn with the prefix
cache flushed (a full prefill)."""

from __future__ import annotations

import dataclasses
import random
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.server_harness import TEST_ENGINE, Live, openai_client, start_live, stop_live

PAGE = TEST_ENGINE.page_size


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    from ftserve.models.checkpoint import write_checkpoint

    ckpt = write_checkpoint("tiny-qwen3-next", tmp_path_factory.mktemp("qwen3-next") / "m", config_only=True)
    server = start_live(dataclasses.replace(TEST_ENGINE, model=str(ckpt), load_format="dummy"))
    yield server
    stop_live(server)


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
    live.wait_idle()
    req = urllib.request.Request(live.url + "/reset_prefix_cache", data=b"{}", method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200
    _, cold_ids, cold_usage = _turn(client, messages)
    assert cold_usage.prompt_tokens_details.cached_tokens == 0
    assert cold_ids == hit_ids
    live.wait_idle()
