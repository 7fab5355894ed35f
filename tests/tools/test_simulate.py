"""Model-free simulation: the synthetic workload generator, the fitted cost model, simulate() on a real
engine's trace (same policy reproduces it; another config changes it plausibly) and on a large synthetic
workload (speed, no model)."""

import dataclasses
import json
import statistics

import numpy as np
import pytest

from scheduler.events import read_jsonl

from scheduler import Engine, EngineConfig, SamplingParams
from scheduler.tools.simulate import (
    FEATURES,
    PHASES,
    CostModel,
    SimExecutor,
    apply_overrides,
    compare_table,
    context_features,
    fit_cost_model,
    load_recorded,
    nnls,
    recorded_metrics,
    simulate,
    tick_features,
    what_if,
)
from scheduler.plan import PrefillChunk, TickPlan
from scheduler.tools.workload import Lognormal, SimArrival, arrivals_from_trace, synthetic_workload

from ..helpers import mixed_prompts

PROMPTS = mixed_prompts(24, 1, 90, seed=5)
ABORTED, FAILING = "r3", "r9"


# The tests on `trace_path` fit a cost model to the recorded run's tick times (and the fixture records it within
# the first of them): they run with no other test running, whose load would bend those times
RECORDED_TIMINGS = pytest.mark.exclusive


@pytest.fixture(scope="module")
def trace_path(text_model, tmp_path_factory):
    """A real run on the tiny model: staggered arrivals, chunked prefill, an abort, a failing request."""
    model, tokenizer = text_model
    path = tmp_path_factory.mktemp("sim-trace") / "run.jsonl"
    engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=32, max_seqs=4, prefill_chunk=8,
                                                   trace_path=str(path)))

    def bad(tokens, logits):
        raise RuntimeError("bad processor")

    for i, p in enumerate(PROMPTS):
        sampling = SamplingParams(max_tokens=6 + i % 7, temperature=0.0 if i % 2 else 0.8, seed=i)
        if f"r{i}" == FAILING:
            sampling = SamplingParams(max_tokens=5, logits_processors=(bad,))
        engine.add_request(prompt_tokens=p, sampling=sampling, request_id=f"r{i}")
        engine.step()
        if i % 3 == 2:
            engine.step()  # two ticks between some arrivals: not every tick has a newcomer
        if i == 6:
            engine.abort(ABORTED)
    while engine.has_pending():
        engine.step()
    engine.close()
    return path


def _events(path):
    return read_jsonl(path)


def _recorded_tokens(path):
    counts = {}
    for e in _events(path):
        if e["event"] == "outcome":
            for rid in e["sampled"]:
                if rid not in e["errors"]:  # a failing row's token is dropped by apply
                    counts[rid] = counts.get(rid, 0) + 1
    return counts


def _ended_by(path, trigger):
    return {e["request_id"] for e in _events(path) if e["event"] == "transition" and e["trigger"] == trigger}


# ---- the workload generator ------------------------------------------------------------------------------


def test_workload_is_deterministic_per_seed():
    kwargs = dict(prompt_len=(4, 64), output_len=(1, 32), shared_prefix_share=0.3, shared_prefix_len=8,
                  image_share=0.2)
    a = synthetic_workload(200, 10.0, seed=7, **kwargs)
    b = synthetic_workload(200, 10.0, seed=7, **kwargs)
    c = synthetic_workload(200, 10.0, seed=8, **kwargs)
    assert a == b
    assert [x.arrival_time for x in a] != [x.arrival_time for x in c]
    assert [x.prompt_tokens for x in a] != [x.prompt_tokens for x in c]
    # another knob does not move the arrival times (separate random streams)
    d = synthetic_workload(200, 10.0, seed=7, prompt_len=(4, 64), output_len=(1, 32))
    assert [x.arrival_time for x in d] == [x.arrival_time for x in a]


def test_workload_rates_and_lengths_are_right_on_average():
    n, rate = 4000, 20.0
    arrivals = synthetic_workload(n, rate, prompt_len=(16, 512), output_len=(16, 256), image_share=0.25, seed=1)
    times = [a.arrival_time for a in arrivals]
    assert times == sorted(times) and times[0] > 0
    gaps = np.diff([0.0] + times)
    assert abs(gaps.mean() - 1 / rate) < 0.1 / rate  # exponential: mean 1/rate ...
    assert abs(np.std(gaps) - 1 / rate) < 0.15 / rate  # ... and standard deviation 1/rate
    prompt_lens = [a.prompt_len for a in arrivals]
    outputs = [a.output_len for a in arrivals]
    assert min(prompt_lens) >= 16 and max(prompt_lens) <= 512
    assert abs(statistics.mean(prompt_lens) - 264) < 0.05 * 264
    assert abs(statistics.mean(outputs) - 136) < 0.05 * 136
    assert all(1 <= a.output_len <= a.max_tokens == 256 for a in arrivals)  # max_tokens: the spec's upper bound
    assert all(7 <= t <= 511 for a in arrivals[:200] for t in a.prompt_tokens)
    assert abs(sum(a.num_images > 0 for a in arrivals) / n - 0.25) < 0.04
    assert len({a.request_id for a in arrivals}) == n

    logn = synthetic_workload(4000, None, prompt_len=Lognormal(mean=100, sigma=0.5), output_len=8, seed=2)
    assert all(a.arrival_time == 0.0 for a in logn)  # no rate: everything at once
    assert abs(statistics.mean(a.prompt_len for a in logn) - 100) < 6
    assert all(a.output_len == a.max_tokens == 8 for a in logn)
    spec = synthetic_workload(500, 5.0, prompt_len={"dist": "lognormal", "mean": 50, "sigma": 1.0, "lo": 10,
                                                    "hi": 60}, seed=3)
    assert all(10 <= a.prompt_len <= 60 for a in spec)


