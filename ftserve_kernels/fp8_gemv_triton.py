"""Dense fp8 GEMV for decode-sized T (y = x W^T + b, W in e4m3 with block scales).

At one to four rows a projection is bound by the bytes of its weight. This is
gemv_triton's kernel (``_gemv_kernel`` with FP8): every program streams
BLOCK_N weight rows of e4m3 codes (half the bytes of bf16) in [BLOCK_N,
BLOCK_K] tiles, for all T rows at once, dequantizes each tile as it arrives
(codes * scale in fp32, Fp8Weight: scale[n // bn, k // bk]) and keeps an fp32
accumulator per row shaped like the tile, so the unrolled K loop is loads and
FMAs only, issued ahead, and K is summed once at the end::

    program p: y[:, p*BN : (p+1)*BN] = in[T, K] . (codes * scale)[p*BN : (p+1)*BN, K]^T

The activation rows stay in their dtype (w8a16: no activation rounding at
decode). Twin: fp8_quant.fp8_linear_ref (the exact reference: the rounding is
fp32's). Fixed shapes, no host read: it runs inside the decode graphs.
Launch parameters (BLOCK_N, BLOCK_K, warps) come from this GPU's gemv table,
kind ``dense_fp8`` (gemv_configs), else gemv_configs.default.
"""

from __future__ import annotations

import torch
import triton

from ftserve_kernels import gemv_configs as gc
from ftserve_kernels import pdl
from ftserve_kernels.config import DEFAULT_KERNELS, KernelConfig
from ftserve_kernels.fp8_gemm_triton import check_weight
from ftserve_kernels.fp8_quant import GROUP, Fp8Weight
from ftserve_kernels.gemv_triton import GEMV_MAX_ROWS, _gemv_kernel

__all__ = ["GEMV_MAX_ROWS", "fp8_gemv_triton", "k_step", "launch_consts"]


def k_step(k: int, scale_k: int, block_k: int) -> tuple[int, bool]:
    """(BLOCK_K, SCALE_STEP) of a K loop over K = k codes in scale blocks of
    scale_k columns, asked for block_k: SCALE_STEP where a step lies inside one
    scale column (blocks of a multiple of BLOCK_K columns, or one block over all
    of K); else a step must span whole ones (check_weight: blocks are multiples
    of GROUP columns), or it falls back to GROUP."""
    bk = min(block_k, triton.next_power_of_2(k))
    if scale_k % bk == 0 or scale_k >= k:
        return bk, True
    return (bk, False) if bk % scale_k == 0 else (GROUP, True)


def launch_consts(k: int, scale_n: int, scale_k: int, cfg: gc.GemvConfig) -> dict[str, object]:
    """The kernel's tile constants for an fp8 weight of K columns in scale blocks
    of scale_n x scale_k under ``cfg`` (also what the offline sm_90 compile
    test specializes on)."""
    bk, step = k_step(k, scale_k, cfg.block_k)
    return dict(BLOCK_N=cfg.block_n, BLOCK_K=bk, K_STEPS=triton.cdiv(k, bk), EVEN_K=k % bk == 0,
                SCALE_N=scale_n, SCALE_K=scale_k, FP8=True, SCALE_STEP=step)


def fp8_gemv_triton(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None,
                    config: gc.GemvConfig | None = None, parts: torch.Tensor | None = None,
                    eps: float = 0.0, kernels: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    """x [T, K] (T <= GEMV_MAX_ROWS) -> y [T, N] in x's dtype. ``parts`` [T, P] fp32:
    x is w * s of a pending norm (eps): y = (x . W^T) / rms(s) (+ b). Launch:
    ``config``, else the device table's ``dense_fp8`` entry, else the default;
    ``kernels``: PDL and the table."""
    t, k = x.shape
    n = w.codes.shape[0]
    assert t <= GEMV_MAX_ROWS and w.codes.shape[1] == k and x.stride(-1) == 1
    assert parts is None or (parts.dtype == torch.float32 and parts.shape[0] == t and parts.is_contiguous())
    check_weight(w)
    y = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t == 0:
        return y
    block_t = triton.next_power_of_2(t)
    if config is None:
        config = (gc.pick(gc.dense_key(n, k, fp8=True), block_t, x.device, kernels)
                  or gc.default("dense_fp8", x.is_cuda, n, t, k))
    on = pdl.active(x, kernels)
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, w.codes, bias if bias is not None else x, y,
        t, n, k, eps,
        x.stride(0), w.codes.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_T=block_t, PDL=on,
        s_ptr=w.scale, stride_s=w.scale.stride(0), **launch_consts(k, w.block_n, w.block_k, config),
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl.launch(on),
        **({} if parts is None else dict(parts_ptr=parts, P=parts.shape[1], HAS_PARTS=True,
                                         BLOCK_P=triton.next_power_of_2(parts.shape[1]))),
    )
    return y
