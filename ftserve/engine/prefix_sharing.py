"""Sharing a prompt's KV pages with requests that arrive while it is computed.

The prefix cache gets a request's pages when the request ends; agentic clients
fan out instead (several sub-agents, or the ``n`` choices of one request, sent
at once over one long conversation). Two rules let them prefill it once:

- **publish**: at a request's first token (its prefill is done) its full prompt
  pages go into the radix tree, still locked by the request, so requests
  admitted from then on match them;
- **wait for the leader**: a waiting request whose prompt shares at least one
  full page more with a running, still-prefilling request than the tree holds
  for it is not admitted yet; once the leader publishes, it prefills only the
  rest. The step's prefill budget would have gone to the leader's chunks first
  anyway, so waiting costs it nothing.

Publishing happens only when the tree holds nothing of those pages yet beyond
the request's own match: the insert then adopts exactly the request's page ids,
so no page changes under a page table that a step in flight may still read
(where another request got there first, the request's pages go in at its
release, as before, and the duplicates are freed then).

Hybrid models (a stateful prefix cache, engine/state_checkpoints.py): pages
count only up to a state checkpoint. A follower waits for a leader that will
publish a checkpoint deeper than the follower's usable match inside their
common prompt; the leader publishes its pages up to its deepest checkpoint,
with its checkpoints, and the follower resumes from a copy of that state (the
prefill of the shared prompt runs once; the follower computes the last
partial page).
"""

from __future__ import annotations

from collections.abc import Iterable

from ftserve.engine import state_checkpoints
from ftserve.engine.request import Req, ReqState
from ftserve.kvcache.radix import RadixCache, as_token_array


def prefill_leader(radix: RadixCache, running: Iterable[Req], req: Req, page_size: int,
                   checkpoint_every: int = 0) -> Req | None:
    """The running request still prefilling pages of ``req``'s prompt that the tree lacks
    (stateful caches: a checkpoint of it, saved every ``checkpoint_every`` tokens)."""
    leaders = [r for r in running if r.state is ReqState.PREFILL]
    if not leaders:
        return None
    ps = page_size
    query = as_token_array(req.tokens[:len(req.tokens) - 1])  # a token is always left to compute
    match = radix.match_prefix(query, count_stats=False)
    if radix.stateful:
        return _state_leader(leaders, req, match.state_tokens, len(query) // ps * ps, ps, checkpoint_every)
    m = match.num_tokens + match.host_tokens
    if m + ps > len(query):
        return None
    for r in leaders:
        # The leader publishes its prompt's full pages: they must cover the next page.
        if (r.prompt_len >= m + ps and r.tokens[m:m + ps] == req.tokens[m:m + ps]
                and r.tokens[:m] == req.tokens[:m]):
            return r
    return None


def _state_leader(leaders: list[Req], req: Req, m: int, usable: int, ps: int, every: int) -> Req | None:
    """A leader that will publish a checkpoint b with m < b <= usable inside the
    prompt it shares with ``req``."""
    for r in leaders:
        if r.first_token_time is not None or r.tokens[m:m + ps] != req.tokens[m:m + ps]:
            # A resumed request publishes nothing; or they part before any deeper
            # checkpoint (the cheap test first).
            continue
        for b in reversed(state_checkpoints.boundaries(r, ps, every)):
            if m < b <= usable and b <= r.prompt_len and r.tokens[:b] == req.tokens[:b]:
                return r
    return None


def publish_prompt(radix: RadixCache, req: Req, page_size: int) -> int:
    """Hand ``req``'s full computed prompt pages to the tree under its lock (module
    doc); returns how many pages the tree gained (0 when it already had them).
    Stateful caches: the pages up to its deepest checkpoint, with its checkpoints."""
    if req.tree_node is None:
        return 0
    ps = page_size
    n_full = min(req.computed_len // ps, len(req.pages))
    if radix.stateful:
        return _publish_with_states(radix, req, n_full, ps)
    if n_full <= req.num_tree_pages:
        return 0
    toks = as_token_array(req.tokens[:n_full * ps])  # converted once for the three walks
    before = radix.match_prefix(toks, count_stats=False)
    if before.num_tokens + before.host_tokens != req.num_tree_pages * ps:
        return 0
    radix.insert(toks, req.pages[:n_full])
    after = radix.match_prefix(toks, count_stats=False)
    assert after.pages == req.pages[:n_full], "the tree adopted other pages than the request's"
    radix.lock(after.node)
    radix.unlock(req.tree_node)
    req.tree_node, req.num_tree_pages = after.node, n_full
    return n_full - before.num_tokens // ps


def _publish_with_states(radix: RadixCache, req: Req, n_full: int, ps: int) -> int:
    ends = [n for n, _ in req.checkpoints if n <= n_full * ps]
    if not ends or max(ends) <= req.num_tree_pages * ps:
        return 0
    end = max(ends)
    toks = as_token_array(req.tokens[:end])
    before = radix.match_prefix(toks, count_stats=False)
    if before.num_tokens + before.host_tokens != req.num_tree_pages * ps:
        return 0
    give = [(n, slot) for n, slot in req.checkpoints if n <= end]
    req.checkpoints = [(n, slot) for n, slot in req.checkpoints if n > end]
    radix.insert(toks, req.pages[:end // ps], give)
    after = radix.match_prefix(toks, count_stats=False)
    assert after.pages == req.pages[:end // ps], "the tree adopted other pages than the request's"
    assert after.state_tokens == end and after.state_node is not None
    radix.lock(after.state_node)
    radix.unlock(req.tree_node)
    req.tree_node, req.num_tree_pages = after.state_node, end // ps
    return end // ps - before.num_tokens // ps
