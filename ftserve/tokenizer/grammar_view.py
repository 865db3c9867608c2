"""The grammar library's view of a tokenizer: an ``llguidance.LLTokenizer`` built from
one of our own ``Tokenizer`` objects (either backend), offline.

llguidance needs every token's bytes (to know which tokens can continue a grammar),
which of them are special (never text), the ids that end generation, and an encode
function for the text it forces. All four come from ``Tokenizer``:

    tokens[i]          = token_bytes(i)       (b"" past the tokenizer's vocabulary)
    special_token_ids  = special_ids          (their bytes are their text: never matched)
    eos                = eos_ids              (tokenizer + generation_config)
    encode(text)       = encode_continuation  (no dummy prefix, no added specials)

The model's vocabulary (its lm_head rows) can be larger than the tokenizer's; the view
is as wide as the model's, so a token mask has one bit per logit column, and the
columns no token owns are empty tokens, never allowed.
"""

from __future__ import annotations

from typing import Any

import llguidance

from ftserve.tokenizer.base import Tokenizer


class _Vocab:
    """What ``llguidance.TokenizerWrapper`` reads off a tokenizer (the attributes it
    names, and ``__call__`` to encode text)."""

    def __init__(self, tok: Tokenizer, vocab_size: int) -> None:
        self.eos_token_id = tok.eos_id
        self.bos_token_id = tok.bos_id
        n = min(tok.vocab_size, vocab_size)
        self.tokens = [tok.token_bytes(i) for i in range(n)] + [b""] * (vocab_size - n)
        self.special_token_ids = sorted(t for t in tok.special_ids if t < vocab_size)
        self._tok = tok

    def __call__(self, text: Any) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode_continuation(text)


def grammar_tokenizer(tok: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """An LLTokenizer over ``tok`` with ``vocab_size`` token ids (the model's lm_head
    width). Takes ~0.1 s per 32k tokens: build it once per tokenizer."""
    if tok.eos_id is None:
        raise ValueError("structured output needs a tokenizer with an end-of-sequence token")
    vocab = _Vocab(tok, vocab_size)
    eos = [e for e in tok.eos_ids if e < vocab_size]
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocab), n_vocab=vocab_size,
                                  eos_token=eos)
