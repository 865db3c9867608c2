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
             At GEMV sizes (T <= GEMV_MAX_TOKENS, on CUDA) there is no
             fill kernel: the expert GEMVs read the misses from the bank over
             UVA themselves and write the slots as they go, so the compute runs
             while the bytes arrive instead of after them.
             All device-side and fixed-shape, so it is captured in the decode graph.
- ``stream`` prefill: whole layers stream into two layer buffers on a copy
             stream by DMA, overlapping the compute (``LayerStreamer``,
             stream.py); experts already in the LRU cache are used in place.

Device maps (fixed shapes, ``-1`` = none, last entry of each *_of_id = sink)::

    slot_of_id  [Lm*E + 1] int32   LRU cache: id -> slot in [0, N)
    id_of_slot  [N] int32, last_used [N] int64, step [1] int64
    counters    [4] int64          distinct lookups, misses (admit); experts
                                   streamed, experts not cached (stream)

Nothing here reads a device value on the host.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ftserve.models.forward_batch import ForwardBatch
from ftserve.moe.banks import HostBank, moe_blocks
from ftserve.moe.kernels import (
    check_bank,
    count_valid,
    count_valid_ref,
    fill_rows,
    fill_rows_ref,
    needed_ids,
    needed_ids_ref,
)
from ftserve.moe.stream import LayerStreamer
from ftserve_kernels import bookkeeping as bk
from ftserve_kernels.config import KernelConfig
from ftserve_kernels.fp8_quant import Fp8Weight
from ftserve_kernels.moe import fused_moe_ref

if TYPE_CHECKING:
    from ftserve_kernels.moe_read_through import ReadThrough

