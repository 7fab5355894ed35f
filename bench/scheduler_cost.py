"""Scheduler cost with no model: plan + apply time per tick with N live decoding requests (steady state:
every request decodes one token per tick, as in a busy engine), events off and on.

    python -m bench.scheduler_cost [--live 16 256 1024] [--ticks 200]
"""

from __future__ import annotations

import argparse
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


def per_tick_cost(live: int, ticks: int, log_events: bool) -> float:
    config = EngineConfig(max_seqs=live, max_batched_tokens=live + 512, prefill_chunk=512)
    sched = Scheduler(config, EventLog([MemorySink()] if log_events else []))
    for i in range(live):
        sched.add(Request(f"r{i}", [5] * 16, SamplingParams(max_tokens=10**6)), 0)
    tick = 0
    warmup = TickLoop(sched, FixedTokenExecutor(100))
    while sched.waiting or sched.prefilling:  # admit and prefill everyone first
        warmup.run_tick(tick)
        tick += 1
    loop = TickLoop(sched, _SameResult(TickResult(sampled={f"r{i}": 100 for i in range(live)})))
    t0 = time.perf_counter()
    for _ in range(ticks):
        loop.run_tick(tick)
        tick += 1
    return (time.perf_counter() - t0) / ticks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scheduler_cost", description=__doc__)
    ap.add_argument("--live", type=int, nargs="+", default=[16, 256, 1024])
    ap.add_argument("--ticks", type=int, default=200)
    args = ap.parse_args(argv)
    print("| live requests | plan + apply per tick (events off) | (events to memory) |")
    print("| ---: | ---: | ---: |")
    for live in args.live:
        off = min(per_tick_cost(live, args.ticks, False) for _ in range(3))
        on = min(per_tick_cost(live, args.ticks, True) for _ in range(3))
        print(f"| {live} | {off * 1e6:.0f} us | {on * 1e6:.0f} us |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
