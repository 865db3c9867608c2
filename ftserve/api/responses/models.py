"""OpenAI Responses API requests (POST /v1/responses) -> the server's chat
request (``ParsedRequest``).

As the Anthropic route does (anthropic_protocol.py), the body is checked field
by field (a bad field is a 400 naming it as the Responses API spells it) and
rewritten as the chat body ``protocol.parse_chat`` reads, so rendering, tool
calls, reasoning and sampling are those of /v1/chat/completions::

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
    text.format json_schema / json_object -> response_format
    max_output_tokens                     -> max_tokens

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
from typing import Any

from ftserve.api.errors import APIError, bad_request, renamed, unsupported
from ftserve.chat import limits
from ftserve.chat.request import ParsedRequest, parse_chat, text_parts

_ROLES = ("user", "system", "developer", "assistant")
_PASSED = ("model", "temperature", "top_p", "stream", "parallel_tool_calls", "top_k", "min_p",
           "seed", "stop", "ignore_eos", "min_tokens", "presence_penalty", "frequency_penalty",
           "repetition_penalty")
_REFUSED = ("previous_response_id", "conversation", "prompt", "background")
_LOGPROBS = "message.output_text.logprobs"
# parse_chat names the chat fields the translation wrote; the client sent these.
RENAMED = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format"}


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise bad_request(f"'{where}' must be a string", param=where)
    return value


def _parts(value: Any, where: str, kinds: tuple[str, ...]) -> str:
    return text_parts(value, where, kinds, ("input_image", "input_file", "input_audio"))


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its reasoning_text content, else its summary."""
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        value = item.get(key)
        if value:
            return _parts(value, f"{where}.{key}", (kind,))
    return ""


