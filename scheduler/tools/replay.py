"""Decision replay: re-run a recorded trace through the real scheduler, with no model, and stop at the first
tick whose decisions differ from the recorded ones.

A trace is the engine's event log (JSON lines, schema `events.SCHEMA_VERSION`). Replay takes from it the
engine config, the policy with its parameters and the model stop ids (`engine_start`), every arrival with the
tick it arrived at (in traces of engines that accepted unreadable media, an arrival failed at once carries its
error), every caller abort, and every executor outcome (`outcome`: the sampled token, logprobs and top_logprobs, errors,
prefix stores, drafts per request). `ReplayExecutor` hands those outcomes back in place of a model and keeps a model of the
batch's rows, so the scheduler's own bookkeeping (admission, chunking, finish detection, prefix-cache hits,
stores and evictions) and the KV merges, filters and rollbacks it implies are re-derived. The vision cache
lives below the scheduler, with the model: its contents are followed from the recorded `vision_store` /
`vision_evict` events, since the vision budget pays only for what it does not hold. Each tick's plan is
compared with the recorded `plan` event, then the tick's decision events (`COMPARED_KINDS`) with the
recorded ones.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Mapping

from caches.kv import KVLayout, QuantizeRule

from scheduler.calibration import CALIBRATION_EVENT
from scheduler.config import EngineConfig
from scheduler.loop import TickLoop
from scheduler.events import SCHEMA_VERSION, EventLog, MemorySink, _jsonable, decision_fields
from scheduler.plan import (DECODE_FAILED, PLAN_RECORD_GROUPS, PREFILL_FAILED, VISION_BUDGET_COUNTS, PrefixStore,
                            TickPlan, TickResult)
from scheduler.policy import Policy, make_policy
from scheduler.request import Request, SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.tools.workload import media_items, media_marks


class TraceError(ValueError):
    """The trace cannot be replayed: unreadable, truncated, from another schema version, or inconsistent."""


@dataclass
class Trace:
    header: dict[str, Any]
    config: EngineConfig
    arrivals: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    aborts: dict[int, list[str]] = field(default_factory=dict)
    prefix_clears: set[int] = field(default_factory=set)  # ticks that started with Engine.clear_prefix_cache()
    plans: dict[int, dict[str, Any]] = field(default_factory=dict)
    outcomes: dict[int, dict[str, Any]] = field(default_factory=dict)
    decisions: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # COMPARED_KINDS, per tick
    # requests of Engine.calibrate() (scheduler/calibration.py): replayed like any others, left out of the
    # recorded metrics and of a simulation's arrivals
    calibration_ids: set[str] = field(default_factory=set)
    # the vision cache's stores and evictions ("store" / "evict", key), in order, by the tick of the first plan
    # after them: what the cache holds when that tick is planned
    vision_changes: dict[int, list[tuple[str, str]]] = field(default_factory=dict)

    @property
    def policy_record(self) -> dict[str, Any]:
        return self.header.get("policy") or {"name": self.config.policy}

    @property
    def last_tick(self) -> int:
        return max(self.plans, default=-1)

    @property
    def stop_token_ids(self) -> list[int]:
        return self.header.get("stop_token_ids", [])

    @property
    def quantize_rule(self) -> QuantizeRule | None:
        """kv_bits: the rule every request's conversion point follows (`engine_start.kv_quantize`); None when
        the engine did not quantize, or predates the record (its conversions are then not compared)."""
        record = self.header.get("kv_quantize")
        return QuantizeRule(**record) if record else None


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
    vision_changes: list[tuple[str, str]] = []  # since the last plan
    for event in events[1:]:
        kind, tick = event["event"], event["tick"]
        if kind in ("vision_store", "vision_evict"):
            vision_changes.append((kind.removeprefix("vision_"), event["key"]))
        if kind == "arrival":
            trace.arrivals.setdefault(tick, []).append(event)
        elif kind == "transition" and event.get("trigger") == "abort":
            trace.aborts.setdefault(tick, []).append(event["request_id"])
        elif kind == "prefix_clear":
            trace.prefix_clears.add(tick)
        elif kind == "plan":
            if tick in trace.plans:
                raise TraceError(f"trace has two plans for tick {tick}")
            trace.plans[tick] = decision_fields(event)
            if vision_changes:
                trace.vision_changes[tick], vision_changes = vision_changes, []
        elif kind == "outcome":
            trace.outcomes[tick] = event
        elif kind == CALIBRATION_EVENT:
            trace.calibration_ids.update(event["request_ids"])
        if kind in COMPARED_KINDS:
            trace.decisions.setdefault(tick, []).append(_comparable(event))
    return trace


# Decision events compared tick by tick besides the plan: transitions, prefix-cache and KV-batch decisions, and
# kv_bits conversions (`kv_quantize`: compared as the tick's set of (request, tokens), whatever their order,
# which follows how the executor grouped its prefill forwards).
COMPARED_KINDS = frozenset({"transition", "prefix_hit", "prefix_miss", "prefix_store", "prefix_evict",
                            "prefix_clear", "kv_merge", "kv_filter", "kv_rollback", "kv_quantize"})


def _tick_decisions(events: list[dict[str, Any]], conversions: bool, failed: set[str]) -> list[dict[str, Any]]:
    """A tick's decision events as replay compares them: in their order, but the tick's `kv_quantize` events
    as one entry after them, `conversions` sorted [request_id, tokens] (tokens: the context length it
    converted at inside a prefill, None at a merge or after a decode); none when `conversions` is off. The
    requests whose prefill failed this tick are left out of it (whether one converted before its forward
    raised is not in the trace)."""
    ordered = [e for e in events if e["event"] != "kv_quantize"]
    if not conversions:
        return ordered
    converted = sorted(([rid, e.get("tokens")] for e in events if e["event"] == "kv_quantize"
                        for rid in e["request_ids"] if rid not in failed),
                       key=lambda c: (c[0], -1 if c[1] is None else c[1]))
    return ordered + ([{"event": "kv_quantize", "conversions": converted}] if converted else [])


def _comparable(event: Mapping[str, Any]) -> dict[str, Any]:
    """Decision fields as JSON would give them back (tuples are lists, keys strings), whatever the source."""
    return json.loads(json.dumps(decision_fields(event), default=_jsonable))


def request_from_arrival(event: Mapping[str, Any]) -> Request:
    return Request(
        request_id=event["request_id"],
        prompt_tokens=list(event["prompt_tokens"]),
        sampling=SamplingParams.from_record(event["sampling"]),
        priority=event.get("priority", 0),
        arrival_tick=event["tick"],
        seed=event.get("seed", 0),
        num_images=event.get("num_images", 0),
        num_media_tokens=event.get("num_media_tokens", 0),  # (traces from before the token budget: 0)
        media_key=event.get("media_key"),
        media_marks=media_marks(event),
        media_items=media_items(event),
        first_chunk_reach=event.get("first_chunk_reach", 0),
        lora=event.get("lora"),
        cache_salt=event.get("cache_salt"),
        draft_eligible=event.get("draft_eligible"),
    )


class ReplayExecutor:
    """Returns the outcomes recorded in a trace instead of running a model, and carries out the KV-batch
    decisions they imply on a model of the batch (its rows, in order), emitting the same `kv_merge`,
    `kv_filter` and `kv_rollback` events `MLXExecutor` does, and under kv_bits the `kv_quantize` conversions
    its QuantizeRule implies (`_Conversions`), so replay compares them with the recorded ones."""

    def __init__(self, trace: Trace, events: EventLog | None = None):
        self.trace = trace
        self.events = events or EventLog()
        self.rows: list[str] = []  # request ids in batch row order
        self.tick = 0
        rule = trace.quantize_rule
        self.conversions = _Conversions(rule, self.events) if rule is not None else None

    def execute(self, plan: TickPlan) -> TickResult:
        self.tick = plan.tick
        outcome = self.trace.outcomes.get(plan.tick)
        if outcome is None:
            raise TraceError(f"tick {plan.tick}: the trace has a plan with work but no outcome")
        dropped = list(plan.preempted) + [rid for rid, _ in plan.failed]
        if dropped:
            self.release(dropped)
        errors = dict(outcome.get("errors", {}))
        drafts = {rid: tuple(d) for rid, d in outcome.get("drafts", {}).items()}
        joining = [c.request_id for c in plan.prefill
                   if c.completes and not errors.get(c.request_id, "").startswith(PREFILL_FAILED)]
        conversions = self.conversions
        if conversions is not None:
            conversions.prefill(plan, errors)
            conversions.join(plan.tick, joining)
        if joining:
            self.rows += joining
            self.events.emit("kv_merge", plan.tick, request_ids=joining)
        decode_failed = any(e.startswith(DECODE_FAILED) for e in errors.values())
        if conversions is not None and self.rows and (plan.decode or joining) and not decode_failed:
            conversions.after_decode(plan.tick)
        width = max((proposed for proposed, _ in drafts.values()), default=0)
        if width:  # every row is rolled back to what it accepted (rows without drafts were padded)
            self.events.emit("kv_rollback", plan.tick, rows=[
                [rid, width - drafts[rid][1] if rid in drafts else width] for rid in self.rows])
        if self.rows and decode_failed:
            self.events.emit("kv_filter", plan.tick, request_ids=list(self.rows))  # the whole batch is dropped
            if conversions is not None:
                conversions.release(self.rows)
            self.rows = []
        stores = [PrefixStore(rid, n, nbytes, whole_only) for rid, n, nbytes, whole_only in outcome.get("prefix_stores", [])]
        top = {rid: [tuple(pair) for pair in pairs] for rid, pairs in outcome.get("top_logprobs", {}).items()}
        return TickResult(sampled=dict(outcome.get("sampled", {})), logprobs=dict(outcome.get("logprobs", {})),
                          top_logprobs=top, errors=errors, prefix_stores=stores, encoded=dict(outcome.get("encoded", {})),
                          accepted_drafts=dict(outcome.get("accepted_drafts", {})), drafts=drafts)

    def release(self, request_ids: Iterable[str]) -> None:
        gone = set(request_ids)
        if self.conversions is not None:
            self.conversions.release(gone)
        removed = [rid for rid in self.rows if rid in gone]
        if removed:
            self.events.emit("kv_filter", self.tick, request_ids=removed)
            self.rows = [rid for rid in self.rows if rid not in gone]


class _Conversions:
    """Under kv_bits, when each request's cache converts, as `MLXExecutor` converts it (ARCHITECTURE.md,
    "Quantized KV"): at its `QuantizeRule.point` inside a prefill (the forward is split there), at a prefix
    restore that lands at or past it, at the merge when the point is the prompt's end, or, for a row that
    joined below its point, after the decode that brings it there. Emits the same `kv_quantize` events."""

    def __init__(self, rule: QuantizeRule, events: EventLog):
        self.rule = rule
        self.events = events
        self.requests: dict[str, Request] = {}  # the executor's copies (TickPlan.new_requests)
        self.converted: set[str] = set()  # requests whose own (prefilling) cache is quantized
        self.float_rows: dict[str, int] = {}  # rows decoding in float storage -> tokens their cache holds

    def prefill(self, plan: TickPlan, errors: Mapping[str, str]) -> None:
        for new in plan.new_requests:
            self.requests[new.request_id] = Request.from_new_request(new)
        for rid, _entry_id, length in plan.prefix_hits:  # a restored cache is a float one (ARCHITECTURE.md)
            self.converted.discard(rid)
            request = self.requests[rid]
            if self.rule.point(request.prompt_len) <= length < request.prefill_len - 1:
                self._convert(plan.tick, rid, length)
        for chunk in plan.prefill:
            rid = chunk.request_id
            if errors.get(rid, "").startswith(PREFILL_FAILED):
                self.converted.discard(rid)  # its cache is dropped (and its conversions are not compared)
                continue
            request = self.requests[rid]
            point, fed_to = self.rule.point(request.prompt_len), chunk.end - 1 if chunk.completes else chunk.end
            if rid not in self.converted and chunk.start < point <= fed_to and point < request.prefill_len - 1:
                self._convert(plan.tick, rid, point)

    def join(self, tick: int, joining: list[str]) -> None:
        converted = []
        for rid in joining:
            request = self.requests[rid]
            if request.prefill_len - 1 >= self.rule.point(request.prompt_len):
                if rid not in self.converted:
                    converted.append(rid)
            else:
                self.float_rows[rid] = request.prefill_len - 1
            self.converted.discard(rid)  # its cache is a batch row now
        if converted:
            self.events.emit("kv_quantize", tick, request_ids=converted)

    def after_decode(self, tick: int) -> None:
        moved = []
        for rid in list(self.float_rows):
            self.float_rows[rid] += 1
            if self.float_rows[rid] >= self.rule.point(self.requests[rid].prompt_len):
                moved.append(rid)
                del self.float_rows[rid]
        if moved:
            self.events.emit("kv_quantize", tick, request_ids=moved)

    def release(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self.converted.discard(rid)
            self.float_rows.pop(rid, None)
            self.requests.pop(rid, None)

    def _convert(self, tick: int, rid: str, tokens: int) -> None:
        self.converted.add(rid)
        self.events.emit("kv_quantize", tick, request_ids=[rid], tokens=tokens)


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


def _plan_record(record: dict[str, Any], tick: int, unrecorded: tuple[str, ...]) -> dict[str, Any]:
    """The replayed plan as the trace writes it, less the key groups this trace predates."""
    out = {"event": "plan", "tick": tick, "schema": SCHEMA_VERSION, **record}
    for key in unrecorded:
        out.pop(key, None)
    return out


def _unrecorded_keys(trace: Trace) -> tuple[str, ...]:
    """Plan-record keys of the groups the trace's engine did not write (`engine_start.plan_records`)."""
    recorded = set(trace.header.get("plan_records", ()))
    return tuple(key for group, keys in PLAN_RECORD_GROUPS.items() if group not in recorded for key in keys)


