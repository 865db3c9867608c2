"""Streaming detokenizer: UTF-8 safety, leading spaces, stop strings, stream == full decode."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftserve.tokenizer import StreamingDetokenizer, Tokenizer
from tests.test_incremental_tokenizer import KINDS, get_tok, text_st


def stream(tok: Tokenizer, ids: list[int], chunks: list[int], **kw: object) -> tuple[list[str], StreamingDetokenizer]:
    d = StreamingDetokenizer(tok, **kw)  # type: ignore[arg-type]
    deltas: list[str] = []
    pos, k = 0, 0
    while pos < len(ids):
        n = chunks[k % len(chunks)] if chunks else 1
        deltas.append(d.feed(ids[pos : pos + n]).text)
        pos, k = pos + n, k + 1
    deltas.append(d.finish())
    return deltas, d


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=40, deadline=None)
@given(data=st.data(), chunks=st.lists(st.integers(1, 4), max_size=5), skip=st.booleans())
def test_random_ids_stream_equals_full_decode(kind: str, data: st.DataObject, chunks: list[int], skip: bool) -> None:
    """Any ids at all (specials, lone byte tokens that form invalid UTF-8) stream to
    exactly what a one-shot decode gives."""
    tok = get_tok(kind)
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=40))
    deltas, _ = stream(tok, ids, chunks, skip_special_tokens=skip)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=40, deadline=None)
@given(text=text_st, chunks=st.lists(st.integers(1, 3), max_size=4))
def test_text_round_trip_never_emits_broken_characters(kind: str, text: str, chunks: list[int]) -> None:
    tok = get_tok(kind)
    text = text.replace("\ufffd", "")
    ids = tok.encode(text)
    deltas, _ = stream(tok, ids, chunks)
    assert "".join(deltas) == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)  # bytes of a character are held until complete


def test_rare_characters_split_into_byte_tokens_are_held() -> None:
    tok = get_tok("sp-v3")
    text = "𝔘𝔫𝔦 🦜 ok"
    ids = tok.encode_body(text)
    assert sum(tok.sp.is_byte(i) for i in ids) >= 8  # 4-byte characters through byte fallback
    d = StreamingDetokenizer(tok)
    out = [d.feed([i]).text for i in ids]
    assert [o for o in out if o] == ["𝔘", "𝔫", "𝔦", " ", "🦜", " ok"]


@pytest.mark.parametrize("kind", ["sp-v1", "sp-v3", "metaspace"])
def test_sentencepiece_leading_spaces(kind: str) -> None:
    tok = get_tok(kind)
    ids = tok.encode_continuation(" Hello world")  # as a model generates after "[/INST]"
    d = StreamingDetokenizer(tok)
    out = [d.feed([i]).text for i in ids] + [d.finish()]
    assert "".join(out) == "Hello world" == tok.decode(ids)
    assert any(o.startswith(" w") for o in out)  # later words keep their space
    two = tok.encode_continuation("  indented")
    d2 = StreamingDetokenizer(tok)
    assert "".join([d2.feed([i]).text for i in two]) == tok.decode(two) == " indented"
    if kind != "metaspace":  # the library itself agrees
        assert tok.decode(ids) == tok.sp.decode(ids)  # type: ignore[attr-defined]


def test_stop_string_held_trimmed_and_reported() -> None:
    tok = get_tok("sp-v3")
    ids = tok.encode_body("The answer is 42.\nUser: next question")
    d = StreamingDetokenizer(tok, stop=["\nUser:", "never"])
    out: list[str] = []
    for i in ids:
        delta = d.feed([i])
        out.append(delta.text)
        assert "\n" not in delta.text  # the newline could start "\nUser:", so it is held
        if delta.stopped:
            assert delta.stop == "\nUser:"
            break
    assert d.stopped and d.stop == "\nUser:"
    assert "".join(out) == "The answer is 42."
    assert d.feed(tok.encode_body(" more")).text == "" and d.finish() == ""


def test_stop_partial_match_released_when_it_diverges() -> None:
    tok = get_tok("bytelevel")
    d = StreamingDetokenizer(tok, stop=["</end>"])
    first = d.feed(tok.encode_body("value </e"))
    assert first.text == "value " and not first.stopped
    second = d.feed(tok.encode_body("x> done"))
    assert second.text == "</ex> done"
    third = d.feed(tok.encode_body(" </end> tail"))
    assert third.text == " " and third.stop == "</end>"


def test_earliest_stop_wins_and_include_option() -> None:
    tok = get_tok("bytelevel")
    ids = tok.encode_body("abc STOP2 xyz STOP1")
    d = StreamingDetokenizer(tok, stop=["STOP1", "STOP2"], include_stop_str_in_output=True)
    text = "".join(d.feed([i]).text for i in ids)
    assert text == "abc STOP2" and d.stop == "STOP2"


@pytest.mark.parametrize("kind", ["sp-v3", "bytelevel"])
@settings(max_examples=40, deadline=None)
@given(text=text_st, stops=st.lists(st.sampled_from(["a", "ab", " ", "\n\n", "中文", "😀", "[/INST]", "lo w"]), max_size=3),
       chunks=st.lists(st.integers(1, 3), max_size=4))
def test_stop_strings_property(kind: str, text: str, stops: list[str], chunks: list[int]) -> None:
    tok = get_tok(kind)
    ids = tok.encode_body(text)
    full = tok.decode(ids)
    d = StreamingDetokenizer(tok, stop=stops)
    longest = max((len(s) for s in stops), default=1)
    out: list[str] = []
    pos, k = 0, 0
    while pos < len(ids) and not d.stopped:
        n = chunks[k % len(chunks)] if chunks else 1
        out.append(d.feed(ids[pos : pos + n]).text)
        assert len(d._held) < longest  # per-step work is bounded: O(new tokens)
        pos, k = pos + n, k + 1
    out.append(d.finish())
    hits = [(full.find(s), s) for s in stops if full.find(s) >= 0]
    if hits:
        first = min(i for i, _ in hits)
        assert "".join(out) == full[:first] and d.stop is not None and full.find(d.stop) == first
    else:
        assert "".join(out) == full and d.stop is None


def test_ids_past_the_vocabulary_produce_no_text() -> None:
    tok = get_tok("sp-v1")  # 32000 pieces; Mistral checkpoints pad the embedding further
    d = StreamingDetokenizer(tok)
    ids = tok.encode_body("ok then")
    assert d.feed([ids[0], tok.vocab_size + 5, -1]).text + d.feed(ids[1:]).text + d.finish() == "ok then"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])  # /detokenize answers 400 on this
