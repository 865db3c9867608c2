"""Streaming client (OpenAI chat / completions, Anthropic messages): one request, timed chunk by
chunk.

Timings use ``time.perf_counter()``; a record's ``start`` is relative to the run's t0 so records
from one run share a clock. TTFT is the arrival of the first chunk that carries text; each later
text chunk adds one inter-token latency (as vLLM's benchmark does: a chunk that carries several
tokens counts once). On /v1/messages a "chunk" is a content_block_delta carrying text, thinking or
tool input; only text goes into the record's ``text``.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from tools.loadgen import anthropic, openai_responses
from tools.loadgen.anthropic import StreamError

# ftserve names itself in every response (--replica-id); routers pass the header on, so a
# run through a router records which replica served each request.
REPLICA_HEADER = "X-Ftserve-Replica"


@dataclass
class RequestSpec:
    """What to send. ``abort_after_chunks`` > 0 closes the stream after that many text chunks."""

    endpoint: str  # "chat" | "completions" | "messages" | "responses"
    # OpenAI messages or prompt, plus sampling fields; stream fields are added, and for
    # "messages" the chat body is converted (anthropic.messages_body)
    body: dict[str, Any]
    kind: str  # profile name or "canary"
    session: int = -1
    turn: int = -1
    abort_after_chunks: int = 0


@dataclass
class RequestRecord:
    kind: str
    session: int
    turn: int
    phase: str  # "warmup" | "measure" | "canary"
    start: float  # seconds since the run's t0
    status: str = "ok"  # "ok" | "aborted" | "error" | "cancelled"
    error_kind: str | None = None  # e.g. "http_503", "timeout", "connection", "stream"
    error: str | None = None
    http_status: int | None = None
    ttft: float | None = None  # seconds
    e2e: float | None = None  # seconds; set for every record that finished its HTTP exchange
    itl: list[float] = field(default_factory=list)  # seconds between text chunks
    chunk_times: list[float] = field(default_factory=list)  # seconds since t0, per text chunk
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int = 0
    finish_reason: str | None = None
    replica: str | None = None  # the worker that answered, when it says (REPLICA_HEADER)
    text: str = ""

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first, as vLLM defines it."""
        if self.status != "ok" or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_json(self, with_text: bool = False) -> dict[str, Any]:
        d = asdict(self)
        d.pop("chunk_times")
        if not with_text:
            d.pop("text")
        d["tpot"] = self.tpot
        return d


class Cancelled(Exception):
    """Carries the partial record of a request cancelled by drain timeout or Ctrl-C."""

    def __init__(self, record: RequestRecord) -> None:
        super().__init__("cancelled")
        self.record = record


def _path(endpoint: str) -> str:
    if endpoint == "chat":
        return "/v1/chat/completions"
    if endpoint == "completions":
        return "/v1/completions"
    if endpoint == "messages":
        return "/v1/messages"
    if endpoint == "responses":
        return "/v1/responses"
    raise ValueError(f"unknown endpoint {endpoint!r}")


def _delta_text(choice: dict[str, Any]) -> str:
    if "delta" in choice:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


class _OpenAIReader:
    """OpenAI chunks: each choice that carries text is one timed piece; ``data: [DONE]`` ends."""

    end = "data: [DONE]"

    def __init__(self) -> None:
        self.done = False

    def feed(self, payload: bytes, rec: RequestRecord) -> list[tuple[str, str]]:
        if payload == b"[DONE]":
            self.done = True
            return []
        obj = json.loads(payload)
        if "error" in obj:
            err = obj["error"]
            raise StreamError(err.get("message", str(err)) if isinstance(err, dict) else str(err))
        usage = obj.get("usage")
        if usage:
            rec.prompt_tokens = usage.get("prompt_tokens")
            rec.output_tokens = usage.get("completion_tokens") or 0
            rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        pieces = []
        for choice in obj.get("choices") or []:
            if choice.get("finish_reason"):
                rec.finish_reason = choice["finish_reason"]
            text = _delta_text(choice)
            if text:
                pieces.append((text, text))
        return pieces


