"""A hybrid (Qwen3-Next) decode step on the Triton kernels: the same logits, KV and
states as the torch reference path, and no torch op besides the launches that
are still to go (tools/bench/op_census.py).

The census counts every aten op that is not a view or an allocation: on a GPU
each is a kernel launch of its own (a copy, a cast, an elementwise op, a
reduction, a GEMM), a few microseconds of a batch-1 step whatever it moves.
Counted on the meta device at qwen3-next-80b-a3b's shapes (the Triton launches
recorded, not run), and the count checked against an interpreted step's.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from ftserve.kvcache.pool import KVPool
from ftserve.kvcache.state_pool import StatePool
from ftserve.models.checkpoint import preset_config
from ftserve.models.config import ModelConfig
from ftserve.models.forward_batch import build_forward_batch
from ftserve.models.loader import build_model
from ftserve_kernels.attention_triton import TritonAttentionBackend
from ftserve_kernels.config import KernelConfig
from ftserve_kernels.paged_attention import TorchAttentionBackend
from tools.bench.op_census import census, hybrid_decode_step

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: the kernels interpreted

# The torch ops of one batch-1 decode step of qwen3-next-80b-a3b cut to 8 layers
# (6 Gated DeltaNet + 2 attention layers, all MoE): the embedding alone (in a decode
# graph the decode inputs launch gathers it). It was 530 before the decode path's
# norms, gates, casts and copies went into the Triton launches and its linears and
# the shared expert's SiLU * up onto the GEMVs (KernelConfig.dense_gemv).
CENSUS_MAX = 1
# Ops that are never needed on the decode path: copies, casts, gathers, syncs.
FORBIDDEN = {"_to_copy", "copy_", "clone", "contiguous", "cat", "index_select", "index_copy_", "gather",
             "_local_scalar_dense", "nonzero", "pow", "mean", "rsqrt", "softplus", "exp", "sigmoid"}
CENSUS_OPS = {"embedding"}


def _census(preset: str, layers: int | None, device: str, **kw: object) -> Counter[str]:
    step, _ = hybrid_decode_step(preset, layers, device, **kw)  # type: ignore[arg-type]
    with torch.no_grad():
        with census(skip_launches=device == "meta"):
            step()  # a first step makes what layers keep between steps (the routers' counters)
        with census(skip_launches=device == "meta") as c:
            step()
    return Counter(o.name.split(".")[0] for o in c.ops)


def test_decode_step_census_at_real_shapes() -> None:
    ops = _census("qwen3-next-80b-a3b", 8, "meta")
    assert not set(ops) & FORBIDDEN, ops
    assert set(ops) <= CENSUS_OPS, f"a new kind of torch op on the decode path: {set(ops) - CENSUS_OPS}"
    assert sum(ops.values()) <= CENSUS_MAX, ops


def _model(dtype: torch.dtype) -> tuple[torch.nn.Module, ModelConfig]:
    """tiny-qwen3-next (2 linear + 2 attention layers), a small vocabulary (the
    interpreted lm_head GEMV is slow), random weights."""
    cfg = ModelConfig.from_hf(preset_config("tiny-qwen3-next", overrides={"vocab_size": 512}))
    model = build_model(cfg, dtype, torch.device(DEVICE))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.5 if "norm" in name or name.endswith(("A_log", "dt_bias")) else 0.1
            p.copy_(torch.randn(p.shape, generator=g) * scale)
        model.init_buffers()
    return model, cfg


NAMES = ("logits", "k", "v", "conv", "recurrent")


def _decode(dtype: torch.dtype, on_triton: bool) -> tuple[list[torch.Tensor], Counter[str]]:
    """Two sequences (13 and 6 tokens prefilled on the torch path, slots 2 and 1)
    decode two steps on one path -> (logits, KV pages, conv windows, recurrent
    states after them; the torch ops of the last step)."""
    model, cfg = _model(dtype)
    kv = KVPool(len(cfg.kv_layers), 8, 16, cfg.num_kv_heads, cfg.head_dim, dtype, DEVICE)
    states = StatePool.for_model(cfg, 3, dtype, torch.float32, DEVICE)
    slots, pages, lens = [2, 1], [[1, 2], [3]], [13, 6]
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in lens]
    torch_k = KernelConfig(backend="torch")
    with torch.no_grad():
        model(build_forward_batch(prompts, [0, 0], pages, kv, TorchAttentionBackend(), state_pool=states,
                                  state_slots=slots, kernels=torch_k))
    kernels = KernelConfig(backend="triton", pdl=False) if on_triton else torch_k
    backend = TritonAttentionBackend() if on_triton else TorchAttentionBackend()
    logits = []
    for i, toks in enumerate(([[7], [9]], [[300], [11]])):
        batch = build_forward_batch(toks, [n + i for n in lens], pages, kv, backend, is_decode=True,
                                    state_pool=states, state_slots=slots, kernels=kernels)
        with torch.no_grad(), census() as c:
            logits.append(model(batch))
    return [torch.cat(logits), kv.k, kv.v, states.conv, states.recurrent], Counter(o.name.split(".")[0] for o in c.ops)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_decode_steps_on_triton_kernels_equal_the_torch_path() -> None:
    """Logits, KV pages, conv windows and recurrent states after two decode steps
    on the Triton kernels: fp32 the torch path's to rounding; bf16 (the interpreter
    truncates its bf16 casts where torch rounds) about as far from the fp32 path
    as the torch path's bf16 is. The step's torch ops are the meta device's census
    (on a GPU: what the CUDA step launched besides the Triton kernels)."""
    ref, _ = _decode(torch.float32, on_triton=False)
    got, seen = _decode(torch.float32, on_triton=True)
    for name, a, b in zip(NAMES, got, ref):
        assert _rel(a, b) <= 1e-5, (name, _rel(a, b))
    assert seen == _census("tiny-qwen3-next", None, "meta", dtype=torch.float32, batch=2,
                           overrides={"vocab_size": 512})
    torch16, _ = _decode(torch.bfloat16, on_triton=False)
    triton16, seen = _decode(torch.bfloat16, on_triton=True)
    for name, a, b, r in zip(NAMES, triton16, torch16, ref):
        assert _rel(a, r) <= 1.5 * _rel(b, r) + 1e-3, (name, _rel(a, r), _rel(b, r))
    assert seen == _census("tiny-qwen3-next", None, "meta", dtype=torch.bfloat16, batch=2,
                           overrides={"vocab_size": 512})
