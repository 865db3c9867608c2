"""Constrained outputs sampled at temperature 1, over real HTTP: the draw never
leaves the grammar, at the seeds whose noise reaches the top of its range; a
request whose min_tokens meets a grammar that allows only its stop ids ends
"stop"; and a sampled token the grammar rejects (a mask that did not hold, a
server bug, injected here) ends the request with a short server error while the
internals go to the server's log with the request id."""

from __future__ import annotations

import json
import logging
from typing import Any

import openai
import pytest
import torch

from ftserve_kernels import sampling as ks
from tests.server_harness import Live
from tests.test_structured_outputs import JSON_SCHEMA, SCHEMA, validate

MSGS = [{"role": "user", "content": "Describe a user account as JSON."}]
# Seeds whose noise, at the demo model's 32768 tokens, puts the largest uniform
# on some token within the first EARLY output steps (checked below), where the
# grammar allows only a handful of tokens, so the token it lands on is banned.
SEEDS = [26, 44, 82, 119, 155, 162, 210, 261]
EARLY = 6


def _hits_the_top(seed: int, vocab: int) -> bool:
    table = ks.token_hash_table(vocab, "cpu")
    k1, k2 = ks.row_keys(torch.full((EARLY,), seed), torch.zeros(EARLY, dtype=torch.int64),
                         torch.arange(EARLY))
    h = ks.mix32(ks.mix32(table[None, :] ^ k1[:, None]) ^ k2[:, None])  # [EARLY, V]
    return bool(((h >> 8) == (1 << 24) - 1).any())


def test_json_at_temperature_1_keeps_its_grammar_where_the_noise_peaks(
    live: Live, client: openai.OpenAI,
) -> None:
    vocab = live.engine.runner.sampler.vocab_size
    assert all(_hits_the_top(seed, vocab) for seed in SEEDS), "the seeds no longer reach the extreme"
    for seed in SEEDS:
        r = client.chat.completions.create(model="ftserve-demo", messages=MSGS, max_tokens=200,
                                           temperature=1.0, seed=seed, response_format=JSON_SCHEMA)
        assert r.choices[0].finish_reason == "stop", (seed, r)
        validate(json.loads(r.choices[0].message.content or ""), SCHEMA)
        # json_object, streamed (what instructor and the openai SDK's helpers send).
        text, reason = "", None
        for chunk in client.chat.completions.create(
                model="ftserve-demo", messages=MSGS, max_tokens=24, temperature=1.0, seed=seed,
                response_format={"type": "json_object"}, stream=True):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                reason = chunk.choices[0].finish_reason or reason
        assert reason in ("stop", "length"), (seed, text)
        if reason == "stop":
            assert isinstance(json.loads(text), dict), (seed, text)
    live.wait_idle()


def test_min_tokens_yields_to_a_grammar_that_allows_only_stop_ids(live: Live, client: openai.OpenAI) -> None:
    """The choice "a" is one of the request's stop ids, and min_tokens holds stop ids
    back: the grammar allows nothing else, so it wins and the request ends "stop"
    with "a", not with an error after a token drawn from an empty row."""
    vocab = live.engine.runner.sampler.vocab_size
    a_ids = [t for t in range(vocab) if live.text.token_bytes(t) == b"a"]
    assert a_ids
    for temperature in (0.0, 1.0):
        r = client.chat.completions.create(
            model="ftserve-demo", messages=MSGS, max_tokens=8, temperature=temperature, seed=3,
            extra_body={"guided_choice": ["a"], "stop_token_ids": a_ids, "min_tokens": 4})
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("a", "stop"), r
    live.wait_idle()


def _leaky_masks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mask that does not hold: every constrained row allows every token."""
    from ftserve.engine.grammar import MaskFiller

    def fill(self: MaskFiller, matchers: Any, out: Any) -> None:
        out.fill(-1)

    monkeypatch.setattr(MaskFiller, "fill", fill)


INTERNALS = ("Parser", "Tokens", "grammar", "lexer", "\n")


def _engine_errors(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("ftserve.engine")]


def test_a_token_the_grammar_rejects_ends_the_request_with_a_short_server_error(
    live: Live, client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    _leaky_masks(monkeypatch)
    caplog.set_level(logging.ERROR)
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model="ftserve-demo", messages=MSGS, max_tokens=40,
                                       temperature=0.0, response_format=JSON_SCHEMA)
    err = info.value.body
    assert isinstance(err, dict) and err["type"] == "server_error" and err["code"] == "internal_error", err
    message = err["message"]
    assert len(message) < 200 and not any(w in message for w in INTERNALS), message
    rid = message.rsplit("request ", 1)[-1].rstrip(")")
    assert rid.startswith("chatcmpl-"), message
    logged = [r.getMessage() for r in _engine_errors(caplog)]
    assert any(rid in m and "Parser" in m for m in logged), logged
    live.wait_idle()

    # Streamed: the tokens before the rejected one went out; then one short error
    # event and the stream's end.
    caplog.clear()
    import asyncio

    import aiohttp

    async def stream() -> list[str]:
        body = {"model": "ftserve-demo", "messages": MSGS, "max_tokens": 40, "temperature": 0.0,
                "stream": True, "response_format": {"type": "json_object"}}
        async with aiohttp.ClientSession() as s, s.post(live.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            raw = (await resp.read()).decode()
        return [e[len("data: "):] for e in raw.split("\n\n") if e.startswith("data: ")]

    events = asyncio.run(stream())
    assert events[-1] == "[DONE]", events
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error", error
    assert len(error["message"]) < 200 and not any(w in error["message"] for w in INTERNALS), error
    rid = error["message"].rsplit("request ", 1)[-1].rstrip(")")
    assert all(json.loads(e)["id"] == rid for e in events[:-2]), events
    assert any(rid in r.getMessage() for r in _engine_errors(caplog))
    live.wait_idle()
