"""Which GEMV launch configs the tuner tries, and why.

The problems tools/tune/gemv tunes (``Problem``, ``PROBLEMS``) and, for each,
the pruned candidate space: static pruning (``fits``: registers, shared memory,
tile size, unrolled K steps, enough programs for the SMs), the round robin over
tile shapes nearest the default (``candidates``), and the warps / stages
variants of the fastest shapes (``refinements``). No GPU needed.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import triton

from ftserve_kernels import gemv_configs as gc
from ftserve_kernels.fp8_quant import GROUP as FP8_GROUP
from ftserve_kernels.gemv_configs import GemvConfig
from tools.tune.common import SMEM_LIMIT, round_robin


@dataclass(frozen=True)
class Problem:
    """One kernel at one shape. ``shape``: (E, k, H, I) for the MoE kinds,
    (N, K) for the dense ones. ``optional``: tuned only with budget left over."""

    name: str
    kind: str
    shape: tuple[int, ...]
    optional: bool = False

    @property
    def moe(self) -> bool:
        return self.kind in gc.MOE_KINDS + gc.FP8_MOE_KINDS

    @property
    def fp8(self) -> bool:
        """e4m3 weights (one byte a code): fp8_moe_gemv_triton's pair, or the
        dense GEMV over an Fp8Weight (fp8_gemv_triton)."""
        return self.kind in gc.FP8_MOE_KINDS or self.kind == "dense_fp8"

    @property
    def gate_up(self) -> bool:
        return self.kind.endswith("gate_up")

    def key(self) -> str:
        if self.moe:
            e, k, h, inter = self.shape
            return gc.moe_key(self.kind, e, h, inter, k)
        n, kd = self.shape
        return gc.dense_key(n, kd, fp8=self.fp8)

    def default(self, cuda: bool, tokens: int) -> GemvConfig:
        """The launch the kernel takes without a table entry (gc.default)."""
        return gc.default(self.kind, cuda, self.shape[0], tokens, self.dims()[2])

    def table_t(self, tokens: int) -> int:
        """The T the runtime looks up: tokens (MoE), the row block (dense)."""
        return tokens if self.moe else triton.next_power_of_2(tokens)

    def dims(self) -> tuple[int, int, int]:
        """(rows of weight a program's tile stacks, N, K) of the kernel's GEMV."""
        if self.moe:
            e, k, h, inter = self.shape
            if self.gate_up:
                return 2, inter, h  # gate and up rows
            return triton.next_power_of_2(k), h, inter  # the k choices' rows
        n, kd = self.shape
        return 1, n, kd

    def weight_bytes(self, tokens: int, elem: int = 2) -> int:
        """Weight bytes one timed call reads (distinct experts per (token, choice));
        fp8: one byte a code (the scales are 1/16,384 of it), and both kernels'
        (MoeFp8Case times the pair, gate/up's 2 x I rows and down's H)."""
        if self.moe:
            e, k, h, inter = self.shape
            if self.fp8:
                return tokens * k * 3 * inter * h
            return tokens * k * (2 if self.gate_up else 1) * inter * h * elem
        n, kd = self.shape
        return n * kd * (1 if self.fp8 else elem)

    def programs(self, tokens: int, block_n: int) -> int:
        if self.moe:
            e, k, h, inter = self.shape
            if self.gate_up:
                return tokens * k * triton.cdiv(inter, block_n)
            return tokens * triton.cdiv(h, block_n)
        return triton.cdiv(self.shape[0], block_n)


QWEN3_MOE = (128, 8, 2048, 768)  # (E, k, H, I)
QWEN3_NEXT_MOE = (512, 10, 2048, 512)
PROBLEMS: dict[str, Problem] = {p.name: p for p in (
    Problem("gate_up", "moe_gate_up", QWEN3_MOE),
    Problem("down", "moe_down", QWEN3_MOE),
    # qkv arrives normed (the layer before applied or left pending its norm): a plain GEMV.
    Problem("qkv", "dense", (5120, 2048)),
    Problem("o_proj", "dense", (2048, 4096)),
    Problem("lm_head", "dense", (151_936, 2048), optional=True),
    # qwen3-30b-a3b-fp8's experts (fp8_moe_gemv_triton: e4m3 codes, 128 x 128 scale
    # blocks); tuned when --problems names them.
    Problem("fp8_gate_up", "moe_fp8_gate_up", QWEN3_MOE),
    Problem("fp8_down", "moe_fp8_down", QWEN3_MOE),
    # ... and its attention projections over e4m3 weights (fp8_gemv_triton).
    Problem("fp8_qkv", "dense_fp8", (5120, 2048)),
    Problem("fp8_o_proj", "dense_fp8", (2048, 4096)),
    # SmolLM2-135M (hidden 576, 9 + 2 x 3 heads of 64, MLP 1536): a dense model whose
    # decode and batch-1 verify steps are GEMVs of 1 and 4 rows (--tokens 1,4); the
    # gate/up entry is the GLU launch's (its key is W's shape, gate and up stacked).
    # Tuned only when --problems names them (not in DEFAULT_PROBLEMS).
    Problem("smol_qkv", "dense", (960, 576)),
    Problem("smol_o_proj", "dense", (576, 576)),
    Problem("smol_gate_up", "dense", (3072, 576)),
    Problem("smol_down", "dense", (576, 1536)),
    Problem("smol_lm_head", "dense", (49_152, 576)),
    # qwen3-next-80b-a3b's decode (the hybrid bench's model, --problems next_*,lm_head):
    # 512 experts top-10; the linear layers' fused in_proj (qkvz + ba) and the full
    # attention layers' gated qkv; the shared expert's gate/up (GLU) and down; its
    # o_proj / out_proj (2048 x 4096) and lm_head are qwen3-30b-a3b's shapes.
    Problem("next_gate_up", "moe_gate_up", QWEN3_NEXT_MOE),
    Problem("next_down", "moe_down", QWEN3_NEXT_MOE),
    Problem("next_in_proj", "dense", (12_352, 2048)),
    Problem("next_qkv", "dense", (9216, 2048)),
    Problem("next_shared_gate_up", "dense", (1024, 2048)),
    Problem("next_shared_down", "dense", (2048, 512)),
)}
PIPELINED = ("moe_gate_up",)  # a runtime K loop: num_stages matters
BLOCK_NS = (4, 8, 16, 32, 64)
BLOCK_KS = (128, 256, 512, 1024)
WARPS = (4, 8, 16)
STAGES = (2, 3, 1)  # preference order inside one tile shape
MIN_LOAD_ELEMS = 8  # weight elements per thread per step: below, lanes idle or replicate
MAX_LOAD_ELEMS = 128  # ... above, the tile's registers crowd out the loads in flight
MAX_ACC_REGS = 48  # fp32 [N, BK] accumulator registers per thread (dense kernel)
MAX_K_STEPS = 32  # unrolled K loops: compile time and code size
CAP = 16  # candidates per (problem, T)


def _acc_regs(problem: Problem, cfg: GemvConfig, tokens: int) -> float:
    """fp32 accumulators per thread of the kernel that keeps a [N, BK] one per row."""
    if problem.moe:
        return 0.0  # the MoE kernels reduce each step into an [N] accumulator
    rows = triton.next_power_of_2(tokens)  # one per input row
    return rows * cfg.block_n * cfg.block_k / (32 * cfg.num_warps)


def fits(problem: Problem, cfg: GemvConfig, tokens: int, sms: int) -> bool:
    """Static pruning: the weight tile per thread, accumulator registers, shared
    memory of the pipelined loads, tiles no larger than the problem, unrolled
    loops of bounded length, and at least half a program per SM."""
    rows, n, k = problem.dims()
    if problem.kind == "moe_fp8_down" and cfg.block_k > FP8_GROUP:
        return False  # its launch steps one scale group at most: the same launch as block_k 128
    per_thread = rows * cfg.block_n * cfg.block_k / (32 * cfg.num_warps)
    smem = cfg.num_stages * rows * cfg.block_n * cfg.block_k * 2 if cfg.num_stages > 1 else 0
    unrolled = problem.kind not in PIPELINED
    return (MIN_LOAD_ELEMS <= per_thread <= MAX_LOAD_ELEMS
            and _acc_regs(problem, cfg, tokens) <= MAX_ACC_REGS
            and (unrolled or smem <= SMEM_LIMIT)
            and cfg.block_n <= max(4, n) and cfg.block_k <= k
            and (not unrolled or triton.cdiv(k, cfg.block_k) <= MAX_K_STEPS)
            and problem.programs(tokens, cfg.block_n) >= max(1, sms // 2))


def candidates(problem: Problem, tokens: int, sms: int, cap: int = CAP) -> list[GemvConfig]:
    """Pruned sweep, at most ``cap`` configs, the default left out (it is the
    baseline). Round robin over tile shapes (block_n, block_k) nearest the
    default first (log2 distance), each shape's variants in preference order
    (the default's warps first; stages only where the kernel pipelines), so a
    small cap still covers the neighbourhood before a second variant of any."""
    base = problem.default(True, tokens)
    stages = STAGES if problem.kind in PIPELINED else (base.num_stages,)

    def dist(shape: tuple[int, int]) -> tuple[float, int, int]:
        bn, bk = shape
        return abs(math.log2(bn / base.block_n)) + abs(math.log2(bk / base.block_k)), bn, bk

    groups: list[list[GemvConfig]] = []
    for bn, bk in sorted(itertools.product(BLOCK_NS, BLOCK_KS), key=dist):
        warps = sorted(WARPS, key=lambda w: (w != base.num_warps, w))
        variants = [GemvConfig(bn, bk, w, s) for w in warps for s in stages]
        variants = [c for c in variants if c != base and fits(problem, c, tokens, sms)]
        if variants:
            groups.append(variants)
    return round_robin(groups, cap)


def refinements(problem: Problem, best: Iterable[GemvConfig], tried: set[GemvConfig], tokens: int,
                sms: int) -> list[GemvConfig]:
    """The untried warps (and, where the kernel pipelines, stages) variants of
    the fastest tile shapes: the round robin reaches few of them under a cap."""
    stages = STAGES if problem.kind in PIPELINED else None
    out: list[GemvConfig] = []
    for b in best:
        for w, s in itertools.product(WARPS, stages or (b.num_stages,)):
            c = GemvConfig(b.block_n, b.block_k, w, s)
            if c not in tried and c not in out and fits(problem, c, tokens, sms):
                out.append(c)
    return out
