"""OpenAI compatibility: the official client against a real server (real engine, demo model)."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from tests.server_harness import TEST_ENGINE, Live, start_live, stop_live

MSGS = [{"role": "user", "content": "Tell me a story about a dragon."}]




async def _sse_events(url: str, body: dict[str, Any]) -> list[bytes]:
    """Raw SSE frames (each 'data: ...' payload or comment) in arrival order."""
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = await resp.read()
    return [f for f in raw.split(b"\n\n") if f]


def _cold(live: Live) -> None:
    """Empty the prefix cache: a cache hit changes the prefill shapes, and with random
    demo weights near-tied logits can then flip a greedy choice. Only where a test
    needs the demo (its tools template) or a cold start; comparisons of two runs
    use the real model (test_server_compare.py)."""
    assert live.engine.reset_prefix_cache()


def _post(live: Live, path: str, body: Any) -> tuple[int, Any]:
    async def go() -> tuple[int, Any]:
        async with aiohttp.ClientSession() as s, s.post(live.url + path, json=body) as resp:
            return resp.status, await resp.json()

    return asyncio.run(go())


def test_models_reports_real_context(live: Live, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["ftserve-demo"]
    assert models[0].model_extra["max_model_len"] == live.engine.max_model_len
    # GET /v1/models/{model} (client.models.retrieve) was a 404 "not found" route.
    one = client.models.retrieve("ftserve-demo")
    assert one.id == "ftserve-demo" and one.object == "model"
    assert one.created == models[0].created == live.state.created  # fixed, not the call's time
    assert one.model_extra["max_model_len"] == live.engine.max_model_len
    for other in ("gpt-4", "org/name"):  # a served name may hold "/"
        with pytest.raises(openai.NotFoundError) as missing:
            client.models.retrieve(other)
        assert missing.value.code == "model_not_found"


def test_chat_non_streaming_usage(live: Live, client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="ftserve-demo", messages=MSGS, max_tokens=6,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6
    assert r.usage.prompt_tokens_details.cached_tokens is not None
    live.wait_idle()


def test_openai_client_streaming(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model="ftserve-demo", messages=MSGS, max_tokens=4,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert chunks[-2].choices[0].finish_reason == "length"


def test_continuous_usage_stats(client: openai.OpenAI) -> None:
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so
    far; the counts only grow, and the last chunk's are the final ones."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    for stream in (client.chat.completions.create(model="ftserve-demo", messages=MSGS, max_tokens=4,
                                                  stream=True, stream_options=opts,  # type: ignore[arg-type]
                                                  extra_body={"ignore_eos": True}),
                   client.completions.create(model="ftserve-demo", prompt="Once upon", max_tokens=4,
                                             stream=True, stream_options=opts,  # type: ignore[arg-type]
                                             extra_body={"ignore_eos": True})):
        chunks = list(stream)
        assert all(c.usage is not None for c in chunks)
        done = [c.usage.completion_tokens for c in chunks]
        assert done == sorted(done) and done[-1] == 4 and done[0] <= 1
        assert len({c.usage.prompt_tokens for c in chunks}) == 1
    plain = list(client.chat.completions.create(model="ftserve-demo", messages=MSGS, max_tokens=2, stream=True,
                                                extra_body={"ignore_eos": True}))
    assert all(c.usage is None for c in plain)


def test_return_token_ids_round_trip(live: Live) -> None:
    body = {"messages": MSGS, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    status, r = _post(live, "/v1/chat/completions", body)
    assert status == 200
    status, tok = _post(live, "/tokenize", {"messages": MSGS})
    assert r["prompt_token_ids"] == tok["tokens"] and tok["count"] == r["usage"]["prompt_tokens"]
    ids = r["choices"][0]["token_ids"]
    assert len(ids) == r["usage"]["completion_tokens"] == 8
    assert live.text.decode(ids) == r["choices"][0]["message"]["content"]
    # Token ids in as a completions prompt, echoed back exactly.
    prompt = r["prompt_token_ids"] + ids[:4]
    status, c = _post(live, "/v1/completions", {"prompt": prompt, "max_tokens": 4,
                                                "ignore_eos": True, "return_token_ids": True})
    assert status == 200 and c["choices"][0]["prompt_token_ids"] == prompt
    assert len(c["choices"][0]["token_ids"]) == 4 and c["usage"]["prompt_tokens"] == len(prompt)


def test_completions_string_prompt_and_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model="ftserve-demo", prompt="The capital of France is",
                                  max_tokens=5, logprobs=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(x <= 0.0 for x in lp.token_logprobs)
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs)


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="ftserve-demo", messages=MSGS, max_tokens=4,
                                       logprobs=True, top_logprobs=2, temperature=0,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert item.logprob <= 0.0 and len(item.top_logprobs) == 2
        # Greedy: the chosen token is the most likely one.
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-4)


def test_logit_bias(live: Live, client: openai.OpenAI) -> None:
    """logit_bias reaches the sampler: +100 on one token makes greedy decoding
    write only it, -100 on the unbiased first token keeps it out; bad maps are 400s."""
    kw: dict[str, Any] = dict(model="ftserve-demo", messages=MSGS, max_tokens=4, temperature=0,
                              extra_body={"ignore_eos": True, "return_token_ids": True})
    plain = client.chat.completions.create(**kw).choices[0].model_extra["token_ids"]
    forced = client.chat.completions.create(**kw, logit_bias={"1234": 100})
    assert forced.choices[0].model_extra["token_ids"] == [1234] * 4
    banned = client.chat.completions.create(**kw, logit_bias={str(plain[0]): -100})
    assert banned.choices[0].model_extra["token_ids"][0] != plain[0]
    for bad in ({"x": 1}, {"5": 101}, {"5": "high"}, [5], {str(10**9): 1}):
        status, err = _post(live, "/v1/chat/completions",
                            {"messages": MSGS, "max_tokens": 1, "logit_bias": bad})
        assert status == 400 and err["error"]["param"] == "logit_bias", (bad, err)
    live.wait_idle()


def test_prefix_cache_hits_and_reset(live: Live) -> None:
    """A prefix-cache hit serves the cold run's greedy tokens (the demo model is
    context-sensitive, see start_live: tokens read from wrong cached KV differ)."""
    words = "read write file path tool call result error test patch the a of and to in".split()
    rng = random.Random(4)
    msgs = [{"role": "user", "content": " ".join(rng.choice(words) for _ in range(120))}]
    body = {"messages": msgs, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    _cold(live)
    _, first = _post(live, "/v1/chat/completions", body)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    _, second = _post(live, "/v1/chat/completions", body)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 100
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    status, reset = _post(live, "/reset_prefix_cache", {})
    assert status == 200 and reset == {"success": True}
    _, third = _post(live, "/v1/chat/completions", body)
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert third["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    live.wait_idle()


TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]


def test_tools_reach_the_template(live: Live, client: openai.OpenAI) -> None:
    """The demo template renders Mistral-style tools: the tool list, an earlier
    assistant turn's calls and the tool's result all reach the prompt, through the
    official client's own message shapes."""
    messages: list[Any] = [
        {"role": "user", "content": "Show me a.py"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "abc123XYZ", "type": "function",
            "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]},
        {"role": "tool", "tool_call_id": "abc123XYZ", "content": "print('hi')"},
    ]
    r = client.chat.completions.create(model="ftserve-demo", messages=messages, tools=TOOLS,
                                       tool_choice="auto", max_tokens=3,
                                       extra_body={"return_token_ids": True})
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    _, det = _post(live, "/detokenize", {"tokens": r.model_extra["prompt_token_ids"]})
    prompt = det["prompt"]
    assert '[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "read_file"' in prompt
    assert '[TOOL_CALLS] [{"name": "read_file", "arguments": {"path": "a.py"}, "id": "abc123XYZ"}]' in prompt
    assert '[TOOL_RESULTS] {"call_id": "abc123XYZ", "content": "print(\'hi\')"}' in prompt
    # /tokenize counts the same prompt, tools included.
    _, tok = _post(live, "/tokenize", {"messages": messages, "tools": TOOLS})
    assert tok["tokens"] == r.model_extra["prompt_token_ids"]
    # tool_choice "none": the tools are not offered (not rendered).
    r2 = client.chat.completions.create(model="ftserve-demo", messages=messages[:1], tools=TOOLS,
                                        tool_choice="none", max_tokens=1,
                                        extra_body={"return_token_ids": True})
    _, det2 = _post(live, "/detokenize", {"tokens": r2.model_extra["prompt_token_ids"]})
    assert "AVAILABLE_TOOLS" not in det2["prompt"]
    # Streaming with tools: the filter passes plain content through unchanged.
    body = {"model": "ftserve-demo", "messages": messages[:1], "tools": TOOLS, "max_tokens": 6,
            "temperature": 0, "ignore_eos": True}
    _cold(live)
    status, full = _post(live, "/v1/chat/completions", body)
    _cold(live)
    frames = asyncio.run(_sse_events(live.url + "/v1/chat/completions", {**body, "stream": True}))
    events = [orjson.loads(f[6:]) for f in frames[:-1] if f.startswith(b"data: ")]
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    msg = full["choices"][0]["message"]
    if "tool_calls" not in msg:  # random weights: almost surely plain text
        assert status == 200 and streamed == msg["content"]
    live.wait_idle()


def test_tokenize_detokenize(live: Live) -> None:
    _, tok = _post(live, "/tokenize", {"prompt": "Hello world, héllo"})
    assert tok["count"] == len(tok["tokens"]) > 0
    assert tok["max_model_len"] == live.engine.max_model_len
    _, det = _post(live, "/detokenize", {"tokens": tok["tokens"]})
    assert det["prompt"].endswith("Hello world, héllo")


def test_developer_role_is_a_system_message(live: Live, client: openai.OpenAI) -> None:
    """OpenAI's "developer" role (the system role of newer models) reaches a template
    that knows only "system" as a system message: this one raised "unknown role",
    Qwen's would drop the message without a word."""
    msgs = [{"role": "user", "content": "hi"}]
    as_system = _post(live, "/tokenize", {"messages": [{"role": "system", "content": "Be brief."},
                                                       *msgs]})[1]["tokens"]
    status, as_dev = _post(live, "/tokenize", {"messages": [
        {"role": "developer", "content": "Be brief."}, *msgs]})
    assert status == 200 and as_dev["tokens"] == as_system
    r = client.chat.completions.create(
        model="ftserve-demo", max_tokens=1,
        messages=[{"role": "developer", "content": "Be brief."}, *msgs])  # type: ignore[list-item]
    assert r.usage.prompt_tokens == len(as_system)


def test_text_parts_join_with_newlines(live: Live) -> None:
    """A message's text parts render as one text, joined by newlines (as vLLM does)."""
    parts = [{"type": "text", "text": "Part one."}, {"type": "text", "text": "Part two."}]
    as_parts = _post(live, "/tokenize", {"messages": [{"role": "user", "content": parts}]})
    as_text = _post(live, "/tokenize", {"messages": [
        {"role": "user", "content": "Part one.\nPart two."}]})
    assert as_parts[0] == 200 and as_parts[1]["tokens"] == as_text[1]["tokens"]


def test_continue_final_message(live: Live, client: openai.OpenAI) -> None:
    """vLLM's continue_final_message: the last assistant message is the start of the
    reply, so the prompt ends right after its text (no end-of-turn) and the model
    continues it; without the flag the message is a finished turn."""
    start = "The capital of France is"
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": start}]
    status, cont = _post(live, "/tokenize", {"messages": msgs, "continue_final_message": True})
    assert status == 200
    closed = _post(live, "/tokenize", {"messages": msgs, "add_generation_prompt": False})[1]
    assert _post(live, "/detokenize", {"tokens": cont["tokens"]})[1]["prompt"].endswith(start)
    assert closed["tokens"][:len(cont["tokens"])] == cont["tokens"]
    assert len(closed["tokens"]) > len(cont["tokens"])  # the end-of-turn the flag leaves out
    paris = live.text.tokenizer.encode("is Paris", add_special_tokens=False)[-1]  # type: ignore[attr-defined]
    r = client.chat.completions.create(
        model="ftserve-demo", messages=msgs, max_tokens=2, temperature=0,  # type: ignore[arg-type]
        logit_bias={str(paris): 100}, extra_body={"continue_final_message": True})
    assert r.usage is not None and r.usage.prompt_tokens == cont["count"]
    assert r.choices[0].message.content == " Paris Paris"  # continues the text: its space kept
    for body, why in (
        ({"messages": msgs[:1]}, "the last message is the user's"),
        ({"messages": [*msgs[:1], {"role": "assistant", "content": ""}]}, "nothing to continue"),
        ({"messages": msgs, "add_generation_prompt": True}, "both"),
        ({"messages": msgs, "continue_final_message": "yes"}, "not a boolean"),
        ({"messages": msgs, "response_format": {"type": "json_object"}}, "a format"),
    ):
        status, err = _post(live, "/v1/chat/completions",
                            {"continue_final_message": True, "max_tokens": 1, **body})
        assert status == 400 and err["error"]["param"] == "continue_final_message", (why, err)
    live.wait_idle()


def test_health_and_metrics(live: Live) -> None:
    async def go() -> tuple[int, str]:
        async with aiohttp.ClientSession() as s:
            async with s.get(live.url + "/health") as h:
                assert h.status == 200
            async with s.get(live.url + "/metrics") as m:
                return m.status, await m.text()

    _post(live, "/v1/completions", {"prompt": "count: one two", "max_tokens": 3,
                                    "ignore_eos": True})
    status, text = asyncio.run(go())
    assert status == 200
    values = {line.split(" ")[0]: float(line.split(" ")[1])
              for line in text.splitlines() if line and not line.startswith("#")}
    for name in ("ftserve_num_requests_running", "ftserve_num_requests_waiting",
                 "ftserve_kv_cache_usage_ratio", "ftserve_kv_pages_used",
                 "ftserve_kv_pages_cached", "ftserve_prefix_cache_hit_tokens_total",
                 "ftserve_prefix_published_pages_total"):
        assert name in values, name
    assert values["ftserve_prompt_tokens_total"] > 0
    assert values["ftserve_generation_tokens_total"] >= 3
    # By finish reason, one per choice; the start-up warm-up request is not counted.
    finished = {r: values[f'ftserve_requests_finished_total{{reason="{r}"}}']
                for r in ("stop", "length", "abort", "error")}
    assert finished["length"] >= 1 and finished["error"] == 0, finished
    for hist in ("ftserve_time_to_first_token_seconds", "ftserve_inter_token_latency_seconds",
                 "ftserve_e2e_request_latency_seconds", "ftserve_request_queue_time_seconds"):
        assert values[hist + "_count"] >= 1, hist
    assert "process_cpu_seconds_total" in values


@pytest.mark.gpu
def test_gpu_server_streams_and_frees_pages() -> None:
    """The same server on CUDA (CUDA graphs on): concurrent streams, a disconnect, usage."""
    gpu = start_live(dataclasses.replace(TEST_ENGINE, device="cuda", cuda_graph_max_bs=8,
                                         max_running_requests=4))
    try:
        body = {"messages": MSGS, "max_tokens": 16, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}

        async def go() -> list[list[bytes]]:
            async with aiohttp.ClientSession() as s:
                dropped = await s.post(gpu.url + "/v1/chat/completions", json=body)
                await dropped.content.readuntil(b"\n\n")
                dropped.close()
                return await asyncio.gather(*[
                    _sse_events(gpu.url + "/v1/chat/completions", body) for _ in range(3)])

        for frames in asyncio.run(go()):
            assert frames[-1] == b"data: [DONE]"
            assert orjson.loads(frames[-2][6:])["usage"]["completion_tokens"] == 16
        gpu.wait_idle()
    finally:
        stop_live(gpu)


def test_openai_client_sees_error_objects(live: Live, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="ftserve-demo", prompt=[7] * 50,
                                  max_tokens=live.engine.max_model_len)
    assert bad.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=MSGS, max_tokens=1)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as too_many:
        client.chat.completions.create(model="ftserve-demo", messages=MSGS, max_tokens=1, n=17)
    assert too_many.value.param == "n"
