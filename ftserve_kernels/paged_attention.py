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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
# All-zero rows (and the dummy page) still get a finite, nonzero scale.
FP8_MIN_AMAX = 1e-8


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def quantize_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] -> (codes [..., D] float8_e4m3fn, scales [...] fp32), see the module docstring."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1).clamp_min(FP8_MIN_AMAX)  # [...]
    # An IEEE division on every device, as the kernels' div_rn: CUDA torch divides
    # by a Python number as a multiply by its rounded reciprocal (an ulp off).
    scale = amax / torch.full_like(amax, FP8_MAX)
    codes = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # [..., D], RNE
    return codes, scale


def dequantize_fp8_ref(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(codes [..., D], scales [...]) -> fp32 [..., D]."""
    return codes.float() * scale[..., None].float()


def _fp32(x: torch.Tensor) -> torch.Tensor:
    """x in fp32 (x itself when it already is: no dispatch on the CPU's step path)."""
    return x if x.dtype == torch.float32 else x.float()


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
        k_cache.index_copy_(0, out_cache_loc, k if k.dtype == k_cache.dtype else k.to(k_cache.dtype))
        v_cache.index_copy_(0, out_cache_loc, v if v.dtype == v_cache.dtype else v.to(v_cache.dtype))
        return
    assert k_scale is not None and v_scale is not None, "fp8 caches need their scales"
    for cache, scales, x in ((k_cache, k_scale, k), (v_cache, v_scale, v)):
        codes, sc = quantize_fp8_ref(x)  # [T, Hkv, D], [T, Hkv]
        # index_copy_ has no fp8 kernel on the CPU: move the code bytes as uint8.
        cache.view(torch.uint8).index_copy_(0, out_cache_loc, codes.view(torch.uint8))
        scales.index_copy_(0, out_cache_loc, sc.to(scales.dtype))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
          mask: torch.Tensor | None = None, causal: bool = False, gqa: bool = False) -> torch.Tensor:
    """q [B, Hq, n, D], k/v [B, Hkv, L, D] -> [B, Hq, n, D] (``gqa``: query head h
    reads KV head h // (Hq / Hkv), with no copy of K/V). 4-D operands: the shape
    torch's fused (flash) CPU kernel takes; 3-D ones fall back to the math path,
    which materializes every score."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                          enable_gqa=gqa)


def _gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows at ``slots`` [N] -> fp32 k, v [N, Hkv, D], fp8 codes dequantized."""
    if is_fp8(k_cache.dtype):
        assert k_scale is not None and v_scale is not None, "fp8 caches need their scales"
        return (dequantize_fp8_ref(k_cache[slots], k_scale[slots]),
                dequantize_fp8_ref(v_cache[slots], v_scale[slots]))
    return _fp32(k_cache.index_select(0, slots)), _fp32(v_cache.index_select(0, slots))


@dataclass(frozen=True)
class KVRows:
    """The cache rows each sequence attends over, from its page table, and the
    masks: the same for every layer of a batch, so worked out once
    (``kv_rows``; TorchAttentionBackend keeps it in ``batch.extras``).

    decode (one new token per sequence)::

        slots [B * L]       L = the longest sequence; a shorter one's tail repeats its first slot
        masks (keys [B, 1, 1, L] < its length, or None when all lengths are equal,)

    otherwise (any new tokens)::

        slots [sum L_b]     the sequences' rows back to back
        masks per sequence: None (no prefix: plain causal), or [n, L] key <= prefix + query
    """

    decode: bool
    slots: torch.Tensor  # [N] int64
    masks: tuple[torch.Tensor | None, ...]


def kv_rows(page_table: torch.Tensor, qo_indptr_host: list[int], seq_lens_host: list[int],
            page_size: int) -> KVRows:
    """KVRows of a batch (host lengths; device tensors, no device reads)."""
    n_seqs = len(seq_lens_host)
    dev = page_table.device
    offs = torch.arange(page_size, device=dev)
    if n_seqs and all(qo_indptr_host[b] == b for b in range(1, n_seqs + 1)):  # one token each
        longest = max(seq_lens_host)
        n_pages = (longest + page_size - 1) // page_size
        slots = (page_table[:, :n_pages].long()[:, :, None] * page_size + offs).reshape(n_seqs, -1)
        slots = slots[:, :longest]  # [B, L]
        if min(seq_lens_host) == longest:
            return KVRows(True, slots.reshape(-1), (None,))
        lens = torch.tensor(seq_lens_host, device=dev)
        valid = torch.arange(longest, device=dev)[None, :] < lens[:, None]  # [B, L]
        # Padding reads the sequence's first slot, not the (maybe garbage, NaN)
        # dummy page: a masked NaN key would still poison its row.
        slots = torch.where(valid, slots, slots[:, :1])
        return KVRows(True, slots.reshape(-1), (valid[:, None, None, :],))
    parts, masks = [], []
    for b in range(n_seqs):
        n_new = qo_indptr_host[b + 1] - qo_indptr_host[b]
        kv_len = seq_lens_host[b]
        n_pages = (kv_len + page_size - 1) // page_size
        parts.append((page_table[b, :n_pages].long()[:, None] * page_size + offs).reshape(-1)[:kv_len])
        prefix = kv_len - n_new
        masks.append(torch.ones(n_new, kv_len, dtype=torch.bool, device=dev).tril(prefix)
                     if prefix and n_new else None)
    slots = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=dev)
    return KVRows(False, slots, tuple(masks))


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
    rows: KVRows | None = None,  # kv_rows(page_table, ...), when the caller has it
) -> torch.Tensor:
    """Causal over the new tokens, full over the cached prefix; fp32 math
    (fp8 caches are dequantized with their scales first).

    Each sequence's K/V rows (KVRows) are gathered from the cache, then torch's
    scaled_dot_product_attention attends (causal when the sequence has no
    prefix, else under the mask ``key <= prefix + query``). A batch of one-token
    sequences (decode) is one call for all of them: the ``group`` query heads
    of a KV head are that head's query rows (no copy of K/V per query head).
    Loops over sequences with host-known lengths (no device reads).
    """
    assert not is_fp8(k_cache.dtype) or (k_scale is not None and v_scale is not None), \
        "fp8 caches need their scales"
    if rows is None:
        rows = kv_rows(page_table, qo_indptr_host, seq_lens_host, page_size)
    t, num_heads, d = q.shape
    num_kv = k_cache.shape[1]
    group = num_heads // num_kv
    k_all, v_all = _gather_kv(k_cache, v_cache, rows.slots, k_scale, v_scale)  # [N, Hkv, D]
    if rows.decode:
        #   q [B, Hq, D] -> [B, Hkv, group, D]: the rows of KV head h are query heads h*group ..
        #   k, v [B * L, Hkv, D] -> [B, Hkv, L, D]
        qb = _fp32(q).reshape(t, num_kv, group, d)
        k_b, v_b = k_all.view(t, -1, num_kv, d).transpose(1, 2), v_all.view(t, -1, num_kv, d).transpose(1, 2)
        o = _sdpa(qb, k_b, v_b, scale, rows.masks[0])
        o = o.reshape(t, num_heads, d)
        return o if o.dtype == q.dtype else o.to(q.dtype)
    out = torch.empty_like(q)
    kv0 = 0
    for b, mask in enumerate(rows.masks):
        q0, q1 = qo_indptr_host[b], qo_indptr_host[b + 1]
        kv_len = seq_lens_host[b]
        k, v = k_all[kv0:kv0 + kv_len], v_all[kv0:kv0 + kv_len]  # [L, Hkv, D]
        kv0 += kv_len
        if q1 == q0:
            continue
        qb = _fp32(q[q0:q1]).transpose(0, 1)[None]  # [1, Hq, n, D]
        # K/V head-major ([1, Hkv, L, D] contiguous): the fused kernel streams
        # each head's rows; the copy costs less than the strided reads.
        k, v = k.transpose(0, 1).contiguous()[None], v.transpose(0, 1).contiguous()[None]
        o = _sdpa(qb, k, v, scale, mask, causal=mask is None, gqa=group > 1)
        out[q0:q1] = o[0].transpose(0, 1)  # [n, Hq, D]
    return out


