"""Triton attention over the paged KV cache: KV store and the backend.

Twins of ``paged_attention.store_kv_ref`` / ``paged_attention_ref``. Shapes as in
``paged_attention.py``; the cache is one layer of the pool ``[slots, Hkv, D]``
(last dim contiguous), ``slot = page * page_size + offset``.

Decode (one query per sequence) splits every sequence's KV range over a fixed
number of programs so one 100k-token request still fills the GPU. Its tiles
of ``decode_block_n`` tokens are dealt out in turn, tile t to split t % S: a
split's first tile is then known before the sequence length is, so its page
entries load alongside it::

    seq b tiles:  0  1  2 .. S-1 | S  S+1 .. 2S-1 | 2S ..    (S fixed per batch size)
    split:        0  1  2 .. S-1 | 0  1   .. S-1  | 0  ..
                  partial (o, lse) per split  ->  reduce kernel  ->  o[b, h]

Each split program serves all query heads of one KV head (GQA), so K/V are read
once per KV head. Which tiles exist comes from ``seq_lens`` on the device: the grid
is ``(B, Hkv, S)`` and never depends on device values, so a decode step can be
captured in a CUDA graph. What must stay static between capture and replay:
q/k/v/out buffers, the pool, ``page_table`` (fixed width), ``seq_lens`` and
``out_cache_loc`` tensors (refill them in place), and the split count (a
function of the batch size only, see ``TritonAttentionBackend.num_splits``).
The decode kernels live in attention_decode_triton.py, the shared helpers and
``AttnKernelConfig`` in attention_common.py (both re-exported here).

``TritonAttentionBackend`` launches the store, decode and extend kernels. The
extend kernels (plain and split-K, their grids and their CUDA-graph contract)
live in attention_extend_triton.py.

fp8 pools (``float8_e4m3fn`` caches, format in ``paged_attention``): the store
kernel quantizes each (token, KV head) row with its own scale; decode and
extend load codes plus per-key scales, cast codes to q's dtype (exact), scale
the score columns by the K scales and the V rows by the V scales, so no
dequantized copy of a page ever exists. The scale tensors are as static as the
pool, so graph capture is unchanged; ``FP8`` is a constexpr (one specialization).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from ftserve_kernels.attention_common import (  # noqa: F401  (re-exported names)
    LOG2E,
    AttnKernelConfig,
    interpreting,
    mma,
    mma_acc,
    quantize_e4m3,
    scale_args,
)
from ftserve_kernels.attention_decode_triton import (  # noqa: F401  (re-exported names)
    MAX_VERIFY_ROWS,
    DecodeQK,
    _decode_reduce_kernel,
    _decode_split_kernel,
    decode_attention_triton,
)
from ftserve_kernels.attention_extend_triton import extend_attention_triton, extend_num_splits
from ftserve_kernels.paged_attention import gate_output

if TYPE_CHECKING:
    from ftserve.models.forward_batch import AttentionMetadata, ForwardBatch


# ---------------------------------------------------------------- KV store


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, loc_ptr, ks_ptr, vs_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch, stride_ss,
    HKV: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
):
    t = tl.program_id(0)
    loc = tl.load(loc_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    hmask = h < HKV
    mask = hmask[:, None] & (d[None, :] < D)
    dst = loc * stride_cs + h[:, None] * stride_ch + d[None, :]
    kk = tl.load(k_ptr + t.to(tl.int64) * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask,
                 other=0.0)  # [H, D]
    vv = tl.load(v_ptr + t.to(tl.int64) * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask,
                 other=0.0)  # [H, D]
    if FP8:
        # One scale per (token, KV head) over D; padded lanes load 0 and cannot raise amax.
        kq, ksc = quantize_e4m3(kk.to(tl.float32), 1)  # [H, D], [H]
        vq, vsc = quantize_e4m3(vv.to(tl.float32), 1)
        tl.store(kc_ptr + dst, kq.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + dst, vq.to(vc_ptr.dtype.element_ty), mask=mask)
        tl.store(ks_ptr + loc * stride_ss + h, ksc, mask=hmask)
        tl.store(vs_ptr + loc * stride_ss + h, vsc, mask=hmask)
    else:
        tl.store(kc_ptr + dst, kk.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + dst, vv.to(vc_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,
    out_cache_loc: torch.Tensor,  # [T] int64
    k_scale: torch.Tensor | None = None,  # [slots, Hkv] fp32, fp8 caches only
    v_scale: torch.Tensor | None = None,
) -> None:
    t, hkv, d = k.shape
    if t == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride()
    ks, vs, stride_ss, fp8 = scale_args(k_cache, k_scale, v_scale)
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, out_cache_loc, ks, vs,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1),
        stride_ss,
        HKV=hkv, D=d, BLOCK_H=triton.next_power_of_2(hkv), BLOCK_D=triton.next_power_of_2(d),
        FP8=fp8,
    )


# ---------------------------------------------------------------- backend


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


class TritonAttentionBackend:
    """AttentionBackend (see forward_batch.py) on Triton kernels.

    Decode batches (``batch.is_decode``, or any batch with one new token per
    sequence) take the split-K path, which is CUDA-graph capturable; everything
    else takes the extend path. ``num_splits`` depends only on the batch size and
    the KV head count, so a graph captured for batch size B stays valid.

    ``extend_token_bound``: when set (the prefill chunk size), extend grids are
    sized from it instead of the batch's ``max_extend_len``, so a prefill chunk
    can be captured once per token budget and replayed (see
    attention_extend_triton's module docstring); the one-token-per-sequence
    shortcut to the decode kernel is then taken only for ``batch.is_decode``,
    since ``max_extend_len`` may change between replays.

    Extend steps whose plain grid leaves SMs idle (few new tokens over a long
    prefix) take the split-K extend at ``extend_splits`` splits, chosen from the
    token bound and ``max_seq_len`` (host values; a graph's are static);
    the constructor's ``extend_splits`` fixes the count instead (tests, benches).
    """

    name = "triton"

    def __init__(
        self, scale: float | None = None, cfg: AttnKernelConfig | None = None,
        extend_token_bound: int | None = None, extend_splits: int | None = None,
    ) -> None:
        self.scale = scale
        self.cfg = cfg
        self.extend_token_bound = extend_token_bound
        self.forced_splits = extend_splits  # None: extend_num_splits decides

    def decode_qk(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch,
        q_w: torch.Tensor | None, k_w: torch.Tensor | None, eps: float, cos_sin: torch.Tensor,
    ) -> torch.Tensor | None:
        """Decode attention from raw q/k [B, H, D]: the split kernel applies the
        per-head norms (q_w / k_w; None: a model without them) and the rotary and
        stores K/V itself (one launch fewer than qk_norm_rotary + forward, two
        fewer than rotary + store + forward); also a verify step's queries (the
        verify graphs' layout, AttentionMetadata.query_first_rows). None where it
        does not apply (another extend step, a verify step of more than
        MAX_VERIFY_ROWS tokens a sequence, fp8 pages, partial rotary, a head dim
        not a power of two): the caller takes the usual path."""
        pool, meta = batch.kv_pool, batch.attn
        d = q.shape[-1]
        verify = (meta.query_seq_lens is not None and meta.query_first_rows is not None
                  and meta.query_rows_bound <= MAX_VERIFY_ROWS)
        if ((not batch.is_decode and not verify) or pool.k_scale is not None or cos_sin.shape[-1] != d
                or triton.next_power_of_2(d) != d):
            return None
        kc, vc = pool.k[layer], pool.v[layer]
        if batch.is_decode:
            qk = DecodeQK(k, v, q_w, k_w, eps, batch.positions, cos_sin, meta.out_cache_loc)
            return self._decode(q, kc, vc, batch, None, None, qk)
        qk = DecodeQK(k, v, q_w, k_w, eps, batch.positions, cos_sin, meta.out_cache_loc,
                      meta.query_first_rows, meta.query_rows_bound)
        return self._decode(q, kc, vc, batch, None, None, qk, verify=True)

    def _decode(
        self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, batch: ForwardBatch,
        ks: torch.Tensor | None, vs: torch.Tensor | None, qk: DecodeQK | None = None,
        out_gate: torch.Tensor | None = None, verify: bool = False,
    ) -> torch.Tensor:
        """Split-K decode attention over this layer's pages at the backend's
        split count and config (forward's decode path, and decode_qk's). ``verify``:
        a verify step's, one decode query per token over
        AttentionMetadata.query_page_table / query_seq_lens."""
        meta = batch.attn
        table, lens = meta.page_table, meta.seq_lens
        if verify:
            assert meta.query_page_table is not None and meta.query_seq_lens is not None
            assert meta.query_seq_lens.shape[0] == q.shape[0]
            table, lens = meta.query_page_table, meta.query_seq_lens
        cfg = self.cfg or AttnKernelConfig.for_device(q.device, q.shape[-1])
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        splits = self.num_splits(q.shape[0], kc.shape[1], q.device, meta.max_seq_len)
        return decode_attention_triton(
            q, kc, vc, table, lens, meta.page_size, scale, splits, cfg,
            k_scale=ks, v_scale=vs, qk=qk, kernels=batch.kernels, out_gate=out_gate,
        )

    def num_splits(self, batch_size: int, num_kv_heads: int, device: torch.device,
                   max_seq_len: int | None = None) -> int:
        """Splits of a decode batch: a function of the batch size and, through
        ``max_seq_len`` (a host bound on every sequence's length; None: no
        bound), of AttnKernelConfig.short_context_splits. A CUDA graph captured
        with a bound stays valid for every batch within it."""
        cfg = self.cfg or AttnKernelConfig.for_device(device, 128)
        # About decode_programs_per_sm split programs per SM over all (sequence,
        # kv head) pairs: one 100k-token sequence needs many splits to fill the HBM pipe.
        want = math.ceil(cfg.decode_programs_per_sm * _num_sms(device)
                         / max(1, batch_size * num_kv_heads))
        splits = max(1, min(cfg.max_splits, want))
        if max_seq_len is not None and max_seq_len <= self.short_context_limit(device):
            splits = min(splits, cfg.short_context_splits)
        return splits

    def short_context_limit(self, device: torch.device) -> int:
        """The longest sequence a decode batch may hold and still take the
        short-context split cap: fewer tiles than short_context_splits, so
        every split (the new token's included) holds at most one (0: no cap)."""
        cfg = self.cfg or AttnKernelConfig.for_device(device, 128)
        return max(0, cfg.short_context_splits - 1) * cfg.decode_block_n

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch,
        kv_stored: bool = False, out_gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``kv_stored``: the caller already put this step's K/V into the pages.
        ``out_gate`` [T, Hq, D]: the output times sigmoid(out_gate), in the decode
        kernels' reduce launch (paged_attention.gate_output after the extend kernel)."""
        pool = batch.kv_pool
        meta = batch.attn
        kc, vc = pool.k[layer], pool.v[layer]
        ks, vs = pool.scales(layer)  # None, None unless the pool holds fp8 codes
        if not kv_stored:
            store_kv_triton(kc, vc, k, v, meta.out_cache_loc, ks, vs)
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        cfg = self.cfg or AttnKernelConfig.for_device(q.device, q.shape[-1])
        bound = self.extend_token_bound
        assert bound is None or bound >= meta.max_extend_len, "extend_token_bound below a chunk"
        # One new token per sequence (host metadata): the split-K kernel reads each
        # KV head once for all its query heads, far cheaper than 64-row extend tiles.
        if batch.is_decode or (bound is None and meta.max_extend_len == 1):
            assert q.shape[0] == meta.num_seqs, "decode batches carry one token per sequence"
            return self._decode(q, kc, vc, batch, ks, vs, out_gate=out_gate)
        if meta.query_seq_lens is not None:  # a verify step: one decode query per token
            return self._decode(q, kc, vc, batch, ks, vs, out_gate=out_gate, verify=True)
        out = extend_attention_triton(
            q, kc, vc, meta.page_table, meta.qo_indptr, meta.prefix_lens,
            bound if bound is not None else meta.max_extend_len, meta.page_size, scale, cfg,
            k_scale=ks, v_scale=vs, num_splits=self.extend_splits(q.shape[1], meta, cfg, q.device),
        )
        return gate_output(out, out_gate)

    def extend_splits(self, num_q_heads: int, meta: AttentionMetadata, cfg: AttnKernelConfig,
                      device: torch.device) -> int:
        """KV splits of an extend launch (1: the plain kernel), from host values
        only: the token bound (``extend_token_bound``, a graph's bucket; else
        the step's new tokens per sequence) and ``meta.max_seq_len`` (a graph's
        static context bound). ``cfg``: the launch's tiles (head-dim dependent).
        See extend_num_splits for the policy; the constructor's
        ``extend_splits`` overrides it."""
        if self.forced_splits is not None:
            return self.forced_splits
        bm = cfg.extend_block_m  # the plain grid's rows: does it fill the GPU already?
        if self.extend_token_bound is not None:  # a graph: one sequence filling its bucket
            blocks = triton.cdiv(self.extend_token_bound, bm)
        else:
            blocks = sum(triton.cdiv(n, bm) for n in meta.extend_lens_host)
        kv_tiles = triton.cdiv(meta.max_seq_len, cfg.extend_block_n)
        return extend_num_splits(num_q_heads * blocks, kv_tiles, _num_sms(device), cfg)
