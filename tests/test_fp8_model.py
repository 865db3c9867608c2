"""fp8 checkpoints on the CPU (issue 32): the quantization_config ftserve serves
and the one-line start-up error for the ones it does not; make_model's HF fp8
layout; modules left unquantized; weights the model keeps in its dtype
dequantized at load; compressed-tensors per-channel / per-tensor checkpoints;
dummy fp8 weights; the engine against the full-recompute reference on an fp8
model (test_engine's scenarios, reused).

Logit parity with transformers on the same fp8 checkpoints runs in
test_parity.py (families qwen3_fp8, qwen3_moe_fp8); the kernels in
test_kernels_fp8.py; fp8 expert offload in test_fp8_moe_cache.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ftserve.config import EngineConfig
from ftserve.engine.engine import Engine
from ftserve.models.checkpoint import write_checkpoint
from ftserve.models.config import ModelConfig
from ftserve.models.fp8_config import Fp8Config, UnsupportedQuantization, parse_quantization
from ftserve.models.layers import Linear, MoEBlock
from ftserve.models.loader import load_model
from ftserve.models.presets import PRESETS
from ftserve_kernels.fp8_quant import FP8, Fp8Weight, dequantize, quantize_weight
from tests import test_engine as te
from tests.test_parity import TOL, PagedSession, Pair, _prompts

FP8_Q = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


def _ct(strategy: str, **weights: Any) -> dict[str, Any]:
    w = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False}
    w.update(weights)
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": w,
                                          "input_activations": {"num_bits": 8, "type": "float",
                                                                "strategy": "token", "dynamic": True}}}}


# ------------------------------------------------------------------ configs


@pytest.mark.parametrize("q,field", [
    ({**FP8_Q, "weight_block_size": [64, 64]}, "weight_block_size"),
    ({**FP8_Q, "weight_block_size": None}, "weight_block_size"),
    ({**FP8_Q, "activation_scheme": "static"}, "activation_scheme"),
    ({**FP8_Q, "fmt": "e5m2"}, "fmt"),
    ({"quant_method": "awq", "bits": 4}, "quant_method"),
    ({"quant_method": "bitsandbytes"}, "quant_method"),
    ({**_ct("channel"), "format": "pack-quantized"}, "format"),
    (_ct("group", group_size=128), "config_groups.group_0.weights"),
    (_ct("block", block_structure=[64, 128]), "config_groups.group_0.weights.block_structure"),
    (_ct("channel", num_bits=4, type="int"), "config_groups.group_0.weights"),
    ({**_ct("tensor"), "kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
])
def test_unservable_quantization_is_a_one_line_startup_error(q: dict[str, Any], field: str,
                                                              tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**PRESETS["tiny-moe"], "quantization_config": q}))
    with pytest.raises(UnsupportedQuantization) as err:
        ModelConfig.from_pretrained(tmp_path)
    msg = str(err.value)
    assert msg.startswith(f"quantization_config.{field} ") and "\n" not in msg, msg
    from ftserve.engine.setup import build_engine

    with pytest.raises(UnsupportedQuantization, match=f"quantization_config.{field} "):
        build_engine(EngineConfig(model=str(tmp_path), load_format="dummy", device="cpu"))


def test_unservable_quantization_stops_ftserve_serve_in_one_line(tmp_path: Path) -> None:
    """`ftserve serve` on a checkpoint whose fp8 config it cannot serve (even with
    --load-format dummy): exit status 1, one ERROR line naming the field, no traceback."""
    import os
    import subprocess
    import sys

    write_checkpoint("tiny-moe-fp8", tmp_path, config_only=True)
    hf = json.loads((tmp_path / "config.json").read_text())
    hf["quantization_config"]["weight_block_size"] = [64, 64]
    (tmp_path / "config.json").write_text(json.dumps(hf))
    run = subprocess.run(
        [sys.executable, "-m", "ftserve", "serve", "--model", str(tmp_path), "--load-format", "dummy",
         "--device", "cpu", "--port", "0", "--status-log-interval", "0"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    errors = [line for line in run.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "quantization_config.weight_block_size [64, 64]" in errors[0], run.stderr


def test_servable_quantization_configs() -> None:
    assert parse_quantization({}) is None
    hf = parse_quantization({"quantization_config": {"quant_method": "fp8"}})  # transformers' defaults
    assert hf == Fp8Config("fp8", "block", "weight_scale_inv")
    q = parse_quantization({"quantization_config": {**FP8_Q, "modules_to_not_convert": [
        "lm_head", "model.layers.0.mlp.gate", "mlp.shared_expert_gate", "model.layers.1"]}})
    assert q is not None
    # transformers' matching: a prefix up to a module boundary, or a suffix.
    assert not q.quantizes("model.layers.0.mlp.gate") and q.quantizes("model.layers.0.mlp.gate_proj")
    assert q.quantizes("model.layers.2.mlp.gate") is True  # listed for layer 0 only
    assert not q.quantizes("model.layers.3.mlp.shared_expert_gate")
    assert not q.quantizes("model.layers.1.self_attn.q_proj") and q.quantizes("model.layers.11.self_attn.q_proj")
    assert not q.quantizes("lm_head")
    for strategy in ("tensor", "channel", "block"):
        extra = {"block_structure": [128, 128]} if strategy == "block" else {}
        ct = parse_quantization({"quantization_config": {**_ct(strategy, **extra),
                                                         "ignore": ["lm_head", "re:.*mlp\\.gate$"]}})
        assert ct is not None and ct.strategy == strategy and ct.scale_suffix == "weight_scale"
        assert not ct.quantizes("model.layers.4.mlp.gate") and ct.quantizes("model.layers.4.mlp.gate_proj")


# ------------------------------------------------------------------ make_model


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def test_make_model_writes_the_hf_fp8_layout(tmp_path: Path) -> None:
    """--quant fp8: every projection and expert weight as e4m3 codes with fp32
    weight_scale_inv per 128 x 128 block, the block-quantized values of the
    weights the unquantized preset writes with the same seed; lm_head, the
    routers, norms and embeddings as they were; quantization_config as HF's."""
    from tools import make_model

    make_model.main(["--preset", "tiny-moe", "--quant", "fp8", "--out", str(tmp_path / "q"), "--seed", "4"])
    write_checkpoint("tiny-moe", tmp_path / "f", seed=4)
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    q = cfg["quantization_config"]
    assert {k: q[k] for k in FP8_Q} == FP8_Q and q["fmt"] == "e4m3"
    assert q["modules_to_not_convert"] == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate", "lm_head"]
    fp8, ref = _tensors(tmp_path / "q"), _tensors(tmp_path / "f")
    quantized = 0
    for name, w in ref.items():
        module = name.removesuffix(".weight")
        scale = fp8.get(f"{name}_scale_inv")
        if scale is None:
            assert torch.equal(fp8[name], w), name
            assert module.endswith(("norm", "mlp.gate", "embed_tokens", "lm_head")), name
            continue
        quantized += 1
        codes = fp8[name]
        n, k = w.shape
        assert codes.dtype == FP8 and codes.shape == w.shape
        assert scale.dtype == torch.float32 and scale.shape == (math.ceil(n / 128), math.ceil(k / 128))
        deq = dequantize(Fp8Weight(codes, scale, 128, 128))
        # e4m3: 3 mantissa bits, round to nearest: half an ulp is 2^-4 of the value;
        # below the normal range (2^-6 * scale) steps of 2^-9 * scale.
        step = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        assert ((deq - w).abs() <= 2.0 ** -4 * w.abs() + 2.0 ** -10 * step).all(), name
        if scale.numel() == 1:  # one (partial) block: its amax maps to the largest code
            assert scale.item() == (w.abs().amax() / 448).item() and codes.float().abs().max() == 448
    assert quantized == 2 * (3 + 1 + 16 * 3)  # per layer: q k v, o, 16 experts x 3
    assert set(fp8) == set(ref) | {f"{n}_scale_inv" for n in ref if f"{n}_scale_inv" in fp8}


