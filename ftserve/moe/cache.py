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
             At GEMV sizes (T <= GEMV_MAX_TOKENS, ``read_through``) there is no
             fill kernel: the expert GEMVs read the misses from the bank over
             UVA themselves and write the slots as they go, so the compute runs
             while the bytes arrive instead of after them.
             All device-side and fixed-shape, so it is captured in the decode graph.
             Decode also prefetches (see prefetch below).
- ``stream`` prefill: whole layers stream into two layer buffers on a copy
             stream by DMA, overlapping the compute (``LayerStreamer``,
             stream.py); experts already in the LRU cache are used in place.

Decode prefetch: layer j's MoE input, put through layer j+1's router, predicts
layer j+1's experts (the residual stream changes little per layer). Right after
layer j's own admission, the prediction is admitted too (LRU order keeps both
sets: it needs N >= 2M slots for M = one call's list, else prefetch is off for
that batch size) and filled on a side stream, so layer j+1's copies overlap
layer j's MoE and layer j+1's attention; layer j+1's admission then mostly hits,
and its MoE waits on the side stream's event. Every copy counts in the stats.
Only for small batches (``prefetch_max_tokens``): large ones are copy-bound.

Device maps (fixed shapes, ``-1`` = none, last entry of each *_of_id = sink)::

    slot_of_id  [Lm*E + 1] int32   LRU cache: id -> slot in [0, N)
    id_of_slot  [N] int32, last_used [N] int64, step [1] int64
    counters    [5] int64          distinct lookups, misses (admit); experts
                                   streamed, experts not cached (stream);
                                   experts prefetched (decode, all copied)

Nothing here reads a device value on the host.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ftserve import envs
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
from ftserve_kernels.fp8_quant import Fp8Weight
from ftserve_kernels.moe import fused_moe_ref

if TYPE_CHECKING:
    from ftserve_kernels.moe_read_through import ReadThrough

LOOKUPS, MISSES, STREAMED, UNCACHED, PREFETCHED = range(5)  # counters (plan_layer: 2, 3)


