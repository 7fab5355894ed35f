"""The declared lifecycle: every (state, trigger) pair is allowed or refused exactly as the table says."""

import itertools
from pathlib import Path

import pytest

from scheduler.lifecycle import (
    TERMINAL_STATES,
    TRANSITIONS,
    IllegalTransition,
    Lifecycle,
    RequestState,
    Trigger,
    allowed_triggers,
    destination,
    mermaid,
)
from scheduler.request import FinishReason, Request, SamplingParams

EXPECTED = {
    # (state, trigger): destination, for every allowed move; everything else must be refused.
    (RequestState.QUEUED, Trigger.START_VISION): RequestState.VISION_ENCODING,
    (RequestState.QUEUED, Trigger.START_PREFILL): RequestState.CHUNK_PREFILLING,
    (RequestState.VISION_ENCODING, Trigger.START_PREFILL): RequestState.CHUNK_PREFILLING,
    (RequestState.CHUNK_PREFILLING, Trigger.START_DECODE): RequestState.DECODING,
    (RequestState.DECODING, Trigger.START_DRAFT): RequestState.DRAFTING,
    (RequestState.DRAFTING, Trigger.END_DRAFT): RequestState.DECODING,
    (RequestState.VISION_ENCODING, Trigger.PREEMPT): RequestState.QUEUED,
    (RequestState.CHUNK_PREFILLING, Trigger.PREEMPT): RequestState.QUEUED,
    (RequestState.DECODING, Trigger.PREEMPT): RequestState.QUEUED,
    (RequestState.DRAFTING, Trigger.PREEMPT): RequestState.QUEUED,
    (RequestState.DECODING, Trigger.FINISH): RequestState.FINISHED,
    (RequestState.DRAFTING, Trigger.FINISH): RequestState.FINISHED,
    **{(s, Trigger.ABORT): RequestState.ABORTED for s in RequestState if s not in TERMINAL_STATES},
    **{(s, Trigger.FAIL): RequestState.ABORTED for s in RequestState if s not in TERMINAL_STATES},
}


def test_states_are_exactly_the_declared_ones():
    assert [s.value for s in RequestState] == [
        "queued", "vision_encoding", "chunk_prefilling", "decoding", "drafting", "finished", "aborted",
    ]


def _request_in(state: RequestState, lifecycle: Lifecycle) -> Request:
    """A request whose guards all pass, forced into `state` (test set-up only)."""
    r = Request("r", [1, 2, 3], SamplingParams())
    lifecycle.attach(r)
    r.num_images = 1
    r.media_encoded = True
    r.num_computed_tokens = 3
    r.output_tokens = [5]
    r.finish_reason = FinishReason.LENGTH
    r.error = "boom"
    r.state = state
    return r


@pytest.mark.parametrize("state,trigger", list(itertools.product(RequestState, Trigger)))
def test_every_state_trigger_pair(state, trigger):
    lifecycle = Lifecycle()
    r = _request_in(state, lifecycle)
    expected = EXPECTED.get((state, trigger))
    assert destination(state, trigger) == expected
    assert (trigger in allowed_triggers(state)) == (expected is not None)
    if expected is None:
        with pytest.raises(IllegalTransition) as info:
            lifecycle.fire(r, trigger)
        assert info.value.request_id == "r"
        assert info.value.state is state
        assert info.value.trigger is trigger
        assert r.state is state  # nothing moved
    else:
        assert lifecycle.fire(r, trigger) == (state, expected)
        assert r.state is expected


def test_terminal_states_have_no_way_out():
    for state in TERMINAL_STATES:
        assert allowed_triggers(state) == frozenset()


@pytest.mark.parametrize(
    "trigger,unset",
    [
        (Trigger.START_VISION, "num_images"),
        (Trigger.START_DECODE, "num_computed_tokens"),
        (Trigger.FINISH, "finish_reason"),
        (Trigger.FAIL, "error"),
    ],
)
def test_a_refused_guard_is_an_illegal_transition(trigger, unset):
    lifecycle = Lifecycle()
    source = next(t.sources[0] for t in TRANSITIONS if t.trigger is trigger)
    r = _request_in(source, lifecycle)
    setattr(r, unset, {"num_images": 0, "num_computed_tokens": 1, "finish_reason": None, "error": None}[unset])
    with pytest.raises(IllegalTransition, match="guard") as info:
        lifecycle.fire(r, trigger)
    assert info.value.state is source
    assert r.state is source


def test_a_terminal_request_cannot_move():
    lifecycle = Lifecycle()
    for state in (RequestState.FINISHED, RequestState.ABORTED):
        r = _request_in(state, lifecycle)
        for trigger in Trigger:
            with pytest.raises(IllegalTransition):
                lifecycle.fire(r, trigger)


def test_one_machine_many_requests_move_independently():
    lifecycle = Lifecycle()
    a, b = Request("a", [1], SamplingParams()), Request("b", [1], SamplingParams())
    lifecycle.attach(a)
    lifecycle.attach(b)
    lifecycle.fire(a, Trigger.START_PREFILL)
    assert a.state is RequestState.CHUNK_PREFILLING and b.state is RequestState.QUEUED
    lifecycle.fire(b, Trigger.ABORT)
    assert a.state is RequestState.CHUNK_PREFILLING and b.state is RequestState.ABORTED


def test_diagram_is_generated_from_the_table_and_architecture_embeds_it():
    diagram = mermaid()
    for t in TRANSITIONS:
        for s in t.sources:
            assert f"{s.value} --> {t.dest.value}: {t.trigger.value}" in diagram
    architecture = (Path(__file__).parents[2] / "ARCHITECTURE.md").read_text(encoding="utf-8")
    assert diagram in architecture, "ARCHITECTURE.md is stale: run `mlxsched lifecycle --update ARCHITECTURE.md`"