LOOKUPS, MISSES, STREAMED, UNCACHED = range(4)  # counters (plan_layer: 2, 3)


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
        self.slots = torch.empty(rows, bank.row_elems, dtype=bank.data.dtype, device=device)  # [S, R]
        # [S, 2I, H] / [S, H, I] views, row stride R (fp8 banks: codes + scales, Fp8Weight)
        self.w13, self.w2 = bank.expert_views(self.slots)
        self.slot_of_id, self.id_of_slot, self.last_used, self.step = bk.new_slot_maps(
            self.total, n, device)
        self.counters = torch.zeros(4, dtype=torch.int64, device=device)
        self.track_stats = track_stats
        self.mode = "full" if self.full else "admit"
        self.streamer: LayerStreamer | None = None
        if self.on_cuda:
            check_bank(bank.data)
        if not self.full:
            self.streamer = LayerStreamer(bank, self.slots, self.slot_of_id, self.counters, n, device,
                                          track_stats)
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
        for t in (self.slot_of_id, self.id_of_slot, self.last_used):
            t.fill_(-1)
        self.step.zero_()
        if self.streamer is not None:
            self.streamer.reset()
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
        t = int(fb.input_ids.shape[0])
        self.mode = self.path_for(t, fb.is_decode)
        if self.mode == "stream":
            assert self.streamer is not None
            self.streamer.begin()

    # ----- per MoE layer -------------------------------------------------
    def _compute(self, j: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 kernels: KernelConfig) -> torch.Tensor:
        e = self.num_experts
        if self.mode == "full":
            return self._moe(x, weights, ids, self.slot_of_id[j * e:(j + 1) * e], kernels)
        if self.mode == "admit":
            rt = self._read_through(j, ids) if self.on_cuda else None
            if rt is None:
                self._admit(j, ids)
            return self._moe(x, weights, ids, self.slot_of_id[j * e:(j + 1) * e], kernels, rt)
        assert self.streamer is not None
        out = self._moe(x, weights, ids, self.streamer.layer_map(j), kernels)
        self.streamer.layer_done(j)
        return out

    def _admission(self, j: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Admit layer j's experts of ids [T, k]; returns the fill list (miss_slot, miss_id)."""
        e = self.num_experts
        m = ids.numel() if ids.numel() <= e else e
        ids = ids.contiguous()  # [T, k] int32, read flat by the kernel
        needed = torch.empty(m, dtype=torch.int32, device=ids.device)  # [M]
        li = LOOKUPS if self.track_stats else -1
        if self.on_cuda:
            needed_ids(ids, needed, self.counters, j, e, li)
            _, miss_slot, miss_id = bk.admit_experts(needed, self.slot_of_id, self.id_of_slot,
                                                     self.last_used, self.step)
            if self.track_stats:
                count_valid(miss_id, self.counters, MISSES)
        else:
            needed_ids_ref(ids, needed, self.counters, j, e, li)
            _, miss_slot, miss_id = bk.admit_experts_ref(needed, self.slot_of_id, self.id_of_slot,
                                                         self.last_used, self.step)
            if self.track_stats:
                count_valid_ref(miss_id, self.counters, MISSES)
        return miss_slot, miss_id

    def _read_through(self, j: int, ids: torch.Tensor) -> ReadThrough | None:
        """Admit layer j's experts of ids [T, k] without filling: the expert GEMVs
        read the misses from the bank (module doc). None at grouped-GEMM sizes."""
        # Imported here: CPU tests pick Triton's interpreter before kernels load.
        from ftserve_kernels.moe_gemv_triton import GEMV_MAX_TOKENS
        from ftserve_kernels.moe_read_through import ReadThrough

        if ids.shape[0] > GEMV_MAX_TOKENS:
            return None
        miss_slot, miss_id = self._admission(j, ids)
        i, h = self.bank.inter, self.bank.hidden
        if self.bank.fp8 is not None:
            from ftserve_kernels.fp8_moe_gemv_triton import Fp8ReadThrough

            row = self.bank.fp8  # slot row: [w13 codes | w2 codes | w13 scales | w2 scales]
            return Fp8ReadThrough(self.bank.data, miss_slot, miss_id, row.row_bytes, 0, row.w2_col,  # type: ignore[return-value]
                                  row.w13_scale_col, row.w2_scale_col)
        return ReadThrough(self.bank.data, miss_slot, miss_id, 0, 2 * i * h)  # slot row: [w13 | w2]

    def _admit(self, j: int, ids: torch.Tensor) -> None:
        miss_slot, miss_id = self._admission(j, ids)
        if self.on_cuda:
            fill_rows(self.bank.data, self.slots, miss_id, miss_slot, bank_checked=True)
        else:
            fill_rows_ref(self.bank.data, self.slots, miss_id, miss_slot)

    def _count(self, which: int, n: torch.Tensor | int) -> None:
        if self.track_stats:
            self.counters[which] += n  # a 0-d device add: no host read

    def _moe(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
             expert_map: torch.Tensor, kernels: KernelConfig, rt: ReadThrough | None = None) -> torch.Tensor:
        if isinstance(self.w13, Fp8Weight) and isinstance(self.w2, Fp8Weight):  # an fp8 bank's slots
            from ftserve_kernels import fp8_ops

            # Triton on CUDA, the twin elsewhere, as the bf16 path below picks.
            return fp8_ops.fused_moe(kernels, x, self.w13, self.w2, weights, ids, expert_map=expert_map,
                                     read_through=rt, triton=x.is_cuda)
        assert isinstance(self.w13, torch.Tensor) and isinstance(self.w2, torch.Tensor)
        if rt is not None:
            from ftserve_kernels.moe_gemv_triton import fused_moe_gemv_triton

            return fused_moe_gemv_triton(x, self.w13, self.w2, weights, ids, expert_map, read_through=rt,
                                         kernels=kernels)
        if x.is_cuda:
            from ftserve_kernels.moe_triton import fused_moe_triton

            return fused_moe_triton(x, self.w13, self.w2, weights, ids, expert_map=expert_map,
                                    kernels=kernels)
        slot_ids = expert_map.index_select(0, ids.reshape(-1).long()).view_as(ids)  # [T, k]
        return fused_moe_ref(x, self.w13, self.w2, weights, slot_ids)  # [T, H]

    # ----- reporting (host reads: tests and benchmarks only) ---------------
    def stats(self) -> dict[str, float]:
        lookups, misses, streamed, uncached = (int(v) for v in self.counters.tolist())
        rb = self.bank.row_bytes
        return {
            "lookups": lookups, "misses": misses,
            "hit_rate": 1.0 - misses / lookups if lookups else float("nan"),
            "experts_streamed": streamed, "experts_uncached": uncached,
            "bytes_streamed": streamed * rb,
            "bytes_missed": misses * rb,  # everything decode moved over PCIe
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

