"""The typed contract between deciding and doing: what one tick will compute.

`TickPlan` is the only thing an executor receives from the scheduler. It names requests by id and says how
many prompt tokens to feed for each; executors never see scheduler objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PrefillChunk:
    """Feed prompt positions [start, end) of a request.

    When `completes` (end == prompt length), the last prompt token is fed as that row's input in this tick's
    batched decode forward, which samples the request's first token: prefill and first token share a tick.
    """

    request_id: str
    start: int
    end: int
    completes: bool

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class TickPlan:
    tick: int
    admitted: tuple[str, ...] = ()  # queued -> chunk_prefilling this tick
    prefill: tuple[PrefillChunk, ...] = ()
    decode: tuple[str, ...] = ()  # already decoding: one token each
    num_batched_tokens: int = 0
    num_seqs: int = 0  # requests holding a slot after this tick's admissions

    @property
    def is_empty(self) -> bool:
        return not (self.prefill or self.decode)

    def to_record(self) -> dict:
        """Decision fields for the event log (compact, JSON-ready)."""
        return {
            "admitted": list(self.admitted),
            "prefill": [[c.request_id, c.start, c.end, c.completes] for c in self.prefill],
            "decode": list(self.decode),
            "num_batched_tokens": self.num_batched_tokens,
            "num_seqs": self.num_seqs,
        }


@dataclass
class TickResult:
    """What an executor reports back: the only input `apply` takes besides the plan."""

    sampled: dict[str, int] = field(default_factory=dict)  # request id -> token sampled this tick
    logprobs: dict[str, float] = field(default_factory=dict)  # only for requests that asked
    errors: dict[str, str] = field(default_factory=dict)  # request id -> readable error; that request fails
    prefill_time: float = 0.0
    decode_time: float = 0.0
