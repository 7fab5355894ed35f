"""The MLX executors have the tick loop's `Executor` protocol shape, `execute(plan)` and `release(ids)` (the
executors that need no MLX: tests/core/test_loop.py)."""

import inspect

import pytest

from scheduler.execution.distributed import ShardedExecutor
from scheduler.execution.executor import MLXExecutor


@pytest.mark.parametrize("executor", [MLXExecutor, ShardedExecutor], ids=lambda c: c.__name__)
def test_every_executor_has_the_protocols_shape(executor):
    assert list(inspect.signature(executor.execute).parameters) == ["self", "plan"]
    assert list(inspect.signature(executor.release).parameters) == ["self", "request_ids"]
