"""OpenAI request parsing (JSON body -> ParsedRequest) and validation.

Types are checked strictly (a bool is not a number, a string is not a list) so that a
bad field gets a 400 naming it instead of surfacing later as a 500. Fields we do not
know are ignored, as OpenAI-compatible servers do; fields we know but cannot honour
(n above MAX_CHOICES, ...) get a 400 naming the field. ``tools`` and ``tool_choice``
are read by tool_choice.py, ``response_format`` by response_format.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from ftserve.api.errors import APIError, bad_request, unsupported
from ftserve.chat import limits, response_format
from ftserve.chat.response_format import ResponseFormat
from ftserve.chat.tool_choice import ForcedCall, _tool_calls, forced_call, parse_tools
from ftserve.engine.sampling_params import SamplingParams, SamplingParamsError

_MISSING: Any = object()
_I32 = 2**31 - 1
_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_CHOICES = 16  # prompts x n: each choice is its own engine request (its own KV and batch slot)


@dataclass(frozen=True)
class ParsedRequest:
    """One validated /v1/chat/completions or /v1/completions request."""

    kind: Literal["chat", "completion"]
    model: str | None
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
    response_format: ResponseFormat | None = None  # JSON output constraint (response_format.py)

    def build_params(self, prompt_len: int, max_model_len: int, vocab_size: int,
                     defaults: dict[str, Any] | None = None) -> SamplingParams:
        """Resolve max_tokens against the context window and validate everything.
        ``defaults`` (generation_defaults.py) fill the sampling fields the request left out."""
        if prompt_len >= max_model_len:
            raise context_length_error(prompt_len, self.max_tokens or 0, max_model_len, self.kind)
        room = max_model_len - prompt_len
        if self.max_tokens is None:
            max_tokens = room if self.kind == "chat" else min(16, room)
        else:
            max_tokens = self.max_tokens
            if prompt_len + max_tokens > max_model_len:
                raise context_length_error(prompt_len, max_tokens, max_model_len, self.kind)
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

    def choice_params(self, params: SamplingParams, index: int) -> SamplingParams:
        """Choice ``index`` of n: a given seed becomes seed + index (wrapped to 64 bits),
        so the choices are distinct draws and the whole response is reproducible."""
        if index == 0 or params.seed is None:
            return params
        return dataclasses.replace(params, seed=(params.seed + index + 2**63) % 2**64 - 2**63)


def context_length_error(prompt_len: int, max_tokens: int, limit: int,
                         kind: str = "chat") -> APIError:
    return bad_request(
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
        f"completion). Please reduce the length of the prompt or the completion.",
        param="messages" if kind == "chat" else "prompt",
        code="context_length_exceeded",
    )


# --- typed field readers -------------------------------------------------------------


def _get(body: dict[str, Any], key: str) -> Any:
    value = body.get(key, _MISSING)
    return _MISSING if value is None else value  # JSON null means "not given"


def _bool(body: dict[str, Any], key: str, default: bool) -> bool:
    value = _get(body, key)
    if value is _MISSING:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{key}' must be a boolean", param=key)
    return value


def _int(body: dict[str, Any], key: str, lo: int | None = None, hi: int | None = None) -> Any:
    value = _get(body, key)
    if value is _MISSING:
        return _MISSING
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{key}' must be an integer", param=key)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise bad_request(f"'{key}' must be in {bounds}, got {value}", param=key)
    return value


def _float(body: dict[str, Any], key: str) -> Any:
    value = _get(body, key)
    if value is _MISSING:
        return _MISSING
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad_request(f"'{key}' must be a number", param=key)
    return float(value)


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = _get(body, "stop")
    if value is _MISSING:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad_request("'stop' must be a string or a list of strings", param="stop")
    if len(value) > 16:
        raise bad_request("'stop' may hold at most 16 strings", param="stop")
    if any(s == "" for s in value):
        raise bad_request("'stop' strings must not be empty", param="stop")
    return tuple(value)


def _token_ids(value: Any, param: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise bad_request(f"'{param}' must be a list of integers", param=param)
    return value


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    """The SamplingParams kwargs present in the body (ranges are checked by validate())."""
    out: dict[str, Any] = {}
    for key in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty"):
        value = _float(body, key)
        if value is not _MISSING:
            out[key] = value
    # Bounds here keep absurd integers out of device tensors; finer ranges are validate()'s.
    for key, lo, hi in (("top_k", -1, _I32), ("seed", -(2**63), 2**63 - 1),
                        ("min_tokens", 0, _I32)):
        value = _int(body, key, lo, hi)
        if value is not _MISSING:
            out[key] = value
    bias = _get(body, "logit_bias")
    if bias is not _MISSING and bias is not None:
        out["logit_bias"] = _logit_bias(bias)
    out["ignore_eos"] = _bool(body, "ignore_eos", False)
    stop_ids = _get(body, "stop_token_ids")
    if stop_ids is not _MISSING:
        out["stop_token_ids"] = tuple(_token_ids(stop_ids, "stop_token_ids"))
    return out


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """{"<token id>": bias} -> ((id, bias), ...); ranges are validate()'s."""
    if not isinstance(value, dict):
        raise bad_request("'logit_bias' must be an object of token id -> bias", param="logit_bias")
    pairs = []
    for key, b in value.items():
        try:
            tid = int(key)
        except (TypeError, ValueError):
            raise bad_request(f"'logit_bias' key {key!r} is not a token id", param="logit_bias") from None
        if isinstance(b, bool) or not isinstance(b, (int, float)) or b != b:
            raise bad_request(f"'logit_bias' value for {key!r} must be a number", param="logit_bias")
        pairs.append((tid, float(b)))
    return tuple(pairs)


