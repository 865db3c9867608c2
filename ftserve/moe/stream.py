"""Prefill streaming of the expert cache: whole MoE layers into two layer
buffers on a copy stream, layer j+1 copying while layer j computes, ordered by
events only (no host waits)::

    copy   : copy+plan L0->b0 | L1->b1 | (wait done0) L2->b0 | (wait done1) L3->b1
    compute:   (wait ready0) L0 | (wait ready1) L1 | (wait ready0) L2 | ...

The copies are cudaMemcpyAsync of contiguous runs of bank rows: copy engines,
no SMs. That is what lets the two streams overlap: an SM-driven copy of a whole
layer (the UVA ``fill_rows`` kernel, ~18k blocks) holds every SM for the
length of the copy and serializes with the attention kernels beside it.

The host cannot see the LRU cache (decode admits on the device), so it picks
the runs from a snapshot of the LRU map taken one streamed forward earlier: an
async D2H copy, adopted only once its event has completed (``query``, never a
wait). Experts the snapshot calls cached are skipped; ``plan_layer`` on the
device maps the truly cached ones in place (no copy at all) and UVA-fills the
few the snapshot got wrong (evicted since), normally none. An expert admitted
since the snapshot is copied anyway: wasted bytes, still correct.

Reusing buffer b first unmaps what pointed into it: one fixed-shape scatter
through the prefill map's sink (``invalidate_slots``), never a boolean index.

Device maps (fixed shapes, ``-1`` = none)::

    pslot_of_id [Lm*E + 1] int32   id -> slot (LRU slot or buffer row); last = sink
    pid_of_slot [2E] int32         buffer row -> id
"""

from __future__ import annotations

from typing import Any

import torch

from ftserve.moe.banks import HostBank
from ftserve.moe.kernels import fill_rows, fill_rows_ref, host_runs, plan_layer, plan_layer_ref
from ftserve_kernels import bookkeeping as bk

STREAMED = 2  # ExpertCache.counters index: experts copied for prefill


