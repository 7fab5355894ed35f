"""vllm-mlx's `MLLMBatchGenerator` surface, on mlxsched's engine.

Engine authors who use vllm-mlx can switch by changing an import: the classes, fields, defaults and methods
keep the reference's names. Underneath, every call goes through `Engine` (the declared lifecycle, the pure
planner, the event log); nothing here touches a model or a cache directly. Where the reference misbehaves we
keep the interface and fix the behaviour; MIGRATION.md lists every difference.

The two feature switches the reference installs by replacing methods (`install_chunked_prefill_mllm`,
`install_mtp_mllm`) are plain configuration here. The engine is built lazily on the first `insert`/`next`, so
configuration calls made right after construction (the reference's usage) take effect without any
monkeypatching; calling them later raises, because a running engine's budgets are part of its trace.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx

from scheduler.config import EngineConfig
from scheduler.engine import Engine, Throughput
from scheduler.request import InvalidRequest, SamplingParams, UnknownRequest

logger = logging.getLogger(__name__)

# The reference sizes its vision cache in entries; ours is a byte budget. One entry of a typical VLM's image
# features (a few hundred tokens x hidden size, float16) is on the order of a megabyte.
VISION_ENTRY_BYTES = 1 << 20


@dataclass
class MLLMBatchRequest:
    """Request data, with the reference's fields and defaults. Our engine reads prompt / input_ids, images,
    max_tokens, sampling fields and logits_processors; it maintains num_tokens and output_tokens."""

    uid: int
    request_id: str
    prompt: str
    images: Optional[List[Any]] = None
    videos: Optional[List[Any]] = None
    audio: Optional[List[Any]] = None
    max_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 0.9
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logits_processors: Optional[List[Callable]] = None
    input_ids: Optional[Any] = None
    pixel_values: Optional[Any] = None
    attention_mask: Optional[Any] = None
    image_grid_thw: Optional[Any] = None
    extra_kwargs: Dict[str, Any] = field(default_factory=dict)
    is_text_only: bool = False
    num_tokens: int = 0
    output_tokens: List[int] = field(default_factory=list)
    vision_encoded: bool = False
    cross_attention_states: Optional[Any] = None
    encoder_outputs: Optional[Any] = None


@dataclass
class MLLMBatchResponse:
    uid: int
    request_id: str
    token: int
    logprobs: Any  # (V,) log-softmax of the processed logits; mx.zeros(1) on abort / error responses
    finish_reason: Optional[str] = None  # "stop", "length", "abort", "error" or None
    prompt_cache: Optional[Callable[[], List[Any]]] = None  # not provided: the engine's prefix cache reuses KV
    from_draft: bool = False
    mtp_attempted: bool = False
    mtp_attempted_count: int = 0


class MLLMBatchStats(Throughput):
    """Token and time counters, read from the engine (each token counted once, each second once)."""

    def __init__(self) -> None:
        self.prompt_tokens: int = 0
        self.prompt_time: float = 0
        self.generation_tokens: int = 0
        self.generation_time: float = 0
        self.vision_encoding_time: float = 0
        self.num_images_processed: int = 0
        self.peak_memory: float = 0  # GB, like the reference

    def to_dict(self) -> Dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "prompt_time": self.prompt_time,
            "prompt_tps": self.prompt_tps,
            "generation_tokens": self.generation_tokens,
            "generation_time": self.generation_time,
            "generation_tps": self.generation_tps,
            "vision_encoding_time": self.vision_encoding_time,
            "num_images_processed": self.num_images_processed,
            "peak_memory": self.peak_memory,
        }


_EMPTY_PREFIX_STATS = {
    "hits": 0, "misses": 0, "hit_rate": 0.0, "evictions": 0, "tokens_saved": 0, "current_memory_mb": 0.0,
    "max_memory_mb": 0.0, "memory_utilization": 0.0, "entry_count": 0,
}


def _prefix_cache_bytes(prefix_cache_config: Any) -> int:
    """vllm-mlx's MemoryCacheConfig (or a dict) -> our byte budget. None: no prefix cache."""
    if prefix_cache_config is None:
        return 0
    get = prefix_cache_config.get if isinstance(prefix_cache_config, dict) else (
        lambda k, d=None: getattr(prefix_cache_config, k, d))
    if get("max_memory_mb") is not None:
        return int(get("max_memory_mb") * 1024 * 1024)
    if get("max_bytes") is not None:
        return int(get("max_bytes"))
    return 512 << 20


