"""Rotary tables: the fp32 cos|sin table [max_len, rot_dim] for each rope type.

Frequencies are computed exactly as the HF reference does (same formulas, same
fp32 order of operations), so logits match transformers bit for bit in fp32
for the static types (default, linear, yarn, llama3).

Dynamic NTK is the exception. HF recomputes the base from the current sequence
length (and uses the unscaled base while the sequence fits the original
context); one static table cannot do that. We scale the base for the table's
length ``max_len`` once, as a static table. It equals HF only while
``max_len <= max_position_embeddings`` (the table is then the unscaled one);
a longer table applies the long-context base to every position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """The ``rope_scaling`` / ``rope_parameters`` fields we use, normalized."""

    rope_type: str = "default"
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    # llama3
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    # yarn
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # Per-frequency divisors of the inverse frequencies, applied after the type's own
    # scaling (a GGUF's rope_freqs tensor: llama.cpp's form of Llama 3.1's long rope).
    freq_factors: tuple[float, ...] | None = None

    @staticmethod
    def from_hf(params: dict | None, max_position_embeddings: int) -> RopeScaling:
        if not params:
            return RopeScaling()
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_scaling type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
            )
        orig = params.get("original_max_position_embeddings")
        if orig is None and rope_type in ("yarn", "llama3"):
            orig = max_position_embeddings  # HF's fallback
        factor = params.get("factor")
        if rope_type in ("linear", "dynamic", "llama3") and factor is None:
            raise ValueError(f"rope_scaling type {rope_type!r} needs a 'factor'")
        if rope_type == "llama3" and (
            params.get("low_freq_factor") is None or params.get("high_freq_factor") is None
        ):
            raise ValueError("rope_scaling type 'llama3' needs low_freq_factor and high_freq_factor")
        return RopeScaling(
            rope_type=rope_type,
            factor=None if factor is None else float(factor),
            original_max_position_embeddings=None if orig is None else int(orig),
            low_freq_factor=params.get("low_freq_factor"),
            high_freq_factor=params.get("high_freq_factor"),
            beta_fast=params.get("beta_fast"),
            beta_slow=params.get("beta_slow"),
            attention_factor=params.get("attention_factor"),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            truncate=bool(params.get("truncate", True)),
        )


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # [dim/2]


def _yarn(s: RopeScaling, base: float, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    orig = s.original_max_position_embeddings or max_pos
    factor = s.factor if s.factor is not None else max_pos / orig

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = s.attention_factor
    if attn is None:
        if s.mscale and s.mscale_all_dim:
            attn = float(get_mscale(factor, s.mscale) / get_mscale(factor, s.mscale_all_dim))
        else:
            attn = get_mscale(factor)
    beta_fast = s.beta_fast or 32
    beta_slow = s.beta_slow or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF avoids the singular ramp the same way
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)  # [dim/2]
    extrapolation = 1 - ramp  # 1 keeps the original frequency, 0 interpolates
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attn)


def _llama3(s: RopeScaling, base: float, dim: int) -> torch.Tensor:
    inv = _base_inv_freq(base, dim)
    assert s.factor is not None and s.low_freq_factor is not None and s.high_freq_factor is not None
    orig = s.original_max_position_embeddings
    assert orig is not None
    low_wavelen = orig / s.low_freq_factor
    high_wavelen = orig / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (orig / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def inv_freq_and_scale(
    s: RopeScaling, base: float, rot_dim: int, max_position_embeddings: int, max_len: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rot_dim/2] fp32 and the attention scaling folded into cos/sin."""
    inv, scale = _scaled_inv_freq(s, base, rot_dim, max_position_embeddings, max_len)
    if s.freq_factors is not None:
        inv = inv / torch.tensor(s.freq_factors, dtype=torch.float32)
    return inv, scale


def _scaled_inv_freq(
    s: RopeScaling, base: float, rot_dim: int, max_position_embeddings: int, max_len: int
) -> tuple[torch.Tensor, float]:
    if s.rope_type == "default":
        return _base_inv_freq(base, rot_dim), 1.0
    if s.rope_type == "linear":
        assert s.factor is not None
        return _base_inv_freq(base, rot_dim) / s.factor, 1.0
    if s.rope_type == "dynamic":
        assert s.factor is not None
        seq_len = max(max_len, max_position_embeddings)
        scaled = base * (
            (s.factor * seq_len / max_position_embeddings) - (s.factor - 1)
        ) ** (rot_dim / (rot_dim - 2))
        return _base_inv_freq(scaled, rot_dim), 1.0
    if s.rope_type == "yarn":
        return _yarn(s, base, rot_dim, max_position_embeddings)
    if s.rope_type == "llama3":
        return _llama3(s, base, rot_dim), 1.0
    raise ValueError(f"unknown rope type {s.rope_type!r}")


def build_cos_sin(
    s: RopeScaling, base: float, rot_dim: int, max_position_embeddings: int, max_len: int
) -> torch.Tensor:
    """The table rotary() reads: [max_len, rot_dim] fp32, cos | sin halves, built on
    the CPU (the caller moves it) so every device sees the same values."""
    inv, scale = inv_freq_and_scale(s, base, rot_dim, max_position_embeddings, max_len)
    pos = torch.arange(max_len, dtype=torch.int64).float()  # [L]
    freqs = pos[:, None] * inv[None, :]  # [L, rot/2]
    return torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1)  # [L, rot_dim]