def test_shared_prefixes_are_really_shared():
    n, share, plen = 2000, 0.4, 32
    arrivals = synthetic_workload(n, 50.0, prompt_len=(48, 128), shared_prefix_share=share, shared_prefix_len=plen,
                                  num_prefixes=3, seed=4)
    heads = {}
    for a in arrivals:
        heads.setdefault(tuple(a.prompt_tokens[:plen]), []).append(a)
    shared = {h: group for h, group in heads.items() if len(group) > 1}
    assert len(shared) == 3  # exactly the three prefixes repeat
    n_shared = sum(len(g) for g in shared.values())
    assert abs(n_shared / n - share) < 0.04
    for group in shared.values():
        assert all(a.prompt_len > plen for a in group)  # the prefix plus a suffix of its own
        assert len({tuple(a.prompt_tokens) for a in group}) == len(group)


@pytest.mark.parametrize("kwargs", [
    dict(rate_per_s=0.0),
    dict(shared_prefix_share=1.5),
    dict(shared_prefix_share=0.5, shared_prefix_len=0),
    dict(prompt_len=(0, 4)),
    dict(prompt_len=(9, 4)),
    dict(output_len="long"),
    dict(prompt_len={"dist": "zipf"}),
])
def test_workload_rejects_bad_specs(kwargs):
    args = dict(n=10, rate_per_s=1.0)
    args.update(kwargs)
    with pytest.raises(ValueError):
        synthetic_workload(**args)


# ---- pieces ----------------------------------------------------------------------------------------------


def test_nnls_is_exact_and_non_negative():
    rng = np.random.default_rng(0)
    a = rng.uniform(0, 1, (60, 4))
    truth = np.array([0.5, 0.0, 2.0, 1.0])
    assert np.allclose(nnls(a, a @ truth), truth, atol=1e-9)
    b = a @ np.array([1.0, -3.0, 0.5, 0.2]) + rng.normal(0, 0.01, 60)  # unconstrained fit is negative
    x = nnls(a, b)
    assert np.all(x >= 0)
    grad = a.T @ (a @ x - b)  # KKT: zero gradient on the support, non-negative off it
    assert np.all(grad[x == 0] >= -1e-9) and np.allclose(grad[x > 0], 0, atol=1e-8)


def test_sim_executor_tokens_stops_and_errors():
    cost = CostModel(base=0.01, per_decode_row=0.001)
    arrivals = [SimArrival("a", 0.0, [7] * 3, max_tokens=5, output_len=2),
                SimArrival("b", 0.0, [7] * 3, max_tokens=3, output_len=3),
                SimArrival("c", 0.0, [7] * 3, max_tokens=4, output_len=4, error_after=1)]
    ex = SimExecutor(cost, arrivals, stop_token_ids=[0, 2])
    assert ex.ordinary_token == 7 and ex.stop_token == 0
    first = TickPlan(0, admitted=("a", "b", "c"), prefill=tuple(PrefillChunk(r, 0, 3, True) for r in "abc"),
                     num_batched_tokens=9, num_seqs=3)
    r1 = ex.execute(first)
    assert r1.sampled == {"a": 7, "b": 7, "c": 7} and not r1.errors
    assert ex.clock == pytest.approx(cost.plan_seconds(first))
    r2 = ex.execute(TickPlan(1, decode=("a", "b", "c"), num_batched_tokens=3, num_seqs=3))
    assert r2.sampled == {"a": 0, "b": 7} and "c" in r2.errors  # a stops at output_len; c fails
    r3 = ex.execute(TickPlan(2, decode=("b",), num_batched_tokens=1, num_seqs=1))
    assert r3.sampled == {"b": 7}  # output_len == max_tokens: no stop token, max_tokens ends it