def gate_output(out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """out * sigmoid(gate) (Qwen3-Next's gated attention), out without a gate."""
    return out if gate is None else out * torch.sigmoid(gate)


class TorchAttentionBackend:
    """Reference attention backend: works on any device, used on the CPU and as
    the oracle for the Triton backend. Not CUDA-graph capturable (host loops)."""

    name = "torch"
    ROWS_KEY = "torch_attention.kv_rows"  # batch.extras key: (qo_indptr, KVRows), shared by the layers

    def __init__(self, scale: float | None = None) -> None:
        self.scale = scale

    def forward(self, q, k, v, layer, batch, kv_stored=False, out_gate=None):  # type: ignore[no-untyped-def]
        pool = batch.kv_pool
        meta = batch.attn
        ks, vs = pool.scales(layer)  # None, None unless the pool holds fp8 codes
        if not kv_stored:
            store_kv_ref(pool.k[layer], pool.v[layer], k, v, meta.out_cache_loc, ks, vs)
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        cached = batch.extras.get(self.ROWS_KEY)
        if cached is None:
            indptr = [0]
            for n in meta.extend_lens_host:
                indptr.append(indptr[-1] + n)
            cached = batch.extras[self.ROWS_KEY] = (
                indptr, kv_rows(meta.page_table, indptr, meta.seq_lens_host, meta.page_size))
        indptr, rows = cached
        out = paged_attention_ref(
            q, pool.k[layer], pool.v[layer], meta.page_table, indptr,
            meta.seq_lens_host, meta.page_size, scale, ks, vs, rows,
        )
        return gate_output(out, out_gate)
