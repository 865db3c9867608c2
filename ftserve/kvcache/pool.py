"""Paged KV pool: the device memory that holds every layer's keys and values.

Layout (one layer, K and V alike)::

    slot = page * page_size + offset
    k[layer]: [num_pages * page_size, num_kv_heads, head_dim]

    page 0        page 1        page 2          ...
    +-----------+ +-----------+ +-----------+
    | dummy     | | seq A 0-15| | seq B 0-15|
    +-----------+ +-----------+ +-----------+

Page 0 is the dummy page: it is never handed out, padded slots of a batch
(CUDA-graph padding, "no slot") write there, and padded page-table entries point
there, so kernels never need a branch or a data-dependent shape for padding.

fp8 pools (``dtype=torch.float8_e4m3fn``, ``--kv-cache-dtype fp8_e4m3``) hold
e4m3 codes in ``k``/``v`` plus one fp32 scale per token and KV head::

    k_scale[layer]: [num_pages * page_size, num_kv_heads]   (same slot index)

A page is its codes AND its scales: whatever moves a page moves both (host
tier, ``copy_kv_pages``). Other dtypes have ``k_scale = v_scale = None``.
"""

from __future__ import annotations

import torch

DUMMY_PAGE = 0
FP8_KV_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.float32  # fp8 pools: one per (slot, KV head), 4 bytes next to D codes
# --kv-cache-dtype values ("auto" = the model's dtype); "fp8" is short for fp8_e4m3.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
    "fp8_e4m3": FP8_KV_DTYPE, "fp8": FP8_KV_DTYPE,
}


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool dtype for a --kv-cache-dtype value (validated by EngineConfig)."""
    dtype = KV_CACHE_DTYPES[name]
    return model_dtype if dtype is None else dtype


class KVPool:
    """Per-layer K and V tensors over a flat slot space (see module docstring)."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_pages < 2:
            raise ValueError("the KV pool needs at least 2 pages (page 0 is the dummy page)")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_layers, num_pages * page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        if self.is_fp8:
            # Zero scales: unwritten slots (the dummy page) dequantize to 0, never NaN.
            sshape = shape[:3]  # [L, slots, Hkv]
            self.k_scale = torch.zeros(sshape, dtype=SCALE_DTYPE, device=self.device)
            self.v_scale = torch.zeros(sshape, dtype=SCALE_DTYPE, device=self.device)

    @property
    def is_fp8(self) -> bool:
        return self.dtype == FP8_KV_DTYPE

    def scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(k_scale, v_scale) of one layer, [slots, Hkv] each; (None, None) unless fp8."""
        if self.k_scale is None or self.v_scale is None:
            return None, None
        return self.k_scale[layer], self.v_scale[layer]

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def usable_pages(self) -> int:
        """Pages that can hold real tokens (all but the dummy page)."""
        return self.num_pages - 1

    def bytes_per_page(self) -> int:
        """Codes and (fp8) scales of one page over all layers, K and V."""
        return self.page_size * self.bytes_per_token(
            self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Device bytes one token takes in every layer: K and V values, plus the
        two fp32 scales per KV head of an fp8 pool (the memory plan counts both)."""
        elem = torch.empty((), dtype=dtype).element_size()
        per_head = head_dim * elem
        if dtype == FP8_KV_DTYPE:
            per_head += torch.empty((), dtype=SCALE_DTYPE).element_size()
        return 2 * num_layers * num_kv_heads * per_head
