"""What the server needs from the tokenizer package, as one small interface.

The server never touches a tokenizer backend directly: chat rendering, incremental
encoding (off the event loop), decoding and streaming detokenization with stop
strings all go through ``TextCodec``.
"""

from __future__ import annotations

from typing import Protocol


class TemplateError(ValueError):
    """The chat template rejected the conversation (raise_exception, missing template)."""


class StreamDetokenizer(Protocol):
    stopped: bool  # a stop string matched; the text returned so far is trimmed before it

    def push(self, token_ids: list[int]) -> str:
        """Feed new ids; return the text that is now safe to emit."""
        ...

    def finish(self) -> str:
        """The sequence ended: return any held-back text."""
        ...


class TextCodec(Protocol):
    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str: ...

    async def encode_async(self, text: str) -> list[int]:
        """Prompt text -> ids, through the incremental cache, off the event loop."""
        ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def token_text(self, token_id: int) -> str:
        """One token as text, for logprobs."""
        ...

    def detokenizer(
        self, prompt_ids: list[int], stop: tuple[str, ...], skip_special_tokens: bool
    ) -> StreamDetokenizer: ...
