"""The invariant checker: explicit checks raising a typed error (they hold under `python -O`), on for every
engine the tests build, and comparing what the executor really did with what was planned."""

import subprocess
import sys
from pathlib import Path

import pytest

from scheduler.config import EngineConfig
from scheduler.events import EventLog
from scheduler.plan import PrefillChunk, TickPlan
from scheduler.scheduler import InvariantViolation, Scheduler

ROOT = Path(__file__).resolve().parents[2]


def test_every_engine_config_in_the_suite_checks_invariants():
    assert EngineConfig().check_invariants is True  # tests/conftest.py sets MLXSCHED_CHECK_INVARIANTS=1


def test_a_broken_plan_raises_invariant_violation():
    sched = Scheduler(EngineConfig(max_batched_tokens=64, max_seqs=4), EventLog())
    over = TickPlan(0, prefill=(PrefillChunk("a", 0, 65, False),), num_batched_tokens=65)
    with pytest.raises(InvariantViolation, match="max_batched_tokens"):
        sched.check_invariants(over)
    miscounted = TickPlan(0, prefill=(PrefillChunk("a", 0, 10, False),), num_batched_tokens=9)
    with pytest.raises(InvariantViolation, match="what the tick computes"):
        sched.check_invariants(miscounted)


def test_the_checks_hold_under_python_O():
    code = (
        "from scheduler import EngineConfig\n"
        "from scheduler.events import EventLog\n"
        "from scheduler.plan import TickPlan\n"
        "from scheduler.scheduler import InvariantViolation, Scheduler\n"
        "s = Scheduler(EngineConfig(max_batched_tokens=64, max_seqs=4), EventLog())\n"
        "try:\n"
        "    s.check_invariants(TickPlan(0, decode=('x',) * 5, num_batched_tokens=5, num_seqs=5))\n"
        "except InvariantViolation:\n"
        "    print('raised')\n"
    )
    out = subprocess.run([sys.executable, "-O", "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": ""}, check=True)
    assert out.stdout.strip() == "raised"
