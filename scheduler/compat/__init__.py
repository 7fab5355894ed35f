"""The vllm-mlx compatibility surface: the reference's `MLLMBatchGenerator` API over our engine.

A surface, like the engine: it imports the engine and nothing imports it (MIGRATION.md lists the differences).
"""

from .generator import (
    MLLMBatch,
    MLLMBatchGenerator,
    MLLMBatchRequest,
    MLLMBatchResponse,
    MLLMBatchStats,
    PrefillAbortedError,
    PrefixCacheHandle,
    install_chunked_prefill_mllm,
    install_mtp_mllm,
)

__all__ = [
    "MLLMBatch",
    "MLLMBatchGenerator",
    "MLLMBatchRequest",
    "MLLMBatchResponse",
    "MLLMBatchStats",
    "PrefillAbortedError",
    "PrefixCacheHandle",
    "install_chunked_prefill_mllm",
    "install_mtp_mllm",
]
