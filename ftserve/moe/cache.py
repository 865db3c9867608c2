"""The expert-slot cache: N hot experts in VRAM slots, the rest in host banks.

Installed on a model whose experts live in a HostBank (see banks.py). Every MoE
block's ``expert_compute`` hook comes here; a forward pre-hook on the model
picks, per forward pass, one of three paths (host shapes only):

- ``full``   the cache holds every expert (N >= Lm*E): filled once at start-up,
             never streams again; the fused kernel reads slots through the map.
- ``admit``  decode (and prefill chunks with fewer (token, expert) pairs than E):
             per layer ONE admission kernel maps the selected experts to slots,
             evicting LRU slots not needed now, ``fill_rows`` copies the misses
             from the pinned bank over UVA, then the fused kernel reads slots.
             All device-side and fixed-shape, so it is captured in the decode graph.
- ``stream`` prefill: whole layers go to two layer buffers on a copy stream,
             layer j+1 copying while layer j computes, ordered by events only::

                 copy   : plan+copy L0->b0 | L1->b1 | (wait done0) L2->b0 | ...
                 compute:   (wait ready0) L0 | (wait ready1) L1 | (wait ready0) L2
             Reusing buffer b first unmaps what pointed into it: one fixed-shape
             scatter through the prefill map's sink (``invalidate_slots``), never
             a boolean index. Experts already cached are used in place, not copied.

Device maps (fixed shapes, ``-1`` = none, last entry of each *_of_id = sink)::

    slot_of_id  [Lm*E + 1] int32   LRU cache: id -> slot in [0, N)
    id_of_slot  [N] int32, last_used [N] int64, step [1] int64
    pslot_of_id [Lm*E + 1] int32   prefill: id -> slot (cache or buffer)
    pid_of_slot [2E] int32         buffer slot -> id
    counters    [3] int64          distinct lookups, misses (admit); experts streamed

Nothing here reads a device value on the host.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from ftserve.models.forward_batch import ForwardBatch
from ftserve.moe.banks import HostBank, moe_blocks
from ftserve.moe.kernels import check_bank, fill_rows, fill_rows_ref, plan_layer, plan_layer_ref
from ftserve_kernels import bookkeeping as bk
from ftserve_kernels.moe import fused_moe_ref


class ExpertCache:
    def __init__(self, model: nn.Module, bank: HostBank, num_slots: int, top_k: int,
                 device: torch.device, track_stats: bool = True) -> None:
        self.bank = bank
        self.device = device
        self.on_cuda = device.type == "cuda"
        self.num_layers = bank.num_layers  # Lm
        self.num_experts = e = bank.num_experts  # E
        self.top_k = top_k
        self.total = self.num_layers * e
        self.full = num_slots >= self.total
        self.num_slots = n = min(num_slots, self.total)  # N, LRU slots
        self.buf_base = n
        rows = n + (0 if self.full else 2 * e) + 1  # + the trash row of the twins
        h, i = bank.hidden, bank.inter
        self.slots = torch.empty(rows, bank.row_elems, dtype=bank.data.dtype, device=device)  # [S, R]
        self.w13 = self.slots[:, : 2 * i * h].view(rows, 2 * i, h)  # [S, 2I, H], row stride R
        self.w2 = self.slots[:, 2 * i * h:].view(rows, h, i)  # [S, H, I], row stride R
        self.slot_of_id, self.id_of_slot, self.last_used, self.step = bk.new_slot_maps(
            self.total, n, device)
        self.pslot_of_id = torch.full((self.total + 1,), -1, dtype=torch.int32, device=device)
        self.pid_of_slot = torch.full((2 * e,), -1, dtype=torch.int32, device=device)
        self.plan_src = torch.full((2, e), -1, dtype=torch.int32, device=device)  # per buffer
        self.plan_dst = torch.full((2, e), -1, dtype=torch.int32, device=device)
        self.counters = torch.zeros(3, dtype=torch.int64, device=device)
        self.ar_e = torch.arange(e, dtype=torch.int32, device=device)
        self.track_stats = track_stats
        self.mode = "full" if self.full else "admit"
        if self.on_cuda:
            check_bank(bank.data)
            self.copy_stream = torch.cuda.Stream(device)
            self.ready = [torch.cuda.Event(), torch.cuda.Event()]
            self.done = [torch.cuda.Event(), torch.cuda.Event()]
        self.blocks = moe_blocks(model)
        assert len(self.blocks) == self.num_layers
        for j, blk in enumerate(self.blocks):
            blk.expert_compute = functools.partial(self._compute, j)
        self._hook = model.register_forward_pre_hook(self._begin)
        if self.full:
            self._fill_all()

    # ----- planning ------------------------------------------------------
    def max_admit(self, num_tokens: int) -> int:
        """Length of the admission list for a batch of T tokens: min(T*k, E)."""
        return min(num_tokens * self.top_k, self.num_experts)

    def path_for(self, num_tokens: int, is_decode: bool) -> str:
        if self.full:
            return "full"
        pairs = num_tokens * self.top_k
        if (is_decode or pairs < self.num_experts) and self.max_admit(num_tokens) <= self.num_slots:
            return "admit"
        return "stream"

    @torch.no_grad()
    def reset(self) -> None:
        """Forget every slot (after the bank's contents changed); full mode refills."""
        for t in (self.slot_of_id, self.id_of_slot, self.last_used, self.pslot_of_id, self.pid_of_slot):
            t.fill_(-1)
        self.step.zero_()
        if self.full:
            self._fill_all()

    @torch.no_grad()
    def _fill_all(self) -> None:
        """Start-up, full mode: id i lives in slot i for good."""
        t = self.total
        self.slots[:t].copy_(self.bank.data)
        self.id_of_slot.copy_(torch.arange(t, dtype=torch.int32))
        self.slot_of_id[:t].copy_(torch.arange(t, dtype=torch.int32))
        self.last_used.zero_()

    # ----- per forward ---------------------------------------------------
    def _begin(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        fb: ForwardBatch = args[0]
        self.mode = self.path_for(int(fb.input_ids.shape[0]), fb.is_decode)
        if self.mode != "stream":
            return
        if self.on_cuda:
            # The copy stream starts after everything already queued (earlier
            # steps' admissions and buffer reads): an event, not a host wait.
            self.copy_stream.wait_stream(torch.cuda.current_stream())
        for j in range(min(2, self.num_layers)):
            self._stream_layer(j)

    def _stream_layer(self, j: int) -> None:
        """Plan layer j into buffer j % 2 and copy its uncached experts (copy stream)."""
        b = j % 2
        e = self.num_experts
        if not self.on_cuda:
            bk.invalidate_slots_ref(self.pslot_of_id, self.pid_of_slot, b * e, (b + 1) * e)
            plan_layer_ref(self.slot_of_id, self.pslot_of_id, self.pid_of_slot,
                           self.plan_src[b], self.plan_dst[b], j, b, self.buf_base)
            fill_rows_ref(self.bank.data, self.slots, self.plan_src[b], self.plan_dst[b])
            self._count(2, (self.plan_src[b] >= 0).sum())
            return
        with torch.cuda.stream(self.copy_stream):
            if j >= 2:
                self.copy_stream.wait_event(self.done[b])  # layer j-2 finished reading buffer b
            bk.invalidate_slots(self.pslot_of_id, self.pid_of_slot, b * e, (b + 1) * e)
            plan_layer(self.slot_of_id, self.pslot_of_id, self.pid_of_slot,
                       self.plan_src[b], self.plan_dst[b], j, b, self.buf_base)
            fill_rows(self.bank.data, self.slots, self.plan_src[b], self.plan_dst[b], bank_checked=True)
            self._count(2, (self.plan_src[b] >= 0).sum())
            self.ready[b].record(self.copy_stream)

    # ----- per MoE layer -------------------------------------------------
    def _compute(self, j: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        e = self.num_experts
        if self.mode == "full":
            return self._moe(x, weights, ids, self.slot_of_id[j * e:(j + 1) * e])
        if self.mode == "admit":
            self._admit(j, ids)
            return self._moe(x, weights, ids, self.slot_of_id[j * e:(j + 1) * e])
        b = j % 2
        if self.on_cuda:
            torch.cuda.current_stream().wait_event(self.ready[b])
        out = self._moe(x, weights, ids, self.pslot_of_id[j * e:(j + 1) * e])
        if self.on_cuda:
            self.done[b].record(torch.cuda.current_stream())
        if j + 2 < self.num_layers:
            self._stream_layer(j + 2)
        return out

    def _admit(self, j: int, ids: torch.Tensor) -> None:
        e = self.num_experts
        flat = ids.reshape(-1)  # [T*k] int32
        sel = torch.zeros(e, dtype=torch.int32, device=ids.device)
        sel.scatter_(0, flat.long(), 1)  # [E] 1 = selected by some token
        if flat.numel() <= e:
            needed = flat + j * e  # [T*k], repeats allowed: the kernel dedups
        else:
            needed = torch.where(sel > 0, self.ar_e + j * e, -1)  # [E]
        admit = bk.admit_experts if self.on_cuda else bk.admit_experts_ref
        _, miss_slot, miss_id = admit(needed, self.slot_of_id, self.id_of_slot, self.last_used, self.step)
        if self.on_cuda:
            fill_rows(self.bank.data, self.slots, miss_id, miss_slot, bank_checked=True)
        else:
            fill_rows_ref(self.bank.data, self.slots, miss_id, miss_slot)
        self._count(0, sel.sum())
        self._count(1, (miss_id >= 0).sum())

    def _count(self, which: int, n: torch.Tensor) -> None:
        if self.track_stats:
            self.counters[which] += n  # a 0-d device add: no host read

    def _moe(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
             expert_map: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from ftserve_kernels.moe_triton import fused_moe_triton

            return fused_moe_triton(x, self.w13, self.w2, weights, ids, expert_map=expert_map)
        slot_ids = expert_map.index_select(0, ids.reshape(-1).long()).view_as(ids)  # [T, k]
        return fused_moe_ref(x, self.w13, self.w2, weights, slot_ids)  # [T, H]

    # ----- reporting (host reads: tests and benchmarks only) ---------------
    def stats(self) -> dict[str, float]:
        lookups, misses, streamed = (int(v) for v in self.counters.tolist())
        return {
            "lookups": lookups, "misses": misses,
            "hit_rate": 1.0 - misses / lookups if lookups else float("nan"),
            "experts_streamed": streamed,
            "bytes_streamed": streamed * self.bank.row_bytes,
            "bytes_missed": misses * self.bank.row_bytes,
        }

    def reset_stats(self) -> None:
        self.counters.zero_()

    def summary(self) -> dict[str, Any]:
        rb = self.bank.row_bytes
        return {
            "mode": "full" if self.full else "lru+stream",
            "slots": self.num_slots, "experts": self.total,
            "slot_fraction": self.num_slots / self.total,
            "slot_gib": self.num_slots * rb / 2**30,
            "buffer_gib": (0 if self.full else 2 * self.num_experts) * rb / 2**30,
            "host_gib": self.bank.nbytes / 2**30, "expert_bytes": rb,
        }
