"""Chat templates from tokenizer_config.json, rendered with HF semantics.

Same environment HF `apply_chat_template` uses: an immutable sandbox, trim_blocks,
lstrip_blocks, the loop-controls extension, `raise_exception(msg)`, a `tojson` filter
that keeps non-ASCII text, `strftime_now(fmt)`, and the variables messages, tools,
add_generation_prompt, bos_token, eos_token (plus any extra keyword).

The rendered text already holds the special tokens the template wants (e.g. "<s>"), so
encode it with add_special_tokens=False, as HF does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template failed for these messages (the server answers 400 with this text)."""


class NoChatTemplateError(ChatTemplateError):
    """The model ships no chat template, so /v1/chat/completions cannot be served."""


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def flatten_content(content: Any) -> Any:
    """A list of {"type": "text", "text": ...} parts becomes one string (parts joined by
    newlines, as vLLM's "string" content format does); anything else is left as is.
    A non-text part raises ChatTemplateError: this engine serves text models."""
    if not isinstance(content, list):
        return content
    texts: list[str] = []
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(
            part.get("text"), str
        ):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ChatTemplateError(f"unsupported message content part {kind!r}; only text parts are supported")
        texts.append(part["text"])
    return "\n".join(texts)


def select_template(
    template: str | Sequence[Mapping[str, str]] | None, tools: object = None
) -> str:
    """tokenizer_config may hold a list of named templates: "tool_use" when tools are
    given and it exists, else "default"."""
    if template is None or (isinstance(template, str) and not template.strip()):
        raise NoChatTemplateError(
            "this model has no chat template (tokenizer_config.json 'chat_template'); "
            "use /v1/completions with a raw prompt instead"
        )
    if isinstance(template, str):
        return template
    named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
    choice = named.get("tool_use") if tools else None
    choice = choice or named.get("default")
    if not isinstance(choice, str):
        raise NoChatTemplateError(f"no default chat template among {sorted(map(str, named))}")
    return choice


class ChatTemplate:
    """A compiled chat template bound to one tokenizer's bos/eos token texts."""

    def __init__(
        self,
        template: str | Sequence[Mapping[str, str]] | None,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        self._sources = template
        self._compiled: dict[str, jinja2.Template] = {}
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        select_template(template)  # fail at load time when there is none

    def source(self, tools: object = None) -> str:
        """The template text used with (truthy ``tools``) or without tools."""
        return select_template(self._sources, tools)

    def compile(self) -> None:
        """Compile every template now (ChatTemplateError on a syntax error)."""
        for tools in (None, True):
            self._template(tools)

    def _template(self, tools: object) -> jinja2.Template:
        source = select_template(self._sources, tools)
        t = self._compiled.get(source)
        if t is None:
            try:
                t = _environment().from_string(source)
            except jinja2.TemplateSyntaxError as e:
                raise ChatTemplateError(f"chat template does not compile: {e}") from e
            self._compiled[source] = t
        return t

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        flatten: bool = True,
        **extra: Any,
    ) -> str:
        msgs = [
            {**m, "content": flatten_content(m.get("content"))} if flatten else dict(m)
            for m in messages
        ]
        try:
            return self._template(tools).render(
                messages=msgs,
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            raise ChatTemplateError(f"chat template failed for these messages: {e}") from e
