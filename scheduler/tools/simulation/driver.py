"""`simulate`: the real `Scheduler` driven over arrivals by `SimExecutor` through the tick loop."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

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
    media_items_encoded: int = 0  # media items that went through the encoders (vision-cache misses)

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
    prefix_checkpoints: bool = False,
    prefix_clear_times: Sequence[float] = (),
    vision_unit_bytes: Mapping[str, int] | None = None,
) -> SimResult:
    """Drive the real Scheduler over `arrivals` in virtual time; see the module docstring.

    Each tick: add the arrivals whose time has come (when nothing is live, the clock first jumps to the next
    arrival), abort those whose `abort_time` has passed, plan, execute on `SimExecutor`, apply.
    `kv_layout` (a `caches.kv.KVLayout`) enables `config.kv_memory_bytes` (admission and preemption); an
    arrival that could never fit is refused as the engine refuses it (outcome "error", never queued).
    `config.prefix_cache_bytes` turns the real prefix cache on; its entries are sized `kv_bytes_per_token`
    per token (default: the layout's, else 0); `prefix_checkpoints` stores them as a model whose caches cannot
    be trimmed does (exact checkpoints, see SimExecutor). `prefix_clear_times` empty the prefix cache as
    `Engine.clear_prefix_cache()` did in the recording: at the start of the first tick at or after each time,
    after that tick's arrivals and aborts. `config.check_invariants` checks the bookkeeping every tick. The vision
    cache holds `config.vision_cache_bytes` (0: none), each media unit sized as `vision_unit_bytes` says (the
    recording's stores; 0 where unknown), least recently used out first, as the engine's does.
    """
    ids = [a.request_id for a in arrivals]
    if len(set(ids)) != len(ids):
        raise ValueError("simulate: request ids must be unique")
    wall0 = time.perf_counter()
    run = _Simulation(arrivals, config, cost_model, policy, stop_token_id, kv_layout, kv_bytes_per_token,
                      prefix_checkpoints, prefix_clear_times, vision_unit_bytes)
    limit = max_ticks if max_ticks is not None else math.inf
    while run.next_arrival < len(run.pending) or run.live:
        now = run.advance_clock()
        run.add_arrivals(now)
        run.abort_due(now)
        if not run.live:
            continue
        run.clear_due(now)
        run.run_tick(now)
        if run.ticks >= limit:
            break
    return run.result(time.perf_counter() - wall0)


class _Simulation:
    """One simulation's state: the scheduler and `SimExecutor` stepped through the tick loop, the arrivals and
    aborts still to come, the records and counters the result is made of."""

    def __init__(self, arrivals: Sequence[SimArrival], config: EngineConfig, cost_model: CostModel,
                 policy: str | Policy | None, stop_token_id: int, kv_layout: Any, kv_bytes_per_token: int | None,
                 prefix_checkpoints: bool = False, prefix_clear_times: Sequence[float] = (),
                 vision_unit_bytes: Mapping[str, int] | None = None):
        self.config, self.kv_layout, self.cost_model = config, kv_layout, cost_model
        self.clears = sorted(prefix_clear_times)
        self.next_clear = 0
        extra = {"kv_layout": kv_layout} if kv_layout is not None else {}
        if kv_bytes_per_token is None:
            kv_bytes_per_token = kv_layout.bytes_per_token if kv_layout is not None else 0
        self.executor = SimExecutor(cost_model, arrivals, stop_token_ids=[stop_token_id],
                                    prefix_block_size=config.prefix_block_size if config.prefix_cache_bytes
                                    else None, kv_bytes_per_token=kv_bytes_per_token,
                                    prefix_checkpoints=prefix_checkpoints,
                                    vision_cache_bytes=config.vision_cache_bytes, vision_unit_bytes=vision_unit_bytes)
        # the vision budget pays for what the simulated vision cache does not hold, as the engine's does
        self.scheduler = Scheduler(config, EventLog(), stop_token_ids=[stop_token_id], policy=policy,
                                   vision_cached=self.executor.vision_cached, **extra)
        self.prefix_cache = getattr(self.scheduler, "prefix_cache", None)
        self.loop = TickLoop(self.scheduler, self.executor)
        self.budget = getattr(config, "kv_memory_bytes", None)
        self.pending = sorted(arrivals, key=lambda a: a.arrival_time)  # stable: ties keep the given order
        self.aborts = sorted(((max(a.abort_time, a.arrival_time), a.request_id) for a in arrivals
                              if a.abort_time is not None))
        self.records: dict[str, RequestRecord] = {a.request_id: RequestRecord(a.request_id, a.arrival_time)
                                                  for a in arrivals}
        self.sampling_cache: dict[int, SamplingParams] = {}
        self.live = self.scheduler.requests
        self.next_arrival = self.next_abort = 0
        self.ticks = self.request_ticks = self.row_ticks = self.preemptions = 0  # ticks: also the next tick's number

    def advance_clock(self) -> float:
        """When nothing is live, the clock jumps to the next arrival."""
        pending, executor = self.pending, self.executor
        if not self.live and pending[self.next_arrival].arrival_time > executor.clock:
            executor.clock = pending[self.next_arrival].arrival_time
        return executor.clock

    def add_arrivals(self, now: float) -> None:
        pending, records, tick, layout = self.pending, self.records, self.ticks, self.kv_layout
        busy = bool(self.live)  # taking an arrival in delays the next tick only while requests are served
        while self.next_arrival < len(pending) and pending[self.next_arrival].arrival_time <= now:
            a = pending[self.next_arrival]
            self.next_arrival += 1
            budget = self.budget
            n, cfg = a.prompt_len, self.config
            if (layout is not None and budget is not None and (  # the engine's add_request rules
                    layout.footprint([n + max(1, cfg.kv_headroom_tokens)], []) > budget)
                    or a.first_chunk_reach > cfg.one_forward_limit()[0]):
                records[a.request_id].outcome, records[a.request_id].end = "error", now  # the engine refuses it
                continue
            sampling = self.sampling_cache.get(a.max_tokens)
            if sampling is None:
                sampling = self.sampling_cache[a.max_tokens] = SamplingParams(max_tokens=a.max_tokens)
            self.scheduler.add(Request(request_id=a.request_id, prompt_tokens=a.prompt_tokens, sampling=sampling,
                                       priority=a.priority, arrival_tick=tick, arrival_time=a.arrival_time,
                                       num_images=a.num_images, num_media_tokens=a.num_media_tokens,
                                       media_key=a.media_key, media_marks=a.media_marks,
                                       media_items=a.media_items, first_chunk_reach=a.first_chunk_reach,
                                       lora=a.lora, cache_salt=a.cache_salt), tick)
            if busy:
                self.executor.clock += self.cost_model.arrival_seconds(a.num_images)

    def abort_due(self, now: float) -> None:
        aborts = self.aborts
        while self.next_abort < len(aborts) and aborts[self.next_abort][0] <= now:
            rid = aborts[self.next_abort][1]
            self.next_abort += 1
            if rid in self.live:
                self.scheduler.abort(rid, self.ticks)
                self.loop.release([rid])
                self.records[rid].outcome, self.records[rid].end = "aborted", now

    def clear_due(self, now: float) -> None:
        """Empty the prefix cache at the start of this tick if a recorded clear's time has come (several clears
        before one tick are one)."""
        due = False
        while self.next_clear < len(self.clears) and self.clears[self.next_clear] <= now:
            self.next_clear += 1
            due = True
        if due:
            self.scheduler.clear_prefix_cache(self.ticks)

    def run_tick(self, now: float) -> None:
        """Plan, count, execute and apply one tick, then record what each request did at the tick's end."""
        tick, records = self.ticks, self.records
        plan = self.loop.plan(tick)
        if plan.is_empty:
            raise RuntimeError(f"simulate: tick {tick}: the scheduler planned no work with {len(self.live)} live "
                               f"requests (a queue head that can never be admitted?)")
        self.request_ticks += len(self.live)
        self.row_ticks += len(plan.prefill) + len(plan.decode)
        preempted = getattr(plan, "preempted", ())
        if preempted:
            self.preemptions += len(preempted)
        for rid in plan.admitted:
            if records[rid].admitted is None:  # first admission (a preempted request is admitted again)
                records[rid].admitted = now
        applied = self.loop.carry_out(plan).applied
        end = self.executor.clock
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
        if self.config.check_invariants:
            self.scheduler.check_invariants(plan)
        self.ticks += 1

    def result(self, wall_s: float) -> SimResult:
        hit_rate = saved = None
        if self.prefix_cache is not None:
            stats = self.prefix_cache.stats()
            hit_rate, saved = stats["hit_rate"], stats["tokens_saved"]
        return SimResult(
            requests=list(self.records.values()), ticks=self.ticks, request_ticks=self.request_ticks,
            row_ticks=self.row_ticks, clock=self.executor.clock, wall_s=wall_s, preemptions=self.preemptions,
            cache_hit_rate=hit_rate, prefix_tokens_saved=saved, config=self.config,
            policy=self.scheduler.policy.name, media_items_encoded=self.executor.media_items_encoded,
        )
