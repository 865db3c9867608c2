"""OpenAI Responses API request bodies (POST /v1/responses) as declared models,
and their mapping into the internal request (``ChatRequest``).

A bad field is a 400 naming it as the Responses API spells it (validation.py words
it). As Anthropic's requests do, the request maps into the chat request
/v1/chat/completions makes, so rendering, tool calls, reasoning and sampling are
that route's::

    instructions                          -> a first "system" message
    input: a string                       -> one "user" message
    input items, in order:
      message {role, content}             -> a message of that role (content a string,
                                             or input_text / output_text parts joined
                                             by "\\n")
      reasoning {content | summary}       -> reasoning_content of the next assistant
                                             message (templates that show an earlier
                                             turn's reasoning read it)
      function_call {call_id, name, arguments}
                                          -> tool_calls of an assistant message (calls
                                             right after an assistant message join it)
      function_call_output {call_id, output}
                                          -> a "tool" message
    tools [{type: function, name, description, parameters}]
                                          -> tools [{type: function, function: {...}}]
    tool_choice, parallel_tool_calls      -> the same, the named form {type: function, name}
                                             as chat's {type: function, function: {name}}
    text.format json_schema / json_object -> the output constraint
    max_output_tokens                     -> max_tokens
    a final assistant message with text   -> continued (the reply continues it)

Stateless: nothing is stored, so ``previous_response_id`` (and ``conversation``)
is a 400, and ``store`` is accepted and ignored (agents such as Codex send the
whole conversation each turn with ``store: false``). Images, files and the hosted
tools (web search, file search, code interpreter, MCP, ...) are a 400: the
models served are text-only and the server runs no tools. ``include`` must be a
list of strings: "message.output_text.logprobs" (and ``top_logprobs`` above 0)
is a 400, as output-text logprobs are not returned; the other values name
outputs this server never makes ("reasoning.encrypted_content": the reasoning
comes back as plain text) and are accepted. ``reasoning``, ``metadata``,
``truncation`` "disabled", ``user`` and other unknown fields are ignored. As ftserve extensions, ``top_k``, ``min_p``,
``seed``, ``stop``, ``ignore_eos``, ``min_tokens`` and the penalties pass
through with their /v1/chat/completions meaning.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import AfterValidator, Field, TypeAdapter, WrapValidator, model_validator

from ftserve.api.openai.models import CHOICE_SHAPE, check_tool_names
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
    text_parts,
    unless_given,
    worded,
)
from ftserve.chat import limits
from ftserve.chat import response_format as rf
from ftserve.chat.request import (
    ChatRequest,
    check_continuation,
    continues,
    message,
    offered_tools,
)
from ftserve.chat.tool_choice import ForcedCall

_ROLES = ("user", "system", "developer", "assistant")
_MEDIA = ("input_image", "input_file", "input_audio")
_LOGPROBS = "message.output_text.logprobs"
_STATELESS = "is not supported: this server stores nothing (send the whole conversation as input)"
_NO_LOGPROBS = "the Responses route returns no logprobs (/v1/chat/completions does)"


# --- input items -----------------------------------------------------------------------


class MessageItem(Body):
    role: Annotated[Any, member(_ROLES, f"'{{at}}' must be one of {', '.join(_ROLES)}")] = Field(
        None, validate_default=True)
    content: text_parts(("input_text", "output_text", "text"), _MEDIA) = Field(
        None, validate_default=True)


class ReasoningItem(Body):
    """Its text: the reasoning_text content, else the summary."""

    content: Annotated[text_parts(("reasoning_text",), ()) | None, falsy_is_absent()] = None
    summary: Annotated[text_parts(("summary_text",), ()) | None, unless_given("content"),
                       falsy_is_absent()] = None

    def text(self) -> str:
        return self.content if self.content is not None else self.summary or ""


def _json_object(value: str) -> dict[str, Any]:
    if limits.text_nesting(value) > limits.MAX_NESTING:
        raise reject(f"'{{at}}' nests deeper than {limits.MAX_NESTING} levels")
    try:
        parsed = json.loads(value) if value.strip() else {}
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise reject("'{at}' must be a JSON object")
    return parsed


class FunctionCallItem(Body):
    name: str = Field(None, validate_default=True)
    arguments: Annotated[str, AfterValidator(_json_object)] = Field(None, validate_default=True)
    call_id: str = Field(None, validate_default=True)


class FunctionCallOutputItem(Body):
    output: text_parts(("input_text", "output_text"), _MEDIA) = Field(None, validate_default=True)
    call_id: str = Field(None, validate_default=True)


_ITEMS: dict[str, type[Body]] = {"message": MessageItem, "reasoning": ReasoningItem,
                                 "function_call": FunctionCallItem,
                                 "function_call_output": FunctionCallOutputItem}


def _item(value: Any) -> Body:
    if not isinstance(value, dict):
        raise reject("'{at}' must be an object")
    kind = value.get("type", "message")
    model = _ITEMS.get(kind) if isinstance(kind, str) else None
    if model is not None:
        return model.model_validate(value)
    if kind == "item_reference":
        raise reject("'{at}.type' 'item_reference' is not supported: nothing is stored",
                     "{at}.type", "unsupported_parameter")
    raise reject(f"'{{at}}.type' {kind!r} is not supported: the server runs no hosted tools and "
                 "reads text only", "{at}.type", "unsupported_parameter")


_ITEM_LIST = TypeAdapter(list[Annotated[Any, AfterValidator(_item)]])


def _input(value: Any, handler: Any) -> Any:
    """A string (one user message) or a non-empty list of items."""
    if value is None:
        raise reject("'{at}' is required")
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise reject("'{at}' must be a string or a non-empty list of items")
    return _ITEM_LIST.validate_python(value)


def _messages(items: str | list[Body]) -> list[dict[str, Any]]:
    """The chat messages of the input items, in order: reasoning becomes the next
    assistant message's reasoning_content; calls right after an assistant message
    join it; reasoning with no assistant turn after it is dropped."""
    if isinstance(items, str):
        return [message("user", items)]
    out: list[dict[str, Any]] = []
    thought: list[str] = []  # reasoning items waiting for their assistant message

    def assistant() -> dict[str, Any]:
        """The assistant message calls join: the last one, or a new one."""
        if not out or out[-1]["role"] != "assistant" or thought:
            out.append(message("assistant", "", reasoning="\n".join(thought) if thought else None))
            thought.clear()
        return out[-1]

    for item in items:
        if isinstance(item, MessageItem):
            if item.role != "assistant":
                thought.clear()  # reasoning belongs to the assistant turn right after it
                out.append(message(item.role, item.content))
                continue
            msg = assistant()
            if msg.get("tool_calls"):  # text after calls: a message of its own
                out.append(message("assistant", item.content))
            else:
                msg["content"] = "\n".join(t for t in (msg["content"], item.content) if t)
        elif isinstance(item, ReasoningItem):
            thought.append(item.text())
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            msg = assistant()
            calls = msg.pop("tool_calls", [])
            reasoning = msg.pop("reasoning_content", None)
            msg["tool_calls"] = [*calls, call]  # the keys in message()'s order
            if reasoning is not None:
                msg["reasoning_content"] = reasoning
        else:
            assert isinstance(item, FunctionCallOutputItem)
            thought.clear()
            out.append(message("tool", item.output, tool_call_id=item.call_id))
    return out


# --- tools, tool_choice, text.format -------------------------------------------------------


def _function_tool(value: Any) -> Any:
    if value != "function":
        raise reject(f"'{{at}}' {value!r} is not supported: only function tools are (the server "
                     "runs no hosted tools)", code="unsupported_parameter")
    return value


class Tool(Body):
    type: Annotated[Any, AfterValidator(_function_tool)] = Field(None, validate_default=True)
    name: str = Field(None, validate_default=True)
    description: str | None = None
    parameters: dict[str, Any] | None = None

    def chat_tool(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        if self.parameters is not None:
            fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


def _tool_choice(value: Any) -> Any:
    """auto / none / required, or {type: function, name}: "required" and the name
    as a ForcedCall, "auto" / "none" as they are."""
    if value is None:
        return None
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise reject(CHOICE_SHAPE, "tool_choice")
        return ForcedCall() if value == "required" else value
    if isinstance(value, dict) and value.get("type") == "function":
        name = value.get("name")
        if not isinstance(name, str):
            raise reject("'{at}.name' must be a string", "{at}.name")
        return ForcedCall(name)
    raise reject("'{at}' must be auto, none, required or {type: function, name}")


class TextFormat(Body):
    type: Annotated[Any, member(("text", "json_object", "json_schema"),
                                "'{at}' must be one of text, json_object, json_schema", "{up}")
                    ] = Field(None, validate_default=True)
    name: Annotated[str, Worded("'{at}' must be a non-empty string", "{up}"),
                    non_empty("'{at}' must be a non-empty string", "{up}")] = "response"
    schema_: Annotated[dict[str, Any], Worded("'{at}' must be a JSON schema object", "{up}")
                       ] = Field(None, alias="schema")
    strict: Annotated[bool, Worded("'{at}' must be a boolean", "{up}")] | None = None

    @model_validator(mode="before")
    @classmethod
    def _schema_when_asked(cls, data: Any) -> Any:
        """name, schema and strict are read for type json_schema only."""
        if isinstance(data, dict) and data.get("type") != "json_schema":
            data = {"type": data.get("type")}
        return data

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise reject("'{at}.schema' must be a JSON schema object", "{at}")
        return self


class TextConfig(Body):
    format: Annotated[TextFormat, worded("'{at}.type' must be one of text, json_object, "
                                         "json_schema", "{at}")] | None = None


def _include(value: list[str]) -> list[str]:
    if _LOGPROBS in value:
        raise reject(f"'{{at}}' {_LOGPROBS!r} is not supported: {_NO_LOGPROBS}",
                     code="unsupported_parameter")
    return value


def _top_logprobs(value: int) -> int:
    if value < 0:
        raise reject("'{at}' must be a non-negative integer")
    if value > 0:
        raise reject(f"'{{at}}' is not supported: {_NO_LOGPROBS}", code="unsupported_parameter")
    return value


def _truncation(value: Any) -> Any:
    if value not in (None, "disabled"):
        raise reject("'{at}' 'auto' is not supported: a conversation longer than the context is "
                     "a 400", code="unsupported_parameter")
    return value


# --- the body -------------------------------------------------------------------------------


class ResponsesRequest(Sampling):
    """A /v1/responses body. Stateless: previous_response_id, conversation, prompt and
    background are a 400; store is accepted and ignored (agents such as Codex send
    the whole conversation each turn with store false); reasoning, metadata, user and
    other unknown fields are ignored. top_k, min_p, seed, stop, ignore_eos,
    min_tokens and the penalties are ftserve extensions, with their
    /v1/chat/completions meaning."""

    include: Annotated[list[str], Worded("'{at}' must be a list of strings"),
                       AfterValidator(_include)] | None = None
    top_logprobs: Annotated[int, Worded("'{at}' must be a non-negative integer"),
                            AfterValidator(_top_logprobs)] | None = None
    previous_response_id: Annotated[Any, refused(_STATELESS)] = None
    conversation: Annotated[Any, refused(_STATELESS)] = None
    prompt: Annotated[Any, refused(_STATELESS)] = None
    background: Annotated[Any, refused(_STATELESS)] = None
    truncation: Annotated[Any, AfterValidator(_truncation)] = None
    input: Annotated[Any, WrapValidator(_input)] = Field(None, validate_default=True)
    instructions: str | None = None
    model: str | None = None
    stream: bool | None = None
    parallel_tool_calls: bool | None = None
    stop: Stop | None = None
    max_output_tokens: Int(1, I32) | None = None
    tools: list[Tool] | None = None
    tool_choice: Annotated[Any, AfterValidator(_tool_choice)] = None
    text: Annotated[TextConfig | None, lenient(dict)] = None


def parse_responses_request(raw: Any) -> ChatRequest:
    """A /v1/responses body as the internal request."""
    body = parse(ResponsesRequest, raw)
    messages = _messages(body.input)
    if body.instructions is not None:
        messages.insert(0, message("system", body.instructions))
    choice = body.tool_choice
    none = choice == "none"
    tools = [t.chat_tool() for t in body.tools] if body.tools else None
    if tools and not none:
        check_tool_names(tools)
    tools, forced = offered_tools(tools, choice if isinstance(choice, ForcedCall) else None, none)
    fmt = _format(body.text)
    rf.check_tools(fmt, tools)
    cont = continues(messages)
    if cont:
        check_continuation("input", forced, fmt, "text.format")
    return ChatRequest(
        kind="chat",
        prompt_field="input",
        model=body.model,
        messages=messages,
        add_generation_prompt=not cont,
        continue_final=cont,
        stream=bool(body.stream),
        stop=body.stop or (),
        max_tokens=body.max_output_tokens,
        sampling=body.sampling(),
        tools=tools,
        parallel_tool_calls=(body.parallel_tool_calls is not False
                             and (forced is None or forced.name is None)),
        forced=forced,
        response_format=fmt,
    )


def _format(text: TextConfig | None) -> rf.ResponseFormat | None:
    spec = text.format if text is not None else None
    if spec is None or spec.type == "text":
        return None
    if spec.type == "json_object":
        return rf.json_object("text.format")
    return rf.bounded("json_schema", spec.schema_, "text.format")
