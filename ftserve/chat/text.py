"""What the server needs from the tokenizer package, as one small interface.

The server never touches a tokenizer backend directly: chat rendering, incremental
encoding (off the event loop), decoding and streaming detokenization with stop
strings all go through ``TextCodec``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import llguidance

from ftserve.chat import reasoning
from ftserve.chat.grammar_sandbox import parser_limits
from ftserve.chat.tool_calls import Format, format_of
from ftserve.engine.grammar import GrammarMatcher
from ftserve.tokenizer import (
    ChatTemplate,
    ChatTemplateError,
    IncrementalTokenizer,
    NoChatTemplateError,
    StreamingDetokenizer,
    Tokenizer,
    chat_template_for,
    load_tokenizer,
)
from ftserve.tokenizer.grammar_view import grammar_tokenizer

# Compiled grammars kept per codec (a JSON schema's compiled matcher is a few
# hundred KB at most; compiling one takes ~1 ms for a small schema at a 32k
# vocabulary, more for large schemas and vocabularies).
GRAMMAR_CACHE_SIZE = 64


class TemplateError(ValueError):
    """The chat template rejected the conversation (raise_exception, missing template)."""


class StreamDetokenizer(Protocol):
    stopped: bool  # a stop string matched; the text returned so far is trimmed before it
    matched: str | None  # which stop string matched (None: none did)

    def push(self, token_ids: list[int]) -> str:
        """Feed new ids; return the text that is now safe to emit."""
        ...

    def finish(self) -> str:
        """The sequence ended: return any held-back text."""
        ...


class TextCodec(Protocol):
    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                    tools: list[dict[str, Any]] | None = None,
                    extra: dict[str, Any] | None = None, continue_final: bool = False) -> str:
        """The prompt text; ``continue_final``: it ends right after the last message's
        content (an assistant's start for the model to continue), not its end-of-turn. Special-token text the client wrote (in messages, tools,
        template kwargs) is escaped so that it encodes as text, never as the token
        (Tokenizer.escape_special); only the template's own markup makes specials."""
        ...

    def escape_special(self, text: str) -> str:
        """Client text spliced into a prompt outside the template: control-token text
        in it encodes as text (Tokenizer.escape_special)."""
        ...

    def tool_format(self) -> Format | None:
        """The tool-call syntax of the chat template (tool_calls.format_of), or None."""
        ...

    def marks_reasoning(self) -> bool:
        """Whether the chat template marks reasoning with think tags (reasoning.supported)."""
        ...

    def template_reads(self, name: str) -> bool:
        """Whether the chat template's source names the variable ``name`` (e.g. Qwen3's
        enable_thinking), with or without tools."""
        ...

    async def encode_async(self, text: str, add_special_tokens: bool) -> list[int]:
        """Prompt text -> ids, through the incremental cache, off the event loop."""
        ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def token_text(self, token_id: int) -> str:
        """One token as text, for logprobs."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes, for logprobs (part of a character, for a byte token)."""
        ...

    def detokenizer(
        self, prompt_ids: list[int], stop: tuple[str, ...], skip_special_tokens: bool,
        include_stop: bool = False,
    ) -> StreamDetokenizer:
        """The output's text as it continues ``prompt_ids``: after text, its first token
        keeps a word-start space ("is" + " Paris"); after a control token ("[/INST]",
        BOS) it starts a text and loses it. ``include_stop``: the text ends with the
        stop string rather than before it."""
        ...

    def grammar_tokenizer(self, vocab_size: int) -> llguidance.LLTokenizer:
        """The grammar library's view of the tokenizer, ``vocab_size`` ids wide (built
        once; blocking: call it off the event loop)."""
        ...

    def grammar_matchers(self, grammar: str, vocab_size: int, n: int) -> list[GrammarMatcher]:
        """``n`` fresh matchers of ``grammar``, copies of one compiled per grammar (a
        bounded cache: agents send the same schema every turn). ValueError when
        the library rejects the grammar. Blocking, and deep in native code: call it
        on a grammar worker (grammar_service.py)."""
        ...


class _Detok:
    """StreamDetokenizer over the tokenizer package's StreamingDetokenizer."""

    def __init__(self, inner: StreamingDetokenizer) -> None:
        self._inner = inner

    @property
    def stopped(self) -> bool:
        return self._inner.stopped

    @property
    def matched(self) -> str | None:
        return self._inner.stop

    def push(self, token_ids: list[int]) -> str:
        return self._inner.feed(token_ids).text

    def finish(self) -> str:
        return self._inner.finish()


