"""OpenAI's request bodies (/v1/chat/completions, /v1/completions, and vLLM's
/tokenize), with the fields vLLM and llama.cpp added to them, as declared models;
and their mapping into the internal request (``parse_chat``, ``parse_completion``).

A bad field is a 400 naming it (validation.py words it); fields we do not know are
ignored, as OpenAI-compatible servers do; fields we know but cannot honour (n above
MAX_CHOICES, audio, ...) get a 400 naming the field. JSON null means "not given".
Sampling ranges are SamplingParams.validate's (checked once the prompt's length is
known); here the integers are bounded so that no absurd one reaches a device tensor.

Output constraints, one per request (a second is a 400 naming both)::

    response_format  {"type": "text"}                  no constraint (as if absent)
                     {"type": "json_object"}           one JSON object
                     {"type": "json_schema", "json_schema": {"name": str, "schema": {...},
                                                             "strict": bool, "description": str}}
    structured_outputs {"json": schema | "<schema text>" | "json_object": true
                        | "regex": str | "choice": [str, ...] | "grammar": str}    (vLLM)
    guided_json / guided_regex / guided_choice / guided_grammar                     (vLLM, older)
    regex / ebnf (a grammar)                                                         (SGLang)
    json_schema: schema,  grammar: str                                               (llama.cpp)

(chat.response_format checks each payload's shape and size.)
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, WrapValidator, model_validator

from ftserve.api.sampling import I32, Sampling, Stop
from ftserve.api.validation import (
    Body,
    Int,
    Worded,
    falsy_is_absent,
    lenient,
    member,
    non_empty,
    parse,
    refused,
    reject,
    unless_given,
    worded,
)
from ftserve.chat import limits
from ftserve.chat import response_format as rf
from ftserve.chat.errors import bad_request, unsupported
from ftserve.chat.request import (
    MAX_CHOICES,
    TEMPLATE_RESERVED,
    ChatRequest,
    check_continuation,
    message,
    offered_tools,
)
from ftserve.chat.response_format import ResponseFormat
from ftserve.chat.tool_choice import ForcedCall

ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_SHAPE = '\'{at}\' must be {"type": "function", "function": {"name": ...}}'
CHOICE_SHAPE = ('\'tool_choice\' must be "auto", "none", "required" or '
                '{"type": "function", "function": {"name": ...}}')
RF = "response_format"


# --- sampling: OpenAI's fields besides the ones every protocol takes (sampling.py) ------


def _logit_bias(value: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    """{"<token id>": bias} -> ((id, bias), ...); ranges are validate()'s."""
    pairs = []
    for key, bias in value.items():
        try:
            tid = int(key)
        except (TypeError, ValueError):
            raise reject(f"'{{at}}' key {key!r} is not a token id") from None
        if isinstance(bias, bool) or not isinstance(bias, int | float) or bias != bias:
            raise reject(f"'{{at}}' value for {key!r} must be a number")
        pairs.append((tid, float(bias)))
    return tuple(pairs)


class OpenAISampling(Sampling):
    logit_bias: Annotated[dict[str, Any], Worded("'{at}' must be an object of token id -> bias"),
                          AfterValidator(_logit_bias)] | None = None
    stop_token_ids: Annotated[list[int], Worded("'{at}' must be a list of integers")] | None = None

    def sampling(self) -> dict[str, Any]:
        out = super().sampling()
        if self.logit_bias is not None:
            out["logit_bias"] = self.logit_bias
        if self.stop_token_ids is not None:
            out["stop_token_ids"] = tuple(self.stop_token_ids)
        return out


# --- what chat and completions share ------------------------------------------------


class StreamOptions(Body):
    include_usage: Annotated[bool, Worded("'{key}' must be a boolean", "{key}")] | None = None
    continuous_usage_stats: Annotated[bool, Worded("'{key}' must be a boolean", "{key}")] | None = None


class JsonSchemaSpec(Body):
    name: Annotated[str, Worded("'{at}' must be a non-empty string", RF),
                    non_empty("'{at}' must be a non-empty string", RF)] = Field(
        None, validate_default=True)
    schema_: Annotated[dict[str, Any], Worded("'{at}' must be a JSON schema object", RF)] | None = (
        Field(None, alias="schema"))
    strict: Annotated[bool, Worded("'{at}' must be a boolean", RF)] | None = None
    description: Annotated[str, Worded("'{at}' must be a string", RF)] | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> JsonSchemaSpec:
        if self.schema_ is None:
            raise reject("'{at}.schema' must be a JSON schema object", RF)
        return self


