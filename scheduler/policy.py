"""Scheduling policies: they order candidates, they never mutate anything.

A policy sees read-only request objects and the tick number and returns them in the order the planner should
consider them. The planner alone applies budgets. Policies are chosen by name from `POLICIES` or passed as
objects.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from .request import Request


class Policy(Protocol):
    name: str

    def order_waiting(self, waiting: Sequence[Request], tick: int) -> Sequence[Request]:
        """Queued requests in admission order."""

    def order_prefilling(self, prefilling: Sequence[Request], tick: int) -> Sequence[Request]:
        """Admitted, partly prefilled requests in the order they get prefill budget."""


class FCFS:
    """First come, first served: arrival order for admission, admission order for prefill budget.

    Trade-off: fair and predictable; a long prompt at the head delays the short ones behind it (they still
    get admitted as budget allows, but prefill budget goes to the oldest first).
    """

    name = "fcfs"

    def order_waiting(self, waiting: Sequence[Request], tick: int) -> Sequence[Request]:
        return waiting

    def order_prefilling(self, prefilling: Sequence[Request], tick: int) -> Sequence[Request]:
        return prefilling


POLICIES: dict[str, type] = {FCFS.name: FCFS}


def make_policy(policy: str | Policy) -> Policy:
    if not isinstance(policy, str):
        return policy
    try:
        return POLICIES[policy]()
    except KeyError:
        raise ValueError(f"unknown policy {policy!r}; known: {sorted(POLICIES)}") from None
