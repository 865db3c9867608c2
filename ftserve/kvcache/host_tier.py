"""Host tier of the KV cache: pinned host pages that keep evicted prefixes.

Same per-layer page layout as ``KVPool`` (page 0 is a dummy here too, so the
same ``PageAllocator`` hands out host pages 1..N)::

    device KVPool.k [L, dev_pages * ps, Hkv, D]   <-- load (host -> device)
    host   tier.k   [L, host_pages * ps, Hkv, D]  --> offload (device -> host)

The radix cache decides WHAT moves (it owns the host page ids through its
host-tier nodes); this class only records the moves the scheduler planned and
performs them in planning order at ``flush()``, which the runner calls right
before it launches the step that may read or overwrite the pages involved.

Ordering on CUDA, without a single host wait::

    compute stream:  ... step N ...  rec(e1)          wait(e2) step N+1 ...
    copy stream:                      wait(e1) copies rec(e2)

- e1: an offload reads device pages only after every earlier step wrote them.
- e2: step N+1 may reuse a just-freed device page (the offload already read
  it) and reads just-loaded pages only after the load wrote them.
- All moves run on one stream in planning order, so a host page freed by a
  load and handed to a later offload in the same plan is read before it is
  overwritten. The host CPU itself never touches the pages.

Each direction's run of moves is a fixed-shape launch of ``copy_kv_pages``
over padded page lists (-1 = skip, padded to a power of two so the shapes seen
stay few), planned on the host from host-side metadata and uploaded with one
non-blocking copy (plus one for the scales of an fp8 pool: a page is its codes
and its scales, and both always move together).

Two ways to flush:

- ``flush()``: every layer in one launch per run; the step waits for all of it
  (e2 above). Before a replayed CUDA graph, which cannot wait mid-way.
- ``flush(layered=True)``: one launch per (layer, run), an event after each
  layer; the step's layer L waits only for event L before it touches layer L's
  pages (``ForwardBatch.layer_ready``), so a restore streams in under the
  compute of the layers before it::

    copy stream:     L0 | L1 | L2 | ...          (one restore, layer by layer)
    compute stream:  .. layer 0 | layer 1 | ...  (layer L waits for event L)

  Offloads in the same plan are split by layer too: layer L of a freed device
  page is read before layer L of the step may overwrite it. The default for an
  eager step that restores host pages: on the H200 a 114k-token restore cost
  18 ms of TTFT this way vs 39 ms batched (BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ftserve.kvcache.allocator import PageAllocator
from ftserve.kvcache.pool import KVPool


@dataclass
class _Run:
    """Consecutive moves in one direction: page src[i] -> page dst[i], every layer."""

    to_host: bool
    src: list[int]
    dst: list[int]


@dataclass
class HostTierCounters:
    pages_offloaded_total: int = 0  # device -> host
    pages_loaded_total: int = 0  # host -> device
    copy_launches_total: int = 0
    layered_flushes_total: int = 0  # flushes that returned per-layer events


class HostKVTier:
    """Host pages in the device pool's layout, a host page allocator, and the
    queue of planned page moves (see the module docstring)."""

    # Programs along the page axis of a layered copy (x 2 for K/V, x the chunks
    # of a page): the copy shares the GPU with the step's kernels, so it gets a
    # few dozen long programs, not one short program per page (which measured
    # slower than no overlap at all on the H200; a pinned-memory read stream of
    # ~50 GB/s needs far fewer SMs than that).
    LAYERED_COPY_PROGRAMS = 16

    def __init__(self, pool: KVPool, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"the host tier needs at least 1 page, got {num_pages}")
        self.pool = pool
        self.page_size = pool.page_size
        self.device = pool.device
        self.on_cuda = self.device.type == "cuda"
        shape = (pool.num_layers, (num_pages + 1) * pool.page_size, pool.num_kv_heads, pool.head_dim)
        # Pinned so the copy kernel reads/writes it over UVA; never initialized:
        # a host page is always written by an offload before a load reads it.
        self.k = torch.empty(shape, dtype=pool.dtype, pin_memory=self.on_cuda)
        self.v = torch.empty(shape, dtype=pool.dtype, pin_memory=self.on_cuda)
        # fp8 pools: the per-(token, KV head) scales live beside the codes here too.
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        if pool.k_scale is not None:
            self.k_scale = torch.empty(shape[:3], dtype=pool.k_scale.dtype, pin_memory=self.on_cuda)
            self.v_scale = torch.empty(shape[:3], dtype=pool.k_scale.dtype, pin_memory=self.on_cuda)
        self.allocator = PageAllocator(num_pages + 1)
        self.counters = HostTierCounters()
        self._runs: list[_Run] = []
        self.copy_stream = torch.cuda.Stream(self.device) if self.on_cuda else None

    # ----- capacity --------------------------------------------------------
    @property
    def num_total(self) -> int:
        """Usable host pages."""
        return self.allocator.num_total

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def bytes_total(self) -> int:
        return self.num_total * self.pool.bytes_per_page()

    @staticmethod
    def pages_for_gib(gib: float, pool: KVPool) -> int:
        """Host pages that fit in ``gib`` GiB at the pool's page size."""
        return int(gib * 2**30) // pool.bytes_per_page()

    # ----- allocation (the radix cache owns the ids it gets) -----------------
    def alloc(self, n: int) -> list[int] | None:
        return self.allocator.alloc(n)

    def free(self, pages: list[int]) -> None:
        self.allocator.free(pages)

    # ----- planned moves -----------------------------------------------------
    def queue_offload(self, device_pages: list[int], host_pages: list[int]) -> None:
        """Plan device_pages[i] -> host_pages[i]. The caller may free the device
        pages at once: the next step waits for this copy (flush)."""
        self._queue(True, device_pages, host_pages)
        self.counters.pages_offloaded_total += len(device_pages)

    def queue_load(self, host_pages: list[int], device_pages: list[int]) -> None:
        """Plan host_pages[i] -> device_pages[i]. The caller may free the host
        pages at once: later moves run after this one on the same stream."""
        self._queue(False, host_pages, device_pages)
        self.counters.pages_loaded_total += len(device_pages)

    def _queue(self, to_host: bool, src: list[int], dst: list[int]) -> None:
        if len(src) != len(dst):
            raise ValueError(f"page move with {len(src)} sources and {len(dst)} destinations")
        if not src:
            return
        if self._runs and self._runs[-1].to_host == to_host:
            self._runs[-1].src.extend(src)
            self._runs[-1].dst.extend(dst)
        else:
            self._runs.append(_Run(to_host, list(src), list(dst)))

    @property
    def num_pending(self) -> int:
        """Page moves planned but not launched yet."""
        return sum(len(r.src) for r in self._runs)

    def pending_moves(self) -> list[tuple[bool, list[int], list[int]]]:
        """(to_host, src pages, dst pages) of each planned run, in order (a copy)."""
        return [(r.to_host, list(r.src), list(r.dst)) for r in self._runs]

    @property
    def has_pending_loads(self) -> bool:
        """A planned host -> device move (a prefix restore) awaits the next step."""
        return any(not r.to_host for r in self._runs)

    def flush(self, layered: bool = False) -> list[torch.cuda.Event] | None:
        """Launch every planned move, in planning order, ordered after the work
        already queued on the current stream (CUDA: events between streams, no
        host wait). Plain: the work queued after this call waits for all of it.
        ``layered``: returns one event per layer (layer L's pages have moved);
        the caller must make the current stream wait for event L before it
        reads or writes layer L's pages, and for the last event before the step
        ends. None when nothing was planned or off CUDA (the CPU copies at once)."""
        if not self._runs:
            return None
        runs, self._runs = self._runs, []
        if self.copy_stream is None:
            for run in runs:
                self._copy_torch(run)
            return None
        compute = torch.cuda.current_stream(self.device)
        before = torch.cuda.Event()
        before.record(compute)
        self.copy_stream.wait_event(before)
        events: list[torch.cuda.Event] = []
        with torch.cuda.stream(self.copy_stream):
            idx = [self._upload_pages(run) for run in runs]
            if not layered:
                for run, ix in zip(runs, idx):
                    self._copy_cuda(run, ix, None)
            else:
                for layer in range(self.pool.num_layers):
                    for run, ix in zip(runs, idx):
                        self._copy_cuda(run, ix, layer)
                    ev = torch.cuda.Event()
                    ev.record(self.copy_stream)
                    events.append(ev)
        if layered:
            self.counters.layered_flushes_total += 1
            return events
        after = torch.cuda.Event()
        after.record(self.copy_stream)
        compute.wait_event(after)
        return None

    def synchronize(self) -> None:
        """Wait (host) for every launched move; for tests and benchmarks only."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()

    # ----- the copies ----------------------------------------------------------
    def _sides(self, run: _Run) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(src_k, src_v, dst_k, dst_v) of every tensor pair a page spans: the
        values, then (fp8) the scales."""
        p = self.pool
        pairs = [(p.k, p.v, self.k, self.v)]
        if p.k_scale is not None and p.v_scale is not None:
            assert self.k_scale is not None and self.v_scale is not None
            pairs.append((p.k_scale, p.v_scale, self.k_scale, self.v_scale))
        if run.to_host:
            return pairs
        return [(hk, hv, dk, dv) for dk, dv, hk, hv in pairs]

    def _upload_pages(self, run: _Run) -> torch.Tensor:
        """The run's page lists on the device, [2, P]: one pinned buffer, one
        non-blocking upload on the copy stream (the caching allocators keep
        both alive until the copy stream has used them)."""
        n = len(run.src)
        # Pad to a power of two (>= 16, so the dst half of the buffer stays
        # 64-byte aligned and the kernel sees one specialization); -1 = skip.
        width = max(16, 1 << (n - 1).bit_length())
        pad = [-1] * (width - n)
        host = torch.tensor(run.src + pad + run.dst + pad, dtype=torch.int32, pin_memory=True)
        return host.to(self.device, non_blocking=True).view(2, width)

    def _copy_cuda(self, run: _Run, idx: torch.Tensor, layer: int | None) -> None:
        """The run's pages in every layer (layer None, one launch per tensor
        pair) or in one layer."""
        from ftserve_kernels.bookkeeping import copy_kv_pages

        for src_k, src_v, dst_k, dst_v in self._sides(run):
            if layer is not None:
                sl = slice(layer, layer + 1)
                src_k, src_v, dst_k, dst_v = src_k[sl], src_v[sl], dst_k[sl], dst_v[sl]
            copy_kv_pages(src_k, src_v, dst_k, dst_v, idx[0], idx[1], self.page_size,
                          max_programs=self.LAYERED_COPY_PROGRAMS if layer is not None else None)
            self.counters.copy_launches_total += 1

    def _copy_torch(self, run: _Run) -> None:
        """CPU path: the same moves with index_select / index_copy_ over slot rows."""
        ps = self.page_size
        offs = torch.arange(ps)
        src_rows = (torch.tensor(run.src)[:, None] * ps + offs).reshape(-1)  # [n * ps]
        dst_rows = (torch.tensor(run.dst)[:, None] * ps + offs).reshape(-1)  # [n * ps]
        for src_k, src_v, dst_k, dst_v in self._sides(run):
            for src, dst in ((src_k, dst_k), (src_v, dst_v)):
                if src.element_size() == 1:  # fp8 codes: no CPU index_copy_ kernel, move bytes
                    src, dst = src.view(torch.uint8), dst.view(torch.uint8)
                dst.index_copy_(1, dst_rows, src.index_select(1, src_rows).to(dst.device))
        self.counters.copy_launches_total += 1
