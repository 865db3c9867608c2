"""Structured outputs for /v1/chat/completions and /v1/completions: the output
constrained token by token to a JSON schema, a regex, a fixed choice or a grammar.

OpenAI's ``response_format``::

    {"type": "text"}                                  no constraint (as if absent)
    {"type": "json_object"}                           one JSON object
    {"type": "json_schema", "json_schema": {"name": str, "schema": {...},
                                            "strict": bool, "description": str}}
                                                      JSON valid against the schema

and, as other servers take them (one constraint per request; a second is a 400)::

    "structured_outputs": {"json": schema | "<schema text>" | "json_object": true
                           | "regex": str | "choice": [str, ...] | "grammar": str}   (vLLM)
    "guided_json" / "guided_regex" / "guided_choice" / "guided_grammar"             (vLLM, older)
    "json_schema": schema,  "grammar": str                                            (llama.cpp)

A grammar is Lark (llguidance's dialect) or GBNF, told apart and converted by
llguidance. Each becomes an llguidance grammar here (``parse``, no tokenizer
needed, checked at once: a bad one is a 400 naming its field and the engine never
sees the request); ``matchers`` compiles it against the model's vocabulary
(engine/grammar.py), one matcher per choice. The sampler then bans what the
grammar does not allow, and the output ends with finish_reason "stop" when the
grammar is complete ("length" if max_tokens comes first: the text is then a prefix
of a valid one).

Choices made here:
- JSON is generated compact (no whitespace between tokens of the JSON syntax):
  with free whitespace a model can emit blank lines forever and never finish, a
  known failure mode. A schema can ask otherwise through llguidance's own
  ``"x-guidance": {"whitespace_flexible": true}``.
- ``strict`` is accepted and not needed: the output always follows the schema.
- With ``tools`` (and a tool_choice other than "none") a constraint is a 400: it
  would constrain the tool calls' text as well, and the model could then never
  call a tool. Send tool_choice "none" to use both.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import llguidance
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from ftserve.engine.grammar import GrammarMatcher
from ftserve.server.errors import bad_request

if TYPE_CHECKING:
    from ftserve.server.text import TextCodec

PARAM = "response_format"
# Applied before the schema's own "x-guidance" options, so a schema can override them.
_JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False}


Kind = Literal["json_object", "json_schema", "regex", "choice", "grammar"]
MAX_CHOICES = 4096


@dataclass(frozen=True)
class ResponseFormat:
    """A validated output constraint and the llguidance grammar it stands for."""

    kind: Kind
    grammar: str  # llguidance grammar (JSON text)
    param: str = PARAM  # the request field it came from (errors name it)


def parse(body: dict[str, Any]) -> ResponseFormat | None:
    """The request's output constraint, from whichever field holds it (None: none,
    or response_format {"type": "text"}); two of them are a 400."""
    found = [f for f in (_response_format(body), *_other_fields(body)) if f is not None]
    if len(found) > 1:
        raise bad_request(f"'{found[0].param}' and '{found[1].param}' both constrain the output; "
                          "give one", param=found[1].param)
    return found[0] if found else None


def _response_format(body: dict[str, Any]) -> ResponseFormat | None:
    fmt = body.get(PARAM)
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request(f"'{PARAM}' must be an object", param=PARAM)
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object", _grammar({"type": "object"}, PARAM))
    if kind == "json_schema":
        return ResponseFormat("json_schema", _grammar(_schema(fmt.get("json_schema")), PARAM))
    raise bad_request(f"'{PARAM}.type' must be \"text\", \"json_object\" or \"json_schema\", "
                      f"got {kind!r}", param=PARAM)


def _other_fields(body: dict[str, Any]) -> list[ResponseFormat | None]:
    out: list[ResponseFormat | None] = []
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("'structured_outputs' must be an object", param="structured_outputs")
        given = {k: v for k, v in so.items() if v is not None and v is not False}
        unknown = sorted(set(given) - {"json", "json_object", "regex", "choice", "grammar"})
        if unknown:
            raise bad_request(f"'structured_outputs' does not support {', '.join(unknown)}",
                              param="structured_outputs")
        if len(given) > 1:
            raise bad_request("'structured_outputs' must hold one of json, json_object, regex, "
                              "choice, grammar", param="structured_outputs")
        for key, value in given.items():
            if key == "json_object":
                out.append(ResponseFormat("json_object", _grammar({"type": "object"}, key),
                                          "structured_outputs"))
            else:
                out.append(_one(key, value, "structured_outputs"))
    for field, key in (("guided_json", "json"), ("guided_regex", "regex"),
                       ("guided_choice", "choice"), ("guided_grammar", "grammar"),
                       ("json_schema", "json"), ("grammar", "grammar")):
        if body.get(field) is not None:
            out.append(_one(key, body[field], field))
    return out


def _one(key: str, value: Any, param: str) -> ResponseFormat:
    """One constraint of structured_outputs' kinds, from field ``param``."""
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise bad_request(f"'{param}' is not JSON", param=param) from None
        if not isinstance(value, dict):
            raise bad_request(f"'{param}' must be a JSON schema object", param=param)
        return ResponseFormat("json_schema", _grammar(value, param), param)
    if key == "regex":
        if not isinstance(value, str) or not value:
            raise bad_request(f"'{param}' must be a non-empty regex string", param=param)
        return ResponseFormat("regex", _checked(llguidance.LLMatcher.grammar_from_regex(value), param),
                              param)
    if key == "choice":
        if (not isinstance(value, list) or not value or len(value) > MAX_CHOICES
                or not all(isinstance(c, str) and c for c in value)):
            raise bad_request(f"'{param}' must be a list of 1 to {MAX_CHOICES} non-empty strings",
                              param=param)
        lark = "start: " + " | ".join(json.dumps(c) for c in value)  # JSON escapes are Lark's
        return ResponseFormat("choice", _checked(llguidance.LLMatcher.grammar_from_lark(lark), param),
                              param)
    if not isinstance(value, str) or not value.strip():
        raise bad_request(f"'{param}' must be a non-empty grammar (Lark or GBNF)", param=param)
    try:
        lark = any_to_lark(value)
    except GbnfToLarkError as err:
        raise bad_request(f"'{param}' is not a valid grammar: {err}", param=param) from None
    return ResponseFormat("grammar", _checked(llguidance.LLMatcher.grammar_from_lark(lark), param),
                          param)


