"""tools/make_model.py and write_checkpoint: complete, loadable HF checkpoint directories."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
from safetensors import safe_open
from transformers import AutoConfig
from transformers.utils.chat_template_utils import render_jinja_template

from ftserve.models.checkpoint import CHAT_TEMPLATE, tensor_shapes, write_checkpoint
from ftserve.models.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]


def test_cli_writes_complete_sharded_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "ck"
    cmd = [sys.executable, str(ROOT / "tools/make_model.py"), "--preset", "tiny-moe", "--out", str(out),
           "--layers", "3", "--seed", "4", "--dtype", "bfloat16", "--shard-size-mb", "2"]
    subprocess.run(cmd, check=True, capture_output=True, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.model", "tokenizer_config.json",
            "model.safetensors.index.json"} <= names
    hf = json.loads((out / "config.json").read_text())
    assert hf["num_hidden_layers"] == 3 and hf["architectures"] == ["Qwen3MoeForCausalLM"]
    assert hf["num_experts"] >= 16 and hf["num_experts_per_tok"] >= 2
    # transformers reads the config as the right class
    auto = AutoConfig.from_pretrained(out)
    assert type(auto).__name__ == "Qwen3MoeConfig" and auto.num_experts == hf["num_experts"]

    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    expected = tensor_shapes(hf)
    assert set(index["weight_map"]) == set(expected)
    total = 0
    for shard in shards:
        with safe_open(str(out / shard), framework="pt") as f:
            for name in f.keys():
                assert index["weight_map"][name] == shard
                t = f.get_tensor(name)
                assert t.dtype == torch.bfloat16 and tuple(t.shape) == expected[name]
                total += t.numel() * t.element_size()
    assert index["metadata"]["total_size"] == total
    assert "model.layers.2.mlp.experts.15.down_proj.weight" in index["weight_map"]

    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    assert sp.vocab_size() == hf["vocab_size"] == 32768
    assert (sp.bos_id(), sp.eos_id()) == (hf["bos_token_id"], hf["eos_token_id"])
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == sp.eos_id()


def test_seed_decides_the_weights(tmp_path: Path) -> None:
    a = write_checkpoint("tiny-dense", tmp_path / "a", seed=1, layers=1)
    b = write_checkpoint("tiny-dense", tmp_path / "b", seed=1, layers=1)
    c = write_checkpoint("tiny-dense", tmp_path / "c", seed=2, layers=1)
    name = "model-00001-of-00001.safetensors"
    assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / name).read_bytes() != (c / name).read_bytes()


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b", "qwen3-next-80b-a3b",
                                    "smollm2-135m", "mistral-7b-v0.3"])
def test_config_only_real_shapes(preset: str, tmp_path: Path) -> None:
    out = write_checkpoint(preset, tmp_path, config_only=True)
    assert not list(out.glob("*.safetensors"))
    cfg = ModelConfig.from_pretrained(out)
    hf = json.loads((out / "config.json").read_text())
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    assert sp.vocab_size() <= cfg.vocab_size  # every token id has an embedding row
    assert cfg.eos_token_ids == (sp.eos_id(),)
    assert AutoConfig.from_pretrained(out).hidden_size == hf["hidden_size"]


def test_every_tiny_preset_vocab_matches_tokenizer(tmp_path: Path) -> None:
    for preset in ["tiny-dense", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-moe", "tiny-mixtral"]:
        out = write_checkpoint(preset, tmp_path / preset, config_only=True)
        sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
        assert ModelConfig.from_pretrained(out).vocab_size == sp.vocab_size() == 32768


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call0001a", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call0001a", "content": "sunny, 21C"},
    {"role": "assistant", "content": "Sunny, 21C."},
    {"role": "user", "content": "Thanks"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def _render(messages: list[dict], tools: list[dict] | None = None, gen: bool = True) -> str:
    rendered, _ = render_jinja_template(
        [messages], tools=tools, chat_template=CHAT_TEMPLATE, add_generation_prompt=gen,
        bos_token="<s>", eos_token="</s>",
    )
    return rendered[0]


def test_chat_template_renders_all_roles(tmp_path: Path) -> None:
    out = write_checkpoint("tiny-dense", tmp_path, config_only=True)
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"] == CHAT_TEMPLATE
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"]) == ("<s>", "</s>")
    text = _render(CONVERSATION, TOOLS)
    assert text == (
        '<s>[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "get_weather", '
        '"parameters": {"type": "object"}}}][/AVAILABLE_TOOLS]'
        "[INST] Be brief.\n\nHi[/INST] Hello!</s>"
        "[INST] Weather in Paris?[/INST]"
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call0001a"}]</s>'
        '[TOOL_RESULTS] {"call_id": "call0001a", "content": "sunny, 21C"}[/TOOL_RESULTS]'
        " Sunny, 21C.</s>[INST] Thanks[/INST]"
    )
    # control tokens of the template are single pieces of the shipped tokenizer
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    for piece in ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[TOOL_RESULTS]"]:
        assert sp.piece_to_id(piece) != sp.unk_id()
    with pytest.raises(Exception, match="unknown role"):
        _render([{"role": "narrator", "content": "x"}])


def test_chat_template_is_prefix_stable() -> None:
    """Each turn's prompt is a prefix of the next turn's: the incremental tokenizer relies on it."""
    for k in range(1, len(CONVERSATION)):
        if CONVERSATION[k - 1]["role"] in ("user", "tool"):
            assert _render(CONVERSATION).startswith(_render(CONVERSATION[:k], gen=True))
    assert _render(CONVERSATION[:2], gen=True) == _render(CONVERSATION[:2], gen=False)
