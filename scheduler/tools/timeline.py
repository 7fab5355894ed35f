"""Timelines of a recorded run: request states over time, from the engine's event log.

* `to_perfetto(events)`: Chrome / Perfetto trace-event JSON (open in https://ui.perfetto.dev or
  chrome://tracing). Process 1 holds one track per request (named by request id) with one complete event
  (`ph: "X"`) per stay in a state, from the arrival's and the transitions' `measure.t`, plus an instant event
  when it ends; track 0 ("engine") holds one slice per busy tick and counters of the batch composition.
* `to_png(events, path)`: a matplotlib Gantt chart over ticks (x = tick, y = request, colour = state).
* `write_timeline(trace_path, out_path)`: picks the format from the extension (.json or .png).

Times are microseconds relative to `engine_start`. Transition events may name one request (`request_id`) or
several (`request_ids`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Iterable

STATE_COLOURS = {
    "queued": "#bdbdbd",
    "vision_encoding": "#9467bd",
    "chunk_prefilling": "#ff7f0e",
    "decoding": "#1f77b4",
    "drafting": "#17becf",
    "finished": "#2ca02c",
    "aborted": "#d62728",
}
TERMINAL = ("finished", "aborted")
# Triggers decided before a tick's work (admission in the plan, caller aborts drained at the tick's start):
# the state they leave did no work in that tick. Every other move is fired in `apply`, after the work.
_DECIDED_AT_TICK_START = frozenset({"start_prefill", "start_vision", "abort", "preempt"})

ENGINE_TID = 0


@dataclass
class Stay:
    """One request in one state: [start, end) in seconds since engine start and in ticks."""

    request_id: str
    state: str
    start_t: float
    end_t: float | None  # None: still in this state when the log ends
    start_tick: int
    end_tick: int | None


def _t(event: dict[str, Any]) -> float | None:
    measure = event.get("measure") or {}
    t = measure.get("t")
    return float(t) if isinstance(t, (int, float)) else None


def _ids(event: dict[str, Any]) -> list[str]:
    if event.get("request_ids"):
        return list(event["request_ids"])
    return [event["request_id"]] if "request_id" in event else []


def _origin(events: list[dict[str, Any]]) -> float:
    start = next((e for e in events if e.get("event") == "engine_start"), None)
    times = [t for t in (_t(e) for e in events) if t is not None]
    t0 = _t(start) if start is not None else None
    if t0 is None:
        return min(times, default=0.0)
    return min([t0] + times)  # never a negative timestamp


def request_stays(events: Iterable[dict[str, Any]]) -> tuple[list[str], list[Stay], dict[str, tuple[str, float, int]]]:
    """(request ids in arrival order, state stays, {id: (terminal state, time, tick)}) from an event log."""
    events = sorted(events, key=lambda e: e.get("seq", 0))
    t0 = _origin(events)
    order: list[str] = []
    current: dict[str, tuple[str, float, int]] = {}  # id -> (state, since t, since tick)
    stays: list[Stay] = []
    ends: dict[str, tuple[str, float, int]] = {}
    for e in events:
        kind = e.get("event")
        if kind == "arrival":
            rid = e["request_id"]
            if rid not in current and rid not in ends:
                order.append(rid)
            t = _t(e)
            current[rid] = ("queued", (t if t is not None else t0) - t0, e["tick"])
        elif kind == "transition":
            t = _t(e)
            tick = e["tick"]
            end_tick = tick if e.get("trigger") in _DECIDED_AT_TICK_START else tick + 1
            for rid in _ids(e):
                prev = current.pop(rid, None)
                if prev is None:
                    continue  # a transition for a request whose arrival is not in this log
                state, since, since_tick = prev
                now = (t if t is not None else since + t0) - t0
                stays.append(Stay(rid, state, since, max(now, since), since_tick, max(end_tick, since_tick)))
                dest = e.get("to")
                if dest in TERMINAL:
                    ends[rid] = (dest, max(now, since), max(end_tick, since_tick))
                else:
                    current[rid] = (dest, max(now, since), max(end_tick, since_tick))
    for rid, (state, since, since_tick) in current.items():
        stays.append(Stay(rid, state, since, None, since_tick, None))
    return order, stays, ends


def to_perfetto(events: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Chrome/Perfetto trace-event JSON for an event log (see the module docstring)."""
    events = sorted(events, key=lambda e: e.get("seq", 0))
    t0 = _origin(events)
    order, stays, ends = request_stays(events)
    tids = {rid: i + 1 for i, rid in enumerate(order)}
    last_t = max([t - t0 for t in (_t(e) for e in events) if t is not None], default=0.0)

    def us(seconds: float) -> float:
        return round(max(0.0, seconds) * 1e6, 3)

    out: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": 1, "tid": ENGINE_TID, "args": {"name": "mlxsched"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": ENGINE_TID, "args": {"name": "engine"}},
    ]
    for rid, tid in tids.items():
        out.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": rid}})
    for s in stays:
        end = s.end_t if s.end_t is not None else max(last_t, s.start_t)
        out.append({"ph": "X", "name": s.state, "cat": "request", "pid": 1, "tid": tids[s.request_id],
                    "ts": us(s.start_t), "dur": round(max(0.0, us(end) - us(s.start_t)), 3),
                    "args": {"request_id": s.request_id, "start_tick": s.start_tick, "end_tick": s.end_tick}})
    for rid, (state, t, tick) in ends.items():
        out.append({"ph": "i", "name": state, "cat": "request", "pid": 1, "tid": tids[rid], "ts": us(t), "s": "t",
                    "args": {"request_id": rid, "tick": tick}})
    plans = {e["tick"]: e for e in events if e.get("event") == "plan"}
    for e in events:
        if e.get("event") != "outcome":
            continue
        m = e.get("measure") or {}
        start, dur = m.get("tick_start_t"), m.get("tick_s")
        if not isinstance(start, (int, float)) or not isinstance(dur, (int, float)):
            continue
        plan = plans.get(e["tick"], {})
        prefill = plan.get("prefill", [])
        args = {"tick": e["tick"], "decode_rows": len(plan.get("decode", [])), "prefill_chunks": len(prefill),
                "prefill_tokens": sum(c[2] - c[1] for c in prefill), "sampled": len(e.get("sampled", {}))}
        out.append({"ph": "X", "name": f"tick {e['tick']}", "cat": "tick", "pid": 1, "tid": ENGINE_TID,
                    "ts": us(start - t0), "dur": us(dur), "args": args})
        out.append({"ph": "C", "name": "batch", "pid": 1, "tid": ENGINE_TID, "ts": us(start - t0),
                    "args": {"decode_rows": args["decode_rows"], "prefill_chunks": args["prefill_chunks"]}})
        out.append({"ph": "C", "name": "prefill_tokens", "pid": 1, "tid": ENGINE_TID, "ts": us(start - t0),
                    "args": {"prefill_tokens": args["prefill_tokens"]}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def to_png(events: Iterable[dict[str, Any]], path: str | os.PathLike, max_requests: int = 200,
           title: str | None = None) -> None:
    """Gantt chart of request states over ticks (x = tick, y = request in arrival order, colour = state).

    Only the first `max_requests` requests are drawn (a chart with thousands of rows is unreadable).
    """
    # The Agg canvas directly, without pyplot: no global backend switch, no GUI, safe in threads and tests.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    events = list(events)
    order, stays, ends = request_stays(events)
    shown = order[:max_requests]
    row = {rid: i for i, rid in enumerate(shown)}
    last_tick = max((e["tick"] for e in events if e.get("event") in ("plan", "outcome", "transition")), default=0) + 1

    height = min(2.0 + 0.22 * len(shown), 40.0)
    fig = Figure(figsize=(11, height), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    bars: dict[str, list[tuple[int, int, int]]] = {}
    for s in stays:
        if s.request_id not in row:
            continue
        end = s.end_tick if s.end_tick is not None else last_tick
        if end > s.start_tick:
            bars.setdefault(s.state, []).append((row[s.request_id], s.start_tick, end - s.start_tick))
    for state, items in bars.items():
        by_row: dict[int, list[tuple[int, int]]] = {}
        for r, start, width in items:
            by_row.setdefault(r, []).append((start, width))
        for r, spans in by_row.items():
            ax.broken_barh(spans, (r - 0.4, 0.8), facecolors=STATE_COLOURS.get(state, "#7f7f7f"))
    for rid, (state, _t_end, tick) in ends.items():
        if rid in row:
            ax.plot([tick], [row[rid]], marker="|" if state == "finished" else "x", markersize=9,
                    markeredgewidth=2.5, color=STATE_COLOURS[state], linestyle="none")
    ax.set_xlim(0, max(last_tick, 1) + 0.5)
    ax.set_ylim(len(shown) - 0.5, -0.5)
    if len(shown) <= 60:
        ax.set_yticks(range(len(shown)))
        ax.set_yticklabels(shown, fontsize=7)
    else:
        ax.set_ylabel("request (arrival order)")
    ax.set_xlabel("tick")
    ax.grid(axis="x", alpha=0.3)
    present = [s for s in STATE_COLOURS if s in bars or any(v[0] == s for v in ends.values())]
    ax.legend(handles=[Patch(color=STATE_COLOURS[s], label=s) for s in present], loc="upper left",
              bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    extra = f" (first {len(shown)} of {len(order)})" if len(order) > len(shown) else ""
    ax.set_title(title or f"request states over ticks{extra}")
    fig.tight_layout()
    fig.savefig(os.fspath(path), format="png")


def read_events(trace_path: str | os.PathLike) -> list[dict[str, Any]]:
    from scheduler.tools.replay import TraceError, parse_events

    try:
        with open(trace_path, encoding="utf-8") as f:
            return parse_events(f, os.fspath(trace_path))
    except OSError as exc:
        raise TraceError(f"cannot read trace {os.fspath(trace_path)}: {exc}") from None


def write_timeline(trace_path: str | os.PathLike, out_path: str | os.PathLike) -> str:
    """Write the timeline of `trace_path` to `out_path`: `.json` -> Perfetto JSON, `.png` -> Gantt chart.
    Returns the format written."""
    ext = os.path.splitext(os.fspath(out_path))[1].lower()
    if ext not in (".json", ".png"):
        raise ValueError(f"timeline format from extension: .json (Perfetto) or .png, got {ext or 'none'!r}")
    events = read_events(trace_path)
    if ext == ".json":
        with open(out_path, "w", encoding="utf-8") as f:
            json.dump(to_perfetto(events), f, separators=(",", ":"))
        return "perfetto"
    to_png(events, out_path)
    return "png"
