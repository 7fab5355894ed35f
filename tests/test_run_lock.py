"""The run lock (tests/run_lock.py) is held by xdist's workers only: a pytest that a test starts in a child
process inherits the workers' environment, and must not queue behind the run's exclusive tests (it deadlocked
a run: the child waited at the turnstile behind the other worker's exclusive test, which waited for the room
the child's parent test held)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import uuid
from pathlib import Path

from tests import run_lock

ROOT = Path(__file__).resolve().parent.parent


def test_a_pytest_started_by_a_test_runs_while_an_exclusive_test_waits():
    run = uuid.uuid4().hex
    where = run_lock._lock_dir(run)
    with open(where / "turnstile", "a+") as turnstile:
        fcntl.flock(turnstile, fcntl.LOCK_EX)  # as a worker's exclusive test holds it while the room empties
        env = {**os.environ, "PYTEST_XDIST_TESTRUNUID": run, "PYTEST_XDIST_WORKER": "gw0",
               "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
                                "tests/core/test_request.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                               timeout=120)
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-2000:]
    assert " passed" in child.stdout


def test_only_an_xdist_worker_names_a_run():
    class Worker:
        workerinput = {"testrunuid": "abc", "workerid": "gw1"}

    class Alone:
        pass

    assert run_lock.run_of(Worker()) == "abc"
    assert run_lock.run_of(Alone()) is None
