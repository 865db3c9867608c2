"""OpenAI response and SSE chunk builders (plain dicts, serialized with orjson).

Shapes follow what OpenAI and vLLM emit, so the official client parses them:
chat chunks carry ``delta``, completion chunks carry ``text``; usage has
``prompt_tokens_details.cached_tokens`` always.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ftserve.engine.messages import TokenLogprob

TokenText = Callable[[int], str]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def chat_logprobs(items: list[TokenLogprob], token_text: TokenText) -> dict[str, Any]:
    content = []
    for item in items:
        text = token_text(item.token_id)
        content.append(
            {
                "token": text,
                "logprob": item.logprob,
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {"token": (t := token_text(tid)), "logprob": lp, "bytes": list(t.encode("utf-8"))}
                    for tid, lp in item.top
                ],
            }
        )
    return {"content": content}


def completion_logprobs(
    items: list[TokenLogprob], token_text: TokenText, text_offset: int
) -> dict[str, Any]:
    """Legacy completions format; ``text_offset`` is where this batch of tokens starts."""
    tokens, lps, tops, offsets = [], [], [], []
    for item in items:
        text = token_text(item.token_id)
        tokens.append(text)
        lps.append(item.logprob)
        tops.append({token_text(tid): lp for tid, lp in item.top})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
    token_ids: list[int] | None = None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "delta": delta,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def completion_chunk(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
    token_ids: list[int] | None = None,
    prompt_token_ids: list[int] | None = None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = prompt_token_ids
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def usage_chunk(rid: str, created: int, model: str, obj: str, use: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}


def chat_response(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str,
    use: dict[str, Any],
    logprobs: dict[str, Any] | None,
    token_ids: list[int] | None,
    prompt_token_ids: list[int] | None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
    out: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": use,
    }
    if prompt_token_ids is not None:
        out["prompt_token_ids"] = prompt_token_ids
    return out


def completion_response(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str,
    use: dict[str, Any],
    logprobs: dict[str, Any] | None,
    token_ids: list[int] | None,
    prompt_token_ids: list[int] | None,
) -> dict[str, Any]:
    out = completion_chunk(
        rid, created, model, text, finish_reason, logprobs, token_ids, prompt_token_ids
    )
    out["usage"] = use
    return out
