"""The shapes and launch configurations test_kernels_fp8.py runs the fp8 kernels
at, in one place: test_kernels_fp8_sm90_compile.py compiles every launch the
GPU run of those tests makes (at the CUDA tile choices) for sm_90, without a
GPU. The interpreter runs a kernel as Python, so it cannot see what only the
compiler rejects (a constexpr branch it builds although it is not taken)."""

from __future__ import annotations

import torch

DTYPES = [torch.float32, torch.bfloat16]

GEMM_CASES = [  # m, n, k, bn, bk
    (37, 200, 300, 128, 128),  # partial row tiles, column tiles and K block
    (20, 256, 64, 64, 128),  # K below one block; fused-projection scale rows (bn 64)
    (9, 96, 256, 1, 256),  # per-channel scales (one per row, bk >= K)
]

GEMV_CASES = [  # t, n, k, bn, bk, at the device's default tiles
    (1, 200, 300, 128, 128),
    (3, 96, 64, 64, 128),  # K below the default 512-code step and below a scale column
    (4, 130, 512, 1, 512),
]

GEMV_TILE_BN = 16  # the weight's scale row blocks in GEMV_TILE_CASES
GEMV_TILE_CASES = [  # t, n, k, bk, (block_n, block_k): explicit tiles, one warp
    (2, 40, 512, 128, (8, 256)),  # a step spans two scale columns: the [N, KB, 128] view
    (1, 24, 300, 128, (16, 256)),  # ... and a partial last step
    (3, 20, 768, 384, (4, 256)),  # 384-column blocks: steps fall back to 128 columns
    (4, 33, 256, 256, (8, 64)),  # steps inside a scale column, rows past N masked
]

GROUPED_MOE_CASES = [  # dtype, t, e, h, inter, k, bn13
    (torch.float32, 21, 8, 256, 192, 4, 64),  # two K steps, a partial 128-column group of I
    (torch.float32, 9, 16, 64, 32, 4, 32),  # tiny-moe's shape: H and I below one block
    (torch.bfloat16, 9, 8, 128, 192, 2, 64),
    (torch.float32, 7, 8, 256, 128, 2, 0),  # per-channel scales
    (torch.float32, 13, 8, 256, 256, 2, 128),  # 128-row scale blocks: one weight scale per gate/up tile
]

MOE_GEMV_SHAPE = (8, 128, 192, 4)  # e, h, inter, k of the expert GEMV tests
MOE_GEMV_CASES = [  # dtype, t, bn13 (0: per-channel scales)
    (torch.float32, 1, 64), (torch.bfloat16, 1, 64), (torch.float32, 2, 64), (torch.bfloat16, 2, 64),
    (torch.float32, 2, 0),
]
NORM_NEXT_TOKENS = [1, 2]  # the down epilogue folding the next norm, at MOE_GEMV_SHAPE, bn13 64

WIDE_SHAPE = (4, 64, 2)  # e, inter, k; one token, bn13 64
WIDE_CASES = [(torch.float32, 384), (torch.bfloat16, 512)]  # dtype, h
WIDE_TILES = ((8, 256, 4, 1), (16, 128, 4, 1))  # (gate/up, down) GemvConfig fields: 256-code gate/up steps

ROUTE_E_K = (16, 4)  # router rows and top-k of the fp8 o_proj + router tests
ROUTE_CASES = [  # dtype, h, q, bn, bk, bias, (block_n, block_k) of the o_proj rows (4 warps)
    (torch.float32, 128, 256, 128, 128, False, (16, 64)),  # two steps a scale column
    (torch.float32, 200, 384, 64, 128, True, (8, 256)),  # a step spans two scale columns, the last partial
    (torch.bfloat16, 96, 512, 128, 128, False, (16, 512)),  # the CUDA default's 512-code steps
    (torch.float32, 130, 256, 1, 256, False, (8, 128)),  # per-channel scales (one per row, bk >= K)
]
ROUTED_SHAPE = (8, 128, 128, 64, 2)  # e, h, q, inter, k: a routed row into the expert pair (default tiles)

DISPATCH_SHAPE = (96, 128, 8, 64, 2)  # n, h, e, inter, k of test_ops_dispatch_fp8_weights (fp32, bk 128)
DISPATCH_TOKENS = [1, 4, 5]
