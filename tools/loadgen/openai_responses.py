"""OpenAI's Responses API for the load generator: the request body and the stream's events.

Profiles build OpenAI chat bodies; ``responses_body`` is the one place that turns one into a
``POST /v1/responses`` body (stateless, as Codex sends it: the whole conversation as input,
``store: false``)::

    system / developer messages   -> "instructions" (joined by blank lines)
    user                          -> a user message item (input_text)
    assistant content / tool_calls -> an assistant message item (output_text), then one
                                     function_call item per call
    tool (tool_call_id, content)  -> a function_call_output item
    tools [{type: function, function: {...}}] -> [{type: function, name, description, parameters}]
    max_tokens                    -> max_output_tokens

``StreamState`` reads the stream's events (response.*_delta, response.completed /
response.incomplete, error) as the client's OpenAI reader reads chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tools.loadgen.anthropic import StreamError, Usage, content_text

# Fields with the same name and meaning in both APIs (top_k, ignore_eos, seed, stop: ftserve's
# extensions, which its /v1/responses accepts too).
_PASSTHROUGH = ("model", "temperature", "top_p", "top_k", "ignore_eos", "seed", "stop",
                "tool_choice", "parallel_tool_calls")
_DELTAS = ("response.output_text.delta", "response.reasoning_text.delta",
           "response.function_call_arguments.delta")


def _items(msg: dict[str, Any]) -> list[dict[str, Any]]:
    role = msg["role"]
    if role == "tool":
        return [{"type": "function_call_output", "call_id": msg["tool_call_id"],
                 "output": content_text(msg.get("content"))}]
    if role == "user":
        return [{"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": content_text(msg.get("content"))}]}]
    if role != "assistant":
        raise ValueError(f"no Responses form for role {role!r}")
    items: list[dict[str, Any]] = []
    text = content_text(msg.get("content"))
    if text:
        items.append({"type": "message", "role": "assistant",
                      "content": [{"type": "output_text", "text": text}]})
    for call in msg.get("tool_calls") or []:
        fn = call["function"]
        args = fn.get("arguments")
        items.append({"type": "function_call", "call_id": call["id"], "name": fn["name"],
                      "arguments": args if isinstance(args, str) else "{}"})
    return items


def responses_body(body: dict[str, Any]) -> dict[str, Any]:
    """The /v1/responses body for an OpenAI chat body (without stream fields)."""
    if "messages" not in body:
        raise ValueError("the responses endpoint needs a chat body (messages), not a prompt")
    out: dict[str, Any] = {k: body[k] for k in _PASSTHROUGH if k in body}
    if isinstance(out.get("tool_choice"), dict):
        out["tool_choice"] = {"type": "function", "name": out["tool_choice"]["function"]["name"]}
    limit = body.get("max_tokens") or body.get("max_completion_tokens")
    if limit:
        out["max_output_tokens"] = int(limit)
    system: list[str] = []
    items: list[dict[str, Any]] = []
    for m in body["messages"]:
        if m["role"] in ("system", "developer"):
            system.append(content_text(m.get("content")))
        else:
            items.extend(_items(m))
    if system:
        out["instructions"] = "\n\n".join(system)
    out["input"] = items
    out["store"] = False
    if body.get("tools"):
        out["tools"] = [{"type": "function", "name": t["function"]["name"],
                         "description": t["function"].get("description", ""),
                         "parameters": t["function"].get("parameters")
                         or {"type": "object", "properties": {}}}
                        for t in body["tools"]]
    return out


@dataclass
class StreamState:
    """What one stream's events have said so far."""

    done: bool = False  # response.completed / response.incomplete arrived
    finish_reason: str | None = None  # "stop" (completed) or the incomplete reason
    usage: Usage | None = None

    def feed(self, obj: dict[str, Any]) -> tuple[str, str] | None:
        """Read one event. Returns (timed piece, reply text) for a delta that carries
        something (text, reasoning or call arguments; only text goes into the reply)."""
        kind = obj.get("type")
        if kind in _DELTAS:
            piece = obj.get("delta") or ""
            if not piece:
                return None
            return piece, (piece if kind == "response.output_text.delta" else "")
        if kind in ("response.completed", "response.incomplete"):
            resp = obj.get("response") or {}
            u = resp.get("usage") or {}
            self.usage = Usage(u.get("input_tokens") or 0,
                               (u.get("input_tokens_details") or {}).get("cached_tokens") or 0,
                               u.get("output_tokens") or 0)
            self.finish_reason = ("stop" if kind == "response.completed"
                                  else (resp.get("incomplete_details") or {}).get("reason"))
            self.done = True
        elif kind in ("error", "response.failed"):
            err = obj.get("error") if kind == "response.failed" else obj
            err = err or {}
            raise StreamError(f"{err.get('code') or 'error'}: {err.get('message', err)}")
        return None
