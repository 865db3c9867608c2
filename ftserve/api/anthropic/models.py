"""Anthropic Messages API requests -> the server's chat request (``ParsedRequest``).

An Anthropic body is checked field by field here (a bad field is a 400 naming it
as Anthropic spells it) and rewritten as the OpenAI chat body the rest of the
server already reads (``protocol.parse_chat``), so rendering, tool calls,
reasoning and sampling are those of /v1/chat/completions::

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
    a final assistant message with text   -> continue_final_message (Anthropic's prefill:
                                             the reply continues it)
    stop_sequences                        -> stop
    tools [{name, description, input_schema}]
                                          -> tools [{type: function, function: {...}}]
    tool_choice auto / any / tool / none  -> "auto" / "required" / the named function /
                                             "none"; disable_parallel_tool_use ->
                                             parallel_tool_calls false
    output_config.format {type: json_schema, schema} (or the beta's output_format)
                                          -> response_format json_schema: the reply's
                                             text is constrained to the schema
    thinking enabled / disabled           -> chat_template_kwargs.enable_thinking true /
                                             false, where the template reads it (Qwen3);
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

import dataclasses
from dataclasses import dataclass
from typing import Any

from ftserve.api.errors import APIError, bad_request, renamed, unsupported
from ftserve.chat.request import ParsedRequest, parse_chat, text_parts
from ftserve.chat.text import TextCodec

_ROLES = ("user", "assistant")
_EXTENSIONS = ("ignore_eos", "seed", "min_p", "min_tokens", "presence_penalty",
               "frequency_penalty", "repetition_penalty")
_SAMPLING = ("temperature", "top_p", "top_k")
_REFUSED = ("mcp_servers", "container")  # fields whose meaning the server cannot provide
# parse_chat names the OpenAI fields the translation wrote; the client sent these.
_OPENAI_NAMES = {"stop": "stop_sequences", "parallel_tool_calls": "tool_choice",
                 "chat_template_kwargs": "thinking", "continue_final_message": "messages"}


@dataclass(frozen=True)
class MessagesRequest:
    """A validated /v1/messages (or count_tokens) request."""

    chat: ParsedRequest
    thinking: bool | None  # thinking enabled / disabled; None: the template's default
    format_name: str = "output_config.format"  # the structured-output field the client sent

    def for_template(self, text: TextCodec) -> ParsedRequest:
        """The chat request with ``thinking`` as enable_thinking, where the template reads it."""
        if self.thinking is None or not text.template_reads("enable_thinking"):
            return self.chat
        kwargs = {**self.chat.template_kwargs, "enable_thinking": self.thinking}
        return dataclasses.replace(self.chat, template_kwargs=kwargs)


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise bad_request(f"'{where}' must be a string", param=where)
    return value


def _text_blocks(value: Any, where: str) -> str:
    """A string, or a list of text blocks joined by newlines."""
    return text_parts(value, where, ("text",), ("image", "document"))


def _user(content: list[Any], where: str) -> list[dict[str, Any]]:
    """A user turn's blocks, in order: text runs become user messages, each
    tool_result a tool message."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_str(block.get("text"), f"{at}.text"))
            continue
        if kind != "tool_result":
            _refuse_block(kind, at, ("text", "tool_result", "image", "document"))
        if texts:
            out.append({"role": "user", "content": "\n".join(texts)})
            texts = []
        call_id = _str(block.get("tool_use_id"), f"{at}.tool_use_id")
        result = block.get("content")
        body = "" if result is None else _text_blocks(result, f"{at}.content")
        is_error = block.get("is_error", False)
        if not isinstance(is_error, bool):
            raise bad_request(f"'{at}.is_error' must be a boolean", param=f"{at}.is_error")
        out.append({"role": "tool", "tool_call_id": call_id,
                    "content": "Error: " + body if is_error else body})
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant(content: list[Any], where: str) -> dict[str, Any]:
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_str(block.get("text"), f"{at}.text"))
        elif kind == "thinking":
            thoughts.append(_str(block.get("thinking"), f"{at}.thinking"))
        elif kind == "redacted_thinking":
            continue  # encrypted for Anthropic's models; nothing a template can show
        elif kind == "tool_use":
            call_id = _str(block.get("id"), f"{at}.id")
            name = _str(block.get("name"), f"{at}.name")
            args = block.get("input")
            if not isinstance(args, dict):
                raise bad_request(f"'{at}.input' must be an object", param=f"{at}.input")
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": args}})
        else:
            _refuse_block(kind, at, ("text", "thinking", "redacted_thinking", "tool_use"))
    msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        msg["tool_calls"] = calls
    if thoughts:
        msg["reasoning_content"] = "\n".join(thoughts)
    return msg


def _refuse_block(kind: Any, at: str, allowed: tuple[str, ...]) -> None:
    if kind in ("image", "document"):
        raise unsupported(f"{at}.type", f"{kind!r} is not supported: this server's model "
                          "reads text only")
    raise bad_request(f"'{at}.type' must be one of {', '.join(allowed)}; got {kind!r}",
                      param=f"{at}.type")


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise bad_request("'messages' must be a non-empty list", param="messages")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(msg, dict) or msg.get("role") not in _ROLES:
            raise bad_request(f"'{where}' must be an object with role 'user' or 'assistant'",
                              param=where)
        content = msg.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise bad_request(f"'{where}.content' must be a string or a list of content blocks",
                              param=f"{where}.content")
        if msg["role"] == "user":
            out.extend(_user(content, where))
        else:
            out.append(_assistant(content, where))
    return out


