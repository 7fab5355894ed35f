"""The recorded run: what the simulator and the recorded metrics need from a trace, indexed once."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterable

from scheduler.tools.replay import Trace, TraceError, load_trace, parse_events


@dataclass
class Recorded:
    """What the simulator and `recorded_metrics` need from a trace, indexed once."""

    trace: Trace
    events: list[dict[str, Any]] | None  # raw events (None when built from a Trace object)
    t0: float  # engine_start measure.t
    arrival_events: list[dict[str, Any]] = field(default_factory=list)  # the workload's (not calibration's)
    calibration_events: list[dict[str, Any]] = field(default_factory=list)  # arrivals of Engine.calibrate()
    arrival_time: dict[str, float] = field(default_factory=dict)
    arrival_tick: dict[str, int] = field(default_factory=dict)
    admitted_tick: dict[str, int] = field(default_factory=dict)
    first_tick: dict[str, int] = field(default_factory=dict)
    last_tick: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    abort_time: dict[str, float] = field(default_factory=dict)
    abort_tick: dict[str, int] = field(default_factory=dict)
    errored: dict[str, int] = field(default_factory=dict)  # id -> tick of the error
    finished: dict[str, int] = field(default_factory=dict)  # id -> tick of the finish transition
    preemptions: int = 0
    prefix_hits: int = 0
    prefix_misses: int = 0
    prefix_tokens_saved: int = 0
    prefix_bytes_per_token: float | None = None  # from prefix_store events (nbytes / tokens)
    prefix_clear_times: list[float] = field(default_factory=list)  # Engine.clear_prefix_cache(), relative to t0
    vision_unit_bytes: dict[str, int] = field(default_factory=dict)  # media unit key -> bytes its store took

    @property
    def cache_hit_rate(self) -> float | None:
        lookups = self.prefix_hits + self.prefix_misses
        return self.prefix_hits / lookups if lookups else None

    @property
    def prefix_checkpoints(self) -> bool:
        """Whether the model's prefix-cache entries are exact checkpoints (caches that cannot be trimmed)."""
        return bool(self.trace.header.get("prefix_checkpoints", False))

    def calibration_only(self, tick: int) -> bool:
        """Whether a recorded tick served `Engine.calibrate()`'s requests alone, not the workload's."""
        plan = self.trace.plans.get(tick)
        if plan is None or not self.trace.calibration_ids:
            return False
        scheduled = [c[0] for c in plan.get("prefill", [])] + list(plan.get("decode", []))
        return bool(scheduled) and all(rid in self.trace.calibration_ids for rid in scheduled)

    def simulation_settings(self, kv_layout: Any = None) -> dict[str, Any]:
        """What `simulate` takes from the recording besides arrivals, config and cost (as keyword arguments):
        its stop token, the model's KV layout (`kv_layout` when given, else the recorded one), the prefix-cache
        bytes per token its entries held, whether they are checkpoints, when the cache was cleared, and the
        bytes of each media unit the vision cache stored."""
        per_token = self.prefix_bytes_per_token
        return dict(stop_token_id=self.trace.stop_token_ids[0] if self.trace.stop_token_ids else 0,
                    kv_layout=kv_layout if kv_layout is not None else self.kv_layout(),
                    kv_bytes_per_token=int(round(per_token)) if per_token else None,
                    prefix_checkpoints=self.prefix_checkpoints, prefix_clear_times=list(self.prefix_clear_times),
                    vision_unit_bytes=dict(self.vision_unit_bytes))

    def kv_layout(self) -> Any:
        """The engine's KV layout (`caches.kv.KVLayout`) if the trace recorded one, else None."""
        layers = self.trace.header.get("kv_layout")
        if not layers:
            return None
        from caches.kv import KVLayout

        return KVLayout.from_record(layers)


