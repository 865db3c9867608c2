"""Programmatic dependent launch (PDL) for the decode-path kernels, sm_90+.

A decode step at batch 1 is ~100 small launches, and between two of them the
GPU idles for the second one's launch and block scheduling. Launched with the
PDL attribute (``launch_pdl=True``), kernel B is scheduled while kernel A is
still running, as soon as every program of A has passed its
``griddepcontrol.launch_dependents``; B's programs then run whatever does not
depend on A (loading their weights) and wait in ``griddepcontrol.wait`` until A
has completed and its writes are visible::

    A:  [wait | work ................ ]
    B:          (scheduled as A's programs exit) [own loads | wait ....| work ... ]

Every kernel compiled with ``PDL=True`` calls ``enter`` before its first read
of anything an earlier kernel wrote, and before any write; a kernel launched
without the attribute (cuBLAS, torch ops) waits for full completion as always,
so the ordering of the stream is kept. No kernel releases its dependant early
(``griddepcontrol.launch_dependents`` right after the wait): the dependant's
programs would squat on SMs this kernel's later waves need (slower on the
H200, BENCHMARKS.md); it is released as this kernel's programs exit. Stream
capture records the programmatic edges, so the decode CUDA graphs keep them.
The step's first kernel (decode_inputs.py) is the exception: launched without
the attribute, it calls ``release`` at its start, so the first GEMV's programs
are placed and load their first weight tile while it reads the host row over
PCIe (its few programs leave the SMs free).

On where the kernel configuration says so (on by default) and only on CUDA
devices of compute capability 9.0 or newer; never under the Triton
interpreter (inline PTX). With every batch-1 decode launch in the chain it
saves ~20 us a step on the H200 (BENCHMARKS.md).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from ftserve_kernels.attention_common import interpreting
from ftserve_kernels.config import KernelConfig

try:  # Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAVE_GDC = True
except ImportError:  # pragma: no cover - older Triton: PDL stays off
    HAVE_GDC = False

    @triton.jit
    def gdc_wait():  # type: ignore[no-redef]
        pass

    @triton.jit
    def gdc_launch_dependents():  # type: ignore[no-redef]
        pass


@triton.jit
def enter(PDL: tl.constexpr):
    """Wait for the kernel before this one (the next one is released as this
    kernel's programs exit)."""
    if PDL:
        gdc_wait()


@triton.jit
def release(ON: tl.constexpr):
    """Let the next kernel be scheduled now: for the first kernel of a decode
    step (launched without the attribute, so it waits for the step before as
    always), whose few programs leave the SMs free."""
    if ON:
        gdc_launch_dependents()


@functools.lru_cache(maxsize=16)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def _can_link(t: torch.Tensor) -> bool:
    """Launches on ``t``'s device can use PDL: CUDA sm_90+, Triton with gdc, not interpreted."""
    if not (HAVE_GDC and t.is_cuda and not interpreting()):
        return False
    return _capable(t.device.index if t.device.index is not None else torch.cuda.current_device())


def active(t: torch.Tensor, kernels: KernelConfig) -> bool:
    """The PDL constexpr for launches on ``t``'s device."""
    return kernels.pdl and _can_link(t)


def launch(on: bool) -> dict[str, Any]:
    """The launch keyword for a kernel whose PDL constexpr is ``on``."""
    return {"launch_pdl": True} if on else {}
