"""ggml tensor types -> float32 torch tensors, on the device the weights go to.

The types llama.cpp's common files use are dequantized here with torch ops over
whole tensors (block layouts below, as ggml defines them), so a large checkpoint
dequantizes at memory speed on a GPU. On the CPU the K-quants go through the
``gguf`` package's numpy code instead, which is faster there for them (a run of
many small uint8 torch ops is not; the 32-value types are faster in torch), and
so does every other type the package can dequantize (Q2_K, Q3_K, the IQ types,
...). tests/test_gguf_quants.py checks every torch path against
``gguf.quants.dequantize`` on random blocks.

Block layouts (bytes; d, m, dmin: float16 scales; a K-quant super-block holds
256 values in 8 (Q4_K, Q5_K) or 16 (Q6_K) sub-blocks):

    Q8_0  [d | 32 x int8 q]                       x = d * q
    Q4_0  [d | 16 bytes: q0..15 low, q16..31 high] x = d * (q - 8)
    Q4_1  [d | m | 16 bytes as Q4_0]               x = d * q + m
    Q5_0  [d | qh u32 (bit 4 of each q) | 16 bytes] x = d * (q - 16)
    Q5_1  [d | m | qh | 16 bytes]                  x = d * q + m
    Q4_K  [d | dmin | 12 bytes: 8 x (6-bit scale, 6-bit min) | 128 bytes of nibbles]
          x = d * scale_j * q - dmin * min_j
    Q5_K  [d | dmin | 12 bytes scales | 32 bytes qh | 128 bytes]  (q gets a 5th bit)
    Q6_K  [128 bytes low nibbles | 64 bytes 2-bit highs | 16 x int8 scale | d]
          x = d * scale_j * (q - 32)
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

# ggml type ids (gguf.GGMLQuantizationType), spelled out so the hot path needs no import
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q4_K, Q5_K, Q6_K, BF16 = 12, 13, 14, 30
QK_K = 256


def _f16(block: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte ``start`` (even) of each block, as float32: [blocks, 1].
    Every block size is even, so the rows view as float16 without a copy."""
    return block.view(torch.float16)[:, start // 2:start // 2 + 1].float()


def _nibbles(qs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (qs & 0x0F), (qs >> 4)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * b[:, 2:34].contiguous().view(torch.int8).float()


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    lo, hi = _nibbles(b[:, 2:18])
    return _f16(b, 0) * (torch.cat((lo, hi), 1).float() - 8)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    lo, hi = _nibbles(b[:, 4:20])
    # not addcmul: a fused multiply-add would round differently from ggml on a GPU
    return _f16(b, 0) * torch.cat((lo, hi), 1).float() + _f16(b, 2)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """[blocks, 4] bytes of a little-endian u32 -> [blocks, 32] bits (bit j = value j)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device)
    return ((qh[:, :, None] >> shifts) & 1).reshape(qh.shape[0], 32)


def _q5(b: torch.Tensor, with_min: bool) -> torch.Tensor:
    off = 4 if with_min else 2
    bits = _high_bits(b[:, off:off + 4])
    lo, hi = _nibbles(b[:, off + 4:off + 20])
    q = (torch.cat((lo, hi), 1) | (bits << 4)).float()
    if with_min:
        return _f16(b, 0) * q + _f16(b, 2)
    return _f16(b, 0) * (q - 16)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes -> 8 six-bit scales and 8 six-bit mins: [blocks, 8] each.
    Sub-blocks 0-3 use the low 6 bits of bytes 0-3 (scale) and 4-7 (min); 4-7 take
    their low 4 bits from bytes 8-11 and their top 2 from the spare bits of 0-7."""
    lo_sc, lo_m = s[:, 0:4] & 63, s[:, 4:8] & 63
    hi_sc = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    hi_m = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return torch.cat((lo_sc, hi_sc), 1).float(), torch.cat((lo_m, hi_m), 1).float()


def _q45_k(b: torch.Tensor, fifth_bit: bool) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scales(b[:, 4:16])
    qs = b[:, 48:176] if fifth_bit else b[:, 16:144]
    lo, hi = _nibbles(qs.reshape(n, 4, 32))  # chunk c: sub-blocks 2c (lo) and 2c+1 (hi)
    q = torch.stack((lo, hi), 2)  # [n, 4 chunks, 2, 32]
    if fifth_bit:
        qh = b[:, 16:48]  # bit k of qh[l] is the 5th bit of value l of sub-block k
        shifts = torch.arange(8, dtype=torch.uint8, device=b.device).reshape(4, 2)
        q = q | (((qh[:, None, None, :] >> shifts[None, :, :, None]) & 1) << 4)
    q = q.reshape(n, 8, 32).float()
    return ((d * sc)[:, :, None] * q - (dmin * mn)[:, :, None]).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 2, 32)  # [n, half, which 32 bytes, 32]
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    scales = b[:, 192:208].contiguous().view(torch.int8).float().reshape(n, 2, 8)
    d = _f16(b, 208)
    lo, hi = _nibbles(ql)  # values 0-31 / 32-63 (lo of ql[0:32] / ql[32:64]), then 64-127 (hi)
    shifts = torch.tensor([[0, 2], [4, 6]], dtype=torch.uint8, device=b.device)
    high = (qh >> shifts.reshape(1, 1, 4, 1)) & 3  # [n, 2, 4, 32] for the 4 groups of 32
    q = torch.cat((lo, hi), 2) | (high << 4)  # [n, half, group, 32]
    q = q.float() - 32
    # each group of 32 splits into two sub-blocks of 16, scale index 2 * group + (l >= 16)
    q = q.reshape(n, 2, 4, 2, 16)
    sc = scales.reshape(n, 2, 4, 2)  # [n, half, group, l // 16]
    return (d[:, :, None, None, None] * sc[..., None] * q).reshape(n, QK_K)


# type id -> (block bytes, values per block, dequantizer over [blocks, block bytes] uint8)
_BLOCKS: dict[int, tuple[int, int, Callable[[torch.Tensor], torch.Tensor]]] = {
    Q8_0: (34, 32, _q8_0),
    Q4_0: (18, 32, _q4_0),
    Q4_1: (20, 32, _q4_1),
    Q5_0: (22, 32, lambda b: _q5(b, False)),
    Q5_1: (24, 32, lambda b: _q5(b, True)),
    Q4_K: (144, QK_K, lambda b: _q45_k(b, False)),
    Q5_K: (176, QK_K, lambda b: _q45_k(b, True)),
    Q6_K: (210, QK_K, _q6_k),
}
TORCH_TYPES = frozenset({F32, F16, BF16, *_BLOCKS})
_NUMPY_ON_CPU = frozenset({Q4_K, Q5_K, Q6_K})


def type_name(qtype: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"#{qtype}"


def dequantize(raw: np.ndarray, qtype: int, shape: tuple[int, ...],
               device: torch.device) -> torch.Tensor:
    """Bytes of one tensor -> float32 [shape] on ``device``. NotImplementedError(type
    name) for a type neither this module nor the gguf package can dequantize."""
    if qtype in TORCH_TYPES and not (device.type == "cpu" and qtype in _NUMPY_ON_CPU):
        data = torch.from_numpy(np.array(raw, copy=True)).to(device)  # [nbytes] uint8
        return dequantize_torch(data, qtype, shape)
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    try:
        kind = GGMLQuantizationType(qtype)
    except ValueError:
        raise NotImplementedError(type_name(qtype)) from None
    if qtype in (F32, F16):
        values = np.asarray(raw).view(np.float32 if qtype == F32 else np.float16)
    else:
        _, size = GGML_QUANT_SIZES[kind]
        try:
            values = quants.dequantize(np.asarray(raw).reshape(-1, size), kind)
        except NotImplementedError:
            raise NotImplementedError(kind.name) from None
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape).to(device)


def dequantize_torch(data: torch.Tensor, qtype: int, shape: tuple[int, ...]) -> torch.Tensor:
    """[nbytes] uint8 of a TORCH_TYPES tensor -> float32 [shape], on data's device."""
    numel = int(np.prod(shape))
    if qtype == F32:
        return data.view(torch.float32).reshape(shape)
    if qtype == F16:
        return data.view(torch.float16).float().reshape(shape)
    if qtype == BF16:
        return data.view(torch.bfloat16).float().reshape(shape)
    size, per, fn = _BLOCKS[qtype]
    if numel % per or data.numel() != numel // per * size:
        raise ValueError(f"{type_name(qtype)} data of {data.numel()} bytes does not hold {numel} values")
    return fn(data.reshape(-1, size)).reshape(shape)
