"""The tokenizer a GGUF file carries in its metadata (``tokenizer.ggml.*``), as one of
the two existing backends:

  tokenizer.ggml.model = "gpt2"   byte-level BPE: tokens + merges become a
                                  tokenizer.json spec for HFTokenizer; the
                                  pre-tokenizer is the original model's, chosen by
                                  tokenizer.ggml.pre (the name llama.cpp's converter
                                  gave the model's split regex)
  tokenizer.ggml.model = "llama"  SentencePiece BPE: tokens + scores + types become
                                  a sentencepiece model proto (written here, field by
                                  field) for SentencePieceTokenizer

Token types are llama.cpp's, which are sentencepiece's piece types: 1 normal,
2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte. Control tokens are the
special tokens; bos / eos / the chat template come from their own keys, and
ftserve.models.gguf.eos_token_ids adds the end-of-turn ids generation stops at.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from ftserve.tokenizer.base import Tokenizer
from ftserve.tokenizer.hf_backend import HFTokenizer
from ftserve.tokenizer.sentencepiece_backend import SentencePieceTokenizer, _write_varint

log = logging.getLogger(__name__)

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# The split regexes of the original tokenizer.json files (as llama.cpp quotes them).
_GPT2 = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
_LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split_then_bytes(regex: str) -> dict[str, Any]:
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
        {**_GPT2, "use_regex": False},
    ]}


_DIGITS_THEN_GPT2 = {"type": "Sequence", "pretokenizers": [
    {"type": "Digits", "individual_digits": True}, _GPT2]}

# tokenizer.ggml.pre -> (pre-tokenizer, normalizer, ignore_merges)
_PRE: dict[str, tuple[dict[str, Any], dict[str, Any] | None, bool]] = {}
for _name in ("gpt2", "mpt", "olmo", "jais", "default"):
    _PRE[_name] = (_GPT2, None, False)
for _name in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"):
    _PRE[_name] = (_DIGITS_THEN_GPT2, None, False)
for _name in ("llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral"):
    _PRE[_name] = (_split_then_bytes(_LLAMA3_RE), None, True)
for _name in ("dbrx", "smaug-bpe"):
    _PRE[_name] = (_split_then_bytes(_LLAMA3_RE), None, False)
for _name in ("qwen2", "stablelm2", "deepseek-r1-qwen", "megrez"):
    _PRE[_name] = (_split_then_bytes(_QWEN2_RE), {"type": "NFC"}, False)
SUPPORTED_PRE = tuple(sorted(_PRE))


class GGUFTokenizerError(ValueError):
    """The GGUF's tokenizer metadata is missing or of a kind ftserve cannot build."""


def load_gguf_tokenizer(meta: Mapping[str, Any], name: str = "GGUF") -> Tokenizer:
    """The tokenizer of a GGUF's metadata (``name``: the file, for messages)."""
    from ftserve.models.gguf import eos_token_ids

    kind = meta.get("tokenizer.ggml.model")
    tokens: Sequence[str] = meta.get("tokenizer.ggml.tokens") or []
    if kind is None or not tokens:
        raise GGUFTokenizerError(f"{name} has no tokenizer in its metadata (tokenizer.ggml.model / "
                                 "tokenizer.ggml.tokens); ftserve needs one to serve text")
    types: Sequence[int] = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise GGUFTokenizerError(f"{name}: {len(tokens)} tokens but {len(types)} token types")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    for key, tid in (("bos", bos), ("eos", eos)):
        if tid is not None and not 0 <= int(tid) < len(tokens):
            raise GGUFTokenizerError(f"{name}: tokenizer.ggml.{key}_token_id {tid} is outside the "
                                     f"vocabulary of {len(tokens)}")
    template = chat_template(meta)
    eos_ids = eos_token_ids(meta)
    if kind == "gpt2":
        merges = meta.get("tokenizer.ggml.merges")
        if not merges:
            raise GGUFTokenizerError(f"{name}: a gpt2 (BPE) tokenizer without tokenizer.ggml.merges")
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        spec = bpe_spec(tokens, types, merges, meta.get("tokenizer.ggml.pre"),
                        bos if add_bos else None, eos if add_eos else None, name)
        return HFTokenizer(spec, bos_token=None if bos is None else tokens[int(bos)],
                           eos_token=None if eos is None else tokens[int(eos)],
                           extra_eos_ids=eos_ids, chat_template=template)
    if kind == "llama":
        scores: Sequence[float] = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        proto = sentencepiece_proto(
            tokens, scores, types,
            unk=meta.get("tokenizer.ggml.unknown_token_id"), bos=bos, eos=eos,
            pad=meta.get("tokenizer.ggml.padding_token_id"),
            add_dummy_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
            remove_extra_whitespaces=bool(meta.get("tokenizer.ggml.remove_extra_whitespaces", False)),
        )
        return SentencePieceTokenizer(
            proto, add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", True)),
            add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            extra_eos_ids=eos_ids, chat_template=template)
    raise GGUFTokenizerError(f"{name}: tokenizer model {kind!r} is not supported (gpt2 byte-level "
                             "BPE and llama sentencepiece are)")


