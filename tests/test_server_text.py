"""The text a response carries and how its logprobs describe it, against a real
server (real engine, demo model with its sentencepiece tokenizer): a completion
continues its prompt's text, logprob ``bytes`` are the token's own bytes,
``text_offset`` indexes the choice's text, and ``include_stop_str_in_output``.

The demo weights are random, so each test forces the tokens it needs with
``logit_bias`` (+100 on a few ids; a frequency penalty makes greedy decoding
cycle through them)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import orjson

from tests.server_harness import Live

PROMPT = "The capital of France is"


def _post(live: Live, path: str, body: Any) -> dict[str, Any]:
    async def go() -> tuple[int, Any]:
        async with aiohttp.ClientSession() as s, s.post(live.url + path, json=body) as resp:
            return resp.status, await resp.json()

    status, out = asyncio.run(go())
    assert status == 200, out
    return out


def _stream(live: Live, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The choice objects of every data chunk but the usage one, in order."""
    async def go() -> bytes:
        async with aiohttp.ClientSession() as s, s.post(live.url + path,
                                                        json={**body, "stream": True}) as resp:
            assert resp.status == 200
            return await resp.read()

    frames = [f for f in asyncio.run(go()).split(b"\n\n") if f.startswith(b"data: {")]
    return [c for f in frames for c in orjson.loads(f[6:])["choices"]]


def _word_id(live: Live, word: str) -> int:
    """The id of ``word`` with its sentencepiece word-start space ("▁Paris")."""
    tok = live.text.tokenizer  # type: ignore[attr-defined]
    ids = tok.encode("is " + word, add_special_tokens=False)
    assert len(ids) == 2 and tok.token_bytes(ids[1]) == b" " + word.encode(), ids
    return ids[1]


def test_completion_text_continues_the_prompt(live: Live, client: openai.OpenAI) -> None:
    """After prompt text the first token keeps its word-start space: prompt + text is
    the text the model wrote, as vLLM returns it (the space was dropped, giving
    "The capital of France isParis"). After a control token (BOS alone, the chat
    template's [/INST]) the output starts a text and has none."""
    paris = _word_id(live, "Paris")
    kw: dict[str, Any] = dict(model="ftserve-demo", max_tokens=2, temperature=0,
                              logit_bias={str(paris): 100}, extra_body={"ignore_eos": True})
    r = client.completions.create(prompt=PROMPT, **kw)
    assert r.choices[0].text == " Paris Paris"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        prompt=PROMPT, stream=True, **kw))
    assert streamed == " Paris Paris"
    echoed = client.completions.create(prompt=PROMPT, echo=True, **kw).choices[0].text
    assert echoed == PROMPT + " Paris Paris"
    ids = live.text.tokenizer.encode(PROMPT)  # type: ignore[attr-defined]
    assert client.completions.create(prompt=ids, **kw).choices[0].text == " Paris Paris"
    # Nothing to continue (the prompt is only the BOS token): the text starts the text.
    assert client.completions.create(prompt="", **kw).choices[0].text == "Paris Paris"
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kw)
    assert chat.choices[0].message.content == "Paris Paris"
    live.wait_idle()


def _byte_token(live: Live) -> int:
    """A byte-fallback token whose byte is no UTF-8 text on its own."""
    tok = live.text.tokenizer  # type: ignore[attr-defined]
    for t in range(tok.vocab_size):
        b = tok.token_bytes(t)
        if len(b) == 1 and b[0] >= 0x80:
            return t
    raise AssertionError("the demo tokenizer has no byte-fallback tokens")


