"""Engines served side by side (scheduler/tools/side_by_side.py): each on a clock that runs only in its own
turns, idle gaps skipped rather than slept, the same tokens as a lone run."""

import json
import time

import pytest

from scheduler import Engine, EngineConfig, SamplingParams
from scheduler.tools.side_by_side import EngineClock, Lane, run_side_by_side


def test_engine_clock_runs_only_while_started():
    clock = EngineClock()
    assert clock() == 0.0 and not clock.running
    time.sleep(0.01)
    assert clock() == 0.0  # stopped: wall time passes, the clock does not
    clock.start()
    time.sleep(0.01)
    clock.stop()
    ran = clock()
    assert ran >= 0.01
    time.sleep(0.01)
    assert clock() == ran
    clock.skip(2.5)
    assert clock() == pytest.approx(ran + 2.5)
    with pytest.raises(ValueError, match="cannot go back"):
        clock.skip(-1.0)


def test_a_lane_needs_an_engine_clock_and_ordered_offsets(text_model_dir):
    engine = Engine.from_pretrained(text_model_dir)
    with pytest.raises(TypeError, match="EngineClock"):
        Lane(engine, [{"prompt_tokens": [5, 6]}], [0.0])
    engine.close()
    engine = Engine.from_pretrained(text_model_dir, clock=EngineClock())
    with pytest.raises(ValueError, match="arrival order"):
        Lane(engine, [{"prompt_tokens": [5, 6]}] * 2, [1.0, 0.5])
    with pytest.raises(ValueError, match="offsets"):
        Lane(engine, [{"prompt_tokens": [5, 6]}] * 2, [0.0])
    engine.close()


def test_side_by_side_lanes_keep_their_own_time_and_tokens(text_model_dir, tmp_path):
    """Two configs serve the same arrivals; the last one comes 30 s after the others. Each lane's clock skips the
    idle gap instead of sleeping it, so its trace says 30 s passed while the run took far less; each lane's
    trace stamps its own clock; and the tokens are those of a lone run."""
    prompts = [[(7 * i + j) % 150 + 5 for j in range(4 + 3 * i)] for i in range(5)]
    sampling = SamplingParams(max_tokens=6)
    requests = [dict(prompt_tokens=p, sampling=sampling) for p in prompts]
    offsets = [0.0, 0.0, 0.01, 0.02, 30.0]
    configs = [EngineConfig(max_seqs=4, trace_path=str(tmp_path / "a.jsonl")),
               EngineConfig(max_seqs=2, trace_path=str(tmp_path / "b.jsonl"))]
    engines = [Engine.from_pretrained(text_model_dir, c, clock=EngineClock()) for c in configs]
    start = time.perf_counter()
    results = run_side_by_side([Lane(engines[0], requests, offsets, calibrate=True),
                                Lane(engines[1], requests, offsets)])
    wall = time.perf_counter() - start
    for engine in engines:
        engine.close()
    assert wall < 30.0 and all(r.seconds > 30.0 for r in results) and all(r.ticks > 0 for r in results)
    lone = Engine.from_pretrained(text_model_dir, EngineConfig(max_seqs=4))
    expected = [o.token_ids for o in lone.generate(prompts, sampling)]
    lone.close()
    for name in ("a.jsonl", "b.jsonl"):
        events = [json.loads(line) for line in open(tmp_path / name)]
        arrivals = {e["request_id"]: e["measure"]["t"] for e in events if e["event"] == "arrival"
                    and e["request_id"].startswith("q")}
        times = [e["measure"]["t"] for e in events if e["event"] in ("arrival", "outcome")]
        assert times == sorted(times)  # one clock per trace, never going back
        assert arrivals["q4"] - arrivals["q0"] > 29.9  # q0 came in a little after its offset 0 (its own add)
        sampled: dict[str, list[int]] = {}
        for e in events:
            if e["event"] == "outcome":
                for rid, token in e["sampled"].items():
                    sampled.setdefault(rid, []).append(token)
        assert [sampled[f"q{i}"] for i in range(5)] == expected
