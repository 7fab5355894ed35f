"""Injected faults: a forward that raises (an out-of-memory stand-in) fails only the requests of that work
item; the engine stays usable, later requests are exact, and the trace records it. The fault is injected
by wrapping the real model object, not by patching any class."""

import json

import pytest

from scheduler import Engine, EngineConfig, FinishReason, RequestState
from scheduler.events import MemorySink
from scheduler.tools.replay import load_trace, replay

from ..helpers import drive, greedy, mixed_prompts, solo_tokens

PROMPTS = mixed_prompts(4, 10, 60, seed=4)


class FaultyModel:
    """The real model, except that the forward call number `fail_at` of the kind `when` raises."""

    def __init__(self, model, when, fail_at):
        self._model, self._when, self._fail_at, self.calls = model, when, fail_at, 0

    def __call__(self, inputs, *args, **kwargs):
        is_decode = inputs.shape[1] == 1 and inputs.shape[0] >= 1
        if self._when(inputs, is_decode):
            self.calls += 1
            if self.calls == self._fail_at:
                raise MemoryError("[metal::malloc] simulated out of memory")
        return self._model(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


def test_a_failing_batched_decode_fails_its_rows_and_the_engine_recovers(text_model, tmp_path):
    model, tokenizer = text_model
    faulty = FaultyModel(model, lambda x, decode: decode, fail_at=5)
    trace = tmp_path / "fault.jsonl"
    engine = Engine(faulty, tokenizer, EngineConfig(check_invariants=True, trace_path=str(trace)))
    run = drive(engine, [(0, {"prompt_tokens": p, "sampling": greedy(10)}) for p in PROMPTS[:3]])
    assert set(run.finish.values()) == {FinishReason.ERROR}
    assert all("simulated out of memory" in e for e in run.errors.values())
    assert engine.executor.cache_bytes() == 0
    # the engine is still usable, and exact
    later = drive(engine, [(0, {"prompt_tokens": PROMPTS[3], "sampling": greedy(10)})])
    assert list(later.tokens.values()) == [solo_tokens(model, tokenizer, PROMPTS[3], 10)]
    engine.close()
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    fails = [e for e in events if e["event"] == "transition" and e["trigger"] == "fail"]
    assert len(fails) == 3 and all("out of memory" in e["reason"] for e in fails)
    assert replay(load_trace(trace)).identical


def test_a_failing_prefill_fails_only_that_request(text_model):
    model, tokenizer = text_model
    long_prompt = [17] * 90
    faulty = FaultyModel(model, lambda x, decode: x.shape[1] == 32, fail_at=2)  # its second 32-token chunk
    engine = Engine(faulty, tokenizer, EngineConfig(prefill_chunk=32, max_batched_tokens=64, check_invariants=True))
    run = drive(engine, [(0, {"prompt_tokens": long_prompt, "sampling": greedy(8), "request_id": "victim"}),
                         (0, {"prompt_tokens": PROMPTS[0], "sampling": greedy(8), "request_id": "ok"})])
    assert run.finish["victim"] is FinishReason.ERROR and "prefill failed" in run.errors["victim"]
    assert engine.state_of("victim") is RequestState.ABORTED
    assert run.tokens["ok"] == solo_tokens(model, tokenizer, PROMPTS[0], 8)
    assert engine.executor.cache_bytes() == 0


def test_a_drafter_that_raises_falls_back_to_plain_decoding(text_model):
    from scheduler.execution.drafters import PromptLookupDrafter

    model, tokenizer = text_model

    class FlakyDrafter(PromptLookupDrafter):
        """Raises on every third proposal."""

        calls = 0

        def propose(self, rows, k):
            self.calls += 1
            if self.calls % 3 == 0:
                raise RuntimeError("drafter bug")
            return super().propose(rows, k)

    sink = MemorySink()
    engine = Engine(model, tokenizer, EngineConfig(draft_tokens=2, check_invariants=True), event_sinks=[sink])
    engine.executor.drafter = FlakyDrafter()
    run = drive(engine, [(0, {"prompt_tokens": p, "sampling": greedy(12)}) for p in PROMPTS])
    assert list(run.tokens.values()) == [solo_tokens(model, tokenizer, p, 12) for p in PROMPTS]
    stats = engine.draft_stats()
    assert stats["drafter_failures"] >= 1 and "drafter bug" in stats["last_drafter_failure"]
    assert sum("drafter bug" in e.get("drafter_error", "") for e in sink.of_kind("outcome")) == stats["drafter_failures"]
