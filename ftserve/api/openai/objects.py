"""OpenAI's response objects: the chat completion and completion bodies, their
stream chunks, usage and logprobs (plain dicts, serialized with orjson).

Shapes follow what OpenAI and vLLM emit, so the official client parses them:
chat chunks carry ``delta``, completion chunks carry ``text``; usage has
``prompt_tokens_details.cached_tokens`` always.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ftserve.chat.text import StreamDetokenizer
from ftserve.engine.messages import TokenLogprob

if TYPE_CHECKING:
    from ftserve.api.driver import Choice

TokenText = Callable[[int], str]
TokenBytes = Callable[[int], bytes]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def usage_of(choices: list[Choice], n: int) -> dict[str, Any]:
    """A request's usage: each prompt counts once however many choices share it (n
    per prompt); prompts add up. Where the template marks reasoning, the reasoning
    tokens are counted too."""
    groups = [choices[i:i + n] for i in range(0, len(choices), n)]
    use = usage(sum(g[0].gen.prompt_tokens for g in groups),
                sum(c.gen.completion_tokens for c in choices),
                sum(max(c.gen.cached_tokens for c in group) for group in groups))
    if any(c.tracks_reasoning for c in choices):
        use["completion_tokens_details"] = {"reasoning_tokens": sum(c.reasoning_tokens
                                                                    for c in choices)}
    return use


def chat_logprobs(items: list[TokenLogprob], token_text: TokenText,
                  token_bytes: TokenBytes) -> dict[str, Any]:
    """``bytes`` are the token's own bytes, not those of ``token``: a byte token's
    ``token`` is U+FFFD, and the bytes are how a client puts the character together."""
    def entry(tid: int, lp: float) -> dict[str, Any]:
        return {"token": token_text(tid), "logprob": lp, "bytes": list(token_bytes(tid))}

    return {"content": [{**entry(item.token_id, item.logprob),
                         "top_logprobs": [entry(tid, lp) for tid, lp in item.top]}
                        for item in items]}


class TextOffsets:
    """Where each generated token's text starts in a completion choice's text.

    A token's own text is not what it adds to the choice's text: a skipped special
    token adds nothing, a byte token adds part of a character (the character counts
    once its last byte arrives), and a stream's chunks lag behind the text a stop
    string holds back. So the tokens go through a detokenizer of their own (no stop
    strings), one at a time, and a token's offset is the text it had before it.
    """

    def __init__(self, detok: StreamDetokenizer, start: int = 0) -> None:
        self._detok = detok
        self._pos = start  # echo: the generated tokens start after the prompt's text

    def of(self, token_ids: list[int]) -> list[int]:
        out = []
        for t in token_ids:
            out.append(self._pos)
            self._pos += len(self._detok.push([t]))
        return out


def completion_logprobs(
    items: list[TokenLogprob], token_text: TokenText, offsets: TextOffsets
) -> dict[str, Any]:
    """Legacy completions format; ``offsets`` has seen the choice's earlier tokens.
    Each ``top_logprobs`` entry also holds the sampled token (OpenAI: up to
    logprobs + 1 entries): a temperature draw, a logit_bias or a grammar can pick a
    token outside the top ``logprobs``."""
    tops = []
    for item in items:
        top = {token_text(tid): lp for tid, lp in item.top}
        top.setdefault(token_text(item.token_id), item.logprob)
        tops.append(top)
    return {
        "tokens": [token_text(item.token_id) for item in items],
        "token_logprobs": [item.logprob for item in items],
        "top_logprobs": tops,
        "text_offset": offsets.of([item.token_id for item in items]),
    }


def echo_logprobs(
    prompt_ids: list[int], items: list[TokenLogprob | None], token_text: TokenText,
    offsets: TextOffsets,
) -> dict[str, Any]:
    """The prompt's part of a completion choice's logprobs under echo (OpenAI's
    legacy format: the first token has no logprob and no alternatives)."""
    tops: list[dict[str, float] | None] = []
    for tid, item in zip(prompt_ids, items):
        if item is None:
            tops.append(None)
            continue
        top = {token_text(t): lp for t, lp in item.top}
        top.setdefault(token_text(tid), item.logprob)
        tops.append(top)
    return {
        "tokens": [token_text(t) for t in prompt_ids],
        "token_logprobs": [None if item is None else item.logprob for item in items],
        "top_logprobs": tops,
        "text_offset": offsets.of(prompt_ids),
    }


def join_logprobs(head: dict[str, Any], tail: dict[str, Any] | None) -> dict[str, Any]:
    """Two parts of a completion choice's logprobs, one after the other."""
    if tail is None:
        return head
    return {key: head[key] + tail[key] for key in head}


def whole_choice(
    body: dict[str, Any], index: int, want_prompt_logprobs: bool, prompt_ids: list[int],
    prompt_lps: list[TokenLogprob | None] | None, token_text: TokenText,
) -> dict[str, Any]:
    """A whole reply's choice ``index`` (its single-choice ``body`` renumbered), with
    vLLM's "prompt_logprobs" where they were asked for and computed."""
    entry = {**body["choices"][0], "index": index}
    if want_prompt_logprobs and prompt_lps is not None:
        entry["prompt_logprobs"] = vllm_prompt_logprobs(prompt_ids, prompt_lps, token_text)
    return entry


def vllm_prompt_logprobs(
    prompt_ids: list[int], items: list[TokenLogprob | None], token_text: TokenText,
) -> list[dict[str, dict[str, Any]] | None]:
    """A choice's "prompt_logprobs" as vLLM gives them: per prompt token (None for
    the first), token id (a string) -> logprob, rank and decoded token, for the
    prompt's own token and its best alternatives."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for tid, item in zip(prompt_ids, items):
        if item is None:
            out.append(None)
            continue
        entry = {str(tid): {"logprob": item.logprob, "rank": item.rank, "decoded_token": token_text(tid)}}
        for rank, (t, lp) in enumerate(item.top, start=1):
            entry.setdefault(str(t), {"logprob": lp, "rank": rank, "decoded_token": token_text(t)})
        out.append(entry)
    return out


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
    text: str | None,
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
