"""The stall watchdog of a sharded rank (scheduler/execution/stall_watchdog.py): a forward that outlives its bound
is reported as a lost peer and ends the process; forwards that finish in time never trigger it.

The killed-rank tests in test_tensor_parallel.py run it against MLX's ring backend; these pin its contract
without a second process, with the exit injected, and once with the real `os._exit`.
"""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from scheduler import EngineConfig
from scheduler.execution.distributed import ShardLost, guarded_execute
from scheduler.execution.stall_watchdog import SHARD_LOST_EXIT_CODE, StallWatchdog
from scheduler.plan import TickPlan, TickResult

ROOT = Path(__file__).resolve().parents[2]


class _Exit:
    """Stands in for os._exit: records the code and releases the 'blocked' forward."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.called = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.called.set()


class _BlockedExecutor:
    """An executor whose forward blocks until the process would have exited (as MLX's does after a lost peer)."""

    def __init__(self, released: threading.Event):
        self.released = released

    def execute(self, plan: TickPlan) -> TickResult:
        assert self.released.wait(10), "the watchdog never fired"
        return TickResult()


class _QuickExecutor:
    def execute(self, plan: TickPlan) -> TickResult:
        time.sleep(0.01)
        return TickResult()


def test_a_forward_blocked_past_the_bound_is_reported_as_a_lost_peer_and_exits():
    exit_, seen = _Exit(), []
    watchdog = StallWatchdog(rank=1, timeout_s=0.2, on_stall=(seen.append,), exit=exit_)
    t0 = time.monotonic()
    guarded_execute(_BlockedExecutor(exit_.called), TickPlan(tick=7), watchdog, rank=1)
    assert 0.2 <= time.monotonic() - t0 < 5
    assert exit_.codes == [SHARD_LOST_EXIT_CODE]
    assert len(seen) == 1 and isinstance(seen[0], ShardLost) and seen[0] is watchdog.fired
    assert str(seen[0]).startswith("rank 1: a peer rank is gone (tick 7's forward has been blocked for 0.2 s")
    watchdog.close()


@pytest.mark.exclusive  # 10 ms forwards against a 0.1 s bound: a loaded machine could stretch one past it
def test_forwards_that_finish_in_time_never_trigger_it():
    exit_, seen = _Exit(), []
    watchdog = StallWatchdog(rank=0, timeout_s=0.1, on_stall=(seen.append,), exit=exit_)
    t0 = time.monotonic()
    tick = 0
    while time.monotonic() - t0 < 0.6:  # many forwards, together several times the bound, each well inside it
        guarded_execute(_QuickExecutor(), TickPlan(tick=tick), watchdog, rank=0)
        tick += 1
    time.sleep(0.3)  # disarmed between ticks: waiting for the next plan is not a stall
    watchdog.close()
    assert exit_.codes == [] and seen == [] and watchdog.fired is None
    assert not watchdog._thread.is_alive()  # close() leaves no thread behind


def test_a_failing_hook_does_not_keep_the_process_alive():
    exit_, seen = _Exit(), []

    def broken(error: ShardLost) -> None:
        raise OSError("disk full")

    watchdog = StallWatchdog(rank=0, timeout_s=0.1, on_stall=(broken, seen.append), exit=exit_)
    guarded_execute(_BlockedExecutor(exit_.called), TickPlan(tick=0), watchdog, rank=0)
    assert exit_.codes == [SHARD_LOST_EXIT_CODE] and len(seen) == 1  # the hooks after it still ran
    watchdog.close()


def test_the_real_exit_ends_a_process_whose_main_thread_never_returns(tmp_path):
    report = tmp_path / "report.txt"
    script = f"""
import sys, threading
sys.path.insert(0, {str(ROOT)!r})
from scheduler.execution.stall_watchdog import StallWatchdog
from pathlib import Path
watchdog = StallWatchdog(0, 0.3, on_stall=(lambda e: Path({str(report)!r}).write_text(str(e)),))
with watchdog.guard("tick 3's forward"):
    threading.Event().wait()  # blocked for good, like a forward whose collective nobody completes
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == SHARD_LOST_EXIT_CODE, proc.stderr
    assert report.read_text().startswith("rank 0: a peer rank is gone (tick 3's forward has been blocked for 0.3 s")
    assert "mlxsched: rank 0: a peer rank is gone" in proc.stderr


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, True, "60"])
def test_the_bound_must_be_a_positive_finite_number(bad):
    with pytest.raises(ValueError, match="shard_stall_timeout_s"):
        EngineConfig(shard_stall_timeout_s=bad)
    assert EngineConfig(shard_stall_timeout_s=None).shard_stall_timeout_s is None


class _TwoRanks:
    """Stands for an `mx.distributed` group of two ranks, for the checks a sharded engine makes before it
    sends anything (no collective runs: the model here is whole)."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 2


def test_a_sharded_engine_that_fails_to_construct_stops_its_watchdog(text_model):
    """The watchdog starts before the construction's probe forwards; a construction that then fails (here:
    a draft model, which sharding does not build) stops its thread instead of leaving it behind."""
    from scheduler import Engine

    model, tokenizer = text_model
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ValueError, match="drafter='draft-model' with a sharded model"):
        Engine(model, tokenizer, EngineConfig(draft_tokens=2, drafter="draft-model"), draft_model=model,
               shard_group=_TwoRanks())
    assert not [t.name for t in threading.enumerate()
                if t.name.startswith("mlxsched-stall-watchdog") and t.name not in before]
