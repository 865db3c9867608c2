"""/v1/completions prompt batches and echo, through the official client against a real
server (real engine, the real small model: tests/real_model.py).

Batched choices must equal the same prompts sent one at a time, token for token,
with whatever the prefix cache holds: real weights leave no near-tied logits for
a changed prefill shape to flip (random demo weights did, and these tests had to
empty the prefix cache before every comparison)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import pytest

from tests.real_model import SMOLLM2
from tests.server_harness import Live

PROMPTS = ["Once upon a time", "The dragon said to the knight", "In a quiet village by the sea"]
GREEDY: dict[str, Any] = dict(model=SMOLLM2, max_tokens=5, temperature=0, seed=3,
                              extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def live(smollm2_live: Live) -> Live:
    return smollm2_live


def _singles(live: Live, client: openai.OpenAI, prompts: list[Any]) -> list[Any]:
    out = []
    for p in prompts:
        out.append(client.completions.create(prompt=p, **GREEDY))
    return out


def test_batch_whole(live: Live, client: openai.OpenAI) -> None:
    singles = _singles(live, client, PROMPTS)
    r = client.completions.create(prompt=PROMPTS, n=2, **GREEDY)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [s.choices[0].text for s in singles for _ in range(2)]
    assert all(c.finish_reason == "length" for c in r.choices)
    # Each prompt counts once (as with n > 1), the prompts add up.
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert r.usage.completion_tokens == 30
    assert r.usage.total_tokens == r.usage.prompt_tokens + 30
    # Token-id prompts: the same batch as lists of ids.
    ids = [[1, 42, 7, 99], [5, 6, 7, 8, 9], [300, 12]]
    singles = _singles(live, client, ids)
    r = client.completions.create(prompt=ids, n=2, **GREEDY)
    assert [c.text for c in r.choices] == [s.choices[0].text for s in singles for _ in range(2)]
    assert r.usage.prompt_tokens == 11
    live.wait_idle()


def test_batch_streamed(live: Live, client: openai.OpenAI) -> None:
    singles = _singles(live, client, PROMPTS)
    stream = client.completions.create(prompt=PROMPTS, n=2, stream=True,
                                       stream_options={"include_usage": True}, **GREEDY)
    texts, reasons = [""] * 6, [None] * 6
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
            continue
        (c,) = chunk.choices  # each chunk carries one choice and its index
        assert reasons[c.index] is None, "nothing after a choice's finish chunk"
        texts[c.index] += c.text
        reasons[c.index] = c.finish_reason
    assert reasons == ["length"] * 6
    assert texts == [s.choices[0].text for s in singles for _ in range(2)]
    assert usage is not None and usage.completion_tokens == 30
    assert usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    live.wait_idle()


def test_echo(live: Live, client: openai.OpenAI) -> None:
    prompt = PROMPTS[1]
    plain = client.completions.create(prompt=prompt, **GREEDY).choices[0].text
    r = client.completions.create(prompt=prompt, echo=True, **GREEDY)
    assert r.choices[0].text == prompt + plain
    ids = live.call(live.text.encode_async("a cat sat on the mat", False))
    decoded = live.text.decode(ids)
    assert "cat sat" in decoded
    plain = client.completions.create(prompt=ids, **GREEDY).choices[0].text
    r = client.completions.create(prompt=ids, echo=True, **GREEDY)
    assert r.choices[0].text == decoded + plain
    # A batch with n = 2: each choice starts with its own prompt, whole and streamed.
    batch: list[Any] = [prompt, "Hello"]
    whole = client.completions.create(prompt=batch, n=2, echo=True, **GREEDY)
    assert [c.text[:len(batch[c.index // 2])] for c in whole.choices] == [
        prompt, prompt, "Hello", "Hello"]
    first: dict[int, str] = {}
    texts = [""] * 4
    for chunk in client.completions.create(prompt=batch, n=2, echo=True, stream=True, **GREEDY):
        (c,) = chunk.choices
        first.setdefault(c.index, c.text)
        texts[c.index] += c.text
    assert [first[i].startswith(batch[i // 2]) for i in range(4)] == [True] * 4
    assert all(texts[i].startswith(batch[i // 2]) and len(texts[i]) > len(batch[i // 2])
               for i in range(4))
    live.wait_idle()


def test_echo_with_logprobs_scores_the_prompt(live: Live, client: openai.OpenAI) -> None:
    """echo + logprobs (how lm-evaluation-harness scores a continuation): the
    choice's logprobs cover the prompt tokens, then the generated ones. Checked
    against the engine's own sampled-token logprob: the logprob the prompt gets
    at position i equals what greedy decoding gave that token there."""
    ids = live.call(live.text.encode_async("The dragon said to the knight", False))
    kw: dict[str, Any] = dict(model=SMOLLM2, temperature=0, logprobs=2)
    first = client.completions.create(prompt=ids, max_tokens=1, **kw,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    (g,) = first.choices[0].model_extra["token_ids"]
    want = first.choices[0].logprobs.token_logprobs[0]
    r = client.completions.create(prompt=ids + [g], max_tokens=2, echo=True, **kw,
                                  extra_body={"ignore_eos": True})
    c = r.choices[0]
    lp = c.logprobs
    n = len(ids) + 1
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) and x <= 0.0 for x in lp.token_logprobs[1:])
    assert lp.tokens[len(ids)] == live.text.token_text(g)
    assert abs(lp.token_logprobs[len(ids)] - want) < 1e-4, (lp.token_logprobs[len(ids)], want)
    # The greedy token is the best: the top entry at its position is itself.
    top = lp.top_logprobs[len(ids)]
    assert max(top, key=top.get) == lp.tokens[len(ids)] and 1 <= len(top) <= 3
    # Offsets walk the echoed text: the prompt's tokens, then the generated ones.
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert lp.text_offset[n] == len(live.text.decode(ids + [g])) <= len(c.text)
    assert r.usage.prompt_tokens == n and r.usage.completion_tokens == 2
    # Streamed: the first chunk carries the prompt's part; the parts add up the same.
    streamed: list[Any] = []
    for chunk in client.completions.create(prompt=ids + [g], max_tokens=2, echo=True, stream=True, **kw,
                                           extra_body={"ignore_eos": True}):
        for ch in chunk.choices:
            if ch.logprobs is not None:
                streamed.extend(ch.logprobs.token_logprobs)
    assert len(streamed) == n + 2 and streamed[0] is None
    assert all(abs(a - b) < 1e-5 for a, b in zip(streamed[1:], lp.token_logprobs[1:]))
    live.wait_idle()


def test_echo_with_max_tokens_0_scores_the_prompt_alone(live: Live, client: openai.OpenAI) -> None:
    """OpenAI's legacy scoring call: echo, logprobs, max_tokens 0. The prompt comes
    back with its logprobs and nothing is generated (whole and streamed); without
    echo, max_tokens 0 is a 400."""
    ids = live.call(live.text.encode_async("The dragon said to the knight", False))
    kw: dict[str, Any] = dict(model=SMOLLM2, prompt=ids, echo=True, logprobs=1, temperature=0)
    one = client.completions.create(max_tokens=1, **kw).choices[0]
    r = client.completions.create(max_tokens=0, **kw)
    c = r.choices[0]
    assert c.text == live.text.decode(ids) and c.finish_reason == "length"
    assert c.logprobs.tokens == one.logprobs.tokens[:len(ids)]
    assert c.logprobs.token_logprobs[0] is None
    assert all(abs(a - b) < 1e-5 for a, b in zip(c.logprobs.token_logprobs[1:], one.logprobs.token_logprobs[1:len(ids)]))
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    chunks = list(client.completions.create(max_tokens=0, stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    lps = [x for ch in chunks if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.token_logprobs]
    assert text == c.text and lps == c.logprobs.token_logprobs
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=SMOLLM2, prompt=ids, max_tokens=0)
    assert err.value.param == "max_tokens"
    live.wait_idle()


def test_truncate_prompt_tokens_keeps_the_last_tokens(live: Live, client: openai.OpenAI) -> None:
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens run, on completions
    (echo shows what ran) and chat; -1 is the context's length; 0 is a 400."""
    ids = live.call(live.text.encode_async("Once upon a time in a land far away there lived a king", False))
    assert len(ids) > 6
    cut = client.completions.create(prompt=ids, echo=True, **{**GREEDY, "extra_body": {
        "ignore_eos": True, "truncate_prompt_tokens": 5}})
    tail = client.completions.create(prompt=ids[-5:], **GREEDY)
    assert cut.usage.prompt_tokens == 5 and tail.usage.prompt_tokens == 5
    head = live.text.decode(ids[-5:])
    assert cut.choices[0].text == head + tail.choices[0].text
    whole = client.completions.create(prompt=ids, **{**GREEDY, "extra_body": {
        "ignore_eos": True, "truncate_prompt_tokens": -1}})
    assert whole.usage.prompt_tokens == len(ids)
    chat = client.chat.completions.create(model=SMOLLM2, max_tokens=1, temperature=0,
                                          messages=[{"role": "user", "content": "tell me " * 20}],
                                          extra_body={"truncate_prompt_tokens": 7})
    assert chat.usage.prompt_tokens == 7
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(prompt=ids, **{**GREEDY, "extra_body": {"truncate_prompt_tokens": 0}})
    assert err.value.param == "truncate_prompt_tokens"
    live.wait_idle()


