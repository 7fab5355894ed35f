"""The tick loop, written once: plan -> execute -> apply -> release, over any `Executor`.

The engine (a real model), replay (recorded outcomes), simulation (a cost model), the tests' planning runs and
the scheduler benchmark all step through `TickLoop`; what differs between them is what they do around a tick
(where arrivals come from, what they compare or measure), never the order of its steps. Model-free: importing
it loads no MLX.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol

from .plan import TickPlan, TickResult
from .scheduler import AppliedTick, Scheduler


class Executor(Protocol):
    """What carries out a plan: `MLXExecutor` (a model), `ReplayExecutor` (a trace's outcomes), `SimExecutor`
    (a cost model), the fixtures' constant-token executor. The plan is all an executor gets: what it needs of
    a request it has not seen comes in `plan.new_requests`, never the scheduler's `Request` objects."""

    def execute(self, plan: TickPlan) -> TickResult: ...

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget requests that ended or were dropped: their caches are freed."""


@dataclass
class Tick:
    """One tick as it ran. `result` is None when the plan had no work (nothing was executed)."""

    plan: TickPlan
    result: TickResult | None
    applied: AppliedTick


class TickLoop:
    """Steps a scheduler and an executor tick by tick. `run_tick` is the whole tick; drivers that look at the
    plan before it runs (replay compares it with the recording) call `plan` and then `carry_out`."""

    def __init__(self, scheduler: Scheduler, executor: Executor):
        self.scheduler = scheduler
        self.executor = executor

    def plan(self, tick: int) -> TickPlan:
        return self.scheduler.plan(self.scheduler.view(tick))

    def carry_out(self, plan: TickPlan) -> Tick:
        """Execute the plan, apply its result, and release what ended (its caches are freed now)."""
        if plan.is_empty:
            return Tick(plan, None, AppliedTick([], []))
        result = self.executor.execute(plan)
        applied = self.scheduler.apply(plan, result)
        if applied.released:
            self.executor.release(applied.released)
        return Tick(plan, result, applied)

    def run_tick(self, tick: int) -> Tick:
        return self.carry_out(self.plan(tick))

    def release(self, request_ids: Iterable[str]) -> None:
        """Requests that ended outside a tick (caller aborts, arrivals failed at once)."""
        request_ids = list(request_ids)
        if request_ids:
            self.executor.release(request_ids)
