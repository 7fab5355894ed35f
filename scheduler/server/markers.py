"""Text that may be the start of a marker (a stop string, a tool-call or reasoning tag), for streaming: what a
splitter must hold back until the next piece of text shows whether the marker follows."""

from __future__ import annotations

from typing import Iterable


def partial_suffix(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest
