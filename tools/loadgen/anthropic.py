"""Anthropic Messages API for the load generator: the request body and the stream's events.

Profiles build OpenAI chat bodies; ``messages_body`` is the one place that turns one into a
``POST /v1/messages`` body, so every profile that speaks chat can speak Messages too::

    system messages               -> top-level "system" (joined by blank lines)
    user                          -> a user message (text blocks)
    assistant content / tool_calls -> text block, then one tool_use block per call
                                     (arguments parsed into "input")
    tool (tool_call_id, content)  -> a tool_result block in a user message
    tools [{type: function, ...}] -> [{name, description, input_schema}]
    tool_choice, parallel_tool_calls, stop -> tool_choice, disable_parallel_tool_use,
                                     stop_sequences

Consecutive messages of one role are merged into one (Anthropic requires user and assistant
to alternate; the results of parallel calls go back in one user turn). ``max_tokens`` is always
set: Anthropic requires it.

``StreamState`` reads the named SSE events (message_start, content_block_*, message_delta,
message_stop, ping, error) as the client's OpenAI reader reads chunks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

ANTHROPIC_VERSION = "2023-06-01"
DEFAULT_MAX_TOKENS = 1024  # only when the OpenAI body had none; Anthropic refuses a body without
# Sampling fields with the same name and meaning in both APIs (ignore_eos, seed: ftserve's
# extensions, which its /v1/messages accepts too).
_PASSTHROUGH = ("model", "temperature", "top_p", "top_k", "ignore_eos", "seed")


class StreamError(Exception):
    """An ``error`` event in the stream."""


def headers(api_key: str | None) -> dict[str, str]:
    """Anthropic's clients send the key as x-api-key (ftserve accepts it on /v1/messages)."""
    h = {"anthropic-version": ANTHROPIC_VERSION}
    if api_key:
        h["x-api-key"] = api_key
    return h


def content_text(content: Any) -> str:
    """OpenAI content: a string, or a list of {type: text, text} parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


def _blocks(msg: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """(Anthropic role, content blocks) of one OpenAI message."""
    role = msg["role"]
    if role == "tool":
        return "user", [{"type": "tool_result", "tool_use_id": msg["tool_call_id"],
                         "content": content_text(msg.get("content"))}]
    if role == "user":
        return "user", [{"type": "text", "text": content_text(msg.get("content"))}]
    if role != "assistant":
        raise ValueError(f"no Anthropic form for role {role!r}")
    blocks: list[dict[str, Any]] = []
    text = content_text(msg.get("content"))
    if text:
        blocks.append({"type": "text", "text": text})
    for call in msg.get("tool_calls") or []:
        fn = call["function"]
        args = fn.get("arguments")
        # OpenAI sends arguments as a JSON string; Anthropic's tool_use input is the object.
        inp = json.loads(args) if isinstance(args, str) and args else (args or {})
        blocks.append({"type": "tool_use", "id": call["id"], "name": fn["name"], "input": inp})
    if not blocks:
        blocks.append({"type": "text", "text": ""})  # keeps the turns alternating
    return "assistant", blocks


def _tool_choice(choice: Any, parallel: Any) -> dict[str, Any] | None:
    if choice is None and parallel is None:
        return None
    if isinstance(choice, dict):
        out: dict[str, Any] = {"type": "tool", "name": choice["function"]["name"]}
    else:
        out = {"type": {"required": "any", "none": "none"}.get(choice or "auto", "auto")}
    if parallel is False:
        out["disable_parallel_tool_use"] = True
    return out


def messages_body(body: dict[str, Any]) -> dict[str, Any]:
    """The /v1/messages body for an OpenAI chat body (without stream fields)."""
    if "messages" not in body:
        raise ValueError("the messages endpoint needs a chat body (messages), not a prompt")
    out: dict[str, Any] = {k: body[k] for k in _PASSTHROUGH if k in body}
    out["max_tokens"] = int(body.get("max_tokens") or body.get("max_completion_tokens")
                            or DEFAULT_MAX_TOKENS)
    system: list[str] = []
    msgs: list[dict[str, Any]] = []
    for m in body["messages"]:
        if m["role"] in ("system", "developer"):
            system.append(content_text(m.get("content")))
            continue
        role, blocks = _blocks(m)
        if msgs and msgs[-1]["role"] == role:
            msgs[-1]["content"].extend(blocks)
        else:
            msgs.append({"role": role, "content": blocks})
    if system:
        out["system"] = "\n\n".join(system)
    out["messages"] = msgs
    if body.get("tools"):
        out["tools"] = [{"name": t["function"]["name"],
                         "description": t["function"].get("description", ""),
                         "input_schema": t["function"].get("parameters")
                         or {"type": "object", "properties": {}}}
                        for t in body["tools"]]
    choice = _tool_choice(body.get("tool_choice"), body.get("parallel_tool_calls"))
    if choice is not None:
        out["tool_choice"] = choice
    stop = body.get("stop")
    if stop:
        out["stop_sequences"] = [stop] if isinstance(stop, str) else list(stop)
    return out


@dataclass
class Usage:
    """Anthropic usage, as the record counts it: the prompt is uncached + cache reads (+ writes)."""

    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


@dataclass
class StreamState:
    """What one stream's events have said so far."""

    done: bool = False  # message_stop arrived
    finish_reason: str | None = None  # stop_reason
    usage: Usage | None = None  # set by message_delta: final, as OpenAI's last usage chunk
    _usage: dict[str, Any] = field(default_factory=dict)  # message_start's, merged into

    def feed(self, obj: dict[str, Any]) -> tuple[str, str] | None:
        """Read one event. Returns (timed piece, reply text) for a content delta that carries
        something (text, thinking or tool input; only text goes into the reply), else None."""
        kind = obj.get("type")
        if kind == "content_block_delta":
            d = obj.get("delta") or {}
            piece = d.get("text") or d.get("thinking") or d.get("partial_json") or ""
            if not piece:
                return None
            return piece, (piece if d.get("type") == "text_delta" else "")
        if kind == "message_start":
            self._usage = dict((obj.get("message") or {}).get("usage") or {})
        elif kind == "message_delta":
            self._usage.update(obj.get("usage") or {})
            self.finish_reason = (obj.get("delta") or {}).get("stop_reason")
            u = self._usage
            cached = u.get("cache_read_input_tokens") or 0
            prompt = (u.get("input_tokens") or 0) + cached + (u.get("cache_creation_input_tokens") or 0)
            self.usage = Usage(prompt, cached, u.get("output_tokens") or 0)
        elif kind == "message_stop":
            self.done = True
        elif kind == "error":
            err = obj.get("error") or {}
            raise StreamError(f"{err.get('type', 'error')}: {err.get('message', err)}")
        return None  # ping, content_block_start / stop
