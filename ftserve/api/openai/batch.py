"""/v1/completions prompt batches and echo, as OpenAI and vLLM do them.

A batch of P prompts with n choices each is P x n engine requests (at most
MAX_CHOICES); choice index = prompt_index * n + j. Every prompt is encoded and
validated (ids in range, not empty, fits the context) before any is submitted, so a
bad batch is a 400 naming the prompt index and leaves nothing running. With
``echo`` each choice's text starts with its prompt's text (a string prompt as sent,
token ids decoded); with ``logprobs`` too, the choice's logprobs start with the
prompt's tokens (the engine's prompt logprobs; the first token has none).
"""

from __future__ import annotations

from typing import Any

from ftserve.api.generation import Generation
from ftserve.api.openai import objects as R
from ftserve.api.state import EngineAPI
from ftserve.chat.errors import RequestError, bad_request
from ftserve.chat.request import ChatRequest
from ftserve.chat.text import TextCodec
from ftserve.engine.sampling_params import SamplingParams


def _where(index: int, count: int) -> str:
    return f"prompt[{index}]: " if count > 1 else ""


async def encode_prompts(parsed: ChatRequest, engine: EngineAPI,
                         text: TextCodec) -> list[list[int]]:
    """Each prompt of a completion request as token ids, checked; errors name the index."""
    count = len(parsed.prompts)
    out: list[list[int]] = []
    for i, prompt in enumerate(parsed.prompts):
        if isinstance(prompt, str):
            ids = await text.encode_async(prompt, add_special_tokens=True)
            if not ids:
                raise bad_request(f"{_where(i, count)}the prompt encodes to zero tokens",
                                  param="prompt")
        else:
            ids = prompt
            bad = next((t for t in ids if not 0 <= t < engine.vocab_size), None)
            if bad is not None:
                raise bad_request(f"{_where(i, count)}prompt token id {bad} is out of range "
                                  f"[0, {engine.vocab_size})", param="prompt")
        out.append(ids)
    return out


def truncate(parsed: ChatRequest, ids: list[int], max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: max_model_len)."""
    k = parsed.truncate_prompt_tokens
    if k is None:
        return ids
    k = max_model_len if k == -1 else k
    return ids[-k:] if len(ids) > k else ids


def echo_heads(parsed: ChatRequest, text: TextCodec, prompts: list[list[int]],
               full_lens: list[int]) -> list[str] | None:
    """With echo: each prompt's text, else None. A string prompt as sent, unless
    truncate_prompt_tokens cut it (``full_lens``: the lengths before); token ids decoded."""
    if not parsed.echo:
        return None
    return [p if isinstance(p, str) and len(ids) == n else text.decode(ids, parsed.skip_special_tokens)
            for p, ids, n in zip(parsed.prompts, prompts, full_lens)]


def build_all(parsed: ChatRequest, prompts: list[list[int]], engine: EngineAPI,
              defaults: dict[str, Any] | None = None) -> list[SamplingParams]:
    """Sampling params per prompt (``defaults``: the checkpoint's, for fields the request
    leaves out); a prompt too long for the context is a 400 naming its index."""
    out: list[SamplingParams] = []
    for i, ids in enumerate(prompts):
        try:
            out.append(parsed.build_params(len(ids), engine.max_model_len, engine.vocab_size,
                                           defaults))
        except RequestError as err:
            if len(prompts) == 1 or err.param != "prompt":
                raise
            raise RequestError(_where(i, len(prompts)) + err.message, err.param, err.code,
                               err.status) from None
    return out


def usage(gens: list[Generation], n: int) -> dict[str, Any]:
    """Each prompt counts once however many choices share it; prompts add up."""
    groups = [gens[i:i + n] for i in range(0, len(gens), n)]
    use = R.usage(sum(g[0].prompt_tokens for g in groups),
                  sum(g.completion_tokens for g in gens),
                  sum(max(g.cached_tokens for g in group) for group in groups))
    if any(g.tracks_reasoning for g in gens):  # the template marks reasoning: count its tokens
        use["completion_tokens_details"] = {"reasoning_tokens": sum(g.reasoning_tokens for g in gens)}
    return use
