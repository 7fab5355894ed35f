"""Stop strings matched on detokenized text, safe for streaming.

Text that could be the start of a stop string is held back until the next piece shows whether it is one, so a
client never receives text that a later match would have to retract, and the result does not depend on how the
text was split into pieces (tokens). The held text is shorter than the longest stop string.

Text can come unchecked (`feed(text, checked=False)`, the text of a request's first `min_tokens` tokens, as vLLM
does): a stop string counts only where it ends in checked text. One that begins in unchecked text and ends in
checked text counts, and cuts the output where it begins: the unchecked text that may begin a stop string is
held back like any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .markers import partial_suffix


@dataclass(frozen=True)
class StopRule:
    """How a choice's text ends on stop strings: the strings, whether the matched one stays in the output (vLLM's
    include_stop_str_in_output), and how many of the first tokens' text is not matched (vLLM's min_tokens)."""

    strings: tuple[str, ...] = ()
    include: bool = False
    unchecked_tokens: int = 0

    def matcher(self) -> "StopMatcher":
        return StopMatcher(self.strings, self.include)


@dataclass
class StopResult:
    text: str  # safe to emit now
    stopped: bool  # a stop string matched: `text` ends right before it, nothing more is emitted


class StopMatcher:
    """The output ends right before the earliest stop string of the whole text (with `include`, right after it),
    however the text is split into pieces: a match is taken only once no stop string can still begin earlier
    (with "a" and "baa" as stops, "ba" waits: "baa" may follow, and it starts first)."""

    def __init__(self, stops: Sequence[str], include: bool = False):
        self.stops = tuple(s for s in stops if s)
        self.include = include  # vLLM's include_stop_str_in_output: the output ends after the stop string
        self._held = ""
        self._held_unchecked = 0  # how much of the held text, from its start, came unchecked
        self._checking = False  # checked text came: unchecked text may not follow
        self.stopped = False

    def feed(self, text: str, checked: bool = True) -> StopResult:
        if not checked and self._checking:
            raise ValueError("unchecked text after checked text: min_tokens' text comes first")
        self._checking = self._checking or (checked and bool(text))
        if self.stopped:
            return StopResult("", True)
        if not self.stops:
            return StopResult(text, False)
        pending = self._held + text
        unchecked = self._held_unchecked if checked else len(pending)
        match = self._earliest_match(pending, unchecked)
        maybe = len(pending) - partial_suffix(pending, self.stops)  # where a stop string may still be beginning
        # (kept in the output, a longer stop string beginning at the same place may still be completing)
        if match is not None and (match[0] < maybe or match[0] == maybe and not self.include):
            return self._stop(pending[:match[self.include]])
        self._held, self._held_unchecked = pending[maybe:], max(0, unchecked - maybe)
        return StopResult(pending[:maybe], False)

    def flush(self) -> StopResult:
        """The end of generation: the held text is final output, up to a stop string it holds."""
        held, self._held = self._held, ""
        if self.stopped:
            return StopResult("", True)
        match = self._earliest_match(held, self._held_unchecked)
        return self._stop(held[:match[self.include]]) if match is not None else StopResult(held, False)

    def _stop(self, text: str) -> StopResult:
        self.stopped = True
        self._held = ""
        return StopResult(text, True)

    def _earliest_match(self, text: str, unchecked: int) -> tuple[int, int] | None:
        """(start, end) of the earliest stop string that ends past `text[:unchecked]` (of those starting there,
        the longest); None if there is none."""
        hits = [(i, i + len(s)) for s in self.stops
                for i in (text.find(s, max(0, unchecked - len(s) + 1)),) if i >= 0]
        return min(hits, key=lambda hit: (hit[0], -hit[1])) if hits else None