class _MessagesReader:
    """Anthropic events: each content_block_delta that carries something is one timed piece;
    usage comes with message_delta, as OpenAI's comes last; message_stop ends. With
    ``responses``, the Responses API's events: each delta is a piece; response.completed
    (or response.incomplete) carries the usage and ends."""

    def __init__(self, responses: bool = False) -> None:
        self.state: anthropic.StreamState | openai_responses.StreamState = (
            openai_responses.StreamState() if responses else anthropic.StreamState())
        self.end = "event: response.completed" if responses else "event: message_stop"

    @property
    def done(self) -> bool:
        return self.state.done

    def feed(self, payload: bytes, rec: RequestRecord) -> list[tuple[str, str]]:
        got = self.state.feed(json.loads(payload))
        if self.state.usage is not None:
            u = self.state.usage
            rec.prompt_tokens, rec.cached_tokens, rec.output_tokens = (
                u.prompt_tokens, u.cached_tokens, u.output_tokens)
            rec.finish_reason = self.state.finish_reason
        return [got] if got else []


async def send(
    session: aiohttp.ClientSession,
    base_url: str,
    spec: RequestSpec,
    t0: float,
    phase: str,
    timeout_s: float,
    headers: dict[str, str] | None = None,
) -> RequestRecord:
    """Send one streaming request and time it. Never raises except on task cancellation."""
    reader: _OpenAIReader | _MessagesReader
    if spec.endpoint == "messages":
        # A body the conversion cannot express is a profile bug: raised, not recorded.
        body = anthropic.messages_body(spec.body)
        reader = _MessagesReader()
    elif spec.endpoint == "responses":
        body = openai_responses.responses_body(spec.body)
        reader = _MessagesReader(responses=True)
    else:
        body = dict(spec.body)
        body["stream_options"] = {"include_usage": True}
        reader = _OpenAIReader()
    body["stream"] = True
    start = time.perf_counter()
    rec = RequestRecord(spec.kind, spec.session, spec.turn, phase, start - t0)
    pieces: list[str] = []
    last = start
    chunks = 0
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(base_url + _path(spec.endpoint), json=body, headers=headers) as resp:
                rec.http_status = resp.status
                rec.replica = resp.headers.get(REPLICA_HEADER)
                if resp.status != 200:
                    detail = (await resp.text())[:300]
                    rec.status, rec.error_kind, rec.error = "error", f"http_{resp.status}", detail
                    return rec
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue  # blank separators, "event:" names, ": keep-alive" comments
                    for _piece, text in reader.feed(line[5:].strip(), rec):
                        now = time.perf_counter()
                        if chunks == 0:
                            rec.ttft = now - start
                        else:
                            rec.itl.append(now - last)
                        last = now
                        chunks += 1
                        rec.chunk_times.append(now - t0)
                        pieces.append(text)
                        if spec.abort_after_chunks and chunks >= spec.abort_after_chunks:
                            # Closing the response mid-stream is what an interrupting user does;
                            # the server must free the request's pages.
                            rec.status = "aborted"
                            resp.close()
                            break
                    if rec.status == "aborted" or reader.done:
                        break
                if rec.status == "ok" and not reader.done:
                    rec.status, rec.error_kind = "error", "stream_truncated"
                    rec.error = f"stream ended without {reader.end}"
    except StreamError as e:
        rec.status, rec.error_kind, rec.error = "error", "stream_error", str(e)
    except TimeoutError:
        rec.status, rec.error_kind, rec.error = "error", "timeout", f"no completion in {timeout_s}s"
    except aiohttp.ClientError as e:
        rec.status, rec.error_kind, rec.error = "error", "connection", f"{type(e).__name__}: {e}"
    except (ValueError, KeyError, TypeError) as e:
        rec.status, rec.error_kind, rec.error = "error", "bad_stream", f"{type(e).__name__}: {e}"
    except asyncio.CancelledError:
        rec.status, rec.error_kind = "cancelled", None
        rec.text = "".join(pieces)
        rec.e2e = time.perf_counter() - start
        raise Cancelled(rec) from None
    finally:
        rec.text = "".join(pieces)
        if rec.e2e is None:
            rec.e2e = time.perf_counter() - start
        if rec.status == "aborted" or (rec.status == "ok" and not rec.output_tokens):
            # No usage chunk reaches an aborted stream; count text chunks instead.
            rec.output_tokens = max(rec.output_tokens, chunks)
    return rec

