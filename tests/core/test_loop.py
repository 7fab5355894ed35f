"""The one tick loop: plan -> execute -> apply -> release in that order, an empty plan executes nothing, what
ended is released after its tick is applied (and aborts outside a tick are released too); every executor the
project ships has the protocol's shape, `execute(plan)` and `release(ids)`."""

import inspect

import pytest

from scheduler.config import EngineConfig
from scheduler.events import EventLog
from scheduler.fixtures.executors import FixedTokenExecutor
from scheduler.loop import TickLoop
from scheduler.request import Request, SamplingParams
from scheduler.scheduler import Scheduler


class _Journal(FixedTokenExecutor):
    def __init__(self, scheduler):
        super().__init__(100)
        self.scheduler, self.calls = scheduler, []

    def execute(self, plan):
        # the plan is not applied yet: no request of this tick has its token
        self.calls.append(("execute", plan.tick, {rid: len(self.scheduler.requests[rid].output_tokens)
                                                  for rid in plan.decode}))
        return super().execute(plan)

    def release(self, request_ids):
        self.calls.append(("release", list(request_ids)))


def test_a_tick_executes_then_applies_then_releases_what_ended():
    sched = Scheduler(EngineConfig(max_seqs=4, max_batched_tokens=16, prefill_chunk=8), EventLog())
    journal = _Journal(sched)
    loop = TickLoop(sched, journal)
    sched.add(Request("a", [9] * 4, SamplingParams(max_tokens=2)), 0)
    sched.add(Request("b", [9] * 4, SamplingParams(max_tokens=3)), 0)
    ticks = [loop.run_tick(t) for t in range(3)]
    assert [t.plan.tick for t in ticks] == [0, 1, 2]
    assert journal.calls[0] == ("execute", 0, {})
    assert journal.calls[1] == ("execute", 1, {"a": 1, "b": 1})  # tick 0's first tokens were applied
    assert journal.calls[2] == ("release", ["a"])  # a ended at tick 1 (max_tokens=2), released right after
    assert ticks[1].applied.released == ["a"]
    assert journal.calls[3:] == [("execute", 2, {"b": 2}), ("release", ["b"])]
    assert not sched.has_live()


def test_an_empty_plan_executes_nothing_and_aborts_are_released():
    sched = Scheduler(EngineConfig(), EventLog())
    journal = _Journal(sched)
    loop = TickLoop(sched, journal)
    empty = loop.run_tick(0)
    assert empty.plan.is_empty and empty.result is None and empty.applied.outputs == []
    assert journal.calls == []
    sched.add(Request("x", [9] * 4, SamplingParams(max_tokens=5)), 1)
    loop.run_tick(1)
    loop.release([sched.abort("x", 2).request_id])
    assert journal.calls[-1] == ("release", ["x"])
    loop.release([])
    assert journal.calls[-1] == ("release", ["x"])  # nothing to release: the executor is not called


def _executors():
    """The executors that need no MLX (the MLX ones: tests/execution/test_executor_protocol.py)."""
    from scheduler.tools.replay import ReplayExecutor
    from scheduler.tools.simulate import SimExecutor

    return [ReplayExecutor, SimExecutor, FixedTokenExecutor]


@pytest.mark.parametrize("executor", _executors(), ids=lambda c: c.__name__)
def test_every_executor_has_the_protocols_shape(executor):
    assert list(inspect.signature(executor.execute).parameters) == ["self", "plan"]
    assert list(inspect.signature(executor.release).parameters) == ["self", "request_ids"]
