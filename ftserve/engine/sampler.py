"""Per-slot sampling state on the device and the sync-free, fixed-shape sampler.

A request holds one slot (a row of every state tensor) from ``admit`` to
``release``. Row ``max_slots`` is the dummy slot: padded batch rows (CUDA-graph
padding) point at it, and it always samples greedily with no penalties.

    slots   0 .. max_slots-1 | max_slots
            requests          dummy

Per step the engine calls ``sample(logits, slots, steps, min_tokens_active)``
then ``update(slots, token_ids)``. Both only launch fixed-shape kernels on
device tensors: no ``.item()``, no boolean indexing, no host reads, so they
can be captured in a CUDA graph.

Pipeline for one row (the model distribution is ``logits``):

    logits --(logprobs: log_softmax of the raw logits, vLLM/OpenAI semantics)
      -> repetition penalty (prompt + generated), presence/frequency (generated)
      -> + logit_bias (per-slot (token, bias) rows, padded with (0, 0.0))
      -> grammar mask: banned tokens -> -inf (per-slot bitmask rows, [S, ceil(V/32)]
         int32; all ones for unconstrained slots; constrained rows are rewritten
         every step from host-built masks: ``set_grammar_masks``)
      -> eos/stop ids -> -inf while the row is below min_tokens (unless its grammar
         allows nothing else: the grammar wins)
      -> greedy rows: argmax (a step of greedy rows, or of temperature alone, on
         Triton: stop mask + argmax / Gumbel-max in one launch, greedy_triton.py)
      -> sampled rows: / temperature -> top-k -> top-p -> min-p -> Gumbel-max
         with counter-based noise keyed by (seed, step, token)

Which stages exist is a host-side ``SamplerFeatures`` value that only grows as
requests needing a stage are admitted (or ``enable`` forces it: their state,
e.g. the penalty counts, is allocated then). Which stages a step runs is the
union of what its own rows need (``features_of``, passed to ``sample``): a
stage is an exact no-op on a row that does not need it, so skipping it changes
no result. A graph runner captures a few stage sets and replays the smallest
that covers the step (cuda_graph.SAMPLER_VARIANTS).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ftserve.engine.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, SamplingParams
from ftserve_kernels import sampling as ks
from ftserve_kernels.config import DEFAULT_KERNELS, KernelConfig

if TYPE_CHECKING:
    from ftserve_kernels.bookkeeping import StagedRows

try:
    from ftserve_kernels.filter_triton import filter_cuts_triton
    from ftserve_kernels.greedy_triton import greedy_sample_triton
    from ftserve_kernels.penalties_triton import apply_penalties_triton
except ImportError:  # pragma: no cover - no triton: the reference stages run
    filter_cuts_triton = None  # type: ignore[assignment]
    apply_penalties_triton = None  # type: ignore[assignment]
    greedy_sample_triton = None

SHORT_K = ks.SHORT_K

# Below this temperature a row samples greedily: logits / T overflows fp32 as
# T -> 0, and the draw would be the argmax anyway.
MIN_TEMPERATURE = 1e-6
_NF = 6  # fp32 columns per slot
_NI = 5  # int64 columns per slot before the stop ids


@dataclass(frozen=True)
class SamplerFeatures:
    """Stages ``sample`` runs. Hashable: use it in a CUDA-graph key."""

    sampling: bool = False  # some row has temperature > 0
    filtering: bool = False  # some row uses top-k, top-p or min-p
    penalties: bool = False  # some row uses presence/frequency/repetition
    logprobs: bool = False  # some row asked for logprobs
    bias: bool = False  # some row has a logit_bias
    grammar: bool = False  # some row is constrained by a grammar (response_format)
    # Some filtering row needs the whole sorted vocabulary: top-p without a top-k
    # of at most filter_triton.SHORT_K, or a longer top-k. Without it, filtering
    # runs sort-free (filter_triton) where the kernels are Triton.
    wide_filter: bool = False

    @classmethod
    def all(cls) -> SamplerFeatures:
        return cls(sampling=True, filtering=True, penalties=True, logprobs=True, bias=True,
                   grammar=True, wide_filter=True)

    def union(self, other: SamplerFeatures) -> SamplerFeatures:
        return SamplerFeatures.from_bits(self.bits | other.bits)

    def covers(self, other: SamplerFeatures) -> bool:
        """Every stage ``other`` runs, this runs too."""
        return other.bits & ~self.bits == 0

    @functools.cached_property
    def bits(self) -> int:
        """Bit i = field i. Cached: the decode step asks once per step and per
        variant (dataclasses.astuple cost ~5 us a call on the engine thread)."""
        return sum(1 << i for i, on in enumerate(dataclasses.astuple(self)) if on)

    @classmethod
    def from_bits(cls, bits: int) -> SamplerFeatures:
        return _from_bits(cls, bits)


@functools.cache
def _from_bits(cls: type[SamplerFeatures], bits: int) -> SamplerFeatures:
    return cls(*(bool(bits >> i & 1) for i in range(len(dataclasses.fields(cls)))))


def _filter_keep(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor) -> torch.Tensor:
    """[B, V] bool: the tokens top-k, top-p and min-p keep of the temperature-scaled logits."""
    return ks.top_k_top_p_keep(scaled, top_k, top_p) & ks.min_p_keep(scaled, min_p)


# Stage sets greedy_triton runs in one launch (the short filters: after filter_triton's;
# penalties: after penalties_triton's one launch).
_FUSED = frozenset(SamplerFeatures(sampling=s, filtering=f, penalties=p)
                   for s in (False, True) for f in (False, True) for p in (False, True) if s or not f)


@dataclass
class SampleOutput:
    token_ids: torch.Tensor  # [B] int64
    # None unless features.logprobs (some admitted request asked for logprobs).
    logprobs: torch.Tensor | None = None  # [B] fp32, log_softmax(raw logits)[token]
    top_ids: torch.Tensor | None = None  # [B, K] int64, best first
    top_logprobs: torch.Tensor | None = None  # [B, K] fp32
    on_host: bool = False  # the tokens are in Sampler.sample's host_out row already


def _features_of(params: SamplingParams, constrained: bool, vocab_size: int) -> SamplerFeatures:
    sampled = not params.greedy and params.temperature >= MIN_TEMPERATURE
    filtering = sampled and (params.top_k > 1 or params.top_p < 1.0 or params.min_p > 0.0)
    top_k = params.top_k if 0 < params.top_k < vocab_size else 0  # 0: off
    short_k = 0 < top_k <= SHORT_K
    return SamplerFeatures(
        sampling=sampled,
        filtering=filtering,
        penalties=params.uses_penalties,
        logprobs=params.logprobs is not None,
        bias=params.uses_bias,
        grammar=constrained,
        wide_filter=filtering and (top_k > SHORT_K or (params.top_p < 1.0 and not short_k)),
    )


class Sampler:
    def __init__(
        self,
        vocab_size: int,
        max_slots: int,
        device: torch.device | str,
        *,
        max_top_logprobs: int = 20,
        max_stop_ids: int = MAX_STOP_TOKEN_IDS + 16,  # + room for eos ids
        seed: int | None = None,
        kernels: KernelConfig = DEFAULT_KERNELS,
    ) -> None:
        """``max_stop_ids`` bounds eos + stop ids per request (masked for
        min_tokens); ``seed`` seeds the host RNG that draws seeds for requests
        that bring none (None = nondeterministic); ``kernels``: the engine's
        kernel choices (Triton stages or the reference ones)."""
        self.kernels = kernels
        self.vocab_size = vocab_size
        self.max_slots = max_slots
        self.device = torch.device(device)
        self.max_top_logprobs = min(max_top_logprobs, vocab_size)
        self.max_stop_ids = max_stop_ids
        self._host_rng = random.Random(seed)
        self._features = SamplerFeatures()
        n = max_slots + 1  # + the dummy slot
        # Two packed tables, so admit/release are one non-blocking upload each:
        #   fp32  [S, 6]       temperature top_p min_p repetition presence frequency
        #   int64 [S, 5 + M]   greedy top_k seed_lo seed_hi n_stops | stop ids (M)
        self._f = torch.zeros(n, _NF, dtype=torch.float32, device=self.device)
        self._i = torch.zeros(n, _NI + max_stop_ids, dtype=torch.int64, device=self.device)
        self._f[:] = torch.tensor(self._neutral_f())
        self._i[:, :_NI] = torch.tensor(self._neutral_i()[:_NI])
        # Column views (strided); temperature is 1 on greedy rows (unused there).
        (self.temperature, self.top_p, self.min_p,
         self.repetition, self.presence, self.frequency) = self._f.unbind(1)
        self.greedy, self.top_k, self.seed_lo, self.seed_hi, self.num_stops = \
            self._i[:, :_NI].unbind(1)
        # eos/stop ids masked while below min_tokens; [:, n_stops:] is padding.
        self.stop_ids = self._i[:, _NI:]  # [S, M]
        self.token_hash = ks.token_hash_table(vocab_size, self.device)  # [V]
        # logit_bias rows: (token id, bias) pairs, padded with (0, 0.0), which adds nothing.
        self.bias_ids = torch.zeros(n, MAX_LOGIT_BIAS, dtype=torch.int64, device=self.device)  # [S, L]
        self.bias_vals = torch.zeros(n, MAX_LOGIT_BIAS, dtype=torch.float32, device=self.device)  # [S, L]
        self._biased: set[int] = set()  # slots whose bias row is not all zero
        # Grammar masks: bit t % 32 of word t // 32 set = token t allowed; -1 = all ones.
        self.mask_words = ks.mask_words(vocab_size)
        self.grammar_mask = torch.full((n, self.mask_words), -1, dtype=torch.int32,
                                       device=self.device)  # [S, W]
        self._mask_word = torch.arange(vocab_size, device=self.device) // 32  # [V] int64
        self._mask_bit = (torch.arange(vocab_size, device=self.device) % 32).to(torch.int32)  # [V]
        self._constrained: set[int] = set()  # slots whose mask row may not be all ones
        # Allocated on the first request that uses penalties ([S, V] each).
        self.counts: torch.Tensor | None = None  # int32, generated-token counts
        self.prompt_mask: torch.Tensor | None = None  # bool, token in the prompt
        # Arrival counters of the fused greedy kernel, one per batch row and one
        # for the rows (its host_out): zero between launches (the kernel re-zeroes them).
        self._greedy_counts = torch.zeros(n + 1, dtype=torch.int32, device=self.device)
        # The stages each slot's request needs (SamplerFeatures.bits; 0 = greedy),
        # so a step runs only what its own rows need (features_of).
        self._slot_bits = [0] * n

    @property
    def dummy_slot(self) -> int:
        return self.max_slots

    @property
    def features(self) -> SamplerFeatures:
        return self._features

    def enable(self, features: SamplerFeatures) -> None:
        """Turn stages on ahead of time (e.g. before capturing CUDA graphs)."""
        self._features = self._features.union(features)
        if self._features.penalties and self.counts is None:
            n = self.max_slots + 1
            self.counts = torch.zeros(n, self.vocab_size, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(n, self.vocab_size, dtype=torch.bool, device=self.device)

    @contextlib.contextmanager
    def forced_features(self, features: SamplerFeatures) -> Iterator[None]:
        """Run exactly ``features`` inside the block, e.g. to capture one CUDA-graph
        variant per feature set; the current set returns afterwards. Replaying a
        variant that lacks a stage some admitted request needs is the caller's bug:
        pick the variant with ``features`` (or a superset of it)."""
        saved = self._features
        self.enable(features)  # allocates penalty state if needed
        self._features = features
        try:
            yield
        finally:
            self._features = saved

    # -- host path: once per request --------------------------------------

    def admit(
        self,
        slot: int,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        eos_ids: Sequence[int],
        output_ids: Sequence[int] = (),
        constrained: bool = False,
    ) -> None:
        """Load a request's parameters into ``slot``. ``output_ids`` are tokens it
        already generated (a preempted request resuming), counted for penalties;
        ``constrained``: a grammar masks its tokens (the rows come every step, from
        ``set_grammar_masks``). Small host -> device copies; not the per-step path."""
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.max_slots})")
        stops = list(dict.fromkeys([*params.stop_token_ids, *([] if params.ignore_eos else eos_ids)]))
        if len(stops) > self.max_stop_ids:
            raise ValueError(f"{len(stops)} eos/stop ids exceed max_stop_ids={self.max_stop_ids}")
        needs = _features_of(params, constrained, self.vocab_size)
        self.enable(needs)
        self._slot_bits[slot] = needs.bits
        sampled = needs.sampling
        seed = params.seed if params.seed is not None else self._host_rng.getrandbits(64)
        lo, hi = ks.split_seed(seed)
        self._upload(self._f[slot], [
            params.temperature if sampled else 1.0, params.top_p, params.min_p,
            params.repetition_penalty, params.presence_penalty, params.frequency_penalty,
        ], torch.float32)
        top_k = params.top_k if params.top_k > 0 else self.vocab_size
        stop_row = stops + [0] * (self.max_stop_ids - len(stops))
        self._upload(self._i[slot], [int(not sampled), top_k, lo, hi, len(stops), *stop_row],
                     torch.int64)
        if params.uses_bias or slot in self._biased:
            self._set_bias(slot, params.logit_bias)
        if constrained:
            self._constrained.add(slot)
        elif slot in self._constrained:
            self.grammar_mask[slot].fill_(-1)  # a device fill: no host data, no sync
            self._constrained.discard(slot)
        if self.counts is not None and self.prompt_mask is not None:
            # Reset even for requests without penalties: update() counts every row.
            self.counts[slot].zero_()
            self.prompt_mask[slot].zero_()
            if params.uses_penalties:
                if prompt_ids:
                    ids = self._to_device(list(prompt_ids), torch.int64)
                    self.prompt_mask[slot].index_fill_(0, ids, True)
                if output_ids:
                    out = self._to_device(list(output_ids), torch.int64)
                    self.counts[slot].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))

    def release(self, slot: int) -> None:
        """Return ``slot`` to neutral greedy settings (a stale row is harmless)."""
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.max_slots})")
        self._upload(self._f[slot], self._neutral_f(), torch.float32)
        self._upload(self._i[slot], self._neutral_i(), torch.int64)
        self._slot_bits[slot] = 0
        if slot in self._biased:
            self._set_bias(slot, ())
        if slot in self._constrained:
            self.grammar_mask[slot].fill_(-1)
            self._constrained.discard(slot)

    def features_of(self, slots: Iterable[int]) -> SamplerFeatures:
        """The stages a step over these slots needs: the union of their requests'
        (the dummy slot needs none). A stage a row does not need is an exact no-op
        on it, so running only these gives the same tokens as every stage on."""
        bits = 0
        for slot in slots:
            bits |= self._slot_bits[slot]
        return SamplerFeatures.from_bits(bits)

    def set_grammar_masks(self, slots: torch.Tensor, words: torch.Tensor) -> None:
        """Write this step's masks of constrained slots: ``words`` [n, W] int32 rows
        for ``slots`` [n] int32, on the device (one upload, built on the host by
        grammar.MaskFiller). Stream-ordered before the step's sampling; a
        fixed-shape scatter of n rows, no sync."""
        self.grammar_mask.index_copy_(0, slots.long(), words)

    def _set_bias(self, slot: int, pairs: Sequence[tuple[int, float]]) -> None:
        pad = MAX_LOGIT_BIAS - len(pairs)
        self._upload(self.bias_ids[slot], [t for t, _ in pairs] + [0] * pad, torch.int64)
        self._upload(self.bias_vals[slot], [float(b) for _, b in pairs] + [0.0] * pad, torch.float32)
        if pairs:
            self._biased.add(slot)
        else:
            self._biased.discard(slot)

    def _neutral_f(self) -> list[float]:
        return [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]

    def _neutral_i(self) -> list[int]:
        """Greedy, top-k off, seed 0, no stop ids."""
        return [1, self.vocab_size, 0, 0, 0] + [0] * self.max_stop_ids

    def _to_device(self, values: list[int] | list[float], dtype: torch.dtype) -> torch.Tensor:
        """Host list -> device without a sync: a pinned staging tensor and an async
        copy (the caching host allocator keeps the block until the copy is done)."""
        host = torch.tensor(values, dtype=dtype)
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def _upload(self, dst: torch.Tensor, values: list[int] | list[float], dtype: torch.dtype) -> None:
        host = torch.tensor(values, dtype=dtype)
        if self.device.type == "cuda":
            host = host.pin_memory()  # async copy, see _to_device
        dst.copy_(host, non_blocking=True)

    # -- step path: fixed shapes, no host sync ----------------------------

    def sample(
        self,
        logits: torch.Tensor,  # [B, V]
        slots: torch.Tensor,  # [B] int64, dummy_slot for padded rows
        steps: torch.Tensor,  # [B] int64, index of the output token being sampled
        min_tokens_active: torch.Tensor,  # [B] bool, below min_tokens: mask eos/stop
        last: torch.Tensor | None = None,  # [>= B] int64: also receives the tokens
        features: SamplerFeatures | None = None,  # this call's stages (features_of); None: all enabled
        host_out: StagedRows | None = None,
    ) -> SampleOutput:
        """``host_out``: where the greedy kernel gives the tokens, it also stores
        them into the picked row of that pinned pair and toggles its word
        (greedy_triton); the output's ``on_host`` says whether it did, and if
        not the caller copies them."""
        f = self._features if features is None else features
        assert self._features.covers(f), "a stage that was never enabled (its state is missing)"
        fusable = (greedy_sample_triton is not None and self.kernels.triton(logits)
                   and logits.shape[0] < self._greedy_counts.numel())
        if f in _FUSED and fusable:
            # Greedy rows, or temperature alone: the stop mask, the argmax (of logits
            # / T + Gumbel noise on sampled rows) and the copy into ``last``, one launch.
            # With short top-k / top-p / min-p filters: a top-k of the logits and one
            # small launch first find each row's cut, which the draw applies
            # (filter_triton; no sort of the vocabulary).
            # Penalties first, as the composed path: one launch over the slots' rows.
            sampled = f.sampling
            if f.penalties:
                assert self.counts is not None and self.prompt_mask is not None
                logits = apply_penalties_triton(logits, slots, self.counts, self.prompt_mask, self._f)
            cuts = None
            if f.filtering:
                cuts = filter_cuts_triton(logits.float(), slots, min_tokens_active, self._i, _NI, self._f,
                                          MIN_TEMPERATURE)
            tokens = greedy_sample_triton(logits, slots, min_tokens_active, self._i, _NI,
                                          self._greedy_counts, last,
                                          self._f if sampled else None, steps if sampled else None,
                                          MIN_TEMPERATURE, cuts=cuts, host_out=host_out, kernels=self.kernels)
            return SampleOutput(tokens, on_host=host_out is not None)
        out = self._sample(logits, slots, steps, min_tokens_active, f, last if fusable else None, fusable,
                           host_out if fusable else None)
        if last is not None and not fusable:
            last[:out.token_ids.shape[0]].copy_(out.token_ids)
        return out

    def _sample(
        self, logits: torch.Tensor, slots: torch.Tensor, steps: torch.Tensor,
        min_tokens_active: torch.Tensor, f: SamplerFeatures, last: torch.Tensor | None = None,
        fused_draw: bool = False, host_out: StagedRows | None = None,
    ) -> SampleOutput:
        """The composed stages. ``fused_draw``: the argmax, the temperature and the
        Gumbel draw (and the copy into ``last``) run as greedy_triton's one launch
        over the penalized, biased, masked and filtered logits; the same tokens:
        a filter always keeps a row's argmax, and x / T is -inf where x is."""
        raw = logits.float()  # [B, V]

        frow = self._f.index_select(0, slots)  # [B, 6]
        irow = self._i.index_select(0, slots)  # [B, 5 + M]
        temperature, top_p, min_p, repetition, presence, frequency = frow.unbind(1)
        greedy, top_k, seed_lo, seed_hi, num_stops = irow[:, :_NI].unbind(1)

        x = raw
        if f.penalties:
            assert self.counts is not None and self.prompt_mask is not None
            x = ks.apply_penalties_ref(
                x, self.counts.index_select(0, slots), self.prompt_mask.index_select(0, slots),
                repetition, presence, frequency,
            )  # [B, V]
        if f.bias:
            # Padding pairs add 0.0 to token 0; a token listed twice gets both.
            x = x.scatter_add(1, self.bias_ids.index_select(0, slots),
                              self.bias_vals.index_select(0, slots))  # [B, V]
        if f.grammar:
            # After the bias, so no bias brings back a token the grammar bans. Rows of
            # unconstrained slots (and the dummy slot) are all ones: a no-op.
            x = ks.apply_token_bitmask(x, self.grammar_mask.index_select(0, slots),
                                       self._mask_word, self._mask_bit)  # [B, V]
        stop_cols = torch.arange(self.max_stop_ids, device=slots.device)  # [M]
        stop_active = (stop_cols[None, :] < num_stops[:, None]) & min_tokens_active[:, None]
        if f.grammar:
            # min_tokens yields to the grammar: a row whose grammar allows nothing but
            # its eos / stop ids keeps them (the grammar's completion ends the request
            # "stop", as at any length) instead of being left with no token at all,
            # whose draw the grammar would reject.
            held = ks.mask_token_ids(x, irow[:, _NI:], stop_active)  # [B, V]
            empty = held.amax(dim=-1) == ks.NEG_INF  # [B]
            min_tokens_active = min_tokens_active & ~empty
            stop_active = stop_active & ~empty[:, None]
        if fused_draw:
            if f.filtering:  # the filters see the stop mask (the launch repeats it: a no-op)
                x = ks.mask_token_ids(x, irow[:, _NI:], stop_active)  # [B, V]
                scaled = x / temperature.clamp_min(MIN_TEMPERATURE)[:, None]  # [B, V]
                x = torch.where(_filter_keep(scaled, top_k, top_p, min_p), x, ks.NEG_INF)
            tokens = greedy_sample_triton(x, slots, min_tokens_active, self._i, _NI, self._greedy_counts,
                                          last, self._f if f.sampling else None,
                                          steps if f.sampling else None, MIN_TEMPERATURE,
                                          host_out=host_out, kernels=self.kernels)
            out = self._logprobs(raw, tokens, f)
            out.on_host = host_out is not None
            return out
        x = ks.mask_token_ids(x, irow[:, _NI:], stop_active)  # [B, V]
        tokens = x.argmax(dim=-1)  # [B], the greedy choice (greedy_sample_ref, fused)

        if f.sampling:
            scaled = x / temperature.clamp_min(MIN_TEMPERATURE)[:, None]  # [B, V]
            if f.filtering:
                scaled = torch.where(_filter_keep(scaled, top_k, top_p, min_p), scaled, ks.NEG_INF)
            k1, k2 = ks.row_keys(seed_lo, seed_hi, steps)  # [B] each
            drawn = gumbel_argmax(scaled, k1, k2, self.token_hash, self.kernels)  # [B]
            tokens = torch.where(greedy != 0, tokens, drawn)

        return self._logprobs(raw, tokens, f)

    def _logprobs(self, raw: torch.Tensor, tokens: torch.Tensor, f: SamplerFeatures) -> SampleOutput:
        if not f.logprobs:
            return SampleOutput(tokens)
        logp = torch.log_softmax(raw, dim=-1)  # [B, V], the raw model distribution
        top_lp, top_ids = logp.topk(self.max_top_logprobs, dim=-1)  # [B, K]
        chosen = logp.gather(1, tokens[:, None]).squeeze(1)  # [B]
        return SampleOutput(tokens, chosen, top_ids, top_lp)

    def update(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count the sampled tokens for presence/frequency/repetition penalties.
        Nothing to do (no kernel) until some admitted request uses penalties:
        capturing the all-stages graph allocates the counts, but rows of requests
        without penalties never read them, and admit() resets a row it hands out."""
        if self.counts is None or not self._features.penalties:
            return
        # A flat scatter_add (atomics) rather than index_put_(accumulate=True),
        # whose CUDA path sorts indices; duplicate (slot, token) pairs just add.
        flat = slots * self.vocab_size + token_ids  # [B]
        ones = torch.ones_like(token_ids, dtype=torch.int32)  # [B]
        self.counts.view(-1).scatter_add_(0, flat, ones)


def gumbel_argmax(
    scores: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor, token_hash: torch.Tensor,
    kernels: KernelConfig = DEFAULT_KERNELS,
) -> torch.Tensor:
    """Dispatch: the fused Triton kernel on CUDA (backend "torch" forces the
    reference, as in ftserve_kernels.ops), else the reference."""
    if scores.is_cuda and ks.triton is not None and kernels.backend != "torch":
        return ks.gumbel_argmax_triton(scores, k1, k2)
    return ks.gumbel_argmax_ref(scores, k1, k2, token_hash)
