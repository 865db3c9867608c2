"""What OpenAI's two streams (chat.py, completions.py) share: ``data: {chunk}``
frames, each choice's chunks indexed by the choice, ``: keep-alive`` comments,
an engine failure as an error object, then (with ``stream_options.include_usage``)
a usage chunk and ``data: [DONE]``; vLLM's ``continuous_usage_stats`` puts the
usage so far on every chunk."""

from __future__ import annotations

from typing import Any

from ftserve.api import sse
from ftserve.api.driver import Choice, Frame, Shaper
from ftserve.api.errors import APIError
from ftserve.api.openai import objects as R
from ftserve.chat.request import ChatRequest
from ftserve.chat.text import TextCodec


class OpenAIStream(Shaper):
    object_name = ""  # the chunks' "object": chat.completion.chunk or text_completion

    def __init__(self, req: ChatRequest, rid: str, created: int, model: str,
                 choices: list[Choice], text: TextCodec) -> None:
        self.req, self.rid, self.created, self.model = req, rid, created, model
        self.choices, self.text = choices, text

    def error(self, err: APIError) -> list[Frame]:
        return [sse.frame(err.to_dict())]

    def close(self, failed: bool) -> list[Frame]:
        frames: list[Frame] = []
        if self.req.include_usage and not failed:
            frames.append(sse.frame(R.usage_chunk(self.rid, self.created, self.model,
                                                  self.object_name, self.usage())))
        return [*frames, sse.DONE]

    def encode(self, event: dict[str, Any]) -> bytes:
        if self.req.continuous_usage:  # the counts when the chunk goes out
            event["usage"] = self.usage()
        return sse.frame(event)

    def usage(self) -> dict[str, Any]:
        return R.usage_of(self.choices, self.req.n)

    @staticmethod
    def indexed(chunk: dict[str, Any], choice: Choice) -> dict[str, Any]:
        chunk["choices"][0]["index"] = choice.index
        return chunk
