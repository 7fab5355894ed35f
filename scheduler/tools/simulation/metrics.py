"""Per-request records and the summary metrics (TTFT, TPOT, throughput, ...), for a recorded run or a
simulated one (the time conventions are in `scheduler.tools.simulate`'s docstring)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from scheduler.tools.replay import Trace
from scheduler.tools.simulation.recorded import Recorded, load_recorded, _tick_start, _tick_end


@dataclass
class RequestRecord:
    request_id: str
    arrival: float
    admitted: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    end: float | None = None
    num_output_tokens: int = 0
    outcome: str | None = None  # "finished", "aborted", "error"; None if still live


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def summarize(records: Iterable[RequestRecord], ticks: int, request_ticks: int, preemptions: int = 0,
              cache_hit_rate: float | None = None, prefix_tokens_saved: int | None = None) -> dict[str, Any]:
    records = list(records)
    ttft = [r.first_token - r.arrival for r in records if r.first_token is not None]
    done = [r for r in records if r.outcome == "finished"]
    e2e = [r.end - r.arrival for r in done if r.end is not None]
    tpot = [(r.last_token - r.first_token) / (r.num_output_tokens - 1)
            for r in done if r.num_output_tokens >= 2 and r.first_token is not None and r.last_token is not None]
    queue = [r.admitted - r.arrival for r in records if r.admitted is not None]
    tokens = sum(r.num_output_tokens for r in records)
    lasts = [r.last_token for r in records if r.last_token is not None]
    start = min((r.arrival for r in records), default=0.0)
    makespan = (max(lasts) - start) if lasts else 0.0
    return {
        "requests": len(records),
        "finished": len(done),
        "aborted": sum(1 for r in records if r.outcome == "aborted"),
        "failed": sum(1 for r in records if r.outcome == "error"),
        "output_tokens": tokens,
        "makespan_s": makespan,
        "throughput_tok_s": tokens / makespan if makespan > 0 else None,
        "ttft_mean_s": _mean(ttft),
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p95_s": _pct(ttft, 95),
        "ttft_p99_s": _pct(ttft, 99),
        "tpot_mean_s": _mean(tpot),
        "e2e_p50_s": _pct(e2e, 50),
        "e2e_p95_s": _pct(e2e, 95),
        "queue_mean_s": _mean(queue),
        "preemptions": preemptions,
        "ticks": ticks,
        "request_ticks": request_ticks,
        "cache_hit_rate": cache_hit_rate,
        "prefix_tokens_saved": prefix_tokens_saved,
    }


def recorded_records(trace: "Recorded | Trace | str | os.PathLike | Iterable[dict]") -> list[RequestRecord]:
    rec = load_recorded(trace)
    tr = rec.trace
    out = []
    for event in rec.arrival_events:
        rid = event["request_id"]
        r = RequestRecord(rid, rec.arrival_time[rid], num_output_tokens=rec.tokens.get(rid, 0))
        if rid in rec.admitted_tick:
            r.admitted = _tick_start(tr, rec.admitted_tick[rid])
        if rid in rec.first_tick:
            r.first_token = _tick_end(tr, rec.first_tick[rid])
            r.last_token = _tick_end(tr, rec.last_tick[rid])
        if rid in rec.abort_tick:
            r.outcome, r.end = "aborted", rec.abort_time.get(rid, _tick_start(tr, rec.abort_tick[rid]))
        elif rid in rec.errored:
            r.outcome, r.end = "error", _tick_end(tr, rec.errored[rid])
        elif rid in rec.finished:
            r.outcome, r.end = "finished", _tick_end(tr, rec.finished[rid])
        out.append(r)
    return out


def recorded_metrics(trace: "Recorded | Trace | str | os.PathLike | Iterable[dict]") -> dict[str, Any]:
    """`SimResult.summary()`'s keys, from the real run's wall times (see the module docstring)."""
    rec = load_recorded(trace)
    records = recorded_records(rec)
    busy = sorted(t for t in rec.trace.outcomes if not rec.calibration_only(t))
    # live during tick k: arrived at a tick <= k, not aborted at a tick <= k (aborts are drained before the
    # plan), not finished/failed at a tick < k (those end in the tick's apply, after the plan).
    horizon = (max(busy) if busy else 0) + 2
    delta = np.zeros(horizon + 1, dtype=np.int64)
    for rid, tick in rec.arrival_tick.items():
        if tick > horizon:
            continue
        if rid in rec.abort_tick:
            end = rec.abort_tick[rid]
        elif rid in rec.errored:
            end = rec.errored[rid] + 1
        elif rid in rec.finished:
            end = rec.finished[rid] + 1
        else:
            end = horizon
        delta[tick] += 1
        delta[min(max(end, tick), horizon)] -= 1
    live = np.cumsum(delta)
    request_ticks = int(sum(live[t] for t in busy))
    return summarize(records, ticks=len(busy), request_ticks=request_ticks, preemptions=rec.preemptions,
                     cache_hit_rate=rec.cache_hit_rate,
                     prefix_tokens_saved=rec.prefix_tokens_saved if rec.prefix_hits + rec.prefix_misses else None)
