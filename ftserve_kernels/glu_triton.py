"""SiLU(gate) * up over a [T, 2I] gate/up projection, in place, on Triton: one
launch where the reference (``silu_mul_ref``) runs two elementwise kernels
(SiLU, then the product). Shapes where the dense GEMV's GLU epilogue does not
run take it: prefill chunks, and verify steps of more rows than the GEMVs take.

Numerics match the reference: SiLU in fp32, rounded to the input dtype, then
the product in fp32, rounded again. The result lands in the gate half (the
down projection reads its strided rows), as the reference's in-place ops do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftserve_kernels import pdl
from ftserve_kernels.config import DEFAULT_KERNELS, KernelConfig

_BLOCK = 1024  # columns a program takes: 8 bf16 a thread at 4 warps


@triton.jit
def _silu_mul_kernel(gu_ptr, inter, stride_t, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)  # the projection comes from the kernel before
    row = gu_ptr + tl.program_id(0).to(tl.int64) * stride_t
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(row + cols, mask=mask, other=0.0)
    u = tl.load(row + inter + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(row + cols, (s * u.to(tl.float32)).to(g.dtype), mask=mask)


def silu_mul_triton(gate_up: torch.Tensor, kernels: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    """gate_up [T, 2I] -> SiLU(gate) * up [T, I], written over the gate half (a view)."""
    t, two_i = gate_up.shape
    inter = two_i // 2
    assert gate_up.stride(1) == 1 and two_i == 2 * inter
    if t:
        on = pdl.active(gate_up, kernels)
        _silu_mul_kernel[(t, triton.cdiv(inter, _BLOCK))](
            gate_up, inter, gate_up.stride(0), BLOCK=_BLOCK, PDL=on, num_warps=4, **pdl.launch(on))
    return gate_up[:, :inter]