class LayerStreamer:
    def __init__(self, bank: HostBank, slots: torch.Tensor, slot_of_id: torch.Tensor,
                 counters: torch.Tensor, buf_base: int, device: torch.device, track_stats: bool) -> None:
        self.bank = bank
        self.slots = slots  # [S, R]: LRU slots, then buffer 0 and buffer 1 from row buf_base
        self.slot_of_id = slot_of_id  # the LRU map (read only here)
        self.counters = counters
        self.buf_base = buf_base
        self.device = device
        self.on_cuda = device.type == "cuda"
        self.track_stats = track_stats
        self.num_layers = lm = bank.num_layers
        self.num_experts = e = bank.num_experts
        total = lm * e
        self.pslot_of_id = torch.full((total + 1,), -1, dtype=torch.int32, device=device)
        self.pid_of_slot = torch.full((2 * e,), -1, dtype=torch.int32, device=device)
        self.plan_src = torch.full((2, e), -1, dtype=torch.int32, device=device)  # per buffer
        self.plan_dst = torch.full((2, e), -1, dtype=torch.int32, device=device)
        # Host view of the LRU map ([Lm][E], True = cached) and its snapshot.
        self.host_cached = [[False] * e for _ in range(lm)]
        self.snap = torch.full((total,), -1, dtype=torch.int32, pin_memory=self.on_cuda)
        self.snap_event: Any = None
        self.snap_pending = False
        self.dma = torch.zeros(lm, e, dtype=torch.int32, device=device)  # [Lm, E] 1 = the host copies it
        self.runs: list[list[tuple[int, int]]] = [[] for _ in range(lm)]
        if self.on_cuda:
            self.copy_stream = torch.cuda.Stream(device)
            self.ready = [torch.cuda.Event(), torch.cuda.Event()]
            self.done = [torch.cuda.Event(), torch.cuda.Event()]

    def reset(self) -> None:
        self.pslot_of_id.fill_(-1)
        self.pid_of_slot.fill_(-1)
        self.host_cached = [[False] * self.num_experts for _ in range(self.num_layers)]

    # ----- per forward ---------------------------------------------------
    def begin(self) -> None:
        """Plan the forward on the host and start layers 0 and 1."""
        if self.on_cuda:
            # The copy stream starts after everything already queued (earlier
            # steps' admissions and buffer reads): an event, not a host wait.
            self.copy_stream.wait_stream(torch.cuda.current_stream())
        self.plan()
        for j in range(min(2, self.num_layers)):
            self.stream_layer(j)

    def layer_map(self, j: int) -> torch.Tensor:
        """Layer j's expert -> slot map [E], once its buffer is ready (compute stream)."""
        if self.on_cuda:
            torch.cuda.current_stream().wait_event(self.ready[j % 2])
        e = self.num_experts
        return self.pslot_of_id[j * e:(j + 1) * e]

    def layer_done(self, j: int) -> None:
        """Layer j's MoE is queued: its buffer may be refilled with layer j+2 after it."""
        if self.on_cuda:
            self.done[j % 2].record(torch.cuda.current_stream())
        if j + 2 < self.num_layers:
            self.stream_layer(j + 2)

    def refresh_host_view(self) -> None:
        """Adopt the last snapshot if its copy has completed (query, never wait)."""
        if self.snap_pending and (self.snap_event is None or self.snap_event.query()):
            self.host_cached = (self.snap.view(self.num_layers, self.num_experts) >= 0).tolist()
            self.snap_pending = False

    def plan(self) -> None:
        """Host plan of one streamed forward: DMA runs per layer, the device copy
        of the plan, and a new snapshot of the LRU map for the next forward."""
        self.refresh_host_view()
        copy = [[not c for c in row] for row in self.host_cached]  # [Lm][E]
        self.runs = [host_runs(row) for row in copy]
        n_dma = sum(z - a for runs in self.runs for a, z in runs)
        dma = torch.tensor(copy, dtype=torch.int32)  # [Lm, E] host
        if not self.on_cuda:
            self.dma = dma
            self.snap.copy_(self.slot_of_id[:-1])  # same one-forward staleness as on CUDA
            self.snap_pending = True
            self._count(n_dma)
            return
        with torch.cuda.stream(self.copy_stream):
            # Pinned staging from the caching host allocator: reused only after this copy ran.
            self.dma = dma.pin_memory().to(self.device, non_blocking=True)
            if not self.snap_pending:
                self.snap.copy_(self.slot_of_id[:-1], non_blocking=True)  # 4 bytes per expert
                self.snap_event = torch.cuda.Event()
                self.snap_event.record(self.copy_stream)
                self.snap_pending = True
            self._count(n_dma)

    def stream_layer(self, j: int) -> None:
        """Copy layer j's uncached experts into buffer j % 2 and plan it (copy stream)."""
        b = j % 2
        e = self.num_experts
        lo = self.buf_base + b * e  # buffer b's first slot row
        if not self.on_cuda:
            for a, z in self.runs[j]:
                self.slots[lo + a:lo + z].copy_(self.bank.data[j * e + a:j * e + z])
            bk.invalidate_slots_ref(self.pslot_of_id, self.pid_of_slot, b * e, (b + 1) * e)
            plan_layer_ref(self.slot_of_id, self.pslot_of_id, self.pid_of_slot, self.plan_src[b],
                           self.plan_dst[b], self.dma[j], self.counters, j, b, self.buf_base)
            fill_rows_ref(self.bank.data, self.slots, self.plan_src[b], self.plan_dst[b])
            return
        with torch.cuda.stream(self.copy_stream):
            if j >= 2:
                self.copy_stream.wait_event(self.done[b])  # layer j-2 finished reading buffer b
            # The copies first: they depend on host data only, so the copy engines
            # start the moment buffer b is free, not after the plan kernel found an
            # SM between long attention blocks.
            for a, z in self.runs[j]:
                # [z-a, R] contiguous pinned rows -> contiguous slot rows: one cudaMemcpyAsync
                self.slots[lo + a:lo + z].copy_(self.bank.data[j * e + a:j * e + z], non_blocking=True)
            bk.invalidate_slots(self.pslot_of_id, self.pid_of_slot, b * e, (b + 1) * e)
            plan_layer(self.slot_of_id, self.pslot_of_id, self.pid_of_slot, self.plan_src[b],
                       self.plan_dst[b], self.dma[j], self.counters, j, b, self.buf_base)
            # Experts the snapshot wrongly called cached (normally none: no-op programs).
            fill_rows(self.bank.data, self.slots, self.plan_src[b], self.plan_dst[b], bank_checked=True)
            self.ready[b].record(self.copy_stream)

    def _count(self, n: int) -> None:
        if self.track_stats:
            self.counters[STREAMED] += n  # a device add of a host int: no read
