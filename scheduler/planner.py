"""The pure planner: (view of request states, budgets, policy) -> TickPlan.

Deterministic and model-free: it reads no clock, no device and no randomness, so a recorded run replays to
the same plans. Invariants it guarantees (tests assert them on every plan):
  * every decoding request decodes one token every tick (running streams never stall);
  * prefill tokens + decode tokens <= max_batched_tokens; admitted + running <= max_seqs;
  * no chunk is longer than prefill_chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .config import EngineConfig
from .plan import PrefillChunk, TickPlan
from .policy import CachedPrefix, Policy, _no_cache
from .request import Request


@dataclass(frozen=True)
class SchedulerView:
    """What the planner may look at. Request objects are read, never written."""

    tick: int
    waiting: Sequence[Request]
    prefilling: Sequence[Request]
    decoding: Sequence[Request]
    cached_prefix: CachedPrefix = _no_cache  # cache summary: prompt tokens already in the prefix cache


def _chunk(request: Request, budget: int, config: EngineConfig) -> PrefillChunk:
    start = request.num_computed_tokens
    end = start + min(request.num_prompt_remaining, config.prefill_chunk, budget)
    return PrefillChunk(request.request_id, start, end, end == request.prompt_len)


def plan_tick(view: SchedulerView, config: EngineConfig, policy: Policy) -> TickPlan:
    decode = tuple(r.request_id for r in view.decoding)
    budget = config.max_batched_tokens - len(decode)
    seqs = len(view.decoding) + len(view.prefilling)

    prefill: list[PrefillChunk] = []
    for request in policy.order_prefilling(view.prefilling, view.tick):
        if budget <= 0:
            break
        chunk = _chunk(request, budget, config)
        prefill.append(chunk)
        budget -= chunk.num_tokens

    admitted: list[str] = []
    for request in policy.order_waiting(view.waiting, view.tick, view.cached_prefix):
        if budget <= 0 or seqs >= config.max_seqs:
            break
        chunk = _chunk(request, budget, config)
        admitted.append(request.request_id)
        prefill.append(chunk)
        budget -= chunk.num_tokens
        seqs += 1

    return TickPlan(
        tick=view.tick,
        admitted=tuple(admitted),
        prefill=tuple(prefill),
        decode=decode,
        num_batched_tokens=config.max_batched_tokens - budget,
        num_seqs=seqs,
    )
