"""Tokenizers, chat templates, the incremental tokenizer cache and the streaming detokenizer."""

from ftserve.tokenizer.base import Tokenizer
from ftserve.tokenizer.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    NoChatTemplateError,
    flatten_content,
)
from ftserve.tokenizer.detokenizer import DetokenizerDelta, StreamingDetokenizer
from ftserve.tokenizer.hf_backend import HFTokenizer
from ftserve.tokenizer.incremental import IncrementalStats, IncrementalTokenizer
from ftserve.tokenizer.loader import TokenizerLoadError, load_tokenizer
from ftserve.tokenizer.sentencepiece_backend import SentencePieceTokenizer


def chat_template_for(tokenizer: Tokenizer) -> ChatTemplate:
    """The model's chat template bound to its bos/eos texts; NoChatTemplateError if none."""
    return ChatTemplate(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token)


__all__ = [
    "ChatTemplate",
    "ChatTemplateError",
    "DetokenizerDelta",
    "HFTokenizer",
    "IncrementalStats",
    "IncrementalTokenizer",
    "NoChatTemplateError",
    "SentencePieceTokenizer",
    "StreamingDetokenizer",
    "Tokenizer",
    "TokenizerLoadError",
    "chat_template_for",
    "flatten_content",
    "load_tokenizer",
]
