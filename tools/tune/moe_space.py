"""Which fused-MoE tiles the tuner tries, and how it picks the winner.

The pruned tile space of tools/tune/moe: static pruning (``fits``: shared
memory, accumulator registers, tile size, pipeline depth), the row tiles worth
trying for the routing (``block_ms``), the round robin over tile shapes
(``candidates``) and group_m refinements, the moe_align chunk sizes that change
the plan (``align_chunks``), and the selection of the fastest (gate/up, down)
pair (``choose``) and its table entry (``merge_table``). No GPU needed.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from ftserve_kernels import moe_align_triton as ma
from ftserve_kernels.moe_configs import MoeConfig
from tools.tune.common import SMEM_LIMIT, round_robin

MAX_ACC_REGS = 128  # fp32 accumulator registers per thread past which Triton spills
BLOCK_NS = (64, 128, 256)
BLOCK_KS = (64, 128)
WARPS = (4, 8)
STAGES = (4, 3, 5)  # preference order inside one tile shape
ALIGN_CHUNKS = (256, 512, 1024, 2048)  # moe_align pairs per program, tried against the default


@dataclass(frozen=True)
class Tile:
    """One kernel's launch parameters (gate/up or down)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def smem_bytes(kind: str, tile: Tile, elem: int = 2) -> int:
    """Pipelined operand buffers: the activation tile plus one weight tile
    (two for gate/up: gate and up rows), per stage."""
    b_tiles = 2 if kind == "gate_up" else 1
    return tile.num_stages * (tile.block_m * tile.block_k + b_tiles * tile.block_k * tile.block_n) * elem


def acc_regs(kind: str, tile: Tile) -> float:
    """fp32 accumulator registers per thread (gate/up keeps two accumulators)."""
    accs = 2 if kind == "gate_up" else 1
    return accs * tile.block_m * tile.block_n / (tile.num_warps * 32)


def fits(kind: str, tile: Tile, k_dim: int, n_dim: int) -> bool:
    """Static pruning: shared memory, accumulator registers, tiles no larger
    than the problem, and enough K steps to fill the pipeline."""
    return (smem_bytes(kind, tile) <= SMEM_LIMIT
            and acc_regs(kind, tile) <= MAX_ACC_REGS
            and tile.block_n <= max(64, n_dim)
            and tile.block_k <= k_dim
            and k_dim // tile.block_k >= tile.num_stages - 1)


def block_ms(avg_rows: float) -> tuple[int, ...]:
    """Row tiles worth trying for an average of ``avg_rows`` pairs per expert:
    a tile much taller than the average is mostly padding."""
    return (32, 64) if avg_rows <= 48 else (64, 128)


def cap_for(tokens: int) -> int:
    """Configs per kernel per T: fewer for small T, where the kernels are short."""
    return 36 if tokens >= 2048 else 24 if tokens >= 1024 else 16


def candidates(kind: str, bms: Iterable[int], k_dim: int, n_dim: int, cap: int,
               group_m: int = 8) -> list[Tile]:
    """Pruned sweep, at most ``cap`` tiles. Round robin over the tile shapes
    (block_m, block_n, block_k), each shape's variants in preference order
    (warps suited to the tile first, then stages 4, 3, 5), so a small cap still
    covers every shape before it tries a second variant of any."""
    groups: list[list[Tile]] = []
    for bm, bn, bk in itertools.product(bms, BLOCK_NS, BLOCK_KS):
        big = bm * bn * (2 if kind == "gate_up" else 1) >= 128 * 128
        warps = sorted(WARPS, key=lambda w: w != (8 if big else 4))
        variants = [Tile(bm, bn, bk, group_m, w, s) for w in warps for s in STAGES]
        variants = [t for t in variants if fits(kind, t, k_dim, n_dim)]
        if variants:
            groups.append(variants)
    return round_robin(groups, cap)


def refinements(best: list[Tile], tried: set[Tile]) -> list[Tile]:
    """group_m 16 variants of the fastest tiles not yet tried."""
    return [t for t in (replace(b, group_m=16) for b in best) if t not in tried]


def align_chunks(num_pairs: int, num_experts: int, block_m: int) -> list[int]:
    """moe_align chunk sizes worth timing: those that change the plan (the
    default is the baseline, a chunk past the pair count is the same plan)."""
    seen = {ma._align_plan(num_pairs, num_experts, block_m)[3]}
    out = []
    for chunk in ALIGN_CHUNKS:
        eff = ma._align_plan(num_pairs, num_experts, block_m, chunk)[3]
        if eff not in seen:
            seen.add(eff)
            out.append(chunk)
    return out


def to_config(gate_up: Tile, down: Tile) -> MoeConfig:
    assert gate_up.block_m == down.block_m, "the two GEMMs share one alignment"
    return MoeConfig(gate_up.block_m, gate_up.block_n, gate_up.block_k, gate_up.group_m,
                     gate_up.num_warps, gate_up.num_stages, down_block_n=down.block_n,
                     down_block_k=down.block_k, down_num_warps=down.num_warps,
                     down_num_stages=down.num_stages, down_group_m=down.group_m)


def split_config(cfg: MoeConfig) -> tuple[Tile, Tile]:
    bn, bk, gm, w, s = cfg.down
    return (Tile(cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, cfg.num_warps, cfg.num_stages),
            Tile(cfg.block_m, bn, bk, gm, w, s))


def choose(gate_up: dict[Tile, float], down: dict[Tile, float],
           align: dict[int, float]) -> tuple[MoeConfig, float] | None:
    """Fastest (gate/up, down) pair with a common block_m, alignment included."""
    best: tuple[MoeConfig, float] | None = None
    for bm in sorted({t.block_m for t in gate_up} & {t.block_m for t in down}):
        gu = min((t for t in gate_up if t.block_m == bm), key=gate_up.__getitem__)
        dn = min((t for t in down if t.block_m == bm), key=down.__getitem__)
        total = gate_up[gu] + down[dn] + align.get(bm, 0.0)
        if best is None or total < best[1]:
            best = (to_config(gu, dn), total)
    return best


def merge_table(old: dict[str, Any], shape: str, tokens: int, cfg: MoeConfig,
                timing: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``old`` with the entry for (shape, T) set; keys sorted by T."""
    table = {"configs": {}, "timings": {}} | {k: v for k, v in old.items()}
    for part, value in (("configs", cfg.to_dict()), ("timings", timing)):
        by_t = dict(table.get(part, {}).get(shape, {}))
        by_t[str(tokens)] = value
        table[part] = dict(table.get(part, {})) | {shape: dict(sorted(by_t.items(), key=lambda kv: int(kv[0])))}
    return table