def chat_template(meta: Mapping[str, Any]) -> str | list[dict[str, str]] | None:
    """tokenizer.chat_template, with the named ones (tokenizer.chat_template.<name>,
    e.g. tool_use) as tokenizer_config.json's list of named templates."""
    default = meta.get("tokenizer.chat_template")
    prefix = "tokenizer.chat_template."
    named = [{"name": k[len(prefix):], "template": v} for k, v in meta.items()
             if k.startswith(prefix) and isinstance(v, str)]
    if not named:
        return default
    return ([{"name": "default", "template": default}] if default else []) + named


def bpe_spec(tokens: Sequence[str], types: Sequence[int], merges: Sequence[str], pre: str | None,
             bos: int | None, eos: int | None, name: str = "GGUF") -> dict[str, Any]:
    """A tokenizer.json spec (``tokenizers`` format) for a byte-level BPE vocabulary.
    ``bos`` / ``eos``: ids the post-processor adds around a text (None: none)."""
    if pre is None:
        log.warning("%s names no pre-tokenizer (tokenizer.ggml.pre): using GPT-2's split, which "
                    "may not be the model's own", name)
        pre = "gpt2"
    if pre not in _PRE:
        raise GGUFTokenizerError(f"{name}: pre-tokenizer {pre!r} is not supported; supported: "
                                 f"{', '.join(SUPPORTED_PRE)}")
    pre_tokenizer, normalizer, ignore_merges = _PRE[pre]
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a duplicated text keeps its first id
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": kind == CONTROL}
             for i, (t, kind) in enumerate(zip(tokens, types)) if kind in (CONTROL, USER_DEFINED)]
    single: list[dict[str, Any]] = []
    special: dict[str, Any] = {}
    for tid in (bos,):
        if tid is not None:
            single.append({"SpecialToken": {"id": tokens[tid], "type_id": 0}})
            special[tokens[tid]] = {"id": tokens[tid], "ids": [tid], "tokens": [tokens[tid]]}
    single.append({"Sequence": {"id": "A", "type_id": 0}})
    if eos is not None:
        single.append({"SpecialToken": {"id": tokens[eos], "type_id": 0}})
        special[tokens[eos]] = {"id": tokens[eos], "ids": [eos], "tokens": [tokens[eos]]}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": {"type": "TemplateProcessing", "single": single,
                           "pair": single + [{"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": special},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": ignore_merges,
                  "vocab": vocab, "merges": [m.split(" ", 1) for m in merges]},
    }


# --- a sentencepiece ModelProto, written field by field --------------------------------
# sentencepiece_model.proto: ModelProto { repeated SentencePiece pieces = 1;
# TrainerSpec trainer_spec = 2; NormalizerSpec normalizer_spec = 3; }
# SentencePiece { string piece = 1; float score = 2; Type type = 3; }
# TrainerSpec { ModelType model_type = 3 (BPE = 2); int32 vocab_size = 4;
#   bool byte_fallback = 35; int32 unk_id = 40, bos_id = 41, eos_id = 42, pad_id = 43; }
# NormalizerSpec { string name = 1; bool add_dummy_prefix = 3;
#   bool remove_extra_whitespaces = 4; bool escape_whitespaces = 5; }

def _key(field: int, wire: int) -> bytes:
    return _write_varint(field << 3 | wire)


def _int(field: int, value: int) -> bytes:
    return _key(field, 0) + _write_varint(value & 0xFFFFFFFFFFFFFFFF)  # negatives: 10 bytes


def _bytes(field: int, value: bytes) -> bytes:
    return _key(field, 2) + _write_varint(len(value)) + value


def sentencepiece_proto(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int], *,
                        unk: int | None, bos: int | None, eos: int | None, pad: int | None,
                        add_dummy_prefix: bool, remove_extra_whitespaces: bool) -> bytes:
    out = bytearray()
    for text, score, kind in zip(tokens, scores, types):
        piece = (_bytes(1, text.encode("utf-8")) + _key(2, 5) + struct.pack("<f", float(score))
                 + _int(3, int(kind) if 1 <= int(kind) <= 6 else NORMAL))
        out += _bytes(1, piece)
    if unk is None:
        unk = next((i for i, k in enumerate(types) if k == UNKNOWN), 0)
    trainer = (_int(3, 2) + _int(4, len(tokens)) + _int(35, int(BYTE in types)) + _int(40, int(unk))
               + _int(41, -1 if bos is None else int(bos)) + _int(42, -1 if eos is None else int(eos))
               + _int(43, -1 if pad is None or pad in (bos, eos, unk) else int(pad)))
    out += _bytes(2, trainer)
    normalizer = (_bytes(1, b"identity") + _int(3, int(add_dummy_prefix))
                  + _int(4, int(remove_extra_whitespaces)) + _int(5, 1))
    out += _bytes(3, normalizer)
    return bytes(out)
