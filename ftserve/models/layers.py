"""Shared layers. Every parameter is created with ``torch.empty`` so models can
be built on the meta device and materialized by the loader (no init cost, no
double allocation). Tensors are packed tokens: x [T, H] (see ForwardBatch).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ftserve.models.forward_batch import ForwardBatch
from ftserve_kernels import ops
from ftserve_kernels.config import KernelConfig
from ftserve_kernels.fp8_quant import FP8, Fp8Weight
from ftserve_kernels.oproj_route_triton import OprojRoute

# Signature of the MoE expert-compute hook: (x [T, H], topk_weights [T, k] fp32,
# topk_ids [T, k] int32, the step's KernelConfig) -> [T, H]. See MoEBlock.
ExpertCompute = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, KernelConfig], torch.Tensor]


class Linear(nn.Module):
    """y = x W^T (+ b); weight [out, in] in the HF layout, so checkpoints copy in as they are.
    An fp8 checkpoint's layers hold e4m3 codes in ``weight`` and their block
    scales in ``weight_scale`` (to_fp8); ``w`` is the weight as ops take it."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        )
        self.register_parameter("weight_scale", None)  # fp8: [ceil(N / bn), ceil(K / bk)] fp32
        self.fp8_block: tuple[int, int] | None = None  # fp8: (bn, bk)

    def to_fp8(self, block_n: int, block_k: int) -> None:
        """Hold the weight as fp8 codes + scales (before materialization, on meta)."""
        n, k = self.weight.shape
        dev = self.weight.device
        self.weight = nn.Parameter(torch.empty(n, k, dtype=FP8, device=dev), requires_grad=False)
        self.weight_scale = nn.Parameter(
            torch.empty(-(-n // block_n), -(-k // block_k), dtype=torch.float32, device=dev), requires_grad=False)
        self.fp8_block = (block_n, block_k)

    @property
    def w(self) -> torch.Tensor | Fp8Weight:
        """The weight: the tensor, or fp8 codes with their scales (ftserve_kernels.fp8_quant)."""
        if self.weight_scale is None or self.fp8_block is None:
            return self.weight
        return Fp8Weight(self.weight, self.weight_scale, *self.fp8_block)

    def forward(self, x: torch.Tensor, kernels: KernelConfig) -> torch.Tensor:
        return ops.linear(kernels, x, self.w, self.bias)  # the GEMV at decode sizes (ops.linear)


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)  # [T, H]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, kernels: KernelConfig) -> torch.Tensor:
        return ops.rms_norm(kernels, x, self.weight, self.eps)

    def forward_add(
        self, x: torch.Tensor, residual: torch.Tensor, kernels: KernelConfig
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual)."""
        return ops.fused_add_rms_norm(kernels, x, residual, self.weight, self.eps)


class Attention(nn.Module):
    """Fused qkv projection -> optional per-head q/k RMSNorm (Qwen3) -> rotary ->
    the batch's attention backend (which also stores K/V into the paged pool)."""

    def __init__(
        self, layer_idx: int, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
        qkv_bias: bool, o_bias: bool, qk_norm: bool, eps: float, dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        # rows [0, q) = q_proj, [q, q+kv) = k_proj, [q+kv, q+2kv) = v_proj
        self.qkv_proj = Linear(hidden_size, self.q_size + 2 * self.kv_size, qkv_bias, dtype)
        self.o_proj = Linear(self.q_size, hidden_size, o_bias, dtype)
        self.q_norm = RMSNorm(head_dim, eps, dtype) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps, dtype) if qk_norm else None

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cos_sin: torch.Tensor) -> torch.Tensor:
        return self.attend(self.qkv_proj(x, batch.kernels), batch, cos_sin)

    def forward_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, batch: ForwardBatch,
        cos_sin: torch.Tensor, normed: bool | ops.PendingNorm = False, project: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """attention(norm(x + residual)), x + residual (x when residual is None); the
        norm folds into the qkv GEMV at decode sizes (ops.add_rms_norm_linear).
        ``normed``: the layer before already applied ``norm`` (x is
        norm(x' + residual), residual that sum), or left it pending (x is the sum).
        ``project=False``: the attention output before o_proj [T, q]."""
        qkv, summed = ops.add_rms_norm_linear(batch.kernels, x, residual, norm.weight, norm.eps,
                                              self.qkv_proj.w, self.qkv_proj.bias, prenormed=normed)
        return self.attend(qkv, batch, cos_sin, project), summed

    def attend(self, qkv: torch.Tensor, batch: ForwardBatch, cos_sin: torch.Tensor,
               project: bool = True) -> torch.Tensor:
        """qkv [T, q + 2kv] -> o_proj(attention) [T, H] (without ``project``: the
        attention [T, q])."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)  # [T, Hq, D], a view of qkv
        k = k.reshape(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.reshape(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if batch.layer_ready is not None:  # this layer's pages may still be streaming in
            torch.cuda.current_stream().wait_event(batch.layer_ready[self.layer_idx])
        q_w: torch.Tensor | None = None
        k_w: torch.Tensor | None = None
        eps = 0.0
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3
            q_w, k_w, eps = self.q_norm.weight, self.k_norm.weight, self.q_norm.eps
        fold = getattr(batch.attn_backend, "decode_qk", None)
        if fold is not None and (batch.is_decode or batch.attn.query_first_rows is not None):
            # The q/k norms (where the model has them), the rotary and the KV store
            # inside the decode attention launch (TritonAttentionBackend.decode_qk),
            # where it applies: decode steps, and the verify graphs' steps.
            out = fold(q, k, v, self.layer_idx, batch, q_w, k_w, eps, cos_sin)
            if out is not None:
                return self._project(out.reshape(t, self.q_size), project, batch.kernels)
        # One kernel for the per-head norms (if any) and the rotary (three on the
        # unfused path), and into a float KV cache the KV store too.
        pool = batch.kv_pool
        stored = pool.k_scale is None
        kv_store = (pool.k[self.layer_idx], pool.v[self.layer_idx], v, batch.attn.out_cache_loc) if stored else None
        if q_w is not None and k_w is not None:
            q, k = ops.qk_norm_rotary(batch.kernels, q, k, q_w, k_w, eps, batch.positions, cos_sin, kv_store)
        else:
            q, k = ops.rotary(batch.kernels, q, k, batch.positions, cos_sin, kv_store)
        if stored:
            out = batch.attn_backend.forward(q, k, v, self.layer_idx, batch, kv_stored=True)
        else:
            out = batch.attn_backend.forward(q, k, v, self.layer_idx, batch)  # [T, Hq, D]
        return self._project(out.reshape(t, self.q_size), project, batch.kernels)  # [T, H]

    def _project(self, out: torch.Tensor, project: bool, kernels: KernelConfig) -> torch.Tensor:
        return ops.linear(kernels, out, self.o_proj.w, self.o_proj.bias) if project else out


class DenseMLP(nn.Module):
    """down(SiLU(gate(x)) * up(x)) with gate and up fused into one matmul; at
    decode sizes two GEMV launches (ops.gate_up_silu's GLU epilogue)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        # rows [0, I) = gate_proj, [I, 2I) = up_proj
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias, dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, bias, dtype)

    def forward(self, x: torch.Tensor | ops.PendingNorm, kernels: KernelConfig, eps: float = 0.0) -> torch.Tensor:
        """x [T, H], or a norm the layer before left pending (eps: its norm's) -> [T, H]."""
        return self.down_proj(self._act(x, kernels, eps), kernels)

    def forward_add_norm(
        self, x: torch.Tensor | ops.PendingNorm, residual: torch.Tensor, norm: RMSNorm, kernels: KernelConfig,
        eps: float = 0.0,
    ) -> tuple[torch.Tensor | ops.PendingNorm, torch.Tensor]:
        """norm.forward_add(forward(x), residual): at decode sizes the down GEMV adds
        the residual and leaves ``norm`` pending (ops.linear_add_rms_norm)."""
        return ops.linear_add_rms_norm(kernels, self._act(x, kernels, eps), self.down_proj.w, self.down_proj.bias,
                                       residual, norm.weight, norm.eps)

    def _act(self, x: torch.Tensor | ops.PendingNorm, kernels: KernelConfig, eps: float) -> torch.Tensor:
        return ops.gate_up_silu(kernels, x, self.gate_up_proj.w, self.gate_up_proj.bias, eps)  # [T, I]


class MoEBlock(nn.Module):
    """Router linear -> softmax top-k -> experts over stacked weights.

    Expert-offload hook: all expert compute goes through ``compute_experts``.
    By default it runs ops.fused_moe over the resident ``w13``/``w2``; an
    expert cache installs its own callable in ``self.expert_compute`` (same
    signature, see ExpertCompute) that maps expert ids to VRAM slots and runs
    the kernel over the slot buffers. ``layer_idx`` tells it which layer it is.
    """

    def __init__(
        self, layer_idx: int, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
        renormalize: bool, dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = Linear(hidden_size, num_experts, False, dtype)  # the router
        # w13 rows [0, I) = gate_proj, [I, 2I) = up_proj of each expert
        self.w13 = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype), requires_grad=False
        )
        # fp8 checkpoints (to_fp8): e4m3 codes in w13 / w2, their block scales here.
        self.register_parameter("w13_scale", None)  # [E, ceil(2I / bn), ceil(H / bk)] fp32
        self.register_parameter("w2_scale", None)  # [E, ceil(H / bn), ceil(I / bk)] fp32
        self.fp8_blocks: dict[str, tuple[int, int]] = {}  # "w13" / "w2" -> (bn, bk)
        self.expert_compute: ExpertCompute | None = None
        # Arrival counter of the fused norm + route kernel: zero between launches
        # (the kernel's last program re-zeroes it); made on first use, on x's device.
        self._route_counter: torch.Tensor | None = None

    def to_fp8(self, name: str, block_n: int, block_k: int) -> None:
        """Hold expert weights ``name`` ("w13" or "w2") as fp8 codes + scales (on meta)."""
        w = getattr(self, name)
        e, n, k = w.shape
        setattr(self, name, nn.Parameter(torch.empty(e, n, k, dtype=FP8, device=w.device), requires_grad=False))
        setattr(self, f"{name}_scale", nn.Parameter(
            torch.empty(e, -(-n // block_n), -(-k // block_k), dtype=torch.float32, device=w.device),
            requires_grad=False))
        self.fp8_blocks[name] = (block_n, block_k)

    @property
    def is_fp8(self) -> bool:
        return bool(self.fp8_blocks)

    def expert_weights(self) -> tuple[torch.Tensor | Fp8Weight, torch.Tensor | Fp8Weight]:
        """(w13, w2) as ops take them: tensors, or fp8 codes with their scales."""
        if not self.is_fp8:
            return self.w13, self.w2
        assert self.w13_scale is not None and self.w2_scale is not None
        return (Fp8Weight(self.w13, self.w13_scale, *self.fp8_blocks["w13"]),
                Fp8Weight(self.w2, self.w2_scale, *self.fp8_blocks["w2"]))

    def norm_route(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, kernels: KernelConfig
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """``norm`` (fused with the residual add when given), then route: one launch
        at decode sizes on Triton. -> (normed [T, H], x + residual or None, weights, ids)."""
        if self.observed():
            # Someone observes the router (tests, bench_engine's expert count): call
            # the modules, unfused, so the hooks see the logits.
            if residual is None:
                normed, summed = norm(x, kernels), None
            else:
                normed, summed = norm.forward_add(x, residual, kernels)
            return (normed, summed, *self.route(normed, kernels))
        return ops.add_rms_norm_route(kernels, x, residual, norm.weight, norm.eps, self.gate.weight,
                                      self.top_k, self.renormalize, self._counter(x))

    def _counter(self, x: torch.Tensor) -> torch.Tensor:
        c = self._route_counter
        if c is None or c.device != x.device:
            c = self._route_counter = torch.zeros(1, dtype=torch.int32, device=x.device)
        return c

    def route(self, x: torch.Tensor, kernels: KernelConfig) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(x, kernels)  # [T, E]
        return ops.route_topk(kernels, logits, self.top_k, self.renormalize)  # [T, k] fp32, [T, k] int32

    def folds_next_norm(self, x: torch.Tensor, kernels: KernelConfig) -> bool:
        """Whether compute_experts_norm folds the norm into the expert launches at
        x's size (the resident experts only: an expert cache computes its own)."""
        return self.expert_compute is None and ops.moe_folds_next_norm(kernels, x)

    def compute_experts_norm(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, residual: torch.Tensor,
        norm: RMSNorm, kernels: KernelConfig, defer: bool = False,
    ) -> tuple[torch.Tensor | ops.PendingNorm, torch.Tensor]:
        """norm.forward_add(compute_experts(x, ...), residual), the norm inside the
        down launch where folds_next_norm(x). -> (normed [T, H], summed [T, H]);
        with ``defer`` the norm may be left pending (ops.fused_moe_add_rms_norm)."""
        if self.expert_compute is not None:
            return norm.forward_add(self.expert_compute(x, topk_weights, topk_ids, kernels), residual, kernels)
        return ops.fused_moe_add_rms_norm(kernels, x, *self.expert_weights(), topk_weights, topk_ids, residual,
                                          norm.weight, norm.eps, self._counter(x), defer)

    def observed(self) -> bool:
        """Someone hooks the router (tests, bench_engine's expert count): it must run as a module."""
        return bool(self.gate._forward_hooks or self.gate._forward_pre_hooks)

    def compute_experts_routed(
        self, route: OprojRoute, route_eps: float, norm: RMSNorm, kernels: KernelConfig, defer: bool = False,
    ) -> tuple[torch.Tensor | ops.PendingNorm, torch.Tensor]:
        """compute_experts_norm for one row routed by o_proj (ops.oproj_route): the
        gate/up launch applies the post-attention norm left pending (eps
        ``route_eps``) and weighs the chosen experts; the down launch adds the
        residual and folds ``norm`` (pending with ``defer``, as there)."""
        return ops.fused_moe_routed(kernels, route, route_eps, *self.expert_weights(), norm.weight, norm.eps,
                                    self._counter(route.scaled), defer)

    def compute_experts(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, kernels: KernelConfig,
        valid_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``valid_rows`` (ForwardBatch.valid_tokens): rows past it are a graph
        bucket's padding, their outputs unspecified (the resident experts skip
        them; an expert cache computes them)."""
        if self.expert_compute is not None:
            return self.expert_compute(x, topk_weights, topk_ids, kernels)
        return ops.fused_moe(kernels, x, *self.expert_weights(), topk_weights, topk_ids,
                             valid_rows=valid_rows)  # [T, H]

    def forward(self, x: torch.Tensor, kernels: KernelConfig) -> torch.Tensor:
        weights, ids = self.route(x, kernels)
        return self.compute_experts(x, weights, ids, kernels)
