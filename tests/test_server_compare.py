"""OpenAI compatibility where two runs are compared (streamed vs whole, n choices vs
single requests, seeded sampling, stop ids and strings): the official client against
the real small model (tests/real_model.py).

With random demo weights these needed an empty prefix cache before every run
(a cache hit changes the prefill shapes and near-tied logits then flip a greedy
token); real weights give the same tokens with the cache as it is.
"""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import orjson
import pytest

from tests.real_model import SMOLLM2
from tests.server_harness import Live
from tests.test_server import _post, _sse_events

MSGS = [{"role": "user", "content": "Tell me a story about a dragon."}]


@pytest.fixture(scope="module")
def live(smollm2_live: Live) -> Live:
    return smollm2_live


def test_chat_stream_wire_format(live: Live) -> None:
    body = {"model": SMOLLM2, "messages": MSGS, "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    frames = asyncio.run(_sse_events(live.url + "/v1/chat/completions", body))
    assert frames[-1] == b"data: [DONE]"
    events = [orjson.loads(f[6:]) for f in frames[:-1] if f.startswith(b"data: ")]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    usage_ev = events[-1]
    assert usage_ev["choices"] == [] and usage_ev["usage"]["completion_tokens"] == 5
    assert "cached_tokens" in usage_ev["usage"]["prompt_tokens_details"]
    finish = events[-2]["choices"][0]
    assert finish["finish_reason"] == "length" and finish["delta"] == {}
    middle = events[1:-2]
    assert all(e["choices"][0]["finish_reason"] is None for e in middle)
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == events[0]["id"]
               for e in events)
    # Streamed text equals the non-streamed text of the same greedy request.
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in middle)
    body.pop("stream"), body.pop("stream_options")
    status, full = _post(live, "/v1/chat/completions", body)
    assert status == 200 and full["choices"][0]["message"]["content"] == streamed


def test_completions_streaming(live: Live, client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=SMOLLM2, prompt="Once upon a time", max_tokens=6,
                              temperature=0, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            logprobs=1, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-2].choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in chunks[:-1])
    offsets = [o for c in chunks[:-2] for o in c.choices[0].logprobs.text_offset]
    assert offsets == sorted(offsets) and len(offsets) == 6
    assert client.completions.create(**kw).choices[0].text == streamed


def test_seed_reproducible_and_sampling_fields(live: Live, client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=SMOLLM2, messages=MSGS, max_tokens=8, temperature=1.0,
                              top_p=0.9, seed=1234, presence_penalty=0.5,
                              frequency_penalty=0.3,
                              extra_body={"top_k": 50, "min_p": 0.01, "ignore_eos": True,
                                          "repetition_penalty": 1.1, "return_token_ids": True})
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert a.choices[0].model_extra["token_ids"] == b.choices[0].model_extra["token_ids"]


def test_n_choices_non_streaming(live: Live, client: openai.OpenAI) -> None:
    """n > 1: one engine request per choice; a seed gives choice i seed + i, so the
    choices differ and the whole response is reproducible; the prompt is counted once."""
    msgs = [{"role": "user", "content": "Tell me about " + "a knight and a dragon, " * 8}]
    kw: dict[str, Any] = dict(model=SMOLLM2, messages=msgs, max_tokens=6, temperature=1.0,
                              seed=99, n=3, extra_body={"ignore_eos": True, "return_token_ids": True})
    a = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and c.message.role == "assistant" for c in a.choices)
    ids = [c.model_extra["token_ids"] for c in a.choices]
    assert all(len(t) == 6 for t in ids) and len({tuple(t) for t in ids}) > 1
    assert a.usage.completion_tokens == 18
    # From a cold cache, choices 1 and 2 start once choice 0 has prefilled and reuse
    # its full prompt pages (16 tokens each; the last prompt token is always computed).
    full_pages = (a.usage.prompt_tokens - 1) // 16 * 16
    assert full_pages > 0 and a.usage.prompt_tokens_details.cached_tokens == full_pages
    single = client.chat.completions.create(model=SMOLLM2, messages=msgs, max_tokens=1)
    assert a.usage.prompt_tokens == single.usage.prompt_tokens
    b = client.chat.completions.create(**kw)
    assert [c.model_extra["token_ids"] for c in b.choices] == ids
    # Choice 0 of n is the single request with the same seed.
    one = client.chat.completions.create(**{**kw, "n": 1})
    assert one.choices[0].model_extra["token_ids"] == ids[0]
    # Greedy choices are the same tokens; completions take n as well.
    g = client.completions.create(model=SMOLLM2, prompt="Once upon a time", max_tokens=5,
                                  temperature=0, n=2, extra_body={"ignore_eos": True})
    assert [c.index for c in g.choices] == [0, 1] and g.choices[0].text == g.choices[1].text
    assert g.usage.completion_tokens == 10
    live.wait_idle()


