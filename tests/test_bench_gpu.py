"""tools/bench/gpu.py's code path on the CPU with a tiny Llama checkpoint (the H200
run itself is the lead's): both sides decode the same batches to the same greedy
tokens, the budget cuts rounds, and the roofline counts the checkpoint's weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402

from ftserve.models.checkpoint import write_checkpoint  # noqa: E402
from tools.bench import gpu as bench_gpu  # noqa: E402
from tools.bench.side_by_side import FtserveSide, TransformersSide  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint("tiny-dense", tmp_path_factory.mktemp("m") / "m", dtype="float32")


def _weights_read_per_step(model: Path, batch: int) -> int:
    """Elements a decode step reads, from the checkpoint's own tensors: every
    matrix once except the embedding, of which only the batch's rows (unless the
    lm_head is the embedding), norms left out as the roofline leaves them."""
    cfg = json.loads((model / "config.json").read_text())
    total = 0
    for f in model.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                shape = st.get_slice(name).get_shape()
                if len(shape) == 2 and "embed_tokens" not in name:
                    total += shape[0] * shape[1]
    if cfg.get("tie_word_embeddings"):
        total += cfg["vocab_size"] * cfg["hidden_size"]
    return total + batch * cfg["hidden_size"]


def test_bench_gpu_path_on_cpu(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    # --budget-s 0: the first round runs, the second would end past the budget.
    assert bench_gpu.main(["--model", str(model), "--device", "cpu", "--dtype", "float32",
                           "--batches", "1,3", "--prompt-tokens", "8", "--decode-tokens", "6",
                           "--ttft-tokens", "40", "--repeats", "2", "--budget-s", "0",
                           "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["rounds"] == 1 and len(res["ttft"]["runs_s"]["ftserve"]) == 1
    # Same weights, same fp32 math: every row of every batch agrees token for token
    # (a wrong KV page, position or padding on either side would not).
    assert res["ttft"]["first_token_agreement"] == [True]
    assert [r["batch"] for r in res["decode"]] == [1, 3]
    copy = res["bandwidth"]["copy_gbps"]
    assert copy > 0 and res["bandwidth"]["datasheet_gbps"] is None
    for r in res["decode"]:
        b = r["batch"]
        assert r["agreement_leading_tokens"] == [[7] * b]
        assert r["weight_bytes"] == 4 * _weights_read_per_step(model, b)
        # K and V, 2 layers, 2 KV heads of 64 / 4, fp32; 8 + (6 + 1) / 2 positions a row on average
        assert r["kv_bytes"] == pytest.approx(b * 11.5 * 2 * 2 * 2 * 16 * 4)
        roof = r["roofline_tokens_per_s_copy_gbps"]
        assert roof == pytest.approx(b / (r["total_bytes"] / (copy * 1e9)))
        f, h = r["ftserve"], r["transformers"]
        assert f["tokens_per_s"] > 0 and h["tokens_per_s"] > 0
        assert f["frac_of_roofline_copy_gbps"] == pytest.approx(f["tokens_per_s"] / roof)
        assert r["ftserve_over_transformers"] == pytest.approx(f["tokens_per_s"] / h["tokens_per_s"])
    text = capsys.readouterr().out
    assert "| decode batch 3, 6 tokens after 8, tokens/s (median round) |" in text
    assert "as measured copy" in text


def test_sides_agree_on_a_ragged_batch(model: Path) -> None:
    """transformers left-pads a ragged batch; each row must still decode as it
    does in ftserve (the mask and positions skip the padding)."""
    prompts = [[101 + i for i in range(5)], [301 + 7 * i for i in range(13)], [211, 212]]
    ft = FtserveSide(str(model), "float32", "cpu", max_len=64, kv_tokens=256, max_batch=3, overlap=False)
    hf = TransformersSide(str(model), "float32", "cpu")
    a, b = ft.decode(prompts, 5), hf.decode(prompts, 5)
    ft.close()
    assert [len(t) for t in a.tokens] == [6, 6, 6] and len(a.stamps) == len(b.stamps) == 6
    assert a.tokens == b.tokens
