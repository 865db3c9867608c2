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
llguidance. ``parse`` checks a constraint's shape and size here, on the event loop,
without the grammar library (a bad one is a 400 naming its field); the library
first sees it in a sandbox child, then it is compiled against the model's
vocabulary, one matcher per choice (grammar_service.py), off the event loop and
before anything is submitted: a constraint the library rejects is a 400 too. The
sampler then bans what the grammar does not allow, and the output ends with
finish_reason "stop" when the grammar is complete ("length" if max_tokens comes
first: the text is then a prefix of a valid one).

What may reach the library is bounded (``MAX_*``), far past what real constraints
need, so that its work for one request stays small and its native recursion, which
overflows the stack on long enough chains of rules or $refs, stays shallow. The
sandbox catches what the bounds miss.

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

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from ftserve.api.errors import bad_request
from ftserve.chat import limits

PARAM = "response_format"

Kind = Literal["json_object", "json_schema", "regex", "choice", "grammar"]
MAX_CHOICES = 4096
MAX_BYTES = 256 * 1024  # a constraint's value as JSON: the schema, regex, choices or grammar
MAX_REFS = 1000  # "$ref"s in a schema
MAX_RULES = 2000  # rule definitions in a grammar

# A rule's definition: its name at the start of a line, then ":" (Lark) or "::=" (GBNF).
_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w.-]*[ \t]*(?:\{[^}\n]*\})?[ \t]*(?:::=|:)", re.M)
_OBJECT = orjson.dumps({"type": "object"})


@dataclass(frozen=True)
class ResponseFormat:
    """A constraint of bounded size, as grammar_sandbox.build takes it."""

    kind: Kind
    value: bytes  # JSON: the schema, regex, list of choices or grammar text
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
        return ResponseFormat("json_object", _OBJECT)
    if kind == "json_schema":
        return _bounded("json_schema", _schema(fmt.get("json_schema")), PARAM)
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
                out.append(ResponseFormat("json_object", _OBJECT, "structured_outputs"))
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
            limits.check_text(value, param)
            try:
                value = json.loads(value)
            except ValueError:
                raise bad_request(f"'{param}' is not JSON", param=param) from None
        if not isinstance(value, dict):
            raise bad_request(f"'{param}' must be a JSON schema object", param=param)
        return _bounded("json_schema", value, param)
    if key == "regex":
        if not isinstance(value, str) or not value:
            raise bad_request(f"'{param}' must be a non-empty regex string", param=param)
        return _bounded("regex", value, param)
    if key == "choice":
        if (not isinstance(value, list) or not value or len(value) > MAX_CHOICES
                or not all(isinstance(c, str) and c for c in value)):
            raise bad_request(f"'{param}' must be a list of 1 to {MAX_CHOICES} non-empty strings",
                              param=param)
        return _bounded("choice", value, param)
    if not isinstance(value, str) or not value.strip():
        raise bad_request(f"'{param}' must be a non-empty grammar (Lark or GBNF)", param=param)
    rules = len(_RULE.findall(value))
    if rules > MAX_RULES:
        raise bad_request(f"'{param}' defines {rules} rules; at most {MAX_RULES} are accepted",
                          param=param)
    return _bounded("grammar", value, param)


def _bounded(kind: Kind, value: Any, param: str) -> ResponseFormat:
    if limits.nesting(value) > limits.MAX_NESTING:
        raise bad_request(f"'{param}' nests deeper than {limits.MAX_NESTING} levels", param=param)
    data = orjson.dumps(value)
    if len(data) > MAX_BYTES:
        raise bad_request(f"'{param}' is {len(data)} bytes as JSON; at most {MAX_BYTES} are "
                          "accepted", param=param)
    if kind == "json_schema":
        refs = data.count(b'"$ref"')
        if refs > MAX_REFS:
            raise bad_request(f"'{param}' schema holds {refs} '$ref's; at most {MAX_REFS} are "
                              "accepted", param=param)
    return ResponseFormat(kind, data, param)


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


def check_tools(fmt: ResponseFormat | None, tools: list[dict[str, Any]] | None) -> None:
    """An output constraint with tools offered is a 400 (see the module docstring)."""
    if fmt is not None and tools:
        raise bad_request(f"'{fmt.param}' {fmt.kind} cannot be combined with 'tools' unless "
                          "'tool_choice' is \"none\": the format would also constrain the "
                          "tool calls", param=fmt.param)
