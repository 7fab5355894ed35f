"""Scheduler cost with no model: plan + apply time per tick with N live decoding requests (steady state:
every request decodes one token per tick, as in a busy engine), events off and on.

With ``--waiting``, as many requests again wait behind ``max_seqs`` (so every tick the planner notes a
`max_seqs` reason for each of them), and the table adds the share of the tick spent on reasons: the planner's
`_Reasons` methods and the plan record's change-only diff (the comprehensions of `Scheduler._plan_record`),
attributed with cProfile in a separate run (profiling inflates small calls, so the share is an upper bound).

    python -m bench.scheduler_cost [--live 16 256 1024] [--ticks 200] [--waiting]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from scheduler.config import EngineConfig
from scheduler.events import EventLog, MemorySink
from scheduler.plan import TickResult
from scheduler.fixtures.executors import FixedTokenExecutor
from scheduler.loop import TickLoop
from scheduler.request import Request, SamplingParams
from scheduler.scheduler import Scheduler


class _SameResult:
    """The steady state's executor, costing nothing: every tick every row samples the same ordinary token."""

    def __init__(self, result: TickResult):
        self.result = result

    def execute(self, plan) -> TickResult:
        return self.result

    def release(self, request_ids) -> None:
        pass


def _steady(live: int, log_events: bool, waiting: bool) -> tuple[TickLoop, int]:
    """A scheduler with `live` decoding requests (and, if `waiting`, `live` more queued behind max_seqs)."""
    config = EngineConfig(max_seqs=live, max_batched_tokens=live + 512, prefill_chunk=512)
    sched = Scheduler(config, EventLog([MemorySink()] if log_events else []))
    for i in range(live):
        sched.add(Request(f"r{i}", [5] * 16, SamplingParams(max_tokens=10**6)), 0)
    tick = 0
    warmup = TickLoop(sched, FixedTokenExecutor(100))
    while sched.waiting or sched.prefilling:  # admit and prefill everyone first
        warmup.run_tick(tick)
        tick += 1
    for i in range(live if waiting else 0):  # these wait for a slot every tick: a max_seqs reason each
        sched.add(Request(f"w{i}", [5] * 16, SamplingParams(max_tokens=10**6)), tick)
    return TickLoop(sched, _SameResult(TickResult(sampled={f"r{i}": 100 for i in range(live)}))), tick


def per_tick_cost(live: int, ticks: int, log_events: bool, waiting: bool = False) -> float:
    loop, tick = _steady(live, log_events, waiting)
    t0 = time.perf_counter()
    for _ in range(ticks):
        loop.run_tick(tick)
        tick += 1
    return (time.perf_counter() - t0) / ticks


def reasons_share(live: int, ticks: int) -> float:
    """The fraction of a profiled tick (events to memory, `live` waiting) spent in the reason code."""
    loop, tick = _steady(live, True, True)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(ticks):
        loop.run_tick(tick)
        tick += 1
    profile.disable()
    stats = pstats.Stats(profile).stats  # {(file, line, name): (cc, nc, tottime, cumtime, callers)}
    total = sum(tt for _, _, tt, _, _ in stats.values())

    def is_reason_entry(func) -> bool:  # the planner's reason methods, and the reason comprehensions of the record
        file, _, name = func
        return ((file.endswith("planner.py") and name in {"note", "held_back", "chunk_given", "preempted"})
                or (file.endswith("scheduler.py") and name in {"<dictcomp>", "<listcomp>"}))

    reasons = 0.0
    for func, (_, _, _, _, callers) in stats.items():
        if is_reason_entry(func):  # time entering reason code from outside it (a note from held_back is inside)
            if func[0].endswith("scheduler.py") and not any(c[2] == "_plan_record" for c in callers):
                continue
            reasons += sum(ct for caller, (_, _, _, ct) in callers.items() if not is_reason_entry(caller))
    return reasons / total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scheduler_cost", description=__doc__)
    ap.add_argument("--live", type=int, nargs="+", default=[16, 256, 1024])
    ap.add_argument("--ticks", type=int, default=200)
    ap.add_argument("--waiting", action="store_true", help="as many requests again wait behind max_seqs")
    args = ap.parse_args(argv)
    if not args.waiting:
        print("| live requests | plan + apply per tick (events off) | (events to memory) |")
        print("| ---: | ---: | ---: |")
    else:
        print("| decoding + waiting | plan + apply per tick (events off) | (events to memory) | reasons' share "
              "of a profiled tick |")
        print("| ---: | ---: | ---: | ---: |")
    for live in args.live:
        off = min(per_tick_cost(live, args.ticks, False, args.waiting) for _ in range(3))
        on = min(per_tick_cost(live, args.ticks, True, args.waiting) for _ in range(3))
        if not args.waiting:
            print(f"| {live} | {off * 1e6:.0f} us | {on * 1e6:.0f} us |")
        else:
            share = reasons_share(live, args.ticks)
            print(f"| {live} + {live} | {off * 1e6:.0f} us | {on * 1e6:.0f} us | {share:.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