@pytest.mark.parametrize("preset,layers,params_b", [("qwen3-30b-a3b-fp8", None, 30.5),
                                                     ("qwen3-235b-a22b-fp8", 12, None)])
def test_real_shape_fp8_presets(preset: str, layers: int | None, params_b: float | None, tmp_path: Path) -> None:
    """The published fp8 releases' shapes on the meta device: every projection and
    expert in fp8 with whole 128 x 128 blocks; the fp8 weights take about half the
    bytes of the bf16 ones (embeddings and lm_head stay bf16)."""
    from ftserve.models.loader import build_model

    write_checkpoint(preset, tmp_path, config_only=True, layers=layers)
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert cfg.quant is not None and cfg.quant.block == (128, 128)
    q = build_model(cfg, torch.bfloat16, torch.device("meta"))
    base = ModelConfig.from_hf({**json.loads((tmp_path / "config.json").read_text()), "quantization_config": None})
    b = build_model(base, torch.bfloat16, torch.device("meta"))
    if params_b is not None:
        assert sum(p.numel() for p in b.parameters()) / 1e9 == pytest.approx(params_b, rel=0.01)
    fp8_bytes = sum(p.numel() * p.element_size() for p in q.parameters())
    bf16_bytes = sum(p.numel() * p.element_size() for p in b.parameters())
    assert 0.5 < fp8_bytes / bf16_bytes < (0.52 if layers is None else 0.53), fp8_bytes / bf16_bytes
    for name, p in q.named_parameters():
        if name.endswith(("qkv_proj.weight", "o_proj.weight", ".w13", ".w2")):
            assert p.dtype == FP8, name
        if name.endswith("_scale"):
            assert p.dtype == torch.float32
    assert q.layers[0].self_attn.qkv_proj.fp8_block == (128, 128)  # 4096 q rows, 512 k, 512 v


