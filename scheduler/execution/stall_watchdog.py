"""A bound on how long a sharded rank's forward may block, because MLX cannot always fail it.

When a peer dies, MLX's ring backend fails the collective that saw the lost connection and then stops that
socket's worker thread. A forward holds several collectives (two per layer, queued together when the graph is
evaluated), and MLX's stream thread still runs the ones queued behind the failed one: their sends and receives
go to the stopped worker, whose queue nobody drains, so the forward's `mx.eval` waits forever
(mlx/distributed/ring/ring.cpp, `SocketThread::worker` returns after "Failing pending tasks"; mlx 0.32). The
collective that failed is inside that same eval, so no exception reaches Python either. Whether a rank hits
this depends only on where in its tick the peer died: between two forwards, the next collective raises and
the rank reports `ShardLost` at once.

A blocked C++ call cannot be interrupted from Python, so the watchdog ends the process: a forward still running
`timeout_s` after it began is reported as a lost peer (to stderr and to the `on_stall` hooks, with the
`ShardLost` error the rank would have raised), and the process exits with `SHARD_LOST_EXIT_CODE`. A rank that
survives its peer is of no use anyway: the model is split across both.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from .distributed import ShardLost

# What a rank's process exits with when its forward stalled after a peer was lost (EX_TEMPFAIL: the cluster can
# be started again).
SHARD_LOST_EXIT_CODE = 75


class StallWatchdog:
    """Arms around each sharded forward (`guard`); a forward that outlives `timeout_s` ends the process."""

    def __init__(self, rank: int, timeout_s: float, on_stall: tuple[Callable[[ShardLost], None], ...] = (),
                 exit: Callable[[int], None] = os._exit):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s!r}")
        self.rank = rank
        self.timeout_s = timeout_s
        self.on_stall = on_stall
        self._exit = exit  # os._exit: a blocked thread keeps a normal exit from completing
        self._cond = threading.Condition()
        self._armed: tuple[int, float, str] | None = None  # (generation, deadline, what is running)
        self._generation = 0
        self._closed = False
        self.fired: ShardLost | None = None
        self._thread = threading.Thread(target=self._watch, name=f"mlxsched-stall-watchdog-{rank}", daemon=True)
        self._thread.start()

    @contextmanager
    def guard(self, what: str) -> Iterator[None]:
        with self._cond:
            self._generation += 1
            self._armed = (self._generation, time.monotonic() + self.timeout_s, what)
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._armed = None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _watch(self) -> None:
        with self._cond:
            while not self._closed:
                if self._armed is None:
                    self._cond.wait()
                    continue
                generation, deadline, what = self._armed
                left = deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                if self._armed is not None and self._armed[0] == generation:
                    self._fire(what)
                    return

    def _fire(self, what: str) -> None:
        error = ShardLost(f"rank {self.rank}: a peer rank is gone ({what} has been blocked for {self.timeout_s:g} s "
                          f"in a collective; exiting with code {SHARD_LOST_EXIT_CODE})")
        self.fired = error
        print(f"mlxsched: {error}", file=sys.stderr, flush=True)
        for hook in self.on_stall:
            try:
                hook(error)
            except Exception as exc:  # a failing hook must not keep the process alive
                print(f"mlxsched: an on_shard_lost hook raised {type(exc).__name__}: {exc}", file=sys.stderr,
                      flush=True)
        self._exit(SHARD_LOST_EXIT_CODE)
