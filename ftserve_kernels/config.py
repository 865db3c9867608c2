"""Which kernels run: one frozen value, built once at start-up and passed down.

The engine builds its KernelConfig from its flags and the table files named
by its environment (ftserve/envs.py, read once), checks the tables, logs it,
and hands the same value to every forward batch, the sampler and the expert
cache. Nothing on the step path reads the environment, so a captured graph
and an eager step always run the same kernels.

Where the choice is made:

- ``ftserve_kernels.ops``: every function takes the config first (Triton or
  the torch twin, per ``backend``);
- a Triton wrapper takes ``kernels=`` for what its launch depends on (PDL, a
  table file, laid-over GEMV entries); a test or tool that calls one on its
  own gets the defaults (``DEFAULT_KERNELS``).

Fields:

    backend       auto: Triton on CUDA tensors, the torch twins elsewhere;
                  triton: Triton everywhere (on the CPU under TRITON_INTERPRET=1);
                  torch: the torch twins everywhere
    pdl           programmatic dependent launch between the decode kernels
                  (pdl.py), where the device has it (sm_90+)
    gemv_table    a decode GEMV launch table (tools/tune/gemv.py) used instead
                  of the device's packaged one (gemv_configs)
    moe_table     a grouped-GEMM MoE tile table (tools/tune/moe.py) used
                  instead of the device's packaged one (moe_configs)
    gemv_entries  GEMV launches laid over the table, ``KEY@T=BN.BK.W.S`` joined
                  by ";" (gemv_configs.parse_entries): in-context tuning runs
    dense_gemv    a layer's dense (not fp8) linears at decode sizes (ops.linear,
                  <= GEMV_MAX_ROWS rows) on the Triton GEMV and the launches
                  folded into it (a gated MLP's SiLU * up, a norm left pending);
                  off: cuBLAS (F.linear) and the unfused composition. Not the
                  lm_head (ops.linear_fp32 decides alone). A measurement knob
                  (tools/bench/decode_variants: ``kernels dense_gemv=0``)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

BACKENDS = ("auto", "triton", "torch")


@dataclass(frozen=True)
class KernelConfig:
    backend: str = "auto"
    pdl: bool = True
    gemv_table: str | None = None
    moe_table: str | None = None
    gemv_entries: str = ""
    dense_gemv: bool = True

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"kernel backend {self.backend!r}: one of {', '.join(BACKENDS)}")
        if self.gemv_entries:
            from ftserve_kernels.gemv_configs import parse_entries

            parse_entries(self.gemv_entries)  # a bad entry is an error naming it, here

    def triton(self, t: torch.Tensor) -> bool:
        """Whether work on ``t`` runs the Triton kernels."""
        return self.backend == "triton" or (self.backend == "auto" and t.is_cuda)

    def check_tables(self, device: torch.device) -> dict[str, int]:
        """Load the tables launches on ``device`` will read (a bad or missing
        file fails here, at start-up, not at the first launch; a named file is
        checked on any device, though only CUDA launches read tables) ->
        entries per table."""
        from ftserve_kernels import gemv_configs, moe_configs

        def entries(table: dict[str, dict[int, Any]]) -> int:
            return sum(map(len, table.values()))

        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            gemv, moe = gemv_configs.table_for(index, self.gemv_table), moe_configs.table_for(index, self.moe_table)
        else:
            gemv = gemv_configs.load_table(self.gemv_table) if self.gemv_table else {}
            moe = moe_configs.load_table(self.moe_table) if self.moe_table else {}
        return {"gemv": entries(gemv), "moe": entries(moe),
                "gemv_laid": entries(gemv_configs.parse_entries(self.gemv_entries))}

    def summary(self) -> dict[str, Any]:
        """The fields, for the start-up log and the engine summary."""
        return {"backend": self.backend, "pdl": self.pdl, "gemv_table": self.gemv_table or "packaged",
                "moe_table": self.moe_table or "packaged", "gemv_entries": self.gemv_entries,
                "dense_gemv": self.dense_gemv}


DEFAULT_KERNELS = KernelConfig()
