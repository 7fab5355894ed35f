"""Prometheus metrics fed from the engine's event stream, and the per-request ledger the server reads.

`EngineMetrics` is an event sink (`Engine.events.add_sink`): it is called on the engine's loop thread with
every event dict (arrival, transition, plan, outcome, prefix_*/vision_* cache events) and turns them into
counters, gauges and histograms. Latencies come from the events' own `measure` timestamps, so they are the
engine's view of a request (arrival in `add_request` to first token / end), not the HTTP round trip.

What events do not carry (bytes held by caches right now) is read by `engine_snapshot`, which the server runs
on the loop thread between two ticks at scrape time (`AsyncEngine.call`), where those structures are
consistent.

The ledger also answers the server's own questions from the same stream: how many requests are waiting
(`--max-queue`), and each request's prompt length for `usage`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

STATES = ("queued", "vision_encoding", "chunk_prefilling", "decoding", "drafting")
_SUBMITTED = "submitted"  # accepted by the server, not yet drained into the engine's loop: waiting too
_ENDED_MEMORY = 65536

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TICK_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class RequestRecord:
    prompt_tokens: int = 0
    # prompt tokens its first prefill reused from the prefix cache (its first lookup's: a preempted request's
    # recompute looks up again, and usage reports what the client's prompt found on arrival, as vLLM does)
    cached_tokens: int = 0
    looked_up: bool = False
    arrival_t: float | None = None
    first_token_t: float | None = None
    generated: int = 0
    state: str = _SUBMITTED
    claimed: bool = False  # the server has read it: not kept once it ends
    lora: str | None = None  # the LoRA adapter it runs on


class EngineMetrics:
    """An event sink. Thread-safe: written on the loop thread, read by request handlers and scrapes."""

    def __init__(self, registry: CollectorRegistry | None = None, prefix: str = "mlxsched"):
        self.registry = registry if registry is not None else CollectorRegistry()
        r, p = self.registry, prefix
        self._lock = threading.Lock()
        self._live: dict[str, RequestRecord] = {}
        self._ended: OrderedDict[str, RequestRecord] = OrderedDict()
        self._counts = dict.fromkeys(STATES + (_SUBMITTED,), 0)

        self.requests = Gauge(f"{p}_requests", "Live requests by lifecycle state", ["state"], registry=r)
        self.queue_length = Gauge(f"{p}_queue_length", "Requests waiting for admission (queued, or accepted by "
                                  "the server and not yet in the engine loop)", registry=r)
        self.running_rows = Gauge(f"{p}_running_rows", "Rows in the decode batch (decoding + drafting)", registry=r)
        self.requests_ended = Counter(f"{p}_requests_ended", "Requests ended, by finish reason (stop, length, "
                                      "abort, error)", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter(f"{p}_prompt_tokens", "Prompt tokens of arrived requests", registry=r)
        self.prefill_tokens = Counter(f"{p}_prefill_tokens", "Prompt tokens computed (prefix-cache hits excluded, "
                                      "recomputation after preemption included)", registry=r)
        self.generation_tokens = Counter(f"{p}_generation_tokens", "Tokens generated", registry=r)
        self.preemptions = Counter(f"{p}_preemptions", "Requests preempted by the KV budget", registry=r)
        self.prefix_hits = Counter(f"{p}_prefix_cache_hits", "Prefix-cache lookups that reused KV", registry=r)
        self.prefix_misses = Counter(f"{p}_prefix_cache_misses", "Prefix-cache lookups that found nothing", registry=r)
        self.prefix_hit_tokens = Counter(f"{p}_prefix_cache_hit_tokens", "Prompt tokens served from the prefix "
                                         "cache", registry=r)
        self.lora_requests = Counter(f"{p}_lora_requests", "Requests arrived on a LoRA adapter, by adapter",
                                     ["adapter"], registry=r)
        self.lora_live = Gauge(f"{p}_lora_live_requests", "Live requests on a LoRA adapter, by adapter", ["adapter"],
                               registry=r)
        self.vision_hits = Counter(f"{p}_vision_cache_hits", "Vision-encoder outputs reused", registry=r)
        self.vision_misses = Counter(f"{p}_vision_cache_misses", "Vision-encoder outputs computed", registry=r)
        self.ttft = Histogram(f"{p}_time_to_first_token_seconds", "Arrival to first token", buckets=TTFT_BUCKETS,
                              registry=r)
        self.tpot = Histogram(f"{p}_time_per_output_token_seconds", "Mean time between output tokens of a "
                              "finished request", buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(f"{p}_e2e_request_latency_seconds", "Arrival to finish (finished requests)",
                             buckets=E2E_BUCKETS, registry=r)
        self.queue_time = Histogram(f"{p}_queue_time_seconds", "Arrival to admission", buckets=E2E_BUCKETS,
                                    registry=r)
        self.tick_duration = Histogram(f"{p}_tick_duration_seconds", "Wall time of one engine tick",
                                       buckets=TICK_BUCKETS, registry=r)
        # sampled at scrape time (engine_snapshot)
        self.kv_bytes = Gauge(f"{p}_kv_cache_bytes", "Bytes of KV caches held for live requests", registry=r)
        self.kv_budget = Gauge(f"{p}_kv_cache_budget_bytes", "kv_memory_bytes (0: no budget)", registry=r)
        self.kv_request_caches = Gauge(f"{p}_kv_request_caches", "Per-request KV caches held (prefilling rows)",
                                       registry=r)
        self.executor_requests = Gauge(f"{p}_executor_requests", "Requests the executor holds any state for "
                                       "(KV rows, per-request caches, encoded media)", registry=r)
        self.prefix_bytes = Gauge(f"{p}_prefix_cache_bytes", "Bytes held by the prefix cache", registry=r)
        self.prefix_entries = Gauge(f"{p}_prefix_cache_entries", "Entries in the prefix cache", registry=r)
        self.prefix_hit_rate = Gauge(f"{p}_prefix_cache_hit_rate", "Prefix-cache hits / lookups (the cache's own "
                                     "counters)", registry=r)
        self.vision_bytes = Gauge(f"{p}_vision_cache_bytes", "Bytes held by the vision cache", registry=r)
        self.vision_entries = Gauge(f"{p}_vision_cache_entries", "Entries in the vision cache", registry=r)
        self.vision_hit_rate = Gauge(f"{p}_vision_cache_hit_rate", "Vision-cache hits / lookups (the cache's own "
                                     "counters)", registry=r)
        # the server's own view: HTTP answers, and how each choice ended (a stop string ends it as "stop",
        # where the engine sees an abort)
        self.http_requests = Counter(f"{p}_http_requests", "HTTP requests answered, by endpoint and status",
                                     ["endpoint", "status"], registry=r)
        self.choices = Counter(f"{p}_choices", "Completion choices answered, by finish reason", ["finish_reason"],
                               registry=r)
        self._publish_counts()

    # ---- the server's side ---------------------------------------------------------------------
    def reserve(self, request_ids: list[str], max_queue: int | None) -> bool:
        """Count these requests as waiting, unless that would put more than `max_queue` in the queue."""
        with self._lock:
            if max_queue is not None and self._waiting() + len(request_ids) > max_queue:
                return False
            for rid in request_ids:
                self._live[rid] = RequestRecord()
                self._counts[_SUBMITTED] += 1
            self._publish_counts()
            return True

    def forget(self, request_id: str) -> None:
        """A reserved request the engine refused (it never arrives)."""
        with self._lock:
            record = self._live.pop(request_id, None)
            if record is not None:
                self._counts[record.state] -= 1
                self._publish_counts()

    def claim(self, request_id: str) -> RequestRecord | None:
        """The record of a request (live or ended); an ended one is handed over once."""
        with self._lock:
            record = self._ended.pop(request_id, None) or self._live.get(request_id)
            if record is not None:
                record.claimed = True
            return record

    def waiting(self) -> int:
        with self._lock:
            return self._waiting()

    def _waiting(self) -> int:
        return self._counts["queued"] + self._counts[_SUBMITTED]

    def _publish_counts(self) -> None:
        for state in STATES:
            self.requests.labels(state).set(self._counts[state] + (self._counts[_SUBMITTED] if state == "queued" else 0))
        self.queue_length.set(self._waiting())
        self.running_rows.set(self._counts["decoding"] + self._counts["drafting"])

    # ---- the event sink --------------------------------------------------------------------------
    def write(self, event: dict[str, Any]) -> None:
        handler = self._handlers.get(event["event"])
        if handler is not None:
            handler(self, event)

    def close(self) -> None:
        pass

    def _arrival(self, event: dict[str, Any]) -> None:
        rid, n = event["request_id"], len(event["prompt_tokens"])
        with self._lock:
            record = self._live.get(rid)
            if record is None:  # not submitted through the server (a direct add_request)
                record = self._live[rid] = RequestRecord()
                self._counts[_SUBMITTED] += 1
            record.prompt_tokens, record.arrival_t = n, event["measure"]["t"]
            record.lora = event.get("lora")
            self._move(record, "queued")
        self.prompt_tokens.inc(n)
        if record.lora is not None:
            self.lora_requests.labels(record.lora).inc()
            self.lora_live.labels(record.lora).inc()

    def _move(self, record: RequestRecord, state: str) -> None:
        self._counts[record.state] -= 1
        record.state = state
        if state in self._counts:
            self._counts[state] += 1
        self._publish_counts()

    def _transition(self, event: dict[str, Any]) -> None:
        rid, dest, trigger, t = event["request_id"], event["to"], event["trigger"], event["measure"]["t"]
        with self._lock:
            record = self._live.get(rid)
            if record is None:
                return
            if event["from"] == "queued" and dest not in ("finished", "aborted") and record.arrival_t is not None:
                self.queue_time.observe(max(0.0, t - record.arrival_t))
            if dest in ("finished", "aborted"):
                self._counts[record.state] -= 1
                record.state = dest
                del self._live[rid]
                if record.lora is not None:
                    self.lora_live.labels(record.lora).dec()
                if not record.claimed:
                    self._ended[rid] = record
                while len(self._ended) > _ENDED_MEMORY:
                    self._ended.popitem(last=False)
                self._publish_counts()
            else:
                self._move(record, dest)
        if trigger == "preempt":
            self.preemptions.inc()
        if dest == "finished":
            self.requests_ended.labels(event["reason"]).inc()
            if record.arrival_t is not None:
                self.e2e.observe(max(0.0, t - record.arrival_t))
            if record.first_token_t is not None and record.generated > 1:
                self.tpot.observe(max(0.0, (t - record.first_token_t) / (record.generated - 1)))
        elif dest == "aborted":
            self.requests_ended.labels("error" if trigger == "fail" else "abort").inc()

    def _plan(self, event: dict[str, Any]) -> None:
        computed = sum(end - start for _, start, end, _ in event["prefill"])
        if computed:
            self.prefill_tokens.inc(computed)

    def _outcome(self, event: dict[str, Any]) -> None:
        t = event["measure"]["t"]
        counts: dict[str, int] = {rid: 1 for rid in event["sampled"]}
        for rid, drafts in event.get("accepted_drafts", {}).items():
            counts[rid] = counts.get(rid, 0) + len(drafts)
        with self._lock:
            for rid, n in counts.items():
                record = self._live.get(rid) or self._ended.get(rid)
                if record is None:
                    continue
                if record.first_token_t is None:
                    record.first_token_t = t
                    if record.arrival_t is not None:
                        self.ttft.observe(max(0.0, t - record.arrival_t))
                record.generated += n
        total = sum(counts.values())
        if total:
            self.generation_tokens.inc(total)
        tick_s = event["measure"].get("tick_s")
        if tick_s is not None:
            self.tick_duration.observe(tick_s)

    def _prefix_hit(self, event: dict[str, Any]) -> None:
        self.prefix_hits.inc()
        self.prefix_hit_tokens.inc(event.get("length", 0))
        self._first_lookup(event["request_id"], event.get("length", 0))

    def _prefix_miss(self, event: dict[str, Any]) -> None:
        self.prefix_misses.inc()
        self._first_lookup(event["request_id"], 0)

    def _first_lookup(self, request_id: str, cached: int) -> None:
        with self._lock:
            record = self._live.get(request_id)
            if record is not None and not record.looked_up:
                record.cached_tokens, record.looked_up = cached, True

    _handlers = {
        "arrival": _arrival,
        "transition": _transition,
        "plan": _plan,
        "outcome": _outcome,
        "prefix_hit": _prefix_hit,
        "prefix_miss": _prefix_miss,
        "vision_hit": lambda self, _e: self.vision_hits.inc(),
        "vision_miss": lambda self, _e: self.vision_misses.inc(),
    }

    # ---- scrape-time state ------------------------------------------------------------------------
    def set_snapshot(self, snap: dict[str, Any]) -> None:
        self.kv_bytes.set(snap["kv_bytes"])
        self.kv_budget.set(snap["kv_budget_bytes"] or 0)
        self.kv_request_caches.set(snap["kv_request_caches"])
        self.executor_requests.set(snap["executor_requests"])
        prefix, vision = snap["prefix_cache"] or {}, snap["vision_cache"] or {}
        self.prefix_bytes.set(round(prefix.get("current_memory_mb", 0.0) * (1 << 20)))
        self.prefix_entries.set(prefix.get("entry_count", 0))
        self.prefix_hit_rate.set(prefix.get("hit_rate", 0.0))
        self.vision_bytes.set(vision.get("bytes", 0))
        self.vision_entries.set(vision.get("entries", 0))
        self.vision_hit_rate.set(vision.get("hit_rate", 0.0))

def engine_snapshot(engine: Any) -> dict[str, Any]:
    """Cache sizes right now. Run it on the loop thread between ticks (AsyncEngine.call)."""
    kv = engine.kv_cache_stats()
    return {
        "kv_bytes": kv["bytes"],
        "kv_budget_bytes": kv["budget_bytes"],
        "kv_request_caches": kv["request_caches"],
        "executor_requests": len(engine.executor.live_request_ids()),
        "prefix_cache": engine.prefix_cache_stats(),
        "vision_cache": engine.vision_cache_stats(),
    }
