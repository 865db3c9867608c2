"""A stream of typed output parts, for the protocols whose replies are lists of
them (Anthropic's content blocks: anthropic/messages.py; the Responses API's
output items: responses/route.py): a choice's pieces (reasoning, text, call
deltas: chat/output.py) become the route's events through its hooks.

Whitespace after text is held until more text comes: if a call comes instead it
is dropped, as the whole response strips it (tool_calls.parse), so a part never
ends with whitespace that a call follows.
"""

from __future__ import annotations

from typing import Any

Event = dict[str, Any]


class PartStream:
    """Pieces -> a route's events; a route implements the hooks (thought, text,
    call_start, call_args, close)."""

    def __init__(self) -> None:
        self._ws = ""  # held whitespace of the text

    def push(self, thought: str, content: str, deltas: list[dict[str, Any]]) -> list[Event]:
        events = self.thought(thought) if thought else []
        text = self._ws + content
        body = text.rstrip()
        self._ws = text[len(body):]
        if body:
            events += self.text(body)
        for d in deltas:
            if "id" in d:  # a call's start: its name; held whitespace before it is dropped
                self._ws = ""
                events += self.call_start(d["id"], d["function"]["name"])
            frag = d["function"].get("arguments", "")
            if frag:
                events += self.call_args(frag)
        return events

    def finish(self) -> list[Event]:
        """The held whitespace (no call followed it) and the last part's closing events."""
        return self.flush() + self.close()

    def flush(self) -> list[Event]:
        """The held whitespace: no call followed it."""
        events = self.text(self._ws) if self._ws else []
        self._ws = ""
        return events

    def thought(self, text: str) -> list[Event]:
        raise NotImplementedError

    def text(self, body: str) -> list[Event]:
        raise NotImplementedError

    def call_start(self, call_id: str, name: str) -> list[Event]:
        raise NotImplementedError

    def call_args(self, frag: str) -> list[Event]:
        raise NotImplementedError

    def close(self) -> list[Event]:
        raise NotImplementedError
