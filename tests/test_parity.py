"""ftserve's forward vs the transformers reference, per family, in float32 on CPU.

Each family gets a tiny random checkpoint written by write_checkpoint (sharded),
loaded by both. ftserve runs over the paged KV pool with the torch reference
attention backend: packed batches of different lengths, a prefill split into
two chunks (prefix then extend), and batched one-token decode steps.

Bound: TOL = 1e-4 absolute on the logits (which are O(1)): float32 on both
sides, so the two forwards differ only in summation order. The fp8 families
(qwen3_fp8, qwen3_moe_fp8: HF's block-scaled e4m3 layout) keep that bound and
the 32-token greedy identity: transformers' reference is the checkpoint
dequantized (each e4m3 code times its block's fp32 scale, in fp32), and
ftserve's CPU path multiplies the very same dequantized weights in fp32 with
the activations as they are (fp8_quant.fp8_linear_ref: no activation rounding,
that is the GPU prefill GEMMs' own bound in test_gpu_fp8), so fp8 adds no error
of its own here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, FineGrainedFP8Config

from ftserve.kvcache.pool import KVPool
from ftserve.models.checkpoint import write_checkpoint
from ftserve.models.decoder import DecoderForCausalLM
from ftserve.models.forward_batch import build_forward_batch
from ftserve.models.loader import load_model
from ftserve_kernels.paged_attention import TorchAttentionBackend

TOL = 1e-4
PAGE = 4  # small pages so every sequence spans several, non-contiguous ones

FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("tiny-dense", {}),
    "mistral": ("tiny-mistral", {}),
    "qwen2": ("tiny-qwen2", {}),
    "qwen3": ("tiny-qwen3", {}),
    "qwen3_moe": ("tiny-moe", {}),
    # dense layer among MoE layers, top-k weights not renormalized
    "qwen3_moe_mixed": ("tiny-moe", {"mlp_only_layers": [1], "norm_topk_prob": False}),
    "mixtral": ("tiny-mixtral", {}),
    # fp8 checkpoints (HF's block-scaled layout): the bound is the float32 one (module docstring)
    "qwen3_fp8": ("tiny-qwen3-fp8", {}),
    "qwen3_moe_fp8": ("tiny-moe-fp8", {}),
}


class Pair:
    def __init__(self, name: str, path: Path) -> None:
        self.name = name
        self.model, self.cfg = load_model(path, dtype="float32", device="cpu")
        # An fp8 checkpoint: the reference is transformers' dequantized model (explicit, since
        # with a GPU present transformers would keep fp8 layers).
        extra = ({"quantization_config": FineGrainedFP8Config(dequantize=True)}
                 if "quantization_config" in json.loads((path / "config.json").read_text()) else {})
        self.hf, info = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, output_loading_info=True, **extra
        )
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
        self.hf.eval()

    def hf_logits(self, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.hf(torch.tensor([ids])).logits[0].float()  # [n, V]


class PagedSession:
    """Host-side page bookkeeping for a few sequences over one KVPool."""

    def __init__(self, model: DecoderForCausalLM, num_pages: int = 96) -> None:
        cfg = model.config
        self.model = model
        self.pool = KVPool(cfg.num_layers, num_pages, PAGE, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
        self.backend = TorchAttentionBackend()
        # Hand pages out in a scrambled order so a wrong page lookup cannot pass.
        self.free = list(torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(1)) + 1)
        self.pages: list[list[int]] = []
        self.lens: list[int] = []

    def new_seq(self) -> int:
        self.pages.append([])
        self.lens.append(0)
        return len(self.pages) - 1

    def step(self, seqs: list[int], new_tokens: list[list[int]], all_logits: bool) -> torch.Tensor:
        for s, toks in zip(seqs, new_tokens):
            need = -(-(self.lens[s] + len(toks)) // PAGE)
            while len(self.pages[s]) < need:
                self.pages[s].append(int(self.free.pop()))
        batch = build_forward_batch(
            new_tokens, [self.lens[s] for s in seqs], [self.pages[s] for s in seqs], self.pool,
            self.backend, all_logits=all_logits, is_decode=all(len(t) == 1 for t in new_tokens),
        )
        out = self.model(batch)
        for s, toks in zip(seqs, new_tokens):
            self.lens[s] += len(toks)
        return out


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    preset, overrides = FAMILIES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    # 4 MB shards: the 8 MB embedding alone fills one, so every checkpoint has several
    write_checkpoint(preset, path, seed=7, dtype="float32", shard_size_mb=4, overrides=overrides)
    assert len(list(path.glob("*.safetensors"))) > 1
    return Pair(request.param, path)


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def test_packed_batch_of_different_lengths(pair: Pair) -> None:
    prompts = _prompts(pair.cfg.vocab_size, [1, 6, 19, 37], seed=0)
    sess = PagedSession(pair.model)
    seqs = [sess.new_seq() for _ in prompts]
    logits = sess.step(seqs, prompts, all_logits=True)  # [sum(len), V]
    off = 0
    for p in prompts:
        ref = pair.hf_logits(p)
        diff = (logits[off : off + len(p)] - ref).abs().max().item()
        assert diff <= TOL, f"len {len(p)}: max abs diff {diff}"
        off += len(p)
    assert off == logits.shape[0]


def test_chunked_prefill_over_paged_cache(pair: Pair) -> None:
    long, short = _prompts(pair.cfg.vocab_size, [41, 9], seed=1)
    ref_long, ref_short = pair.hf_logits(long), pair.hf_logits(short)
    sess = PagedSession(pair.model)
    a = sess.new_seq()
    first = sess.step([a], [long[:15]], all_logits=True)
    assert (first - ref_long[:15]).abs().max().item() <= TOL
    # extend over the cached prefix, packed with a fresh sequence in the same batch
    b = sess.new_seq()
    second = sess.step([a, b], [long[15:], short], all_logits=True)
    assert (second[:26] - ref_long[15:]).abs().max().item() <= TOL
    assert (second[26:] - ref_short).abs().max().item() <= TOL
    # default logits rows: the last new token of each sequence
    c = sess.new_seq()
    last = sess.step([c], [short], all_logits=False)
    assert last.shape == (1, pair.cfg.vocab_size)
    assert (last[0] - ref_short[-1]).abs().max().item() <= TOL


@pytest.mark.filterwarnings("ignore::FutureWarning")  # HF renames past_key_values in later releases
def test_greedy_continuation_32_tokens(pair: Pair) -> None:
    if pair.name == "qwen3_moe_mixed":
        pytest.skip("logit parity covers this variant; greedy runs once per family")
    prompts = _prompts(pair.cfg.vocab_size, [9, 9], seed=2)
    steps = 32
    # Reference: HF's own KV cache, both prompts as one [2, n] batch (no padding).
    ref_rows: list[torch.Tensor] = []  # per step [2, V]
    with torch.no_grad():
        out = pair.hf(torch.tensor(prompts), use_cache=True)
        for _ in range(steps):
            row = out.logits[:, -1].float()  # [2, V]
            ref_rows.append(row)
            out = pair.hf(row.argmax(-1, keepdim=True), past_key_values=out.past_key_values, use_cache=True)
    ref_tokens = torch.stack([r.argmax(-1) for r in ref_rows], dim=1).tolist()  # [2, steps]
    sess = PagedSession(pair.model)
    seqs = [sess.new_seq() for _ in prompts]
    logits = sess.step(seqs, prompts, all_logits=False)  # [2, V]
    got: list[list[int]] = [[], []]
    for step in range(steps):
        diff = (logits - ref_rows[step]).abs().max().item()
        assert diff <= TOL, f"step {step}: max abs diff {diff}"
        nxt = logits.argmax(dim=-1).tolist()
        for b in range(2):
            got[b].append(nxt[b])
        if step + 1 < steps:
            logits = sess.step(seqs, [[t] for t in nxt], all_logits=False)  # batched decode
    assert got == ref_tokens
    assert len(set(got[0])) > 1  # the continuation is not one repeated token


ROPE_SCALINGS: dict[str, dict] = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    # dynamic NTK equals HF only within the original context: the table is cut to it
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn_mscale": {
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
        "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2,
    },
    # orig 128 / head_dim 16: low, medium and high frequency bands all occur
    "llama3": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128,
    },
}


@pytest.mark.parametrize("kind", list(ROPE_SCALINGS))
def test_rope_scaling_logits(kind: str, tmp_path: Path) -> None:
    overrides = {"rope_scaling": ROPE_SCALINGS[kind], "max_position_embeddings": 256}
    write_checkpoint("tiny-dense", tmp_path, seed=3, dtype="float32", overrides=overrides)
    pair = Pair(kind, tmp_path)
    if kind == "dynamic":
        assert pair.cfg.max_context_len == 1024  # the request limit the scaling buys
        pair.model, pair.cfg = load_model(tmp_path, dtype="float32", device="cpu", max_model_len=256)
    prompts = _prompts(pair.cfg.vocab_size, [230, 3], seed=4)
    sess = PagedSession(pair.model, num_pages=80)
    logits = sess.step([sess.new_seq(), sess.new_seq()], prompts, all_logits=True)
    assert (logits[:230] - pair.hf_logits(prompts[0])).abs().max().item() <= TOL
    assert (logits[230:] - pair.hf_logits(prompts[1])).abs().max().item() <= TOL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"])
def test_cuda_parity(family: str, tmp_path: Path) -> None:
    """On the GPU (whatever kernels ops picks): fp32 matches HF closely; bf16 is no
    less accurate than HF's own bf16 forward, both measured against fp32."""
    preset, overrides = FAMILIES[family]
    write_checkpoint(preset, tmp_path, seed=7, dtype="float32", overrides=overrides)
    prompts = _prompts(32768, [1, 13, 64], seed=5)
    hf32 = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).cuda().eval()
    hf16 = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        ref = [hf32(torch.tensor([p], device="cuda")).logits[0].float() for p in prompts]
        ref16 = [hf16(torch.tensor([p], device="cuda")).logits[0].float() for p in prompts]
    for dtype, pool_dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        model, cfg = load_model(tmp_path, dtype=dtype, device="cuda")
        pool = KVPool(cfg.num_layers, 64, 16, cfg.num_kv_heads, cfg.head_dim, pool_dtype, "cuda")
        pages = [[1], [2], [3, 4, 5, 6]]
        batch = build_forward_batch(prompts, [0, 0, 0], pages, pool, TorchAttentionBackend(), all_logits=True)
        logits = model(batch)
        off = 0
        for p, r, r16 in zip(prompts, ref, ref16):
            ours = logits[off : off + len(p)]
            off += len(p)
            if dtype == "float32":
                # fp32 throughout: cuBLAS, and the Triton MoE kernels multiply fp32
                # operands in fp32 (attention_common.mma), not TF32; only the order
                # of the sums differs from transformers.
                err = (ours - r).abs().max().item()
                assert err <= 1e-3, f"max |logit - transformers fp32| {err:.2e} (len {len(p)})"
            else:
                err, hf_err = (ours - r).abs().max().item(), (r16 - r).abs().max().item()
                assert err <= 2 * hf_err + 0.05, (err, hf_err)
