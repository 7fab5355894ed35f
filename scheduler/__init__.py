"""mlxsched: continuous batching on MLX as an explicit, logged, replayable state machine."""

from .async_engine import AsyncEngine
from .compat import (
    MLLMBatchGenerator,
    MLLMBatchRequest,
    MLLMBatchResponse,
    MLLMBatchStats,
    install_chunked_prefill_mllm,
    install_mtp_mllm,
)
from .config import EngineConfig
from .engine import Engine, EngineStats, RequestOutput
from .lifecycle import IllegalTransition, RequestState, Trigger
from .request import FinishReason, InvalidRequest, Request, SamplingParams, UnknownRequest
from .scheduler import StepOutput

__all__ = [
    "AsyncEngine",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "FinishReason",
    "IllegalTransition",
    "InvalidRequest",
    "MLLMBatchGenerator",
    "MLLMBatchRequest",
    "MLLMBatchResponse",
    "MLLMBatchStats",
    "Request",
    "RequestOutput",
    "RequestState",
    "SamplingParams",
    "StepOutput",
    "Trigger",
    "UnknownRequest",
    "install_chunked_prefill_mllm",
    "install_mtp_mllm",
]
