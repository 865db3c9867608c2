"""Incremental tokenizer cache: incremental == full, always; bounded memory; off-loop encodes."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftserve.tokenizer import IncrementalTokenizer, Tokenizer, chat_template_for, load_tokenizer
from ftserve.tokenizer.incremental import common_prefix_len
from tests.test_tokenizer import hf_tokenizer, sp_tokenizer, trained_dir

KINDS = ["sp-v1", "sp-v3", "bytelevel", "metaspace"]


def get_tok(kind: str) -> Tokenizer:
    return sp_tokenizer(kind[3:]) if kind.startswith("sp-") else hf_tokenizer(kind)


def small_cache(tok: Tokenizer, **kw: Any) -> IncrementalTokenizer:
    """Thresholds scaled down so that short test texts exercise the splice path."""
    opts: dict[str, Any] = {"min_reuse_chars": 4, "window_chars": 4, "inline_chars": 64}
    opts.update(kw)
    return IncrementalTokenizer(tok, **opts)


# Fragments chosen to stress boundaries: multi-codepoint graphemes (ZWJ emoji, combining
# accents), CJK, whitespace runs, byte-fallback characters and special-token texts.
FRAGMENTS = [
    "hello", "world", " ", "  ", "   ", "\n", "\n\n", "\t", "é", "e\u0301", "中文", "日本語", "😀",
    "👩\u200d💻", "🎉🎉", ",", ".", "!", "?", "'s", "123", "4567", "[INST]", "[/INST]", "</s>", "<s>",
    "[IN", "ST]", "</", "s>", "<|im_start|>", "<|im_end|>", "def f(x):", "    return x", "café",
    "\u00a0", "ü", "ß", "—", "\r\n", "<0x0A>", "▁", "Ġ",
    # special-token texts as the server escapes them in messages (base.LITERAL_MARK), a bare mark
    "<\ue000|im_end|>", "[\ue000INST]", "<\ue000/s>", "\ue000",
]
text_st = st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=6), max_size=14).map("".join)
message_st = st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=10).map(" ".join) | text_st


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=st.lists(st.tuples(message_st, message_st), min_size=1, max_size=5))
def test_multi_turn_conversation_equals_full(kind: str, turns: list[tuple[str, str]]) -> None:
    tok = get_tok(kind)
    tpl = chat_template_for(tok)
    cache = small_cache(tok)
    messages: list[dict[str, str]] = []
    for user, assistant in turns:
        messages.append({"role": "user", "content": user})
        prompt = tpl.render(messages, add_generation_prompt=True)
        assert cache.encode(prompt) == tok.encode(prompt, add_special_tokens=False)
        messages.append({"role": "assistant", "content": assistant})
    s = cache.stats
    assert s.requests == len(turns) and s.exact_hits + s.prefix_hits + s.misses + s.fallbacks == s.requests


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=40, deadline=None)
@given(texts=st.lists(text_st, min_size=2, max_size=4), cuts=st.lists(st.integers(0, 10_000), min_size=3, max_size=3))
def test_growing_text_split_anywhere_equals_full(kind: str, texts: list[str], cuts: list[int]) -> None:
    """Old prompts are prefixes of the new one cut at arbitrary characters (inside special
    token texts, between a base letter and its accent, inside emoji ZWJ sequences), or
    share only part of it (an edited last message)."""
    tok = get_tok(kind)
    cache = small_cache(tok)
    full = "".join(texts) * 2
    for c in sorted(cuts):
        prefix = full[: c % (len(full) + 1)]
        for add in (True, False):
            assert cache.encode(prefix, add_special_tokens=add) == tok.encode(prefix, add_special_tokens=add)
    edited = full[: len(full) // 2] + texts[0][::-1]
    assert cache.encode(edited) == tok.encode(edited, add_special_tokens=False)
    assert cache.encode(full) == tok.encode(full, add_special_tokens=False)


@pytest.mark.parametrize("kind", KINDS)
def test_agentic_turns_reuse_almost_everything(kind: str) -> None:
    """A realistic growing conversation must actually take the splice path (no silent
    fallback) and reuse most tokens."""
    tok = get_tok(kind)
    tpl = chat_template_for(tok)
    cache = IncrementalTokenizer(tok, min_reuse_chars=64, inline_chars=1024)
    messages: list[dict[str, str]] = []
    for turn in range(8):
        body = f"Turn {turn}: please read file_{turn}.py and fix the bug. 中文 😀 " * 20
        messages.append({"role": "user", "content": body})
        prompt = tpl.render(messages)
        assert cache.encode(prompt) == tok.encode(prompt, add_special_tokens=False)
        messages.append({"role": "assistant", "content": f"Done with step {turn}; the tests pass. " * 10})
    assert cache.stats.prefix_hits == 7 and cache.stats.fallbacks == 0
    assert cache.stats.verify_failures == 0
    total = sum(len(tok.encode(tpl.render(messages[: 2 * t + 1]), False)) for t in range(1, 8))
    assert cache.stats.tokens_reused > 0.6 * total


def test_text_without_spaces_splices_at_newlines() -> None:
    """A CJK conversation in ChatML has no spaces at all; newlines are the cut points."""
    tok = get_tok("bytelevel")
    tpl = chat_template_for(tok)
    cache = IncrementalTokenizer(tok, min_reuse_chars=64, inline_chars=256)
    messages: list[dict[str, str]] = []
    for turn in range(6):
        messages.append({"role": "user", "content": f"第{turn}轮：读取文件并修复错误。\n" * 30})
        prompt = tpl.render(messages)
        assert " " not in prompt
        assert cache.encode(prompt) == tok.encode(prompt, add_special_tokens=False)
        messages.append({"role": "assistant", "content": "好的，已经完成。\n" * 10})
    assert cache.stats.prefix_hits == 5 and cache.stats.fallbacks == 0


def test_exact_hit_and_lru_by_bytes() -> None:
    tok = get_tok("sp-v3")
    texts = [f"conversation {i} " + "lorem ipsum dolor " * 200 for i in range(6)]
    one = IncrementalTokenizer(tok)
    one.encode(texts[0])
    budget = one.nbytes * 3 + 10  # room for three entries
    cache = IncrementalTokenizer(tok, max_bytes=budget)
    for t in texts:
        cache.encode(t)
        assert cache.nbytes <= budget
    assert len(cache) == 3 and cache.stats.evictions == 3
    before = cache.stats.exact_hits
    assert cache.encode(texts[-1]) == tok.encode(texts[-1], False)
    assert cache.stats.exact_hits == before + 1
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0


def test_common_prefix_len() -> None:
    a = "x" * 10_000 + "abc" + "y" * 50
    for b, want in [(a, len(a)), (a[:5000], 5000), ("x" * 10_000 + "abd", 10_002), ("", 0), ("q", 0),
                    (a + "tail", len(a)), ("x" * 300 + "z", 300)]:
        assert common_prefix_len(a, b) == want
        assert common_prefix_len(b, a) == want


def test_long_encode_runs_off_the_event_loop() -> None:
    """A 170k-token first turn arrives while a stream is running: the stream keeps its pace."""
    tok = get_tok("sp-v3")
    cache = IncrementalTokenizer(tok)
    big = "The agent reads the repository and writes a patch for the failing test. " * 12_000

    async def main() -> tuple[float, float, list[int]]:
        gaps: list[float] = []
        done = asyncio.Event()

        async def stream() -> None:  # stands in for an SSE stream emitting a token every 2 ms
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.002)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        streamer = asyncio.create_task(stream())
        await asyncio.sleep(0.01)
        t0 = time.perf_counter()
        ids = await cache.encode_async(big)
        elapsed = time.perf_counter() - t0
        done.set()
        await streamer
        return elapsed, max(gaps), ids

    elapsed, worst_gap, ids = asyncio.run(main())
    assert len(ids) > 150_000
    assert elapsed > 0.15  # the encode really is long ...
    assert worst_gap < elapsed / 3  # ... yet the stream never stalled for it


def test_space_eating_special_tokens_are_caught_by_verification(tmp_path: Path) -> None:
    """Added tokens with lstrip/rstrip swallow the spaces around them, so a space right
    after one is no token boundary. The checks must reject that cut and splice earlier."""
    src = trained_dir("bytelevel")
    spec = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    for added in spec["added_tokens"]:
        if added["content"] == "[/INST]":
            added["lstrip"] = added["rstrip"] = True
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    shutil.copy(src / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    tok = load_tokenizer(tmp_path)
    cache = small_cache(tok, window_chars=1)
    old = "alpha beta [/INST] gamma delta"
    new = old + " and more words"
    assert cache.encode(old) == tok.encode(old, False)
    assert cache.encode(new) == tok.encode(new, False)
    assert cache.stats.verify_failures >= 1 and cache.stats.prefix_hits == 1


@cache
def space_eating_tokenizer() -> Tokenizer:
    """The byte-level test tokenizer with every special token stripping spaces on both sides."""
    d = Path(tempfile.mkdtemp(prefix="ftserve-tok-eating-"))
    spec = json.loads((trained_dir("bytelevel") / "tokenizer.json").read_text(encoding="utf-8"))
    for added in spec["added_tokens"]:
        added["lstrip"] = added["rstrip"] = True
    (d / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    return load_tokenizer(d)


@settings(max_examples=30, deadline=None)
@given(texts=st.lists(text_st, min_size=2, max_size=4), cut=st.integers(0, 10_000))
def test_space_eating_tokens_property(texts: list[str], cut: int) -> None:
    tok = space_eating_tokenizer()
    cache = small_cache(tok)
    full = " ".join(texts) * 2
    prefix = full[: cut % (len(full) + 1)]
    assert cache.encode(prefix) == tok.encode(prefix, False)
    assert cache.encode(full) == tok.encode(full, False)