def _input(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request("'input' must be a string or a non-empty list of items", param="input")
    out: list[dict[str, Any]] = []
    thought: list[str] = []  # reasoning items waiting for their assistant message

    def assistant() -> dict[str, Any]:
        """The assistant message calls join: the last one, or a new one."""
        if not out or out[-1]["role"] != "assistant" or thought:
            msg: dict[str, Any] = {"role": "assistant", "content": ""}
            if thought:
                msg["reasoning_content"] = "\n".join(thought)
                thought.clear()
            out.append(msg)
        return out[-1]

    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"'{where}' must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise bad_request(f"'{where}.role' must be one of {', '.join(_ROLES)}", param=f"{where}.role")
            text = _parts(item.get("content"), f"{where}.content", ("input_text", "output_text", "text"))
            if role != "assistant":
                thought.clear()  # reasoning belongs to the assistant turn right after it
            if role == "assistant":
                msg = assistant()
                if msg.get("tool_calls"):  # text after calls: a message of its own
                    out.append({"role": "assistant", "content": text})
                else:
                    msg["content"] = "\n".join(t for t in (msg["content"], text) if t)
            else:
                out.append({"role": role, "content": text})
        elif kind == "reasoning":
            thought.append(_reasoning_text(item, where))
        elif kind == "function_call":
            name = _str(item.get("name"), f"{where}.name")
            args = _str(item.get("arguments"), f"{where}.arguments")
            limits.check_text(args, f"{where}.arguments")
            try:
                parsed = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise bad_request(f"'{where}.arguments' must be a JSON object",
                                  param=f"{where}.arguments") from None
            if not isinstance(parsed, dict):
                raise bad_request(f"'{where}.arguments' must be a JSON object", param=f"{where}.arguments")
            call = {"id": _str(item.get("call_id"), f"{where}.call_id"), "type": "function",
                    "function": {"name": name, "arguments": parsed}}
            assistant().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = _parts(item.get("output"), f"{where}.output", ("input_text", "output_text"))
            thought.clear()
            out.append({"role": "tool", "tool_call_id": _str(item.get("call_id"), f"{where}.call_id"),
                        "content": output})
        elif kind == "item_reference":
            raise unsupported(f"{where}.type", "'item_reference' is not supported: nothing is stored")
        else:
            raise unsupported(f"{where}.type", f"{kind!r} is not supported: the server runs no "
                              "hosted tools and reads text only")
    return out  # reasoning with no assistant turn after it is dropped


def _tools(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise bad_request("'tools' must be a list", param="tools")
    out = []
    for i, tool in enumerate(value):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_request(f"'{at}' must be an object", param=at)
        if tool.get("type") != "function":
            raise unsupported(f"{at}.type", f"{tool.get('type')!r} is not supported: only "
                              "function tools are (the server runs no hosted tools)")
        fn: dict[str, Any] = {"name": _str(tool.get("name"), f"{at}.name")}
        if tool.get("description") is not None:
            fn["description"] = _str(tool["description"], f"{at}.description")
        params = tool.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise bad_request(f"'{at}.parameters' must be an object", param=f"{at}.parameters")
            fn["parameters"] = params
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(value: Any) -> Any:
    if isinstance(value, str):
        return value  # auto / none / required: parse_chat checks them
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": _str(value.get("name"), "tool_choice.name")}}
    raise bad_request("'tool_choice' must be auto, none, required or {type: function, name}",
                      param="tool_choice")


def _text_format(text: Any) -> dict[str, Any] | None:
    """text.format -> chat's response_format (None: plain text)."""
    if not isinstance(text, dict) or text.get("format") is None:
        return None
    fmt = text["format"]
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {"name": fmt.get("name", "response"), "schema": fmt.get("schema"),
                  "strict": fmt.get("strict", False)}
        return {"type": "json_schema", "json_schema": schema}
    raise bad_request("'text.format.type' must be one of text, json_object, json_schema",
                      param="text.format")


def _check_include(include: Any, top_logprobs: Any) -> None:
    """``include`` and ``top_logprobs``: a clear 400 where they ask for output-text
    logprobs (not returned here: silently empty arrays would mislead)."""
    if include is not None:
        if not isinstance(include, list) or not all(isinstance(v, str) for v in include):
            raise bad_request("'include' must be a list of strings", param="include")
        if _LOGPROBS in include:
            raise unsupported("include", f"{_LOGPROBS!r} is not supported: the Responses route "
                              "returns no logprobs (/v1/chat/completions does)")
    if top_logprobs is not None:
        if not isinstance(top_logprobs, int) or isinstance(top_logprobs, bool) or top_logprobs < 0:
            raise bad_request("'top_logprobs' must be a non-negative integer", param="top_logprobs")
        if top_logprobs > 0:
            raise unsupported("top_logprobs", "is not supported: the Responses route returns no "
                              "logprobs (/v1/chat/completions does)")


def parse_responses_request(raw: Any) -> ParsedRequest:
    if not isinstance(raw, dict):
        raise bad_request("request body must be a JSON object")
    _check_include(raw.get("include"), raw.get("top_logprobs"))
    for key in _REFUSED:
        if raw.get(key) is not None:
            raise unsupported(key, "is not supported: this server stores nothing (send the "
                              "whole conversation as input)")
    if raw.get("truncation") not in (None, "disabled"):
        raise unsupported("truncation", "'auto' is not supported: a conversation longer than "
                          "the context is a 400")
    if raw.get("input") is None:
        raise bad_request("'input' is required", param="input")
    messages = _input(raw["input"])
    if raw.get("instructions") is not None:
        messages.insert(0, {"role": "system", "content": _str(raw["instructions"], "instructions")})
    chat: dict[str, Any] = {"messages": messages}
    for key in _PASSED:
        if raw.get(key) is not None:
            chat[key] = raw[key]
    if raw.get("max_output_tokens") is not None:
        chat["max_tokens"] = raw["max_output_tokens"]
    if raw.get("tools") is not None:
        chat["tools"] = _tools(raw["tools"])
    if raw.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(raw["tool_choice"])
    fmt = _text_format(raw.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    last = messages[-1]
    if last["role"] == "assistant" and last["content"] and not last.get("tool_calls"):
        chat["continue_final_message"] = True  # the reply continues this text
    try:
        return parse_chat(chat)
    except APIError as err:
        raise renamed(err, RENAMED) from None
