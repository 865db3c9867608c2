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

An fp8 checkpoint's bank holds bytes (uint8), a row being the e4m3 codes and
the fp32 block scales of one expert (``Fp8Row``)::

    [ w13 codes 2I x H | w2 codes H x I | w13 scales | w2 scales | pad to 16 B ]

so a row, and a miss, is about half the bytes of the bf16 row; the blocks'
``w13_scale`` / ``w2_scale`` parameters are fp32 views of their part.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ftserve.models import fp8
from ftserve.models.config import ModelConfig
from ftserve.models.decoder import DecoderForCausalLM
from ftserve.models.layers import MoEBlock
from ftserve.models.loader import fill_dummy, fill_from_checkpoint, resolve_dtype, stored_names
from ftserve.models.registry import model_class
from ftserve_kernels.fp8_quant import FP8, Fp8Weight

# fill_dummy's init for expert matrices (see ftserve.models.loader.fill_dummy).
DUMMY_EXPERT_STD = 0.02


def moe_blocks(model: nn.Module) -> list[MoEBlock]:
    """The model's MoE blocks in layer order (index j = position in this list)."""
    return [m for m in model.modules() if isinstance(m, MoEBlock)]


@dataclass(frozen=True)
class Fp8Row:
    """Byte layout of one fp8 expert row (module docstring); (bn, bk) per weight."""

    hidden: int
    inter: int
    w13_block: tuple[int, int]
    w2_block: tuple[int, int]

    @property
    def w13_scale_shape(self) -> tuple[int, int]:
        (bn, bk), i, h = self.w13_block, self.inter, self.hidden
        return -(-2 * i // bn), -(-h // bk)

    @property
    def w2_scale_shape(self) -> tuple[int, int]:
        (bn, bk), i, h = self.w2_block, self.inter, self.hidden
        return -(-h // bn), -(-i // bk)

    @property
    def w2_col(self) -> int:  # byte offsets within a row
        return 2 * self.inter * self.hidden

    @property
    def w13_scale_col(self) -> int:
        return -(-3 * self.inter * self.hidden // 4) * 4

    @property
    def w2_scale_col(self) -> int:
        a, b = self.w13_scale_shape
        return self.w13_scale_col + 4 * a * b

    @property
    def row_bytes(self) -> int:
        a, b = self.w2_scale_shape
        return -(-(self.w2_scale_col + 4 * a * b) // 16) * 16

    def views(self, rows: torch.Tensor) -> tuple[Fp8Weight, Fp8Weight]:
        """rows [S, R] uint8 -> (w13 [S, 2I, H], w2 [S, H, I]) as Fp8Weight views."""
        s, i, h = rows.shape[0], self.inter, self.hidden
        words = rows.view(torch.float32)  # [S, R / 4]
        a13, b13 = self.w13_scale_shape
        a2, b2 = self.w2_scale_shape
        c13, c2 = self.w13_scale_col // 4, self.w2_scale_col // 4
        w13 = Fp8Weight(rows[:, :2 * i * h].view(FP8).view(s, 2 * i, h),
                        words[:, c13:c13 + a13 * b13].view(s, a13, b13), *self.w13_block)
        w2 = Fp8Weight(rows[:, self.w2_col:self.w2_col + h * i].view(FP8).view(s, h, i),
                       words[:, c2:c2 + a2 * b2].view(s, a2, b2), *self.w2_block)
        return w13, w2


@dataclass
class HostBank:
    data: torch.Tensor  # [Lm * E, R] on the host, pinned when serving a CUDA device
    num_layers: int  # Lm, MoE layers only
    num_experts: int  # E per layer
    hidden: int  # H
    inter: int  # I
    fp8: Fp8Row | None = None  # fp8 experts: data is uint8 rows of this layout

    @staticmethod
    def allocate(num_layers: int, num_experts: int, hidden: int, inter: int,
                 dtype: torch.dtype, pin: bool, fp8_row: Fp8Row | None = None) -> HostBank:
        if fp8_row is not None:
            data = torch.empty(num_layers * num_experts, fp8_row.row_bytes, dtype=torch.uint8, pin_memory=pin)
            return HostBank(data, num_layers, num_experts, hidden, inter, fp8_row)
        row = 3 * inter * hidden
        data = torch.empty(num_layers * num_experts, row, dtype=dtype, pin_memory=pin)
        return HostBank(data, num_layers, num_experts, hidden, inter)

    def expert_views(self, rows: torch.Tensor) -> tuple[torch.Tensor | Fp8Weight, torch.Tensor | Fp8Weight]:
        """rows [S, R] laid out as bank rows (the bank, or VRAM slots) -> (w13 [S, 2I, H],
        w2 [S, H, I]): strided views (row stride R), Fp8Weight views for fp8 rows."""
        if self.fp8 is not None:
            return self.fp8.views(rows)
        s, h, i = rows.shape[0], self.hidden, self.inter
        return rows[:, : 2 * i * h].view(s, 2 * i, h), rows[:, 2 * i * h:].view(s, h, i)

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
        """Layer j's gate/up weights (fp8: codes) as a view [E, 2I, H] (row stride R)."""
        return self.layer_params(j)["w13"]

    def w2(self, j: int) -> torch.Tensor:
        """Layer j's down weights (fp8: codes) as a view [E, H, I] (row stride R)."""
        return self.layer_params(j)["w2"]

    def layer_params(self, j: int) -> dict[str, torch.Tensor]:
        """Layer j's expert parameters as views of the bank (row stride R):
        w13 [E, 2I, H], w2 [E, H, I] (fp8: codes, + w13_scale / w2_scale)."""
        e = self.num_experts
        w13, w2 = self.expert_views(self.data[j * e:(j + 1) * e])
        if isinstance(w13, Fp8Weight) and isinstance(w2, Fp8Weight):
            return {"w13": w13.codes, "w2": w2.codes, "w13_scale": w13.scale, "w2_scale": w2.scale}
        assert isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor)
        return {"w13": w13, "w2": w2}


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def _expert_params(blk: MoEBlock) -> list[str]:
    return ["w13", "w2"] + (["w13_scale", "w2_scale"] if blk.is_fp8 else [])


def _placeholders(blocks: list[MoEBlock]) -> None:
    """Swap each block's expert params for empty ones of the same kind."""
    for blk in blocks:
        for name in _expert_params(blk):
            p = getattr(blk, name)
            setattr(blk, name, _param(p.new_empty((0, *p.shape[1:]))))


def _fp8_row(blocks: list[MoEBlock], cfg: ModelConfig) -> Fp8Row | None:
    kinds = {tuple(sorted(b.fp8_blocks.items())) for b in blocks}
    if len(kinds) != 1:
        raise ValueError("--moe-cache-size needs every MoE layer's experts in one format (all fp8 or none)")
    if not blocks[0].is_fp8:
        return None
    return Fp8Row(cfg.hidden_size, cfg.moe_intermediate_size, blocks[0].fp8_blocks["w13"],
                  blocks[0].fp8_blocks["w2"])


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
        if cfg.quant is not None:  # as loader.build_model: the fp8 weights first
            fp8.convert(model, cfg.quant, stored_names(cfg, model_dir, load_format))
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError(f"{model_dir} has no MoE layers; --moe-cache-size applies to MoE models only")
    bank = HostBank.allocate(len(blocks), cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                             torch_dtype, pin=device.type == "cuda", fp8_row=_fp8_row(blocks, cfg))
    _placeholders(blocks)  # meta, zero-size: to_empty allocates no expert memory on the device
    model.to_empty(device=device)
    model.init_buffers()
    model.eval()
    host_views = [{n: _param(v) for n, v in bank.layer_params(j).items()} for j in range(len(blocks))]

    def attach(views: list[dict[str, nn.Parameter]]) -> None:
        for blk, params in zip(blocks, views):
            for name, p in params.items():
                setattr(blk, name, p)

    if load_format in ("safetensors", "auto"):
        attach(host_views)
        fill_from_checkpoint(model, model_dir)
    elif load_format == "dummy":
        if device.type == "cpu":
            # normal_ draws a strided view in another order than a contiguous
            # tensor: fill contiguous stand-ins (resident mode's exact values),
            # then move them into the bank. CPU only, so the extra copy is small.
            stand_ins = [{n: _param(torch.empty_like(v)) for n, v in views.items()} for views in host_views]
            attach(stand_ins)
            fill_dummy(model, seed)
            for stand, views in zip(stand_ins, host_views):
                for name, v in views.items():
                    v.copy_(stand[name])
            attach(host_views)
        else:
            # fill_dummy draws on the device: it sees the empty placeholders still
            # in place; the bank is filled layer by layer through a device stage.
            fill_dummy(model, seed)
            attach(host_views)
            _fill_bank_dummy(bank, device, seed, torch_dtype)
    else:
        raise ValueError(f"load_format must be safetensors or dummy, got {load_format!r}")
    return model, cfg, bank


def _fill_bank_dummy(bank: HostBank, device: torch.device, seed: int, dtype: torch.dtype) -> None:
    """Every layer's experts drawn on the device (N(0, DUMMY_EXPERT_STD) in the model
    ``dtype``, a bf16 bank row's layout), then copied into the bank; an fp8 bank gets
    the same draw block-quantized (fp8.quantize_into), so fp8 and bf16 banks
    of one seed hold the same experts up to the quantization and route alike."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed + 1)
    e, i, h = bank.num_experts, bank.inter, bank.hidden
    stage = torch.empty(e, bank.row_elems, dtype=bank.data.dtype, device=device)  # [E, R]
    for j in range(bank.num_layers):
        if bank.fp8 is None:
            stage.normal_(0.0, DUMMY_EXPERT_STD, generator=gen)
        else:
            draw = torch.empty(e, 3 * i * h, dtype=dtype, device=device)  # the bf16 bank's rows
            draw.normal_(0.0, DUMMY_EXPERT_STD, generator=gen)
            stage.zero_()
            w13, w2 = bank.fp8.views(stage)
            fp8.quantize_into(w13, draw[:, :2 * i * h].view(e, 2 * i, h))
            fp8.quantize_into(w2, draw[:, 2 * i * h:].view(e, h, i))
            del draw
        bank.data[j * e:(j + 1) * e].copy_(stage)  # start-up only: a blocking copy is fine
