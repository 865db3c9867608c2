"""Shared pieces of the Triton attention kernels: the interpreter switch, the
tensor-core dot helpers and the tile configuration (``AttnKernelConfig``)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Same values as paged_attention.FP8_MAX / FP8_MIN_AMAX (constexpr: read inside kernels).
FP8_MAX = tl.constexpr(448.0)
FP8_MIN_AMAX = tl.constexpr(1e-8)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def mma(a, b, UPCAST: tl.constexpr):
    """tl.dot with fp32 accumulation. The CPU interpreter (triton 3.9) returns
    garbage for bf16 operands, so there (UPCAST) both sides go to fp32 first.

    fp32 operands (an fp32 model) multiply in fp32 ("ieee"), not Triton's
    default TF32: the model's cuBLAS layers run fp32 too, the interpreter tests
    check fp32 arithmetic, and fp32 is the dtype parity is measured in. TF32's
    10-bit operands put about 1e-2 on a small model's logits and, where a
    router's k-th and k+1-th experts are near-tied, swap an expert (about 0.5
    on that token's logits). Serving runs bf16, whose operands are unchanged."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    elif UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b)


@triton.jit
def mma_acc(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b, accumulated in place by the tensor-core instruction (fp32
    operands: in fp32, as mma)."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    elif UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def round_e4m3(y):
    """fp32 values in [-448, 448] rounded (nearest, ties to even) to the e4m3
    grid, still fp32: the cast to fp8 that follows is then exact. Done by hand
    because the CPU interpreter's own fp32 -> fp8 cast rounds some values wrong
    (31.27 -> 16), and so the GPU and the torch twin agree bit for bit. The
    magnitude is rounded and y's sign bit put back with integer ops, so a
    negative value that rounds to zero stays -0 (code 0x80, as torch casts it):
    Triton up to 3.6 lowers ``-x`` to ``0 - x``, which makes +0 of -0."""
    bits = y.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF  # |y|
    e = tl.maximum((mag >> 23) - 127, -6)  # exponent; -6 = subnormal range
    ulp = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2**(e-3): 3 mantissa bits
    inv_ulp = ((127 - (e - 3)) << 23).to(tl.float32, bitcast=True)  # 2**(3-e)
    t = mag.to(tl.float32, bitcast=True) * inv_ulp  # exact (a power of two), 0 <= t <= 16
    r = ((t + 12582912.0) - 12582912.0) * ulp  # 1.5 * 2**23: the fp32 add rounds to nearest even
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)  # y's sign bit


@triton.jit
def quantize_e4m3(x, D_AXIS: tl.constexpr):
    """x [H, D] fp32 -> (codes [H, D] fp32 on the e4m3 grid, scales [H]); see
    paged_attention's module docstring for the format."""
    amax = tl.max(tl.abs(x), D_AXIS)
    # IEEE divisions, as torch's: on the GPU "/" is an approximate division.
    scale = tl.math.div_rn(tl.maximum(amax, FP8_MIN_AMAX), FP8_MAX)  # [H]
    y = tl.math.div_rn(x, tl.expand_dims(scale, D_AXIS))
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    return round_e4m3(y), scale


def scale_args(
    k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, int, bool]:
    """(k_scale, v_scale, slot stride, fp8) kernel arguments; non-fp8 caches pass
    the cache itself as an unread placeholder pointer."""
    if k_cache.dtype != torch.float8_e4m3fn:
        return k_cache, k_cache, 0, False
    assert k_scale is not None and v_scale is not None, "fp8 caches need their scales"
    assert k_scale.shape == k_cache.shape[:2] and k_scale.stride() == v_scale.stride()
    assert k_scale.stride(-1) == 1 and k_scale.dtype == torch.float32
    return k_scale, v_scale, k_scale.stride(0), True


@dataclass(frozen=True)
class AttnKernelConfig:
    """Tile sizes. ``for_device`` picks Hopper-sized tiles on CUDA and tiny ones
    for the CPU interpreter (which is slow and needs only correctness)."""

    # H200, 4096 queries over 102,400 keys (32/4 heads, d 128): bm64 bn64 w4 s3
    # 323 TFLOP/s, bm128 bn64 w8 s3 291, bm128 bn128 w8 s2 301 (tools/bench/kernels.py).
    extend_block_m: int = 64
    extend_block_n: int = 64
    extend_warps: int = 4
    extend_stages: int = 3
    # Decode split kernel: 64-token tiles in a 2-stage pipeline measured fastest
    # at short and long contexts on the H200 (tools.bench.decode_variants).
    decode_block_n: int = 64
    decode_warps: int = 4
    decode_stages: int = 2
    # At batch 1 (and 2) the split count is this cap: long contexts need the
    # parallelism of 128 splits; short ones lose nothing to the splits that hold
    # no tile, which exit before their q work (see short_context_splits).
    max_splits: int = 128
    decode_programs_per_sm: int = 4  # split-K target: (B * Hkv * splits) ~ this x SMs
    # Head columns one decode reduce program combines (0: the whole head): at
    # batch 1 whole heads give too few programs to fill the GPU. The sums over
    # the splits run in another order than whole-head programs', so greedy
    # tokens can differ from theirs at near-ties.
    decode_reduce_block_d: int = 32
    # A decode batch whose longest sequence (the host bound max_seq_len) has
    # fewer tiles than this takes at most this many splits: past its tiles a
    # split holds nothing, so at short contexts fewer programs do the same
    # work (0: off). Long contexts keep max_splits, where fewer splits lose.
    short_context_splits: int = 64
    # Split-K extend (attention_extend_triton.extend_num_splits): a grid of fewer
    # programs than SMs (few new tokens over a long prefix) is cut into at most
    # extend_max_splits KV splits, towards extend_programs_per_sm programs per
    # SM, each split holding at least extend_split_min_tiles tiles.
    extend_max_splits: int = 32
    extend_programs_per_sm: int = 2
    extend_split_min_tiles: int = 8

    @staticmethod
    def for_device(device: torch.device, head_dim: int) -> AttnKernelConfig:
        return _config_for(device.type, head_dim)

    def tag(self) -> str:
        return f"bm{self.extend_block_m}_bn{self.extend_block_n}_w{self.extend_warps}_s{self.extend_stages}"


@functools.lru_cache(maxsize=16)
def _config_for(device_type: str, head_dim: int) -> AttnKernelConfig:
    # Cached: the backend asks on every layer of every step.
    if device_type != "cuda":
        # Splits from a single tile, so the tests' tiny contexts take split-K too.
        return AttnKernelConfig(16, 16, 4, 1, 16, 4, 1, 8, extend_split_min_tiles=1)
    if head_dim > 128:
        # Shared memory: Q + staged K/V tiles. Decode: 8 warps, as the fp8 cache's
        # [64, 256] K and V tiles are converted to bf16 in registers; at 4 warps that
        # spilled inside the key loop on sm_90 (255 registers, 152 stack bytes, 51
        # spill instructions; 8 warps: 192, none; bf16 pages 214 -> 104).
        return AttnKernelConfig(extend_block_n=32, extend_stages=2, decode_warps=8)
    return AttnKernelConfig()
