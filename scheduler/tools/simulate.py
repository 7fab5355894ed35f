"""Model-free what-if simulation: the real `Scheduler` driven in virtual time by a fitted per-tick cost model.

    trace ──fit_cost_model──▶ CostModel ─┐
    trace ──arrivals_from_trace──────────┼─▶ simulate(arrivals, config, cost, policy) ─▶ SimResult.summary()
    synthetic_workload(...) ─────────────┘
    trace ──recorded_metrics──────────────────────────────────────────────────────────▶ same keys

`simulate` runs the same planner and `apply` the engine runs (so admission, chunking and finish detection
are the real ones); only the executor is replaced: `SimExecutor` advances a virtual clock by the cost model
and returns an ordinary token until a request has produced its `output_len`, then a stop token. No model is
loaded and no MLX op runs. The scheduler's own features come along: a policy by name, the prefix cache
(`prefix_cache_bytes`: the sim executor offers prompts at prefill end as the real one does, so hits, the
hit rate and the shorter prefills are real decisions) and, given the model's KV layout, the KV budget with
its preemptions.

Time conventions (shared by the recorded and the simulated metrics so the two compare):
  arrival      the request's add time (recorded: arrival `measure.t`)
  admitted     start of the tick whose plan admitted it (recorded: that tick's `outcome.measure.tick_start_t`)
  first/last   end of the tick that sampled its first/last token (recorded: that tick's `outcome.measure.t`)
  makespan     last token time - first arrival time; throughput = output tokens / makespan.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from scheduler.config import EngineConfig
from scheduler.events import EventLog
from scheduler.plan import TickPlan, TickResult
from scheduler.policy import Policy
from scheduler.tools.replay import Trace, TraceError, load_trace, parse_events
from scheduler.request import Request, SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.tools.workload import FIRST_ORDINARY_ID, SimArrival, arrivals_from_trace

# ---- cost model ------------------------------------------------------------------------------------------

#: Per-tick features (see `tick_features`). The executor feeds a completing chunk's last prompt token in the
#: batched decode forward, so "prefill tokens" excludes it and "decode rows" includes it; a completing chunk
#: also merges that request's cache into the batch cache (`per_prefill_done`).
#: Vision-language work: `per_image_encoded` is each media item encoded this tick that missed the vision
#: cache (its encoder forward), `per_media_prefill_token` the extra cost of a prefill token of a media
#: request (embedding inputs, M-RoPE positions) over a text one.
FEATURES = ("base", "per_prefill_token", "per_decode_row", "per_prefill_chunk", "per_decode_forward",
            "per_prefill_done", "per_image_encoded", "per_media_prefill_token")


@dataclass
class CostModel:
    """Seconds per tick = (base + per_prefill_token * prefill tokens + per_decode_row * decode rows
    + per_prefill_chunk * chunks + per_decode_forward * [any decode row] + per_prefill_done * completed
    prefills) * slowdown + overhead.

    `slowdown` scales the terms so that they also account for the time the fit's outlier ticks took (pauses,
    contention; see `fit_cost_model`). `overhead` is the engine/client time between two busy ticks (outside
    `tick_s`), added to every simulated tick. `r2`, `mean_rel_error` (the model as used, slowdown included),
    `typical_rel_error` (median over ticks of the terms alone: how well the shape fits), `n_ticks` and
    `dropped` describe the fit (None when not fitted).
    """

    base: float = 0.0
    per_prefill_token: float = 0.0
    per_decode_row: float = 0.0
    per_prefill_chunk: float = 0.0
    per_decode_forward: float = 0.0
    per_prefill_done: float = 0.0
    per_image_encoded: float = 0.0
    per_media_prefill_token: float = 0.0
    slowdown: float = 1.0
    overhead: float = 0.0
    r2: float | None = None
    mean_rel_error: float | None = None
    typical_rel_error: float | None = None
    n_ticks: int = 0
    dropped: int = 0  # outlier ticks left out of the final fit (e.g. the first tick's warm-up)

    @property
    def coefficients(self) -> tuple[float, ...]:
        return tuple(getattr(self, name) for name in FEATURES)

    def tick_seconds(self, prefill_tokens: int, decode_rows: int, num_chunks: int, completed: int = 0,
                     images_encoded: int = 0, media_prefill_tokens: int = 0) -> float:
        """Predicted wall time of one tick (including `overhead`)."""
        return (self.base + self.per_prefill_token * prefill_tokens + self.per_decode_row * decode_rows
                + self.per_prefill_chunk * num_chunks + (self.per_decode_forward if decode_rows else 0.0)
                + self.per_prefill_done * completed + self.per_image_encoded * images_encoded
                + self.per_media_prefill_token * media_prefill_tokens) * self.slowdown + self.overhead

    def plan_seconds(self, plan: TickPlan, images_encoded: int = 0,
                     media: "Callable[[str], bool]" = lambda _rid: False) -> float:
        """A plan's predicted time; `images_encoded`: media items it encodes that miss the vision cache;
        `media(request_id)`: whether a request carries media (its prefill tokens cost the media term too)."""
        row = tick_features([[c.request_id, c.start, c.end, c.completes] for c in plan.prefill], plan.decode,
                            plan.num_batched_tokens, images_encoded, media)
        return self.tick_seconds(*row[1:4], row[5], row[6], row[7])

    def describe(self) -> str:
        parts = [f"{self.base * 1e3:.3g} ms/tick", f"{self.per_prefill_token * 1e6:.3g} us/prefill token",
                 f"{self.per_decode_row * 1e6:.3g} us/decode row", f"{self.per_prefill_chunk * 1e6:.3g} us/chunk",
                 f"{self.per_decode_forward * 1e3:.3g} ms/decode forward",
                 f"{self.per_prefill_done * 1e6:.3g} us/completed prefill",
                 f"{self.per_image_encoded * 1e3:.3g} ms/image encoded",
                 f"{self.per_media_prefill_token * 1e6:.3g} us/media prefill token",
                 f"{self.overhead * 1e6:.3g} us between ticks"]
        text = "cost model: (" + " + ".join(parts[:-1]) + f") x {self.slowdown:.3g} + {parts[-1]}"
        if self.r2 is not None:
            text += (f"; fit over {self.n_ticks} ticks ({self.dropped} outliers left out of the terms): "
                     f"R^2 = {self.r2:.3f}, mean relative error {self.mean_rel_error:.1%}, "
                     f"typical tick (median, terms alone) {self.typical_rel_error:.1%}")
        return text


def tick_features(prefill: Sequence[Sequence[Any]], decode: Sequence[str], num_batched_tokens: int,
                  images_encoded: int = 0, media: "Callable[[str], bool]" = lambda _rid: False) -> list[float]:
    """Feature row for one recorded plan (`prefill` as `[[id, start, end, completes], ...]`), in FEATURES order.
    `images_encoded`: media items encoded this tick that missed the vision cache; `media(id)`: whether a
    request carries media."""
    completing = sum(1 for c in prefill if c[3])
    decode_rows = len(decode) + completing
    media_tokens = sum(c[2] - c[1] - (1 if c[3] else 0) for c in prefill if media(c[0]))
    return [1.0, float(num_batched_tokens - decode_rows), float(decode_rows), float(len(prefill)),
            1.0 if decode_rows else 0.0, float(completing), float(images_encoded), float(media_tokens)]


def _images_encoded(outcome: Mapping[str, Any], images: Mapping[str, int]) -> int:
    """Media items a recorded tick encoded that missed the vision cache (`outcome.encoded`)."""
    return sum(images.get(rid, 1) for rid, info in outcome.get("encoded", {}).items()
               if not info.get("vision_cache_hit"))


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a handful of columns: the best unconstrained fit over every support.

    The NNLS optimum is the unconstrained least-squares solution on its own support, so trying every subset
    of columns (2**k, k <= ~8) and keeping the best one whose coefficients are all >= 0 is exact.
    """
    k = a.shape[1]
    if k > 10:
        raise ValueError("nnls here is exhaustive over supports; use at most 10 columns")
    best, best_err = np.zeros(k), float(np.sum(b * b))
    for size in range(1, k + 1):
        for support in itertools.combinations(range(k), size):
            cols = list(support)
            coef, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if np.any(coef < 0):
                continue
            err = float(np.sum((a[:, cols] @ coef - b) ** 2))
            if err < best_err - 1e-18:
                best = np.zeros(k)
                best[cols] = coef
                best_err = err
    return best