class TokenizerCodec:
    """TextCodec for a model directory: its tokenizer, chat template and a shared
    incremental cache (agentic clients resend the whole conversation every turn)."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None = None) -> None:
        """``chat_template`` (--chat-template: a file or the text) replaces the checkpoint's."""
        self.tokenizer = tokenizer
        self.cache = IncrementalTokenizer(tokenizer)
        self._template: ChatTemplate | None = None
        self._template_error: str | None = None
        try:
            self._template = (chat_template_for(tokenizer) if chat_template is None else
                              ChatTemplate(chat_template_text(chat_template), tokenizer.bos_token,
                                           tokenizer.eos_token))
        except NoChatTemplateError as err:
            # Completions still work; chat requests get a 400 that says why.
            self._template_error = f"this model has no chat template ({err}); use /v1/completions"
        self._grammar_tok: llguidance.LLTokenizer | None = None
        self._grammar_lock = threading.Lock()
        self._grammars: OrderedDict[str, GrammarMatcher] = OrderedDict()  # grammar -> its start
        self._tool_format: Format | None = None  # read off the template once
        self._reasoning = False
        self._sources: list[str] = []
        if self._template is not None:
            try:
                self._tool_format = format_of(self._template.source(tools=True))
                sources = self._sources = [self._template.source(tools=t) for t in (False, True)]
                self._reasoning = any(reasoning.supported(src) for src in sources)
            except ChatTemplateError:
                pass

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                    tools: list[dict[str, Any]] | None = None,
                    extra: dict[str, Any] | None = None, continue_final: bool = False) -> str:
        if self._template is None:
            raise TemplateError(self._template_error or "no chat template")
        esc = self.tokenizer.escape_special
        if not self.template_reads("developer"):
            # OpenAI's "developer" role is the system role of newer models; a template
            # that never names it would raise on it or, like Qwen's, drop it silently.
            messages = [{**m, "role": "system"} if m.get("role") == "developer" else m
                        for m in messages]
        try:
            prompt = self._template.render(_escaped(messages, esc), add_generation_prompt=add_generation_prompt,
                                           tools=_escaped(tools, esc), **_escaped(extra or {}, esc))
        except ChatTemplateError as err:
            raise TemplateError(str(err)) from None
        if not continue_final:
            return prompt
        # Cut after the final message's own text: what follows it is the template's
        # end-of-turn markup. A template that rewrites that text cannot be continued.
        start = esc(messages[-1]["content"])
        cut = prompt.rfind(start)
        if not start or cut < 0:
            raise TemplateError("the chat template does not render the final assistant message's "
                                "content as written, so it cannot be continued")
        return prompt[:cut + len(start)]

    def escape_special(self, text: str) -> str:
        return self.tokenizer.escape_special(text)

    def tool_format(self) -> Format | None:
        return self._tool_format

    def marks_reasoning(self) -> bool:
        return self._reasoning

    def template_reads(self, name: str) -> bool:
        return any(name in src for src in self._sources)

    async def encode_async(self, text: str, add_special_tokens: bool) -> list[int]:
        return await self.cache.encode_async(text, add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        # A model's padded embedding rows past the tokenizer's vocabulary have no text,
        # and one can still be sampled or be among the top logprobs.
        if not 0 <= token_id < self.tokenizer.vocab_size:
            return b""
        return self.tokenizer.token_bytes(token_id)

    def detokenizer(
        self, prompt_ids: list[int], stop: tuple[str, ...], skip_special_tokens: bool,
        include_stop: bool = False,
    ) -> StreamDetokenizer:
        # As vLLM's prompt-primed detokenizer has it; one rule for both endpoints, so a
        # chat reply is the raw completion of its rendered prompt.
        last = prompt_ids[-1] if prompt_ids else None
        after_text = (last is not None and last not in self.tokenizer.special_ids
                      and bool(self.token_bytes(last)))
        return _Detok(StreamingDetokenizer(self.tokenizer, stop,
                                           skip_special_tokens=skip_special_tokens,
                                           include_stop_str_in_output=include_stop,
                                           continues_text=after_text))

    def grammar_tokenizer(self, vocab_size: int) -> llguidance.LLTokenizer:
        with self._grammar_lock:  # worker threads: the first structured requests race
            if self._grammar_tok is None or self._grammar_tok.vocab_size != vocab_size:
                self._grammar_tok = grammar_tokenizer(self.tokenizer, vocab_size)
                self._grammars.clear()  # compiled against the old view
            return self._grammar_tok

    def grammar_matchers(self, grammar: str, vocab_size: int, n: int) -> list[GrammarMatcher]:
        vocab = self.grammar_tokenizer(vocab_size)
        with self._grammar_lock:
            start = self._grammars.get(grammar)
            if start is not None:
                self._grammars.move_to_end(grammar)
        if start is None:
            start = GrammarMatcher.compile(vocab, grammar, parser_limits())  # outside the lock: it may take a while
        with self._grammar_lock:  # the cached start is only ever copied, one thread at a time
            self._grammars[grammar] = start
            while len(self._grammars) > GRAMMAR_CACHE_SIZE:
                self._grammars.popitem(last=False)  # least recently used
            return [start.copy() for _ in range(n)]


def _escaped(value: Any, escape: Callable[[str], str]) -> Any:
    """Every string inside ``value`` (dicts, lists) escaped, but not dict keys or roles."""
    if isinstance(value, str):
        return escape(value)
    if isinstance(value, dict):
        return {k: v if k == "role" else _escaped(v, escape) for k, v in value.items()}
    if isinstance(value, list):
        return [_escaped(v, escape) for v in value]
    return value


def chat_template_text(value: str) -> str:
    """--chat-template's value: the text of the file it names, or itself when it is
    template text (holds "{{" or "{%"); OSError for a missing file."""
    if "{{" in value or "{%" in value:
        return value
    with open(value, encoding="utf-8") as f:
        return f.read()


def make_text_codec(model_dir: str, chat_template: str | None = None) -> TextCodec:
    return TokenizerCodec(load_tokenizer(model_dir), chat_template)
