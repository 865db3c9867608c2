"""A forced ``tool_choice``: the start of a call appended to the prompt.

``tool_choice`` (OpenAI's spelling; Anthropic's any / tool and the Responses API's
forms map onto it): "auto" (or absent) lets the model decide; "none" does not
offer the tools (they are not rendered); "required" and a named function
(``{"type": "function", "function": {"name": "X"}}``) force a call: the start
of a call in the template's syntax (FORCED_CALL) is appended to the rendered
prompt, so the model continues it, and a grammar (tool_grammar.py) holds the
continuation to well-formed calls whose arguments follow the tools' schemas.
That text is prompt (counted in prompt_tokens), and the tool-call parser reads
it followed by the model's output:

- "required" forces the opening up to the name: the model
  writes an offered tool's name, its arguments and, unless parallel_tool_calls
  is false, possibly further calls;
- a named function forces the opening, the name and the start of the
  arguments: the model writes the arguments, and the reply is that one call;
- a prompt that left a reasoning block open (a template that opens ``<think>``)
  gets it closed first (``before_call``), as templates write an empty one with
  thinking off: the client asked for a call now, the call is not reasoning, and
  reasoning could otherwise use up max_tokens before any call;
- output cut off by max_tokens (or a stop string) before its calls are whole
  is returned as the existing rules return it (content, nothing lost), with
  the forced text in front of it, so the client sees exactly what the model
  was conditioned on.

Forcing needs ``tools``, and a named function must be one of them (else a 400
naming ``tool_choice``: request.offered_tools). Each protocol spells tool_choice its
own way (its models.py) and maps it to a ``ForcedCall``.

The forced text per syntax, as the template renders a call (``FORCED_CALL``)::

    hermes,      named X:   <tool_call>\\n{"name": "X", "arguments":|
    hermes,      required:  <tool_call>\\n{"name": "|
    mistral,     named X:   [TOOL_CALLS] [{"name": "X", "arguments":|
    mistral,     required:  [TOOL_CALLS] [{"name": "|
    qwen3_coder, named X:   <tool_call>\\n<function=X>\\n|
    qwen3_coder, required:  <tool_call>\\n<function|
    llama3,      named X:   {"name": "X", "parameters":|
    llama3,      required:  {"name": "|

(``|`` marks the end; ``\\n`` is a newline). Named: up to the colon before the
arguments value, which the model writes (with its space: a forced trailing
space would split the model's usual " {" token); qwen3_coder has no JSON: up
to the newline the template writes after ``<function=X>``, which a Qwen
tokenizer joins to the ">". Required: up to the name's opening quote, the
model writes the name; qwen3_coder: up to ``<function``, so the model writes
"=name>" (a forced "=" would split its usual "=name" piece). llama3 is
forced without ``<|python_tag|>``: Llama templates write a custom tool's
call as bare JSON, with "parameters". The parser is fed
that text and then the model's, so a call parses as if the model had written
all of it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from ftserve.chat import reasoning
from ftserve.chat.tool_calls import Format


@dataclass(frozen=True)
class CallStart:
    """A call's opening as the template writes it, cut where a forced tool_choice
    ends (the module docstring shows each)."""

    required: str  # "required": up to where the model writes the name
    before_name: str  # named: up to the name
    after_name: str  # named: from after the name to the arguments
    json_name: bool = True  # the name is written as a JSON string


FORCED_CALL: dict[str, CallStart] = {
    "hermes": CallStart('<tool_call>\n{"name": "', '<tool_call>\n{"name": ', ', "arguments":'),
    "mistral": CallStart('[TOOL_CALLS] [{"name": "', '[TOOL_CALLS] [{"name": ', ', "arguments":'),
    "qwen3_coder": CallStart("<tool_call>\n<function", "<tool_call>\n<function=", ">\n",
                             json_name=False),
    "llama3": CallStart('{"name": "', '{"name": ', ', "parameters":'),
}


@dataclass(frozen=True)
class ForcedCall:
    """A forced tool_choice: "required" (name None) or the named function."""

    name: str | None = None


def forced_text(fmt: Format, call: ForcedCall, escape: Callable[[str], str] = str) -> str:
    """The text appended to the prompt to force ``call`` in syntax ``fmt``; ``escape``
    (TextCodec.escape_special) keeps control-token text in the client's name text."""
    start = FORCED_CALL[fmt]
    if call.name is None:
        return start.required
    name = json.dumps(call.name, ensure_ascii=False) if start.json_name else call.name
    return start.before_name + escape(name) + start.after_name


def before_call(prompt: str, marks_reasoning: bool) -> str:
    """What goes between the rendered ``prompt`` and a forced call's start: the end of
    a reasoning block the prompt opened (``marks_reasoning``: the template marks
    reasoning), as templates write an empty one with thinking off, else nothing."""
    if marks_reasoning and reasoning.opens_in_prompt(prompt):
        return reasoning.CLOSE + "\n\n"
    return ""
