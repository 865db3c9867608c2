"""`load_tokenizer(model_dir)`: pick a backend and read the HF side files.

A GGUF file carries its tokenizer in its metadata (ftserve/tokenizer/gguf.py).
In a checkpoint directory, the files read (all optional except one tokenizer file):
  tokenizer.json          -> HFTokenizer (preferred: it is what HF itself runs)
  tokenizer.model         -> SentencePieceTokenizer
  tokenizer_config.json   -> bos_token / eos_token, add_bos_token / add_eos_token,
                             chat_template (string or list of named templates)
  chat_template.jinja     -> chat template (newer HF layout; wins over the config's)
  generation_config.json  -> eos_token_id (int or list): extra ids that end generation
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ftserve.tokenizer.base import Tokenizer
from ftserve.tokenizer.hf_backend import HFTokenizer
from ftserve.tokenizer.sentencepiece_backend import SentencePieceTokenizer


class TokenizerLoadError(RuntimeError):
    """The model directory has no usable tokenizer."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores tokens as "<s>" or as {"content": "<s>", ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _eos_ids(gen_cfg: dict[str, Any]) -> tuple[int, ...]:
    eos = gen_cfg.get("eos_token_id")
    if isinstance(eos, int):
        return (eos,)
    if isinstance(eos, list):
        return tuple(e for e in eos if isinstance(e, int))
    return ()


def load_tokenizer(model_dir: str | os.PathLike[str], backend: str = "auto") -> Tokenizer:
    """backend: "auto" (tokenizer.json if present), "hf" or "sentencepiece". A GGUF
    checkpoint (a .gguf file or a folder of one) brings its tokenizer in its metadata."""
    from ftserve.models import gguf

    if gguf.is_gguf(model_dir):
        from ftserve.tokenizer.gguf import GGUFTokenizerError, load_gguf_tokenizer

        ckpt = gguf.read_checkpoint(model_dir)
        try:
            return load_gguf_tokenizer(ckpt.metadata, ckpt.name)
        except GGUFTokenizerError as err:
            raise TokenizerLoadError(str(err)) from None
    d = Path(model_dir)
    cfg = _read_json(d / "tokenizer_config.json")
    extra_eos = _eos_ids(_read_json(d / "generation_config.json"))
    template: str | list[dict[str, str]] | None = cfg.get("chat_template")
    jinja_file = d / "chat_template.jinja"
    if jinja_file.is_file():
        template = jinja_file.read_text(encoding="utf-8")
    has_json = (d / "tokenizer.json").is_file()
    has_sp = (d / "tokenizer.model").is_file()
    if backend == "hf" or (backend == "auto" and has_json):
        if not has_json:
            raise TokenizerLoadError(f"{d} has no tokenizer.json")
        return HFTokenizer(
            d / "tokenizer.json",
            bos_token=_token_text(cfg.get("bos_token")),
            eos_token=_token_text(cfg.get("eos_token")),
            extra_eos_ids=extra_eos,
            chat_template=template,
        )
    if backend in ("sentencepiece", "auto") and has_sp:
        return SentencePieceTokenizer(
            d / "tokenizer.model",
            add_bos=bool(cfg.get("add_bos_token", True)),
            add_eos=bool(cfg.get("add_eos_token", False)),
            extra_eos_ids=extra_eos,
            chat_template=template,
        )
    raise TokenizerLoadError(
        f"{d} has no tokenizer.json or tokenizer.model (backend={backend!r}); "
        "point --model at a Hugging Face model directory"
    )