# ------------------------------------------------------------------ loading


def test_modules_to_not_convert_stay_in_model_dtype(tmp_path: Path) -> None:
    """A checkpoint that leaves layer 1's o_proj and every down_proj unquantized:
    those layers load in the model dtype, the rest in fp8, and the logits match
    transformers on the same checkpoint (dequantized)."""
    skip = ["lm_head", "model.layers.1.self_attn.o_proj", "down_proj"]
    write_checkpoint("tiny-qwen3-fp8", tmp_path, seed=2, shard_size_mb=4,
                     overrides={"quantization_config": {**FP8_Q, "modules_to_not_convert": skip}})
    pair = Pair("skip", tmp_path)
    layers = pair.model.layers
    assert layers[0].self_attn.o_proj.weight.dtype == FP8 and layers[1].self_attn.o_proj.weight.dtype == torch.float32
    assert all(layer.mlp.down_proj.weight_scale is None for layer in layers)
    assert all(layer.mlp.gate_up_proj.weight.dtype == FP8 for layer in layers)
    prompts = _prompts(pair.cfg.vocab_size, [5, 17], seed=1)
    sess = PagedSession(pair.model)
    logits = sess.step([sess.new_seq(), sess.new_seq()], prompts, all_logits=True)
    assert (logits[:5] - pair.hf_logits(prompts[0])).abs().max().item() <= TOL
    assert (logits[5:] - pair.hf_logits(prompts[1])).abs().max().item() <= TOL


def test_quantized_router_and_partial_fusion_dequantized_at_load(tmp_path: Path) -> None:
    """A checkpoint that quantizes the routers (which ftserve runs in the model
    dtype) and only k_proj of layer 0's q/k/v: those weights are dequantized
    on their way in, to exactly codes x scale."""
    skip = ["lm_head", "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"]
    write_checkpoint("tiny-moe-fp8", tmp_path, seed=3, layers=1,
                     overrides={"quantization_config": {**FP8_Q, "modules_to_not_convert": skip}})
    model, cfg = load_model(tmp_path, dtype="float32")
    stored = _tensors(tmp_path)
    layer = model.layers[0]
    assert isinstance(layer.mlp, MoEBlock) and layer.mlp.is_fp8
    name = "model.layers.0.mlp.gate.weight"
    want = dequantize(Fp8Weight(stored[name], stored[f"{name}_scale_inv"], 128, 128))
    assert layer.mlp.gate.weight.dtype == torch.float32 and torch.equal(layer.mlp.gate.weight, want)
    qkv = layer.self_attn.qkv_proj
    assert qkv.weight_scale is None  # a fused projection is fp8 only when every part is
    k = "model.layers.0.self_attn.k_proj.weight"
    q_rows = cfg.q_size
    assert torch.equal(qkv.weight[q_rows:q_rows + cfg.kv_size],
                       dequantize(Fp8Weight(stored[k], stored[f"{k}_scale_inv"], 128, 128)))
    assert torch.equal(qkv.weight[:q_rows], stored["model.layers.0.self_attn.q_proj.weight"])


