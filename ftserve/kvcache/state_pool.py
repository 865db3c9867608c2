"""Recurrent-state pool of a hybrid model: the fixed-size memory that holds each
running request's Gated DeltaNet state, beside the paged KV pool.

A linear-attention layer carries two states per sequence, whatever its length:

    conv[j]:      [num_slots + 1, conv_dim, conv_kernel - 1]     the last inputs of the short conv
    recurrent[j]: [num_slots + 1, value_heads, key_dim, value_dim]   the delta-rule state S

(j = the layer's index among the linear layers, ModelConfig.linear_layers).

    slot 0     slot 1     slot 2          ...  slot num_slots
    +--------+ +--------+ +--------+           +--------+
    | sink   | | req A  | | req B  |           |        |
    +--------+ +--------+ +--------+           +--------+

Slot 0 is the sink, as page 0 is the KV pool's dummy page: never handed out,
padded rows of a batch (CUDA-graph padding, "no request") read and write it,
so a decode step gathers and scatters by a fixed-shape slot index tensor with
no branch. What the sink holds is garbage and nobody reads it as state.

The contract with the model (ftserve/models/linear_attention.py): a sequence
whose ``prefix_lens`` is 0 starts from zero state and never reads its slot, so a
freed slot needs no clearing; a sequence with a prefix finds in its slot the
state after exactly ``prefix_lens`` tokens (left there by its previous chunk, or
copied in from a prefix-cache checkpoint with ``copy_slots``). Every forward
leaves the state after its last token in the slot.

Slot ownership (alloc / free) is host bookkeeping of the scheduler; the
tensors are only touched by the forward, ``copy_slots`` and ``commit_verified``.

Speculative decoding: a verify step feeds a request's last token and its draft
and may keep only a prefix of them, so its forward leaves every slot as it was
and logs what the linear layers would need to move a state on, per token of
the step (``verify_log``, sized at start-up for the largest verify step)::

    conv_in[j]: [tokens, conv_dim]   the conv's inputs       k[j]: [tokens, Hk, dk]
    v[j]:       [tokens, Hv, dv]     g[j], beta[j]: [tokens, Hv]   (the rule's inputs)

Once the step has sampled, ``commit_verified`` moves each request's slot on by
the tokens it keeps (counted on the device: no sync), in every layer, as decode
steps over them would. A token's log is about 1% of a slot (Qwen3-Next-80B:
1 MB against 77 MB), where keeping a state per draft position would cost a
whole slot each, and the commit reads and writes each state once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ftserve.models.config import ModelConfig
from ftserve_kernels import ops
from ftserve_kernels.config import KernelConfig

SINK_SLOT = 0


@dataclass(frozen=True)
class StateLayout:
    """Per-slot state shapes of every linear layer, from the model config alone
    (the start-up memory plan sizes the pool before any tensor exists)."""

    num_layers: int  # linear-attention layers
    conv_dim: int
    conv_width: int  # conv_kernel - 1 remembered inputs
    num_heads: int  # value heads
    key_dim: int  # per head
    value_dim: int  # per head
    num_key_heads: int = 0

    @staticmethod
    def from_config(cfg: ModelConfig) -> StateLayout:
        la = cfg.linear_attn
        if la is None or not cfg.linear_layers:
            raise ValueError(f"{cfg.architecture} has no linear-attention layers: it needs no state pool")
        return StateLayout(
            num_layers=len(cfg.linear_layers), conv_dim=la.conv_dim, conv_width=la.conv_kernel - 1,
            num_heads=la.num_value_heads, key_dim=la.key_head_dim, value_dim=la.value_head_dim,
            num_key_heads=la.num_key_heads,
        )

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_width)

    @property
    def recurrent_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.key_dim, self.value_dim)

    def bytes_per_slot(self, conv_dtype: torch.dtype, state_dtype: torch.dtype) -> int:
        """Bytes one slot holds over all linear layers."""
        conv = math.prod(self.conv_shape) * conv_dtype.itemsize
        rec = math.prod(self.recurrent_shape) * state_dtype.itemsize
        return self.num_layers * (conv + rec)

    def log_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes the verify log holds per token over all linear layers (conv inputs,
        k, v and beta in the model's dtype, g in fp32)."""
        n = self.conv_dim + self.num_key_heads * self.key_dim + self.num_heads * (self.value_dim + 1)
        return self.num_layers * (n * dtype.itemsize + self.num_heads * 4)

    def pool_bytes(self, num_slots: int, conv_dtype: torch.dtype, state_dtype: torch.dtype,
                   verify_tokens: int = 0) -> int:
        """Bytes of a StatePool of ``num_slots`` slots (the sink included) and a
        verify log of ``verify_tokens`` tokens."""
        return ((num_slots + 1) * self.bytes_per_slot(conv_dtype, state_dtype)
                + verify_tokens * self.log_bytes_per_token(conv_dtype))


