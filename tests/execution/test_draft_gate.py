"""The tick-level draft gate (scheduler/execution/draft_gate.py): the verify width that pays for the whole
batch. Pure bookkeeping, no model: the engine-level checks (greedy output identical with the gate on, on the
trained model and on an untrained one where it declines) are in test_adaptive_drafting.py."""

from __future__ import annotations

import pytest

from scheduler.execution.draft_gate import DraftGate, VerifyCost, expected_accepted

# explicit costs, so the checks do not move when the measured defaults do
COST = VerifyCost(verify=0.1, width=0.075, rows=0.0, shift=0.45)


def _observed(gate: DraftGate, rid: str, drafted: int, accepted: int, times: int = 20) -> None:
    for _ in range(times):
        gate.observe(rid, drafted, accepted)


def test_expected_accepted_is_the_geometric_prefix_sum():
    assert expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_accepted(1.0, 4) == 4
    assert expected_accepted(0.0, 4) == 0
    assert expected_accepted(0.9, 0) == 0


def test_the_cost_model_grows_with_width_and_charges_the_shift_only_for_several_rows():
    assert COST.tick(4, 1) == 1.0 and COST.tick(1, 1) == 1.0
    assert COST.tick(1, 5) == pytest.approx(1 + 0.1 + 4 * 0.075)
    assert COST.tick(4, 5) == pytest.approx(1 + 0.1 + 4 * 0.075 + 0.45)
    assert COST.tick(4, 3) < COST.tick(4, 5)
    scaled = VerifyCost(verify=0.1, width=0.075, rows=0.5, shift=0.45)
    assert scaled.tick(4, 5) == pytest.approx(1 + 0.1 + 4 * 0.075 * (1 + 0.5 * 3) + 0.45)
    with pytest.raises(ValueError):
        VerifyCost(shift=-1)


def test_one_hopeful_row_does_not_make_a_batch_of_four_verify_five_positions():
    """A new row (prior acceptance) drafting 4 tokens among 4 rows: 4 + E[accepted] tokens do not pay for a
    width-5 tick of all four rows, so the tick is a plain step."""
    gate = DraftGate(COST)
    decision = gate.decide(4, {"a": 4, "b": 0, "c": 0, "d": 0})
    assert decision.width == 1
    p = gate.acceptance("a")
    assert (4 + expected_accepted(p, 4)) / COST.tick(4, 5) < 4  # the arithmetic the decision rests on
    assert gate.apply(4, {"a": 4, "b": 0, "c": 0, "d": 0}) == {}
    assert gate.stats()["declined_ticks"] == 1 and gate.stats()["draft_tokens_cut"] == 4


def test_the_gate_declines_rows_whose_drafts_are_rejected():
    gate = DraftGate(COST)
    for rid in "abcd":
        _observed(gate, rid, 4, 0)  # nothing accepted, twenty times
    assert gate.acceptance("a") < 0.2
    assert gate.decide(4, dict.fromkeys("abcd", 4)).width == 1
    assert gate.decide(1, {"a": 4}).width == 1  # alone too: one more verify does not pay at p < 0.2


def test_the_gate_drafts_at_full_width_when_acceptance_is_high():
    gate = DraftGate(COST)
    for rid in "abcd":
        _observed(gate, rid, 4, 4)
    assert gate.acceptance("a") > 0.95
    decision = gate.decide(4, dict.fromkeys("abcd", 4))
    assert decision.width == 5 and decision.rate > decision.plain_rate
    assert gate.apply(4, dict.fromkeys("abcd", 4)) == dict.fromkeys("abcd", 4)
    assert gate.stats()["declined_ticks"] == 0 and gate.stats()["narrowed_ticks"] == 0


def test_a_row_with_low_acceptance_does_not_widen_the_tick():
    """Two rows that accept their 2-token drafts and one whose 4-token drafts are rejected: the tick verifies
    at width 3 (what the accepted rows use), and the rejected row's draft is cut to 2."""
    gate = DraftGate(COST)
    _observed(gate, "a", 2, 2)
    _observed(gate, "b", 2, 2)
    _observed(gate, "c", 4, 0)
    drafts = {"a": 2, "b": 2, "c": 4, "d": 0}
    assert gate.decide(4, drafts).width == 3
    assert gate.apply(4, drafts) == {"a": 2, "b": 2, "c": 2}
    assert gate.stats()["narrowed_ticks"] == 1 and gate.stats()["draft_tokens_cut"] == 2


