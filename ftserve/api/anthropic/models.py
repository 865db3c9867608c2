"""Anthropic Messages API request bodies (/v1/messages, /v1/messages/count_tokens)
as declared models, and their mapping into the internal request (``ChatRequest``).

A bad field is a 400 naming it as Anthropic spells it (validation.py words it).
The request maps into the chat request /v1/chat/completions makes, so rendering,
tool calls, reasoning and sampling are that route's::

    system (string or text blocks)        -> a first "system" message
    user text blocks                      -> a "user" message (blocks joined by "\\n")
    user tool_result {tool_use_id, content, is_error}
                                          -> a "tool" message (tool_call_id; an error's
                                             text gets "Error: " in front: templates have
                                             no error flag)
    assistant text / tool_use / thinking  -> one "assistant" message: content,
                                             tool_calls (input as the arguments object),
                                             reasoning_content (templates that show an
                                             earlier turn's reasoning read it)
    a final assistant message with text   -> continued (Anthropic's prefill: the reply
                                             continues it)
    stop_sequences                        -> stop strings
    tools [{name, description, input_schema}]
                                          -> tools [{type: function, function: {...}}]
    tool_choice auto / any / tool / none  -> "auto" / "required" / the named function /
                                             "none"; disable_parallel_tool_use ->
                                             parallel_tool_calls false
    output_config.format {type: json_schema, schema} (or the beta's output_format)
                                          -> a json_schema output constraint: the reply's
                                             text is constrained to the schema
    thinking enabled / disabled           -> the template's enable_thinking true / false,
                                             where the template reads it (Qwen3);
                                             adaptive or absent: the template's default.
                                             budget_tokens is checked, not enforced:
                                             max_tokens bounds thinking and answer together

Image and document blocks are a 400 (the models served are text-only); so are
server tools, MCP servers and containers. redacted_thinking blocks (opaque to
anything but Anthropic's models) and cache_control marks (prefix caching is
automatic) are dropped; metadata and other unknown fields are ignored. As
ftserve extensions, ``ignore_eos``, ``seed``, ``min_p``, ``min_tokens`` and the
penalties pass through with their /v1/chat/completions meaning.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    Field,
    TypeAdapter,
    ValidationInfo,
    WrapValidator,
    model_validator,
)

from ftserve.api.openai.models import check_tool_names
from ftserve.api.sampling import I32, Sampling, Stop
from ftserve.api.validation import (
    Body,
    Int,
    Worded,
    member,
    parse,
    refused,
    reject,
    text_parts,
    worded,
)
from ftserve.chat import response_format as rf
from ftserve.chat.request import (
    ChatRequest,
    check_continuation,
    continues,
    message,
    offered_tools,
)
from ftserve.chat.tool_choice import ForcedCall

_MEDIA = ("image", "document")
_TEXT = text_parts(("text",), _MEDIA)


# --- content blocks ---------------------------------------------------------------------


class TextBlock(Body):
    type: Literal["text"]
    text: str = Field(None, validate_default=True)


class ToolResultBlock(Body):
    type: Literal["tool_result"]
    tool_use_id: str = Field(None, validate_default=True)
    content: _TEXT | None = None
    is_error: bool = False


class ThinkingBlock(Body):
    type: Literal["thinking"]
    thinking: str = Field(None, validate_default=True)


class RedactedThinkingBlock(Body):
    type: Literal["redacted_thinking"]  # encrypted for Anthropic's models: dropped


class ToolUseBlock(Body):
    type: Literal["tool_use"]
    id: str = Field(None, validate_default=True)
    name: str = Field(None, validate_default=True)
    input: dict[str, Any] = Field(None, validate_default=True)


def _blocks(kinds: dict[str, type[Body]], allowed: tuple[str, ...]) -> TypeAdapter[list[Any]]:
    """A list of content blocks of these types (by ``type``; ``allowed`` as the error
    lists them); image and document blocks are a 400 saying the model reads text only."""

    def block(value: Any) -> Body:
        kind = value.get("type") if isinstance(value, dict) else None
        model = kinds.get(kind) if isinstance(kind, str) else None
        if model is not None:
            return model.model_validate(value)
        if kind in _MEDIA:
            raise reject(f"'{{at}}.type' {kind!r} is not supported: this server's model reads "
                         "text only", "{at}.type", "unsupported_parameter")
        raise reject(f"'{{at}}.type' must be one of {', '.join(allowed)}; got {kind!r}",
                     "{at}.type")

    return TypeAdapter(list[Annotated[Any, AfterValidator(block)]])


_USER_BLOCKS = _blocks({"text": TextBlock, "tool_result": ToolResultBlock},
                       ("text", "tool_result", "image", "document"))
_ASSISTANT_BLOCKS = _blocks({"text": TextBlock, "thinking": ThinkingBlock,
                             "redacted_thinking": RedactedThinkingBlock, "tool_use": ToolUseBlock},
                            ("text", "thinking", "redacted_thinking", "tool_use"))


def _content(value: Any, handler: Any, info: ValidationInfo) -> list[Body]:
    if isinstance(value, str):
        value = [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise reject("'{at}' must be a string or a list of content blocks")
    blocks = _ASSISTANT_BLOCKS if info.data.get("role") == "assistant" else _USER_BLOCKS
    return blocks.validate_python(value)


class Message(Body):
    role: Annotated[Any, member(("user", "assistant"), "'{up}' must be an object with role "
                                "'user' or 'assistant'", "{up}")] = Field(None, validate_default=True)
    content: Annotated[Any, WrapValidator(_content)] = Field(None, validate_default=True)

    def entries(self) -> list[dict[str, Any]]:
        return _assistant(self.content) if self.role == "assistant" else _user(self.content)


def _user(blocks: list[Body]) -> list[dict[str, Any]]:
    """A user turn's blocks, in order: text runs become user messages, each
    tool_result a tool message (an error's text gets "Error: " in front: templates
    have no error flag)."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for block in blocks:
        if isinstance(block, TextBlock):
            texts.append(block.text)
            continue
        assert isinstance(block, ToolResultBlock)
        if texts:
            out.append(message("user", "\n".join(texts)))
            texts = []
        body = block.content or ""
        out.append(message("tool", "Error: " + body if block.is_error else body,
                           tool_call_id=block.tool_use_id))
    if texts or not out:
        out.append(message("user", "\n".join(texts)))
    return out