class MLLMBatchGenerator:
    def __init__(
        self,
        model: Any,
        processor: Any,
        mm_processor: Optional[Any] = None,
        max_tokens: int = 256,
        stop_tokens: Optional[set] = None,
        sampler: Optional[Callable[[mx.array], mx.array]] = None,
        prefill_batch_size: int = 4,
        completion_batch_size: int = 16,
        prefill_step_size: int = 1024,
        enable_vision_cache: bool = True,
        vision_cache_size: int = 100,
        prefix_cache_config: Optional[Any] = None,
        max_kv_size: int = 0,
        *,
        event_sinks: Any = (),
        trace_path: Optional[str] = None,
    ):
        if sampler is not None:
            raise ValueError("sampler: a global sampling function is not supported; each request's temperature, "
                             "top_p, top_k and min_p are honoured (vectorised), see MIGRATION.md")
        self.model = model
        self.processor = processor
        self.mm_processor = mm_processor  # accepted for signature compatibility; the model's processor is used
        self.max_tokens = max_tokens
        self.stop_tokens = set(stop_tokens or ())
        self.prefill_batch_size = prefill_batch_size
        self.completion_batch_size = max(completion_batch_size, prefill_batch_size)
        self.prefill_step_size = prefill_step_size
        self._config = EngineConfig(
            max_seqs=self.completion_batch_size,
            prefill_chunk=prefill_step_size,
            max_batched_tokens=self.completion_batch_size + prefill_batch_size * prefill_step_size,
            vision_budget=prefill_batch_size,
            vision_cache_bytes=vision_cache_size * VISION_ENTRY_BYTES if enable_vision_cache else 0,
            prefix_cache_bytes=_prefix_cache_bytes(prefix_cache_config),
            max_kv_size=max_kv_size or None,
            logprob_vectors=True,
            trace_path=trace_path,
        )
        self._event_sinks = event_sinks
        self._mtp_head: Any = None
        self._engine: Engine | None = None
        self._uid_counter = 0
        self._requests: dict[int, MLLMBatchRequest] = {}  # live, by uid
        self._uid_of: dict[str, int] = {}  # engine request id -> uid
        self._removed: set[int] = set()  # removed uids: their outputs are dropped, never returned
        self._pending_error_responses: list[MLLMBatchResponse] = []
        self._pending_removal_uids: set[int] = set()
        self._pending_removal_lock = threading.Lock()
        self._stats = MLLMBatchStats()

    # ---- configuration ----------------------------------------------------------------------------------
    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = Engine(self.model, self.processor, self._config, event_sinks=self._event_sinks,
                                  mtp_head=self._mtp_head)
        return self._engine

    def _configure(self, **changes: Any) -> None:
        if self._engine is not None:
            raise RuntimeError("configure the generator before the first insert() or next(): the running "
                               "engine's budgets are part of its trace")
        self._config = dataclasses.replace(self._config, **changes)

    # ---- requests in ------------------------------------------------------------------------------------
    def insert(self, requests: List[MLLMBatchRequest]) -> List[int]:
        """Queue requests; returns their uids. Bad input never raises here: that request gets an "error"
        response from the next `next()`, like the reference's preprocessing failures."""
        uids = []
        # the engine first: a configuration error (e.g. drafting this model cannot do) is the caller's, raised
        # here for the whole call, never turned into one request's error response
        self.engine
        for req in requests:
            req.uid = self._uid_counter
            self._uid_counter += 1
            uids.append(req.uid)
            try:
                self._add(req)
            except (InvalidRequest, ValueError, TypeError) as exc:
                logger.warning("request %s refused: %s", req.request_id, exc)
                self._pending_error_responses.append(self._terminal(req, "error"))
        return uids

    def _add(self, req: MLLMBatchRequest) -> None:
        if req.videos or req.audio:
            raise InvalidRequest("videos" if req.videos else "audio", "video and audio inputs are not supported yet")
        sampling = SamplingParams(
            max_tokens=req.max_tokens if req.max_tokens is not None else self.max_tokens,
            temperature=req.temperature, top_p=req.top_p if req.top_p and req.top_p > 0 else 1.0,
            top_k=req.top_k, min_p=req.min_p, presence_penalty=req.presence_penalty,
            repetition_penalty=req.repetition_penalty, stop_token_ids=tuple(sorted(self.stop_tokens)),
            logits_processors=tuple(req.logits_processors or ()),
        )
        if req.input_ids is not None:
            tokens = req.input_ids
            # vllm-mlx hands (1, L) batches of one; any other shape is refused by add_request
            if getattr(tokens, "ndim", None) == 2 and tokens.shape[0] == 1:
                tokens = tokens[0]
            elif isinstance(tokens, list) and len(tokens) == 1 and isinstance(tokens[0], list):
                tokens = tokens[0]
            self.engine.add_request(prompt_tokens=tokens, images=req.images, sampling=sampling,
                                    request_id=req.request_id)
        else:
            self.engine.add_request(prompt=req.prompt, images=req.images, sampling=sampling,
                                    request_id=req.request_id)
        req.is_text_only = not req.images
        self._requests[req.uid] = req
        self._uid_of[req.request_id] = req.uid

    # ---- requests out -----------------------------------------------------------------------------------
    def remove(self, uids: List[int]) -> None:
        """Stop these requests now; they get no further response (not even an abort one)."""
        for uid in uids:
            req = self._requests.get(uid)
            if req is None:
                continue
            self._removed.add(uid)
            try:
                self.engine.abort(req.request_id)
            except UnknownRequest:
                pass

    def schedule_removal(self, uids: List[int]) -> None:
        """Thread-safe: removal happens at the start of the next `next()`."""
        with self._pending_removal_lock:
            self._pending_removal_uids.update(uids)

    def process_pending_removals(self) -> None:
        with self._pending_removal_lock:
            pending, self._pending_removal_uids = self._pending_removal_uids, set()
        if pending:
            self.remove(list(pending))

    def abort_prefill(self, request_id: str) -> None:
        """Abort a request that has not started decoding: it ends with an "abort" response. A request
        already decoding is left alone (use `remove`), as in the reference."""
        uid = self._uid_of.get(request_id)
        if uid is None:
            return
        state = self.engine.state_of(request_id)
        if state.value in ("queued", "vision_encoding", "chunk_prefilling"):
            self.engine.abort(request_id)

    # ---- the loop -----------------------------------------------------------------------------------------
    def next(self) -> List[MLLMBatchResponse]:
        engine = self.engine  # before taking the queued responses: if this raises, none of them is lost
        self.process_pending_removals()
        responses, self._pending_error_responses = self._pending_error_responses, []
        if not engine.has_pending():
            return responses
        for out in self.engine.step():
            uid = self._uid_of.get(out.request_id)
            if uid is None:
                continue
            req = self._requests[uid]
            if out.finished:
                self._forget(uid)
            if uid in self._removed:
                if out.finished:
                    self._removed.discard(uid)
                continue
            for i, token in enumerate(out.token_ids):
                req.output_tokens.append(token)
                req.num_tokens = len(req.output_tokens)
                last = i == len(out.token_ids) - 1
                responses.append(MLLMBatchResponse(
                    uid=uid, request_id=req.request_id, token=token,
                    logprobs=out.logprob_vectors[i] if i < len(out.logprob_vectors) else mx.zeros(1),
                    finish_reason=out.finish_reason.value if (last and out.finished) else None,
                    # the tokens before the last one of a drafting step are accepted drafts
                    from_draft=not last,
                    mtp_attempted=i == 0 and out.num_drafted > 0,
                    mtp_attempted_count=out.num_drafted if i == 0 else 0,
                ))
            if out.finished and not out.token_ids:  # abort / error: the reference's token-0 response
                responses.append(self._terminal(req, out.finish_reason.value))
        return responses

    def _terminal(self, req: MLLMBatchRequest, reason: str) -> MLLMBatchResponse:
        return MLLMBatchResponse(uid=req.uid, request_id=req.request_id, token=0, logprobs=mx.zeros(1),
                                 finish_reason=reason)

    def _forget(self, uid: int) -> None:
        req = self._requests.pop(uid, None)
        if req is not None:
            self._uid_of.pop(req.request_id, None)

    def has_pending(self) -> bool:
        return bool(self._pending_error_responses) or (self._engine is not None and self._engine.has_pending())

    # ---- stats --------------------------------------------------------------------------------------------
    def stats(self) -> MLLMBatchStats:
        if self._engine is not None:
            s = self._engine.stats()
            self._stats.prompt_tokens = s.prompt_tokens
            self._stats.prompt_time = s.prompt_time
            self._stats.generation_tokens = s.generation_tokens
            self._stats.generation_time = s.generation_time
            self._stats.vision_encoding_time = s.vision_encoding_time
            self._stats.num_images_processed = s.num_images_processed
        self._stats.peak_memory = mx.get_peak_memory() / 1e9
        return self._stats

    def get_prefill_progress(self, request_id: str) -> Optional[Tuple[int, int]]:
        if self._engine is None:
            return None
        return self._engine.prefill_progress(request_id)

    def get_vision_cache_stats(self) -> Dict[str, Any]:
        stats = self._engine.vision_cache_stats() if self._engine is not None else None
        if not stats:
            return {"hits": 0, "misses": 0, "hit_rate": 0.0, "entries": 0, "time_saved": 0.0}
        return {"hits": stats["hits"], "misses": stats["misses"], "hit_rate": stats["hit_rate"],
                "entries": stats["entries"], "time_saved": stats["encoder_time_saved_s"], **stats}

    def get_prefix_cache_stats(self) -> Dict[str, Any]:
        stats = self._engine.prefix_cache_stats() if self._engine is not None else None
        return stats if stats is not None else dict(_EMPTY_PREFIX_STATS)

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to release
            pass