class ExpertCache:
    PREFETCH_FILL_PROGRAMS = 16
    def __init__(self, model: nn.Module, bank: HostBank, num_slots: int, top_k: int,
                 device: torch.device, track_stats: bool = True, prefetch: bool = False) -> None:
        # prefetch defaults off: on the H200 (2026-11-30 03:15, qwen3-30b-a3b x 8, 25%
        # cache, the same tokens both ways) batch-1 decode ran at 192 tok/s without it
        # and 97 with it: wrong guesses doubled the copies (51 vs 23 per step), and the
        # SM-driven copy beside compute slows the compute (BENCHMARKS.md).
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
        self.counters = torch.zeros(5, dtype=torch.int64, device=device)
        self.track_stats = track_stats
        self.prefetch = prefetch
        self.read_through = envs.moe_read_through()
        # The prefetch fill runs on a side stream beside the layer's compute: a
        # capped grid leaves it most SMs (uncapped, ~290 programs per expert row
        # queue ahead of the compute kernels and serialize the two streams).
        self.prefetch_fill_programs: int | None = self.PREFETCH_FILL_PROGRAMS
        # A wrong guess costs a whole copy, and only compute can hide behind the
        # right ones: worth it while a layer's copies are comparable to its compute
        # (few tokens); a large batch is copy-bound, where guesses only add bytes.
        self.prefetch_max_tokens = max(1, e // (4 * top_k))
        self.mode = "full" if self.full else "admit"
        self._pf_on = False
        self._pf_wait: dict[int, Any] = {}  # layer -> (event, tensors kept alive until the wait)
        self.streamer: LayerStreamer | None = None
        if self.on_cuda:
            check_bank(bank.data)
            self.pf_stream = torch.cuda.Stream(device)
        if not self.full:
            self.streamer = LayerStreamer(bank, self.slots, self.slot_of_id, self.counters, n, device,
                                          track_stats)
        self.blocks = moe_blocks(model)
        assert len(self.blocks) == self.num_layers
        for j, blk in enumerate(self.blocks):
            blk.expert_compute = functools.partial(self._compute, j)
        self._hook = model.register_forward_pre_hook(self._begin)
        model.register_forward_hook(self._end)
        # Router-input norms of the MoE layers, for the prefetch guesses (None: a
        # model without the usual decoder layout guesses from the raw MoE input).
        self._norms = _router_norms(model, self.blocks)
        self._inv_w: list[torch.Tensor | None] = [None] * self.num_layers
        embed = getattr(model, "embed_tokens", None)
        if self._norms is not None and isinstance(embed, nn.Module):
            embed.register_forward_hook(self._after_embed)  # guesses layer 0 from the embeddings
        self._refresh_norms()
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

    def prefetches(self, num_tokens: int, is_decode: bool) -> bool:
        """Decode prefetch needs room for two admission lists at once (module doc)."""
        return (self.prefetch and is_decode and self.num_layers > 1
                and num_tokens <= self.prefetch_max_tokens
                and self.path_for(num_tokens, is_decode) == "admit"
                and 2 * self.max_admit(num_tokens) <= self.num_slots)

    @torch.no_grad()
    def reset(self) -> None:
        """Forget every slot (after the bank's contents changed); full mode refills."""
        for t in (self.slot_of_id, self.id_of_slot, self.last_used):
            t.fill_(-1)
        self.step.zero_()
        if self.streamer is not None:
            self.streamer.reset()
        self._refresh_norms()
        if self.full:
            self._fill_all()

    @torch.no_grad()
    def _refresh_norms(self) -> None:
        """inv_w[j] = 1 / w[j] of layer j's router-input norm: layer j's MoE input
        rms(h) * w[j] times it is rms(h), which layer j+1's norm + router then
        treat as if the residual stream had not moved. None where w[j] is all
        ones (start-up / reset only: these host reads are outside the step path)."""
        if self._norms is None:
            return
        for j in range(self.num_layers - 1):
            w = self._norms[j].weight  # [H]
            ones = bool((w == 1).all())
            self._inv_w[j] = None if ones else torch.where(w != 0, 1.0 / w.float(), 0.0).to(w.dtype)

    def _guess(self, j: int, h: torch.Tensor) -> torch.Tensor:
        """Layer j's experts [T, k] for a residual-stream-like h [T, H]: its own
        norm + router (one fused launch at decode sizes)."""
        if self._norms is None:
            return self.blocks[j].route(h)[1]
        return self.blocks[j].norm_route(h, None, self._norms[j])[3]

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
        self._pf_on = self.prefetches(t, fb.is_decode)
        self._pf_wait.clear()
        if self.mode == "stream":
            assert self.streamer is not None
            self.streamer.begin()

    def _end(self, module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        # Every prefetch was joined by its layer; an embedding lookup outside a
        # forward (tests, tools) must not start one.
        assert not self._pf_wait, f"prefetches of layers {list(self._pf_wait)} never joined"
        self._pf_on = False

    def _after_embed(self, module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
        """Decode prefetch of the first MoE layer: its router over the normed
        embeddings [T, H], so the copies overlap the first attention."""
        if self._pf_on and self.mode == "admit" and self._norms is not None:
            self._prefetch(0, self._guess(0, out))

    # ----- per MoE layer -------------------------------------------------
    def _compute(self, j: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        e = self.num_experts
        if self.mode == "full":
            return self._moe(x, weights, ids, self.slot_of_id[j * e:(j + 1) * e])
        if self.mode == "admit":
            pred = None
            if self._pf_on and j + 1 < self.num_layers:
                inv = self._inv_w[j]
                pred = self._guess(j + 1, x if inv is None else x * inv)  # [T, k] layer j+1's guess
            rt = self._read_through(j, ids) if self.on_cuda and self.read_through else None
            if rt is None:
                self._admit(j, ids, LOOKUPS, MISSES)
            if pred is not None:
                self._prefetch(j + 1, pred)
            if j in self._pf_wait:
                ev, _held = self._pf_wait.pop(j)  # the side stream filled this layer's prefetch
                torch.cuda.current_stream().wait_event(ev)
            return self._moe(x, weights, ids, self.slot_of_id[j * e:(j + 1) * e], rt)
        assert self.streamer is not None
        out = self._moe(x, weights, ids, self.streamer.layer_map(j))
        self.streamer.layer_done(j)
        return out

    def _admission(self, j: int, ids: torch.Tensor, lookup_idx: int,
                   miss_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Admit layer j's experts of ids [T, k]; returns the fill list (miss_slot, miss_id)."""
        e = self.num_experts
        m = ids.numel() if ids.numel() <= e else e
        ids = ids.contiguous()  # [T, k] int32, read flat by the kernel
        needed = torch.empty(m, dtype=torch.int32, device=ids.device)  # [M]
        li = lookup_idx if self.track_stats else -1
        if self.on_cuda:
            needed_ids(ids, needed, self.counters, j, e, li)
            _, miss_slot, miss_id = bk.admit_experts(needed, self.slot_of_id, self.id_of_slot,
                                                     self.last_used, self.step)
            if self.track_stats:
                count_valid(miss_id, self.counters, miss_idx)
        else:
            needed_ids_ref(ids, needed, self.counters, j, e, li)
            _, miss_slot, miss_id = bk.admit_experts_ref(needed, self.slot_of_id, self.id_of_slot,
                                                         self.last_used, self.step)
            if self.track_stats:
                count_valid_ref(miss_id, self.counters, miss_idx)
        return miss_slot, miss_id

    def _read_through(self, j: int, ids: torch.Tensor) -> ReadThrough | None:
        """Admit layer j's experts of ids [T, k] without filling: the expert GEMVs
        read the misses from the bank (module doc). None at grouped-GEMM sizes."""
        # Imported here: CPU tests pick Triton's interpreter before kernels load.
        from ftserve_kernels.moe_gemv_triton import GEMV_MAX_TOKENS
        from ftserve_kernels.moe_read_through import ReadThrough

        if ids.shape[0] > GEMV_MAX_TOKENS:
            return None
        miss_slot, miss_id = self._admission(j, ids, LOOKUPS, MISSES)
        i, h = self.bank.inter, self.bank.hidden
        if self.bank.fp8 is not None:
            from ftserve_kernels.fp8_moe_gemv_triton import Fp8ReadThrough

            row = self.bank.fp8  # slot row: [w13 codes | w2 codes | w13 scales | w2 scales]
            return Fp8ReadThrough(self.bank.data, miss_slot, miss_id, row.row_bytes, 0, row.w2_col,  # type: ignore[return-value]
                                  row.w13_scale_col, row.w2_scale_col)
        return ReadThrough(self.bank.data, miss_slot, miss_id, 0, 2 * i * h)  # slot row: [w13 | w2]

    def _admit(self, j: int, ids: torch.Tensor, lookup_idx: int = LOOKUPS, miss_idx: int = MISSES) -> None:
        miss_slot, miss_id = self._admission(j, ids, lookup_idx, miss_idx)
        if self.on_cuda:
            fill_rows(self.bank.data, self.slots, miss_id, miss_slot, bank_checked=True)
        else:
            fill_rows_ref(self.bank.data, self.slots, miss_id, miss_slot)

    def _prefetch(self, j: int, pred: torch.Tensor) -> None:
        """Admit layer j's predicted experts now; fill them on the side stream."""
        miss_slot, miss_id = self._admission(j, pred, -1, PREFETCHED)
        if not self.on_cuda:
            fill_rows_ref(self.bank.data, self.slots, miss_id, miss_slot)
            return
        main = torch.cuda.current_stream()
        self.pf_stream.wait_stream(main)  # after this admission (and everything before it)
        with torch.cuda.stream(self.pf_stream):
            fill_rows(self.bank.data, self.slots, miss_id, miss_slot, bank_checked=True,
                      max_programs=self.prefetch_fill_programs)
            ev = torch.cuda.Event()
            ev.record(self.pf_stream)
        # miss_* were allocated on the main stream: keep them alive until main waits
        # on ev, so the allocator cannot hand their memory out while the fill reads it.
        self._pf_wait[j] = (ev, (miss_id, miss_slot))

    def _count(self, which: int, n: torch.Tensor | int) -> None:
        if self.track_stats:
            self.counters[which] += n  # a 0-d device add: no host read

    def _moe(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
             expert_map: torch.Tensor, rt: ReadThrough | None = None) -> torch.Tensor:
        if isinstance(self.w13, Fp8Weight) and isinstance(self.w2, Fp8Weight):  # an fp8 bank's slots
            from ftserve_kernels import fp8_ops, pdl

            return fp8_ops.fused_moe(x, self.w13, self.w2, weights, ids, x.is_cuda, expert_map=expert_map,
                                     read_through=rt, pdl_mode=pdl.active(x))
        assert isinstance(self.w13, torch.Tensor) and isinstance(self.w2, torch.Tensor)
        if rt is not None:
            from ftserve_kernels.moe_gemv_triton import fused_moe_gemv_triton

            return fused_moe_gemv_triton(x, self.w13, self.w2, weights, ids, expert_map, read_through=rt)
        if x.is_cuda:
            from ftserve_kernels.moe_triton import fused_moe_triton

            return fused_moe_triton(x, self.w13, self.w2, weights, ids, expert_map=expert_map)
        slot_ids = expert_map.index_select(0, ids.reshape(-1).long()).view_as(ids)  # [T, k]
        return fused_moe_ref(x, self.w13, self.w2, weights, slot_ids)  # [T, H]

    # ----- reporting (host reads: tests and benchmarks only) ---------------
    def stats(self) -> dict[str, float]:
        lookups, misses, streamed, uncached, prefetched = (int(v) for v in self.counters.tolist())
        rb = self.bank.row_bytes
        return {
            "lookups": lookups, "misses": misses, "prefetched": prefetched,
            "hit_rate": 1.0 - misses / lookups if lookups else float("nan"),
            "experts_streamed": streamed, "experts_uncached": uncached,
            "bytes_streamed": streamed * rb,
            "bytes_missed": misses * rb,
            # Everything decode moved over PCIe: demand misses and prefetches.
            "bytes_copied_decode": (misses + prefetched) * rb,
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


def _router_norms(model: nn.Module, blocks: list[Any]) -> list[nn.Module] | None:
    """The norm that feeds each MoE block's router (its decoder layer's
    post_attention_layernorm), in block order; None if the layout differs."""
    owner = {id(getattr(m, "mlp", None)): m for m in model.modules()}
    norms = [getattr(owner.get(id(b)), "post_attention_layernorm", None) for b in blocks]
    return norms if all(isinstance(n, nn.Module) for n in norms) else None
