"""The torch attention twin (paged_attention_ref, TorchAttentionBackend) against
plain dense attention written out here: softmax(q k^T * scale) v in float64 over
each sequence's keys, causal over its new tokens, full over its cached prefix.

The twin runs torch's scaled_dot_product_attention over K/V gathered from the
pages (the CPU's serving path), so these cases pin what the Triton kernels are
compared against: ragged prefill batches with prefixes and empty rows, GQA,
decode batches of unequal lengths over a NaN-poisoned dummy page, fp8 pages.
"""

from __future__ import annotations

import pytest
import torch

from ftserve.kvcache.pool import KVPool
from ftserve.models.forward_batch import build_forward_batch
from ftserve_kernels.paged_attention import (
    FP8_DTYPE,
    TorchAttentionBackend,
    dequantize_fp8_ref,
    kv_rows,
    paged_attention_ref,
    quantize_fp8_ref,
)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int,
                    scale: float) -> torch.Tensor:
    """q [n, Hq, D] at positions prefix.., k/v [prefix + n, Hkv, D] -> [n, Hq, D] float64."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    n, length = q.shape[0], k.shape[0]
    future = torch.arange(length)[None, :] > (prefix + torch.arange(n))[:, None]
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    return torch.einsum("hnl,lhd->nhd", probs, v)


def paged_case(new_lens: list[int], prefix_lens: list[int], hq: int, hkv: int, d: int,
               page_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                        torch.Tensor, list[torch.Tensor]]:
    """(q, k_cache, v_cache, page_table, each sequence's slots) with shuffled
    pages, the dummy page 0 poisoned with NaN, the table padded with it."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(p + n) // page_size) for p, n in zip(prefix_lens, new_lens)]
    num_pages = sum(need) + 2
    k_cache = torch.randn(num_pages * page_size, hkv, d, generator=g)
    v_cache = torch.randn(num_pages * page_size, hkv, d, generator=g)
    k_cache[:page_size] = float("nan")
    v_cache[:page_size] = float("nan")
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    table = torch.zeros(len(need), max(need) + 1, dtype=torch.int32)
    slots, at = [], 0
    for b, n in enumerate(need):
        pages = perm[at:at + n]
        at += n
        table[b, :n] = torch.tensor(pages, dtype=torch.int32)
        length = prefix_lens[b] + new_lens[b]
        slots.append((torch.tensor(pages)[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:length])
    q = 3 * torch.randn(sum(new_lens), hq, d, generator=g)  # peaky softmax: a wrong key shows
    return q, k_cache, v_cache, table, slots


def expected(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: list[torch.Tensor],
             new_lens: list[int], prefix_lens: list[int], scale: float) -> torch.Tensor:
    out, q0 = [], 0
    for s, n, p in zip(slots, new_lens, prefix_lens):
        out.append(dense_attention(q[q0:q0 + n], k_cache[s], v_cache[s], p, scale))
        q0 += n
    return torch.cat(out)


def indptr_of(new_lens: list[int]) -> list[int]:
    out = [0]
    for n in new_lens:
        out.append(out[-1] + n)
    return out


@pytest.mark.parametrize("hq,hkv,page_size", [(4, 4, 4), (6, 2, 16), (9, 3, 1)])
def test_prefill_batch_matches_dense_attention(hq: int, hkv: int, page_size: int) -> None:
    # A cold prompt, chunks over cached prefixes (aligned and not), a one-token row,
    # and a sequence with no new token (its rows and keys must not shift the others').
    new, prefix = [9, 20, 1, 0, 5], [0, 13, 30, 7, 16]
    q, kc, vc, table, slots = paged_case(new, prefix, hq, hkv, 16, page_size)
    seq = [p + n for p, n in zip(prefix, new)]
    out = paged_attention_ref(q, kc, vc, table, indptr_of(new), seq, page_size, 0.25)
    assert out.shape == q.shape and torch.isfinite(out).all()
    keep = [i for i, n in enumerate(new) if n]
    want = expected(q, kc, vc, [slots[i] for i in keep], [new[i] for i in keep],
                    [prefix[i] for i in keep], 0.25)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lens", [[5, 5, 5], [1, 37, 6, 16]])
def test_decode_batch_matches_dense_attention(lens: list[int]) -> None:
    """One token per sequence: one batched call, shorter sequences padded (with
    their own first row, not the NaN dummy page) and masked."""
    new, prefix = [1] * len(lens), [n - 1 for n in lens]
    q, kc, vc, table, slots = paged_case(new, prefix, 8, 2, 32, 4, seed=1)
    out = paged_attention_ref(q, kc, vc, table, indptr_of(new), lens, 4, 32**-0.5)
    assert torch.isfinite(out).all()
    rows = kv_rows(table, indptr_of(new), lens, 4)
    assert rows.decode and rows.slots.shape == (len(lens) * max(lens),)
    assert (rows.masks[0] is None) == (min(lens) == max(lens))
    torch.testing.assert_close(out.double(), expected(q, kc, vc, slots, new, prefix, 32**-0.5),
                               rtol=1e-5, atol=1e-5)


def test_fp8_pages_attend_over_the_dequantized_rows() -> None:
    new, prefix = [6, 1], [10, 3]
    q, kc, vc, table, slots = paged_case(new, prefix, 4, 2, 16, 4, seed=2)
    (kq, ks), (vq, vs) = quantize_fp8_ref(kc.nan_to_num(0.0)), quantize_fp8_ref(vc.nan_to_num(0.0))
    assert kq.dtype == FP8_DTYPE
    seq = [p + n for p, n in zip(prefix, new)]
    out = paged_attention_ref(q, kq, vq, table, indptr_of(new), seq, 4, 0.25, ks, vs)
    want = expected(q, dequantize_fp8_ref(kq, ks), dequantize_fp8_ref(vq, vs), slots, new, prefix, 0.25)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("is_decode", [False, True])
def test_backend_works_out_the_rows_once_per_batch(is_decode: bool) -> None:
    """Every layer of a batch reads the same pages: the backend keeps the batch's
    KVRows in batch.extras after the first layer, and each layer still attends
    over its own pool layer (stored first)."""
    new = [1, 1] if is_decode else [7, 3]
    prefix = [12, 3]
    pool = KVPool(2, 8, 4, 2, 16, torch.float32, "cpu")
    g = torch.Generator().manual_seed(3)
    pool.k.copy_(torch.randn(pool.k.shape, generator=g))
    pool.v.copy_(torch.randn(pool.v.shape, generator=g))
    tables = [[3, 1, 5, 7, 4], [2, 6]]
    be = TorchAttentionBackend()
    fb = build_forward_batch([[1] * n for n in new], prefix, tables, pool, be, is_decode=is_decode)
    t = sum(new)
    outs = []
    for layer in range(2):
        q, k, v = (torch.randn(t, h, 16, generator=g) for h in (4, 2, 2))
        outs.append(be.forward(q, k, v, layer, fb))
        if layer == 0:
            cached = fb.extras[TorchAttentionBackend.ROWS_KEY]
        assert fb.extras[TorchAttentionBackend.ROWS_KEY] is cached
        slots = [(torch.tensor(p)[:, None] * 4 + torch.arange(4)).reshape(-1)[:pre + n]
                 for p, pre, n in zip(tables, prefix, new)]
        want = expected(q, pool.k[layer], pool.v[layer], slots, new, prefix, 16**-0.5)
        torch.testing.assert_close(outs[-1].double(), want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(outs[0], outs[1])
