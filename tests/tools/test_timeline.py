"""Timelines from a real run's trace: Perfetto trace-event JSON (validated against the format) and a PNG
Gantt chart."""

import json
import struct

import pytest

from scheduler.events import read_jsonl

from scheduler import Engine, EngineConfig, SamplingParams
from scheduler.tools.timeline import request_stays, to_perfetto, to_png, write_timeline

from ..helpers import mixed_prompts

PROMPTS = mixed_prompts(12, 1, 70, seed=9)
ABORTED = "r2"
LIFECYCLE = ["queued", "chunk_prefilling", "decoding"]


@pytest.fixture(scope="module")
def trace_path(text_model, tmp_path_factory):
    """Staggered arrivals, chunked prefill, a queue (max_seqs=3), an abort."""
    model, tokenizer = text_model
    path = tmp_path_factory.mktemp("timeline-trace") / "run.jsonl"
    engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=24, max_seqs=3, prefill_chunk=8,
                                                   trace_path=str(path)))
    for i, p in enumerate(PROMPTS):
        engine.add_request(prompt_tokens=p, sampling=SamplingParams(max_tokens=4 + i % 5), request_id=f"r{i}")
        engine.step()
        if i == 4:
            engine.abort(ABORTED)
    while engine.has_pending():
        engine.step()
    engine.close()
    return path


def _events(path):
    return read_jsonl(path)


def check_trace_event_format(doc):
    """A small schema check of the Chrome/Perfetto trace-event JSON object format."""
    assert isinstance(doc, dict) and isinstance(doc.get("traceEvents"), list)
    assert doc.get("displayTimeUnit") in ("ms", "ns")
    for e in doc["traceEvents"]:
        assert e["ph"] in {"X", "M", "C", "i"}, e
        assert isinstance(e["name"], str) and e["name"], e
        for key in ("pid", "tid"):
            assert isinstance(e[key], int) and not isinstance(e[key], bool), e
        if e["ph"] == "M":
            assert isinstance(e["args"]["name"], str), e
            continue
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
        if e["ph"] == "C":
            assert e["args"] and all(isinstance(v, (int, float)) for v in e["args"].values()), e
        if e["ph"] == "i":
            assert e.get("s", "t") in ("g", "p", "t"), e
        assert isinstance(e.get("args", {}), dict)
    json.dumps(doc)  # serialisable as is


def test_perfetto_json_is_valid_trace_event_format(trace_path):
    doc = to_perfetto(_events(trace_path))
    check_trace_event_format(doc)
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert sorted(v for k, v in names.items() if k != 0) == sorted(f"r{i}" for i in range(len(PROMPTS)))
    assert names[0] == "engine"
    assert len(set(names)) == len(names)  # one stable tid per request


def test_each_request_track_is_its_lifecycle_in_order(trace_path):
    events = _events(trace_path)
    doc = to_perfetto(events)
    tid_of = {e["args"]["name"]: e["tid"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    finished = {e["request_id"] for e in events if e["event"] == "transition" and e["to"] == "finished"}
    assert len(finished) == len(PROMPTS) - 1
    for rid, tid in tid_of.items():
        if rid == "engine":
            continue
        slices = sorted((e for e in doc["traceEvents"] if e["ph"] == "X" and e["tid"] == tid), key=lambda e: e["ts"])
        for a, b in zip(slices, slices[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (rid, a, b)  # no overlap (1 ns rounding slack)
        states = [s["name"] for s in slices]
        assert states == LIFECYCLE[: len(states)], (rid, states)  # queued, then prefilling, then decoding
        ends = [e for e in doc["traceEvents"] if e["ph"] == "i" and e["tid"] == tid]
        if rid in finished:
            assert states == LIFECYCLE and [e["name"] for e in ends] == ["finished"], (rid, states, ends)
            assert ends[0]["ts"] == pytest.approx(slices[-1]["ts"] + slices[-1]["dur"], abs=1e-2)
    assert [e["name"] for e in doc["traceEvents"] if e["ph"] == "i" and e["tid"] == tid_of[ABORTED]] == ["aborted"]


def test_tick_track_matches_the_outcomes(trace_path):
    events = _events(trace_path)
    doc = to_perfetto(events)
    ticks = sorted((e for e in doc["traceEvents"] if e["ph"] == "X" and e["tid"] == 0), key=lambda e: e["ts"])
    outcomes = [e for e in events if e["event"] == "outcome"]
    assert len(ticks) == len(outcomes)
    for a, b in zip(ticks, ticks[1:]):
        assert a["ts"] + a["dur"] <= b["ts"] + 1e-3
    counters = [e for e in doc["traceEvents"] if e["ph"] == "C" and e["name"] == "batch"]
    assert len(counters) == len(outcomes)
    assert max(c["args"]["decode_rows"] for c in counters) <= 3  # max_seqs


def test_stays_in_ticks_cover_the_work(trace_path):
    """In tick coordinates a request is prefilling in every tick that fed it a chunk, decoding in every tick
    that decoded it."""
    events = _events(trace_path)
    _, stays, ends = request_stays(events)
    plans = {e["tick"]: e for e in events if e["event"] == "plan"}
    for s in stays:
        if s.end_tick is None or s.state == "queued":
            continue
        for tick in range(s.start_tick, s.end_tick):
            plan = plans[tick]
            if s.state == "chunk_prefilling":
                assert any(c[0] == s.request_id for c in plan["prefill"]), (s, tick)
            else:
                assert s.request_id in plan["decode"], (s, tick)
    assert ends[ABORTED][0] == "aborted"


def test_batched_transitions_and_missing_times_are_handled():
    events = [
        {"event": "engine_start", "tick": 0, "seq": 0, "measure": {"t": 10.0}},
        {"event": "arrival", "tick": 0, "seq": 1, "request_id": "a", "measure": {"t": 10.5}},
        {"event": "arrival", "tick": 0, "seq": 2, "request_id": "b", "measure": {"t": 10.5}},
        {"event": "transition", "tick": 0, "seq": 3, "request_ids": ["a", "b"], "trigger": "start_prefill",
         "from": "queued", "to": "chunk_prefilling", "measure": {"t": 11.0}},
        {"event": "transition", "tick": 1, "seq": 4, "request_id": "a", "trigger": "abort",
         "from": "chunk_prefilling", "to": "aborted"},
    ]
    doc = to_perfetto(events)
    check_trace_event_format(doc)
    xs = [(e["tid"], e["name"], e["ts"], e["dur"]) for e in doc["traceEvents"] if e["ph"] == "X"]
    assert (1, "queued", 500000.0, 500000.0) in xs and (2, "queued", 500000.0, 500000.0) in xs
    assert (1, "chunk_prefilling", 1000000.0, 0.0) in xs  # no time on the abort: ends where it started
    assert any(t == 2 and n == "chunk_prefilling" for t, n, _, _ in xs)  # b is still prefilling at the end


def test_png_gantt_chart(trace_path, tmp_path):
    out = tmp_path / "timeline.png"
    assert write_timeline(trace_path, out) == "png"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 600 and height >= 200 and len(data) > 5000
    many = tmp_path / "capped.png"
    to_png(_events(trace_path), many, max_requests=5)
    assert many.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_write_timeline_picks_the_format(trace_path, tmp_path):
    out = tmp_path / "timeline.json"
    assert write_timeline(trace_path, out) == "perfetto"
    check_trace_event_format(json.loads(out.read_text()))
    with pytest.raises(ValueError, match=".json"):
        write_timeline(trace_path, tmp_path / "timeline.svg")
