"""Structured events: one structlog event dict per thing that happened, written as one JSON line.

Schema (version `SCHEMA_VERSION`): every event has `schema`, `seq` (monotonic per log), `tick`, `event` (its
kind) and kind-specific *decision* fields at the top level. *Measurements* (wall time, durations, memory)
live under the single key `measure`, so replay compares `decision_fields(event)` and ignores timings.

Kinds written by the engine: `arrival`, `transition` (request_id, from, to, trigger, reason), `plan`,
`outcome`, `tick`. Same-kind moves of one tick may be batched into one event (`transition` with
`request_ids`) to keep the per-tick cost proportional to changes.
"""

from __future__ import annotations

import io
import json
import os
import threading
import time
from typing import Any, Callable, Iterable, Protocol

import structlog

# 2: arrival draft_eligible (and error, no longer written), policy record, outcome logprobs, kv_* events
SCHEMA_VERSION = 2
MEASURE_KEY = "measure"


class EventSink(Protocol):
    def write(self, event: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class MemorySink:
    """Keeps event dicts in memory (tests, replay of a live run)."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def write(self, event: dict[str, Any]) -> None:
        self.events.append(event)

    def close(self) -> None:
        pass

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == kind]


class JsonlSink:
    """Appends one JSON object per line to a file; flushed on close and every `flush_every` events.

    `hold_until_close`: the lines are kept in memory and the file is written at `close`, so a timing
    measurement's ticks do no file I/O (the writes, and the disk interrupts they bring, would land in them).
    """

    def __init__(self, path: str | os.PathLike, flush_every: int = 256, hold_until_close: bool = False):
        self.path = os.fspath(path)
        self._held = hold_until_close
        self._file: io.TextIOBase | None = (io.StringIO() if hold_until_close
                                             else open(self.path, "w", encoding="utf-8"))
        self._flush_every = flush_every
        self._pending = 0

    def write(self, event: dict[str, Any]) -> None:
        if self._file is None:
            raise ValueError(f"event sink {self.path} is closed")
        self._file.write(json.dumps(event, separators=(",", ":"), default=_jsonable) + "\n")
        self._pending += 1
        if self._pending >= self._flush_every:
            self._file.flush()
            self._pending = 0

    def close(self) -> None:
        if self._file is None:
            return
        if self._held:
            with open(self.path, "w", encoding="utf-8") as f:
                f.write(self._file.getvalue())
        self._file.close()
        self._file = None


def _jsonable(value: Any) -> Any:
    if hasattr(value, "value"):  # enums
        return value.value
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


class _FanOut:
    """The structlog 'logger': receives the final event dict as keyword arguments."""

    def __init__(self, sinks: list[EventSink]):
        self.sinks = sinks

    def msg(self, **event: Any) -> None:
        for sink in self.sinks:
            sink.write(event)


class EventLog:
    """Thread-safe event emitter built on a private structlog pipeline (no global structlog config).

    `emit(kind, tick, measure=None, **decision_fields)`.

    `clock` stamps the measurements' times (`measure.t`, and every timestamp the engine and scheduler record):
    `time.perf_counter` unless the engine was given another (`Engine(clock=...)`, e.g. a
    `tools.side_by_side.EngineClock` that stops while another engine runs).
    """

    def __init__(self, sinks: Iterable[EventSink] = (), clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self._sinks = list(sinks)
        self._seq = 0
        self._lock = threading.Lock()
        self._logger = structlog.wrap_logger(
            _FanOut(self._sinks),
            processors=[self._stamp],
            wrapper_class=structlog.BoundLogger,
            cache_logger_on_first_use=True,
        )

    @property
    def enabled(self) -> bool:
        return bool(self._sinks)

    def add_sink(self, sink: EventSink) -> None:
        self._sinks.append(sink)

    def _stamp(self, _logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        event_dict["schema"] = SCHEMA_VERSION
        event_dict["seq"] = self._seq
        self._seq += 1
        return event_dict

    def emit(self, kind: str, tick: int, measure: dict[str, Any] | None = None, **fields: Any) -> None:
        if not self._sinks:
            return
        if measure is None:
            measure = {"t": self.clock()}
        with self._lock:
            self._logger.msg(kind, tick=tick, **fields, **{MEASURE_KEY: measure})

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()


def decision_fields(event: dict[str, Any]) -> dict[str, Any]:
    """What replay compares: everything except measurements and the sequence number."""
    return {k: v for k, v in event.items() if k not in (MEASURE_KEY, "seq")}


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
