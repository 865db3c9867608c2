"""Llama 3.1 / 3.2 / 3.3 JSON tool calls (format "llama3" in tool_calls.py)::

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "now", ...}

The whole assistant message is the call: one JSON object (``"parameters"`` or
``"arguments"``, as tool_calls.py's scanner reads both), optionally after the
``<|python_tag|>`` text and whitespace; more calls follow after ``;``. There is
no closing marker: the message just ends (the model's ``<|eom_id|>`` /
``<|eot_id|>`` are stop tokens, never in the text). A call is there only when
the output *starts* with one: text first and JSON later is plain content, as is
anything after the calls that is not ``; {...}``.

Streaming (tool_calls.ToolStream with this module's ``opening``): there is no
marker to look for, so the stream holds everything while the output is still
only whitespace, ``<|python_tag|>`` or a part of it; the first other character
decides. ``{``: from there on the text is scanned as calls (the held prefix is
kept in the buffer, so an unclean first call gives all of it back as content);
anything else: the held text and all that follows are content, sent at once.
A plain answer is therefore delayed only by its leading whitespace.

Which templates: format_of's ``is_llama3`` (Llama 3 header tokens, and the
template writing a call the JSON way or knowing ``<|python_tag|>``), tried after
the marker formats, so a hermes fine-tune of Llama (``<tool_call>``) stays hermes.
"""

from __future__ import annotations

from typing import Literal

PYTHON_TAG = "<|python_tag|>"
_HEADER = "<|start_header_id|>"
_WS = " \t\r\n"


def is_llama3(template_source: str) -> bool:
    """Whether a chat template is a Llama 3.x one that renders JSON tool calls."""
    if _HEADER not in template_source:
        return False
    # A call rendered as {"name": ..., "parameters": ...} or the python tag it may lead with.
    return PYTHON_TAG in template_source or '"parameters"' in template_source


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def opening(text: str) -> int | Literal["wait", "content"]:
    """What the start of an output, ``text``, is: the index of its call's ``{``;
    "wait" while it is all whitespace / the python tag (or a part of it);
    "content" once it is plain text."""
    i = _skip_ws(text, 0)
    if text.startswith(PYTHON_TAG, i):
        i = _skip_ws(text, i + len(PYTHON_TAG))
    elif PYTHON_TAG.startswith(text[i:]):  # nothing yet, or a part of the tag
        return "wait"
    if i == len(text):
        return "wait"
    return i if text[i] == "{" else "content"
