"""mlxsched: continuous batching on MLX as an explicit, logged, replayable state machine.

The public names are loaded lazily (PEP 562): `import scheduler.planner` or `scheduler.tools.replay` loads the
decision side only, with no MLX; `from scheduler import Engine` loads the engine and MLX when it is asked for.

Layers, imports pointing one way (tests/test_layers.py enforces the boundaries):
- surfaces: `engine`, `async_engine`, `cli`, `compat/` (the vllm-mlx API);
- core (no MLX): `lifecycle`, `request`, `config`, `plan`, `policy`, `planner`, `scheduler`, `events`;
- execution (MLX): `execution/` (executor, runners, library seam, drafters), `models/` (model families, media);
- tools over traces (no MLX): `tools/` (replay, simulate, workload, timeline);
- fixtures: `fixtures/` (tiny seeded models for tests and the demo).
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> module that defines it
_EXPORTS = {
    "AsyncEngine": ".async_engine",
    "Engine": ".engine",
    "EngineStats": ".engine",
    "RequestOutput": ".engine",
    "EngineConfig": ".config",
    "IllegalTransition": ".lifecycle",
    "RequestState": ".lifecycle",
    "Trigger": ".lifecycle",
    "FinishReason": ".request",
    "InvalidRequest": ".request",
    "UnreadableMedia": ".request",
    "Request": ".request",
    "SamplingParams": ".request",
    "StructuredKind": ".request",
    "StructuredOutput": ".request",
    "GrammarProcessor": ".execution.structured",
    "ShardDivergence": ".execution.distributed",
    "ShardLost": ".execution.distributed",
    "LoRAError": ".models.lora",
    "LoRAInUse": ".models.lora",
    "UnknownLoRA": ".models.lora",
    "UnknownRequest": ".request",
    "StepOutput": ".scheduler",
    "MLLMBatchGenerator": ".compat",
    "MLLMBatchRequest": ".compat",
    "MLLMBatchResponse": ".compat",
    "MLLMBatchStats": ".compat",
    "install_chunked_prefill_mllm": ".compat",
    "install_mtp_mllm": ".compat",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'scheduler' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
