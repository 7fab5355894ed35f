"""Old traces still replay: a corpus recorded with the code of an earlier commit (tests/data/traces, written by
its record_corpus.py) replays to identical plans and decision events with today's scheduler. It guards
refactors of the planner, `apply` and the tick loop, and the reading of traces an older engine wrote."""

import gzip
from pathlib import Path

import pytest

from scheduler.tools.replay import load_trace, parse_events, replay

CORPUS = Path(__file__).resolve().parents[1] / "data" / "traces"
TRACES = sorted(CORPUS.glob("*.jsonl.gz"))
# what each recording was made to exercise: (event kind, field, value) that must occur in it
EXERCISES = {
    "text": [("transition", "trigger", "abort")],
    "vlm": [("transition", "trigger", "start_vision")],
    "drafting": [("transition", "trigger", "start_draft")],
    "drafting_self": [("transition", "trigger", "end_draft")],
    "preemption": [("transition", "trigger", "preempt")],
    "prefix": [("prefix_hit", "event", "prefix_hit")],
}


def _events(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return parse_events(f, path.name)


def test_the_corpus_is_there_and_small():
    assert {p.name.removesuffix(".jsonl.gz") for p in TRACES} == set(EXERCISES)
    assert sum(p.stat().st_size for p in TRACES) < 200_000


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.name.removesuffix(".jsonl.gz"))
def test_a_recorded_trace_replays_identically(path):
    events = _events(path)
    for kind, key, value in EXERCISES[path.name.removesuffix(".jsonl.gz")]:
        assert any(e["event"] == kind and e.get(key) == value for e in events), f"{path.name}: no {kind} {value}"
    report = replay(load_trace(events))
    assert report.identical, report.format()
    assert report.ticks_compared == max(e["tick"] for e in events if e["event"] == "plan") + 1
    assert report.requests == sum(e["event"] == "arrival" for e in events)
