"""Incremental detokenization for streaming: text of new tokens as they arrive, never a partial character.

Byte-level BPE tokens can split one UTF-8 character; decoding them alone gives U+FFFD. Each step decodes a short
window (from the last fully emitted token) and emits only what grew past the already-emitted part of that window,
waiting while the tail is an incomplete character (the vLLM / TGI offsets method, O(window) per token).
"""

from __future__ import annotations

from typing import Any, Sequence

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens  # the tokenizer's special tokens decode to nothing
        self.tokens: list[int] = []
        self._prefix = 0  # window start: tokens before it are emitted and never re-decoded
        self._read = 0  # tokens[_prefix:_read] are emitted

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        if self._skip_special:
            return self._tokenizer.decode(list(ids), skip_special_tokens=True)
        return self._tokenizer.decode(list(ids))

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; returns the newly completed text (maybe empty)."""
        self.tokens.extend(token_ids)
        emitted = self._decode(self.tokens[self._prefix:self._read])
        text = self._decode(self.tokens[self._prefix:])
        if len(text) > len(emitted) and not text.endswith(_REPLACEMENT) and text.startswith(emitted):
            self._prefix, self._read = self._read, len(self.tokens)
            return text[len(emitted):]
        return ""

    def flush(self) -> str:
        """What is still held at the end of generation (an incomplete character decodes as U+FFFD then)."""
        emitted = self._decode(self.tokens[self._prefix:self._read])
        text = self._decode(self.tokens[self._prefix:])
        self._prefix = self._read = len(self.tokens)
        return text[len(emitted):] if text.startswith(emitted) else text