def replay(trace: Trace, policy: str | Policy | None = None) -> ReplayReport:
    """Re-derive every plan and decision event of `trace` with the real scheduler; stop at the first tick
    that differs. `policy`: replay under another policy (a name or an object); by default the recorded one
    with its recorded parameters. A trace recorded with a custom policy needs that object passed here
    (`PolicyUnavailable` otherwise)."""
    layout = trace.header.get("kv_layout")
    kv_layout = KVLayout.from_record(layout) if layout else None
    if policy is None:
        policy = make_policy(trace.policy_record)  # PolicyUnavailable: a custom policy that was not passed
    sink = MemorySink()
    events = EventLog([sink])
    vision_cache: set[str] = set()  # the keys the recorded engine's vision cache holds (`Trace.vision_changes`)
    scheduler = Scheduler(trace.config, events, trace.stop_token_ids, policy, kv_layout,
                          max_model_len=trace.header.get("max_model_len"), record_plans=True,
                          record_row_reasons="row_reasons" in trace.header.get("plan_records", ()),
                          vision_cached=vision_cache.__contains__,
                          count_cached_media=trace.header.get("vision_budget_counts") != VISION_BUDGET_COUNTS)
    unrecorded = _unrecorded_keys(trace)
    executor = ReplayExecutor(trace, events)
    loop = TickLoop(scheduler, executor)
    n_requests = 0
    records_reuse = _records_reuse(trace)
    conversions = trace.quantize_rule is not None
    for tick in range(trace.last_tick + 1):
        executor.tick = tick
        ended = []
        for event in trace.arrivals.get(tick, []):
            scheduler.add(request_from_arrival(event), tick)
            if event.get("error") is not None:
                # written by engines before UnreadableMedia, which accepted a request whose media could not be
                # read and failed it on arrival; such a trace replays that failure
                scheduler.fail(event["request_id"], tick, event["error"])
                ended.append(event["request_id"])
            n_requests += 1
        for rid in dict.fromkeys(trace.aborts.get(tick, [])):
            if rid in scheduler.requests:
                scheduler.abort(rid, tick)
                ended.append(rid)
        loop.release(ended)
        if tick in trace.prefix_clears:
            scheduler.clear_prefix_cache(tick)
        for change, key in trace.vision_changes.get(tick, ()):
            (vision_cache.add if change == "store" else vision_cache.discard)(key)
        plan = loop.plan(tick)
        replayed = _plan_record(scheduler.last_plan_record, tick, unrecorded)
        recorded = trace.plans.get(tick)
        if recorded != replayed:
            return ReplayReport(tick, n_requests, _divergence(tick, recorded, replayed, scheduler, trace.config))
        loop.carry_out(plan)
        replayed_decisions = [_comparable(e) for e in sink.events if e["event"] in COMPARED_KINDS]
        if not records_reuse:
            replayed_decisions = [_without_reuse(e) for e in replayed_decisions]
        sink.events.clear()
        failed = {rid for rid, error in trace.outcomes.get(tick, {}).get("errors", {}).items()
                  if error.startswith(PREFILL_FAILED)}
        replayed_decisions = _tick_decisions(replayed_decisions, conversions, failed)
        recorded_decisions = _tick_decisions(trace.decisions.get(tick, []), conversions, failed)
        if replayed_decisions != recorded_decisions:
            return ReplayReport(tick, n_requests, _event_divergence(tick, recorded_decisions, replayed_decisions,
                                                                    scheduler, trace.config))
    return ReplayReport(trace.last_tick + 1, n_requests, None)


