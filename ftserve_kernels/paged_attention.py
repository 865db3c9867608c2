"""Attention over the paged KV cache, and the KV store into pages.

Reference twins (plain torch, any device) live here; Triton kernels with the
same signatures sit beside them. Shapes:

    q        [T, Hq, D]         new tokens' queries, packed (see ForwardBatch)
    k_cache  [slots, Hkv, D]    one layer of the pool
    page_table [B, max_pages]   int32, padded with the dummy page 0
    qo_indptr  [B+1]            int32
    seq_lens / prefix_lens [B]  int32
"""

from __future__ import annotations

import torch


def store_kv_ref(
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,
    out_cache_loc: torch.Tensor,  # [T] int64
) -> None:
    k_cache.index_copy_(0, out_cache_loc, k.to(k_cache.dtype))
    v_cache.index_copy_(0, out_cache_loc, v.to(v_cache.dtype))


def paged_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # [B, max_pages]
    qo_indptr_host: list[int],
    seq_lens_host: list[int],
    page_size: int,
    scale: float,
) -> torch.Tensor:
    """Causal over the new tokens, full over the cached prefix; fp32 math.

    Loops over sequences with host-known lengths (no device reads).
    """
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

    def forward(self, q, k, v, layer, batch):  # type: ignore[no-untyped-def]
        pool = batch.kv_pool
        meta = batch.attn
        store_kv_ref(pool.k[layer], pool.v[layer], k, v, meta.out_cache_loc)
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        indptr = [0]
        for n in meta.extend_lens_host:
            indptr.append(indptr[-1] + n)
        return paged_attention_ref(
            q, pool.k[layer], pool.v[layer], meta.page_table, indptr,
            meta.seq_lens_host, meta.page_size, scale,
        )
