"""A chat request's prompt: the chat template's text, a forced call's start after it,
and the token ids the engine gets; with it, how the output will be split.

    messages, tools, template kwargs --template (worker thread)--> text
    + the end of a reasoning block the prompt opened, if a call is forced (tool_choice.py)
    + the forced start of a call (its rest held to well-formed calls: tool_grammar.py)
    --encode (incremental tokenizer cache)--> ids
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ftserve.chat import reasoning, tool_calls, tool_choice, tool_grammar
from ftserve.chat.errors import bad_request
from ftserve.chat.output import OutputSpec
from ftserve.chat.request import ChatRequest
from ftserve.chat.response_format import ResponseFormat
from ftserve.chat.text import TemplateError, TextCodec


@dataclass(frozen=True)
class ChatPrompt:
    """A chat request's prompt as the engine gets it (what count_tokens counts)."""

    ids: list[int]  # the rendered conversation and the forced call's start, if any
    # The output constraint: the request's own, or a forced call's grammar (tool_grammar.py).
    constraint: ResponseFormat | None = None
    output: OutputSpec = field(default_factory=OutputSpec)  # how each choice's output is split

    @property
    def think(self) -> bool | None:
        """Reasoning split: None = off, else whether the prompt opened the reasoning."""
        return self.output.think


async def render(text: TextCodec, req: ChatRequest) -> tuple[str, str]:
    """(the rendered prompt, the forced start of a call that follows it: "" unless
    tool_choice forces one). A template error is a 400 naming the prompt's field."""
    assert req.messages is not None
    kwargs = req.template_kwargs
    if req.thinking is not None and text.template_reads("enable_thinking"):
        kwargs = {**kwargs, "enable_thinking": req.thinking}
    try:
        # Rendering a 170k-token conversation is real work: keep it off the loop too.
        prompt = await asyncio.to_thread(text.render_chat, req.messages, req.add_generation_prompt,
                                         req.tools, kwargs, req.continue_final)
    except TemplateError as err:
        raise bad_request(f"chat template error: {err}", param=req.prompt_field) from None
    # A forced tool_choice: the start of the call is prompt (after a reasoning block the
    # prompt opened is closed); the parser reads it first; a grammar holds the rest.
    fmt = text.tool_format()
    if req.forced is None or fmt is None:
        return prompt, ""
    prompt += tool_choice.before_call(prompt, text.marks_reasoning())
    return prompt, tool_choice.forced_text(fmt, req.forced, text.escape_special)


async def chat_prompt(text: TextCodec, req: ChatRequest, reasoning_parser: bool) -> ChatPrompt:
    """Render and encode a chat request (every chat route shares it);
    ``reasoning_parser``: split the reasoning off where the template marks it."""
    if req.tools and text.tool_format() is None:
        raise bad_request("this model's chat template does not render tools, so it cannot "
                          "be given any", param="tools")
    prompt, forced = await render(text, req)
    constraint = req.response_format
    fmt = text.tool_format()
    if forced:
        assert req.forced is not None and req.tools is not None and fmt is not None
        constraint = tool_grammar.constraint(fmt, req.forced, req.tools, req.parallel_tool_calls)
    ids = await text.encode_async(prompt + forced, add_special_tokens=False)  # template adds them
    # Reasoning split (reasoning.py): None = off, else whether the prompt opened it.
    # Off under a forced call: the output continues the call, not a reasoning block;
    # off under a JSON response_format: the grammar makes all of the output the JSON.
    think = (reasoning.opens_in_prompt(prompt) if reasoning_parser and text.marks_reasoning()
             and not forced and req.response_format is None else None)
    output = OutputSpec(fmt if req.tools else None, req.parallel_tool_calls,
                        tool_calls.param_types(req.tools), think, forced)
    return ChatPrompt(ids, constraint, output)