def test_cost_model_features_follow_the_executor():
    # a completing chunk's last prompt token runs in the decode forward: 8 + 4 - 1 prefill tokens, 2 + 1 rows
    row = tick_features([["a", 0, 8, False], ["b", 4, 8, True]], ["c", "d"], 14)
    assert row == [1.0, 11.0, 3.0, 2.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert len(row) == len(FEATURES)
    cost = CostModel(*[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0])
    plan = TickPlan(0, prefill=(PrefillChunk("a", 0, 8, False), PrefillChunk("b", 4, 8, True)), decode=("c", "d"),
                    num_batched_tokens=14, num_seqs=4)
    assert cost.plan_seconds(plan) == pytest.approx(float(np.dot(row, cost.coefficients)))
    # media: 2 images encoded (vision-cache misses); b carries media, so its 3 prefill tokens cost the media term
    # and 30 media tokens in those images; the 3 decode rows attend over 100 tokens of context in all
    media_row = tick_features([["a", 0, 8, False], ["b", 4, 8, True]], ["c", "d"], 14, 2, lambda rid: rid == "b",
                              30, 100)
    assert media_row == [1.0, 11.0, 3.0, 2.0, 1.0, 1.0, 2.0, 3.0, 30.0, 100.0, 0.0, 0.0, 0.0]
    assert cost.plan_seconds(plan, 2, lambda rid: rid == "b", 30, 100) == pytest.approx(
        float(np.dot(media_row, cost.coefficients)))
    # sampling: b (completing: it decodes this tick) and d sample, a (prefill only) does not count
    samples = {"a", "b", "d"}.__contains__
    sampling_row = tick_features([["a", 0, 8, False], ["b", 4, 8, True]], ["c", "d"], 14, samples=samples)
    assert sampling_row == [1.0, 11.0, 3.0, 2.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 0.0]
    assert cost.plan_seconds(plan, samples=samples) == pytest.approx(float(np.dot(sampling_row, cost.coefficients)))
    # a merge (b completes): the batch of c, d and b is copied at the longest row's length, 3 x 60
    assert context_features([60, 25, 15], merges=True) == (100, 180)
    assert context_features([60, 25, 15], merges=False) == (100, 0) and context_features([], True) == (0, 0)
    merge_row = tick_features([["a", 0, 8, False], ["b", 4, 8, True]], ["c", "d"], 14, context_tokens=100,
                              join_padded_tokens=180)
    assert merge_row[FEATURES.index("per_join_padded_token")] == 180.0
    assert cost.plan_seconds(plan, context_tokens=100, join_padded_tokens=180) == pytest.approx(
        float(np.dot(merge_row, cost.coefficients)))


def test_sim_executor_counts_what_a_merge_copies():
    """The simulator reads a tick's context features as the fit does: the first tick merges prompts of 3, 5 and
    3 tokens (11 of context; 3 rows x the longest 5 copied), the decode tick after it merges nothing."""
    cost = CostModel(per_context_token=0.001, per_join_padded_token=0.01)
    arrivals = [SimArrival("a", 0.0, [7] * 3, max_tokens=4, output_len=4),
                SimArrival("b", 0.0, [7] * 5, max_tokens=4, output_len=4),
                SimArrival("c", 0.0, [7] * 3, max_tokens=4, output_len=4)]
    ex = SimExecutor(cost, arrivals, stop_token_ids=[0])
    first = TickPlan(0, admitted=("a", "b", "c"), prefill=(PrefillChunk("a", 0, 3, True), PrefillChunk("b", 0, 5, True),
                                                          PrefillChunk("c", 0, 3, True)), num_batched_tokens=11, num_seqs=3)
    ex.execute(first)
    assert ex.clock == pytest.approx(0.001 * 11 + 0.01 * 15)
    ex.execute(TickPlan(1, decode=("a", "b", "c"), num_batched_tokens=3, num_seqs=3))
    assert ex.clock == pytest.approx(0.001 * 11 + 0.01 * 15 + 0.001 * 14)  # each row produced one token


def test_first_chunks_that_must_reach_far_plan_as_the_engine_plans_them():
    """An image prompt whose first chunk must reach 30 tokens (`first_chunk_reach`, as a Gemma 4 trace records
    it): under prefill_chunk 8 it runs (its first chunk reaching 30: the invariants, checked every tick, hold the
    planner to it); with a tick's budget of 24 it is refused
    as the engine refuses it at add_request (outcome "error", never queued), and the text request runs."""
    arrivals = [SimArrival("img", 0.0, [7] * 40, max_tokens=3, output_len=3, num_images=1, num_media_tokens=20,
                           media_key="m", first_chunk_reach=30),
                SimArrival("txt", 0.0, [7] * 10, max_tokens=3, output_len=3)]
    fits = simulate(arrivals, EngineConfig(max_batched_tokens=40, prefill_chunk=8, max_seqs=4,
                                           check_invariants=True), CostModel(base=0.01))
    assert [r.outcome for r in fits.requests] == ["finished", "finished"]
    refused = simulate(arrivals, EngineConfig(max_batched_tokens=24, prefill_chunk=8, max_seqs=4,
                                              check_invariants=True), CostModel(base=0.01))
    assert [r.outcome for r in refused.requests] == ["error", "finished"]


def test_compare_table_and_overrides():
    table = compare_table({"one": {"ttft_p50_s": 0.0123, "ticks": 7, "cache_hit_rate": None},
                           "two": {"ttft_p50_s": 0.5, "ticks": 9}})
    lines = table.splitlines()
    assert lines[0] == "| metric | one | two |" and len(lines) == 5
    assert "| TTFT p50 (ms) | 12.3 | 500 |" in lines and "| ticks | 7 | 9 |" in lines
    assert "| prefix cache hit rate | - | - |" in lines
    base = EngineConfig()
    assert apply_overrides(base, {"max_seqs": "4", "policy": "fcfs", "max_model_len": "none"}) == EngineConfig(
        max_seqs=4, max_model_len=None)
    with pytest.raises(ValueError, match="unknown config field"):
        apply_overrides(base, {"max_seq": 4})
    with pytest.raises(ValueError, match="integer"):
        apply_overrides(base, {"max_seqs": "many"})


# ---- on a real run's trace -------------------------------------------------------------------------------


@RECORDED_TIMINGS
def test_arrivals_from_trace(trace_path):
    arrivals = {a.request_id: a for a in arrivals_from_trace(trace_path)}
    assert list(arrivals) == [f"r{i}" for i in range(len(PROMPTS))]
    tokens = _recorded_tokens(trace_path)
    finished = _ended_by(trace_path, "finish")
    assert ABORTED not in finished and FAILING not in finished
    for rid in finished:
        assert arrivals[rid].output_len == tokens[rid] <= arrivals[rid].max_tokens
    assert arrivals[ABORTED].abort_time > arrivals[ABORTED].arrival_time
    assert arrivals[ABORTED].output_len == arrivals[ABORTED].max_tokens
    assert arrivals[FAILING].error_after == tokens.get(FAILING, 0) == 0
    times = [a.arrival_time for a in arrivals.values()]
    assert times == sorted(times)
    assert [a.prompt_tokens for a in arrivals.values()] == PROMPTS


@RECORDED_TIMINGS
def test_fitted_cost_model_is_non_negative_and_predicts_tick_times(trace_path):
    cost = fit_cost_model(trace_path)
    assert all(c >= 0 for c in cost.coefficients) and cost.slowdown > 0  # NNLS: no negative term
    rec = load_recorded(trace_path)
    assert cost.n_ticks == len(rec.trace.outcomes) and 0 <= cost.dropped < cost.n_ticks / 3
    # Loose: the tiny model's ticks are a few ms, and other work shares this machine (spikes of 10x happen);
    # the typical tick is what the terms must get right, the spikes go into `slowdown`.
    # (recovering known terms and predicting held-out ticks: the synthetic tests below; the predicted total of
    # the fitted ticks equals the recording by construction of `slowdown`, so it is not checked)
    assert cost.typical_rel_error < 0.5, cost.describe()
    for robust in (None, 5.0):
        other = fit_cost_model(trace_path, outlier_mads=robust)
        assert all(c >= 0 for c in other.coefficients) and other.slowdown > 0
    assert "R^2" in cost.describe()


def _synthetic_trace(true: CostModel, n_ticks: int, spikes: int, seed: int = 0) -> list[dict]:
    """A trace whose tick times follow `true` (+2% noise), with `spikes` ticks taking 10x as long."""
    rng = np.random.default_rng(seed)
    events = [{"schema": 1, "seq": 0, "tick": 0, "event": "engine_start", "config": {"max_seqs": 8},
               "measure": {"t": 100.0}}]
    t = 100.0
    spiky = set(rng.choice(n_ticks, spikes, replace=False).tolist())
    for tick in range(n_ticks):
        chunks = [[f"p{tick}-{j}", 0, int(rng.integers(1, 64)), bool(rng.random() < 0.4)]
                  for j in range(int(rng.integers(0, 4)))]
        decode = [f"d{j}" for j in range(int(rng.integers(0 if chunks else 1, 9)))]
        nbt = sum(c[2] - c[1] for c in chunks) + len(decode)
        row = tick_features(chunks, decode, nbt)
        seconds = float(np.dot(row, true.coefficients)) * rng.normal(1.0, 0.02) * (10 if tick in spiky else 1)
        events.append({"schema": 1, "seq": len(events), "tick": tick, "event": "plan", "admitted": [],
                       "prefill": chunks, "decode": decode, "num_batched_tokens": nbt, "num_seqs": 8})
        events.append({"schema": 1, "seq": len(events), "tick": tick, "event": "outcome", "sampled": {},
                       "errors": {}, "measure": {"t": t + seconds, "tick_start_t": t, "tick_s": seconds}})
        t += seconds + 50e-6
    return events


def test_fit_recovers_known_terms_despite_spikes():
    true = CostModel(base=1e-3, per_prefill_token=20e-6, per_decode_row=100e-6, per_prefill_chunk=300e-6,
                     per_decode_forward=2e-3, per_prefill_done=500e-6)
    events = _synthetic_trace(true, 400, spikes=12)
    fitted = fit_cost_model(events)
    assert np.allclose(fitted.coefficients, true.coefficients, rtol=0.15, atol=2e-5), fitted
    assert 12 <= fitted.dropped < 40 and fitted.typical_rel_error < 0.03
    assert fitted.overhead == pytest.approx(50e-6, rel=0.01)
    assert 1.2 < fitted.slowdown < 1.5  # 12 of 400 ticks took 10x: ~27% more time than the terms explain
    plain = fit_cost_model(events, outlier_mads=None)  # every tick counts: the spikes bend the terms
    assert plain.typical_rel_error > fitted.typical_rel_error


def test_a_fitted_model_predicts_ticks_it_was_not_fitted_on():
    """Held out: fit on one run, predict another run of the same true costs (other plans, other spike ticks).
    Each tick's terms (the slowdown left out) within 5% typically; the total busy time, spikes included,
    within 8% (the slowdown learnt from one run's spikes carries over to the other's)."""
    true = CostModel(base=1e-3, per_prefill_token=20e-6, per_decode_row=100e-6, per_prefill_chunk=300e-6,
                     per_decode_forward=2e-3, per_prefill_done=500e-6)
    fitted = fit_cost_model(_synthetic_trace(true, 400, spikes=12, seed=1))
    held_out = _synthetic_trace(true, 400, spikes=12, seed=101)
    plans = [e for e in held_out if e["event"] == "plan"]
    actual = [e["measure"]["tick_s"] for e in held_out if e["event"] == "outcome"]
    predicted = [fitted.tick_seconds(*_row(p)) - fitted.overhead for p in plans]
    terms_error = [abs(p / fitted.slowdown - a) / a for p, a in zip(predicted, actual)]
    assert np.median(terms_error) < 0.05
    assert sum(predicted) == pytest.approx(sum(actual), rel=0.08)
    # and a model fitted on a run with other costs does not: the check can fail
    other = fit_cost_model(_synthetic_trace(dataclasses.replace(true, per_decode_row=300e-6), 400, 12, seed=1))
    assert sum(other.tick_seconds(*_row(p)) - other.overhead for p in plans) > 1.12 * sum(actual)


def test_the_fit_says_when_decode_rows_barely_varied():
    true = CostModel(base=1e-3, per_prefill_token=20e-6, per_decode_row=100e-6, per_decode_forward=2e-3)
    varied = fit_cost_model(_synthetic_trace(true, 200, spikes=0))
    lo, hi = varied.decode_rows_seen
    assert 1 <= lo < hi <= 8 and "too narrow" not in varied.describe()
    events = _synthetic_trace(true, 200, spikes=0)
    for e in events:  # every tick decodes the same 6 rows: per-row and per-tick decode costs are one column
        if e["event"] == "plan":
            e["decode"] = [f"d{j}" for j in range(6)]
            e["prefill"] = [[rid, start, end, False] for rid, start, end, _ in e["prefill"]]  # none joins
            e["num_batched_tokens"] = sum(c[2] - c[1] for c in e["prefill"]) + 6
    narrow = fit_cost_model(events)
    assert narrow.decode_rows_seen == (6, 6) and "too narrow" in narrow.describe()


def _row(plan):
    _, prefill_tokens, decode_rows, chunks, _, done, *_media = tick_features(plan["prefill"], plan["decode"],
                                                                    plan["num_batched_tokens"])
    return prefill_tokens, decode_rows, chunks, done


@RECORDED_TIMINGS
def test_simulating_the_recorded_run_reproduces_it(trace_path):
    rec = load_recorded(trace_path)
    config = dataclasses.replace(rec.trace.config, trace_path=None, check_invariants=True)
    result = simulate(arrivals_from_trace(rec), config, fit_cost_model(rec), policy=config.policy,
                      stop_token_id=rec.trace.stop_token_ids[0])
    assert result.all_ended
    by_id = {r.request_id: r for r in result.requests}
    tokens = _recorded_tokens(trace_path)
    for rid in _ended_by(trace_path, "finish"):
        assert by_id[rid].outcome == "finished"
        assert by_id[rid].num_output_tokens == tokens[rid], rid
    assert by_id[FAILING].outcome == "error" and by_id[FAILING].num_output_tokens == 0
    assert by_id[ABORTED].outcome in ("aborted", "finished")  # finished only if the sim outran the abort

    recorded, simulated = recorded_metrics(rec), result.summary()
    assert set(recorded) == set(simulated)
    assert recorded["requests"] == simulated["requests"] == len(PROMPTS)
    assert recorded["ticks"] == len(rec.trace.outcomes)
    assert 0 < recorded["ttft_p50_s"] <= recorded["ttft_p95_s"] <= recorded["ttft_p99_s"]
    assert recorded["tpot_mean_s"] > 0
    assert recorded["request_ticks"] >= recorded["ticks"] and recorded["preemptions"] == 0
    # How close simulated timings come to recorded ones is a timed measurement (bench/, run against peers);
    # here only what cannot drift with load: every request's outcome and output count above, and the held-out
    # cost prediction on known costs (test_a_fitted_model_predicts_ticks_it_was_not_fitted_on).


@RECORDED_TIMINGS
def test_another_config_gives_a_different_plausible_result(trace_path):
    rec = load_recorded(trace_path)
    cost = fit_cost_model(rec)
    arrivals = arrivals_from_trace(rec)
    stop = rec.trace.stop_token_ids[0]
    base = simulate(arrivals, rec.trace.config, cost, stop_token_id=stop).summary()
    one = simulate(arrivals, apply_overrides(rec.trace.config, {"max_seqs": 1}), cost, stop_token_id=stop)
    alone = one.summary()
    assert one.all_ended
    assert alone["queue_mean_s"] > 1.5 * base["queue_mean_s"]
    assert alone["ttft_mean_s"] > base["ttft_mean_s"]
    assert alone["makespan_s"] > base["makespan_s"]
    assert alone["ticks"] > base["ticks"]
    assert alone["finished"] == base["finished"]


@RECORDED_TIMINGS
def test_what_if_table(trace_path):
    text = what_if(trace_path, overrides={"max_seqs": "1"})
    assert text.startswith("cost model:")
    header = next(line for line in text.splitlines() if line.startswith("| metric"))
    assert header == "| metric | recorded | simulated (fcfs) | simulated (max_seqs=1) |"
    assert "| TTFT p95 (ms) |" in text and "| throughput (tok/s) |" in text
    assert "simulation of the recorded policy vs the recording: throughput" in text
    plain = what_if(trace_path)
    assert "simulated (max_seqs=1)" not in plain


# ---- model-free speed ------------------------------------------------------------------------------------


def test_simulates_a_large_synthetic_workload_without_a_model():
    arrivals = synthetic_workload(2000, 50.0, prompt_len=(16, 512), output_len=(16, 256),
                                  shared_prefix_share=0.2, shared_prefix_len=64, seed=11)
    config = EngineConfig(max_seqs=64, max_batched_tokens=2048, prefill_chunk=512)
    cost = CostModel(base=2e-3, per_prefill_token=10e-6, per_decode_row=40e-6, per_prefill_chunk=200e-6,
                     per_decode_forward=1e-3, per_prefill_done=100e-6)
    result = simulate(arrivals, config, cost)
    summary = result.summary()
    assert result.all_ended and summary["finished"] == 2000
    by_id = {r.request_id: r for r in result.requests}
    assert all(by_id[a.request_id].num_output_tokens == a.output_len for a in arrivals)
    assert summary["output_tokens"] == sum(a.output_len for a in arrivals)
    assert result.request_ticks >= result.row_ticks >= summary["output_tokens"]
    print(f"\nsimulated {len(arrivals)} requests, {result.ticks} ticks, {result.request_ticks} request-ticks in "
          f"{result.wall_s:.2f}s: {result.request_ticks_per_s:,.0f} request-ticks/s")


def test_simulate_aborts_on_time_and_jumps_idle_gaps():
    cost = CostModel(base=0.01)
    arrivals = [SimArrival("early", 0.0, [7] * 4, max_tokens=50, output_len=50, abort_time=0.105),
                SimArrival("late", 100.0, [7] * 4, max_tokens=3, output_len=2)]
    result = simulate(arrivals, EngineConfig(max_batched_tokens=16, max_seqs=2, prefill_chunk=8), cost)
    early, late = result.requests
    # ticks start at 0, 0.01, ...: tokens at the ends of ticks 0..10; the tick starting at 0.11 aborts it
    assert early.outcome == "aborted" and early.end == pytest.approx(0.11) and early.num_output_tokens == 11
    assert late.outcome == "finished" and late.num_output_tokens == 2
    assert late.first_token - late.arrival == pytest.approx(0.01)  # the clock jumped to its arrival
    assert result.ticks == 11 + 2
    with pytest.raises(ValueError, match="unique"):
        simulate(arrivals + arrivals[:1], EngineConfig(), cost)


def test_prefix_cache_in_the_simulation():
    """The real prefix cache runs in the sim: shared prefixes hit, hit prompts prefill less."""
    arrivals = synthetic_workload(300, 30.0, prompt_len=(80, 200), output_len=(16, 64), shared_prefix_share=0.6,
                                  shared_prefix_len=64, seed=3)
    cost = CostModel(base=2e-3, per_prefill_token=20e-6, per_decode_row=40e-6, per_decode_forward=1e-3)
    runs = {}
    for budget in (0, 10**8):
        config = EngineConfig(max_seqs=16, max_batched_tokens=512, prefill_chunk=128, prefix_cache_bytes=budget,
                              check_invariants=True)
        runs[budget] = simulate(arrivals, config, cost, kv_bytes_per_token=1000)
        assert runs[budget].all_ended and runs[budget].summary()["finished"] == 300
    off, on = runs[0].summary(), runs[10**8].summary()
    assert off["cache_hit_rate"] is None and off["prefix_tokens_saved"] is None
    assert 0.4 < on["cache_hit_rate"] <= 0.6  # at most the shared share; the first of each prefix misses
    assert on["prefix_tokens_saved"] >= 0.4 * 300 * 48  # whole 16-token blocks of the 64-token prefixes
    assert on["ttft_mean_s"] < off["ttft_mean_s"]


def test_a_recorded_prefix_cache_clear_is_carried_into_the_simulation(text_model, tmp_path):
    """Engine.clear_prefix_cache() is part of the workload: the what-if applies it when the recording did (at
    the first tick at or after its time), so the recorded cache hits are what the simulation of the recorded
    config finds; without the clear it would find one more."""
    model, tokenizer = text_model
    prompt = mixed_prompts(1, 60, 60, seed=9)[0]
    path = tmp_path / "clear.jsonl"
    engine = Engine(model, tokenizer, EngineConfig(prefix_cache_bytes=1 << 22, trace_path=str(path)))
    for wave in range(3):  # the same prompt three times, one after another; the cache is cleared before the third
        if wave == 2:
            assert engine.clear_prefix_cache()
        engine.add_request(prompt_tokens=prompt, sampling=SamplingParams(max_tokens=5))
        while engine.has_pending():
            engine.step()
    engine.close()
    rec = load_recorded(path)
    assert (rec.prefix_hits, rec.prefix_misses) == (1, 2) and len(rec.prefix_clear_times) == 1
    # the clear took effect in the third request's first tick, after it was queued: it is placed at its arrival
    assert rec.prefix_clear_times == [rec.arrival_time["req-2"] - rec.t0]

    config = dataclasses.replace(rec.trace.config, trace_path=None, check_invariants=True)
    settings = rec.simulation_settings()
    cost = fit_cost_model(rec)
    carried = simulate(arrivals_from_trace(rec), config, cost, policy=config.policy, **settings).summary()
    settings["prefix_clear_times"] = []
    dropped = simulate(arrivals_from_trace(rec), config, cost, policy=config.policy, **settings).summary()
    assert carried["cache_hit_rate"] == pytest.approx(1 / 3) == recorded_metrics(rec)["cache_hit_rate"]
    assert dropped["cache_hit_rate"] == pytest.approx(2 / 3)


def test_kv_budget_preempts_in_the_simulation():
    from caches import kv  # an in-repo module: an import error must fail the test, not skip it

    # 1000 bytes per token over 8 layers: a merge holds one layer twice (caches/kv.py join_bytes), so the budget
    # left for growth depends on the layer count as it does on a real model
    layout = kv.KVLayout((kv.LayerLayout(125, None),) * 8)
    arrivals = synthetic_workload(200, 100.0, prompt_len=(32, 128), output_len=(100, 400), seed=3)
    cost = CostModel(base=2e-3, per_prefill_token=20e-6, per_decode_row=40e-6, per_decode_forward=1e-3)
    results = {}
    for budget in (None, 2_000_000):
        config = EngineConfig(max_seqs=16, max_batched_tokens=512, prefill_chunk=128, kv_memory_bytes=budget,
                              check_invariants=True)
        results[budget] = simulate(arrivals, config, cost, kv_layout=layout)
    free, tight = results[None].summary(), results[2_000_000].summary()
    assert free["preemptions"] == 0 and tight["preemptions"] > 0
    assert tight["finished"] == free["finished"] == 200
    assert tight["output_tokens"] == free["output_tokens"] == sum(a.output_len for a in arrivals)
    assert tight["throughput_tok_s"] < free["throughput_tok_s"]


def _phased_trace(true: CostModel, n_ticks: int, seed: int = 0, media_ids: tuple[int, ...] = (5,)) -> list[dict]:
    """A trace that times each tick's phases (vision_s, prefill_s, decode_s, as the engine records them), with
    encoding on one tick in 25: requests of one or two images, 4..40 media tokens in all. Decode rows attend
    over a growing context; every phase's time follows `true` (+2% noise) and one tick in 30 takes 3x as long
    (load). The loop takes each arrival in before the tick that drains it: 0.5 ms, and 2 ms per image."""
    rng = np.random.default_rng(seed)
    events = [{"schema": 1, "seq": 0, "tick": 0, "event": "engine_start", "config": {"max_seqs": 8},
               "media_token_ids": list(media_ids), "measure": {"t": 100.0}}]
    t, produced, prompt_len, images = 100.0, {}, {}, {}
    for tick in range(n_ticks):
        chunks, encode = [], []
        if tick % 25 == 3:  # a few images arrive and are encoded and prefilled at once
            for j in range(int(rng.integers(1, 4))):
                rid, vt = f"m{tick}-{j}", int(rng.integers(4, 41))
                prompt = [1] * 6 + [media_ids[0]] * vt + [1] * 6
                prompt_len[rid] = len(prompt)
                images[rid] = 1 + j % 2
                events.append({"schema": 1, "seq": len(events), "tick": tick, "event": "arrival", "request_id": rid,
                               "prompt_tokens": prompt, "sampling": {"max_tokens": 8}, "num_images": images[rid],
                               "measure": {"t": t}})
                encode.append(rid)
                chunks.append([rid, 0, len(prompt), True])
            t += 0.5e-3 * len(encode) + 2e-3 * sum(images[r] for r in encode)  # the loop took them in
        live = [rid for rid in prompt_len if produced.get(rid, 0) < 30 and rid not in encode]
        decode = live[:8]
        rows = decode + [c[0] for c in chunks]
        context = sum(prompt_len[r] + produced.get(r, 0) for r in rows)
        vision_tokens = sum(prompt_len[r] - 12 for r in encode)
        x = tick_features(chunks, decode, sum(c[2] for c in chunks) + len(decode), sum(images[r] for r in encode),
                          lambda rid: rid.startswith("m"), vision_tokens, context)
        spike = 3.0 if tick % 30 == 17 else 1.0
        phase = {key: float(sum(x[FEATURES.index(f)] * getattr(true, f) for f in names)) * rng.normal(1, 0.02) * spike
                 for key, names in PHASES}
        seconds = sum(phase.values()) + true.base * rng.normal(1, 0.02)
        events.append({"schema": 1, "seq": len(events), "tick": tick, "event": "plan", "admitted": [],
                       "encode": encode, "prefill": chunks, "decode": decode,
                       "num_batched_tokens": sum(c[2] for c in chunks) + len(decode), "num_seqs": 8})
        events.append({"schema": 1, "seq": len(events), "tick": tick, "event": "outcome",
                       "sampled": {r: 7 for r in rows}, "errors": {},
                       "encoded": {r: {"rope_delta": 0, "vision_cache_hit": False} for r in encode},
                       "measure": {"t": t + seconds, "tick_start_t": t, "tick_s": seconds, **phase}})
        for r in rows:
            produced[r] = produced.get(r, 0) + 1
        t += seconds + 50e-6
    return events


def test_the_phases_fit_apart_so_rare_encoding_ticks_keep_their_cost():
    """Encoding ticks are 1 in 25: one fit over whole ticks leaves them out as outliers (their time lands on
    every tick through the slowdown); fitted on each phase's own time, the vision terms (per image and per
    media token), the prefill terms and the context term come back."""
    true = CostModel(base=0.5e-3, per_prefill_token=30e-6, per_decode_row=200e-6, per_prefill_chunk=400e-6,
                     per_decode_forward=2e-3, per_prefill_done=300e-6, per_image_encoded=8e-3,
                     per_media_prefill_token=10e-6, per_vision_token=500e-6, per_context_token=2e-6)
    events = _phased_trace(true, 500)
    fitted = fit_cost_model(events)
    assert fitted.phases == ("vision_s", "prefill_s", "decode_s")
    assert fitted.media_token_ids == frozenset({5})
    for name in ("per_image_encoded", "per_vision_token", "per_context_token", "per_decode_forward"):
        assert getattr(fitted, name) * fitted.slowdown == pytest.approx(getattr(true, name), rel=0.25), name
    assert fitted.r2 > 0.95 and fitted.dropped >= 10  # the 3x ticks were left out of the terms
    assert fitted.overhead == pytest.approx(50e-6)
    assert fitted.per_arrival == pytest.approx(0.5e-3, rel=0.02)
    assert fitted.per_media_arrival == pytest.approx(2e-3, rel=0.02)  # per image: the arrivals carry one or two
    whole = fit_cost_model([{k: v for k, v in e.items()} if e["event"] != "outcome" else
                            {**e, "measure": {k: e["measure"][k] for k in ("t", "tick_start_t", "tick_s")}}
                            for e in events])
    assert whole.phases == () and whole.r2 < fitted.r2  # the whole-tick fit: the encoding ticks fit worse
    encoding = [i for i, e in enumerate(e for e in events if e["event"] == "plan") if e["encode"]]
    assert encoding and len(encoding) < 25


def test_the_sim_executor_charges_vision_tokens_and_context():
    cost = CostModel(per_vision_token=1e-3, per_context_token=1e-6, media_token_ids=frozenset({5}))
    arrivals = [SimArrival("m", 0.0, [1, 5, 5, 5, 1], max_tokens=4, output_len=4, num_images=1, media_key="k"),
                SimArrival("t", 0.0, [1] * 10, max_tokens=4, output_len=4)]
    ex = SimExecutor(cost, arrivals)
    ex.execute(TickPlan(0, admitted=("m", "t"), encode=("m",), prefill=(PrefillChunk("m", 0, 5, True),
                                                                        PrefillChunk("t", 0, 10, True)),
                        num_batched_tokens=15, num_seqs=2))
    assert ex.clock == pytest.approx(3e-3 + 15e-6)  # 3 media tokens encoded; rows of 5 + 10 tokens of context
    ex.execute(TickPlan(1, decode=("m", "t"), num_batched_tokens=2, num_seqs=2))
    assert ex.clock == pytest.approx(3e-3 + 15e-6 + 17e-6)  # each row has produced one token since


def test_the_sim_executor_counts_vision_hits_per_media_item():
    """Arrivals that record their media per item (`media_items`): a chat turn that resends an earlier image
    encodes, and is charged for, its new image only; an arrival without items is one unit (its media key)."""
    from scheduler.request import MediaItemRef

    cost = CostModel(per_image_encoded=1e-3, per_vision_token=1e-4, media_token_ids=frozenset({5}))
    first, second = MediaItemRef("a", 3, 1), MediaItemRef("b", 2, 1)
    arrivals = [SimArrival("t1", 0.0, [1, 5, 5, 5, 1], 4, 4, num_images=1, media_key="ka", media_items=(first,)),
                SimArrival("t2", 0.0, [1, 5, 5, 5, 1, 5, 5, 1], 4, 4, num_images=2, media_key="kab",
                           media_items=(first, second)),
                SimArrival("w", 0.0, [1, 5, 5, 5, 5, 1], 4, 4, num_images=1, media_key="kw")]
    ex = SimExecutor(cost, arrivals)
    encoded = {}
    for tick, rid in enumerate(("t1", "t2", "w")):
        before = ex.clock
        result = ex.execute(TickPlan(tick, admitted=(rid,), encode=(rid,)))
        encoded[rid] = (result.encoded[rid], ex.clock - before)
    assert encoded["t1"][0] == {"rope_delta": 0, "vision_cache_hit": False, "items_encoded": 1,
                                "media_tokens_encoded": 3}
    assert encoded["t2"][0]["items_encoded"] == 1 and encoded["t2"][0]["media_tokens_encoded"] == 2
    assert encoded["t2"][1] == pytest.approx(1e-3 + 2e-4)  # b alone: a's rows are a hit
    assert encoded["w"][0]["media_tokens_encoded"] == 4  # one unit: every media token of its prompt
    again = ex.execute(TickPlan(3, admitted=("t2",), encode=("t2",)))  # a preempted t2 re-encoded: all hits
    assert again.encoded["t2"]["vision_cache_hit"] is True and again.encoded["t2"]["items_encoded"] == 0


def test_a_simulation_s_vision_budget_pays_only_for_what_its_cache_lacks():
    """The simulated scheduler sees the simulated vision cache, as the engine's sees its own: with room for one
    image a tick, three requests showing the same image are encoded in one tick (one encoder unit) and get
    their first tokens together; three different images take a tick each."""
    from scheduler.request import MediaItemRef

    cost = CostModel(overhead=1e-3, per_image_encoded=1e-3, media_token_ids=frozenset({5}))
    config = EngineConfig(vision_budget=1, max_seqs=8)

    def first_tokens(keys):
        arrivals = [SimArrival(f"r{i}", 0.0, [1, 5, 5, 5, 1], 2, 2, num_images=1, num_media_tokens=3,
                               media_key=key, media_items=(MediaItemRef(key, 3, 1),)) for i, key in enumerate(keys)]
        return [r.first_token for r in simulate(arrivals, config, cost).requests]

    same = first_tokens(["a", "a", "a"])
    assert len(set(same)) == 1
    assert len(set(first_tokens(["a", "b", "c"]))) == 3


def test_the_sim_executor_s_vision_cache_holds_what_the_engine_s_would():
    """`vision_cache_bytes` bounds the simulated vision cache as it bounds the engine's: units sized by the
    recording's stores, the least recently used evicted first, one larger than the whole cache never stored, 0
    no cache at all (a tick still encodes a repeated unit once), None (a synthetic workload's) unbounded."""
    from scheduler.request import MediaItemRef

    cost = CostModel(per_image_encoded=1e-3, media_token_ids=frozenset({5}))
    arrivals = [SimArrival(rid, 0.0, [1, 5, 5, 1], 4, 4, num_images=1, media_key=key,
                           media_items=(MediaItemRef(key, 2, 1),))
                for rid, key in (("a1", "a"), ("b1", "b"), ("a2", "a"), ("a3", "a"))]

    def encoded(capacity, sizes=None):
        ex = SimExecutor(cost, arrivals, vision_cache_bytes=capacity, vision_unit_bytes=sizes or {"a": 100, "b": 100})
        out = [ex.execute(TickPlan(t, admitted=(rid,), encode=(rid,))).encoded[rid]["items_encoded"]
               for t, rid in enumerate(("a1", "b1", "a2", "a3"))]
        assert ex.media_items_encoded == sum(out)
        return out

    assert encoded(None) == encoded(250) == [1, 1, 0, 0]
    assert encoded(150) == [1, 1, 1, 0]  # b's store evicted a; a's store then evicted b
    assert encoded(0) == encoded(50) == encoded(150, {"a": 200, "b": 100}) == [1, 1, 1, 1]
    ex = SimExecutor(cost, arrivals, vision_cache_bytes=0)
    result = ex.execute(TickPlan(0, admitted=("a1", "a2"), encode=("a1", "a2")))
    assert [result.encoded[r]["items_encoded"] for r in ("a1", "a2")] == [1, 0]


def test_a_what_if_of_the_vision_cache_size_follows_the_engine_s_evictions(tmp_path):
    """On a recording of the tiny Qwen2-VL with a vision cache that holds one image (images A, B, then A again,
    one request at a time), the engine encoded A twice; the what-if with the recorded settings (units sized by
    the trace's stores) encodes as many, and with a cache of room for both, A once."""
    import mlx_vlm

    from scheduler.events import MemorySink
    from scheduler.fixtures.tiny_models import build_model

    from ..models.test_vision_batch import image_requests

    model, processor = mlx_vlm.load(str(build_model("vlm", tmp_path / "vlm")))
    (a_msgs, a), (b_msgs, b) = image_requests()[:2]  # two images of one size
    sink = MemorySink()  # a cache of 1 byte stores nothing: an image's size is in its rejection
    engine = Engine(model, processor, EngineConfig(vision_cache_bytes=1), event_sinks=[sink])
    engine.add_request(prompt=a_msgs, images=a, sampling=SamplingParams(max_tokens=2))
    while engine.has_pending():
        engine.step()
    engine.close()
    size = next(e["bytes"] for e in sink.events if e["event"] == "vision_evict")
    sink = MemorySink()
    engine = Engine(model, processor, EngineConfig(vision_cache_bytes=size + size // 2), event_sinks=[sink])
    for messages, images in ((a_msgs, a), (b_msgs, b), (a_msgs, a)):
        engine.add_request(prompt=messages, images=images, sampling=SamplingParams(max_tokens=2))
        while engine.has_pending():
            engine.step()
    engine.close()
    recorded = sum(c["images"] for c in sink.of_kind("vision_encode"))
    assert recorded == 3  # A, B, A again: B's store evicted A
    rec = load_recorded(list(sink.events))
    settings = rec.simulation_settings()
    assert set(settings["vision_unit_bytes"].values()) == {size}
    config = dataclasses.replace(rec.trace.config, trace_path=None)
    cost = fit_cost_model(rec)
    arrivals = arrivals_from_trace(rec)
    assert simulate(arrivals, config, cost, **settings).media_items_encoded == recorded
    roomy = dataclasses.replace(config, vision_cache_bytes=3 * size)
    assert simulate(arrivals, roomy, cost, **settings).media_items_encoded == 2


def test_the_fit_counts_the_items_an_outcome_says_were_encoded():
    """The vision terms are fitted on what each outcome records as encoded (`items_encoded`,
    `media_tokens_encoded`); a trace from before those fields counts every media item of a request that was
    not a hit."""
    from scheduler.tools.simulation.cost_model import _encoded_misses

    images, tokens = {"t2": 2, "old": 3}, {"t2": 5, "old": 9}
    now = {"encoded": {"t2": {"vision_cache_hit": False, "items_encoded": 1, "media_tokens_encoded": 2}}}
    before = {"encoded": {"old": {"vision_cache_hit": False}, "hit": {"vision_cache_hit": True}}}
    assert _encoded_misses(now, images, tokens) == (1, 2)
    assert _encoded_misses(before, images, tokens) == (3, 9)


def test_an_arrival_taken_in_while_serving_delays_the_next_tick():
    """The loop's time to take a media arrival in (fitted on the gaps) is charged when it arrives while other
    requests are served; an arrival to an idle engine delays nothing (the loop was waiting anyway)."""
    arrivals = [SimArrival("a", 0.0, [7] * 4, max_tokens=3, output_len=3, num_images=1, media_key="x"),
                SimArrival("b", 0.0015, [7] * 4, max_tokens=3, output_len=3, num_images=1, media_key="y")]
    runs = {}
    for cost in (0.0, 20e-3):
        result = simulate(arrivals, EngineConfig(max_seqs=4), CostModel(base=1e-3, per_media_arrival=cost))
        runs[cost] = ({r.request_id: r for r in result.requests}, result.clock)
    (free, free_clock), (charged, charged_clock) = runs[0.0], runs[20e-3]
    assert charged["a"].first_token == free["a"].first_token  # a's arrival found the engine idle
    assert charged_clock == pytest.approx(free_clock + 20e-3)  # b came in while a was served: once, 20 ms
    assert charged["b"].first_token == pytest.approx(free["b"].first_token + 20e-3)