def _max_tokens(body: dict[str, Any]) -> int | None:
    value = _int(body, "max_completion_tokens", lo=1, hi=_I32)
    if value is _MISSING:
        value = _int(body, "max_tokens", lo=1, hi=_I32)
    return None if value is _MISSING else value


def _common(body: dict[str, Any]) -> dict[str, Any]:
    model = _get(body, "model")
    if model is not _MISSING and not isinstance(model, str):
        raise bad_request("'model' must be a string", param="model")
    n = _int(body, "n", lo=1, hi=MAX_CHOICES)
    stream = _bool(body, "stream", False)
    options = _get(body, "stream_options")
    include_usage = continuous = False
    if options is not _MISSING and options is not None:
        if not isinstance(options, dict):
            raise bad_request("'stream_options' must be an object", param="stream_options")
        if not stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true",
                              param="stream_options")
        include_usage = _bool(options, "include_usage", False)
        continuous = _bool(options, "continuous_usage_stats", False)
    return {
        "model": None if model is _MISSING else model,
        "stream": stream,
        "include_usage": include_usage,
        "continuous_usage": continuous,
        "stop": _stop(body),
        "include_stop": _bool(body, "include_stop_str_in_output", False),
        "max_tokens": _max_tokens(body),
        "return_token_ids": _bool(body, "return_token_ids", False),
        "skip_special_tokens": _bool(body, "skip_special_tokens", True),
        "sampling": _sampling(body),
        "n": 1 if n is _MISSING else n,
        "prompt_logprobs": _prompt_logprobs(body, stream),
        "truncate_prompt_tokens": _truncate(body),
    }


def _truncate(body: dict[str, Any]) -> int | None:
    k = _int(body, "truncate_prompt_tokens", lo=-1, hi=_I32)
    if k is _MISSING or k is None:
        return None
    if k == 0:
        raise bad_request("'truncate_prompt_tokens' must be -1 (the context's length) or at least 1",
                          param="truncate_prompt_tokens")
    return k


def _prompt_logprobs(body: dict[str, Any], stream: bool) -> int | None:
    k = _int(body, "prompt_logprobs", lo=0, hi=20)
    if k is _MISSING or k is None:
        return None
    if stream:
        raise unsupported("prompt_logprobs", "is not supported with 'stream': true (completions "
                          "give the prompt's logprobs in a stream with 'echo' and 'logprobs')")
    return k