def _records_reuse(trace: Trace) -> bool:
    """Whether the trace's engine wrote `prefix_hit.reuse` (whole / trimmed / checkpoint); traces from before
    it have prefix hits without it, and replay then leaves it out of what it compares."""
    hits = [e for events in trace.decisions.values() for e in events if e.get("event") == "prefix_hit"]
    return not hits or any("reuse" in e for e in hits)


def _without_reuse(event: dict[str, Any]) -> dict[str, Any]:
    if event.get("event") != "prefix_hit":
        return event
    return {k: v for k, v in event.items() if k != "reuse"}


def _by_kind(events: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        out[e["event"]].append({k: v for k, v in e.items() if k not in ("event", "tick", "schema")})
    return dict(out)


def _event_divergence(tick: int, recorded: list[dict], replayed: list[dict], scheduler: Scheduler,
                      config: EngineConfig) -> Divergence:
    rec, rep = _by_kind(recorded), _by_kind(replayed)
    differing = sorted(k for k in set(rec) | set(rep) if rec.get(k) != rep.get(k))
    if not differing:  # same events per kind, in another order
        differing, rec, rep = ["order of events"], {"order of events": recorded}, {"order of events": replayed}
    involved = []
    for e in recorded + replayed:
        if e.get("event") in differing or differing == ["order of events"]:
            involved += [e["request_id"]] if e.get("request_id") else []
            involved += e.get("request_ids", []) + [r[0] for r in e.get("rows", []) + e.get("conversions", [])]
    return Divergence(tick, {k: rec.get(k) for k in differing}, {k: rep.get(k) for k in differing}, differing,
                      _involved(dict.fromkeys(involved), scheduler), _budgets(config))


def _divergence(tick: int, recorded: dict | None, replayed: dict, scheduler: Scheduler,
                config: EngineConfig) -> Divergence:
    keys = sorted(set(replayed) | set(recorded or {}))
    differing = [k for k in keys if (recorded or {}).get(k) != replayed.get(k)]
    involved: list[str] = []
    for record in (recorded or {}, replayed):
        involved += record.get("admitted", []) + record.get("decode", [])
        involved += [c[0] for c in record.get("prefill", [])]
    return Divergence(tick, recorded, replayed, differing, _involved(dict.fromkeys(involved), scheduler),
                      _budgets(config))


def _involved(request_ids: Iterable[str], scheduler: Scheduler) -> list[dict[str, Any]]:
    requests = []
    for rid in request_ids:
        r = scheduler.requests.get(rid)
        if r is None:
            requests.append({"id": rid, "state": "not live in the replay"})
        else:
            requests.append({"id": rid, "state": r.state.value, "prompt_len": r.prompt_len,
                             "computed": r.num_computed_tokens, "outputs": r.num_output_tokens,
                             "max_tokens": r.sampling.max_tokens})
    return requests


def _budgets(config: EngineConfig) -> dict[str, Any]:
    return {"max_batched_tokens": config.max_batched_tokens, "max_seqs": config.max_seqs,
            "prefill_chunk": config.prefill_chunk}
