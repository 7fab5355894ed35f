"""Stop strings matched on detokenized text, safe for streaming.

Text that could be the start of a stop string is held back until the next piece shows whether it is one, so a
client never receives text that a later match would have to retract. The held text is at most the longest stop
string minus one character.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass
class StopResult:
    text: str  # safe to emit now
    stopped: bool  # a stop string matched: `text` ends right before it, nothing more is emitted


class StopMatcher:
    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> StopResult:
        if self.stopped:
            return StopResult("", True)
        if not self.stops:
            return StopResult(text, False)
        pending = self._held + text
        # the held text cannot contain a whole stop string (it would have matched), so any match starts in it
        # or in the new text; the earliest one wins
        hits = [i for i in (pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return StopResult(pending[: min(hits)], True)
        keep = self._partial_suffix(pending)
        self._held = pending[len(pending) - keep:] if keep else ""
        return StopResult(pending[: len(pending) - keep], False)

    def flush(self) -> str:
        """The held text, once generation ended without a match (it is final output then)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