def test_fp8_tensor_without_scale_is_a_checkpoint_error(tmp_path: Path) -> None:
    write_checkpoint("tiny-qwen3-fp8", tmp_path, seed=1, layers=1)
    f = next(tmp_path.glob("*.safetensors"))
    tensors = _tensors(tmp_path)
    for p in tmp_path.glob("*.safetensors"):
        p.unlink()
    (tmp_path / "model.safetensors.index.json").unlink()
    tensors.pop("model.layers.0.self_attn.o_proj.weight_scale_inv")
    save_file(tensors, str(f))
    with pytest.raises(ValueError, match="o_proj.weight"):
        load_model(tmp_path, dtype="float32")


def _to_compressed_tensors(src: Path, dst: Path, deq: Path, strategy: str) -> None:
    """Rewrite a float32 checkpoint as compressed-tensors fp8 (``dst``: e4m3
    weights with ``weight_scale`` per output channel or per tensor, and static
    ``input_scale`` tensors ftserve does not read) and as the same weights
    dequantized in a plain checkpoint (``deq``) for transformers."""
    cfg = json.loads((src / "config.json").read_text())
    tensors = _tensors(src)
    qt, dt = {}, {}
    for name, w in tensors.items():
        module = name.removesuffix(".weight")
        if w.dim() != 2 or "norm" in name or "embed" in name or module == "lm_head":
            qt[name] = dt[name] = w
            continue
        amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
        scale = (amax / 448).float()
        codes = (w / (scale if strategy == "channel" else scale[0])).to(FP8)
        qt[name], qt[f"{module}.weight_scale"] = codes, scale
        qt[f"{module}.input_scale"] = torch.tensor([0.05])
        dt[name] = codes.float() * (scale if strategy == "channel" else scale[0])
    for out, ts, q in ((dst, qt, _ct(strategy)), (deq, dt, None)):
        out.mkdir()
        for f in src.iterdir():
            if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
                (out / f.name).write_bytes(f.read_bytes())
        save_file(ts, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps({**cfg, "quantization_config": q} if q else cfg))


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_compressed_tensors_fp8(strategy: str, tmp_path: Path) -> None:
    """compressed-tensors float-quantized, per channel and per tensor: projections
    in fp8 with one scale per row (per-tensor scales expanded, fused q/k/v
    keeping each its own), equal to transformers on the dequantized weights."""
    write_checkpoint("tiny-moe", tmp_path / "src", seed=5, dtype="float32", layers=2)
    _to_compressed_tensors(tmp_path / "src", tmp_path / "ct", tmp_path / "deq", strategy)
    model, cfg = load_model(tmp_path / "ct", dtype="float32")
    assert cfg.quant is not None and cfg.quant.strategy == strategy
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8 and qkv.fp8_block == (1, cfg.hidden_size)
    assert qkv.weight_scale is not None and qkv.weight_scale.shape == (cfg.q_size + 2 * cfg.kv_size, 1)
    if strategy == "tensor":  # three stored scalars, one per part
        assert qkv.weight_scale.unique().numel() == 3
    assert model.layers[0].mlp.is_fp8
    pair = Pair(strategy, tmp_path / "deq")
    prompts = _prompts(cfg.vocab_size, [7, 19], seed=3)
    sess = PagedSession(model)
    logits = sess.step([sess.new_seq(), sess.new_seq()], prompts, all_logits=True)
    assert (logits[:7] - pair.hf_logits(prompts[0])).abs().max().item() <= TOL
    assert (logits[7:] - pair.hf_logits(prompts[1])).abs().max().item() <= TOL


