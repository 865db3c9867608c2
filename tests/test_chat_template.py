"""Chat templates: HF rendering semantics, errors, content parts, tokenization of the result."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftserve.tokenizer import (
    ChatTemplate,
    ChatTemplateError,
    NoChatTemplateError,
    chat_template_for,
    flatten_content,
)
from tests.test_tokenizer import (
    CHATML_TEMPLATE,
    MISTRAL_TEMPLATE,
    hf_tokenizer,
    sp_tokenizer,
    trained_dir,
)

CONVO = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": [{"type": "text", "text": "Part one"}, {"type": "text", "text": "part two"}]},
]


def test_mistral_template_renders_and_tokenizes() -> None:
    tok = sp_tokenizer("v3")
    tpl = chat_template_for(tok)
    text = tpl.render(CONVO)
    assert text == "<s>[INST] Hi there[/INST] Hello! How can I help?</s>[INST] Part one\npart two[/INST]"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.id_to_piece(i) for i in ids]
    assert pieces[:3] == ["<s>", "[INST]", "▁Hi"] and pieces[-1] == "[/INST]"
    assert pieces.count("<s>") == 1 and pieces.count("</s>") == 1


def test_raise_exception_becomes_chat_template_error() -> None:
    tpl = ChatTemplate(MISTRAL_TEMPLATE, "<s>", "</s>")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        tpl.render([{"role": "assistant", "content": "first"}])
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        tpl.render([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}])


def test_no_template_is_a_clear_error() -> None:
    with pytest.raises(NoChatTemplateError, match="no chat template"):
        ChatTemplate(None)
    with pytest.raises(NoChatTemplateError):
        ChatTemplate("   ")
    with pytest.raises(NoChatTemplateError, match="no default chat template"):
        ChatTemplate([{"name": "rag", "template": "x"}])


def test_named_templates_and_tools() -> None:
    tpl = ChatTemplate(
        [{"name": "default", "template": "D{{ messages[0]['content'] }}"},
         {"name": "tool_use", "template": "T{{ tools | tojson }}"}]
    )
    assert tpl.render([{"role": "user", "content": "x"}]) == "Dx"
    tools = [{"type": "function", "function": {"name": "wetter", "description": "Grüße ☀"}}]
    assert tpl.render([{"role": "user", "content": "x"}], tools=tools) == "T" + json.dumps(tools, ensure_ascii=False)


def test_trim_and_lstrip_blocks_and_generation_prompt() -> None:
    tpl = ChatTemplate(
        "{% for m in messages %}\n    {% if m['role'] == 'user' %}\nU:{{ m['content'] }}\n"
        "    {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}A:{% endif %}"
    )
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert tpl.render(msgs) == "U:a\nU:b\nA:"
    assert tpl.render(msgs, add_generation_prompt=False) == "U:a\nU:b\n"


def test_sandbox_blocks_attribute_escape_and_bad_templates() -> None:
    evil = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        evil.render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}").render([])
    with pytest.raises(ChatTemplateError, match="only text parts"):
        ChatTemplate(CHATML_TEMPLATE).render([{"role": "user", "content": [{"type": "image_url"}]}])


def test_flatten_content() -> None:
    assert flatten_content("s") == "s"
    assert flatten_content([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]) == "a\nb"
    assert flatten_content(None) is None


def test_matches_transformers_apply_chat_template() -> None:
    """HF's own apply_chat_template over the same tokenizer.json/template gives the same text and ids."""
    transformers = pytest.importorskip("transformers")
    d = trained_dir("bytelevel")
    ours = hf_tokenizer("bytelevel")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), bos_token="<s>", eos_token="</s>")
    hf.chat_template = CHATML_TEMPLATE
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀  there"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "中文?"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for kwargs in ({}, {"tools": tools}):
        ref = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kwargs)
        text = chat_template_for(ours).render(msgs, add_generation_prompt=True, **kwargs)
        assert text == ref
        ref_ids = hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, **kwargs)
        if not isinstance(ref_ids, list):  # BatchEncoding in transformers 5
            ref_ids = ref_ids["input_ids"]
        assert ours.encode(text, add_special_tokens=False) == list(ref_ids)


# --- --chat-template ---------------------------------------------------------------

OVERRIDE = ("{% for m in messages %}<<{{ m.role }}>>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<<assistant>>{% endif %}")


def test_chat_template_flag_replaces_the_checkpoints(tmp_path: Path) -> None:
    """--chat-template FILE (or the template text itself) is what the chat endpoint and
    /tokenize render with; the demo checkpoint's own is Mistral-style."""
    import asyncio
    import dataclasses

    import aiohttp

    from tests.server_harness import TEST_SERVER, start_live, stop_live

    path = tmp_path / "template.jinja"
    path.write_text(OVERRIDE)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    for value in (str(path), OVERRIDE):
        live = start_live(server_cfg=dataclasses.replace(TEST_SERVER, chat_template=value))
        try:
            async def go(url: str) -> str:
                async with aiohttp.ClientSession() as s:
                    async with s.post(url + "/tokenize", json={"messages": msgs}) as r:
                        ids = (await r.json())["tokens"]
                    async with s.post(url + "/detokenize", json={"tokens": ids}) as r:
                        return (await r.json())["prompt"]

            assert asyncio.run(go(live.url)) == "<<system>>Be brief.\n<<user>>hi\n<<assistant>>"
            live.wait_idle()
        finally:
            stop_live(live)


@pytest.mark.parametrize("value, says", [
    ("/no/such/template.jinja", "No such file"),
    ("{% for m in messages %}{{ m.content }", "does not compile"),
])
def test_chat_template_flag_fails_at_start_up(value: str, says: str) -> None:
    from ftserve.cli import build_parser, configs_from_args
    from ftserve.config import ConfigError

    with pytest.raises(ConfigError, match="--chat-template") as err:
        configs_from_args(build_parser().parse_args(["serve", "--chat-template", value]))
    assert says in str(err.value)
