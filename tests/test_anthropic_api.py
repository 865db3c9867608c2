"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens;
ftserve/api/anthropic/messages.py) against real servers, read with the official
``anthropic`` client: the demo model (Mistral-style template: system prompt,
tools; thinking blocks: test_anthropic_thinking.py). Engine steps are scripted
where the output must be tool calls."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from typing import Any

import aiohttp
import anthropic
import pytest

from tests.server_harness import TEST_SERVER, Live
from tests.test_server_errors import _aborted, call
from tests.test_tool_choice import script as script  # the scripted-generations fixture

MODEL = "ftserve-demo"
USER = [{"role": "user", "content": "What is the weather like in Paris today?"}]
GREEDY = {"temperature": 0}  # this client version has no sampling arguments of its own
TOOLS = [{"name": "get_weather", "description": "Forecast",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}},
         {"name": "now", "input_schema": {"type": "object"}}]
# The same tools and a finished call round in OpenAI's shape, for /tokenize.
OPENAI_TOOLS = [{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"],
                                                  **({"description": t["description"]}
                                                     if "description" in t else {})}}
                for t in TOOLS]
HISTORY = [*USER,
           {"role": "assistant", "content": [
               {"type": "text", "text": "Let me look."},
               {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                "input": {"city": "Paris"}}]},
           {"role": "user", "content": [
               {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21C"},
               {"type": "text", "text": "And in Rome?"}]}]
OPENAI_HISTORY = [*USER,
                  {"role": "assistant", "content": "Let me look.", "tool_calls": [
                      {"id": "toolu_1", "type": "function",
                       "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                  {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 21C"},
                  {"role": "user", "content": "And in Rome?"}]


def _client(live: Live, base: str | None = None, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base or live.url, api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(live: Live) -> anthropic.Anthropic:
    return _client(live)


def _tokenize(live: Live, body: dict[str, Any]) -> int:
    status, _, out = call(live, "/tokenize", body)
    assert status == 200, out
    return out["count"]


def _streamed(client: anthropic.Anthropic, **req: Any) -> tuple[Any, list[Any]]:
    """The stream helper's final message and the raw events it saw."""
    with client.messages.stream(**req) as stream:
        events = list(stream)
        return stream.get_final_message(), events


def _same(whole: Any, streamed: Any) -> None:
    """Equal messages but for the ids the server draws (message, tool_use) and how
    much of the prompt the prefix cache held (the later request finds more)."""
    def norm(m: Any) -> dict[str, Any]:
        d = m.model_dump(exclude={"id"})
        use = d.pop("usage")
        d["prompt"] = use.pop("input_tokens") + use.pop("cache_read_input_tokens")
        d["usage"] = use
        for block in d["content"]:
            block.pop("parsed_output", None)
            if block["type"] == "tool_use":
                assert block.pop("id").startswith("toolu_")
        return d

    assert whole.id.startswith("msg_") and streamed.id.startswith("msg_")
    assert norm(whole) == norm(streamed)


def _blocks(message: Any) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for b in message.content:
        if b.type == "text":
            out.append(("text", b.text))
        elif b.type == "thinking":
            out.append(("thinking", b.thinking, b.signature))
        else:
            out.append((b.type, b.name, b.input))
    return out


# ----------------------------------------------------------------- blocks


def _assemble(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Content blocks from stream events, as a client puts them together."""
    blocks: list[dict[str, Any]] = []
    json_of: dict[int, str] = {}
    open_at: int | None = None
    for ev in events:
        if ev["type"] == "content_block_start":
            assert open_at is None and ev["index"] == len(blocks)
            open_at = ev["index"]
            blocks.append(dict(ev["content_block"]))
        elif ev["type"] == "content_block_delta":
            assert ev["index"] == open_at
            d, b = ev["delta"], blocks[ev["index"]]
            if d["type"] == "text_delta":
                b["text"] += d["text"]
            elif d["type"] == "thinking_delta":
                b["thinking"] += d["thinking"]
            else:
                json_of[ev["index"]] = json_of.get(ev["index"], "") + d["partial_json"]
        else:
            assert ev == {"type": "content_block_stop", "index": open_at}
            open_at = None
    assert open_at is None
    for i, raw in json_of.items():
        blocks[i]["input"] = json.loads(raw)
    return blocks


OUTPUTS = [  # (output, the prompt opened reasoning, tools given)
    ("Plain text, no tools.", False, False),
    ("  padded text \n", False, True),
    ("Checking. [TOOL_CALLS] [{\"name\": \"ls\", \"arguments\": {\"d\": [1, 2]}}]", False, True),
    ("a plan\n</think>\n\nThe answer.  ", True, False),
    ("plan</think>\n\n[TOOL_CALLS] [{\"name\": \"ls\", \"arguments\": {}}, "
     "{\"name\": \"cat\", \"arguments\": {\"f\": \"x y\"}}]", True, True),
    ("cut off while thinking", True, True),
]


@pytest.mark.parametrize("output,think,tools", OUTPUTS)
def test_stream_blocks_equal_whole_blocks_at_every_cut(output: str, think: bool,
                                                       tools: bool) -> None:
    from ftserve.api.anthropic.messages import StreamBlocks, whole_blocks
    from ftserve.chat.output import StreamSplit, split_whole

    fmt = "mistral" if tools else None

    def norm(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in b.items() if k != "id"} for b in blocks]

    want = norm(whole_blocks(split_whole(output, fmt, True, None, think)))
    assert want  # every case has some block
    for cut in range(len(output) + 1):
        filt, blocks = StreamSplit(fmt, True, None, think), StreamBlocks()
        events = [*blocks.push(*filt.push(output[:cut])), *blocks.push(*filt.push(output[cut:])),
                  *blocks.push(*filt.finish()), *blocks.finish()]
        assert norm(_assemble(events)) == want, cut


# ----------------------------------------------------------------- text


def test_text_whole_and_streamed_are_the_chat_reply(live: Live, client: anthropic.Anthropic) -> None:
    req = {"model": MODEL, "max_tokens": 6, "messages": USER,
           "extra_body": {**GREEDY, "ignore_eos": True}}
    whole = client.messages.create(**req)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == MODEL
    assert whole.stop_reason == "max_tokens" and whole.stop_sequence is None
    assert whole.usage.output_tokens == 6
    # The same chat path as /v1/chat/completions: the same greedy text.
    status, _, chat = call(live, "/v1/chat/completions", {
        "messages": USER, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert status == 200 and _blocks(whole) == [("text", chat["choices"][0]["message"]["content"])]
    streamed, events = _streamed(client, **req)
    _same(whole, streamed)
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "text" in kinds and "content_block_stop" in kinds and "message_delta" in kinds
    live.wait_idle()


def test_stop_sequences(live: Live, client: anthropic.Anthropic) -> None:
    req = {"model": MODEL, "max_tokens": 16, "messages": USER,
           "extra_body": {**GREEDY, "ignore_eos": True}}
    raw = client.messages.create(**req).content[0].text
    # A piece of the greedy text, first found past its start: the reply ends before it.
    at = next(i for i in range(2, len(raw) - 3) if raw.find(raw[i:i + 3]) == i)
    stop = raw[at:at + 3]
    whole = client.messages.create(**req, stop_sequences=["\x00never", stop])
    assert whole.stop_reason == "stop_sequence" and whole.stop_sequence == stop
    assert _blocks(whole) == [("text", raw[:at])]
    streamed, _ = _streamed(client, **req, stop_sequences=["\x00never", stop])
    _same(whole, streamed)
    live.wait_idle()


def test_max_tokens_past_the_context_window_gets_the_room_left(live: Live,
                                                                client: anthropic.Anthropic) -> None:
    limit = live.engine.max_model_len
    words = 400
    while True:  # a prompt that leaves a few tokens of room
        messages = [{"role": "user", "content": "word " * words}]
        counted = client.messages.count_tokens(model=MODEL, messages=messages).input_tokens
        if limit - counted <= 8:
            break
        words += max(1, (limit - counted - 6) // 2)
    room = limit - counted
    assert room > 0
    req = {"model": MODEL, "max_tokens": 100, "messages": messages,
           "extra_body": {**GREEDY, "ignore_eos": True}}
    whole = client.messages.create(**req)
    assert whole.stop_reason == "model_context_window_exceeded"
    assert whole.usage.output_tokens == room
    streamed, _ = _streamed(client, **req)
    _same(whole, streamed)
    # Within the window, max_tokens is what stops it.
    assert client.messages.create(**{**req, "max_tokens": room}).stop_reason == "max_tokens"
    live.wait_idle()


def test_system_prompt_and_count_tokens(live: Live, client: anthropic.Anthropic) -> None:
    system = "You are terse. Answer in one word."
    counted = client.messages.count_tokens(model=MODEL, messages=USER, system=system).input_tokens
    assert counted == _tokenize(live, {"messages": [{"role": "system", "content": system}, *USER]})
    assert counted > client.messages.count_tokens(model=MODEL, messages=USER).input_tokens
    # Text blocks as the system prompt: the same prompt.
    blocks = [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]
    assert client.messages.count_tokens(model=MODEL, messages=USER, system=blocks).input_tokens == counted
    reply = client.messages.create(model=MODEL, max_tokens=2, messages=USER, system=system,
                                   extra_body=GREEDY)
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == counted
    # A final assistant message is the start of the reply (prefill): the prompt ends in it.
    prefill = [*USER, {"role": "assistant", "content": "The weather"}]
    assert client.messages.count_tokens(model=MODEL, messages=prefill).input_tokens == _tokenize(
        live, {"messages": [*USER, {"role": "assistant", "content": "The weather"}],
               "continue_final_message": True})


def test_repeated_conversation_reads_the_prefix_cache(live: Live, client: anthropic.Anthropic) -> None:
    messages = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper " * 6}]
    counted = client.messages.count_tokens(model=MODEL, messages=messages).input_tokens
    req = {"model": MODEL, "max_tokens": 3, "messages": messages, "extra_body": GREEDY}
    first = client.messages.create(**req)
    second = client.messages.create(**req)
    for use in (first.usage, second.usage):
        assert use.input_tokens + use.cache_read_input_tokens == counted
        assert use.cache_creation_input_tokens == 0
    assert second.usage.cache_read_input_tokens > 0
    assert second.usage.cache_read_input_tokens > first.usage.cache_read_input_tokens
    streamed, events = _streamed(client, **req)
    start = next(e for e in events if e.type == "message_start")
    assert start.message.usage.cache_read_input_tokens > 0  # message_start carries the hit
    assert streamed.usage == second.usage
    live.wait_idle()


def test_structured_output_format(live: Live, client: anthropic.Anthropic) -> None:
    """output_config.format (and the beta's output_format): the reply's text is JSON
    of the schema, whole and streamed."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
              "required": ["city"], "additionalProperties": False}
    for extra in ({"output_config": {"format": {"type": "json_schema", "schema": schema}}},
                  {"output_format": {"type": "json_schema", "schema": schema}}):
        req = {"model": MODEL, "max_tokens": 40, "messages": USER, "extra_body": {**GREEDY, **extra}}
        whole = client.messages.create(**req)
        ((kind, text),) = _blocks(whole)
        obj = json.loads(text)
        assert kind == "text" and set(obj) == {"city"} and isinstance(obj["city"], str)
        assert whole.stop_reason == "end_turn"
        streamed, _ = _streamed(client, **req)
        _same(whole, streamed)
    live.wait_idle()


# ----------------------------------------------------------------- tools


def test_tool_use_round_trip(live: Live, client: anthropic.Anthropic, script: list[str]) -> None:
    assert live.text.tool_format() == "mistral"
    # The history (tool_use, tool_result, text) renders as its OpenAI twin does.
    assert client.messages.count_tokens(model=MODEL, messages=HISTORY, tools=TOOLS).input_tokens == (
        _tokenize(live, {"messages": OPENAI_HISTORY, "tools": OPENAI_TOOLS}))
    # A failed call's result: templates have no error flag, the text says so.
    failed = [*HISTORY[:2], {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
         "content": [{"type": "text", "text": "no such city"}]}]}]
    assert client.messages.count_tokens(model=MODEL, messages=failed, tools=TOOLS).input_tokens == (
        _tokenize(live, {"messages": [*OPENAI_HISTORY[:2], {"role": "tool", "tool_call_id": "toolu_1",
                                                            "content": "Error: no such city"}],
                         "tools": OPENAI_TOOLS}))
    script[:] = ["Checking. ", '[TOOL_CALLS] [{"name": "get_weather", ',
                 '"arguments": {"city": "Ro', 'me"}}, {"name": "now", "arguments": {}}]']
    req = {"model": MODEL, "max_tokens": len(script), "messages": HISTORY, "tools": TOOLS,
           "extra_body": {**GREEDY, "ignore_eos": True}}
    want = [("text", "Checking."), ("tool_use", "get_weather", {"city": "Rome"}),
            ("tool_use", "now", {})]
    whole = client.messages.create(**req)
    assert whole.stop_reason == "tool_use" and _blocks(whole) == want
    assert all(b.id.startswith("toolu_") for b in whole.content[1:])
    streamed, events = _streamed(client, **req)
    _same(whole, streamed)
    parts = [e.partial_json for e in events if e.type == "input_json"]
    assert len(parts) >= 2 and "".join(parts) == '{"city": "Rome"}{}'
    one = client.messages.create(**req, tool_choice={"type": "auto",
                                                     "disable_parallel_tool_use": True})
    assert _blocks(one) == want[:2] and one.stop_reason == "tool_use"
    one_streamed, _ = _streamed(client, **req, tool_choice={"type": "auto",
                                                            "disable_parallel_tool_use": True})
    _same(one, one_streamed)
    live.wait_idle()


@pytest.mark.parametrize("choice,pieces,want", [
    ({"type": "tool", "name": "get_weather"}, [' {"city": ', '"Oslo"}}]'],
     [("tool_use", "get_weather", {"city": "Oslo"})]),
    ({"type": "any"}, ['now", ', '"arguments": {}}]'], [("tool_use", "now", {})]),
])
def test_forced_tool_choice(live: Live, client: anthropic.Anthropic, script: list[str],
                            choice: dict[str, Any], pieces: list[str],
                            want: list[tuple[Any, ...]]) -> None:
    script[:] = pieces
    req = {"model": MODEL, "max_tokens": len(pieces), "messages": USER, "tools": TOOLS,
           "tool_choice": choice, "extra_body": {**GREEDY, "ignore_eos": True}}
    whole = client.messages.create(**req)
    assert whole.stop_reason == "tool_use" and _blocks(whole) == want
    streamed, _ = _streamed(client, **req)
    _same(whole, streamed)
    # The forced start of the call is prompt: counted, and more than without it.
    counted = client.messages.count_tokens(model=MODEL, messages=USER, tools=TOOLS,
                                           tool_choice=choice).input_tokens
    assert counted == whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert counted > client.messages.count_tokens(model=MODEL, messages=USER, tools=TOOLS).input_tokens
    live.wait_idle()


# ----------------------------------------------------------------- errors


def _anthropic_error(resp: tuple[int, dict[str, str], Any], status: int, kind: str) -> str:
    got, _, body = resp
    assert got == status, body
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind and body["error"]["message"], body
    return body["error"]["message"]


@pytest.mark.parametrize("body,field", [
    ({"messages": USER}, "max_tokens"),
    ({"max_tokens": "3", "messages": USER}, "max_tokens"),
    ({"max_tokens": 3}, "messages"),
    ({"max_tokens": 3, "messages": [{"role": "system", "content": "x"}]}, "messages[0]"),
    ({"max_tokens": 3, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]},
     "messages[0].content[0].type"),
    ({"max_tokens": 3, "messages": USER, "stop_sequences": [""]}, "stop_sequences"),
    ({"max_tokens": 3, "messages": USER, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"max_tokens": 3, "messages": USER, "tools": TOOLS,
      "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ({"max_tokens": 3, "messages": USER, "tools": [{"type": "web_search_20250305", "name": "w"}]},
     "tools[0].type"),
    ({"max_tokens": 3, "messages": USER, "thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"max_tokens": 3, "messages": USER, "mcp_servers": [{"url": "x"}]}, "mcp_servers"),
    ({"max_tokens": 3, "messages": USER, "temperature": "hot"}, "temperature"),
    ({"max_tokens": 3, "messages": USER, "output_config": {"format": {"type": "xml"}}},
     "output_config.format"),
    ({"max_tokens": 3, "messages": USER, "output_format": {"type": "json_schema", "schema": {"type": 3}}},
     "output_format"),
])
def test_bad_fields_are_400_naming_them(live: Live, body: dict[str, Any], field: str) -> None:
    message = _anthropic_error(call(live, "/v1/messages", {"model": MODEL, **body}), 400,
                               "invalid_request_error")
    assert f"'{field}'" in message, message


def test_error_shapes_and_statuses(live: Live, client: anthropic.Anthropic) -> None:
    _anthropic_error(call(live, "/v1/messages", raw=b"{not json"), 400, "invalid_request_error")
    _anthropic_error(call(live, "/v1/messages/count_tokens", raw=b"[]"), 400,
                     "invalid_request_error")
    _anthropic_error(call(live, "/v1/messages", method="GET", raw=b""), 405,
                     "invalid_request_error")
    with pytest.raises(anthropic.NotFoundError) as nf:
        client.messages.create(model="claude-sonnet-4-5", max_tokens=3, messages=USER)
    assert nf.value.body["error"]["type"] == "not_found_error"
    long = [{"role": "user", "content": "word " * 600}]
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL, max_tokens=3, messages=long)
    assert "maximum context length" in bad.value.body["error"]["message"]
    # The OpenAI routes keep their own shape.
    status, _, body = call(live, "/v1/chat/completions", raw=b"{not json")
    assert status == 400 and set(body) == {"error"} and "param" in body["error"]


def test_queue_full_is_529_overloaded(live: Live) -> None:
    """Two streams hold the door of a server that admits --max-running-requests (2) +
    --max-queued-requests (0): the next request is Anthropic's 529 overloaded_error."""
    base = live.listen(dataclasses.replace(TEST_SERVER, max_queued_requests=0))
    client = _client(live, base)
    with contextlib.ExitStack() as held:
        for _ in range(live.engine.max_running_requests):
            stream = held.enter_context(client.messages.stream(
                model=MODEL, max_tokens=400, messages=USER, extra_body={"ignore_eos": True}))
            next(iter(stream))  # admitted: its first event came
        with pytest.raises(anthropic.InternalServerError) as err:
            client.messages.create(model=MODEL, max_tokens=3, messages=USER)
    assert err.value.status_code == 529 and err.value.body["error"]["type"] == "overloaded_error"
    assert int(err.value.response.headers["Retry-After"]) >= 1


def test_api_key_from_x_api_key_or_bearer(live: Live) -> None:
    base = live.listen(dataclasses.replace(TEST_SERVER, api_key="sekret"))
    for key in (None, "wrong"):
        headers = {} if key is None else {"x-api-key": key}
        _anthropic_error(call(live, "/v1/messages/count_tokens", {"messages": USER}, base=base,
                              headers=headers), 401, "authentication_error")
    # x-api-key is what Anthropic's clients send (this client version sends the api_key
    # as a bearer token: both must work).
    status, _, body = call(live, "/v1/messages/count_tokens", {"messages": USER}, base=base,
                           headers={"x-api-key": "sekret"})
    assert status == 200 and body["input_tokens"] > 0, body
    with pytest.raises(anthropic.AuthenticationError):
        _client(live, base, "wrong").messages.count_tokens(model=MODEL, messages=USER)
    assert _client(live, base, "sekret").messages.count_tokens(model=MODEL, messages=USER).input_tokens > 0
    bearer = anthropic.Anthropic(base_url=base, auth_token="sekret", max_retries=0, timeout=60)
    assert bearer.messages.create(model=MODEL, max_tokens=1, messages=USER).usage.output_tokens == 1
    # x-api-key is Anthropic's header: the OpenAI routes still want the bearer token.
    assert call(live, "/v1/models", method="GET", base=base, raw=b"",
                headers={"x-api-key": "sekret"})[0] == 401


def test_stream_disconnect_aborts(live: Live) -> None:
    baseline = live.wait_idle()
    aborted = _aborted(live)

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            resp = await s.post(live.url + "/v1/messages", json={
                "model": MODEL, "messages": USER, "max_tokens": 400, "ignore_eos": True,
                "stream": True})
            assert resp.status == 200
            first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 20)
            assert first.startswith(b"event: message_start\n")
            for _ in range(3):  # tokens are flowing
                await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 10)
            resp.close()

    asyncio.run(go())
    after = live.wait_idle(timeout=5)
    assert after.kv_pages_used == baseline.kv_pages_used == 0
    assert _aborted(live) == aborted + 1  # not finished: 400 tokens would take longer


def test_ping_before_a_slow_step(live: Live, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step slower than the keep-alive interval: a ping event, after message_start."""
    from ftserve.api.generation import Generation

    real = Generation.next
    calls = {"n": 0}

    async def slow(self: Generation, timeout: float | None = None) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            await asyncio.sleep(3 * TEST_SERVER.keepalive_interval)
            return None  # as a wait that timed out
        return await real(self, timeout)

    monkeypatch.setattr(Generation, "next", slow)

    async def go() -> bytes:
        async with aiohttp.ClientSession() as s, s.post(live.url + "/v1/messages", json={
                "model": MODEL, "messages": USER, "max_tokens": 3, "stream": True}) as resp:
            return await resp.read()

    body = asyncio.run(go())
    names = [line[7:] for line in body.decode().splitlines() if line.startswith("event: ")]
    assert names[0] == "message_start" and "ping" in names and names[-1] == "message_stop"
    live.wait_idle()


def test_engine_error_mid_stream_is_an_error_event(live: Live, monkeypatch: pytest.MonkeyPatch) -> None:
    from ftserve.api.generation import EngineRequestError, Generation

    real = Generation.next
    calls = {"n": 0}

    async def failing(self: Generation, timeout: float | None = None) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            self.close()  # what an engine failure leaves: the request gone
            raise EngineRequestError("the engine could not run this request")
        return await real(self, timeout)

    monkeypatch.setattr(Generation, "next", failing)

    async def go() -> bytes:
        async with aiohttp.ClientSession() as s, s.post(live.url + "/v1/messages", json={
                "model": MODEL, "messages": USER, "max_tokens": 5, "stream": True,
                "ignore_eos": True}) as resp:
            return await resp.read()

    frames = [f for f in asyncio.run(go()).decode().split("\n\n") if f]
    names = [f.split("\n")[0][7:] for f in frames]
    assert names[0] == "message_start" and names[-1] == "error" and "message_stop" not in names
    err = json.loads(frames[-1].split("\n")[1][6:])
    assert err["type"] == "error" and err["error"]["message"] == "the engine could not run this request"
    with pytest.raises(anthropic.APIStatusError):
        calls["n"] = 0
        _streamed(_client(live), model=MODEL, max_tokens=5, messages=USER)
    live.wait_idle()