def test_qwen3_next_fp8_against_transformers(tmp_path: Path) -> None:
    """The hybrid Qwen3-Next with HF's fp8 layout (as Qwen3-Next-80B-A3B-FP8 ships):
    the linear-attention in/out projections, gated attention, routed and shared
    experts in e4m3, the routers in fp32; logits equal transformers' forward of the
    dequantized checkpoint within test_parity's float32 bound (the same reasoning:
    both multiply the same dequantized weights in fp32). Dimensions are multiples
    of 128 or below it, as transformers' CPU dequantization needs (tiny fp8 presets)."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    from tests.test_qwen3_next import HybridSession
    from tests.test_qwen3_next import _prompts as next_prompts

    wide = {"hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 128,
            "shared_expert_intermediate_size": 128, "linear_key_head_dim": 32, "linear_value_head_dim": 32}
    write_checkpoint("tiny-qwen3-next", tmp_path, seed=7, dtype="float32", overrides=wide, quant="fp8")
    model, cfg = load_model(tmp_path, dtype="float32")
    lin, full = model.layers[0], model.layers[cfg.kv_layers[0]]
    assert lin.linear_attn is not None and full.self_attn is not None
    assert lin.linear_attn.in_proj.weight.dtype == lin.linear_attn.out_proj.weight.dtype == FP8
    assert full.self_attn.qkv_proj.weight.dtype == FP8 and lin.mlp.is_fp8
    assert lin.mlp.shared_expert.gate_up_proj.weight.dtype == FP8 and lin.mlp.gate.weight.dtype == torch.float32
    hf, info = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, output_loading_info=True,
                                                    quantization_config=FineGrainedFP8Config(dequantize=True))
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    prompts = next_prompts([5, 19, 70], seed=0)
    sess = HybridSession(model, num_slots=4)
    logits = sess.step([sess.new_seq() for _ in prompts], prompts, all_logits=True)
    off = 0
    with torch.no_grad():
        for p in prompts:
            ref = hf.eval()(torch.tensor([p])).logits[0].float()
            assert (logits[off:off + len(p)] - ref).abs().max().item() <= TOL
            off += len(p)


def test_mtp_layer_of_an_fp8_checkpoint(tmp_path: Path) -> None:
    """An fp8 checkpoint that ships an MTP layer (make_model --mtp 1 --quant fp8):
    its projections and experts are stored in e4m3 like the main layers' and load
    as fp8 under --speculative mtp; the engine drafts with them and its greedy
    tokens are plain decoding's."""
    from safetensors import safe_open

    from ftserve.engine.setup import build_engine
    from tests.engine_util import collect, greedy, tokens_of
    from tools.make_model import main as make_model

    make_model(["--preset", "tiny-moe-fp8", "--out", str(tmp_path), "--layers", "1", "--mtp", "1"])
    with safe_open(str(next(tmp_path.glob("*.safetensors"))), framework="pt") as h:
        names = set(h.keys())
    assert {"mtp.fc.weight_scale_inv", "mtp.layers.0.self_attn.q_proj.weight_scale_inv",
            "mtp.layers.0.mlp.experts.0.down_proj.weight_scale_inv"} <= names
    assert "mtp.layers.0.mlp.gate.weight_scale_inv" not in names  # routers stay in the model dtype
    model, _ = load_model(tmp_path, dtype="float32", mtp=True)
    assert model.mtp is not None and model.mtp.fc.weight.dtype == FP8 and model.mtp.layers[0].mlp.is_fp8
    prompts = [("a", [5, 6, 7, 8, 9, 10, 11], greedy(12)), ("b", [40, 41, 42], greedy(12))]
    outs = {}
    for spec in ("off", "mtp"):
        eng = build_engine(EngineConfig(model=str(tmp_path), device="cpu", dtype="float32", speculative=spec,
                                        num_pages=64, status_log_interval=0.0, speculative_gate=False))
        try:
            outs[spec] = {k: tokens_of(v) for k, v in collect(eng, prompts).items()}
            if spec == "mtp":
                assert eng.runner.mtp is not None and eng.stats().spec_verifies_total > 0
        finally:
            eng.shutdown()
    assert outs["mtp"] == outs["off"]


def test_engine_summary_says_fp8(engine: Engine) -> None:
    assert engine.summary["weights_format"] == "fp8" and engine.summary["dtype"] == "float32"