def _checked(grammar: str, param: str) -> str:
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise bad_request(f"'{param}' is not valid: {problem.strip()}", param=param)
    return grammar


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


def _grammar(schema: dict[str, Any], param: str) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_DEFAULTS)
    except (ValueError, TypeError) as err:
        raise bad_request(f"'{param}' schema is invalid: {err}", param=param) from None


def check_tools(fmt: ResponseFormat | None, tools: list[dict[str, Any]] | None) -> None:
    """An output constraint with tools offered is a 400 (see the module docstring)."""
    if fmt is not None and tools:
        raise bad_request(f"'{fmt.param}' {fmt.kind} cannot be combined with 'tools' unless "
                          "'tool_choice' is \"none\": the format would also constrain the "
                          "tool calls", param=fmt.param)


async def matchers(fmt: ResponseFormat, text: TextCodec, vocab_size: int,
                   n: int) -> list[GrammarMatcher]:
    """n fresh matchers of ``fmt`` (one per choice), off the event loop (compiling a
    large schema takes a while; the codec keeps compiled grammars); a grammar the
    library rejects is a 400."""
    try:
        return await asyncio.to_thread(text.grammar_matchers, fmt.grammar, vocab_size, n)
    except ValueError as err:
        raise bad_request(f"'{fmt.param}' cannot be used: {err}", param=fmt.param) from None
