"""A thinking model's reasoning out of a chat choice's text, safe for streaming.

mlx-lm's tokenizer wrapper says whether a model thinks and how it marks it (`TokenizerWrapper.think_start` /
`think_end`, e.g. `<think>` ... `</think>`, inferred from the vocabulary). Text between the markers is the
message's `reasoning_content` (vLLM's and vllm-mlx's field), the rest its content. A chat template that opens the
reasoning in the prompt (Qwen3's generation prompt ends with `<think>`) makes the output start inside it
(`in_reasoning`). Whitespace right after the end marker is not content (templates put a blank line there, and a
chat sent back renders its content after it). Text that may be the start of a marker is held back until the next
piece shows which it is, so the split does not depend on how the text arrives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .markers import partial_suffix


@dataclass(frozen=True)
class ReasoningFormat:
    start: str
    end: str

    @classmethod
    def of(cls, tokenizer: Any) -> "ReasoningFormat | None":
        """The markers mlx-lm's tokenizer wrapper declares, or None (not a thinking model)."""
        if not getattr(tokenizer, "has_thinking", False):
            return None
        return cls(tokenizer.think_start, tokenizer.think_end)

    def opens_in(self, prompt: str) -> bool:
        """Whether a prompt (its text) leaves the reasoning open: the output starts inside it."""
        return prompt.rfind(self.start) > prompt.rfind(self.end)


@dataclass
class ReasoningPiece:
    reasoning: str = ""
    content: str = ""


class ReasoningSplitter:
    """One choice's text -> (reasoning, content), incrementally."""

    def __init__(self, fmt: ReasoningFormat, in_reasoning: bool):
        self.fmt = fmt
        self.in_reasoning = in_reasoning
        self._held = ""  # a possible marker start
        self._after_end = False  # whitespace right after the end marker is not content

    def feed(self, text: str) -> ReasoningPiece:
        piece = ReasoningPiece()
        pending, self._held = self._held + text, ""
        while pending:
            if self._after_end and not self.in_reasoning:
                pending = pending.lstrip()
                if not pending:
                    return piece
                self._after_end = False
            marker = self.fmt.end if self.in_reasoning else self.fmt.start
            at = pending.find(marker)
            if at >= 0:
                self._emit(piece, pending[:at])
                pending = pending[at + len(marker):]
                self._after_end = self.in_reasoning
                self.in_reasoning = not self.in_reasoning
                continue
            keep = partial_suffix(pending, (marker,))
            self._emit(piece, pending[: len(pending) - keep])
            self._held = pending[len(pending) - keep:]
            return piece
        return piece

    def finish(self) -> ReasoningPiece:
        """The end of the output: held text is final (a reasoning cut short stays reasoning)."""
        piece = ReasoningPiece()
        self._emit(piece, self._held)
        self._held = ""
        return piece

    def _emit(self, piece: ReasoningPiece, text: str) -> None:
        if self.in_reasoning:
            piece.reasoning += text
        else:
            piece.content += text
