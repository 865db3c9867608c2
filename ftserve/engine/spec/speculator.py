"""Per-request speculation: who drafts, how much, and backing off.

The scheduler asks ``propose`` for each decoding request whose last token the
host holds; a non-empty draft becomes a verify row (the last token and the
draft as one small extend, scored at every position), and ``record`` learns
from what the verify step kept (accept.py). ``Speculator`` drafts by n-gram
lookup (``_draft``); ``mtp.MTPSpeculator`` only overrides ``_draft`` (its
drafts are made on the device), so both kinds share who drafts and the
back-off below.

Who drafts: requests whose sampling the verify step reproduces exactly. The
sampler's stages are per row and per step index, so temperature, top-k/p,
min-p, logit_bias, min_tokens, stop ids and logprobs all hold at every
position. Two do not and fall back to plain decoding for that request:
penalties (the counts a row reads would have to include the draft tokens
before it) and grammars (the matcher would have to walk the draft to mask
each position).

Back-off: a step where the request's text offers no match, or a verify that
keeps no draft token, is a miss; after m misses in a row the request decodes
plainly for min(2^m, MAX_BACKOFF) tokens before it looks again, and a verify
that keeps something resets m. A request in back-off does no lookup and
verifies nothing, and its steps keep overlap scheduling (a request about to
draft needs its last token on the host, so the engine reads such a step back
at once; engine._step). (An MTP request in back-off still has its MTP KV
kept by every step: mtp.py.)

Gate (gate.py): speculation pays only where the verify steps it saves cost
less than the tokens they add; a SpecGate (--disable-speculative-gate: none)
measures tokens/s with and without it per batch size and holds drafting off
where it loses. A step it holds off drafts nothing and counts no miss.

Indexing: the engine indexes a verify step's drafts ahead while the device
runs it (``index_ahead``: the lookup after it then mostly finds them done),
and a request's n-gram index catches up over its prompt in pieces of
at most INDEX_BUDGET positions per engine step, all requests together, so a
long prompt's first steps do not stall everyone's (it drafts once indexed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ftserve.engine.spec.gate import SpecGate
from ftserve.engine.spec.ngram import NgramIndex

if TYPE_CHECKING:
    from ftserve.engine.request import Req

MAX_BACKOFF = 128  # plain tokens after the longest run of misses
INDEX_BUDGET = 16384  # prompt positions indexed per engine step, all requests together


@dataclass
class SpecCounters:
    verifies_total: int = 0  # drafts verified (one per request per verify step)
    proposed_tokens_total: int = 0
    accepted_tokens_total: int = 0
    # accept_lengths[a]: verifies that kept a draft tokens (0 .. k)
    accept_lengths: list[int] = field(default_factory=list)


@dataclass(eq=False)
class SpecState:
    """One request's speculation state (Req.spec)."""

    misses: int = 0  # misses in a row
    resume_at: int = 0  # the output count at which it next looks for a draft
    index: NgramIndex | None = None  # n-gram drafting's suffix index


class Speculator:
    # Drafts made on the device at launch (mtp.py): the scheduler plans
    # placeholders, and a prefix-cache match gives back its last page.
    device_drafts = False

    def __init__(self, num_tokens: int, min_match: int, max_match: int, max_model_len: int) -> None:
        self.num_tokens = num_tokens
        self.min_match, self.max_match = min_match, max_match
        self.max_model_len = max_model_len
        self.counters = SpecCounters(accept_lengths=[0] * (num_tokens + 1))
        self._budget = INDEX_BUDGET
        self.gate: SpecGate | None = None  # set by the engine's setup (--speculative-gate)
        self._open = True  # this step's requests may draft (the gate)

    @staticmethod
    def supports(req: Req) -> bool:
        """Its sampling is reproduced at every draft position (module docstring)."""
        return req.grammar is None and not req.params.uses_penalties

    def _state(self, req: Req) -> SpecState:
        if req.spec is None:
            req.spec = self._new_state()
        st: SpecState = req.spec
        return st

    def _new_state(self) -> SpecState:
        return SpecState(index=NgramIndex(self.min_match, self.max_match))

    def drafting(self, req: Req, rows: int | None = None) -> bool:
        """It will look for a draft at its step after the next one commits: that
        step must be read back before the following one is planned. ``rows``:
        that step's batch size, for the gate (None: assume it lets it)."""
        if not self.supports(req):
            return False
        if rows is not None and self.gate is not None and not self.gate.allows(rows):
            return False
        st: SpecState | None = req.spec
        return st is None or req.num_outputs + 1 >= st.resume_at

    def begin_step(self, rows: int) -> bool:
        """A decode step of ``rows`` requests is being planned: whether they may
        draft (the gate)."""
        self._budget = INDEX_BUDGET
        self._open = self.gate is None or self.gate.planned(rows)
        return self._open

    def limit(self, req: Req) -> int:
        """The longest useful draft: room for it and the bonus token within
        max_tokens, and for its KV positions within the context."""
        left = req.params.max_tokens - req.num_outputs - 1
        return max(0, min(self.num_tokens, left, self.max_model_len - len(req.tokens)))

    def propose(self, req: Req) -> list[int]:
        """This step's draft for a decoding request whose tokens the host holds
        (empty: plain decoding this step)."""
        if not self._open or not self.supports(req):
            return []
        st = req.spec if req.spec is not None else self._state(req)
        n_out = len(req.output_ids)
        if n_out < st.resume_at:
            return []
        k = min(self.num_tokens, req.params.max_tokens - n_out - 1, self.max_model_len - len(req.tokens))
        if k <= 0:  # as limit(req)
            return []
        draft = self._draft(req, st, k)
        if draft is None:
            return []  # not ready to draft yet: no miss
        if not draft:
            self._miss(req, st)
        return draft

    def _draft(self, req: Req, st: SpecState, k: int) -> list[int] | None:
        """At most k draft tokens after the request's last (empty: a miss), or
        None while its n-gram index still catches up over its prompt."""
        idx = st.index
        assert idx is not None
        idx.sync(req.tokens)
        if idx.behind:
            self._budget -= idx.catch_up(max(0, self._budget))
            if idx.behind:
                return None
        return idx.propose(k)

    def index_ahead(self, req: Req, draft: list[int]) -> None:
        """While the verify step of ``draft`` runs: index the request's n-grams as
        if it kept all of it (ngram.py), so the commit and the next lookup have
        only what the kept tokens change left to do. A guess: the next ``_draft``
        syncs the index with the tokens really kept, exactly."""
        st: SpecState | None = req.spec
        if st is not None and st.index is not None and len(st.index) == len(req.tokens):
            st.index.index_ahead(draft)

    def record(self, req: Req, proposed: int, accepted: int) -> None:
        """What a verify step kept of the request's draft."""
        c = self.counters
        c.verifies_total += 1
        c.proposed_tokens_total += proposed
        c.accepted_tokens_total += accepted
        c.accept_lengths[accepted] += 1
        st = self._state(req)
        if accepted == 0:
            self._miss(req, st)
        else:
            st.misses = 0

    def _miss(self, req: Req, st: SpecState) -> None:
        st.misses += 1
        st.resume_at = req.num_outputs + min(1 << st.misses, MAX_BACKOFF)
