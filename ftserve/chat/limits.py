"""How deep a request may nest: checked once at the door, and again for JSON that
arrives as text inside a string.

Everything after the door recurses over what the client sent: the prompt's escaping
helper (text._escaped), the chat template (jinja2's tojson), the grammar library's
schema reader, Python's json module. Each has a limit far past any real request and
each fails differently at it (RecursionError, a native stack overflow), so the server
draws one line first: more than ``MAX_NESTING`` containers deep is a 400 naming the
field. Real requests stay far below it: a tool's JSON schema nests ~10 containers,
a conversation 4.
"""

from __future__ import annotations

import re
from typing import Any

from ftserve.chat.errors import bad_request

MAX_NESTING = 64

# A JSON string literal (an unterminated one runs to the end) or a bracket.
_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{}]')


def nesting(value: Any, limit: int = MAX_NESTING) -> int:
    """How many containers (dicts, lists) deep ``value`` goes, counted up to
    ``limit + 1`` (no recursion: the point is to be safe on anything)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        depth += 1
        if depth > limit:
            return depth
        deepest = max(deepest, depth)
        stack.extend((child, depth) for child in children if isinstance(child, dict | list))
    return deepest


def text_nesting(text: str) -> int:
    """How many containers deep the JSON text ``text`` goes (brackets inside string
    literals do not count), without parsing it."""
    depth = deepest = 0
    for token in _TOKENS.findall(text):
        if token in ("[", "{"):
            depth += 1
            deepest = max(deepest, depth)
        elif token in ("]", "}"):
            depth -= 1
    return deepest


def _too_deep(where: str) -> Exception:
    return bad_request(f"'{where}' nests deeper than {MAX_NESTING} levels", param=where)


def check_body(body: Any) -> None:
    """A 400 naming the top-level field (as the client sent it) that nests too deep."""
    if not isinstance(body, dict):
        if nesting(body) > MAX_NESTING:
            raise bad_request(f"the request body nests deeper than {MAX_NESTING} levels")
        return
    for key, value in body.items():
        if nesting(value, MAX_NESTING - 1) > MAX_NESTING - 1:
            raise _too_deep(str(key))


def check_text(text: str, where: str) -> None:
    """A 400 naming ``where`` when the JSON text nests too deep to be parsed safely."""
    if text_nesting(text) > MAX_NESTING:
        raise _too_deep(where)