def _tools(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise bad_request("'tools' must be a list", param="tools")
    out = []
    for i, tool in enumerate(value):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_request(f"'{at}' must be an object", param=at)
        if tool.get("type") not in (None, "custom"):
            raise unsupported(f"{at}.type", f"{tool.get('type')!r} is not supported: only "
                              "client tools ({name, description, input_schema}) are")
        name = _str(tool.get("name"), f"{at}.name")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise bad_request(f"'{at}.input_schema' must be an object", param=f"{at}.input_schema")
        fn: dict[str, Any] = {"name": name, "parameters": schema}
        if tool.get("description") is not None:
            fn["description"] = _str(tool["description"], f"{at}.description")
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(value: Any) -> tuple[Any, bool]:
    """(OpenAI tool_choice, parallel_tool_calls)."""
    if not isinstance(value, dict):
        raise bad_request("'tool_choice' must be an object with a type", param="tool_choice")
    kind = value.get("type")
    parallel = not value.get("disable_parallel_tool_use", False)
    if not isinstance(value.get("disable_parallel_tool_use", False), bool):
        raise bad_request("'tool_choice.disable_parallel_tool_use' must be a boolean",
                          param="tool_choice")
    if kind == "tool":
        choice: Any = {"type": "function",
                       "function": {"name": _str(value.get("name"), "tool_choice.name")}}
    elif kind in ("auto", "any", "none"):
        choice = {"auto": "auto", "any": "required", "none": "none"}[kind]
    else:
        raise bad_request("'tool_choice.type' must be one of auto, any, tool, none",
                          param="tool_choice")
    return choice, parallel


def _thinking(value: Any) -> bool | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "enabled":
        budget = value.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise bad_request("'thinking.budget_tokens' must be a positive integer",
                              param="thinking.budget_tokens")
        return True
    if kind == "disabled":
        return False
    if kind == "adaptive":
        return None
    raise bad_request("'thinking.type' must be one of enabled, disabled, adaptive",
                      param="thinking")


def parse_messages_request(raw: Any, count_only: bool = False) -> MessagesRequest:
    """A /v1/messages body (``count_only``: a count_tokens body, which has no
    max_tokens and does not stream)."""
    if not isinstance(raw, dict):
        raise bad_request("request body must be a JSON object")
    for key in _REFUSED:
        if raw.get(key) is not None:
            raise unsupported(key)
    fmt, fmt_name = _output_format(raw)
    if raw.get("messages") is None:
        raise bad_request("'messages' is required", param="messages")
    chat: dict[str, Any] = {"messages": _messages(raw["messages"])}
    system = raw.get("system")
    if system is not None:
        text = _text_blocks(system, "system")
        if text:
            chat["messages"].insert(0, {"role": "system", "content": text})
    last = chat["messages"][-1]
    if last["role"] == "assistant" and last["content"] and not last.get("tool_calls"):
        chat["continue_final_message"] = True  # prefill: the reply continues this text
    if not count_only:
        if raw.get("max_tokens") is None:
            raise bad_request("'max_tokens' is required", param="max_tokens")
        chat["max_tokens"] = raw["max_tokens"]
        chat["stream"] = raw.get("stream", False)
        for key in (*_SAMPLING, *_EXTENSIONS):
            if raw.get(key) is not None:
                chat[key] = raw[key]
    if "model" in raw:
        chat["model"] = raw["model"]
    if raw.get("stop_sequences") is not None:
        if not isinstance(raw["stop_sequences"], list):
            raise bad_request("'stop_sequences' must be a list of strings", param="stop_sequences")
        chat["stop"] = raw["stop_sequences"]
    if raw.get("tools") is not None:
        chat["tools"] = _tools(raw["tools"])
    if raw.get("tool_choice") is not None:
        chat["tool_choice"], chat["parallel_tool_calls"] = _tool_choice(raw["tool_choice"])
    if fmt is not None:
        chat["response_format"] = fmt
    thinking = _thinking(raw.get("thinking"))
    try:
        parsed = parse_chat(chat)
    except APIError as err:
        raise renamed(err, chat_names(fmt_name)) from None
    return MessagesRequest(parsed, thinking, fmt_name)


def _output_format(raw: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """Structured outputs: output_config.format (or the beta's output_format)
    {type: json_schema, schema} -> chat's response_format; and the field's name."""
    config = raw.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise bad_request("'output_config' must be an object", param="output_config")
    name, fmt = "output_config.format", (config or {}).get("format")
    if fmt is None and raw.get("output_format") is not None:
        name, fmt = "output_format", raw["output_format"]
    if fmt is None:
        return None, name
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad_request(f"'{name}' must be {{type: json_schema, schema: {{...}}}}", param=name)
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}, name


def chat_names(format_name: str) -> dict[str, str]:
    """Chat field -> the name this request's client sent it under."""
    return {**_OPENAI_NAMES, "response_format": format_name}
