"""``ftserve chat``: a terminal client that streams replies and keeps the history.

Standard library only (urllib, and readline for line editing and history on a terminal),
so it runs wherever Python does. Lines that start with ``/`` are commands and never reach the
model (``//`` sends a line that starts with one ``/``): see ``COMMANDS``.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any, TextIO


class ChatError(RuntimeError):
    pass


class ChatClient:
    def __init__(self, url: str, model: str | None = None, api_key: str | None = None,
                 max_tokens: int | None = None, temperature: float | None = None,
                 timeout: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.timeout = timeout
        self._model = model

    def _request(self, path: str, body: dict[str, Any] | None = None) -> Any:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers=headers)
        try:
            return urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as err:
            try:
                message = json.loads(err.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = str(err)
            raise ChatError(f"HTTP {err.code}: {message}") from None
        except urllib.error.URLError as err:
            raise ChatError(f"cannot reach {self.url}: {err.reason}") from None

    @property
    def model(self) -> str:
        if self._model is None:
            with self._request("/v1/models") as resp:
                self._model = str(json.loads(resp.read())["data"][0]["id"])
        return self._model

    def stream(self, messages: list[dict[str, str]]) -> Iterator[str]:
        """Yield the reply's text deltas as the server sends them."""
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": True}
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        if self.temperature is not None:
            body["temperature"] = self.temperature
        with self._request("/v1/chat/completions", body) as resp:
            for raw in resp:
                line = raw.decode("utf-8").rstrip("\r\n")
                if not line.startswith("data: "):
                    continue  # blank separators and ": keep-alive" comments
                data = line[6:]
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise ChatError(event["error"].get("message", "server error"))
                for choice in event.get("choices", []):
                    text = choice.get("delta", {}).get("content")
                    if text:
                        yield text


COMMANDS = {
    "/help": "list these commands",
    "/reset": "clear the conversation (the system prompt stays)",
    "/exit": "quit (so does end of input, Ctrl-D)",
}


def _read_line(inp: TextIO, out: TextIO) -> str | None:
    """One line of user input without its newline; None at end of input. On a terminal the
    prompt goes through input(), which readline gives line editing and history."""
    if inp.isatty() and out.isatty():
        try:
            import readline  # noqa: F401  (importing it is what turns editing on for input())
        except ImportError:  # not on every platform (Windows): plain input still works
            pass
        try:
            return input("> ")
        except EOFError:
            return None
    out.write("> ")
    out.flush()
    line = inp.readline()
    return line.rstrip("\n") if line else None


def chat_loop(client: ChatClient, system: str | None, inp: TextIO, out: TextIO,
              history: list[dict[str, str]] | None = None) -> int:
    """Read user lines, stream replies; returns the exit status. ``history`` (if given)
    is filled in place with the conversation as sent to the server."""
    base: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    if history is None:
        history = []
    history[:] = base
    try:
        out.write(f"ftserve chat with '{client.model}' at {client.url} (/help lists commands, "
                  "/exit quits)\n")
    except ChatError as err:
        out.write(f"error: {err}\n")
        return 1
    while True:
        text = _read_line(inp, out)
        command = text.strip() if text is not None else "/exit"
        if command.startswith("/") and not command.startswith("//"):
            if command == "/exit":
                out.write("\n")
                return 0
            if command == "/reset":
                history[:] = base
                out.write("(history cleared)\n")
            elif command == "/help":
                out.writelines(f"  {name:<7} {what}\n" for name, what in COMMANDS.items())
                out.write("  //text   send a line that starts with '/'\n")
            else:
                out.write(f"unknown command {command.split()[0]!r}: /help lists the commands "
                          "(nothing was sent)\n")
            continue
        assert text is not None
        if command.startswith("//"):
            text = text.replace("//", "/", 1)
        if not text.strip():
            continue
        history.append({"role": "user", "content": text})
        reply: list[str] = []
        try:
            for piece in client.stream(history):
                reply.append(piece)
                out.write(piece)
                out.flush()
        except ChatError as err:
            history.pop()  # the turn failed; do not resend it
            out.write(f"\nerror: {err}\n")
            continue
        except KeyboardInterrupt:
            out.write("\n(interrupted)\n")
        out.write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})