def test_n_choices_streaming(live: Live) -> None:
    body = {"model": SMOLLM2, "messages": MSGS, "max_tokens": 5, "temperature": 1.0, "seed": 7,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "n": 2}
    frames = asyncio.run(_sse_events(live.url + "/v1/chat/completions", body))
    assert frames[-1] == b"data: [DONE]"
    events = [orjson.loads(f[6:]) for f in frames[:-1] if f.startswith(b"data: ")]
    assert [e["choices"][0]["index"] for e in events[:2]] == [0, 1]  # a role chunk each
    assert all(e["choices"][0]["delta"] == {"role": "assistant", "content": ""} for e in events[:2])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 10
    texts, reasons = ["", ""], [None, None]
    for e in events[2:-1]:
        (c,) = e["choices"]
        assert reasons[c["index"]] is None, "nothing after a choice's finish chunk"
        texts[c["index"]] += c["delta"].get("content", "")
        reasons[c["index"]] = c["finish_reason"]
    assert reasons == ["length", "length"]
    # Each choice's stream equals the same choice of the non-streamed response.
    body.pop("stream"), body.pop("stream_options")
    status, full = _post(live, "/v1/chat/completions", body)
    assert status == 200 and [c["message"]["content"] for c in full["choices"]] == texts
    live.wait_idle()


def test_stop_token_ids_and_min_tokens(live: Live) -> None:
    base = {"messages": MSGS, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    _, ref = _post(live, "/v1/chat/completions", base)
    ids = ref["choices"][0]["token_ids"]
    stop_id = ids[3]
    _, r = _post(live, "/v1/chat/completions", {**base, "stop_token_ids": [stop_id]})
    got = r["choices"][0]["token_ids"]
    assert r["choices"][0]["finish_reason"] == "stop"
    assert got[-1] == stop_id and len(got) == ids.index(stop_id) + 1
    # min_tokens masks stop ids until that many tokens exist.
    k = ids.index(stop_id) + 2
    _, r = _post(live, "/v1/chat/completions",
                 {**base, "stop_token_ids": [stop_id], "min_tokens": k})
    got = r["choices"][0]["token_ids"]
    assert len(got) >= k and stop_id not in got[:k]


def test_stop_string_trims_and_aborts(live: Live) -> None:
    base = {"messages": MSGS, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    _, ref = _post(live, "/v1/chat/completions", base)
    text = ref["choices"][0]["message"]["content"]
    stripped = text.strip()
    assert len(stripped) >= 6, f"demo output too short to test stop strings: {text!r}"
    stop = stripped[len(stripped) // 2: len(stripped) // 2 + 2]
    cut = text.index(stop)
    for stream in (False, True):
        if stream:
            frames = asyncio.run(_sse_events(live.url + "/v1/chat/completions",
                                             {**base, "stop": [stop], "stream": True}))
            evs = [orjson.loads(f[6:]) for f in frames[:-1] if f.startswith(b"data: ")]
            got = "".join(e["choices"][0]["delta"].get("content", "") for e in evs)
            reason = evs[-1]["choices"][0]["finish_reason"]
        else:
            _, r = _post(live, "/v1/chat/completions", {**base, "stop": stop})
            got, reason = r["choices"][0]["message"]["content"], r["choices"][0]["finish_reason"]
        assert got == text[:cut] and reason == "stop"
    live.wait_idle()  # the stop string aborted the engine request: nothing left running