def _format_type(value: Any) -> Any:
    if not isinstance(value, str) or value not in ("text", "json_object", "json_schema"):
        raise reject(f"'{{at}}' must be \"text\", \"json_object\" or \"json_schema\", got "
                     f"{value!r}", RF)
    return value


class ResponseFormatSpec(Body):
    type: Annotated[Any, AfterValidator(_format_type)] = Field(None, validate_default=True)
    json_schema: Annotated[JsonSchemaSpec, worded(
        "'{at}' must be an object with 'name' and 'schema'", RF)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _schema_when_asked(cls, data: Any) -> Any:
        """json_schema is read for type json_schema only."""
        if isinstance(data, dict) and data.get("type") != "json_schema" and "json_schema" in data:
            data = {k: v for k, v in data.items() if k != "json_schema"}
        return data

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormatSpec:
        if self.type == "json_schema" and self.json_schema is None:
            raise reject("'{at}.json_schema' must be an object with 'name' and 'schema'", RF)
        return self


def _not_zero(value: int) -> int:
    if value == 0:
        raise reject("'{at}' must be -1 (the context's length) or at least 1")
    return value


class _Generate(OpenAISampling):
    """The fields /v1/chat/completions and /v1/completions both take."""

    model: str | None = None
    n: Int(1, MAX_CHOICES) | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: Stop | None = None
    include_stop_str_in_output: bool | None = None
    max_completion_tokens: Int(1, I32) | None = None
    max_tokens: Annotated[Int(1, I32) | None, unless_given("max_completion_tokens")] = None
    return_token_ids: bool | None = None
    skip_special_tokens: bool | None = None
    prompt_logprobs: Int(0, 20) | None = None
    truncate_prompt_tokens: Annotated[Int(-1, I32), AfterValidator(_not_zero)] | None = None
    # Output constraints (the module docstring); the vLLM / llama.cpp payloads are
    # checked by chat.response_format.constraint.
    response_format: Annotated[ResponseFormatSpec, worded("'{at}' must be an object", RF)] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    json_schema: Any = None
    grammar: Any = None
    # SGLang's names: sglang-router passes these (and response_format) on and drops
    # vLLM's and llama.cpp's (docs/scaling.md).
    regex: Any = None
    ebnf: Any = None

    def common(self) -> dict[str, Any]:
        """The internal request's fields both endpoints fill the same way."""
        stream = bool(self.stream)
        options = self.stream_options
        if options is not None and not stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true",
                              param="stream_options")
        if self.prompt_logprobs is not None and stream:
            raise unsupported("prompt_logprobs", "is not supported with 'stream': true "
                              "(completions give the prompt's logprobs in a stream with 'echo' "
                              "and 'logprobs')")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens
        return {
            "model": self.model,
            "stream": stream,
            "include_usage": bool(options and options.include_usage),
            "continuous_usage": bool(options and options.continuous_usage_stats),
            "stop": self.stop or (),
            "include_stop": bool(self.include_stop_str_in_output),
            "max_tokens": max_tokens,
            "return_token_ids": bool(self.return_token_ids),
            "skip_special_tokens": self.skip_special_tokens is not False,
            "sampling": self.sampling(),
            "n": self.n or 1,
            "prompt_logprobs": self.prompt_logprobs,
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
        }

    def constraint(self) -> ResponseFormat | None:
        """The output constraint, from whichever field holds it (None: none, or
        response_format {"type": "text"}); two of them are a 400."""
        found = [f for f in (self._response_format(), *self._other_constraints()) if f is not None]
        if len(found) > 1:
            raise bad_request(f"'{found[0].param}' and '{found[1].param}' both constrain the "
                              "output; give one", param=found[1].param)
        return found[0] if found else None

    def _response_format(self) -> ResponseFormat | None:
        spec = self.response_format
        if spec is None or spec.type == "text":
            return None
        if spec.type == "json_object":
            return rf.json_object(RF)
        return rf.bounded("json_schema", spec.json_schema.schema_, RF)

    def _other_constraints(self) -> list[ResponseFormat]:
        out: list[ResponseFormat] = []
        so = self.structured_outputs
        if so is not None:
            given = {k: v for k, v in so.items() if v is not None and v is not False}
            unknown = sorted(set(given) - {"json", "json_object", "regex", "choice", "grammar"})
            if unknown:
                raise bad_request(f"'structured_outputs' does not support {', '.join(unknown)}",
                                  param="structured_outputs")
            if len(given) > 1:
                raise bad_request("'structured_outputs' must hold one of json, json_object, "
                                  "regex, choice, grammar", param="structured_outputs")
            for key, value in given.items():
                out.append(rf.json_object("structured_outputs") if key == "json_object"
                           else rf.constraint(key, value, "structured_outputs"))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                          ("guided_choice", "choice"), ("guided_grammar", "grammar"),
                          ("json_schema", "json"), ("grammar", "grammar"),
                          ("regex", "regex"), ("ebnf", "grammar")):
            value = getattr(self, name)
            if value is not None:
                out.append(rf.constraint(key, value, name))
        return out


