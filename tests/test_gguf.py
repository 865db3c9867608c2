"""GGUF checkpoints: tiny GGUFs made on the fly (tests/gguf_util.py) from tiny
safetensors checkpoints load into the same model, weight for weight and logit for
logit, for every family; quantized tensors load as ggml dequantizes them; split
files and folders load; damaged or unsupported files fail in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from ftserve.kvcache.pool import KVPool
from ftserve.models.checkpoint import write_checkpoint
from ftserve.models.config import ModelConfig, UnsupportedModelError
from ftserve.models.forward_batch import build_forward_batch
from ftserve.models.gguf import GGUFError, read_checkpoint
from ftserve.models.loader import load_model
from ftserve.models.registry import model_class
from ftserve.models.rope import _base_inv_freq, _llama3
from ftserve.tokenizer import TokenizerLoadError, load_tokenizer
from ftserve_kernels.paged_attention import TorchAttentionBackend
from tests.gguf_util import permute, write_gguf

FAMILIES = {"llama": "tiny-dense", "mistral": "tiny-mistral", "qwen2": "tiny-qwen2",
            "qwen3": "tiny-qwen3", "qwen3_moe": "tiny-moe", "mixtral": "tiny-mixtral"}
SEQS = [[1, 415, 2936, 9060, 285, 1142, 10575, 754], [1, 22, 7, 3001, 17, 900, 12000]]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf_src")
    return {fam: write_checkpoint(preset, root / fam, seed=3) for fam, preset in FAMILIES.items()}


def _last_logits(model: torch.nn.Module, seqs: list[list[int]]) -> torch.Tensor:
    cfg = model.config
    counts = [-(-len(s) // 16) for s in seqs]
    pool = KVPool(cfg.num_layers, sum(counts) + 1, 16, cfg.num_kv_heads, cfg.head_dim,
                  torch.float32, "cpu")
    starts = [1 + sum(counts[:i]) for i in range(len(seqs))]
    pages = [list(range(a, a + n)) for a, n in zip(starts, counts)]
    with torch.no_grad():
        return model(build_forward_batch(seqs, [0] * len(seqs), pages, pool, TorchAttentionBackend()))


def _same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_loads_like_its_safetensors(family: str, ckpts: dict[str, Path], tmp_path: Path) -> None:
    src = ckpts[family]
    path = write_gguf(src, tmp_path / f"{family}.gguf", tokenizer=False)  # vocab: test below
    ref, ref_cfg = load_model(src, dtype="float32")
    got, cfg = load_model(path, dtype="float32")
    assert model_class(cfg.architecture) is model_class(ref_cfg.architecture)  # Mistral is llama
    for field in ("num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "hidden_size", "vocab_size", "rope_theta", "rms_norm_eps", "qkv_bias",
                  "qk_norm", "tie_word_embeddings", "sparse_layers", "num_experts",
                  "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "rotary_dim"):
        a, b = getattr(cfg, field), getattr(ref_cfg, field)
        if isinstance(b, float):  # GGUF stores float32; the forward computes in it too
            a, b = np.float32(a), np.float32(b)
        assert a == b, field
    _same_params(got, ref)  # F32: bit for bit, q/k rows un-permuted, experts split
    torch.testing.assert_close(_last_logits(got, SEQS), _last_logits(ref, SEQS), rtol=0, atol=0)


def test_split_parts_folder_and_per_expert_tensors(ckpts: dict[str, Path], tmp_path: Path) -> None:
    src = ckpts["mixtral"]
    ref, _ = load_model(src, dtype="float32")
    split_dir = tmp_path / "split"
    split_dir.mkdir()
    write_gguf(src, split_dir / "m.gguf", split_max_tensors=7, tokenizer=False)
    parts = sorted(split_dir.glob("*.gguf"))
    assert len(parts) > 2 and parts[0].name.endswith(f"-00001-of-{len(parts):05d}.gguf")
    for where in (split_dir, parts[0], parts[-1]):  # the folder or any part names the whole
        got, _ = load_model(where, dtype="float32")
        _same_params(got, ref)
    one = tmp_path / "one"
    one.mkdir()
    write_gguf(src, one / "old-mixtral.gguf", per_expert=True, tokenizer=False)  # blk.N.ffn_gate.E.weight
    got, _ = load_model(one, dtype="float32")
    _same_params(got, ref)
    parts[1].unlink()
    with pytest.raises(GGUFError, match="missing part"):
        read_checkpoint(parts[0])


QUANT_TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.BF16, Q.F16]


K_QUANTS = {"blk.0.ffn_down.weight": Q.Q6_K, "blk.1.ffn_down.weight": Q.Q4_K,
            "blk.2.ffn_down.weight": Q.Q5_K}


def _random_k_blocks(kind: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks (gguf cannot quantize to these) with small float16 scales."""
    per, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows, cols // per * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    scales = rng.uniform(-1e-3, 1e-3, (blocks.shape[0], 2)).astype(np.float16)
    if kind == Q.Q6_K:
        blocks[:, 208:210] = scales[:, :1].view(np.uint8)
    else:  # d and dmin lead the block
        blocks[:, 0:4] = scales.view(np.uint8)
    return raw


def test_quantized_tensors_load_as_ggml_dequantizes_them(tmp_path: Path) -> None:
    """Every matrix quantized, the types in rotation (K-quants as random blocks):
    each loaded weight equals gguf.quants.dequantize of its data, q/k rows
    un-permuted, and stays close to the float32 original."""
    src = write_checkpoint("tiny-dense", tmp_path / "src", layers=3, seed=4,
                           overrides={"intermediate_size": 256})  # K-quant rows hold 256
    stored: dict[str, np.ndarray] = {}
    rng = np.random.default_rng(0)
    kinds = iter(QUANT_TYPES * 100)

    def encode(name: str, a: np.ndarray) -> tuple[np.ndarray, object]:
        if a.ndim == 1:
            return a, None
        kind = K_QUANTS.get(name) or next(kinds)
        if kind in K_QUANTS.values():
            raw = _random_k_blocks(kind, *a.shape, rng)
        elif kind == Q.F16:
            raw = a.astype(np.float16)
        else:
            raw = quants.quantize(a, kind)
        stored[name] = raw.astype(np.float32) if kind == Q.F16 else quants.dequantize(raw, kind)
        return raw, (None if kind == Q.F16 else kind)

    path = write_gguf(src, tmp_path / "q.gguf", encode=encode, tokenizer=False)
    types = {gguf.GGMLQuantizationType(s.qtype).name for s in read_checkpoint(path).tensors.values()}
    assert {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16", "F16", "Q4_K", "Q5_K", "Q6_K"} <= types
    got, cfg = load_model(path, dtype="float32")
    ref, _ = load_model(src, dtype="float32")
    params, refp = dict(got.named_parameters()), dict(ref.named_parameters())
    q, inter = cfg.q_size, cfg.intermediate_size
    for layer in range(cfg.num_layers):
        qkv = params[f"layers.{layer}.self_attn.qkv_proj.weight"]
        stored_q = stored[f"blk.{layer}.attn_q.weight"]
        # the stored rows with the converter's permutation undone (pairs back to halves)
        halves = stored_q.reshape(cfg.num_heads, cfg.head_dim // 2, 2, -1).swapaxes(1, 2).reshape(q, -1)
        assert np.array_equal(permute(halves, cfg.num_heads), stored_q)
        assert torch.equal(qkv[:q], torch.from_numpy(halves))
        gate_up = params[f"layers.{layer}.mlp.gate_up_proj.weight"]
        assert torch.equal(gate_up[inter:], torch.from_numpy(stored[f"blk.{layer}.ffn_up.weight"]))
        for ours, theirs in (("mlp.down_proj", "ffn_down"), ("self_attn.o_proj", "attn_output")):
            assert torch.equal(params[f"layers.{layer}.{ours}.weight"],
                               torch.from_numpy(stored[f"blk.{layer}.{theirs}.weight"])), theirs
    emb, ref_emb = params["embed_tokens.weight"], refp["embed_tokens.weight"]
    assert torch.equal(emb, torch.from_numpy(stored["token_embd.weight"]))
    assert (emb - ref_emb).norm() / ref_emb.norm() < 0.2  # quantized, not garbage


def test_llama3_rope_from_rope_freqs(tmp_path: Path) -> None:
    """Llama 3.1 GGUFs carry the long-context rope as a rope_freqs tensor of divisors."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    src = write_checkpoint("tiny-dense", tmp_path / "l3", seed=5, overrides={"rope_scaling": scaling})
    ref, ref_cfg = load_model(src, dtype="float32")
    dim = ref_cfg.rotary_dim
    base = _base_inv_freq(ref_cfg.rope_theta, dim)
    factors = (base / _llama3(ref_cfg.rope_scaling, ref_cfg.rope_theta, dim)).numpy().astype(np.float32)
    path = write_gguf(src, tmp_path / "l3.gguf", extra={"rope_freqs.weight": factors}, tokenizer=False)
    got, cfg = load_model(path, dtype="float32")
    assert cfg.rope_scaling.freq_factors is not None
    long = [list(range(5, 205))]  # past the original 64 positions, where the factors matter
    torch.testing.assert_close(_last_logits(got, long), _last_logits(ref, long), rtol=1e-5, atol=1e-5)
    plain, _ = load_model(write_gguf(src, tmp_path / "plain.gguf", tokenizer=False), dtype="float32")
    assert not torch.allclose(_last_logits(plain, long), _last_logits(ref, long), atol=1e-3)


def test_sentencepiece_vocab_tokenizes_like_the_original(ckpts: dict[str, Path], tmp_path: Path) -> None:
    src = ckpts["llama"]
    path = write_gguf(src, tmp_path / "t.gguf")
    ours, orig = load_tokenizer(path), load_tokenizer(src)
    texts = ["Hello world", "  leading spaces", "[INST] hi [/INST]", "naïve café 🤖 東京",
             "line\n\nbreaks\ttab", "x" * 50, "1234567 + 89 = ?"]
    for t in texts:
        assert ours.encode(t) == orig.encode(t), t
        assert ours.encode_continuation(t) == orig.encode_continuation(t), t
        assert ours.decode(ours.encode(t)) == orig.decode(orig.encode(t))
    assert (ours.bos_id, ours.eos_ids, ours.special_prefix) == (orig.bos_id, orig.eos_ids, orig.special_prefix)
    assert ours.special_tokens == orig.special_tokens
    assert ours.chat_template == orig.chat_template


# --- bad input: one line each, never a traceback ---------------------------------------

def _one_line(err: BaseException) -> str:
    text = str(err)
    assert "\n" not in text and len(text) < 400, text
    return text


def test_truncated_and_corrupt_files(ckpts: dict[str, Path], tmp_path: Path) -> None:
    good = write_gguf(ckpts["llama"], tmp_path / "good.gguf", tokenizer=False).read_bytes()
    for cut in (100, len(good) // 2, len(good) - 10):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(good[:cut])
        with pytest.raises(GGUFError) as err:
            ModelConfig.from_pretrained(bad)
        assert bad.name in _one_line(err.value)
    noise = tmp_path / "noise.gguf"
    noise.write_bytes(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        load_model(noise)
    header = bytearray(good)
    header[8:16] = (10**12).to_bytes(8, "little")  # an absurd tensor count
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(bytes(header))
    with pytest.raises(GGUFError) as err:
        load_model(bogus)
    _one_line(err.value)


def test_unknown_architecture_and_missing_tokenizer(ckpts: dict[str, Path], tmp_path: Path) -> None:
    gemma = write_gguf(ckpts["llama"], tmp_path / "gemma.gguf", arch="gemma2", tokenizer=False)
    with pytest.raises(UnsupportedModelError) as err:
        load_model(gemma)
    assert "gemma2" in _one_line(err.value) and "qwen3moe" in str(err.value)
    bare = write_gguf(ckpts["qwen2"], tmp_path / "bare.gguf", tokenizer=False)
    load_model(bare)  # the weights are fine
    with pytest.raises(TokenizerLoadError) as err2:
        load_tokenizer(bare)
    assert "no tokenizer" in _one_line(err2.value)


def test_unsupported_tensor_type_names_tensor_and_type(ckpts: dict[str, Path], tmp_path: Path) -> None:
    def encode(name: str, a: np.ndarray) -> tuple[np.ndarray, object]:
        if name == "blk.1.ffn_up.weight":
            return np.zeros(a.shape, dtype=np.int8), None  # I8: ggml stores it, nobody dequantizes it
        return a, None

    path = write_gguf(ckpts["llama"], tmp_path / "i8.gguf", encode=encode, tokenizer=False)
    with pytest.raises(GGUFError) as err:
        load_model(path)
    assert "'blk.1.ffn_up.weight'" in _one_line(err.value) and "I8" in str(err.value)


def test_serve_a_corrupt_gguf_fails_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(60))
    env = {"FTSERVE_CACHE_DIR": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "ftserve", "serve", "--model", str(bad), "--port",
                           "0", "--device", "cpu", "--status-log-interval", "0"],
                          capture_output=True, text=True, timeout=240,
                          env={**env, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    errors = [ln for ln in done.stderr.splitlines() if "broken.gguf" in ln and "ERROR" in ln]
    assert len(errors) == 1 and "not a readable GGUF" in errors[0], done.stderr


def test_metadata_is_read_once(ckpts: dict[str, Path], tmp_path: Path) -> None:
    path = write_gguf(ckpts["qwen3"], tmp_path / "once.gguf", tokenizer=False)
    assert read_checkpoint(path) is read_checkpoint(path)  # model, engine and tokenizer share it
    meta = read_checkpoint(path).metadata
    assert meta["general.architecture"] == "qwen3" and json.dumps(meta["qwen3.block_count"])


def test_expert_offload_reads_gguf_experts_into_the_host_bank(ckpts: dict[str, Path],
                                                              tmp_path: Path) -> None:
    from ftserve.moe.banks import load_offloaded_model

    src = ckpts["qwen3_moe"]
    path = write_gguf(src, tmp_path / "moe.gguf", tokenizer=False)
    cpu = torch.device("cpu")
    _, _, ref = load_offloaded_model(src, "float32", cpu, "safetensors")
    model, cfg, bank = load_offloaded_model(path, "float32", cpu, "safetensors")
    assert cfg.num_experts > 1
    for j in range(len(cfg.sparse_layers)):
        assert torch.equal(bank.w13(j), ref.w13(j)) and torch.equal(bank.w2(j), ref.w2(j))


def _byte_level_meta(pre: str | None) -> dict[str, object]:
    from ftserve.tokenizer.hf_backend import _gpt2_byte_decoder

    alphabet = sorted(_gpt2_byte_decoder(), key=lambda c: _gpt2_byte_decoder()[c])
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *alphabet, "Ġt", "he", "Ġthe"]
    meta: dict[str, object] = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 3] + [1] * (len(tokens) - 3),
        "tokenizer.ggml.merges": ["Ġ t", "h e", "Ġt he"],
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 1,
    }
    if pre is not None:
        meta["tokenizer.ggml.pre"] = pre
    return meta


def test_byte_level_vocab_and_its_pre_tokenizer_names() -> None:
    from ftserve.tokenizer.gguf import GGUFTokenizerError, load_gguf_tokenizer

    tok = load_gguf_tokenizer(_byte_level_meta("smollm"))
    ids = tok.encode("the the 42<|im_end|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == "the the 42<|im_end|>"
    assert [tok.id_to_piece(i) for i in ids[:3]] == ["t", "he", "Ġthe"] and ids[-1] == 2
    assert tok.id_to_piece(ids[-3]) == "4" and tok.id_to_piece(ids[-2]) == "2"  # digits split
    # eos: the metadata's (here <|im_start|>, as a badly converted file may say), then the
    # end-of-turn control tokens generation also stops at
    assert tok.eos_ids[0] == 1 and set(tok.eos_ids) == {0, 1, 2}
    with_bos = load_gguf_tokenizer({**_byte_level_meta("smollm"), "tokenizer.ggml.add_bos_token": True})
    assert with_bos.special_prefix == (1,) and with_bos.encode("the") == [1, *tok.encode("the", False)]
    for pre in ("llama-bpe", "qwen2", "gpt2", None):  # None: GPT-2's split, with a warning
        assert load_gguf_tokenizer(_byte_level_meta(pre)).encode("the 1234", False)
    from ftserve.tokenizer import ChatTemplate

    named = load_gguf_tokenizer({**_byte_level_meta("gpt2"), "tokenizer.chat_template": "A{{ x }}",
                                 "tokenizer.chat_template.tool_use": "T{{ x }}"})
    template = ChatTemplate(named.chat_template)
    assert template.source() == "A{{ x }}" and template.source(tools=[{}]) == "T{{ x }}"
    with pytest.raises(GGUFTokenizerError, match="pre-tokenizer 'klingon' is not supported"):
        load_gguf_tokenizer(_byte_level_meta("klingon"))
