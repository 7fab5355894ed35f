"""Decision replay: a trace the engine wrote replays to identical plans with no model; an edited token or
arrival is reported at the right tick; broken traces are refused clearly."""

import json

import pytest

from scheduler import Engine, EngineConfig, SamplingParams
from scheduler.cli import main
from scheduler.events import read_jsonl
from scheduler.tools.replay import TraceError, load_trace, replay

from ..helpers import mixed_prompts

PROMPTS = mixed_prompts(10, 1, 90, seed=3)


@pytest.fixture(scope="module")
def trace_path(text_model, tmp_path_factory):
    """A run with staggered arrivals, chunked prefill, mixed sampling, an abort and a failing processor."""
    model, tokenizer = text_model
    path = tmp_path_factory.mktemp("trace") / "run.jsonl"
    engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=32, max_seqs=4, prefill_chunk=8,
                                                   trace_path=str(path)))

    def bad(tokens, logits):
        raise RuntimeError("bad processor")

    for i, p in enumerate(PROMPTS):
        sampling = SamplingParams(max_tokens=6 + i % 4, temperature=0.0 if i % 2 else 0.8, seed=i)
        if i == 7:
            sampling = SamplingParams(max_tokens=5, logits_processors=(bad,))
        engine.add_request(prompt_tokens=p, sampling=sampling, request_id=f"r{i}")
        engine.step()
        if i == 5:
            engine.abort("r2")
    while engine.has_pending():
        engine.step()
    engine.close()
    return path


def _events(path):
    return read_jsonl(path)


def _write(path, events):
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def test_replay_reproduces_every_plan(trace_path):
    report = replay(load_trace(trace_path))
    assert report.identical, report.format()
    assert report.requests == len(PROMPTS)
    assert report.ticks_compared == max(e["tick"] for e in _events(trace_path) if e["event"] == "plan") + 1
    events = _events(trace_path)
    assert any(e["event"] == "transition" and e["trigger"] == "abort" for e in events)
    assert any(e["event"] == "transition" and e["trigger"] == "fail" for e in events)


def test_an_edited_token_is_reported_at_the_tick_it_changes_a_decision(trace_path, tmp_path):
    events = _events(trace_path)
    eos = load_trace(trace_path).stop_token_ids[0]
    # make r0's first sampled token a stop token: r0 then finishes at that tick (its finish transition and
    # its row's filter are decisions of that tick), where the recording kept it decoding
    outcome = next(e for e in events if e["event"] == "outcome" and "r0" in e["sampled"])
    outcome["sampled"]["r0"] = eos
    report = replay(load_trace(_write(tmp_path / "edited.jsonl", events)))
    assert not report.identical
    assert report.divergence.tick == outcome["tick"]
    assert "transition" in report.divergence.differing_fields
    assert any(e["trigger"] == "finish" and e["request_id"] == "r0"
               for e in report.divergence.replayed["transition"])
    assert any(r["id"] == "r0" for r in report.divergence.requests)


def test_an_edited_arrival_is_reported_at_its_tick(trace_path, tmp_path):
    events = _events(trace_path)
    arrival = next(e for e in events if e["event"] == "arrival" and e["request_id"] == "r3")
    arrival["sampling"]["max_tokens"] = 1
    report = replay(load_trace(_write(tmp_path / "edited.jsonl", events)))
    assert not report.identical
    first_decode = min(e["tick"] for e in events if e["event"] == "plan"
                       and any(c[0] == "r3" and c[3] for c in e["prefill"]))
    # with max_tokens=1, r3 finishes on its first token, in the tick its prefill completes
    assert report.divergence.tick == first_decode
    assert any(e["trigger"] == "finish" and e["request_id"] == "r3"
               for e in report.divergence.replayed["transition"])
    assert "divergence at tick" in report.format()


def test_replay_under_another_config_diverges(trace_path, tmp_path):
    events = _events(trace_path)
    events[0]["config"]["max_seqs"] = 1
    report = replay(load_trace(_write(tmp_path / "other.jsonl", events)))
    assert not report.identical and report.divergence.budgets["max_seqs"] == 1


def test_truncated_trace_is_refused(trace_path, tmp_path):
    text = trace_path.read_text()
    cut = tmp_path / "cut.jsonl"
    middle_line_start = text.index("\n", len(text) // 2) + 1
    cut.write_text(text[: middle_line_start + 10])  # ten characters into a line: a half-written event
    with pytest.raises(TraceError, match="not valid JSON"):
        load_trace(cut)


def test_other_schema_version_is_refused(trace_path, tmp_path):
    events = _events(trace_path)
    events[4]["schema"] = 99
    with pytest.raises(TraceError, match="schema 99"):
        load_trace(_write(tmp_path / "v99.jsonl", events))


def test_trace_without_header_is_refused(trace_path, tmp_path):
    with pytest.raises(TraceError, match="engine_start"):
        load_trace(_write(tmp_path / "headless.jsonl", _events(trace_path)[1:]))


def test_replay_command_exit_codes(trace_path, tmp_path, capsys):
    assert main(["replay", str(trace_path)]) == 0
    assert "identical" in capsys.readouterr().out
    events = _events(trace_path)
    events[0]["config"]["prefill_chunk"] = 3
    assert main(["replay", str(_write(tmp_path / "x.jsonl", events))]) == 1
    assert "DIVERGED" in capsys.readouterr().out
    assert main(["replay", str(tmp_path / "missing.jsonl")]) == 2
