"""The raw bytes of a token: the `bytes` of an OpenAI logprobs entry, what the token adds to the output's UTF-8.

A token's decoded text is not enough: byte-level BPE and SentencePiece's byte fallback split one character
across tokens, and such a token decodes alone to U+FFFD, whose bytes (EF BF BD) are not the token's; the
`bytes` field exists so that a client can join a character's tokens back together. So the bytes are read from
the token's vocabulary entry, the way the tokenizer's own decoder (tokenizer.json `decoder`) reads it:

* `ByteLevel` (GPT-2 style BPE: Qwen, Llama 3, ...): each character of the entry stands for one byte;
* `ByteFallback` (SentencePiece style: Llama 2, Mistral, Gemma, ...): an entry `<0xNN>` is that byte, any other
  is its text with `Replace` / `Metaspace`'s word marker as a space. The first token's space is kept, though
  decoded text drops it: the bytes are the token's, not the text's;
* anything else (a tokenizer without a fast backend, a word-level vocabulary): the token's decoded text.

Added tokens (specials, chat markers) are stored as their text under every scheme.
"""

from __future__ import annotations

import enum
import json
import re
from functools import lru_cache
from typing import Any

_BYTE_ENTRY = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class DecoderScheme(str, enum.Enum):
    BYTE_LEVEL = "byte_level"
    BYTE_FALLBACK = "byte_fallback"
    TEXT = "text"


class TokenBytes:
    """`token_bytes(token_id) -> bytes` for one tokenizer (an mlx-lm TokenizerWrapper or a Hugging Face one)."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        decoder = _decoder_record(tokenizer)
        self.scheme = _scheme(decoder)
        self._replacements = _replacements(decoder) if self.scheme is DecoderScheme.BYTE_FALLBACK else ()
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._added = {int(token_id): str(getattr(entry, "content", entry)) for token_id, entry in added.items()}
        self._known: dict[int, bytes] = {}

    def __call__(self, token: int) -> bytes:
        known = self._known.get(token)
        if known is None:
            known = self._known[token] = self._bytes(token)
        return known

    def _bytes(self, token: int) -> bytes:
        if token in self._added:
            return self._added[token].encode("utf-8")
        if self.scheme is DecoderScheme.TEXT:
            return self._tokenizer.decode([token]).encode("utf-8")
        entry = self._tokenizer.convert_ids_to_tokens(token)
        if entry is None:  # an id past the vocabulary (a padded embedding): it has no text of its own
            return self._tokenizer.decode([token]).encode("utf-8")
        if self.scheme is DecoderScheme.BYTE_LEVEL:
            byte_of = _byte_level_decoder()
            return bytes(byte_of[c] for c in entry) if all(c in byte_of for c in entry) else entry.encode("utf-8")
        match = _BYTE_ENTRY.fullmatch(entry)
        if match:
            return bytes([int(match.group(1), 16)])
        for pattern, content in self._replacements:
            entry = entry.replace(pattern, content)
        return entry.encode("utf-8")


def _decoder_record(tokenizer: Any) -> dict[str, Any] | None:
    """The `decoder` of the fast tokenizer's tokenizer.json (public: `backend_tokenizer.to_str()`), or None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    decoder = json.loads(backend.to_str()).get("decoder")
    return decoder if isinstance(decoder, dict) else None


def _parts(decoder: dict[str, Any] | None) -> list[dict[str, Any]]:
    if decoder is None:
        return []
    if decoder.get("type") == "Sequence":
        return [p for d in decoder.get("decoders", []) for p in _parts(d)]
    return [decoder]


def _scheme(decoder: dict[str, Any] | None) -> DecoderScheme:
    types = {part.get("type") for part in _parts(decoder)}
    if "ByteLevel" in types:
        return DecoderScheme.BYTE_LEVEL
    if "ByteFallback" in types:
        return DecoderScheme.BYTE_FALLBACK
    return DecoderScheme.TEXT


def _replacements(decoder: dict[str, Any] | None) -> tuple[tuple[str, str], ...]:
    """The (pattern, text) pairs a SentencePiece-style decoder substitutes: `Replace` rules with a plain string
    pattern, and `Metaspace`'s word marker (a space)."""
    pairs = []
    for part in _parts(decoder):
        if part.get("type") == "Replace" and isinstance(part.get("pattern"), dict) and "String" in part["pattern"]:
            pairs.append((part["pattern"]["String"], part.get("content", "")))
        elif part.get("type") == "Metaspace":
            pairs.append((part.get("replacement", "\u2581"), " "))
    return tuple(pairs)


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the printable character that stands for each byte in a ByteLevel
    vocabulary -> the byte (printable ASCII and Latin-1 stand for themselves, the rest map from U+0100 on)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars
