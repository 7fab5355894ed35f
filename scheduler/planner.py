"""The pure planner: (view of request states, budgets, policy) -> TickPlan.

Deterministic and model-free: it reads no clock, no device and no randomness, so a recorded run replays to
the same plans. Invariants it guarantees (tests assert them on every plan):
  * every decoding request decodes one token every tick (running streams never stall);
  * prefill tokens + decode tokens <= max_batched_tokens; admitted + running <= max_seqs;
  * no chunk is longer than prefill_chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .config import EngineConfig
from .plan import PrefillChunk, TickPlan
from .policy import Policy
from .request import Request


@dataclass(frozen=True)
class SchedulerView:
    """What the planner may look at. Request objects are read, never written."""

    tick: int
    waiting: Sequence[Request]
    prefilling: Sequence[Request]
    decoding: Sequence[Request]
    # cache summary: the prefix-cache entry (id, tokens) a waiting request would start from, or None
    prefix_match: Callable[[Request], tuple[int, int] | None] = lambda _request: None

    def cached_prefix(self, request: Request) -> int:
        match = self.prefix_match(request)
        return match[1] if match else 0


def _chunk(request: Request, start: int, budget: int, config: EngineConfig) -> PrefillChunk:
    end = start + min(request.prompt_len - start, config.prefill_chunk, budget)
    return PrefillChunk(request.request_id, start, end, end == request.prompt_len)


def plan_tick(view: SchedulerView, config: EngineConfig, policy: Policy) -> TickPlan:
    decode = tuple(r.request_id for r in view.decoding)
    budget = config.max_batched_tokens - len(decode)
    seqs = len(view.decoding) + len(view.prefilling)

    prefill: list[PrefillChunk] = []
    for request in policy.order_prefilling(view.prefilling, view.tick):
        if budget <= 0:
            break
        chunk = _chunk(request, request.num_computed_tokens, budget, config)
        prefill.append(chunk)
        budget -= chunk.num_tokens

    admitted: list[str] = []
    prefix_hits: list[tuple[str, int, int]] = []
    for request in policy.order_waiting(view.waiting, view.tick, view.cached_prefix):
        if budget <= 0 or seqs >= config.max_seqs:
            break
        match = view.prefix_match(request)
        if match is not None:
            prefix_hits.append((request.request_id, *match))
        chunk = _chunk(request, match[1] if match else request.num_computed_tokens, budget, config)
        admitted.append(request.request_id)
        prefill.append(chunk)
        budget -= chunk.num_tokens
        seqs += 1

    return TickPlan(
        tick=view.tick,
        admitted=tuple(admitted),
        prefill=tuple(prefill),
        decode=decode,
        prefix_hits=tuple(prefix_hits),
        num_batched_tokens=config.max_batched_tokens - budget,
        num_seqs=seqs,
    )
