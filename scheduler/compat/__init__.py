"""The vllm-mlx compatibility surface: the reference's `MLLMBatchGenerator` API over our engine.

A surface, like the engine: it imports the engine and nothing imports it (MIGRATION.md lists the differences).
"""

from .generator import (
    MLLMBatchGenerator,
    MLLMBatchRequest,
    MLLMBatchResponse,
    MLLMBatchStats,
    install_chunked_prefill_mllm,
    install_mtp_mllm,
)

__all__ = [
    "MLLMBatchGenerator",
    "MLLMBatchRequest",
    "MLLMBatchResponse",
    "MLLMBatchStats",
    "install_chunked_prefill_mllm",
    "install_mtp_mllm",
]