# --- chat ---------------------------------------------------------------------------


class TextPart(Body):
    type: Literal["text"]
    text: Annotated[str, worded("'{up3}.content[].text' must be a string", "{up3}")] = Field(
        None, validate_default=True)


_PARTS = "'{at}' must be a string or a list of text parts"


def _content(value: Any, handler: Any) -> Any:
    if isinstance(value, str):
        return value
    if value is not None and not isinstance(value, list):
        raise reject(_PARTS, "{up}")
    return handler(value)


# A string, or a list of text parts (joined by newlines, as vLLM joins them and as
# Anthropic's text blocks are joined: the same conversation renders the same either way).
Content = Annotated[
    list[Annotated[TextPart, worded("'{up}' supports only text parts", "{up}",
                                    "unsupported_parameter", deep=True)]] | None,
    WrapValidator(_content)]


def _arguments(value: Any) -> Any:
    """An earlier call's arguments: JSON text parsed for the template (templates
    expect the object, as vLLM gives it); anything else passes as it is."""
    if not isinstance(value, str):
        return value
    if limits.text_nesting(value) > limits.MAX_NESTING:
        raise reject(f"'{{at}}' nests deeper than {limits.MAX_NESTING} levels")
    try:
        return json.loads(value) if value.strip() else {}
    except json.JSONDecodeError:
        raise reject("'{at}' is not valid JSON", "{up3}") from None


class CalledFunction(Body):
    name: str
    arguments: Annotated[Any, AfterValidator(_arguments)] = Field("{}", validate_default=True)


class ToolCall(Body):
    id: Any = ""
    function: CalledFunction

    def entry(self) -> dict[str, Any]:
        fn = self.function
        return {"id": self.id, "type": "function", "function": {"name": fn.name,
                                                               "arguments": fn.arguments}}


class Message(Body):
    role: Annotated[Literal["system", "developer", "user", "assistant", "tool"],
                    Worded(f"'{{at}}' must be one of {', '.join(ROLES)}", "{up}")] = Field(
        None, validate_default=True)
    content: Content = None
    name: Annotated[str | None, lenient(str)] = None  # kept when a string
    tool_calls: Annotated[
        list[Annotated[ToolCall, worded("'{at}' must have a function with a name", "{up}",
                                        deep=True)]] | None,
        falsy_is_absent()] = None
    tool_call_id: Annotated[str | None, lenient(str)] = None
    reasoning_content: Annotated[
        str, Worded("'{at}' must be a string on an assistant message", "{up}")] | None = None

    @model_validator(mode="after")
    def _fits_role(self) -> Message:
        if self.role != "assistant":
            if self.content is None:
                raise reject("'{at}.content' must be a string or a list of text parts")
            if self.tool_calls:
                raise reject("'{at}.tool_calls' is only allowed on assistant messages")
            if self.reasoning_content is not None:
                raise reject("'{at}.reasoning_content' must be a string on an assistant message")
        return self

    def entry(self) -> dict[str, Any]:
        content = self.content
        text = content if isinstance(content, str) else "\n".join(p.text for p in content or ())
        calls = [c.entry() for c in self.tool_calls] if self.tool_calls else None
        return message(self.role, text, name=self.name, tool_calls=calls,
                       tool_call_id=self.tool_call_id, reasoning=self.reasoning_content)


def _messages(value: Any, handler: Any) -> Any:
    if value is None:
        raise reject("'{at}' is required")
    if not isinstance(value, list) or not value:
        raise reject("'{at}' must be a non-empty list")
    return handler(value)


Messages = Annotated[list[Message], WrapValidator(_messages)]