@dataclass
class VerifyLog:
    """The linear layers' inputs over one verify step's packed tokens (module
    docstring); layer j of the pool is index j, token t of the step row t."""

    conv_in: torch.Tensor  # [L, tokens, conv_dim]
    k: torch.Tensor  # [L, tokens, Hk, dk]
    v: torch.Tensor  # [L, tokens, Hv, dv]
    g: torch.Tensor  # [L, tokens, Hv] fp32, log decay
    beta: torch.Tensor  # [L, tokens, Hv]

    @staticmethod
    def empty(layout: StateLayout, tokens: int, dtype: torch.dtype, device: torch.device) -> VerifyLog:
        n, heads = layout.num_layers, layout.num_heads

        def make(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros((n, tokens, *shape), dtype=dt, device=device)

        return VerifyLog(conv_in=make(layout.conv_dim), k=make(layout.num_key_heads, layout.key_dim),
                         v=make(heads, layout.value_dim), g=make(heads, dt=torch.float32), beta=make(heads))

    @property
    def tokens(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.conv_in, self.k, self.v, self.g, self.beta))


class StatePool:
    """The state tensors (module docstring) and the host free list of their slots.

    ``conv_dtype`` is the model's dtype (the conv state is a copy of layer
    inputs); the recurrent state accumulates over the whole sequence and is
    kept in fp32 by default, as the reference implementation keeps it.
    """

    def __init__(
        self, layout: StateLayout, num_slots: int, conv_dtype: torch.dtype,
        state_dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
        verify_tokens: int = 0,
    ) -> None:
        if num_slots < 1:
            raise ValueError("the state pool needs at least one slot besides the sink")
        self.layout = layout
        self.num_slots = num_slots
        self.device = torch.device(device)
        rows = num_slots + 1
        self.conv = torch.zeros((layout.num_layers, rows, *layout.conv_shape), dtype=conv_dtype,
                                device=self.device)
        self.recurrent = torch.zeros((layout.num_layers, rows, *layout.recurrent_shape),
                                     dtype=state_dtype, device=self.device)
        # Speculative decoding: the largest verify step's log (None: no speculation).
        self.verify_log = (VerifyLog.empty(layout, verify_tokens, conv_dtype, self.device)
                           if verify_tokens else None)
        # LIFO: a slot just freed is handed out next (its rows are warm in L2).
        self._free: list[int] = list(range(num_slots, 0, -1))
        self._owned: set[int] = set()

    @staticmethod
    def for_model(cfg: ModelConfig, num_slots: int, dtype: torch.dtype,
                  state_dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                  verify_tokens: int = 0) -> StatePool:
        return StatePool(StateLayout.from_config(cfg), num_slots, dtype, state_dtype, device, verify_tokens)

    @property
    def nbytes(self) -> int:
        log = self.verify_log.nbytes if self.verify_log is not None else 0
        return self.conv.nbytes + self.recurrent.nbytes + log

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_slots(self) -> list[int]:
        """The free slots (a copy), for integrity checks."""
        return list(self._free)

    def alloc(self) -> int:
        """A free slot for a new request; its contents are stale (see the module
        docstring: a sequence without a prefix never reads them)."""
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} state slots are in use")
        slot = self._free.pop()
        self._owned.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._owned:
            raise ValueError(f"state slot {slot} is not allocated")
        self._owned.remove(slot)
        self._free.append(slot)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """state[dst[i]] = state[src[i]] in every layer: a prefix-cache checkpoint
        saved from a request's slot, or restored into one. src, dst: [N] int64 on
        the pool's device, fixed shape; pad both with SINK_SLOT (a sink-to-sink
        copy is a no-op). No host sync."""
        self.conv.index_copy_(1, dst, self.conv.index_select(1, src))
        self.recurrent.index_copy_(1, dst, self.recurrent.index_select(1, src))

    def commit_verified(self, kernels: KernelConfig, slots: torch.Tensor, has_state: torch.Tensor,
                        starts: torch.Tensor, kept: torch.Tensor, max_kept: int) -> None:
        """After a verify step: sequence b's state in slots[b] moves on by the
        logged tokens starts[b] .. starts[b] + kept[b] - 1, in every linear layer
        (module docstring). All [B] on the device; max_kept bounds kept (host)."""
        log = self.verify_log
        assert log is not None, "the pool was built without a verify log (no --speculative)"
        gated_delta = ops.gated_delta(kernels, self.recurrent)
        gated_delta.conv_commit(log.conv_in, self.conv, slots, has_state, starts, kept, max_kept)
        gated_delta.gated_delta_commit(log.k, log.v, log.g, log.beta, self.recurrent, slots, has_state,
                                       starts, kept, max_kept)
