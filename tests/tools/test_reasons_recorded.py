"""Reasons in recorded runs: a real engine's trace carries the reasons (and the row reasons) and replays them;
replay flags an edited reason; the vLLM-shaped step fields agree with the plan; older traces without these
fields still replay; `mlxsched explain` tells the slowest requests. (The reason vocabulary itself, scenario by
scenario and model-free: tests/core/test_reasons.py.)"""

import json

import pytest

from scheduler import Engine, EngineConfig, SamplingParams
from scheduler.cli import main
from scheduler.events import read_jsonl
from scheduler.plan import ROW_REASONS, Reason
from scheduler.tools.explain import explain
from scheduler.tools.replay import load_trace, replay

from ..helpers import mixed_prompts


@pytest.fixture(scope="module")
def trace_path(text_model, tmp_path_factory):
    model, tokenizer = text_model
    path = tmp_path_factory.mktemp("reasons") / "run.jsonl"
    engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=24, max_seqs=3, prefill_chunk=8,
                                                   trace_path=str(path)))
    for i, p in enumerate(mixed_prompts(8, 4, 40, seed=5)):
        engine.add_request(prompt_tokens=p, sampling=SamplingParams(max_tokens=4 + i % 3), request_id=f"r{i}")
        if i == 4:
            engine.step()
            engine.abort("r1")
    while engine.has_pending():
        engine.step()
    engine.close()
    return path


def _write(path, events):
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def test_a_recorded_run_carries_reasons_and_replays_them(trace_path):
    events = read_jsonl(trace_path)
    assert any(e.get("reasons") for e in events if e["event"] == "plan")
    assert replay(load_trace(trace_path)).identical


def test_replay_flags_an_edited_reason(trace_path, tmp_path):
    events = read_jsonl(trace_path)
    plan = next(e for e in events if e["event"] == "plan" and e.get("reasons"))
    plan["reasons"][0][1] = "kv_budget" if plan["reasons"][0][1] != "kv_budget" else "max_seqs"
    report = replay(load_trace(_write(tmp_path / "edited.jsonl", events)))
    assert not report.identical
    assert report.divergence.tick == plan["tick"] and report.divergence.differing_fields == ["reasons"]


def test_a_trace_from_before_reasons_still_replays(trace_path, tmp_path):
    events = read_jsonl(trace_path)
    del events[0]["plan_records"]
    for e in events:
        for key in ("reasons", "reasons_cleared", "step"):
            e.pop(key, None)
    assert replay(load_trace(_write(tmp_path / "old.jsonl", events))).identical


def test_step_fields_agree_with_the_plan(trace_path):
    events = read_jsonl(trace_path)
    ended_since: list[str] = []
    for e in events:
        if e["event"] == "transition" and e["trigger"] in ("finish", "abort", "fail"):
            ended_since.append(e["request_id"])
        if e["event"] != "plan":
            continue
        step = e["step"]
        drafts = dict(map(tuple, e["draft"]))
        assert step["scheduled"] == e["decode"] + [c[0] for c in e["prefill"]]
        assert step["num_scheduled_tokens"] == [1 + drafts.get(r, 0) for r in e["decode"]] + [
            c[2] - c[1] for c in e["prefill"]]
        assert sum(step["num_scheduled_tokens"]) == e["num_batched_tokens"]
        assert step["preempted"] == e["preempted"]
        assert step["finished"] == ended_since
        ended_since = []
    assert any(e["step"]["finished"] for e in events if e["event"] == "plan")


def test_explain_cli_tells_the_slowest(trace_path, capsys):
    assert main(["explain", str(trace_path), "--slowest", "2"]) == 0
    out = capsys.readouterr().out
    stories = explain(str(trace_path), slowest=2)
    assert [s.request_id for s in stories] == [line.split(":")[0] for line in out.splitlines()
                                                if line.startswith("r") and ": arrived" in line]
    # the aborted request never got a token: it counts as slowest; then the worst TTFT of the rest
    assert stories[0].request_id == "r1" and stories[0].end == "abort" and stories[0].ttft_s is None
    ttfts = [s.ttft_s for s in explain(str(trace_path)) if s.ttft_s is not None]
    assert stories[1].ttft_s == max(ttfts)
    assert "max_seqs" in out  # with 3 slots and 8 requests, the slowest waited for a slot
    assert main(["explain", str(trace_path), "nope"]) == 2


@pytest.fixture(scope="module")
def row_trace_path(text_model, tmp_path_factory):
    """prefill-first with drafting: running rows pause for prefill, draft less than draft_tokens when the
    budget is short, a row with a penalty never drafts, and one with min_tokens drafts only past them."""
    model, tokenizer = text_model
    path = tmp_path_factory.mktemp("row-reasons") / "run.jsonl"
    engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=8, max_seqs=3, prefill_chunk=8,
                                                   draft_tokens=2, mix="prefill-first", trace_path=str(path)))
    prompts = mixed_prompts(5, 4, 20, seed=9)
    for i, p in enumerate(prompts):
        sampling = SamplingParams(max_tokens=8, presence_penalty=0.5 if i == 1 else 0.0, min_tokens=4 if i == 3 else 0)
        engine.add_request(prompt_tokens=p, sampling=sampling, request_id=f"r{i}")
        for _ in range(3):
            engine.step()
    while engine.has_pending():
        engine.step()
    engine.close()
    return path


def test_a_recorded_run_carries_row_reasons_and_replays_them(row_trace_path):
    events = read_jsonl(row_trace_path)
    recorded = {r[1] for e in events if e["event"] == "plan" for r in e.get("reasons", [])}
    assert {r.value for r in ROW_REASONS} <= recorded
    assert replay(load_trace(row_trace_path)).identical
    held = {w.reason for story in explain(str(row_trace_path)) for w in story.waits}
    assert ROW_REASONS <= held
    assert (Reason.DRAFT_INELIGIBLE, ()) in {(w.reason, w.others) for w in explain(str(row_trace_path), ["r1"])[0].waits}


def test_replay_compares_row_reasons_only_in_traces_that_record_them(row_trace_path, tmp_path):
    events = read_jsonl(row_trace_path)
    row_values = {r.value for r in ROW_REASONS}
    first = next(e for e in events if e["event"] == "plan" and any(r[1] in row_values for r in e.get("reasons", [])))
    edited = json.loads(json.dumps(events))
    plan = next(e for e in edited if e["event"] == "plan" and e["tick"] == first["tick"])
    record = next(r for r in plan["reasons"] if r[1] in row_values)
    record[1] = "draft_budget" if record[1] != "draft_budget" else "prefill_first"
    report = replay(load_trace(_write(tmp_path / "edited.jsonl", edited)))
    assert report.divergence.tick == first["tick"] and report.divergence.differing_fields == ["reasons"]
    # a header without the row_reasons group says the engine did not record them: replay leaves them out, so
    # this (new) trace now differs at its first row reason, where an older engine's trace has none
    events[0]["plan_records"].remove("row_reasons")
    report = replay(load_trace(_write(tmp_path / "predates.jsonl", events)))
    assert report.divergence.tick == first["tick"] and report.divergence.differing_fields == ["reasons"]
    assert not any(r[1] in row_values for r in report.divergence.replayed.get("reasons", []))