def fit_cost_model(trace: "Trace | str | os.PathLike | Iterable[dict]",
                   outlier_mads: float | None = 3.0) -> CostModel:
    """Least-squares (non-negative) fit of the per-tick cost over a trace's busy ticks.

    x comes from each tick's `plan` (`tick_features`), y is that tick's `outcome.measure.tick_s`. The
    coefficients are fitted robustly: refits leave out ticks whose residual exceeds `outlier_mads` median
    absolute deviations (warm-up, GC pauses, another process taking the CPU; None keeps every tick). The
    terms are then scaled by `slowdown` = recorded busy time / predicted busy time, so the predicted total
    time of the recorded plans matches the recording (a slowdown from contention is proportional: it carries
    over to a config with more, cheaper ticks better than a constant per tick would). `overhead` is the
    median gap between one busy tick's end and the next busy tick's start. R^2 and the mean relative error
    are those of the model as used over all busy ticks; `typical_rel_error` is the median relative error of
    the terms alone.
    """
    rec = load_recorded(trace)
    images = {e["request_id"]: int(e.get("num_images", 0)) for e in rec.arrival_events}
    media = lambda rid: images.get(rid, 0) > 0  # noqa: E731
    rows, ys = [], []
    for tick in sorted(rec.trace.outcomes):
        plan = rec.trace.plans.get(tick)
        outcome = rec.trace.outcomes[tick]
        m = outcome.get("measure", {})
        if plan is None or "tick_s" not in m:
            continue
        rows.append(tick_features(plan["prefill"], plan["decode"], plan["num_batched_tokens"],
                                  _images_encoded(outcome, images), media))
        ys.append(float(m["tick_s"]))
    if len(rows) < 2:
        raise TraceError("fit_cost_model: the trace has fewer than 2 timed ticks (outcome.measure.tick_s)")
    x, y = np.asarray(rows), np.asarray(ys)
    coef = nnls(x, y)
    keep = np.ones(len(y), bool)
    if outlier_mads is not None:
        for _ in range(5):  # refit without the outliers of the current fit until the kept set settles
            resid = y - x @ coef
            mad = float(np.median(np.abs(resid - np.median(resid))))
            if mad <= 0:
                break
            new_keep = np.abs(resid) <= outlier_mads * 1.4826 * mad
            if new_keep.sum() < len(FEATURES) or np.array_equal(new_keep, keep):
                break
            keep = new_keep
            coef = nnls(x[keep], y[keep])
    terms = x @ coef
    slowdown = float(y.sum() / terms.sum()) if terms.sum() > 0 else 1.0
    pred = terms * slowdown
    ss_res = float(np.sum((y - pred) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    rel = np.abs(pred - y) / np.maximum(y, 1e-12)
    typical = float(np.median(np.abs(terms - y) / np.maximum(y, 1e-12)))
    gaps = []
    ticks = sorted(rec.trace.outcomes)
    for a, b in zip(ticks, ticks[1:]):
        if b == a + 1:
            ma, mb = rec.trace.outcomes[a]["measure"], rec.trace.outcomes[b]["measure"]
            if "tick_start_t" in mb and "t" in ma:
                gaps.append(max(0.0, mb["tick_start_t"] - ma["t"]))
    overhead = float(np.median(gaps)) if gaps else 0.0
    return CostModel(*[float(c) for c in coef], slowdown=slowdown, overhead=overhead, r2=r2,
                     mean_rel_error=float(rel.mean()), typical_rel_error=typical, n_ticks=len(y),
                     dropped=int((~keep).sum()))


# ---- the recorded run ------------------------------------------------------------------------------------


@dataclass
class Recorded:
    """What the simulator and `recorded_metrics` need from a trace, indexed once."""

    trace: Trace
    events: list[dict[str, Any]] | None  # raw events (None when built from a Trace object)
    t0: float  # engine_start measure.t
    arrival_events: list[dict[str, Any]] = field(default_factory=list)
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

    @property
    def cache_hit_rate(self) -> float | None:
        lookups = self.prefix_hits + self.prefix_misses
        return self.prefix_hits / lookups if lookups else None

    def kv_layout(self) -> Any:
        """The engine's KV layout (`caches.kv.KVLayout`) if the trace recorded one, else None."""
        layers = self.trace.header.get("kv_layout")
        if not layers:
            return None
        from caches.kv import KVLayout, LayerLayout

        return KVLayout(tuple(LayerLayout(int(b), None if w is None else int(w)) for b, w in layers))


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
            if kind == "prefix_hit":
                rec.prefix_hits += 1
                rec.prefix_tokens_saved += int(e.get("length", 0))
            elif kind == "prefix_miss":
                rec.prefix_misses += 1
            elif kind == "prefix_store":
                stored_tokens += int(e.get("tokens", 0))
                stored_bytes += int(e.get("nbytes", 0))
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
    return rec


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


# ---- metrics ---------------------------------------------------------------------------------------------


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
    busy = sorted(rec.trace.outcomes)
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


# ---- simulation ------------------------------------------------------------------------------------------


class SimExecutor:
    """Executor stand-in: advances `clock` by the cost model, returns synthetic tokens.

    A request produces `ordinary_token` until its `output_len`-th token, which is the stop token (unless
    output_len == max_tokens: then `max_tokens` ends it). A request with `error_after = k` gets an error instead
    of its (k+1)-th token. The token count survives a preemption (the request resumes where it stopped, as
    the real executor's sampling step does). With `prefix_block_size`, a request whose prefill completes
    offers prompt[:-1] to the prefix cache, as `MLXExecutor._offer_prefix` does (`kv_bytes_per_token` sizes
    the entry; no payload). Same interface as `ReplayExecutor`: `execute(plan, requests)`, `release(ids)`.
    """

    def __init__(self, cost_model: CostModel, arrivals: Iterable[SimArrival],
                 stop_token_ids: Sequence[int] = (0,), ordinary_token: int | None = None,
                 prefix_block_size: int | None = None, kv_bytes_per_token: int = 0):
        self.cost_model = cost_model
        self.clock = 0.0
        stops = set(stop_token_ids)
        if not stops:
            raise ValueError("SimExecutor needs at least one stop token id")
        self.stop_token = min(stops)
        token = FIRST_ORDINARY_ID if ordinary_token is None else ordinary_token
        while token in stops:
            token += 1
        self.ordinary_token = token
        self.prefix_block_size = prefix_block_size
        self.kv_bytes_per_token = kv_bytes_per_token
        # id -> index of the token that is the stop (or -1), index that errors (or -1)
        self._stop_at: dict[str, int] = {}
        self._error_at: dict[str, int] = {}
        self._prompt_len: dict[str, int] = {}
        self._media: dict[str, tuple[int, str | None]] = {}  # id -> (media items, media key)
        self._vision_seen: set[str] = set()  # media keys encoded before: a vision-cache hit (unbounded cache)
        for a in arrivals:
            self._stop_at[a.request_id] = a.output_len - 1 if a.output_len < a.max_tokens else -1
            self._error_at[a.request_id] = -1 if a.error_after is None else a.error_after
            self._prompt_len[a.request_id] = a.prompt_len
            if a.num_images:
                self._media[a.request_id] = (a.num_images, a.media_key)
        self._produced: dict[str, int] = {}

    def execute(self, plan: TickPlan, requests: Mapping[str, Request] | None = None) -> TickResult:
        encoded: dict[str, dict] = {}
        images = 0
        for rid in plan.encode:
            count, key = self._media.get(rid, (1, None))
            hit = key is not None and key in self._vision_seen
            if key is not None:
                self._vision_seen.add(key)
            images += 0 if hit else count
            encoded[rid] = {"rope_delta": 0, "vision_cache_hit": hit}
        seconds = self.cost_model.plan_seconds(plan, images, self._media.__contains__)
        self.clock += seconds
        sampled: dict[str, int] = {}
        errors: dict[str, str] = {}
        produced, stop_at, error_at = self._produced, self._stop_at, self._error_at
        ordinary, stop = self.ordinary_token, self.stop_token
        rows = [c.request_id for c in plan.prefill if c.completes]
        result = TickResult(sampled=sampled, errors=errors, prefill_time=seconds, decode_time=0.0, encoded=encoded)
        if rows and self.prefix_block_size is not None:
            self._offer_prefixes(plan, rows, result)
        rows.extend(plan.decode)
        for rid in rows:
            n = produced.get(rid, 0)
            if n == error_at[rid]:
                errors[rid] = f"simulated error after {n} tokens"
                continue
            sampled[rid] = stop if n == stop_at[rid] else ordinary
            produced[rid] = n + 1
        # Errors come only with sampling here; the real executor can also fail a request mid-prefill.
        return result

    def _offer_prefixes(self, plan: TickPlan, completing: list[str], result: TickResult) -> None:
        from scheduler.plan import PrefixStore  # the prefix-cache contract (absent from older plan modules)

        restored = {rid: length for rid, _entry, length in getattr(plan, "prefix_hits", ())}
        for rid in completing:
            n = self._prompt_len[rid] - 1
            if n < self.prefix_block_size or restored.get(rid, 0) == n:
                continue
            result.prefix_stores.append(PrefixStore(rid, n, n * self.kv_bytes_per_token, False, None))

    def release(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._produced.pop(rid, None)


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
            n = a.prompt_len
            if kv_layout is not None and budget is not None and (  # the engine's add_request rule
                    kv_layout.footprint([n + max(1, config.kv_headroom_tokens)], [])
                    + kv_layout.join_bytes([], [(n, min(n, config.prefill_chunk))]) > budget):
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
                executor.release([rid])
                records[rid].outcome, records[rid].end = "aborted", now
        if not live:
            continue
        plan = scheduler.plan(scheduler.view(tick))
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
        result = executor.execute(plan, live)
        applied = scheduler.apply(plan, result)
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
        if applied.released:
            executor.release(applied.released)
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


# ---- comparison ------------------------------------------------------------------------------------------

_DISPLAY = (  # key, label, scale
    ("requests", "requests", None),
    ("finished", "finished", None),
    ("aborted", "aborted", None),
    ("failed", "failed", None),
    ("output_tokens", "output tokens", None),
    ("throughput_tok_s", "throughput (tok/s)", 1.0),
    ("makespan_s", "makespan (s)", 1.0),
    ("ttft_mean_s", "TTFT mean (ms)", 1e3),
    ("ttft_p50_s", "TTFT p50 (ms)", 1e3),
    ("ttft_p95_s", "TTFT p95 (ms)", 1e3),
    ("ttft_p99_s", "TTFT p99 (ms)", 1e3),
    ("tpot_mean_s", "TPOT mean (ms)", 1e3),
    ("e2e_p50_s", "e2e p50 (ms)", 1e3),
    ("e2e_p95_s", "e2e p95 (ms)", 1e3),
    ("queue_mean_s", "queue mean (ms)", 1e3),
    ("preemptions", "preemptions", None),
    ("ticks", "ticks", None),
    ("request_ticks", "request-ticks", None),
    ("cache_hit_rate", "prefix cache hit rate", 1.0),
    ("prefix_tokens_saved", "prefix tokens saved", None),
)


def _cell(value: Any, scale: float | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if scale is None and isinstance(value, int):
        return str(value)
    v = float(value) * (scale or 1.0)
    return f"{v:.4g}" if abs(v) < 1e4 else f"{v:,.0f}"


def compare_table(rows: Mapping[str, Mapping[str, Any]]) -> str:
    """A markdown table: one column per run (the keys of `rows`), one row per metric."""
    names = list(rows)
    known = [k for k, _, _ in _DISPLAY]
    extra = [k for k in dict.fromkeys(k for r in rows.values() for k in r) if k not in known]
    spec = [(k, label, scale) for k, label, scale in _DISPLAY if any(k in r for r in rows.values())]
    spec += [(k, k, 1.0) for k in extra]
    lines = ["| metric | " + " | ".join(names) + " |", "| --- |" + " ---: |" * len(names)]
    for key, label, scale in spec:
        lines.append(f"| {label} | " + " | ".join(_cell(rows[n].get(key), scale) for n in names) + " |")
    return "\n".join(lines)


def _coerce(name: str, value: Any, current: Any, annotation: str) -> Any:
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.lower() in ("none", "null") and "None" in annotation:
        return None
    if "bool" in annotation:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}: expected a boolean, got {value!r}")
    if "int" in annotation:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{name}: expected an integer, got {value!r}") from None
    if "float" in annotation:
        return float(text)
    return text


def apply_overrides(config: EngineConfig, overrides: Mapping[str, Any] | None) -> EngineConfig:
    """`config` with fields replaced; string values (from `--set key=value`) are converted to the field's type."""
    if not overrides:
        return config
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    changes = {}
    for name, value in overrides.items():
        if name not in fields:
            raise ValueError(f"unknown config field {name!r}; known: {sorted(fields)}")
        changes[name] = _coerce(name, value, getattr(config, name), str(fields[name].type))
    return dataclasses.replace(config, **changes)


def _label(policy: str | Policy | None, overrides: Mapping[str, Any] | None) -> str:
    parts = []
    if policy is not None:
        parts.append(f"policy={policy if isinstance(policy, str) else getattr(policy, 'name', policy)}")
    parts += [f"{k}={v}" for k, v in (overrides or {}).items()]
    return "simulated (" + ", ".join(parts) + ")"


def what_if(trace_path: "str | os.PathLike | Trace", policy: str | Policy | None = None,
            overrides: Mapping[str, Any] | None = None, kv_layout: Any = None) -> str:
    """Fit the cost model on a trace, simulate its arrivals under the recorded policy and config and under
    `policy` / `overrides`, and return the cost model and a table: recorded vs simulated vs alternative.

    A KV budget (`kv_memory_bytes`) needs the model's KV layout: the one the trace recorded, else `kv_layout`.
    """
    rec = load_recorded(trace_path)
    cost = fit_cost_model(rec)
    arrivals = arrivals_from_trace(rec)
    stop = rec.trace.stop_token_ids[0] if rec.trace.stop_token_ids else 0
    config = dataclasses.replace(rec.trace.config, trace_path=None)
    layout = kv_layout if kv_layout is not None else rec.kv_layout()
    other_config = apply_overrides(config, overrides)
    if getattr(other_config, "kv_memory_bytes", None) is not None and layout is None:
        raise ValueError("kv_memory_bytes needs the model's KV layout: this trace has none (engine_start "
                         "kv_layout); pass kv_layout=")
    per_token = rec.prefix_bytes_per_token
    per_token = int(round(per_token)) if per_token is not None else None
    kwargs = dict(stop_token_id=stop, kv_layout=layout, kv_bytes_per_token=per_token)
    recorded_policy = config.policy
    rows = {"recorded": recorded_metrics(rec)}
    same = simulate(arrivals, config, cost, policy=recorded_policy, **kwargs)
    rows[f"simulated ({recorded_policy})"] = same.summary()
    if policy is not None or overrides:
        other = simulate(arrivals, other_config, cost, policy=policy if policy is not None else recorded_policy,
                         **kwargs)
        rows[_label(policy, overrides)] = other.summary()
    lines = [cost.describe(), ""]
    rec_row, sim_row = rows["recorded"], rows[f"simulated ({recorded_policy})"]
    errs = []
    for key, label in (("throughput_tok_s", "throughput"), ("ttft_mean_s", "mean TTFT")):
        a, b = rec_row.get(key), sim_row.get(key)
        if a and b is not None:
            errs.append(f"{label} {(b - a) / a:+.1%}")
    if errs:
        lines += ["simulation of the recorded policy vs the recording: " + ", ".join(errs), ""]
    lines.append(compare_table(rows))
    return "\n".join(lines)
