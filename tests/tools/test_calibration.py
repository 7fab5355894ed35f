"""Engine.calibrate(): synthetic ramps that decode at every batch size, recorded in the trace, used by the
cost-model fit and left out of the recorded metrics and of a simulation's arrivals; and the rest-of-tick terms
the fit now learns."""

import numpy as np
import pytest

from scheduler import Engine, EngineConfig, SamplingParams
from scheduler.calibration import CALIBRATION_ID_PREFIX
from scheduler.tools.explain import explain
from scheduler.tools.replay import load_trace, replay
from scheduler.tools.simulate import CostModel, fit_cost_model, recorded_metrics, tick_features
from scheduler.tools.workload import arrivals_from_trace

from ..helpers import mixed_prompts

SLOTS = 4
# a workload that keeps every slot full: all arrive at once, equal lengths of output; the second half extends
# the first half's prompts, so it hits the prefix cache
_FIRST = mixed_prompts(8, 20, 40, seed=3)
WORKLOAD = _FIRST + [p + [7, 8, 9] for p in _FIRST]


def _record(text_model, path, calibrate: bool):
    model, tokenizer = text_model
    engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=256, max_seqs=SLOTS, prefill_chunk=64,
                                                   prefix_cache_bytes=8 << 20, trace_path=str(path)))
    calibration = engine.calibrate(prompt_lens=(8, 48), step_tokens=3) if calibrate else None
    for i, prompt in enumerate(WORKLOAD):
        engine.add_request(prompt_tokens=prompt, sampling=SamplingParams(max_tokens=12), request_id=f"w{i}")
    while engine.has_pending():
        engine.step()
    engine.close()
    return calibration


def _decode_rows(trace, request_ids):
    return {len(plan["decode"]) for plan in trace.plans.values()
            if plan["decode"] and set(plan["decode"]) <= request_ids}


@pytest.fixture(scope="module")
def traces(text_model, tmp_path_factory):
    where = tmp_path_factory.mktemp("calibration")
    plain, calibrated = where / "plain.jsonl", where / "calibrated.jsonl"
    _record(text_model, plain, calibrate=False)
    calibration = _record(text_model, calibrated, calibrate=True)
    return plain, calibrated, calibration


def test_calibration_decodes_at_every_batch_size_and_stays_out_of_the_workload(traces):
    plain, calibrated, calibration = traces
    trace = load_trace(calibrated)
    ids = set(calibration.request_ids)
    assert ids == trace.calibration_ids and len(ids) == 2 * SLOTS
    assert all(rid.startswith(CALIBRATION_ID_PREFIX) for rid in ids)
    assert _decode_rows(trace, ids) == set(range(1, SLOTS + 1))  # every batch size, ramp by ramp
    assert calibration.ticks == max(t for t, p in trace.plans.items() if set(p["decode"]) & ids) + 1
    # the workload's numbers are the workload's: the same requests, counts and ticks as without calibration
    real, base = recorded_metrics(calibrated), recorded_metrics(plain)
    for key in ("requests", "finished", "output_tokens", "ticks", "cache_hit_rate", "prefix_tokens_saved"):
        assert real[key] == base[key], key
    assert real["cache_hit_rate"] > 0.25  # the check above compares something
    assert {a.request_id for a in arrivals_from_trace(calibrated)} == {f"w{i}" for i in range(len(WORKLOAD))}


def test_explain_leaves_the_calibration_out_unless_asked(traces):
    _plain, calibrated, calibration = traces
    stories = explain(calibrated)
    assert {s.request_id for s in stories} == {f"w{i}" for i in range(len(WORKLOAD))}
    assert {s.request_id for s in explain(calibrated, slowest=3)} <= {s.request_id for s in stories}
    asked = calibration.request_ids[0]
    assert [s.request_id for s in explain(calibrated, [asked])] == [asked]


def test_a_calibrated_trace_replays_identically(traces):
    _plain, calibrated, _ = traces
    report = replay(load_trace(calibrated))
    assert report.divergence is None and report.ticks_compared > 0


def test_calibration_lets_the_fit_see_batch_sizes_the_workload_never_ran(traces):
    plain, calibrated, _ = traces
    narrow, wide = fit_cost_model(plain), fit_cost_model(calibrated)
    assert narrow.decode_rows_seen[0] == narrow.decode_rows_seen[1] == SLOTS  # the workload kept 4 rows
    assert "too narrow" in narrow.describe()
    assert wide.decode_rows_seen == (1, SLOTS) and "too narrow" not in wide.describe()


def test_calibration_refuses_a_busy_engine_and_clears_its_prefix_entries(text_model):
    model, tokenizer = text_model
    engine = Engine(model, tokenizer, EngineConfig(max_seqs=3, prefix_cache_bytes=8 << 20))
    rid = engine.add_request(prompt_tokens=WORKLOAD[0], sampling=SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="idle"):
        engine.calibrate()
    while engine.has_pending():  # the pending request is untouched and completes
        engine.step()
    assert engine.state_of(rid).value == "finished"
    entries = engine.prefix_cache_stats()["entry_count"]
    engine.calibrate(prompt_lens=(40,), step_tokens=2)
    engine.step()  # the clear applies at the start of the next tick
    assert engine.prefix_cache_stats()["entry_count"] == 0 < entries
    with pytest.raises(ValueError, match="step_tokens"):
        engine.calibrate(step_tokens=0)
    engine.close()