def _assistant(blocks: list[Body]) -> list[dict[str, Any]]:
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in blocks:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thoughts.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": block.input}})
    return [message("assistant", "\n".join(texts), tool_calls=calls,
                    reasoning="\n".join(thoughts) if thoughts else None)]


def _messages(value: Any, handler: Any) -> Any:
    if value is None:
        raise reject("'{at}' is required")
    if not isinstance(value, list) or not value:
        raise reject("'{at}' must be a non-empty list")
    return handler(value)


# --- tools, tool_choice, thinking, structured output ----------------------------------------


def _client_tool(value: Any) -> Any:
    if value not in (None, "custom"):
        raise reject(f"'{{at}}' {value!r} is not supported: only client tools ({{name, "
                     "description, input_schema}) are", code="unsupported_parameter")
    return value


class Tool(Body):
    type: Annotated[Any, AfterValidator(_client_tool)] = None
    name: str = Field(None, validate_default=True)
    input_schema: dict[str, Any] = Field(None, validate_default=True)
    description: str | None = None

    def chat_tool(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


class ToolChoice(Body):
    disable_parallel_tool_use: Annotated[bool, Worded("'{at}' must be a boolean", "{up}")] = False
    type: Annotated[Any, member(("auto", "any", "tool", "none"),
                                "'{at}' must be one of auto, any, tool, none", "{up}")] = Field(
        None, validate_default=True)
    name: Any = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and not isinstance(self.name, str):
            raise reject("'{at}.name' must be a string", "{at}.name")
        return self

    def forced(self) -> ForcedCall | None:
        if self.type == "tool":
            return ForcedCall(self.name)
        return ForcedCall() if self.type == "any" else None


class Thinking(Body):
    type: Annotated[Any, member(("enabled", "disabled", "adaptive"),
                                "'{at}' must be one of enabled, disabled, adaptive", "{up}")
                    ] = Field(None, validate_default=True)
    budget_tokens: Any = None  # checked, not enforced: max_tokens bounds thinking and answer

    @model_validator(mode="after")
    def _budget(self) -> Thinking:
        budget = self.budget_tokens
        if self.type == "enabled" and (isinstance(budget, bool) or not isinstance(budget, int)
                                       or budget < 1):
            raise reject("'{at}.budget_tokens' must be a positive integer", "{at}.budget_tokens")
        return self

    def enabled(self) -> bool | None:
        return {"enabled": True, "disabled": False}.get(self.type)


class JsonOutput(Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


OutputFormat = Annotated[JsonOutput, Worded("'{at}' must be {type: json_schema, schema: {...}}")]


class OutputConfig(Body):
    format: OutputFormat | None = None


def _beta_format(value: Any, handler: Any, info: ValidationInfo) -> Any:
    """output_format (the beta's name) is read when output_config.format is not given."""
    config = info.data.get("output_config")
    return None if config is not None and config.format is not None else handler(value)


def _a_list(value: Any, handler: Any) -> Any:
    if not isinstance(value, list):
        raise reject("'{at}' must be a list of strings")
    return handler(value)


def _required(value: Any, handler: Any) -> Any:
    if value is None:
        raise reject("'{at}' is required")
    return handler(value)


# --- the bodies ---------------------------------------------------------------------------


class CountTokensRequest(Body):
    """A /v1/messages/count_tokens body: what /v1/messages renders, without the
    generation fields."""

    mcp_servers: Annotated[Any, refused()] = None
    container: Annotated[Any, refused()] = None
    output_config: OutputConfig | None = None
    output_format: Annotated[OutputFormat | None, WrapValidator(_beta_format)] = None
    messages: Annotated[list[Annotated[Message, worded(
        "'{at}' must be an object with role 'user' or 'assistant'")]],
        WrapValidator(_messages)] = Field(None, validate_default=True)
    system: _TEXT | None = None
    model: str | None = None
    stop_sequences: Annotated[Stop, WrapValidator(_a_list)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Annotated[ToolChoice, worded("'{at}' must be an object with a type")] | None = None
    thinking: Annotated[Thinking, worded("'{at}.type' must be one of enabled, disabled, adaptive",
                                         "{at}")] | None = None


class MessagesRequest(CountTokensRequest, Sampling):
    """A /v1/messages body (ignore_eos, seed, min_p, min_tokens and the penalties are
    ftserve extensions, with their /v1/chat/completions meaning)."""

    max_tokens: Annotated[Int(1, I32), WrapValidator(_required)] = Field(None,
                                                                        validate_default=True)
    stream: bool | None = None


def parse_messages_request(raw: Any, count_only: bool = False) -> ChatRequest:
    """A /v1/messages body (``count_only``: a count_tokens body, which has no
    max_tokens and does not stream) as the internal request."""
    body = parse(CountTokensRequest if count_only else MessagesRequest, raw)
    messages = [entry for m in body.messages for entry in m.entries()]
    if body.system:
        messages.insert(0, message("system", body.system))
    choice = body.tool_choice
    forced = choice.forced() if choice is not None else None
    none = choice is not None and choice.type == "none"
    tools = [t.chat_tool() for t in body.tools] if body.tools else None
    if tools and not none:
        check_tool_names(tools)
    tools, forced = offered_tools(tools, forced, none)
    fmt_name, spec = "output_config.format", None
    if body.output_config is not None and body.output_config.format is not None:
        spec = body.output_config.format
    elif body.output_format is not None:
        fmt_name, spec = "output_format", body.output_format
    fmt = rf.bounded("json_schema", spec.schema_, fmt_name) if spec is not None else None
    rf.check_tools(fmt, tools)
    cont = continues(messages)
    if cont:
        check_continuation("messages", forced, fmt, fmt_name)
    parallel = choice is None or not choice.disable_parallel_tool_use
    generate: dict[str, Any] = {}
    if isinstance(body, MessagesRequest):
        generate = {"max_tokens": body.max_tokens, "stream": bool(body.stream),
                    "sampling": body.sampling()}
    return ChatRequest(
        kind="chat",
        model=body.model,
        messages=messages,
        add_generation_prompt=not cont,
        continue_final=cont,
        stop=tuple(body.stop_sequences or ()),
        tools=tools,
        parallel_tool_calls=parallel and (forced is None or forced.name is None),
        forced=forced,
        response_format=fmt,
        thinking=body.thinking.enabled() if body.thinking is not None else None,
        **generate,
    )
