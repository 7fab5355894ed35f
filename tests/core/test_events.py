"""Structured events: valid JSON lines with a schema, decisions kept apart from measurements."""

import json
import threading

from scheduler.events import (
    MEASURE_KEY,
    SCHEMA_VERSION,
    EventLog,
    JsonlSink,
    MemorySink,
    decision_fields,
    read_jsonl,
)


def test_a_held_jsonl_sink_writes_nothing_until_close(tmp_path):
    """hold_until_close: no file I/O while events come (a timing measurement's ticks), the same lines at close."""
    held, plain = tmp_path / "held.jsonl", tmp_path / "plain.jsonl"
    logs = [EventLog([JsonlSink(held, flush_every=1, hold_until_close=True)], clock=lambda: 1.5),
            EventLog([JsonlSink(plain, flush_every=1)], clock=lambda: 1.5)]
    for log in logs:
        log.emit("plan", 4, decode=["r1"])
    assert not held.exists() and plain.read_text()
    for log in logs:
        log.close()
    assert held.read_text() == plain.read_text()
    assert json.loads(held.read_text())[MEASURE_KEY] == {"t": 1.5}  # stamped by the log's clock


def test_jsonl_events_are_valid_json_with_the_schema(tmp_path):
    path = tmp_path / "events.jsonl"
    sink = JsonlSink(path)
    log = EventLog([sink])
    log.emit("transition", 3, request_id="r1", trigger="start_prefill", reason=None,
             **{"from": "queued", "to": "chunk_prefilling"})
    log.emit("plan", 4, decode=["r1"], measure={"wall_s": 0.5})
    log.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first["schema"] == SCHEMA_VERSION and second["schema"] == SCHEMA_VERSION
    assert (first["seq"], second["seq"]) == (0, 1)
    assert first["event"] == "transition" and first["tick"] == 3
    assert first["from"] == "queued" and first["to"] == "chunk_prefilling" and first["request_id"] == "r1"
    assert MEASURE_KEY in first and "t" in first[MEASURE_KEY]
    assert second[MEASURE_KEY] == {"wall_s": 0.5}
    assert read_jsonl(path) == [first, second]


def test_decision_fields_drop_measurements_and_sequence():
    a = {"event": "plan", "tick": 1, "seq": 5, "decode": ["x"], MEASURE_KEY: {"t": 1.0}}
    b = {"event": "plan", "tick": 1, "seq": 9, "decode": ["x"], MEASURE_KEY: {"t": 2.0}}
    assert decision_fields(a) == decision_fields(b) == {"event": "plan", "tick": 1, "decode": ["x"]}
    c = dict(b, decode=["y"])
    assert decision_fields(a) != decision_fields(c)


def test_sequence_numbers_are_unique_and_monotonic_across_threads():
    sink = MemorySink()
    log = EventLog([sink])

    def worker(n):
        for i in range(200):
            log.emit("arrival", i, request_id=f"{n}-{i}")

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seqs = [e["seq"] for e in sink.events]
    assert seqs == list(range(800))


def test_a_log_without_sinks_is_disabled_and_silent():
    log = EventLog()
    assert not log.enabled
    log.emit("plan", 0)  # no error, nothing to write
