"""Decision replay: re-run a recorded trace through the real scheduler, with no model, and stop at the first
plan that differs from the recorded one.

A trace is the engine's event log (JSON lines, schema `events.SCHEMA_VERSION`). Replay takes from it the
engine config and model stop ids (`engine_start`), every arrival with the tick it arrived at, every caller
abort, and every executor outcome (`outcome`: the sampled token and the error per request). `ReplayExecutor`
hands those outcomes back in place of a model, so the scheduler's own bookkeeping (admission, chunking,
finish detection) re-derives every plan, and each is compared with the recorded `plan` event.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Mapping

from caches.kv import KVLayout, LayerLayout

from scheduler.config import EngineConfig
from scheduler.events import SCHEMA_VERSION, EventLog, decision_fields
from scheduler.plan import PrefixStore, TickPlan, TickResult
from scheduler.policy import Policy
from scheduler.request import Request, SamplingParams
from scheduler.scheduler import Scheduler


class TraceError(ValueError):
    """The trace cannot be replayed: unreadable, truncated, from another schema version, or inconsistent."""


@dataclass
class Trace:
    header: dict[str, Any]
    config: EngineConfig
    arrivals: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    aborts: dict[int, list[str]] = field(default_factory=dict)
    plans: dict[int, dict[str, Any]] = field(default_factory=dict)
    outcomes: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def last_tick(self) -> int:
        return max(self.plans, default=-1)

    @property
    def stop_token_ids(self) -> list[int]:
        return self.header.get("stop_token_ids", [])


def _config_from(record: Mapping[str, Any]) -> EngineConfig:
    known = {f.name for f in fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in record.items() if k in known})


def parse_events(lines: Iterable[str], source: str = "trace") -> list[dict[str, Any]]:
    events = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{source}: line {number} is not valid JSON (truncated or edited?): {exc}") from None
        if not isinstance(event, dict) or "event" not in event or "tick" not in event:
            raise TraceError(f"{source}: line {number} is not an event (needs 'event' and 'tick')")
        if event.get("schema") != SCHEMA_VERSION:
            raise TraceError(
                f"{source}: line {number} has schema {event.get('schema')!r}; this mlxsched reads schema "
                f"{SCHEMA_VERSION}"
            )
        events.append(event)
    return events


def load_trace(source: str | os.PathLike | Iterable[dict[str, Any]]) -> Trace:
    if isinstance(source, (str, os.PathLike)):
        try:
            with open(source, encoding="utf-8") as f:
                events = parse_events(f, os.fspath(source))
        except OSError as exc:
            raise TraceError(f"cannot read trace {os.fspath(source)}: {exc}") from None
    else:
        events = list(source)
    if not events or events[0]["event"] != "engine_start":
        raise TraceError("trace does not start with an engine_start event")
    header = events[0]
    trace = Trace(header=header, config=_config_from(header["config"]))
    for event in events[1:]:
        kind, tick = event["event"], event["tick"]
        if kind == "arrival":
            trace.arrivals.setdefault(tick, []).append(event)
        elif kind == "transition" and event.get("trigger") == "abort":
            trace.aborts.setdefault(tick, []).append(event["request_id"])
        elif kind == "plan":
            if tick in trace.plans:
                raise TraceError(f"trace has two plans for tick {tick}")
            trace.plans[tick] = decision_fields(event)
        elif kind == "outcome":
            trace.outcomes[tick] = event
    return trace


def request_from_arrival(event: Mapping[str, Any]) -> Request:
    return Request(
        request_id=event["request_id"],
        prompt_tokens=list(event["prompt_tokens"]),
        sampling=SamplingParams.from_record(event["sampling"]),
        priority=event.get("priority", 0),
        arrival_tick=event["tick"],
        seed=event.get("seed", 0),
        num_images=event.get("num_images", 0),
        media_key=event.get("media_key"),
    )


class ReplayExecutor:
    """Returns the outcomes recorded in a trace instead of running a model."""

    def __init__(self, trace: Trace):
        self.trace = trace

    def execute(self, plan: TickPlan, requests: Mapping[str, Request]) -> TickResult:
        outcome = self.trace.outcomes.get(plan.tick)
        if outcome is None:
            raise TraceError(f"tick {plan.tick}: the trace has a plan with work but no outcome")
        stores = [PrefixStore(rid, n, nbytes, whole_only) for rid, n, nbytes, whole_only in outcome.get("prefix_stores", [])]
        return TickResult(sampled=dict(outcome.get("sampled", {})), errors=dict(outcome.get("errors", {})),
                          prefix_stores=stores, encoded=dict(outcome.get("encoded", {})),
                          accepted_drafts=dict(outcome.get("accepted_drafts", {})),
                          drafts={rid: tuple(d) for rid, d in outcome.get("drafts", {}).items()})

    def release(self, request_ids: Iterable[str]) -> None:
        pass


@dataclass
class Divergence:
    tick: int
    recorded: dict[str, Any] | None
    replayed: dict[str, Any]
    differing_fields: list[str]
    requests: list[dict[str, Any]]
    budgets: dict[str, Any]

    def format(self) -> str:
        lines = [f"first divergence at tick {self.tick}"]
        for name in self.differing_fields:
            rec = None if self.recorded is None else self.recorded.get(name)
            lines.append(f"  {name}:\n    recorded: {rec}\n    replayed: {self.replayed.get(name)}")
        lines.append("  requests involved:")
        for r in self.requests:
            lines.append("    " + ", ".join(f"{k}={v}" for k, v in r.items()))
        lines.append("  budgets: " + ", ".join(f"{k}={v}" for k, v in self.budgets.items()))
        return "\n".join(lines)


@dataclass
class ReplayReport:
    ticks_compared: int
    requests: int
    divergence: Divergence | None

    @property
    def identical(self) -> bool:
        return self.divergence is None

    def format(self) -> str:
        head = f"replayed {self.ticks_compared} ticks, {self.requests} requests: "
        if self.divergence is None:
            return head + "every plan identical to the recording"
        return head + "DIVERGED\n" + self.divergence.format()


def _plan_record(plan: TickPlan) -> dict[str, Any]:
    return {"event": "plan", "tick": plan.tick, "schema": SCHEMA_VERSION, **plan.to_record()}


def replay(trace: Trace, policy: str | Policy | None = None) -> ReplayReport:
    """Re-derive every plan of `trace` with the real scheduler; stop at the first one that differs."""
    layout = trace.header.get("kv_layout")
    kv_layout = KVLayout(tuple(LayerLayout(b, w) for b, w in layout)) if layout else None
    scheduler = Scheduler(trace.config, EventLog(), trace.stop_token_ids, policy, kv_layout)
    executor = ReplayExecutor(trace)
    n_requests = 0
    for tick in range(trace.last_tick + 1):
        for event in trace.arrivals.get(tick, []):
            scheduler.add(request_from_arrival(event), tick)
            n_requests += 1
        for rid in trace.aborts.get(tick, []):
            if rid in scheduler.requests:
                scheduler.abort(rid, tick)
        view = scheduler.view(tick)
        plan = scheduler.plan(view)
        replayed = _plan_record(plan)
        recorded = trace.plans.get(tick)
        if recorded != replayed:
            return ReplayReport(tick, n_requests, _divergence(tick, recorded, replayed, scheduler, trace.config))
        if not plan.is_empty:
            scheduler.apply(plan, executor.execute(plan, scheduler.requests))
    return ReplayReport(trace.last_tick + 1, n_requests, None)


def _divergence(tick: int, recorded: dict | None, replayed: dict, scheduler: Scheduler,
                config: EngineConfig) -> Divergence:
    keys = sorted(set(replayed) | set(recorded or {}))
    differing = [k for k in keys if (recorded or {}).get(k) != replayed.get(k)]
    involved: list[str] = []
    for record in (recorded or {}, replayed):
        involved += record.get("admitted", []) + record.get("decode", [])
        involved += [c[0] for c in record.get("prefill", [])]
    requests = []
    for rid in dict.fromkeys(involved):
        r = scheduler.requests.get(rid)
        if r is None:
            requests.append({"id": rid, "state": "not live in the replay"})
        else:
            requests.append({"id": rid, "state": r.state.value, "prompt_len": r.prompt_len,
                             "computed": r.num_computed_tokens, "outputs": r.num_output_tokens,
                             "max_tokens": r.sampling.max_tokens})
    budgets = {"max_batched_tokens": config.max_batched_tokens, "max_seqs": config.max_seqs,
               "prefill_chunk": config.prefill_chunk}
    return Divergence(tick, recorded, replayed, differing, requests, budgets)
