"""``response_format``: structured outputs for /v1/chat/completions and /v1/completions.

    {"type": "text"}                                  no constraint (as if absent)
    {"type": "json_object"}                           one JSON object
    {"type": "json_schema", "json_schema": {"name": str, "schema": {...},
                                            "strict": bool, "description": str}}
                                                      JSON valid against the schema

The JSON forms become an llguidance grammar here (``parse``, no tokenizer needed);
``matchers`` compiles it against the model's vocabulary (engine/grammar.py), one
matcher per choice, before anything is submitted: a schema the library rejects is a
400 naming ``response_format`` and the engine never sees the request. The output is
then constrained token by token (the sampler bans what the grammar does not allow)
and ends with finish_reason "stop" when the grammar is complete ("length" if
max_tokens comes first: the text is then a prefix of valid JSON).

Choices made here:
- JSON is generated compact (no whitespace between tokens of the JSON syntax):
  with free whitespace a model can emit blank lines forever and never finish, a
  known failure mode. A schema can ask otherwise through llguidance's own
  ``"x-guidance": {"whitespace_flexible": true}``.
- ``strict`` is accepted and not needed: the output always follows the schema.
- With ``tools`` (and a tool_choice other than "none") a JSON response_format is a
  400: the format would constrain the tool calls' text as well, and the model
  could then never call a tool. Send tool_choice "none" to use both.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import llguidance

from ftserve.engine.grammar import GrammarMatcher
from ftserve.server.errors import bad_request

if TYPE_CHECKING:
    from ftserve.server.text import TextCodec

PARAM = "response_format"
# Applied before the schema's own "x-guidance" options, so a schema can override them.
_JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False}


@dataclass(frozen=True)
class ResponseFormat:
    """A validated JSON response_format and the llguidance grammar it stands for."""

    kind: Literal["json_object", "json_schema"]
    grammar: str  # llguidance grammar (JSON text)


def parse(body: dict[str, Any]) -> ResponseFormat | None:
    """The request's response_format (None: absent, null or {"type": "text"})."""
    fmt = body.get(PARAM)
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request(f"'{PARAM}' must be an object", param=PARAM)
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object", _grammar({"type": "object"}))
    if kind == "json_schema":
        return ResponseFormat("json_schema", _grammar(_schema(fmt.get("json_schema"))))
    raise bad_request(f"'{PARAM}.type' must be \"text\", \"json_object\" or \"json_schema\", "
                      f"got {kind!r}", param=PARAM)


def _schema(spec: Any) -> dict[str, Any]:
    where = f"{PARAM}.json_schema"
    if not isinstance(spec, dict):
        raise bad_request(f"'{where}' must be an object with 'name' and 'schema'", param=PARAM)
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"'{where}.name' must be a non-empty string", param=PARAM)
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise bad_request(f"'{where}.schema' must be a JSON schema object", param=PARAM)
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise bad_request(f"'{where}.strict' must be a boolean", param=PARAM)
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise bad_request(f"'{where}.description' must be a string", param=PARAM)
    return schema


def _grammar(schema: dict[str, Any]) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_DEFAULTS)
    except (ValueError, TypeError) as err:
        raise bad_request(f"'{PARAM}' schema is invalid: {err}", param=PARAM) from None


def check_tools(fmt: ResponseFormat | None, tools: list[dict[str, Any]] | None) -> None:
    """A JSON format with tools offered is a 400 (see the module docstring)."""
    if fmt is not None and tools:
        raise bad_request(f"'{PARAM}' {fmt.kind} cannot be combined with 'tools' unless "
                          "'tool_choice' is \"none\": the format would also constrain the "
                          "tool calls", param=PARAM)


async def matchers(fmt: ResponseFormat, text: TextCodec, vocab_size: int,
                   n: int) -> list[GrammarMatcher]:
    """n fresh matchers of ``fmt`` (one per choice), off the event loop (compiling a
    large schema takes a while; the codec keeps compiled grammars); a grammar the
    library rejects is a 400."""
    try:
        return await asyncio.to_thread(text.grammar_matchers, fmt.grammar, vocab_size, n)
    except ValueError as err:
        raise bad_request(f"'{PARAM}' cannot be used: {err}", param=PARAM) from None
