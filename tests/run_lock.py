"""Tests that measure time run alone, while the suite runs on several workers (pytest-xdist).

The suite runs on every core (`-n auto` in pyproject.toml): most tests are exact comparisons, which a busy
machine slows but cannot change. A few measure time: the what-if checks compare a simulated clock with a
real one, and the stall watchdog's tests time how long a rank takes to notice a dead peer. Those are marked
`exclusive`: while one runs, no other test runs on any worker.

A readers-writer lock over files shared by the run's workers (`fcntl.flock`, released by the kernel if a
worker dies): every test holds the room shared, an exclusive test holds it alone. A turnstile in front of the
room keeps the exclusive test from starving: once it waits, tests that arrive after it wait behind it.
Outside xdist (one process) the lock does nothing.

The run is named by the worker's own xdist configuration (`config.workerinput`), not by the environment: a
pytest a test starts in a child process (tests/test_layers.py runs the core tests so) inherits xdist's
`PYTEST_XDIST_TESTRUNUID`, and taking the lock there deadlocked a run: the child waited at the turnstile
behind an exclusive test of the other worker, which waited for the room its parent test held.
"""

from __future__ import annotations

import contextlib
import fcntl
import tempfile
from pathlib import Path
from typing import Iterator


def _lock_dir(run: str | None) -> Path | None:
    if run is None:
        return None
    where = Path(tempfile.gettempdir()) / f"mlxsched-tests-{run}"
    where.mkdir(exist_ok=True)
    return where


def run_of(config) -> str | None:
    """The xdist run this pytest is a worker of (the same for all its workers), or None (not a worker)."""
    workerinput = getattr(config, "workerinput", None)
    return None if workerinput is None else workerinput["testrunuid"]


@contextlib.contextmanager
def _flock(path: Path, mode: int) -> Iterator[None]:
    with open(path, "a+") as handle:
        fcntl.flock(handle, mode)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def hold(run: str | None, exclusive: bool) -> Iterator[None]:
    """Hold run `run`'s room (`run_of`) for one test: shared, or alone when `exclusive`."""
    where = _lock_dir(run)
    if where is None:
        yield
        return
    turnstile, room = where / "turnstile", where / "room"
    if exclusive:
        with _flock(turnstile, fcntl.LOCK_EX), _flock(room, fcntl.LOCK_EX):
            yield
    else:
        with _flock(turnstile, fcntl.LOCK_EX):
            pass  # through the turnstile: an exclusive test waiting inside it goes first
        with _flock(room, fcntl.LOCK_SH):
            yield