def test_chat_logprob_bytes_are_the_token_bytes(live: Live, client: openai.OpenAI) -> None:
    """``bytes`` is the token's raw UTF-8 bytes, so a character split over tokens can
    be put back together (OpenAI's reason for the field); it was the bytes of U+FFFD."""
    byte_id = _byte_token(live)
    raw = list(live.text.tokenizer.token_bytes(byte_id))  # type: ignore[attr-defined]
    kw: dict[str, Any] = dict(model="ftserve-demo", messages=[{"role": "user", "content": "hi"}],
                              max_tokens=2, temperature=0, logprobs=True, top_logprobs=3,
                              logit_bias={str(byte_id): 100}, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert [c.bytes for c in content] == [raw, raw]
    for c in content:  # every alternative's bytes decode to its token text
        for alt in c.top_logprobs:
            assert bytes(alt.bytes).decode("utf-8", errors="replace") == alt.token
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = [c.bytes for ch in chunks for choice in ch.choices if choice.logprobs
                for c in choice.logprobs.content]
    assert streamed == [raw, raw]
    live.wait_idle()


def _offsets_check(tokens: list[str], offsets: list[int], text: str,
                   skipped: set[str]) -> None:
    assert len(tokens) == len(offsets) and offsets == sorted(offsets)
    for tok, off in zip(tokens, offsets, strict=True):
        assert 0 <= off <= len(text)
        if tok not in skipped:
            assert text[off:off + len(tok)] == tok, (tok, off, text)


def test_completion_text_offset_indexes_the_text(live: Live) -> None:
    """``text_offset[i]`` is where token i's text starts in the choice's text: a skipped
    special token takes no room, and the offsets of a stream do not lag behind the
    text a stop string holds back. They were counted from each token's own text."""
    tok = live.text.tokenizer  # type: ignore[attr-defined]
    special = min(t for t in tok.special_ids if t not in (tok.bos_id, *tok.eos_ids))
    special_text = tok.token_bytes(special).decode()
    words = [_word_id(live, w) for w in ("Paris", "Rome")]
    body: dict[str, Any] = {
        "prompt": PROMPT, "max_tokens": 9, "temperature": 0, "logprobs": 1,
        "ignore_eos": True, "frequency_penalty": 2.0, "return_token_ids": True,
        "logit_bias": {str(t): 100 for t in (special, *words)},
    }
    r = _post(live, "/v1/completions", body)["choices"][0]
    assert special in r["token_ids"] and set(words) <= set(r["token_ids"]), r["token_ids"]
    lp = r["logprobs"]
    _offsets_check(lp["tokens"], lp["text_offset"], r["text"], {special_text})
    # Streamed, under a stop string that never matches but keeps holding "Paris" back.
    choices = _stream(live, "/v1/completions", {**body, "stop": ["Paris!"]})
    assert "".join(c["text"] for c in choices) == r["text"]
    offsets = [o for c in choices if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert offsets == lp["text_offset"]
    live.wait_idle()


def test_completion_top_logprobs_hold_the_sampled_token(live: Live) -> None:
    """Legacy completions list the sampled token among the alternatives even when it
    is not one of the top ``logprobs`` (here: forced by logit_bias, which logprobs do
    not see), as OpenAI does; the entry was missing."""
    rome = _word_id(live, "Rome")
    base: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 1,
                            "ignore_eos": True}
    free = _post(live, "/v1/completions", base)["choices"][0]["logprobs"]
    forced = _post(live, "/v1/completions", {**base, "logit_bias": {str(rome): 100}})
    lp = forced["choices"][0]["logprobs"]
    assert lp["tokens"] == [" Rome"] * 3, lp["tokens"]
    assert list(free["top_logprobs"][0]) != [" Rome"]  # Rome is not the model's own top-1
    for tok, val, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert top[tok] == val and 1 <= len(top) <= 2, top
    live.wait_idle()


def test_include_stop_str_in_output(live: Live) -> None:
    """vLLM's include_stop_str_in_output: the text ends with the stop string instead of
    before it (finish_reason "stop" either way). It was ignored as an unknown field."""
    paris, rome = (_word_id(live, w) for w in ("Paris", "Rome"))
    body: dict[str, Any] = {
        "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "frequency_penalty": 2.0, "logit_bias": {str(paris): 100, str(rome): 100},
    }
    full = _post(live, "/v1/completions", body)["choices"][0]["text"]
    assert "Rome" in full, full
    cut = full.index("Rome")
    for stream in (False, True):
        for include in (False, True):
            req = {**body, "stop": ["Rome"], "include_stop_str_in_output": include}
            if stream:
                choices = _stream(live, "/v1/completions", req)
                text, reason = "".join(c["text"] for c in choices), choices[-1]["finish_reason"]
            else:
                c = _post(live, "/v1/completions", req)["choices"][0]
                text, reason = c["text"], c["finish_reason"]
            assert text == full[:cut + 4 if include else cut] and reason == "stop", (stream, include)
    out = _post(live, "/v1/chat/completions", {
        **{k: v for k, v in body.items() if k != "prompt"},
        "messages": [{"role": "user", "content": "hi"}], "stop": "Rome",
        "include_stop_str_in_output": True})
    assert out["choices"][0]["message"]["content"].endswith("Rome")
    live.wait_idle()
