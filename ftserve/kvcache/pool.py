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
"""

from __future__ import annotations

import torch

DUMMY_PAGE = 0


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

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def usable_pages(self) -> int:
        """Pages that can hold real tokens (all but the dummy page)."""
        return self.num_pages - 1

    def bytes_per_page(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim * elem

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * elem
