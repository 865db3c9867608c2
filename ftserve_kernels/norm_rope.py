"""RMSNorm and rotary embedding: torch reference twins (see ops.py for dispatch).

Numerics follow the HF reference implementations: the norm runs in fp32 and
casts back to the input dtype before the weight multiply (a zero-centered
norm, Qwen3-Next's, scales by 1 + w in fp32 and rounds once); rotary applies the
neox ("rotate half") convention with a precomputed fp32 cos|sin table.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    """x [T, H] (or [..., H]), w [H] -> [T, H] in x's dtype. ``zero_centered``
    (Qwen3-Next): norm(x) * (1 + w), all in fp32 and rounded once."""
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)  # [T, 1]
    if zero_centered:
        return (xf * torch.rsqrt(var + eps) * (1.0 + w.float())).to(x.dtype)
    normed = (xf * torch.rsqrt(var + eps)).to(x.dtype)  # [T, H]
    return (w * normed).to(x.dtype)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] -> SiLU(gate) * up [T, I] in its dtype, written over the gate
    half (a view: no [T, I] buffer; the down linear reads the strided rows)."""
    inter = gate_up.shape[1] // 2
    return F.silu(gate_up[:, :inter], inplace=True).mul_(gate_up[:, inter:])


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float, zero_centered: bool = False,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); the sum is the next residual.

    The sum is taken in the input dtype, as the HF decoder layers do. ``shared`` =
    (y [T, H], logit [T, 1]): x is a MoE block's routed experts and y its shared
    expert, weighed by sigmoid(logit) (Qwen3-Next): x + sigmoid(logit) * y is what
    is added to the residual, each op rounded to the dtype as the reference's.
    """
    if shared is not None:
        y, logit = shared
        x = x + torch.sigmoid(logit) * y
    summed = x + residual  # [T, H]
    return rms_norm_ref(summed, w, eps, zero_centered), summed


def gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated DeltaNet's output norm: w * norm(x) * SiLU(gate) over the last dim, x
    [T, NH, D]; gate [T, G, NH / G, D] (value heads grouped by key head, as a
    view into the input projection) or [T, NH, D]. The norm in fp32, rounded to
    x's dtype before the weight, the gate's SiLU in fp32 (the reference's)."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return ((w * normed) * F.silu(gate.reshape(x.shape).float())).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, Hx, D]; cos/sin [T, 1, rot/2] fp32. Dims past rot_dim pass through
    # unrotated (partial rotary); none of the supported families use it today.
    rot = 2 * cos.shape[-1]
    xr = x if rot == x.shape[-1] else x[..., :rot]
    x1, x2 = xr.float().chunk(2, dim=-1)
    # (x1 cos - x2 sin | x2 cos + x1 sin), each half written in place into one
    # buffer: the same roundings as the plain expressions, fewer passes on the CPU.
    out = torch.empty(xr.shape, dtype=torch.float32, device=x.device)  # [T, Hx, rot]
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=o1).sub_(x2 * sin)
    torch.mul(x2, cos, out=o2).add_(x1 * sin)
    out = out.to(x.dtype)
    return out if xr is x else torch.cat((out, x[..., rot:]), dim=-1)


def rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary. q [T, Hq, D], k [T, Hkv, D], positions [T] int64,
    cos_sin [max_pos, rot_dim] fp32 = cos | sin halves (any attention scaling,
    e.g. yarn's mscale, is already folded into the table). Returns new tensors.
    """
    cos, sin = cos_sin.index_select(0, positions)[:, None].chunk(2, dim=-1)  # [T, 1, rot/2] each
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def qk_norm_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, q_w: torch.Tensor | None, k_w: torch.Tensor | None, eps: float,
    positions: torch.Tensor, cos_sin: torch.Tensor,
    kv_store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    zero_centered: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q [T, Hq, D] and k [T, Hkv, D] (weights q_w/k_w [D];
    None: no norms, the rotary alone), then neox rotary: what Qwen3 attention does
    before the KV store. ``kv_store`` = (k_cache, v_cache, v, out_cache_loc): then
    also that store (float caches). ``zero_centered``: the norms are (rms_norm_ref's)."""
    if q_w is not None and k_w is not None:
        q = rms_norm_ref(q, q_w, eps, zero_centered)  # [T, Hq, D]
        k = rms_norm_ref(k, k_w, eps, zero_centered)  # [T, Hkv, D]
    qo, ko = rotary_ref(q, k, positions, cos_sin)
    if kv_store is not None:
        kc, vc, v, loc = kv_store
        kc.index_copy_(0, loc, ko.to(kc.dtype))
        vc.index_copy_(0, loc, v.to(vc.dtype))
    return qo, ko
