"""Structured outputs: the output constrained token by token to a JSON schema, a
regex, a fixed choice or a grammar, whichever protocol asked for it (each maps its
fields here: OpenAI's ``response_format`` and vLLM's / llama.cpp's fields in
ftserve/api/openai/models.py, Anthropic's ``output_config.format``, the Responses
API's ``text.format``). A ``ResponseFormat`` names the field it came from, so an
error about it names what the client sent.

    json_object   one JSON object
    json_schema   JSON valid against the schema
    regex         text matching the regex
    choice        one of a list of strings
    grammar       Lark (llguidance's dialect) or GBNF, told apart and converted by
                  llguidance

A constraint's shape and size are checked here, on the event loop, without the
grammar library (a bad one is a 400 naming its field); the library first sees it in
a sandbox child, then it is compiled against the model's vocabulary, one matcher per
choice (grammar_service.py), off the event loop and before anything is submitted: a
constraint the library rejects is a 400 too. The sampler then bans what the grammar
does not allow, and the output ends with finish_reason "stop" when the grammar is
complete ("length" if max_tokens comes first: the text is then a prefix of a valid
one).

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

from ftserve.chat import limits
from ftserve.chat.errors import bad_request

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
    param: str  # the request field it came from, as the client named it (errors name it)


def json_object(param: str) -> ResponseFormat:
    """One JSON object, asked for in field ``param``."""
    return ResponseFormat("json_object", _OBJECT, param)


def constraint(key: str, value: Any, param: str) -> ResponseFormat:
    """One constraint of vLLM's structured_outputs kinds (json: a schema object or
    its JSON text, regex, choice, grammar), from field ``param``."""
    if key == "json":
        if isinstance(value, str):
            limits.check_text(value, param)
            try:
                value = json.loads(value)
            except ValueError:
                raise bad_request(f"'{param}' is not JSON", param=param) from None
        if not isinstance(value, dict):
            raise bad_request(f"'{param}' must be a JSON schema object", param=param)
        return bounded("json_schema", value, param)
    if key == "regex":
        if not isinstance(value, str) or not value:
            raise bad_request(f"'{param}' must be a non-empty regex string", param=param)
        return bounded("regex", value, param)
    if key == "choice":
        if (not isinstance(value, list) or not value or len(value) > MAX_CHOICES
                or not all(isinstance(c, str) and c for c in value)):
            raise bad_request(f"'{param}' must be a list of 1 to {MAX_CHOICES} non-empty strings",
                              param=param)
        return bounded("choice", value, param)
    if not isinstance(value, str) or not value.strip():
        raise bad_request(f"'{param}' must be a non-empty grammar (Lark or GBNF)", param=param)
    rules = len(_RULE.findall(value))
    if rules > MAX_RULES:
        raise bad_request(f"'{param}' defines {rules} rules; at most {MAX_RULES} are accepted",
                          param=param)
    return bounded("grammar", value, param)


def bounded(kind: Kind, value: Any, param: str) -> ResponseFormat:
    """``value`` as a constraint of ``kind``, once its size is known to be bounded."""
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


def check_tools(fmt: ResponseFormat | None, tools: list[dict[str, Any]] | None) -> None:
    """An output constraint with tools offered is a 400 (see the module docstring)."""
    if fmt is not None and tools:
        raise bad_request(f"'{fmt.param}' {fmt.kind} cannot be combined with 'tools' unless "
                          "'tool_choice' is \"none\": the format would also constrain the "
                          "tool calls", param=fmt.param)
