"""The internal request every protocol maps into (``ChatRequest``), and the checks
that do not depend on the protocol: a forced tool_choice against the offered tools,
an output constraint with tools, continuing the last message, the context window.

Field types and shapes are each protocol's business (ftserve/api/*/models.py, where
a bad field is a 400 naming it as that protocol's client sent it); a check here
names the field through what the protocol passes in.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from ftserve.chat.errors import RequestError, bad_request
from ftserve.chat.response_format import ResponseFormat
from ftserve.chat.tool_choice import ForcedCall
from ftserve.engine.sampling_params import SamplingParams, SamplingParamsError

MAX_CHOICES = 16  # prompts x n: each choice is its own engine request (its own KV and batch slot)
# Names the server itself passes to the chat template (chat_template_kwargs cannot set them).
TEMPLATE_RESERVED = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                     "flatten")


@dataclass(frozen=True)
class ChatRequest:
    """What a client asked for, whichever protocol it spoke: a chat (``messages``,
    rendered by the chat template) or a raw completion (``prompts``). Every route
    validates its body with its own declared models (ftserve/api/*/models.py) and
    maps it into this; from here on nothing knows the protocol."""

    kind: Literal["chat", "completion"]
    model: str | None
    # The field the prompt came in, as the client named it (context-length and
    # template errors name it): "messages", "prompt" or "input".
    prompt_field: str = "messages"
    messages: list[dict[str, Any]] | None = None  # chat: {"role", "content"} (+ tool fields)
    prompts: tuple[str | list[int], ...] = ()  # completion: strings or token ids, a batch of 1+
    echo: bool = False  # completion: each choice's text starts with its prompt's
    add_generation_prompt: bool = True
    # continue_final_message (vLLM): the last message is an assistant's start, left open
    # for the model to continue (no end-of-turn after it, no generation prompt).
    continue_final: bool = False
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (vLLM): usage on every chunk
    stop: tuple[str, ...] = ()
    include_stop: bool = False  # include_stop_str_in_output (vLLM): the text ends with the stop
    max_tokens: int | None = None  # None = whatever context remains (chat) / 16 (completion)
    logprobs: int | None = None  # alternatives per token; None = no logprobs
    # vLLM's prompt_logprobs: alternatives per prompt token, returned as the
    # choice's "prompt_logprobs" (non-streamed responses); None = off.
    prompt_logprobs: int | None = None
    # Completions echo with max_tokens 0 (OpenAI's legacy scoring call): the engine runs
    # one token (max_tokens 1), which the response leaves out.
    score_only: bool = False
    # vLLM's truncate_prompt_tokens: keep the prompt's last k tokens (-1: as many as
    # the context holds); None = the whole prompt.
    truncate_prompt_tokens: int | None = None
    return_token_ids: bool = False
    skip_special_tokens: bool = True
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams kwargs
    n: int = 1  # choices: one engine request each, the same prompt (seeds: seed + i)
    tools: list[dict[str, Any]] | None = None  # chat: rendered by the template, calls parsed
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs
    parallel_tool_calls: bool = True  # False: only the first call the model writes is returned
    forced: ForcedCall | None = None  # tool_choice "required" or a named function (tool_choice.py)
    response_format: ResponseFormat | None = None  # output constraint (response_format.py)
    # Anthropic's thinking switch: the template's enable_thinking where it reads one
    # (None: the template's default).
    thinking: bool | None = None

    def build_params(self, prompt_len: int, max_model_len: int, vocab_size: int,
                     defaults: dict[str, Any] | None = None) -> SamplingParams:
        """Resolve max_tokens against the context window and validate everything.
        ``defaults`` (generation_defaults.py) fill the sampling fields the request left out."""
        if prompt_len >= max_model_len:
            raise context_length_error(prompt_len, self.max_tokens or 0, max_model_len,
                                           self.prompt_field)
        room = max_model_len - prompt_len
        if self.max_tokens is None:
            max_tokens = room if self.kind == "chat" else min(16, room)
        else:
            max_tokens = self.max_tokens
            if prompt_len + max_tokens > max_model_len:
                raise context_length_error(prompt_len, max_tokens, max_model_len,
                                           self.prompt_field)
        params = SamplingParams(max_tokens=max_tokens, logprobs=self.logprobs,
                                prompt_logprobs=self.engine_prompt_logprobs,
                                **{**(defaults or {}), **self.sampling})
        try:
            params.validate(vocab_size)
        except SamplingParamsError as err:
            raise bad_request(str(err), param=err.param) from None
        return params

    @property
    def echo_logprobs(self) -> bool:
        """Completions echo + logprobs: choice.logprobs starts with the prompt's tokens."""
        return self.echo and self.logprobs is not None

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token the engine computes (None: no prompt logprobs)."""
        wanted = [k for k in (self.logprobs if self.echo_logprobs else None, self.prompt_logprobs)
                  if k is not None]
        return max(wanted) if wanted else None

    def truncated(self, ids: list[int], max_model_len: int) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: max_model_len)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return ids
        k = max_model_len if k == -1 else k
        return ids[-k:] if len(ids) > k else ids

    def choice_params(self, params: SamplingParams, index: int) -> SamplingParams:
        """Choice ``index`` of n: a given seed becomes seed + index (wrapped to 64 bits),
        so the choices are distinct draws and the whole response is reproducible."""
        if index == 0 or params.seed is None:
            return params
        return dataclasses.replace(params, seed=(params.seed + index + 2**63) % 2**64 - 2**63)


def context_length_error(prompt_len: int, max_tokens: int, limit: int,
                         param: str = "messages") -> RequestError:
    return bad_request(
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
        f"completion). Please reduce the length of the prompt or the completion.",
        param=param,
        code="context_length_exceeded",
    )


def message(role: str, content: str, *, name: str | None = None,
            tool_calls: list[dict[str, Any]] | None = None, tool_call_id: str | None = None,
            reasoning: str | None = None) -> dict[str, Any]:
    """One message as the chat template reads it, whichever protocol it came in:
    ``content`` text, earlier ``tool_calls`` as {id, type, function: {name, arguments}}
    with the arguments an object (templates expect it, as vLLM gives it), and
    ``reasoning_content`` for templates that show an earlier turn's reasoning. The
    keys always come in this order."""
    entry: dict[str, Any] = {"role": role, "content": content}
    if name is not None:
        entry["name"] = name
    if tool_calls:
        entry["tool_calls"] = tool_calls
    if tool_call_id is not None:
        entry["tool_call_id"] = tool_call_id
    if reasoning is not None:
        entry["reasoning_content"] = reasoning
    return entry


def offered_tools(tools: list[dict[str, Any]] | None, forced: ForcedCall | None,
                  choice_none: bool) -> tuple[list[dict[str, Any]] | None, ForcedCall | None]:
    """(the tools the template renders, the forced call). tool_choice "none" offers
    none; a forced call needs tools, and a named one must be among them (a 400
    naming ``tool_choice``, whatever the protocol spells inside it)."""
    if choice_none or not tools:
        tools = None
    if forced is None:
        return tools, None
    if not tools:
        raise bad_request("'tool_choice' other than \"auto\" or \"none\" requires 'tools'",
                          param="tool_choice")
    if forced.name is not None and forced.name not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"'tool_choice' names function {forced.name!r}, which is not in 'tools'",
                          param="tool_choice")
    return tools, forced


def check_continuation(field_name: str, forced: ForcedCall | None,
                       fmt: ResponseFormat | None, fmt_name: str) -> None:
    """Continuing the last assistant message (``field_name``: where the client asked
    for it) leaves no room for a forced call or an output constraint (``fmt_name``)."""
    if forced is not None:
        raise bad_request(f"'{field_name}' cannot be combined with a forced 'tool_choice'",
                          param=field_name)
    if fmt is not None:
        raise bad_request(f"'{field_name}' cannot be combined with '{fmt_name}': the format "
                          "constrains the whole reply", param=field_name)


def continues(messages: list[dict[str, Any]]) -> bool:
    """The conversation ends with an assistant message holding text (and no calls):
    Anthropic's and the Responses API's prefill, the reply continues it."""
    last = messages[-1]
    return last["role"] == "assistant" and bool(last["content"]) and not last.get("tool_calls")