def load_recorded(source: "Recorded | Trace | str | os.PathLike | Iterable[dict]") -> Recorded:
    if isinstance(source, Recorded):
        return source
    events: list[dict[str, Any]] | None
    if isinstance(source, Trace):
        trace, events = source, None
    elif isinstance(source, (str, os.PathLike)):
        try:
            with open(source, encoding="utf-8") as f:
                events = parse_events(f, os.fspath(source))
        except OSError as exc:
            raise TraceError(f"cannot read trace {os.fspath(source)}: {exc}") from None
        trace = load_trace(events)
    else:
        events = list(source)
        trace = load_trace(events)
    rec = Recorded(trace=trace, events=events, t0=float(trace.header.get("measure", {}).get("t", 0.0)))
    for tick in sorted(trace.arrivals):
        for event in trace.arrivals[tick]:
            rid = event["request_id"]
            if rid in trace.calibration_ids:  # the cost-model fit reads these; metrics and arrivals do not
                rec.calibration_events.append(event)
                continue
            rec.arrival_events.append(event)
            rec.arrival_tick[rid] = tick
            rec.arrival_time[rid] = float(event.get("measure", {}).get("t", rec.t0))
    for tick in sorted(trace.plans):
        for rid in trace.plans[tick].get("admitted", []):
            rec.admitted_tick.setdefault(rid, tick)
    for tick in sorted(trace.outcomes):
        outcome = trace.outcomes[tick]
        errors = outcome.get("errors", {})
        for rid in outcome.get("sampled", {}):
            if rid in errors:  # the executor may sample a row that fails: apply fails it, the token is dropped
                continue
            rec.tokens[rid] = rec.tokens.get(rid, 0) + 1
            rec.first_tick.setdefault(rid, tick)
            rec.last_tick[rid] = tick
        for rid in outcome.get("errors", {}):
            rec.errored.setdefault(rid, tick)
    for tick, ids in trace.aborts.items():
        for rid in ids:
            rec.abort_tick[rid] = tick
    if events is not None:
        stored_tokens = stored_bytes = 0
        for e in events:
            kind = e["event"]
            if e.get("request_id") in trace.calibration_ids:  # the workload's cache figures are the workload's
                continue
            if kind == "prefix_hit":
                rec.prefix_hits += 1
                rec.prefix_tokens_saved += int(e.get("length", 0))
            elif kind == "prefix_miss":
                rec.prefix_misses += 1
            elif kind == "prefix_store":
                stored_tokens += int(e.get("tokens", 0))
                stored_bytes += int(e.get("nbytes", 0))
            elif kind in ("vision_store", "vision_evict"):  # each carries the unit's own size (a unit too large
                rec.vision_unit_bytes[e["key"]] = int(e.get("bytes", 0))  # for the cache has an eviction only)
            if kind != "transition":
                continue
            trigger = e.get("trigger")
            ids = e.get("request_ids") or [e.get("request_id")]
            for rid in ids:
                if trigger == "abort":
                    rec.abort_time[rid] = float(e.get("measure", {}).get("t", rec.t0))
                elif trigger == "finish":
                    rec.finished[rid] = e["tick"]
                elif trigger == "fail":
                    rec.errored.setdefault(rid, e["tick"])
                elif trigger == "preempt":
                    rec.preemptions += 1
        if stored_tokens:
            rec.prefix_bytes_per_token = stored_bytes / stored_tokens
    else:  # a bare Trace: no transition times; use what the outcomes tell
        for rid, tick in rec.abort_tick.items():
            rec.abort_time[rid] = _tick_start(trace, tick)
        for rid, tick in rec.last_tick.items():
            if rid not in rec.abort_tick and rid not in rec.errored:
                rec.finished[rid] = tick
    rec.prefix_clear_times = [_clear_time(rec, tick) for tick in sorted(trace.prefix_clears)]
    return rec


def _clear_time(rec: Recorded, tick: int) -> float:
    """When a recorded `clear_prefix_cache()` happened, as a simulation reads it (relative to t0): it took
    effect at the start of `tick`, after that tick's arrivals were queued, so it is placed at the latest of
    those arrivals (the simulation adds them and clears in the same tick); a tick without arrivals places it
    at the tick's start."""
    joined = [rec.arrival_time[e["request_id"]] for e in rec.trace.arrivals.get(tick, ())
              if e["request_id"] in rec.arrival_time]
    return max(joined, default=_tick_start(rec.trace, tick)) - rec.t0


def _tick_start(trace: Trace, tick: int) -> float:
    """Start time of `tick`: its outcome's tick_start_t, else the end of the last timed tick before it."""
    outcome = trace.outcomes.get(tick)
    if outcome is not None and "tick_start_t" in outcome.get("measure", {}):
        return float(outcome["measure"]["tick_start_t"])
    earlier = [t for t in trace.outcomes if t < tick]
    if earlier:
        return float(trace.outcomes[max(earlier)]["measure"]["t"])
    return float(trace.header.get("measure", {}).get("t", 0.0))


def _tick_end(trace: Trace, tick: int) -> float:
    return float(trace.outcomes[tick]["measure"]["t"])
