"""HF `tokenizer.json` backend, through the `tokenizers` library.

Continuation encoding needs a tokenizer that does not add a leading "▁" / space to the
first word: we build a second `tokenizers.Tokenizer` from the same JSON with the
Metaspace `prepend_scheme` set to "never", ByteLevel `add_prefix_space` off and any
`Prepend` normalizer removed. The incremental cache verifies every splice, so a
tokenizer shape this does not cover falls back to full encodes instead of wrong ids.

Token bytes: byte-level BPE tokens ("Ġworld") map back through the GPT-2 byte table;
Metaspace/ByteFallback tokens ("▁world", "<0x0A>") are read like sentencepiece pieces.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tokenizers import Tokenizer as HFTokenizerCore

from ftserve.tokenizer.base import Tokenizer


def _gpt2_byte_decoder() -> dict[str, int]:
    """Inverse of the GPT-2 byte->printable-character table used by ByteLevel."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _walk(node: Any, kind: str) -> list[dict[str, Any]]:
    """Every component dict of `type == kind` inside a normalizer/pre-tokenizer/decoder."""
    if not isinstance(node, dict):
        return []
    found = [node] if node.get("type") == kind else []
    for key in ("normalizers", "pretokenizers", "decoders"):
        for child in node.get(key) or []:
            found += _walk(child, kind)
    return found


def _continuation_json(spec: dict[str, Any]) -> dict[str, Any]:
    spec = json.loads(json.dumps(spec))  # deep copy
    norm = spec.get("normalizer")
    if isinstance(norm, dict):
        if norm.get("type") == "Prepend":
            spec["normalizer"] = None
        elif norm.get("type") == "Sequence":
            norm["normalizers"] = [n for n in norm["normalizers"] if n.get("type") != "Prepend"]
    for m in _walk(spec.get("pre_tokenizer"), "Metaspace"):
        m["prepend_scheme"] = "never"
        m["add_prefix_space"] = False
    for b in _walk(spec.get("pre_tokenizer"), "ByteLevel"):
        b["add_prefix_space"] = False
    return spec


class HFTokenizer(Tokenizer):
    def __init__(
        self,
        tokenizer_json: str | os.PathLike[str] | dict[str, Any],
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        extra_eos_ids: tuple[int, ...] = (),
        chat_template: str | list[dict[str, str]] | None = None,
    ) -> None:
        """``tokenizer_json``: the file, or its content already parsed (a GGUF's vocabulary)."""
        super().__init__()
        if isinstance(tokenizer_json, dict):
            spec = tokenizer_json
        else:
            with open(tokenizer_json, encoding="utf-8") as f:
                spec = json.load(f)
        self.tok = HFTokenizerCore.from_str(json.dumps(spec))
        self._cont = HFTokenizerCore.from_str(json.dumps(_continuation_json(spec)))
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.special_tokens = {
            a["content"]: a["id"] for a in spec.get("added_tokens", []) if a.get("special")
        }
        self.chat_template = chat_template
        dec = spec.get("decoder")
        self._byte_level = bool(_walk(dec, "ByteLevel"))
        self._byte_decoder = _gpt2_byte_decoder() if self._byte_level else {}
        # Fuse + Strip(" ", 1, 0) strips the first character of the whole text, whatever
        # token made it; a Metaspace decoder strips the "▁" of the first word piece only.
        self._strip_any = bool([s for s in _walk(dec, "Strip") if s.get("start", 0) > 0])
        self.strips_leading_space = self._strip_any or bool(
            [m for m in _walk(dec, "Metaspace") if m.get("prepend_scheme", "always") != "never"]
        )
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_id = self.tok.token_to_id(bos_token) if bos_token else None
        eos_id = self.tok.token_to_id(eos_token) if eos_token else None
        eos_list = [eos_id] if eos_id is not None else []
        self.eos_ids = tuple(eos_list + [e for e in extra_eos_ids if e not in eos_list])
        # What the post-processor adds around a body: find the body inside a probe.
        probe = self.tok.encode("a", add_special_tokens=False).ids
        full = self.tok.encode("a", add_special_tokens=True).ids
        start = next(i for i in range(len(full) - len(probe) + 1) if full[i : i + len(probe)] == probe)
        self.special_prefix = tuple(full[:start])
        self.special_suffix = tuple(full[start + len(probe) :])

    def _encode_body(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def _encode_continuation(self, text: str) -> list[int]:
        return self._cont.encode(text, add_special_tokens=False).ids

    def id_to_piece(self, token_id: int) -> str:
        piece = self.tok.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary")
        return piece

    def _raw_token_bytes(self, token_id: int) -> bytes:
        piece = self.id_to_piece(token_id)
        if token_id in self.special_ids:
            return piece.encode("utf-8")
        if self._byte_level:
            try:
                return bytes(self._byte_decoder[c] for c in piece)
            except KeyError:  # an added (non-special) token stored as plain text
                return piece.encode("utf-8")
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("▁", " ").encode("utf-8")

    def strip_first(self, token_id: int) -> bool:
        if self._strip_any:
            return token_id not in self.special_ids
        return super().strip_first(token_id)

    def _is_word_piece(self, token_id: int) -> bool:
        if token_id in self.special_ids:
            return False
        piece = self.id_to_piece(token_id)
        return not (len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"))