class FunctionDef(Body):
    name: Annotated[str, Field(min_length=1)]
    parameters: Annotated[dict[str, Any], worded("'{at}' must be an object", "tools")] = {}


class ToolDef(Body):
    type: Literal["function"]
    function: FunctionDef


def _tool(value: Any, handler: Any) -> dict[str, Any]:
    """The template renders a tool as the client wrote it (its keys in its order,
    unknown ones kept): the shape is checked, the client's function passes."""
    handler(value)
    return {"type": "function", "function": dict(value["function"])}


Tool = Annotated[ToolDef, worded(TOOL_SHAPE, "tools", deep=True), WrapValidator(_tool)]


class NamedFunction(Body):
    name: str


class NamedChoice(Body):
    type: Literal["function"]
    function: NamedFunction


def _choice_modes(value: Any, handler: Any) -> Any:
    return value if value in ("auto", "none", "required") else handler(value)


# "auto", "none", "required" or {"type": "function", "function": {"name": ...}}.
ToolChoice = Annotated[NamedChoice, worded(CHOICE_SHAPE, "tool_choice", deep=True),
                       WrapValidator(_choice_modes)]


def check_tool_names(tools: list[dict[str, Any]]) -> None:
    """Every offered tool has a name (the other protocols' tools, mapped into this
    shape, are held to it too)."""
    for i, tool in enumerate(tools):
        if not tool["function"]["name"]:
            raise bad_request(TOOL_SHAPE.replace("{at}", f"tools[{i}]"), param="tools")


def _forced(choice: Any) -> ForcedCall | None:
    if choice == "required":
        return ForcedCall()
    return ForcedCall(choice.function.name) if isinstance(choice, NamedChoice) else None


def _template_kwargs(value: dict[str, Any]) -> dict[str, Any]:
    if not all(k.isidentifier() for k in value):
        raise reject("'{at}' must be an object of template variable names")
    taken = sorted(set(value) & set(TEMPLATE_RESERVED))
    if taken:
        raise reject(f"'{{at}}' cannot set {', '.join(taken)}: the request's own fields do")
    return dict(value)


