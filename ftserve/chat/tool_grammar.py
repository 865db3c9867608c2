"""The grammar a forced ``tool_choice`` holds the output to: well-formed calls in the
template's call syntax, each call's arguments valid against its tool's JSON schema.

tool_choice.py appends the start of a call to the prompt (``FORCED_CALL``); the
output continues it under this grammar (llguidance Lark, compiled per choice like a
``response_format``: response_format.matchers), so "required" and a named function
always come back as calls, parsed and streamed as any other output. What the
grammar lets the model write after the forced text, per syntax (NAME: an offered
tool's name; ARGS: that tool's schema as JSON; PARAMS: qwen3_coder's parameters)::

    hermes       named X:   ␣ARGS}\\n</tool_call>
                 required:  NAME", "arguments": ARGS}\\n</tool_call>
                            (\\n<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>)*
    mistral      named X:   ␣ARGS}]
                 required:  NAME", "arguments": ARGS}(, {"name": "NAME", "arguments": ARGS})*]
    llama3       named X:   ␣ARGS}
                 required:  NAME", "parameters": ARGS}(; {"name": "NAME", "parameters": ARGS})*
    qwen3_coder  named X:   PARAMS</function>\\n</tool_call>
                 required:  =NAME>\\nPARAMS</function>\\n</tool_call>
                            (\\n<tool_call>\\n<function=NAME>\\nPARAMS</function>\\n</tool_call>)*

A named function, and "required" with ``parallel_tool_calls`` false, is one call:
the grammar is then complete and the request ends there. "required" otherwise
lets the model end after any call or write another. Every syntax the project
reads (tool_calls.Format) is covered; a template with none cannot be given tools
at all (a 400 before this).

- ARGS is compact JSON with the separators templates render calls with (", " and
  ": ", as ``tojson`` writes them), the schema's own "x-guidance" options winning.
  A tool without ``parameters`` takes none: ``{}``. Schemas are compiled leniently:
  a keyword the library does not implement is ignored rather than refused; one
  it still cannot compile (no value meets it) is a 400 naming ``tool_choice``.
- PARAMS (qwen3_coder, which writes no JSON): the schema's properties in the
  schema's order, the required ones always and the others if the model likes,
  each ``<parameter=KEY>\\nVALUE\\n</parameter>\\n``. A value the parser keeps as
  text (tool_calls_xml.stays_text: type "string", or no type) is text that does
  not hold ``</parameter>``, held to the schema's ``enum`` / ``const`` of strings,
  ``minLength`` and ``maxLength`` (not to ``pattern`` or ``format``); any other
  value is its schema as JSON, which the parser types back.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from ftserve.chat.response_format import ResponseFormat
from ftserve.chat.tool_calls import Format
from ftserve.chat.tool_calls_xml import schema_types, stays_text
from ftserve.chat.tool_choice import ForcedCall, forced_text

PARAM = "tool_choice"  # the field a grammar the library refuses is blamed on
# Applied before a schema's own "x-guidance", so a schema can override them.
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ",
                                 "key_separator": ": ", "lenient": True}
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
# Per syntax: (after every call, before a further call, after the last call).
_FRAME: dict[str, tuple[str, str, str]] = {
    "hermes": ("\n</tool_call>", '\n<tool_call>\n{"name": "', ""),
    "mistral": ("", ', {"name": "', "]"),
    "llama3": ("", '; {"name": "', ""),
    "qwen3_coder": ("\n</tool_call>", "\n<tool_call>\n<function", ""),
}
_NL = "\n"
_PARAM_END = "\n</parameter>\n"
# Text that does not hold the end tag (qwen3_coder's text values; see the docstring).
_NO_END_TAG = r"~/(?s:.*)<\/parameter>(?s:.*)/"


def constraint(fmt: Format, call: ForcedCall, tools: list[dict[str, Any]],
               parallel: bool) -> ResponseFormat:
    """The output constraint of a forced ``call`` in syntax ``fmt`` over the validated
    ``tools`` (as the request offers them); ``parallel``: "required" may write more calls."""
    # Lark text, checked and compiled as any grammar constraint is (grammar_service.py).
    return ResponseFormat("grammar", orjson.dumps(lark(fmt, call, tools, parallel)), PARAM)


def lark(fmt: Format, call: ForcedCall, tools: list[dict[str, Any]], parallel: bool) -> str:
    """The grammar's Lark text (the module docstring shows its shape)."""
    each, further, last = _FRAME[fmt]
    rules: list[str] = []
    if call.name is not None:  # the prompt holds the call up to its arguments
        i, fn = next((i, t["function"]) for i, t in enumerate(tools) if t["function"]["name"] == call.name)
        start = f"{_body(fmt, i, fn, rules)} {_lit(each)} {_lit(last)}"
    else:
        opening = forced_text(fmt, ForcedCall())
        for i, tool in enumerate(tools):
            named = forced_text(fmt, ForcedCall(tool["function"]["name"]))
            assert named.startswith(opening), (named, opening)  # the name's text follows
            rules.append(f"call_{i}: {_lit(named[len(opening):])} {_body(fmt, i, tool['function'], rules)}")
        rules.append("call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
        more = f" ({_lit(further)} call {_lit(each)})*" if parallel else ""
        start = f"call {_lit(each)}{more} {_lit(last)}"
    return "\n".join([f"start: {start}", *rules]) + "\n"


def _lit(text: str) -> str:
    """A Lark string literal (JSON escapes are Lark's); nothing for empty text."""
    return json.dumps(text) if text else ""


def _body(fmt: Format, i: int, fn: dict[str, Any], rules: list[str]) -> str:
    """Tool ``i``'s call from its arguments to its end (its rules go into ``rules``)."""
    schema = _object_schema(fn.get("parameters"))
    if fmt != "qwen3_coder":
        rules.append(f"args_{i}: %json {json.dumps(_with_options(schema))}")
        return f'" " args_{i} "}}"'
    props = schema.get("properties")
    required = set(schema.get("required") or ())
    params = []
    for k, (key, prop) in enumerate(props.items() if isinstance(props, dict) else ()):
        value = _xml_value(f"value_{i}_{k}", prop, schema, rules)
        rules.append(f"param_{i}_{k}: {_lit(f'<parameter={key}>{_NL}')} {value}")
        params.append(f"param_{i}_{k}" + ("" if key in required else "?"))
    return " ".join([*params, '"</function>"'])


def _object_schema(parameters: Any) -> dict[str, Any]:
    """A tool's arguments schema: an object (a schema naming no type is given one)."""
    if parameters is None:
        return _NO_PARAMETERS
    return parameters if "type" in parameters else {**parameters, "type": "object"}


def _with_options(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "x-guidance": {**_JSON_OPTIONS, **(schema.get("x-guidance") or {})}}


def _xml_value(name: str, prop: Any, root: dict[str, Any], rules: list[str]) -> str:
    """A qwen3_coder parameter's value and its end tag, as a rule named ``name``."""
    prop = prop if isinstance(prop, dict) else {}
    if not stays_text(schema_types(prop)):
        # A value written as JSON; the root's definitions come along for its "$ref"s.
        defs = {k: root[k] for k in ("$defs", "definitions") if k in root}
        rules.append(f"{name}: %json {json.dumps(_with_options({**defs, **prop}))} "
                     f"{_lit(_PARAM_END)}")
        return name
    choices = prop["enum"] if "enum" in prop else [prop["const"]] if "const" in prop else None
    if isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices):
        rules.append(f"{name}: ({' | '.join(json.dumps(c) for c in choices)}) {_lit(_PARAM_END)}")
        return name
    lo, hi = prop.get("minLength"), prop.get("maxLength")
    lo = lo if isinstance(lo, int) and lo >= 0 else 0
    hi = str(hi) if isinstance(hi, int) and hi >= lo else ""
    term = name.upper()
    rules.append(f"{term}: /(?s:.){{{lo},{hi}}}/ & {_NO_END_TAG}")
    rules.append(f"{name}[lazy]: {term} {_lit(_PARAM_END)}")  # lazy: it ends at the first end tag
    return name