def text_parts(value: Any, where: str, kinds: tuple[str, ...], media: tuple[str, ...]) -> str:
    """A string, or a list of text parts (``type`` in ``kinds``, each with ``text``)
    joined by newlines; a part of a type in ``media`` is a 400 saying the model reads
    text only (the Anthropic and Responses routes' content)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_request(f"'{where}' must be a string or a list of text parts", param=where)
    texts = []
    for j, part in enumerate(value):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in media:
            raise unsupported(f"{at}.type", f"{kind!r} is not supported: this server's model "
                              "reads text only")
        if kind not in kinds:
            raise bad_request(f"'{at}.type' must be one of {', '.join(kinds)}; got {kind!r}",
                              param=f"{at}.type")
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_request(f"'{at}.text' must be a string", param=f"{at}.text")
        texts.append(text)
    return "\n".join(texts)


def _require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


# --- chat ------------------------------------------------------------------------------


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise unsupported(f"{where}.content", "supports only text parts")
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request(f"'{where}.content[].text' must be a string", param=where)
            parts.append(text)
        # Joined by newlines, as vLLM joins them and as Anthropic text blocks are joined
        # (anthropic_protocol.py): the same conversation renders the same either way.
        return "\n".join(parts)
    raise bad_request(f"'{where}.content' must be a string or a list of text parts", param=where)


def _check_arguments(calls: Any, where: str) -> None:
    """Earlier calls' arguments are JSON text, parsed for the template: a 400 naming
    the one that nests too deep to parse safely."""
    for i, call in enumerate(calls if isinstance(calls, list) else ()):
        fn = call.get("function") if isinstance(call, dict) else None
        args = fn.get("arguments") if isinstance(fn, dict) else None
        if isinstance(args, str):
            limits.check_text(args, f"{where}[{i}].function.arguments")


def parse_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = _get(body, "messages")
    if messages is _MISSING:
        raise bad_request("'messages' is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", param="messages")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise bad_request(f"'{where}' must be an object", param=where)
        role = msg.get("role")
        if role not in _ROLES:
            raise bad_request(f"'{where}.role' must be one of {', '.join(_ROLES)}", param=where)
        content = msg.get("content")
        text = "" if content is None and role == "assistant" else _content_text(content, where)
        entry: dict[str, Any] = {"role": role, "content": text}
        name = msg.get("name")
        if isinstance(name, str):
            entry["name"] = name
        calls = msg.get("tool_calls")
        if calls:
            if role != "assistant":
                raise bad_request(f"'{where}.tool_calls' is only allowed on assistant messages",
                                  param=where)
            _check_arguments(calls, f"{where}.tool_calls")
            entry["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
        call_id = msg.get("tool_call_id")
        if isinstance(call_id, str):
            entry["tool_call_id"] = call_id
        reasoning = msg.get("reasoning_content")
        if reasoning is not None:  # an earlier turn's reasoning: templates that show it read it
            if role != "assistant" or not isinstance(reasoning, str):
                raise bad_request(f"'{where}.reasoning_content' must be a string on an assistant "
                                  "message", param=where)
            entry["reasoning_content"] = reasoning
        out.append(entry)
    return out


def parse_continuation(body: dict[str, Any], messages: list[dict[str, Any]]) -> tuple[bool, bool]:
    """(add_generation_prompt, continue_final_message). Continuing needs a last
    assistant message with text; add_generation_prompt then defaults to false."""
    cont = _bool(body, "continue_final_message", False)
    add_gen = _bool(body, "add_generation_prompt", not cont)
    if cont:
        last = messages[-1]
        if add_gen:
            raise bad_request("'continue_final_message' and 'add_generation_prompt' cannot both be "
                              "true", param="continue_final_message")
        if last["role"] != "assistant" or not last["content"] or last.get("tool_calls"):
            raise bad_request("'continue_final_message' needs the last message to be an assistant "
                              "message with text content (the start of the reply)",
                              param="continue_final_message")
    return add_gen, cont


# Names the server itself passes to the chat template.
_TEMPLATE_RESERVED = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "flatten")


def parse_template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """chat_template_kwargs: extra variables for the chat template (e.g. Qwen3's
    enable_thinking)."""
    value = _get(body, "chat_template_kwargs")
    if value is _MISSING or value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and k.isidentifier() for k in value):
        raise bad_request("'chat_template_kwargs' must be an object of template variable names",
                          param="chat_template_kwargs")
    taken = sorted(set(value) & set(_TEMPLATE_RESERVED))
    if taken:
        raise bad_request(f"'chat_template_kwargs' cannot set {', '.join(taken)}: the request's own "
                          "fields do", param="chat_template_kwargs")
    return dict(value)


def parse_chat(raw: Any) -> ParsedRequest:
    body = _require_object(raw)
    if _get(body, "functions") is not _MISSING:
        raise unsupported("functions", "(the legacy form) is not supported; use 'tools'")
    tools = parse_tools(body)
    forced = forced_call(body, tools)
    modalities = _get(body, "modalities")
    if modalities is not _MISSING and modalities is not None and modalities != ["text"]:
        raise unsupported("modalities", "supports ['text'] only")
    if _get(body, "audio") not in (_MISSING, None):
        raise unsupported("audio")
    fmt = response_format.parse(body)
    response_format.check_tools(fmt, tools)
    common = _common(body)
    logprobs: int | None = None
    top = _int(body, "top_logprobs", lo=0, hi=20)
    if _bool(body, "logprobs", False):
        logprobs = 0 if top is _MISSING else top
    elif top is not _MISSING and top > 0:
        raise bad_request("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
    messages = parse_messages(body)
    add_gen, cont = parse_continuation(body, messages)
    if cont and forced is not None:
        raise bad_request("'continue_final_message' cannot be combined with a forced 'tool_choice'",
                          param="continue_final_message")
    if cont and fmt is not None:
        raise bad_request("'continue_final_message' cannot be combined with 'response_format': "
                          "the format constrains the whole reply", param="continue_final_message")
    return ParsedRequest(
        kind="chat",
        messages=messages,
        add_generation_prompt=add_gen,
        continue_final=cont,
        logprobs=logprobs,
        tools=tools,
        template_kwargs=parse_template_kwargs(body),
        # A named function: only that call, the first, is returned.
        parallel_tool_calls=(_bool(body, "parallel_tool_calls", True)
                             and (forced is None or forced.name is None)),
        forced=forced,
        response_format=fmt,
        **common,
    )


# --- completions ---------------------------------------------------------------------


def _prompts(body: dict[str, Any]) -> tuple[str | list[int], ...]:
    """A string, a list of ids, or a batch: a list of strings or a list of id lists."""
    prompt = _get(body, "prompt")
    if prompt is _MISSING:
        raise bad_request("'prompt' is required", param="prompt")
    if isinstance(prompt, str):
        return (prompt,)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return tuple(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        batch = tuple(_token_ids(p, "prompt") for p in prompt)
    else:  # one list of ids; anything else (a mix of strings and lists, ...) is a 400 here
        batch = (_token_ids(prompt, "prompt"),)
    empty = next((i for i, ids in enumerate(batch) if not ids), None)
    if empty is not None:
        where = f"prompt[{empty}]" if len(batch) > 1 else "prompt"
        raise bad_request(f"'{where}' must not be empty", param="prompt")
    return batch


def _score_only(body: dict[str, Any]) -> bool:
    """max_tokens 0: allowed with echo only (score the prompt, generate nothing)."""
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value != 0:
        return False
    if not _bool(body, "echo", False):
        raise bad_request(f"'{key}' must be at least 1 (0 only with 'echo': true, to score the "
                          "prompt)", param=key)
    return True


def parse_completion(raw: Any) -> ParsedRequest:
    body = _require_object(raw)
    if _get(body, "suffix") is not _MISSING:
        raise unsupported("suffix")
    if _int(body, "best_of", lo=1) not in (_MISSING, 1):
        raise unsupported("best_of", "> 1 is not supported")
    prompts = _prompts(body)
    score_only = _score_only(body)
    if score_only:
        body = {k: v for k, v in body.items() if k not in ("max_tokens", "max_completion_tokens")}
    common = _common(body)
    if score_only:
        common["max_tokens"] = 1
    if len(prompts) * common["n"] > MAX_CHOICES:
        raise bad_request(f"{len(prompts)} prompts x n={common['n']} is more than {MAX_CHOICES} "
                          "choices", param="n" if common["n"] > 1 else "prompt")
    logprobs = _int(body, "logprobs", lo=0, hi=20)
    echo = _bool(body, "echo", False)  # with logprobs: the prompt's too (engine prompt_logprobs)
    return ParsedRequest(
        kind="completion",
        prompts=prompts,
        score_only=score_only,
        response_format=response_format.parse(body),
        echo=echo,
        logprobs=None if logprobs is _MISSING else logprobs,
        **common,
    )