def test_the_rest_of_a_tick_is_fitted_per_row_and_per_chunk():
    """Bookkeeping outside the timed phases grows with the rows and chunks a tick schedules: a trace whose rest
    is 0.1 ms + 40 us per row + 300 us per chunk is predicted tick by tick (the old fit put one constant
    there: off by the per-row part on the narrowest and widest ticks)."""
    rng = np.random.default_rng(0)
    events = [{"schema": 2, "seq": 0, "tick": 0, "event": "engine_start", "config": {"max_seqs": 16},
               "measure": {"t": 0.0}}]
    t, expected = 0.0, []
    for tick in range(300):
        chunks = [[f"p{tick}-{j}", 0, int(rng.integers(8, 64)), False] for j in range(int(rng.integers(0, 3)))]
        decode = [f"d{j}" for j in range(int(rng.integers(1, 17)))]
        tokens = sum(c[2] for c in chunks)
        prefill_s = 20e-6 * tokens
        decode_s = 1e-3 + 60e-6 * len(decode)
        rest = 100e-6 + 40e-6 * len(decode) + 300e-6 * len(chunks)
        tick_s = (prefill_s + decode_s + rest) * rng.normal(1.0, 0.01)
        expected.append(tick_s)
        events.append({"schema": 2, "seq": len(events), "tick": tick, "event": "plan", "admitted": [],
                       "prefill": chunks, "decode": decode, "num_batched_tokens": tokens + len(decode)})
        events.append({"schema": 2, "seq": len(events), "tick": tick, "event": "outcome", "sampled": {},
                       "errors": {}, "measure": {"t": t + tick_s, "tick_start_t": t, "tick_s": tick_s,
                                                 "vision_s": 0.0, "prefill_s": prefill_s, "decode_s": decode_s}})
        t += tick_s
    fitted = fit_cost_model(events)
    plans = [e for e in events if e["event"] == "plan"]
    predicted = [fitted.tick_seconds(*(tick_features(p["prefill"], p["decode"], p["num_batched_tokens"])[1:4]))
                 - fitted.overhead for p in plans]
    errors = np.abs(np.asarray(predicted) - expected) / expected
    assert np.percentile(errors, 95) < 0.05, fitted.describe()
    one_constant = CostModel(base=float(np.mean([e - (20e-6 * sum(c[2] for c in p["prefill"]) + 1e-3
                                                      + 60e-6 * len(p["decode"]))
                                                  for e, p in zip(expected, plans)])),
                             per_prefill_token=20e-6, per_decode_row=60e-6, per_decode_forward=1e-3)
    old = [one_constant.tick_seconds(*(tick_features(p["prefill"], p["decode"], p["num_batched_tokens"])[1:4]))
           for p in plans]
    assert np.percentile(np.abs(np.asarray(old) - expected) / expected, 95) > 0.1  # the check can fail


def _ramp_then_workload(workload_factor: float) -> list[dict]:
    """Calibration ticks decoding 1..8 rows at 1 ms + 0.1 ms a row, then workload ticks at 8 rows costing
    `workload_factor` times that (the machine serving is slower than on the clean ramps)."""
    events = [{"schema": 2, "seq": 0, "tick": 0, "event": "engine_start", "config": {"max_seqs": 8},
               "measure": {"t": 0.0}}]
    t = 0.0
    for tick in range(400):
        calibrating = tick < 200
        rows = 1 + tick % 8 if calibrating else 8
        decode = [f"{'c' if calibrating else 'w'}{j}" for j in range(rows)]
        tick_s = (1e-3 + 100e-6 * rows) * (1.0 if calibrating else workload_factor)
        events.append({"schema": 2, "seq": len(events), "tick": tick, "event": "plan", "admitted": [],
                       "prefill": [], "decode": decode, "num_batched_tokens": rows})
        events.append({"schema": 2, "seq": len(events), "tick": tick, "event": "outcome", "sampled": {},
                       "errors": {}, "measure": {"t": t + tick_s, "tick_start_t": t, "tick_s": tick_s}})
        t += tick_s
    events.append({"schema": 2, "seq": len(events), "tick": 400, "event": "calibration",
                   "request_ids": [f"c{j}" for j in range(8)]})
    return events


def test_the_workload_sets_the_level_of_terms_the_calibration_helps_shape():
    events = _ramp_then_workload(1.3)
    workload = [e["measure"]["tick_s"] for e in events if e["event"] == "outcome" and e["tick"] >= 200]
    fitted = fit_cost_model(events)
    predicted = fitted.tick_seconds(0, 8, 0) - fitted.overhead
    assert predicted == pytest.approx(np.mean(workload), rel=0.01)
    # the same ticks with nothing marked as calibration: the level is the average of both (the check can fail)
    unmarked = fit_cost_model([e for e in events if e["event"] != "calibration"])
    assert unmarked.tick_seconds(0, 8, 0) - unmarked.overhead < 0.95 * np.mean(workload)
