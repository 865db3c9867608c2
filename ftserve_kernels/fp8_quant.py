"""FP8 (e4m3) weights and activations: the format, its torch twins, and the
per-token-group activation quantization kernel of the prefill GEMMs.

Weights (HF ``quant_method: fp8`` and compressed-tensors checkpoints, kept in
fp8 on the device) are an ``Fp8Weight``::

    codes  [..., N, K]                            float8_e4m3fn
    scale  [..., ceil(N / bn), ceil(K / bk)]      fp32
    w[n, k] = codes[n, k] * scale[n // bn, k // bk]

(bn, bk) is the checkpoint's 128 x 128 block, with bn made smaller where the
loader fused projections whose row counts are not multiples of 128 (their
scale rows repeated: exact); a per-channel checkpoint is bn = 1, bk >= K (one
scale per output row). Experts stack a leading [E] on both tensors.

Activations, for the w8a8 prefill GEMMs only (decode GEMVs read bf16 rows),
are quantized per token and GROUP-column group on the fly::

    scale[t, g] = max(amax |x[t, g*128 : (g+1)*128]|, 1e-8) / 448
    code[t, c]  = rne_e4m3(x[t, c] / scale[t, c // 128])

the format of the fp8 KV pages (paged_attention), per 128 columns instead of
per head. The twin and the kernel agree bit for bit (round_e4m3).

The exact reference for the CPU engine dequantizes the weight and multiplies
in fp32 with the activations as they are (``fp8_linear_ref``), which is what
transformers computes on the same checkpoint dequantized.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ftserve_kernels.attention_common import FP8_MAX, FP8_MIN_AMAX, round_e4m3

FP8 = torch.float8_e4m3fn
GROUP = 128  # activation quantization group (columns), the GEMMs' BLOCK_K
E4M3_MAX = 448.0
MIN_AMAX = 1e-8


@dataclass(frozen=True)
class Fp8Weight:
    """An fp8 weight as the kernels take it (module docstring). Built per call
    from a module's parameters (host only: no copy, graph-capturable)."""

    codes: torch.Tensor  # [..., N, K] float8_e4m3fn
    scale: torch.Tensor  # [..., ceil(N / bn), ceil(K / bk)] fp32
    block_n: int
    block_k: int

    def __post_init__(self) -> None:
        assert self.codes.dtype == FP8 and self.scale.dtype == torch.float32
        n, k = self.codes.shape[-2:]
        assert self.scale.shape[-2:] == (-(-n // self.block_n), -(-k // self.block_k)), (
            f"scale {tuple(self.scale.shape)} does not tile codes {tuple(self.codes.shape)} "
            f"in blocks of {self.block_n} x {self.block_k}")

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def expert(self, e: int) -> Fp8Weight:
        """Expert e of a stacked [E, N, K] weight."""
        return Fp8Weight(self.codes[e], self.scale[e], self.block_n, self.block_k)


# ---------------------------------------------------------------- weights: torch


def expand_scale(scale: torch.Tensor, n: int, k: int, block_n: int, block_k: int) -> torch.Tensor:
    """scale [..., ceil(n/bn), ceil(k/bk)] -> one scale per element [..., n, k]."""
    rows = scale.repeat_interleave(block_n, dim=-2)[..., :n, :]
    return rows.repeat_interleave(min(block_k, k), dim=-1)[..., :k]


def dequantize(w: Fp8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight itself: codes * scale in fp32 (as transformers' dequantization
    multiplies), then ``dtype``."""
    n, k = w.codes.shape[-2:]
    full = w.codes.float() * expand_scale(w.scale.float(), n, k, w.block_n, w.block_k)
    return full.to(dtype)


def quantize_weight(w: torch.Tensor, block_n: int = 128, block_k: int = 128) -> Fp8Weight:
    """Block-quantize w [..., N, K] (make_model's checkpoints, dummy weights, tests):
    per block scale = amax / 448 (1 for an all-zero block), codes = rne(w / scale)."""
    n, k = w.shape[-2:]
    nb, kb = -(-n // block_n), -(-k // block_k)
    wf = w.float()
    padded = F.pad(wf, (0, kb * block_k - k, 0, nb * block_n - n))  # [..., nb*bn, kb*bk]
    blocks = padded.unflatten(-1, (kb, block_k)).unflatten(-3, (nb, block_n))  # [..., nb, bn, kb, bk]
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    codes = (wf / expand_scale(scale, n, k, block_n, block_k)).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return Fp8Weight(codes.contiguous(), scale.contiguous(), block_n, block_k)


# ---------------------------------------------------------------- activations: torch


def quantize_act_ref(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (codes [T, K] float8_e4m3fn, scales [T, ceil(K / group)] fp32)."""
    t, k = x.shape
    g = -(-k // group)
    xf = F.pad(x.float(), (0, g * group - k)).view(t, g, group)  # [T, G, group]
    amax = xf.abs().amax(dim=-1).clamp_min(MIN_AMAX)  # [T, G]
    # IEEE divisions on every device, as the kernel's div_rn: CUDA torch divides by a
    # Python number as a multiply by its rounded reciprocal, an ulp off the quotient;
    # bf16 activations (8 significant bits) can sit exactly on an e4m3 rounding tie
    # of x / scale, where that ulp moves the code a step.
    scale = amax / torch.full_like(amax, E4M3_MAX)
    codes = (xf / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)  # RNE cast
    return codes.view(t, g * group)[:, :k].contiguous(), scale


def dequantize_act_ref(codes: torch.Tensor, scale: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """(codes [T, K], scales [T, G]) -> fp32 [T, K]."""
    k = codes.shape[1]
    return codes.float() * scale.repeat_interleave(group, dim=1)[:, :k]


def fake_quant_act(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] through the activation quantization and back, fp32."""
    return dequantize_act_ref(*quantize_act_ref(x))


def fp8_linear_ref(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None,
                   act_quant: bool = False) -> torch.Tensor:
    """y = x W^T (+ b) [T, N] in x's dtype, accumulated in fp32. ``act_quant``:
    x goes through the per-token-group fp8 quantization first, as in the
    prefill GEMM kernel (fp8_gemm_triton); without it this is the exact
    reference (the CPU engine's path)."""
    xf = fake_quant_act(x) if act_quant else x.float()
    y = F.linear(xf, dequantize(w))
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# ---------------------------------------------------------------- activations: Triton


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, T, T_OUT, K, G, stride_x, stride_q, stride_s, stride_sg,
                      GROUP_K: tl.constexpr, BLOCK_T: tl.constexpr):
    # Program (row block, column group): BLOCK_T rows of one GROUP_K-column group.
    # Rows T..T_OUT (padding a GEMM asks for) get zero codes and the floor scale.
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    g = tl.program_id(1)
    c = g * GROUP_K + tl.arange(0, GROUP_K)  # [GK]
    m = (t[:, None] < T) & (c[None, :] < K)
    x = tl.load(x_ptr + t[:, None].to(tl.int64) * stride_x + c[None, :], mask=m, other=0.0).to(tl.float32)
    # IEEE divisions, as torch's: on the GPU "/" is an approximate division.
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 1), FP8_MIN_AMAX), FP8_MAX)  # [BT]
    y = tl.math.div_rn(x, scale[:, None])
    y = round_e4m3(tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX))
    out = (t[:, None] < T_OUT) & (c[None, :] < K)
    tl.store(q_ptr + t[:, None].to(tl.int64) * stride_q + c[None, :], y.to(q_ptr.dtype.element_ty), mask=out)
    tl.store(s_ptr + t.to(tl.int64) * stride_s + g * stride_sg, scale, mask=t < T_OUT)


def quantize_act_triton(x: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of quantize_act_ref: one launch over (row blocks, groups); fixed
    shapes, no host read. ``out``: (codes [T', K], scales [T', G]) to write into,
    any strides with unit column steps for the codes; T' >= T rows, the ones past
    x's zero codes with the floor scale (fp8_scaled_mm's padding)."""
    t, k = x.shape
    g = -(-k // GROUP)
    assert x.stride(-1) == 1
    codes, scales = out if out is not None else (
        torch.empty((t, k), dtype=FP8, device=x.device),
        torch.empty((t, g), dtype=torch.float32, device=x.device))
    rows = codes.shape[0]
    assert codes.stride(-1) == 1 and rows >= t and scales.shape == (rows, g)
    if rows:
        block_t = 8
        _act_quant_kernel[(triton.cdiv(rows, block_t), g)](
            x, codes, scales, t, rows, k, g, x.stride(0), codes.stride(0), scales.stride(0), scales.stride(1),
            GROUP_K=GROUP, BLOCK_T=block_t, num_warps=4)
    return codes, scales
