"""Which weights a decode step pulls into L2 early, and on which stream.

ftserve_kernels/l2_prefetch.py has the kernel. This module decides the points
(FTSERVE_L2_PREFETCH, ftserve/envs.py) and owns the side stream::

    layer i, main:  norm+qkv | attention, reduce | o_proj | route | gate/up | down | join
               side:          ^ "o": o_proj + router      ^ "q": layer i+1's qkv

A fork makes the side stream wait for the main stream's work so far (so the
prefetch starts when its window opens, not earlier where it would compete with
the GEMV before it); the layer's end joins the side stream back into the main
one, so every captured decode graph ends with its branches joined. Only decode
steps of at most MAX_ROWS rows prefetch: the window is the latency-bound work
of small batches.

The tables (byte ranges of each layer's weights) are built on first use, which
is a warm-up step outside graph capture (cuda_graph.capture_graph runs the step
twice before capturing); a table is a device tensor, so building one during a
capture would be a copy the capture cannot take: that raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ftserve import envs
from ftserve_kernels import l2_prefetch as l2k
from ftserve_kernels import ops

if TYPE_CHECKING:
    from ftserve.models.decoder import DecoderLayer

MAX_ROWS = 8


class WeightPrefetch:
    """Per-model side stream and per-layer tables; the model's layers call
    ``after_qkv`` / ``after_attention`` / ``join``, which do nothing unless
    ``begin`` switched this step on. ``layers``: the model's DecoderLayers (a
    plain list: their weights stay theirs)."""

    def __init__(self, layers: Sequence[DecoderLayer]) -> None:
        self._layers = list(layers)
        self._side: torch.cuda.Stream | None = None
        # (layer, point) -> (the weights' addresses, table, the kernel's out buffer)
        self._tables: dict[tuple[int, str], tuple[tuple[int, ...], torch.Tensor, torch.Tensor]] = {}
        self._points: frozenset[str] = frozenset()
        self._mode = "line"
        self._forked = False

    def begin(self, x: torch.Tensor, is_decode: bool) -> None:
        """Decide this step's prefetch points (none unless a small decode step on CUDA)."""
        points = envs.l2_prefetch()
        on = bool(points) and is_decode and x.is_cuda and x.shape[0] <= MAX_ROWS and ops.uses_triton(x)
        self._points = points if on else frozenset()
        self._mode = envs.l2_prefetch_mode()
        if on and (self._side is None or self._side.device != x.device):
            self._side = torch.cuda.Stream(device=x.device)

    def after_qkv(self, i: int) -> None:
        """Layer i's qkv GEMV is launched: prefetch its o_proj and router weights."""
        if "o" in self._points:
            layer = self._layers[i]
            tensors = [layer.self_attn.o_proj.weight]
            gate = getattr(layer.mlp, "gate", None)  # MoEBlock's router
            if gate is not None:
                tensors.append(gate.weight)
            self._fork((i, "o"), tensors)

    def after_attention(self, i: int) -> None:
        """Layer i's o_proj is launched: prefetch layer i + 1's qkv weight."""
        if "q" in self._points and i + 1 < len(self._layers):
            self._fork((i + 1, "q"), [self._layers[i + 1].self_attn.qkv_proj.weight])

    def join(self) -> None:
        """The main stream waits for the side stream's prefetches (end of a layer)."""
        if self._forked:
            assert self._side is not None
            torch.cuda.current_stream(self._side.device).wait_stream(self._side)
            self._forked = False

    def _fork(self, key: tuple[int, str], tensors: Sequence[torch.Tensor]) -> None:
        table, out = self._table(key, tensors)
        side = self._side
        assert side is not None
        side.wait_stream(torch.cuda.current_stream(side.device))
        with torch.cuda.stream(side):
            l2k.prefetch_l2_triton(table, self._mode, out)
        self._forked = True

    def _table(self, key: tuple[int, str], tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        ptrs = tuple(t.data_ptr() for t in tensors)  # weights reloaded -> rebuild
        hit = self._tables.get(key)
        if hit is not None and hit[0] == ptrs:
            return hit[1], hit[2]
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("L2 prefetch tables are built in the eager warm-up step, not during "
                               "graph capture; run the step once before capturing it")
        table = l2k.chunk_table(tensors)
        out = torch.zeros(l2k.programs(table), dtype=torch.int64, device=table.device)
        self._tables[key] = (ptrs, table, out)
        return table, out
