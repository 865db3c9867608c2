"""The codec's compiled-grammar cache (chat/text.py): one compile per grammar,
fresh independent matchers per request, a bounded LRU, rejected grammars not kept."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import llguidance
import numpy as np
import pytest

from ftserve.chat import text as text_mod
from ftserve.engine.grammar import GrammarMatcher, MaskFiller, mask_words
from ftserve.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def codec(tmp_path_factory: pytest.TempPathFactory) -> text_mod.TokenizerCodec:
    from ftserve.models.checkpoint import write_checkpoint

    out = tmp_path_factory.mktemp("tiny-moe")
    write_checkpoint("tiny-moe", out, config_only=True)
    return text_mod.TokenizerCodec(load_tokenizer(Path(out)))


def _grammar(n: int) -> str:
    schema = {"type": "object", "properties": {f"k{n}": {"type": "integer"}}, "required": [f"k{n}"]}
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})


def test_one_compile_per_grammar_and_fresh_matchers(codec: text_mod.TokenizerCodec,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    compiles: list[str] = []
    real = GrammarMatcher.compile.__func__  # type: ignore[attr-defined]

    def counted(cls: type[GrammarMatcher], tok: llguidance.LLTokenizer, grammar: str,
                *rest: Any) -> GrammarMatcher:
        compiles.append(grammar)
        return real(cls, tok, grammar, *rest)

    monkeypatch.setattr(GrammarMatcher, "compile", classmethod(counted))
    vocab = codec.tokenizer.vocab_size
    g = _grammar(0)
    a, b = codec.grammar_matchers(g, vocab, 2)
    (c,) = codec.grammar_matchers(g, vocab, 1)
    assert compiles == [g], "the second request reused the compiled grammar"
    start = _mask(a, vocab)
    for _ in range(3):  # advance a by whatever the grammar allows first
        assert a.accept(int(np.flatnonzero(_allowed(_mask(a, vocab), vocab))[0]))
    assert not np.array_equal(_mask(a, vocab), start)
    # b and c start where a started: advancing a moved neither (nor the cached start).
    (d,) = codec.grammar_matchers(g, vocab, 1)
    for m in (b, c, d):
        assert np.array_equal(_mask(m, vocab), start)
    assert len(compiles) == 1


def _mask(m: GrammarMatcher, vocab: int) -> np.ndarray:
    out = np.zeros((1, mask_words(vocab)), dtype=np.int32)
    MaskFiller().fill([m], out)
    return out[0]


def _allowed(words: np.ndarray, vocab: int) -> np.ndarray:
    bits = (words[np.arange(vocab) // 32] >> (np.arange(vocab) % 32)) & 1
    return bits.astype(bool)


def test_the_cache_is_bounded_and_keeps_rejected_grammars_out(codec: text_mod.TokenizerCodec,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(text_mod, "GRAMMAR_CACHE_SIZE", 3)
    vocab = codec.tokenizer.vocab_size
    for i in range(1, 6):
        codec.grammar_matchers(_grammar(i), vocab, 1)
    assert list(codec._grammars) == [_grammar(3), _grammar(4), _grammar(5)]
    codec.grammar_matchers(_grammar(3), vocab, 1)  # a hit moves to the young end
    codec.grammar_matchers(_grammar(6), vocab, 1)
    assert list(codec._grammars) == [_grammar(5), _grammar(3), _grammar(6)]
    with pytest.raises(ValueError):
        codec.grammar_matchers("%llguidance {}\nstart: ???", vocab, 1)
    assert len(codec._grammars) == 3