def test_vllm_prompt_logprobs(live: Live, client: openai.OpenAI) -> None:
    """vLLM's prompt_logprobs field, on completions and chat: per prompt token
    (None first) token id -> logprob, rank, decoded token, for the token itself
    and its best alternatives."""
    ids = live.call(live.text.encode_async("a cat sat on the mat", False))
    r = client.completions.create(model=SMOLLM2, prompt=ids, max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    pl = r.choices[0].model_extra["prompt_logprobs"]
    assert len(pl) == len(ids) and pl[0] is None
    for tid, entry in zip(ids[1:], pl[1:]):
        own = entry[str(tid)]
        assert own["decoded_token"] == live.text.token_text(tid) and own["rank"] >= 1
        assert 1 <= len(entry) <= 3 and own["logprob"] <= 0.0
        best = min(entry.values(), key=lambda e: e["rank"])
        assert best["rank"] == 1 and best["logprob"] >= own["logprob"] - 1e-6
    chat = client.chat.completions.create(model=SMOLLM2, max_tokens=1, temperature=0,
                                          messages=[{"role": "user", "content": "hi"}],
                                          extra_body={"prompt_logprobs": 0})
    cpl = chat.choices[0].model_extra["prompt_logprobs"]
    assert len(cpl) == chat.usage.prompt_tokens and cpl[0] is None
    assert all(len(e) == 1 for e in cpl[1:])  # 0 alternatives: the token alone
    assert "prompt_logprobs" not in client.completions.create(
        model=SMOLLM2, prompt=ids, max_tokens=1).choices[0].model_extra
    live.wait_idle()


def test_bad_batches_are_400s_and_submit_nothing(live: Live, client: openai.OpenAI,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    limit, vocab = live.engine.max_model_len, live.engine.vocab_size
    submitted: list[Any] = []
    real = live.engine.submit
    monkeypatch.setattr(live.engine, "submit", lambda req: (submitted.append(req), real(req)))
    cases: list[tuple[dict[str, Any], str, str | None]] = [
        ({"prompt": [[1, 2], []]}, "prompt", "prompt[1]"),
        ({"prompt": [[1, 2], [3, vocab]]}, "prompt", "prompt[1]"),
        ({"prompt": ["fine", [1, 2]]}, "prompt", None),
        ({"prompt": [[1, 2], [3, "x"]]}, "prompt", None),
        ({"prompt": [[5] * 10, [5] * (limit + 3)]}, "prompt", "prompt[1]"),
        ({"prompt": ["a"] * 9, "n": 2}, "n", None),
        ({"prompt": ["a"] * 17}, "prompt", None),
        ({"prompt": "x", "suffix": "y"}, "suffix", None),
        ({"prompt": ["x", "y"], "best_of": 2}, "best_of", None),
    ]
    for extra, param, where in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=SMOLLM2, max_tokens=2,
                                      **{k: v for k, v in extra.items() if k == "prompt"},
                                      extra_body={k: v for k, v in extra.items() if k != "prompt"})
        assert err.value.param == param, (extra, err.value)
        if where is not None:
            assert where in err.value.message, err.value.message
    too_long = [[5] * 10, [5] * 100]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=SMOLLM2, prompt=too_long, max_tokens=limit - 50)
    assert err.value.code == "context_length_exceeded" and "prompt[1]" in err.value.message
    assert submitted == []  # nothing reached the engine, not even the valid prompts
    st = live.wait_idle()
    assert st.running == st.waiting == 0 and len(live.state.tracker) == 0
    metrics = asyncio.run(_get(live.url + "/metrics"))
    assert "ftserve_num_requests_running 0.0" in metrics


async def _get(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url) as resp:
        return await resp.text()


def test_batch_disconnect_aborts_every_choice(live: Live) -> None:
    """A client that leaves mid-stream frees every prompt's choices."""
    baseline = live.wait_idle()

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            resp = await s.post(live.url + "/v1/completions", json={
                "prompt": PROMPTS, "n": 2, "max_tokens": 400, "ignore_eos": True,
                "stream": True})
            assert resp.status == 200
            await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 20)
            st = live.engine.stats()
            for _ in range(100):  # the stats snapshot is refreshed once per engine step
                if st.running + st.waiting >= 2:
                    break
                await asyncio.sleep(0.05)
                st = live.engine.stats()
            assert st.running + st.waiting >= 2, st
            resp.close()

    asyncio.run(go())
    after = live.wait_idle(timeout=10)
    assert after.kv_pages_used == baseline.kv_pages_used == 0
    assert len(live.state.tracker) == 0