def test_dummy_weights_with_an_fp8_config(tmp_path: Path) -> None:
    """--load-format dummy with an fp8 config: the model dtype's dummy model of the
    same seed, block-quantized (every fp8 weight's codes and scales are its twin's
    weight quantized on the layer's grid; every other parameter equals the twin's),
    so the two formats route alike in a benchmark; a forward is finite."""
    from ftserve.models.checkpoint import write_config

    model, cfg = load_model(write_config("tiny-moe-fp8", tmp_path / "fp8"), dtype="float32", load_format="dummy")
    twin, _ = load_model(write_config("tiny-moe-fp8", tmp_path / "plain", quantization_config=None), dtype="float32",
                         load_format="dummy")
    w = model.layers[0].mlp.w13
    assert w.dtype == FP8 and model.layers[0].mlp.w13_scale is not None
    params = dict(model.named_parameters())
    quantized = 0
    for name, p in twin.named_parameters():
        mine = params[name]
        if mine.dtype != FP8:
            assert torch.equal(mine, p), name
            continue
        path, _, attr = name.rpartition(".")
        mod = model.get_submodule(path)
        block = mod.fp8_block if attr == "weight" else mod.fp8_blocks[attr]
        for k in range(p.shape[0] if p.dim() == 3 else 1):
            q = quantize_weight(p[k] if p.dim() == 3 else p, *block)
            assert torch.equal(q.codes.view(torch.uint8), (mine[k] if p.dim() == 3 else mine).view(torch.uint8))
            assert torch.equal(q.scale, params[f"{name}_scale"][k] if p.dim() == 3 else params[f"{name}_scale"])
        quantized += 1
    assert quantized >= 3 * len(model.layers)  # qkv, o_proj and the experts' pair at least
    weights = dequantize(model.layers[0].mlp.expert_weights()[0])
    assert weights.std().item() == pytest.approx(0.02, rel=0.05)
    assert all(isinstance(m, Linear) and m.weight.dtype == torch.float32
               for m in (model.layers[0].mlp.gate, model.lm_head))
    sess = PagedSession(model)
    out = sess.step([sess.new_seq()], _prompts(cfg.vocab_size, [9], seed=0), all_logits=True)
    assert torch.isfinite(out).all() and out.std() > 0


def test_dummy_fp8_bank_is_the_bf16_bank_quantized() -> None:
    """The offload bank's dummy experts (drawn on the serving device, then copied
    into the bank): an fp8 bank holds the bf16 bank of the same seed, quantized."""
    from ftserve.moe.banks import Fp8Row, HostBank, _fill_bank_dummy

    layers, e, h, i = 2, 3, 256, 128
    plain = HostBank.allocate(layers, e, h, i, torch.bfloat16, pin=False)
    q8 = HostBank.allocate(layers, e, h, i, torch.bfloat16, pin=False, fp8_row=Fp8Row(h, i, (128, 128), (128, 128)))
    _fill_bank_dummy(plain, torch.device("cpu"), 7, torch.bfloat16)
    _fill_bank_dummy(q8, torch.device("cpu"), 7, torch.bfloat16)
    for j in range(layers):
        for name in ("w13", "w2"):
            src, got = plain.layer_params(j)[name], q8.layer_params(j)
            for x in range(e):
                q = quantize_weight(src[x], 128, 128)
                assert torch.equal(q.codes.view(torch.uint8), got[name][x].view(torch.uint8)), (j, name, x)
                assert torch.equal(q.scale, got[f"{name}_scale"][x])
    assert plain.layer_params(0)["w13"].float().std().item() == pytest.approx(0.02, rel=0.05)


# ------------------------------------------------------------------ the engine on an fp8 model
# test_engine's scenarios against the full-recompute reference, on tiny-moe-fp8
# with dummy weights (made context-sensitive through o_proj's scales).


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("tiny-moe-fp8")
    write_checkpoint("tiny-moe-fp8", out, config_only=True)
    return str(out)


@pytest.fixture(scope="module")
def engine(model_dir: str) -> Engine:
    eng = te.make_engine(model_dir)
    assert eng.runner.model.layers[0].mlp.is_fp8
    yield eng
    eng.shutdown()


test_single_request_matches_reference = te.test_single_request_matches_reference
test_sixteen_concurrent_requests = te.test_sixteen_concurrent_requests
test_chunked_prefill_longer_than_chunk = te.test_chunked_prefill_longer_than_chunk
test_second_turn_hits_prefix_cache = te.test_second_turn_hits_prefix_cache
test_preemption_and_resume_exact = te.test_preemption_and_resume_exact
