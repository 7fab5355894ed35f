"""Several engines served tick by tick on one machine, each on its own clock that stops while the others work.

Why: to compare two configurations (or a what-if prediction with reality) one runs each on the same timed
arrivals. Run one after the other, the runs meet a different machine: on a shared 2-core VM the same config's
throughput moved 1015-1633 tok/s between consecutive runs (bench/README.md, "Issue 16"), more than most
schedule changes move it. Run side by side in two processes, they fight over the cores. Here the engines
take turns, a call at a time (arrivals taken in, then one `step`), always the one whose clock is furthest
behind: a drift of the machine's speed lands on every lane alike, and each lane's clock counts its own work
only, plus the idle gaps until its next arrival (where a lone run would sleep). Each lane's trace then reads as
a run alone on the machine, timed by its `EngineClock` (`Engine(clock=...)`).

    a = EngineClock(); b = EngineClock()
    lanes = [Lane(Engine.from_pretrained(d, config_a, clock=a), requests, offsets, calibrate=True),
             Lane(Engine.from_pretrained(d, config_b, clock=b), requests, offsets)]
    run_side_by_side(lanes)  # then each config's trace_path holds its run
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence


class EngineClock:
    """Wall time that runs only while started: `time.perf_counter` minus the time spent stopped (and plus the
    idle time skipped). It reads 0 when made and starts stopped."""

    def __init__(self) -> None:
        self._stopped_at: float | None = time.perf_counter()
        self._offset = self._stopped_at  # perf_counter() - offset is this clock's time while it runs

    def __call__(self) -> float:
        now = self._stopped_at if self._stopped_at is not None else time.perf_counter()
        return now - self._offset

    @property
    def running(self) -> bool:
        return self._stopped_at is None

    def start(self) -> None:
        if self._stopped_at is not None:
            self._offset += time.perf_counter() - self._stopped_at
            self._stopped_at = None

    def stop(self) -> None:
        if self._stopped_at is None:
            self._stopped_at = time.perf_counter()

    def skip(self, seconds: float) -> None:
        """Idle time: the clock moves on `seconds` with no work (a lone run would sleep until its next arrival)."""
        if seconds < 0:
            raise ValueError(f"a clock cannot go back ({seconds} s)")
        self._offset -= seconds


@dataclass
class Lane:
    """One engine and the timed arrivals it serves: `requests` are `Engine.add_request` keyword arguments,
    added once `offsets[i]` seconds have passed on the engine's clock since the lane started (after its
    calibration, with `calibrate`: `Engine.calibrate()` first, on the same clock). Ids default to `q{i}`."""

    engine: Any
    requests: Sequence[Mapping[str, Any]]
    offsets: Sequence[float]
    calibrate: bool = False
    start: float = field(init=False, default=0.0)
    next_arrival: int = field(init=False, default=0)
    ticks: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if not isinstance(self.engine.clock, EngineClock):
            raise TypeError("a lane's engine must run on an EngineClock: Engine(..., clock=EngineClock())")
        if len(self.requests) != len(self.offsets):
            raise ValueError(f"{len(self.requests)} requests but {len(self.offsets)} offsets")
        if any(b < a for a, b in zip(self.offsets, self.offsets[1:])):
            raise ValueError("offsets must be in arrival order (non-decreasing)")

    @property
    def clock(self) -> EngineClock:
        return self.engine.clock

    @property
    def done(self) -> bool:
        return self.next_arrival == len(self.requests) and not self.engine.has_pending()

    def take_turn(self) -> None:
        """Take in the arrivals that are due, then run one tick; with nothing live, skip to the next arrival."""
        self.clock.start()
        try:
            since_start = self.clock() - self.start
            while self.next_arrival < len(self.requests) and self.offsets[self.next_arrival] <= since_start:
                request = {"request_id": f"q{self.next_arrival}", **self.requests[self.next_arrival]}
                self.engine.add_request(**request)
                self.next_arrival += 1
            if self.engine.has_pending():
                self.engine.step()
                self.ticks += 1
            elif self.next_arrival < len(self.requests):
                self.clock.skip(self.offsets[self.next_arrival] - since_start)
        finally:
            self.clock.stop()


@dataclass(frozen=True)
class LaneResult:
    seconds: float  # the lane's clock from its start (after calibration) to its last tick
    ticks: int


def run_side_by_side(lanes: Sequence[Lane]) -> list[LaneResult]:
    """Serve every lane to the end, a turn at a time, the lane whose clock is furthest behind first (ties in
    lane order). Calibrations run first, lane by lane."""
    for lane in lanes:
        lane.clock.start()
        try:
            if lane.calibrate:
                lane.engine.calibrate()
            lane.start = lane.clock()
        finally:
            lane.clock.stop()
    active = [lane for lane in lanes if not lane.done]
    while active:
        lane = min(active, key=lambda candidate: candidate.clock() - candidate.start)
        lane.take_turn()
        if lane.done:
            active.remove(lane)
    return [LaneResult(lane.clock() - lane.start, lane.ticks) for lane in lanes]
