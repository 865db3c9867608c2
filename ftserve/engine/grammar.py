"""Constrained decoding on the host: one grammar matcher per request, token masks.

A request with ``response_format`` json_object / json_schema carries a
``GrammarMatcher`` (built by the server, owned by the engine thread once submitted).
Per step that samples it:

    runner.launch:   masks = fill_masks(constrained rows)   host, llguidance
                     one non-blocking copy -> sampler.grammar_mask[slot]
    sampler.sample:  logits of banned tokens -> -inf        device, fixed shape
    scheduler.commit matcher.accept(token); matcher.done -> finish "stop"

A mask row is ``mask_words(vocab_size)`` int32 words, bit ``t % 32`` of word
``t // 32`` set when token t may come next (llguidance's layout). The mask of step
N+1 depends on step N's token, which is why a step holding a constrained request is
not overlapped with the next one (engine.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask_par

from ftserve_kernels.sampling import mask_words

__all__ = ["GrammarMatcher", "MaskFiller", "mask_words"]


class GrammarMatcher:
    """One request's grammar state: which tokens may come next, advanced by each
    token the request commits. Not thread-safe: one thread at a time (the engine's)."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._m = matcher
        if matcher.is_error():
            raise ValueError(matcher.get_error())

    @classmethod
    def compile(cls, tokenizer: llguidance.LLTokenizer, grammar: str,
                limits: llguidance.LLParserLimits | None = None) -> GrammarMatcher:
        """ValueError with the library's message when it rejects the grammar. Building
        it recurses natively as deep as the grammar's chains of rules go: callers give
        untrusted grammars a deep stack (server/grammar_sandbox.py)."""
        return cls(llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits))

    def copy(self) -> GrammarMatcher:
        """A fresh matcher over the same compiled grammar (another choice of ``n``)."""
        return GrammarMatcher(self._m.deep_copy())

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it (the
        matcher is then in its error state, see ``error``)."""
        return self._m.consume_token(token_id)

    @property
    def done(self) -> bool:
        """The output is complete: nothing but an end-of-sequence id may follow."""
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        return self._m.get_error()


class MaskFiller:
    """Computes the token masks of a step's constrained rows into one host array,
    in parallel over the rows (llguidance releases the GIL)."""

    def __init__(self) -> None:
        self._executor: llguidance.LLExecutor | None = None

    def fill(self, matchers: Sequence[GrammarMatcher], out: np.ndarray) -> None:
        """out[i] = the next-token mask of matchers[i]; out is [n, words] int32, C order."""
        assert out.dtype == np.int32 and out.flags["C_CONTIGUOUS"] and len(out) == len(matchers)
        if not matchers:
            return
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        fill_next_token_bitmask_par(self._executor, [(m._m, i) for i, m in enumerate(matchers)],
                                    out)
