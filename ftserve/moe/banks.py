"""Host banks: every expert of every MoE layer in (pinned) host memory, and the
loader path that fills them straight from safetensors (or dummy values)
without ever placing the experts on the device.

One bank for the whole model, one contiguous row per expert::

    bank [Lm * E, R]      R = 2I*H + H*I elements of the model dtype
    row id = j * E + e    (j = index among the MoE layers, e = expert)
           = [ w13 (gate rows then up rows), 2I x H | w2 (down), H x I ]

A row is exactly what one VRAM slot holds, so a miss is one contiguous copy.
Each MoE block's ``w13`` / ``w2`` parameters become strided views of the bank
([E, 2I, H] with row stride R), so the checkpoint loader writes into the bank
through the same targets it uses for resident weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ftserve.models.config import ModelConfig
from ftserve.models.decoder import DecoderForCausalLM
from ftserve.models.layers import MoEBlock
from ftserve.models.loader import fill_dummy, fill_from_checkpoint, resolve_dtype
from ftserve.models.registry import model_class

# fill_dummy's init for expert matrices (see ftserve.models.loader.fill_dummy).
DUMMY_EXPERT_STD = 0.02


def moe_blocks(model: nn.Module) -> list[MoEBlock]:
    """The model's MoE blocks in layer order (index j = position in this list)."""
    return [m for m in model.modules() if isinstance(m, MoEBlock)]


@dataclass
class HostBank:
    data: torch.Tensor  # [Lm * E, R] on the host, pinned when serving a CUDA device
    num_layers: int  # Lm, MoE layers only
    num_experts: int  # E per layer
    hidden: int  # H
    inter: int  # I

    @staticmethod
    def allocate(num_layers: int, num_experts: int, hidden: int, inter: int,
                 dtype: torch.dtype, pin: bool) -> HostBank:
        row = 3 * inter * hidden
        data = torch.empty(num_layers * num_experts, row, dtype=dtype, pin_memory=pin)
        return HostBank(data, num_layers, num_experts, hidden, inter)

    @property
    def row_elems(self) -> int:
        return self.data.shape[1]

    @property
    def row_bytes(self) -> int:
        return self.row_elems * self.data.element_size()

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def w13(self, j: int) -> torch.Tensor:
        """Layer j's gate/up weights as a view [E, 2I, H] (row stride R)."""
        e, h, i = self.num_experts, self.hidden, self.inter
        return self.data[j * e:(j + 1) * e, : 2 * i * h].view(e, 2 * i, h)

    def w2(self, j: int) -> torch.Tensor:
        """Layer j's down weights as a view [E, H, I] (row stride R)."""
        e, h, i = self.num_experts, self.hidden, self.inter
        return self.data[j * e:(j + 1) * e, 2 * i * h:].view(e, h, i)


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def _placeholders(blocks: list[MoEBlock]) -> list[tuple[nn.Parameter, nn.Parameter]]:
    """Swap each block's expert params for empty ones of the same kind; return the old."""
    old = []
    for blk in blocks:
        old.append((blk.w13, blk.w2))
        blk.w13 = _param(blk.w13.new_empty((0, *blk.w13.shape[1:])))
        blk.w2 = _param(blk.w2.new_empty((0, *blk.w2.shape[1:])))
    return old


@torch.no_grad()
def load_offloaded_model(
    model_dir: str | Path, dtype: str | torch.dtype, device: torch.device, load_format: str,
    *, seed: int = 0,
) -> tuple[DecoderForCausalLM, ModelConfig, HostBank]:
    """Like ftserve.models.loader.load_model, but every expert lands in a host bank.

    Non-expert weights are materialized on ``device`` once; the experts are never
    allocated there. On the CPU the dummy values equal resident mode's exactly
    (same parameter order, same generator); on CUDA the experts are drawn on the
    device one layer at a time and copied into the pinned bank.
    """
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_pretrained(model_dir)
    torch_dtype = resolve_dtype(dtype, device)
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg, torch_dtype)
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError(f"{model_dir} has no MoE layers; --moe-cache-size applies to MoE models only")
    bank = HostBank.allocate(len(blocks), cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                             torch_dtype, pin=device.type == "cuda")
    _placeholders(blocks)  # meta, zero-size: to_empty allocates no expert memory on the device
    model.to_empty(device=device)
    model.init_buffers()
    model.eval()
    host_views = [(_param(bank.w13(j)), _param(bank.w2(j))) for j in range(len(blocks))]

    def attach() -> None:
        for blk, (w13, w2) in zip(blocks, host_views):
            blk.w13, blk.w2 = w13, w2

    if load_format in ("safetensors", "auto"):
        attach()
        fill_from_checkpoint(model, model_dir)
    elif load_format == "dummy":
        if device.type == "cpu":
            # normal_ draws a strided view in another order than a contiguous
            # tensor: fill contiguous stand-ins (resident mode's exact values),
            # then move them into the bank. CPU only, so the extra copy is small.
            stand_ins = [(_param(torch.empty_like(a)), _param(torch.empty_like(b))) for a, b in host_views]
            for blk, (w13, w2) in zip(blocks, stand_ins):
                blk.w13, blk.w2 = w13, w2
            fill_dummy(model, seed)
            for (w13, w2), (h13, h2) in zip(stand_ins, host_views):
                h13.copy_(w13)
                h2.copy_(w2)
            attach()
        else:
            # fill_dummy draws on the device: it sees the empty placeholders still
            # in place; the bank is filled layer by layer through a device stage.
            fill_dummy(model, seed)
            attach()
            _fill_bank_dummy(bank, device, seed)
    else:
        raise ValueError(f"load_format must be safetensors or dummy, got {load_format!r}")
    return model, cfg, bank


def _fill_bank_dummy(bank: HostBank, device: torch.device, seed: int) -> None:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed + 1)
    e = bank.num_experts
    stage = torch.empty(e, bank.row_elems, dtype=bank.data.dtype, device=device)  # [E, R]
    for j in range(bank.num_layers):
        stage.normal_(0.0, DUMMY_EXPERT_STD, generator=gen)
        bank.data[j * e:(j + 1) * e].copy_(stage)  # start-up only: a blocking copy is fine
