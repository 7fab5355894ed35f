"""Scheduling policies: they order candidates, they never mutate anything.

A policy sees read-only request objects, the tick number and cache summaries, and returns the candidates in
the order the planner should consider them; the planner alone applies budgets. Policies are chosen by name
from `POLICIES` (`make_policy("priority")`) or passed as objects: any class with `name`, `order_waiting` and
`order_prefilling` will do.

Orders must be deterministic functions of their inputs (ties broken by arrival order) so that replay
reproduces them. A registered policy records itself with its parameters (`to_record()`, read back by
`policy_from_record`), so a trace replays under the same policy it was recorded with; any other policy object
is recorded by name as custom, and replaying it needs the caller to pass that object.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, Sequence

from .request import Request

CachedPrefix = Callable[[Request], int]  # tokens of this request's prompt already in the prefix cache


def _no_cache(_request: Request) -> int:
    return 0


class Policy(Protocol):
    name: str

    def order_waiting(self, waiting: Sequence[Request], tick: int,
                      cached_prefix: CachedPrefix = _no_cache) -> Sequence[Request]:
        """Queued requests in admission order."""

    def order_prefilling(self, prefilling: Sequence[Request], tick: int) -> Sequence[Request]:
        """Admitted, partly prefilled requests in the order they get prefill budget."""


class FCFS:
    """First come, first served: arrival order for admission, admission order for prefill budget.

    Trade-off: fair and predictable, never starves anyone; a long prompt at the head of the queue takes the
    prefill budget before short prompts behind it (head-of-line blocking raises their time to first token).
    """

    name = "fcfs"

    def to_record(self) -> dict[str, Any]:
        return {"name": self.name}

    def order_waiting(self, waiting, tick, cached_prefix=_no_cache):
        return waiting

    def order_prefilling(self, prefilling, tick):
        return prefilling


class Priority:
    """Highest `priority` first, with aging: every `aging_ticks` ticks spent waiting add one priority level.

    Trade-off: urgent requests jump the queue; aging bounds how long a low-priority request can wait (a
    request `d` levels below a constant stream of urgent ones waits about `d * aging_ticks` ticks), at the
    cost of occasionally serving an old low-priority request before a fresh urgent one.
    """

    name = "priority"

    def __init__(self, aging_ticks: int = 32):
        if aging_ticks < 1:
            raise ValueError(f"aging_ticks must be >= 1, got {aging_ticks}")
        self.aging_ticks = aging_ticks

    def to_record(self) -> dict[str, Any]:
        return {"name": self.name, "aging_ticks": self.aging_ticks}

    def effective(self, request: Request, tick: int) -> float:
        return request.priority + (tick - request.arrival_tick) / self.aging_ticks

    def order_waiting(self, waiting, tick, cached_prefix=_no_cache):
        return sorted(waiting, key=lambda r: -self.effective(r, tick))  # stable: ties keep arrival order

    def order_prefilling(self, prefilling, tick):
        return sorted(prefilling, key=lambda r: -self.effective(r, tick))


class ShortestPromptFirst:
    """Fewest remaining prompt tokens first (admission and prefill budget).

    Trade-off: minimises mean time to first token when prompt lengths vary a lot; long prompts can wait
    indefinitely under a steady stream of short ones (no aging: use `priority` or `prefix-aware` if that
    matters).
    """

    name = "shortest-prompt-first"

    def to_record(self) -> dict[str, Any]:
        return {"name": self.name}

    def order_waiting(self, waiting, tick, cached_prefix=_no_cache):
        return sorted(waiting, key=lambda r: r.num_prompt_remaining)

    def order_prefilling(self, prefilling, tick):
        return sorted(prefilling, key=lambda r: r.num_prompt_remaining)


class PrefixAware:
    """Longest cached prefix first, with aging: admits requests whose prompt is mostly in the prefix cache
    before their shared prefix is evicted; every `aging_ticks` ticks of waiting count as `aging_tokens`
    cached tokens so cold requests are not starved.

    Trade-off: raises prefix-cache hit rate and throughput on workloads with shared system prompts; a cold
    request waits longer when many warm ones arrive (bounded by aging).
    """

    name = "prefix-aware"

    def __init__(self, aging_ticks: int = 32, aging_tokens: int = 64):
        if aging_ticks < 1:
            raise ValueError(f"aging_ticks must be >= 1, got {aging_ticks}")
        self.aging_ticks = aging_ticks
        self.aging_tokens = aging_tokens

    def to_record(self) -> dict[str, Any]:
        return {"name": self.name, "aging_ticks": self.aging_ticks, "aging_tokens": self.aging_tokens}

    def order_waiting(self, waiting, tick, cached_prefix=_no_cache):
        def score(r: Request) -> float:
            return cached_prefix(r) + (tick - r.arrival_tick) / self.aging_ticks * self.aging_tokens

        return sorted(waiting, key=lambda r: -score(r))

    def order_prefilling(self, prefilling, tick):
        return prefilling


POLICIES: dict[str, type] = {
    cls.name: cls for cls in (FCFS, Priority, ShortestPromptFirst, PrefixAware)
}


def make_policy(policy: "str | Mapping[str, Any] | Policy") -> Policy:
    """A policy from its registered name, its record (`to_record()`), or the object itself."""
    if isinstance(policy, str):
        return policy_from_record({"name": policy})
    if isinstance(policy, Mapping):
        return policy_from_record(policy)
    return policy


def policy_record(policy: Policy) -> dict[str, Any]:
    """What a trace records of a policy: a registered one by name and parameters; anything else (a custom
    class, or a subclass of a registered one) as `custom` with its class, since its code cannot be recorded."""
    name = getattr(policy, "name", type(policy).__name__)
    if type(policy) is POLICIES.get(name):
        return policy.to_record()
    return {"name": name, "custom": f"{type(policy).__module__}.{type(policy).__qualname__}"}


class PolicyUnavailable(ValueError):
    """A policy record this process cannot rebuild: an unknown name, or a custom policy (pass the object)."""


def policy_from_record(record: Mapping[str, Any]) -> Policy:
    name = record.get("name")
    if record.get("custom"):
        raise PolicyUnavailable(f"custom policy {name!r} ({record['custom']}) cannot be rebuilt from its record; "
                                "pass the policy object (replay(trace, policy=obj))")
    cls = POLICIES.get(name)
    if cls is None:
        raise PolicyUnavailable(f"unknown policy {name!r}; known: {sorted(POLICIES)}")
    return cls(**{k: v for k, v in record.items() if k != "name"})