class ChatTemplated(Body):
    """What a chat prompt is rendered from (/v1/chat/completions, /tokenize)."""

    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    messages: Messages = Field(None, validate_default=True)
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: Annotated[
        dict[str, Any], Worded("'{at}' must be an object of template variable names"),
        AfterValidator(_template_kwargs)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _none_offers_no_tools(cls, data: Any) -> Any:
        """tool_choice "none": the tools are not offered, nor read."""
        if isinstance(data, dict) and data.get("tool_choice") == "none" and "tools" in data:
            data = {k: v for k, v in data.items() if k != "tools"}
        return data

    def chat_messages(self) -> list[dict[str, Any]]:
        return [m.entry() for m in self.messages]

    def offered(self) -> tuple[list[dict[str, Any]] | None, ForcedCall | None]:
        """(tools, forced call) as the template and the output parser take them."""
        return offered_tools(self.tools, _forced(self.tool_choice), self.tool_choice == "none")

    def continuation(self, messages: list[dict[str, Any]]) -> tuple[bool, bool]:
        """(add_generation_prompt, continue_final_message). Continuing needs a last
        assistant message with text; add_generation_prompt then defaults to false."""
        cont = bool(self.continue_final_message)
        add_gen = self.add_generation_prompt if self.add_generation_prompt is not None else not cont
        if cont:
            last = messages[-1]
            if add_gen:
                raise bad_request("'continue_final_message' and 'add_generation_prompt' cannot "
                                  "both be true", param="continue_final_message")
            if last["role"] != "assistant" or not last["content"] or last.get("tool_calls"):
                raise bad_request("'continue_final_message' needs the last message to be an "
                                  "assistant message with text content (the start of the reply)",
                                  param="continue_final_message")
        return add_gen, cont


def _text_only(value: Any) -> Any:
    if value is not None and value != ["text"]:
        raise reject("'{at}' supports ['text'] only", code="unsupported_parameter")
    return value


class ChatCompletionRequest(ChatTemplated, _Generate):
    functions: Annotated[Any, refused("(the legacy form) is not supported; use 'tools'")] = None
    modalities: Annotated[Any, AfterValidator(_text_only)] = None
    audio: Annotated[Any, refused()] = None
    top_logprobs: Int(0, 20) | None = None
    logprobs: bool | None = None
    parallel_tool_calls: bool | None = None


def parse_chat(raw: Any) -> ChatRequest:
    """A /v1/chat/completions body as the internal request."""
    body = parse(ChatCompletionRequest, raw)
    tools, forced = body.offered()
    fmt = body.constraint()
    rf.check_tools(fmt, tools)
    common = body.common()
    logprobs: int | None = None
    if body.logprobs:
        logprobs = body.top_logprobs or 0
    elif body.top_logprobs:
        raise bad_request("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
    messages = body.chat_messages()
    add_gen, cont = body.continuation(messages)
    if cont:
        check_continuation("continue_final_message", forced, fmt, RF)
    return ChatRequest(
        kind="chat",
        messages=messages,
        add_generation_prompt=add_gen,
        continue_final=cont,
        logprobs=logprobs,
        tools=tools,
        template_kwargs=body.chat_template_kwargs or {},
        # A named function: only that call, the first, is returned.
        parallel_tool_calls=(body.parallel_tool_calls is not False
                             and (forced is None or forced.name is None)),
        forced=forced,
        response_format=fmt,
        **common,
    )


# --- completions ----------------------------------------------------------------------


def _token_ids(value: Any) -> list[int]:
    if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise reject("'{at}' must be a list of integers")
    return value


def _prompts(value: Any) -> tuple[str | list[int], ...]:
    """A string, a list of ids, or a batch: a list of strings or a list of id lists."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        return tuple(value)
    if isinstance(value, list) and value and all(isinstance(p, list) for p in value):
        batch = tuple(_token_ids(p) for p in value)
    else:  # one list of ids; anything else (a mix of strings and lists, ...) is a 400 here
        batch = (_token_ids(value),)
    empty = next((i for i, ids in enumerate(batch) if not ids), None)
    if empty is not None:
        where = f"prompt[{empty}]" if len(batch) > 1 else "prompt"
        raise reject(f"'{where}' must not be empty")
    return batch


def _prompt(value: Any) -> Any:
    if value is None:
        raise reject("'{at}' is required")
    return _prompts(value)


class CompletionRequest(_Generate):
    suffix: Annotated[Any, refused()] = None
    best_of: Annotated[Int(1, None), member((1,), "'{at}' > 1 is not supported",
                                            code="unsupported_parameter")] | None = None
    prompt: Annotated[Any, AfterValidator(_prompt)] = Field(None, validate_default=True)
    logprobs: Int(0, 20) | None = None
    echo: bool | None = None


def _score_only(body: dict[str, Any]) -> bool:
    """max_tokens 0: allowed with echo only (score the prompt, generate nothing)."""
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value != 0:
        return False
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise bad_request("'echo' must be a boolean", param="echo")
    if not echo:
        raise bad_request(f"'{key}' must be at least 1 (0 only with 'echo': true, to score the "
                          "prompt)", param=key)
    return True


def parse_completion(raw: Any) -> ChatRequest:
    """A /v1/completions body as the internal request."""
    score_only = isinstance(raw, dict) and _score_only(raw)
    if score_only:  # the engine runs one token, which the response leaves out
        raw = {k: v for k, v in raw.items() if k not in ("max_tokens", "max_completion_tokens")}
    body = parse(CompletionRequest, raw)
    common = body.common()
    if score_only:
        common["max_tokens"] = 1
    prompts = body.prompt
    if len(prompts) * common["n"] > MAX_CHOICES:
        raise bad_request(f"{len(prompts)} prompts x n={common['n']} is more than {MAX_CHOICES} "
                          "choices", param="n" if common["n"] > 1 else "prompt")
    return ChatRequest(
        kind="completion",
        prompt_field="prompt",
        prompts=prompts,
        score_only=score_only,
        response_format=body.constraint(),
        echo=bool(body.echo),  # with logprobs: the prompt's too (engine prompt_logprobs)
        logprobs=body.logprobs,
        **common,
    )


# --- /tokenize ------------------------------------------------------------------------


class TokenizeChat(ChatTemplated):
    """/tokenize with messages: the prompt /v1/chat/completions would render."""

    add_special_tokens: bool = None  # type: ignore[assignment]  # null: a 400; absent: False


class TokenizePrompt(Body):
    prompt: Annotated[str, worded("'prompt' (a string) or 'messages' is required", "prompt")
                      ] = Field(None, validate_default=True)
    add_special_tokens: bool = None  # type: ignore[assignment]  # null: a 400; absent: True
