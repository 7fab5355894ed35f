"""The engine's invariant check on a real model: it compares what the executor really holds with what was
planned (the checker's model-free side: tests/core/test_invariants.py)."""

import pytest

from scheduler import Engine, EngineConfig
from scheduler.plan import TickPlan
from scheduler.scheduler import InvariantViolation


def test_real_kv_bytes_over_the_planned_bound_is_caught(text_model):
    """The checker compares the executor's real bytes with the plan's bound, not only each with the budget."""
    model, tokenizer = text_model
    engine = Engine(model, tokenizer, EngineConfig(kv_memory_bytes=1 << 30, max_batched_tokens=64))
    engine.add_request(prompt_tokens=list(range(7, 47)), sampling=None)
    engine.step()
    plan = TickPlan(engine.tick, kv_bytes_bound=engine.executor.cache_bytes() - 1)
    with pytest.raises(InvariantViolation, match="over the planned bound"):
        engine._check_executor(plan, None)
