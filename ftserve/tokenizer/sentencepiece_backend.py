"""SentencePiece backend (`tokenizer.model`).

Special tokens: sentencepiece itself never turns the text "[INST]" into the control id
[INST]; chat templates render them as text, so we split the text on every control piece
first (longest match wins) and encode the plain segments between them, as HF's
non-legacy Llama tokenizer does. Only a segment that starts the text gets the
dummy-prefix space; a segment after a special token is encoded as a continuation. For
that we load a second processor from the same model with `add_dummy_prefix` off,
patched directly in the serialized model proto (no protobuf dependency).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

import sentencepiece as spm

from ftserve.tokenizer.base import Tokenizer


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def _write_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _fields(buf: bytes) -> Iterator[tuple[int, int, int, int]]:
    """(field number, wire type, start of the field's key, end of the field)."""
    pos = 0
    while pos < len(buf):
        start = pos
        key, pos = _read_varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            _, pos = _read_varint(buf, pos)
        elif wire == 1:
            pos += 8
        elif wire == 2:
            n, pos = _read_varint(buf, pos)
            pos += n
        elif wire == 5:
            pos += 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield field, wire, start, pos


def _without_dummy_prefix(model_proto: bytes) -> bytes:
    """ModelProto with normalizer_spec (field 3).add_dummy_prefix (field 3) = false.
    Appending the field again works because protobuf keeps the last scalar value."""
    for field, wire, start, end in _fields(model_proto):
        if field == 3 and wire == 2:
            n, body_start = _read_varint(model_proto, start + 1)
            body = model_proto[body_start:end] + b"\x18\x00"
            patched = b"\x1a" + _write_varint(len(body)) + body
            return model_proto[:start] + patched + model_proto[end:]
    raise ValueError("sentencepiece model has no normalizer_spec")


def _trie_pattern(words: list[str]) -> str:
    """A regex matching any of `words`, longest first, as a prefix trie: with ~750
    control pieces a flat alternation tries every one at each "[" or "<" of a long
    prompt; the trie follows one branch per character."""
    trie: dict[str, dict] = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}  # end of a word

    def build(node: dict[str, dict]) -> str:
        branches = [re.escape(ch) + build(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return f"(?:{body})?" if "" in node else body  # greedy: the longer word wins

    return build(trie) if words else "(?!)"


class SentencePieceTokenizer(Tokenizer):
    def __init__(
        self,
        model_file: str | os.PathLike[str] | bytes,
        *,
        add_bos: bool = True,
        add_eos: bool = False,
        extra_eos_ids: tuple[int, ...] = (),
        chat_template: str | list[dict[str, str]] | None = None,
    ) -> None:
        """``model_file``: tokenizer.model, or a serialized model proto (a GGUF's vocabulary)."""
        super().__init__()
        if isinstance(model_file, bytes):
            self.sp = spm.SentencePieceProcessor(model_proto=model_file)
        else:
            self.sp = spm.SentencePieceProcessor(model_file=os.fspath(model_file))
        proto = self.sp.serialized_model_proto()
        self._sp_cont = spm.SentencePieceProcessor(model_proto=_without_dummy_prefix(proto))
        self.vocab_size = self.sp.get_piece_size()
        # Whether the model adds "▁" in front: encoding "a" yields "▁a" then.
        self._dummy_prefix = self.sp.encode("a", out_type=str)[0].startswith("▁")
        self.strips_leading_space = self._dummy_prefix
        bos, eos = self.sp.bos_id(), self.sp.eos_id()
        self.bos_id = bos if bos >= 0 else None
        self.bos_token = self.sp.id_to_piece(bos) if bos >= 0 else None
        self.eos_token = self.sp.id_to_piece(eos) if eos >= 0 else None
        eos_ids = ([eos] if eos >= 0 else []) + [e for e in extra_eos_ids if e != eos]
        self.eos_ids = tuple(eos_ids)
        self.special_prefix = (bos,) if add_bos and bos >= 0 else ()
        self.special_suffix = (eos,) if add_eos and eos >= 0 else ()
        self.special_tokens = {
            self.sp.id_to_piece(i): i
            for i in range(self.vocab_size)
            if self.sp.is_control(i) or self.sp.is_unknown(i)
        }
        self.chat_template = chat_template
        self._special_re = re.compile(_trie_pattern(list(self.special_tokens)))

    def _segments(self, text: str, at_start: bool) -> list[int]:
        ids: list[int] = []
        pos = 0
        for m in self._special_re.finditer(text):
            if m.start() > pos:
                ids += self._encode_plain(text[pos : m.start()], at_start and pos == 0)
            ids.append(self.special_tokens[m.group()])
            pos = m.end()
        if pos < len(text):
            ids += self._encode_plain(text[pos:], at_start and pos == 0)
        return ids

    def _encode_plain(self, text: str, first: bool) -> list[int]:
        return (self.sp if first else self._sp_cont).encode(text)

    def _encode_body(self, text: str) -> list[int]:
        return self._segments(text, at_start=True)

    def _encode_continuation(self, text: str) -> list[int]:
        return self._segments(text, at_start=False)

    def id_to_piece(self, token_id: int) -> str:
        return self.sp.id_to_piece(token_id)

    def _raw_token_bytes(self, token_id: int) -> bytes:
        piece = self.sp.id_to_piece(token_id)
        if self.sp.is_byte(token_id):  # "<0xE4>"
            return bytes([int(piece[3:5], 16)])
        return piece.replace("▁", " ").encode("utf-8")

    def _is_word_piece(self, token_id: int) -> bool:
        sp = self.sp
        return not (sp.is_byte(token_id) or sp.is_control(token_id) or sp.is_unknown(token_id))
