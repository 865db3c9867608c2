"""What one forward pass needs: flattened tokens of several sequences plus the
attention metadata over the paged KV cache.

Sequences are packed back to back (no padding between them)::

    input_ids   [ a0 a1 a2 | b0 | c0 c1 ]      T = 6 tokens, B = 3 sequences
    qo_indptr   [0, 3, 4, 6]
    prefix_lens [0, 7, 2]   tokens already in the cache before this step
    seq_lens    [3, 8, 4]   prefix + new: the KV length each query row sees
    out_cache_loc: the slot (page * page_size + offset) each new token's K/V goes to

Query j (0-based within its sequence) of sequence b sits at absolute position
prefix_lens[b] + j and attends to KV positions [0, prefix_lens[b] + j]: causal
over the new tokens, full over the cached prefix. Decode is the case where every
sequence has exactly one new token.

Host copies (``*_host`` lists) are what the scheduler planned; kernels and the
torch reference read the device tensors, and the reference may use the host
lists for loop bounds (that is host data, no sync). Nothing here is ever read
back from the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from ftserve_kernels.config import DEFAULT_KERNELS, KernelConfig
from ftserve_kernels.gated_delta import InnerSaves

if TYPE_CHECKING:
    from ftserve.kvcache.pool import KVPool
    from ftserve.kvcache.state_pool import StatePool


@dataclass
class AttentionMetadata:
    page_size: int
    qo_indptr: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32, KV length after this step
    prefix_lens: torch.Tensor  # [B] int32, KV length before this step
    page_table: torch.Tensor  # [B, max_pages] int32, padded with the dummy page 0
    out_cache_loc: torch.Tensor  # [T] int64, slot for each new token
    seq_lens_host: list[int]
    prefix_lens_host: list[int]
    max_seq_len: int  # max(seq_lens_host), bounds kernel grids
    max_extend_len: int  # max new tokens of one sequence
    # A verify step's few new tokens per sequence (speculative decoding), set by
    # the verify graphs: each query token attends as a decode query of its own,
    # query t over KV [0, query_seq_lens[t]) through page-table row
    # query_page_table[t] (its sequence's row). Split-K over the cached prefix
    # spreads a long context over the whole GPU, where the extend kernel's few
    # programs (one per head and sequence) would each walk all of it in turn.
    # The same attention as the extend layout above; None: that layout.
    query_page_table: torch.Tensor | None = None  # [T, max_pages] int32
    query_seq_lens: torch.Tensor | None = None  # [T] int32: position + 1
    # [T] int64: the row of each token's sequence's first new token (its rows run
    # consecutively from there), and a host bound on one sequence's new tokens:
    # the decode kernel's q/k norm + rotary + KV store fold takes a verify step
    # with them (TritonAttentionBackend.decode_qk). None: the unfused path.
    query_first_rows: torch.Tensor | None = None
    query_rows_bound: int = 1

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def extend_lens_host(self) -> list[int]:
        return [s - p for s, p in zip(self.seq_lens_host, self.prefix_lens_host)]


class AttentionBackend(Protocol):
    """Stores the new K/V of one layer into the pool (unless ``kv_stored``: the
    caller's fused q/k norm + rotary launch did), then attends; with ``out_gate``
    [T, Hq, D] the output is multiplied by sigmoid(out_gate) (Qwen3-Next).

    q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq, D]
    """

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch,
        kv_stored: bool = False, out_gate: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    kv_pool: KVPool
    attn_backend: AttentionBackend
    # Rows of the final hidden state that become logits: the last new token of
    # each sequence ([B] int64), or None for every token (parity tests).
    logits_indices: torch.Tensor | None
    is_decode: bool = False
    # Per-step extras a backend may attach (e.g. MoE expert-cache state).
    extras: dict[str, Any] = field(default_factory=dict)
    # CUDA events, one per layer: layer L must not touch its KV pages before
    # event L (a KV host-tier restore streaming in layer by layer; see
    # HostKVTier.flush). None: the pages are ready.
    layer_ready: list[Any] | None = None
    # [T, H]: the embedding rows of input_ids, when the caller gathered them
    # already (the decode graph's fused inputs launch); None: the model embeds.
    input_embeds: torch.Tensor | None = None
    # [T, H]: the first layer's input norm of input_embeds, when the caller
    # applied it too (DecoderForCausalLM.decode_input_norm); None: layer 0 norms.
    input_normed: torch.Tensor | None = None
    # Hybrid models (linear-attention layers): the recurrent-state pool and each
    # sequence's slot in it ([B] int64, padded rows -> state_pool.SINK_SLOT).
    # None for models without linear layers.
    state_pool: StatePool | None = None
    state_slots: torch.Tensor | None = None
    # A speculative verify step on a hybrid: the linear layers leave every slot's
    # state as it was and log their inputs into state_pool.verify_log; the runner
    # then moves each slot on by the tokens it kept (StatePool.commit_verified).
    state_verify: bool = False
    # State checkpoints inside this prefill step's sequences, which the linear
    # layers save as they pass (engine/state_checkpoints.py).
    state_inner: InnerSaves | None = None
    # A captured graph's extend forward (engine/prefill_graph.py): the attn host
    # lists are static upper bounds, not this step's, so the linear layers read
    # each sequence's tokens from qo_indptr on the device, at most this many
    # each (one sequence per state_slots row, empty ones padding); 0: eager, the
    # host lists are the step's.
    graph_seq_bound: int = 0
    # [1] int32 on the device: how many leading rows are real tokens, in a
    # captured graph's bucket padded past them (engine/prefill_graph.py); the
    # resident MoE layers skip the padding rows' experts (moe_align's
    # valid_rows). None: every row is a token.
    valid_tokens: torch.Tensor | None = None
    # Which kernels every layer runs (the engine's, fixed at start-up; tests
    # and tools building a batch themselves get the defaults unless they pass one).
    kernels: KernelConfig = DEFAULT_KERNELS
    # keep_hidden: the model also leaves every token's final hidden state (after
    # the final norm) in ``hidden`` [T, H], the input of MTP drafting (models/mtp.py).
    keep_hidden: bool = False
    hidden: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return self.attn.num_seqs


# (token ids [T], positions [T], KV slots [T]) as int64 numpy arrays, then
# (qo_indptr [B+1], seq_lens [B], each sequence's last token row [B]) as lists.
PackedTokens = tuple[np.ndarray, np.ndarray, np.ndarray, list[int], list[int], list[int]]

# Sequences up to this many new tokens are packed in plain Python (decode rows:
# a numpy call per row would cost more than the row); longer ones with numpy.
_SHORT_SEQ = 16


def pack_tokens(
    token_ids: Sequence[Sequence[int]],
    prefix_lens: Sequence[int],
    page_tables: Sequence[Sequence[int]],
    page_size: int,
) -> PackedTokens:
    """The packed layout (module docstring) on the host, vectorized: a 4,096-token
    chunk costs ~0.1 ms here (Python lists and torch.tensor cost ~1.5 ms, all of
    it GPU idle time before a chunk's first kernel)."""
    ps = page_size
    ids: list[Any] = []  # per-sequence pieces: lists (short) or arrays (long)
    pos: list[Any] = []
    locs: list[Any] = []
    indptr = [0]
    seq_lens: list[int] = []
    last: list[int] = []
    short_ids: list[int] = []  # a run of short sequences, flushed as one piece
    short_pos: list[int] = []
    short_locs: list[int] = []

    def flush_short() -> None:
        if short_ids:
            ids.append(np.array(short_ids, dtype=np.int64))
            pos.append(np.array(short_pos, dtype=np.int64))
            locs.append(np.array(short_locs, dtype=np.int64))
            short_ids.clear()
            short_pos.clear()
            short_locs.clear()

    for toks, pre, pages in zip(token_ids, prefix_lens, page_tables):
        n = len(toks)
        if n <= _SHORT_SEQ:
            short_ids.extend(toks)
            for p in range(pre, pre + n):
                short_pos.append(p)
                short_locs.append(pages[p // ps] * ps + p % ps)
        else:
            flush_short()
            first = pre // ps
            p = np.arange(pre, pre + n, dtype=np.int64)
            table = np.array(pages[first:(pre + n - 1) // ps + 1], dtype=np.int64)
            ids.append(np.array(toks, dtype=np.int64))
            pos.append(p)
            locs.append(table[p // ps - first] * ps + p % ps)
        indptr.append(indptr[-1] + n)
        seq_lens.append(pre + n)
        last.append(indptr[-1] - 1)
    flush_short()

    def cat(parts: list[np.ndarray]) -> np.ndarray:
        if not parts:
            return np.zeros(0, dtype=np.int64)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    return cat(ids), cat(pos), cat(locs), indptr, seq_lens, last


def build_forward_batch(
    token_ids: list[list[int]],
    prefix_lens: list[int],
    page_tables: list[list[int]],
    kv_pool: KVPool,
    attn_backend: AttentionBackend,
    *,
    all_logits: bool = False,
    is_decode: bool = False,
    device: torch.device | str | None = None,
    state_pool: StatePool | None = None,
    state_slots: list[int] | None = None,
    kernels: KernelConfig = DEFAULT_KERNELS,
) -> ForwardBatch:
    """Simple host-side builder: one sequence per entry of ``token_ids`` holding
    its *new* tokens, ``prefix_lens[b]`` tokens already cached in the pages
    ``page_tables[b]`` (which must cover prefix + new tokens); for a hybrid
    model, ``state_slots[b]`` is its slot in ``state_pool``.

    The engine's scheduler builds the same tensors into pinned staging buffers
    (one non-blocking copy); this builder serves tests and tools.
    """
    device = torch.device(device) if device is not None else kv_pool.device
    ps = kv_pool.page_size
    for toks, pre, pages in zip(token_ids, prefix_lens, page_tables):
        if not toks:
            raise ValueError("every sequence in a batch needs at least one new token")
        if (pre + len(toks) + ps - 1) // ps > len(pages):
            raise ValueError(f"page table of {len(pages)} pages cannot hold {pre + len(toks)} tokens")
    ids, pos, locs, indptr, seq_lens, last = pack_tokens(token_ids, prefix_lens, page_tables, ps)
    max_pages = max(1, max(len(p) for p in page_tables))
    table = torch.zeros((len(token_ids), max_pages), dtype=torch.int32)
    for b, pages in enumerate(page_tables):
        if pages:
            table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    attn = AttentionMetadata(
        page_size=ps,
        qo_indptr=torch.tensor(indptr, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32, device=device),
        page_table=table.to(device),
        out_cache_loc=torch.from_numpy(locs).to(device),
        seq_lens_host=seq_lens,
        prefix_lens_host=list(prefix_lens),
        max_seq_len=max(seq_lens),
        max_extend_len=max(len(t) for t in token_ids),
    )
    return ForwardBatch(
        input_ids=torch.from_numpy(ids).to(device),
        positions=torch.from_numpy(pos).to(device),
        attn=attn,
        kv_pool=kv_pool,
        attn_backend=attn_backend,
        logits_indices=None if all_logits else torch.tensor(last, dtype=torch.int64, device=device),
        is_decode=is_decode,
        state_pool=state_pool,
        state_slots=None if state_slots is None else torch.tensor(state_slots, dtype=torch.int64, device=device),
        kernels=kernels,
    )