def test_declined_rows_are_retried_once_their_estimates_have_decayed():
    """Four rows whose drafts were all rejected: declined, each declined tick decays their counts towards the
    (optimistic) prior, and after some ticks a draft is verified again."""
    gate = DraftGate(COST)
    drafts = dict.fromkeys("abcd", 4)
    for rid in drafts:
        _observed(gate, rid, 4, 0)
    tries = 0
    while not gate.apply(4, drafts):
        tries += 1
        assert tries < 50, "declined rows must be retried eventually"
    assert tries > 3  # but not at once
    assert gate.stats()["declined_ticks"] == tries


def test_a_released_row_starts_from_the_prior_again():
    gate = DraftGate(COST)
    _observed(gate, "a", 4, 0)
    low = gate.acceptance("a")
    gate.release("a")
    assert gate.acceptance("a") > low == pytest.approx(low)


def test_bad_settings_and_observations_are_refused():
    with pytest.raises(ValueError):
        DraftGate(decay=1.0)
    with pytest.raises(ValueError):
        DraftGate(prior_rejected=0)
    with pytest.raises(ValueError):
        DraftGate().observe("a", 2, 3)
    with pytest.raises(ValueError):
        DraftGate().decide(0, {})


def test_the_cost_model_is_fitted_from_measured_forwards():
    """`VerifyCost.fit` recovers width and rows from forwards that follow the model (with the engine's work per
    tick in the denominator), from two batch sizes or more; with one batch size rows is 0."""
    truth = VerifyCost(width=0.07, rows=0.3)
    overhead = 0.4

    def forwards(batches):
        plain = {b: 1.0 + 0.2 * b for b in batches}  # bare w = 1 forwards, ms
        return {b: {w: plain[b] + (plain[b] + overhead) * truth.width * (w - 1) * (1 + truth.rows * (b - 1))
                    for w in (1, 2, 3, 5)} for b in batches}

    for batches in ((1, 4, 16), (2, 8)):
        fit = VerifyCost.fit(forwards(batches), overhead)
        assert fit.width == pytest.approx(truth.width, abs=1e-4) and fit.rows == pytest.approx(truth.rows, abs=1e-4)
        assert (fit.verify, fit.shift) == (VerifyCost().verify, VerifyCost().shift)
    alone = VerifyCost.fit({1: {1: 1.0, 3: 1.3}}, 0.0, verify=0.2, shift=0.0)
    assert (alone.width, alone.rows, alone.verify) == (pytest.approx(0.15), 0.0, 0.2)
    flat = VerifyCost.fit({1: {1: 1.0, 2: 0.9}, 4: {1: 2.0, 2: 1.9}})  # narrower was faster: nothing to charge
    assert flat.width == 0.0 and flat.rows == 0.0
    with pytest.raises(ValueError):
        VerifyCost.fit({4: {1: 1.0}})


def test_the_engine_gate_takes_the_configured_cost(text_model):
    from scheduler import Engine, EngineConfig

    model, tokenizer = text_model
    engine = Engine(model, tokenizer, EngineConfig(draft_tokens=2, draft_cost=[0.2, 0.05, 0.1, 0.0]))
    assert engine.executor.draft_gate.cost == VerifyCost(verify=0.2, width=0.05, rows=0.1, shift=0.0)
    assert engine.config.draft_cost == (0.2, 0.05, 0.1, 0.0)  # a list (as a trace records it) becomes a tuple
    engine.close()
    default = Engine(model, tokenizer, EngineConfig(draft_tokens=2))
    assert default.executor.draft_gate.cost == VerifyCost()
    default.close()
    for bad in ((0.1, 0.1, 0.1), (0.1, -0.1, 0.0, 0.0), (0.1, float("nan"), 0.0, 0.0), (True, 0.1, 0.1, 0.1)):
        with pytest.raises(ValueError, match="draft_cost"):
            EngineConfig(draft_cost=bad)
