"""Speculative decoding on the real small model (SmolLM2-135M-Instruct) over HTTP:
a server with --speculative ngram answers token for token as the one without
(greedy, seeded sampling, logprobs, stop strings, chat), while drafts copied
from the prompt are really kept, and /metrics counts them."""

from __future__ import annotations

import dataclasses
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.real_model import REAL_ENGINE, SMOLLM2
from tests.server_harness import TEST_SERVER, Live, start_live, stop_live

CODE = '''def area(shape, size):
    if shape == "square":
        return size * size
    if shape == "circle":
        return 3.14159 * size * size
    raise ValueError(f"unknown shape {shape}")


def perimeter(shape, size):
    if shape == "square":
        return 4 * size
    if shape == "circle":
        return 2 * 3.14159 * size
    raise ValueError(f"unknown shape {shape}")
'''
# A raw prompt in the model's chat format whose answer copies the code.
COPY = (f"<|im_start|>user\nCopy this code exactly, renaming `size` to `length`:\n```python\n{CODE}```"
        "<|im_end|>\n<|im_start|>assistant\n```python\n")


@pytest.fixture(scope="module")
def spec_live(smollm2_path: Path) -> Iterator[Live]:
    live = start_live(dataclasses.replace(REAL_ENGINE, model=str(smollm2_path), speculative="ngram",
                                          num_speculative_tokens=5, speculative_gate=False),
                      dataclasses.replace(TEST_SERVER, served_model_name=SMOLLM2), attention_gain=None)
    try:
        yield live
    finally:
        stop_live(live)


def _client(live: Live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=300)


def _both(plain: Live, spec: Live, **kw: Any) -> tuple[Any, Any]:
    a = _client(plain).completions.create(model=SMOLLM2, **kw)
    b = _client(spec).completions.create(model=SMOLLM2, **kw)
    return a.choices[0], b.choices[0]


def _metrics(live: Live) -> dict[str, float]:
    with urllib.request.urlopen(live.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("ftserve_spec_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_copying_greedy_same_tokens_and_drafts_kept(smollm2_live: Live, spec_live: Live) -> None:
    before = _metrics(spec_live)
    a, b = _both(smollm2_live, spec_live, prompt=COPY, max_tokens=90, temperature=0,
                 extra_body={"return_token_ids": True})
    assert b.model_extra["token_ids"] == a.model_extra["token_ids"]
    assert b.text == a.text and "3.14159" in a.text and b.finish_reason == a.finish_reason
    m = _metrics(spec_live)
    proposed = m["ftserve_spec_proposed_tokens_total"] - before.get("ftserve_spec_proposed_tokens_total", 0)
    accepted = m["ftserve_spec_accepted_tokens_total"] - before.get("ftserve_spec_accepted_tokens_total", 0)
    # Most of the answer is copied: most output tokens came as kept draft tokens.
    assert accepted > 40 and accepted <= proposed, (accepted, proposed)
    assert m['ftserve_spec_accept_length_bucket{le="5.0"}'] == m["ftserve_spec_accept_length_count"] > 0
    assert m["ftserve_spec_accept_length_sum"] == m["ftserve_spec_accepted_tokens_total"]


def test_sampled_logprobs_and_stop_strings_as_without(smollm2_live: Live, spec_live: Live) -> None:
    a, b = _both(smollm2_live, spec_live, prompt=COPY, max_tokens=60, temperature=0.7, seed=5,
                 logprobs=2, extra_body={"return_token_ids": True})
    assert b.model_extra["token_ids"] == a.model_extra["token_ids"]
    assert b.logprobs.tokens == a.logprobs.tokens
    for x, y in zip(a.logprobs.token_logprobs, b.logprobs.token_logprobs):
        assert y == pytest.approx(x, abs=1e-3)
    a, b = _both(smollm2_live, spec_live, prompt=COPY, max_tokens=90, temperature=0,
                 stop=["circle"])
    assert b.text == a.text and a.finish_reason == b.finish_reason == "stop"


def test_chat_edit_same_reply(smollm2_live: Live, spec_live: Live) -> None:
    msgs = [{"role": "system", "content": "Reply with the complete edited file, nothing else."},
            {"role": "user", "content": f"Rename `shape` to `kind` in this file:\n```python\n{CODE}```"}]
    replies = [_client(live).chat.completions.create(model=SMOLLM2, messages=msgs, max_tokens=40,
                                                     temperature=0)
               for live in (smollm2_live, spec_live)]
    assert replies[1].choices[0].message.content == replies[0].choices[0].message.content
    assert replies[1].usage.completion_tokens == replies[0].usage.completion_tokens
    spec_live.wait_idle()