def install_chunked_prefill_mllm(batch_gen: MLLMBatchGenerator, budget: int = 1024) -> None:
    """Interleave prefill with decode: at most `budget` prefill tokens per `next()`, next to a decode step for
    every running request. Our engine always interleaves; this sets the per-tick prefill budget."""
    if not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget: must be an integer >= 1, got {budget!r}")
    batch_gen._configure(prefill_chunk=budget, max_prefill_tokens=budget,
                         max_batched_tokens=batch_gen.completion_batch_size + budget)


def install_mtp_mllm(batch_gen: MLLMBatchGenerator, language_model: Any, num_draft_tokens: int = 1) -> None:
    """Multi-token-prediction drafting: up to `num_draft_tokens` drafts per row per step from an MTP head,
    verified in the same batched forward with exact acceptance (greedy rows: unchanged output; sampled rows:
    unchanged distribution). `language_model` is the MTP head (`scheduler.execution.mtp.MTPHead`) or an object carrying
    one as `.mtp_head`. Plain configuration: call it before the first `insert()`/`next()`. A configuration the
    engine refuses (drafting on a model whose caches cannot be rolled back, a vision-language model, a model
    whose logits the MTP seam cannot reproduce) raises here, and the generator stays as it was."""
    from scheduler.execution.mtp import MTPHead

    head = language_model if isinstance(language_model, MTPHead) else getattr(language_model, "mtp_head", None)
    if head is None:
        raise TypeError("install_mtp_mllm needs an MTP head: pass scheduler.execution.mtp.MTPHead (load_mtp_head(model_dir)) "
                        "or an object with an .mtp_head attribute")
    if not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens: must be an integer >= 1, got {num_draft_tokens!r}")
    before = batch_gen._config
    batch_gen._configure(draft_tokens=num_draft_tokens, drafter="mtp",
                         max_batched_tokens=batch_gen._config.max_batched_tokens
                         + num_draft_tokens * batch_gen.completion_batch_size)
    try:  # what the engine would refuse (a model whose caches cannot roll back, a VLM, ...) is refused here,
        # by building one as configured (no trace, no sinks) and dropping it: the real one is built at first use
        Engine(batch_gen.model, batch_gen.processor, dataclasses.replace(batch_gen._config, trace_path=None),
               mtp_head=head)
    except Exception:
        batch_gen._config = before  # the generator stays usable without MTP
        raise
    batch_gen._mtp_head = head
