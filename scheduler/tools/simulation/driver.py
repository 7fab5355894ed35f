"""`simulate`: the real `Scheduler` driven over arrivals by `SimExecutor` through the tick loop."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

from scheduler.config import EngineConfig
from scheduler.events import EventLog
from scheduler.loop import TickLoop
from scheduler.policy import Policy
from scheduler.request import Request, SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.tools.simulation.cost_model import CostModel
from scheduler.tools.simulation.executor import SimExecutor
from scheduler.tools.simulation.metrics import RequestRecord, summarize
from scheduler.tools.workload import SimArrival


@dataclass
class SimResult:
    requests: list[RequestRecord]
    ticks: int
    request_ticks: int  # sum over ticks of live requests (queued included)
    row_ticks: int  # sum over ticks of requests given work (prefill chunks + decode rows)
    clock: float  # virtual time at the end
    wall_s: float  # how long the simulation itself took
    preemptions: int = 0
    cache_hit_rate: float | None = None
    prefix_tokens_saved: int | None = None
    config: EngineConfig | None = None
    policy: str | None = None

    def summary(self) -> dict[str, Any]:
        return summarize(self.requests, self.ticks, self.request_ticks, self.preemptions, self.cache_hit_rate,
                         self.prefix_tokens_saved)

    @property
    def request_ticks_per_s(self) -> float:
        return self.request_ticks / self.wall_s if self.wall_s > 0 else float("inf")

    @property
    def all_ended(self) -> bool:
        return all(r.outcome is not None for r in self.requests)


def simulate(
    arrivals: Sequence[SimArrival],
    config: EngineConfig,
    cost_model: CostModel,
    policy: str | Policy | None = None,
    stop_token_id: int = 0,
    *,
    kv_layout: Any = None,
    kv_bytes_per_token: int | None = None,
    max_ticks: int | None = None,
) -> SimResult:
    """Drive the real Scheduler over `arrivals` in virtual time; see the module docstring.

    Each tick: add the arrivals whose time has come (when nothing is live, the clock first jumps to the next
    arrival), abort those whose `abort_time` has passed, plan, execute on `SimExecutor`, apply.
    `kv_layout` (a `caches.kv.KVLayout`) enables `config.kv_memory_bytes` (admission and preemption); an
    arrival that could never fit is refused as the engine refuses it (outcome "error", never queued).
    `config.prefix_cache_bytes` turns the real prefix cache on; its entries are sized `kv_bytes_per_token`
    per token (default: the layout's, else 0). `config.check_invariants` checks the bookkeeping every tick.
    """
    ids = [a.request_id for a in arrivals]
    if len(set(ids)) != len(ids):
        raise ValueError("simulate: request ids must be unique")
    wall0 = time.perf_counter()
    extra = {"kv_layout": kv_layout} if kv_layout is not None else {}
    scheduler = Scheduler(config, EventLog(), stop_token_ids=[stop_token_id], policy=policy, **extra)
    if kv_bytes_per_token is None:
        kv_bytes_per_token = kv_layout.bytes_per_token if kv_layout is not None else 0
    prefix_cache = getattr(scheduler, "prefix_cache", None)
    executor = SimExecutor(cost_model, arrivals, stop_token_ids=[stop_token_id],
                           prefix_block_size=config.prefix_block_size if prefix_cache is not None else None,
                           kv_bytes_per_token=kv_bytes_per_token)
    loop = TickLoop(scheduler, executor)
    budget = getattr(config, "kv_memory_bytes", None)
    pending = sorted(arrivals, key=lambda a: a.arrival_time)  # stable: ties keep the given order
    aborts = sorted(((max(a.abort_time, a.arrival_time), a.request_id) for a in arrivals
                     if a.abort_time is not None))
    records: dict[str, RequestRecord] = {a.request_id: RequestRecord(a.request_id, a.arrival_time) for a in arrivals}
    sampling_cache: dict[int, SamplingParams] = {}
    live = scheduler.requests
    next_arrival = next_abort = 0
    tick = ticks = request_ticks = row_ticks = preemptions = 0
    limit = max_ticks if max_ticks is not None else math.inf

    while next_arrival < len(pending) or live:
        if not live and pending[next_arrival].arrival_time > executor.clock:
            executor.clock = pending[next_arrival].arrival_time
        now = executor.clock
        while next_arrival < len(pending) and pending[next_arrival].arrival_time <= now:
            a = pending[next_arrival]
            next_arrival += 1
            if kv_layout is not None and budget is not None and kv_layout.footprint([a.prompt_len + 1], []) > budget:
                records[a.request_id].outcome, records[a.request_id].end = "error", now  # the engine refuses it
                continue
            sampling = sampling_cache.get(a.max_tokens)
            if sampling is None:
                sampling = sampling_cache[a.max_tokens] = SamplingParams(max_tokens=a.max_tokens)
            scheduler.add(Request(request_id=a.request_id, prompt_tokens=a.prompt_tokens, sampling=sampling,
                                  priority=a.priority, arrival_tick=tick, arrival_time=a.arrival_time,
                                  num_images=a.num_images, media_key=a.media_key), tick)
        while next_abort < len(aborts) and aborts[next_abort][0] <= now:
            rid = aborts[next_abort][1]
            next_abort += 1
            if rid in live:
                scheduler.abort(rid, tick)
                loop.release([rid])
                records[rid].outcome, records[rid].end = "aborted", now
        if not live:
            continue
        plan = loop.plan(tick)
        if plan.is_empty:
            raise RuntimeError(f"simulate: tick {tick}: the scheduler planned no work with {len(live)} live "
                               f"requests (a queue head that can never be admitted?)")
        request_ticks += len(live)
        row_ticks += len(plan.prefill) + len(plan.decode)
        preempted = getattr(plan, "preempted", ())
        if preempted:
            preemptions += len(preempted)
        for rid in plan.admitted:
            if records[rid].admitted is None:  # first admission (a preempted request is admitted again)
                records[rid].admitted = now
        applied = loop.carry_out(plan).applied
        end = executor.clock
        for out in applied.outputs:
            r = records[out.request_id]
            if out.token_ids:
                if r.first_token is None:
                    r.first_token = end
                r.last_token = end
                r.num_output_tokens += len(out.token_ids)
            if out.finished:
                r.end = end
                r.outcome = "error" if out.error is not None else "finished"
        if config.check_invariants:
            scheduler.check_invariants(plan)
        tick += 1
        ticks += 1
        if ticks >= limit:
            break
    hit_rate = saved = None
    if prefix_cache is not None:
        stats = prefix_cache.stats()
        hit_rate, saved = stats["hit_rate"], stats["tokens_saved"]
    return SimResult(
        requests=list(records.values()), ticks=ticks, request_ticks=request_ticks, row_ticks=row_ticks,
        clock=executor.clock, wall_s=time.perf_counter() - wall0, preemptions=preemptions,
        cache_hit_rate=hit_rate, prefix_tokens_saved=saved, config=config, policy=scheduler.policy.name,
    )
