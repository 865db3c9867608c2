"""Attention over the paged KV cache, and the KV store into pages.

Reference twins (plain torch, any device) live here; Triton kernels with the
same signatures sit beside them. Shapes:

    q        [T, Hq, D]         new tokens' queries, packed (see ForwardBatch)
    k_cache  [slots, Hkv, D]    one layer of the pool
    page_table [B, max_pages]   int32, padded with the dummy page 0
    qo_indptr  [B+1]            int32
    seq_lens / prefix_lens [B]  int32

fp8 KV (``float8_e4m3fn`` caches): each (slot, KV head) row of D values is
stored as codes plus one fp32 scale in ``k_scale`` / ``v_scale`` [slots, Hkv]::

    scale = max(amax(|x|) over D, FP8_MIN_AMAX) / 448     code = rne_e4m3(x / scale)
    x ~= code * scale   (|error| <= 2**-4 * |x| for normal codes, <= scale * 2**-10 below)

A per-token scale keeps a later token from changing an earlier one's codes, so a
store never rewrites a page it does not own.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
# All-zero rows (and the dummy page) still get a finite, nonzero scale.
FP8_MIN_AMAX = 1e-8


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def quantize_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] -> (codes [..., D] float8_e4m3fn, scales [...] fp32), see the module docstring."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp_min(FP8_MIN_AMAX) / FP8_MAX  # [...]
    codes = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # [..., D], RNE
    return codes, scale


def dequantize_fp8_ref(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(codes [..., D], scales [...]) -> fp32 [..., D]."""
    return codes.float() * scale[..., None].float()


def store_kv_ref(
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,
    out_cache_loc: torch.Tensor,  # [T] int64
    k_scale: torch.Tensor | None = None,  # [slots, Hkv] fp32, fp8 caches only
    v_scale: torch.Tensor | None = None,
) -> None:
    if not is_fp8(k_cache.dtype):
        k_cache.index_copy_(0, out_cache_loc, k.to(k_cache.dtype))
        v_cache.index_copy_(0, out_cache_loc, v.to(v_cache.dtype))
        return
    assert k_scale is not None and v_scale is not None, "fp8 caches need their scales"
    for cache, scales, x in ((k_cache, k_scale, k), (v_cache, v_scale, v)):
        codes, sc = quantize_fp8_ref(x)  # [T, Hkv, D], [T, Hkv]
        # index_copy_ has no fp8 kernel on the CPU: move the code bytes as uint8.
        cache.view(torch.uint8).index_copy_(0, out_cache_loc, codes.view(torch.uint8))
        scales.index_copy_(0, out_cache_loc, sc.to(scales.dtype))


def paged_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # [B, max_pages]
    qo_indptr_host: list[int],
    seq_lens_host: list[int],
    page_size: int,
    scale: float,
    k_scale: torch.Tensor | None = None,  # [slots, Hkv] fp32, fp8 caches only
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal over the new tokens, full over the cached prefix; fp32 math
    (fp8 caches are dequantized with their scales first).

    Loops over sequences with host-known lengths (no device reads).
    """
    fp8 = is_fp8(k_cache.dtype)
    assert not fp8 or (k_scale is not None and v_scale is not None), "fp8 caches need their scales"
    num_heads = q.shape[1]
    num_kv = k_cache.shape[1]
    group = num_heads // num_kv
    out = torch.empty_like(q)
    offs = torch.arange(page_size, device=q.device)
    for b in range(len(seq_lens_host)):
        q0, q1 = qo_indptr_host[b], qo_indptr_host[b + 1]
        n_new = q1 - q0
        kv_len = seq_lens_host[b]
        prefix = kv_len - n_new
        n_pages = (kv_len + page_size - 1) // page_size
        slots = (page_table[b, :n_pages].long()[:, None] * page_size + offs[None, :]).reshape(-1)
        slots = slots[:kv_len]
        if fp8:
            assert k_scale is not None and v_scale is not None
            k = dequantize_fp8_ref(k_cache[slots], k_scale[slots])  # [L, Hkv, D]
            v = dequantize_fp8_ref(v_cache[slots], v_scale[slots])
        else:
            k = k_cache.index_select(0, slots).float()  # [L, Hkv, D]
            v = v_cache.index_select(0, slots).float()
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        qb = q[q0:q1].float()  # [n, Hq, D]
        scores = torch.einsum("nhd,lhd->hnl", qb, k) * scale  # [Hq, n, L]
        qpos = prefix + torch.arange(n_new, device=q.device)
        kpos = torch.arange(kv_len, device=q.device)
        mask = kpos[None, :] > qpos[:, None]  # [n, L]
        scores = scores.masked_fill(mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q0:q1] = torch.einsum("hnl,lhd->nhd", probs, v).to(q.dtype)
    return out


class TorchAttentionBackend:
    """Reference attention backend: works on any device, used on the CPU and as
    the oracle for the Triton backend. Not CUDA-graph capturable (host loops)."""

    name = "torch"

    def __init__(self, scale: float | None = None) -> None:
        self.scale = scale

    def forward(self, q, k, v, layer, batch, kv_stored=False):  # type: ignore[no-untyped-def]
        pool = batch.kv_pool
        meta = batch.attn
        ks, vs = pool.scales(layer)  # None, None unless the pool holds fp8 codes
        if not kv_stored:
            store_kv_ref(pool.k[layer], pool.v[layer], k, v, meta.out_cache_loc, ks, vs)
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        indptr = [0]
        for n in meta.extend_lens_host:
            indptr.append(indptr[-1] + n)
        return paged_attention_ref(
            q, pool.k[layer], pool.v[layer], meta.page_table, indptr,
            meta.seq_lens_host, meta.page_size, scale, ks, vs,
        )
