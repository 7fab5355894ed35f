"""vllm-mlx's `MLLMBatchGenerator` surface, on mlxsched's engine.

Engine authors who use vllm-mlx can switch by changing an import: the classes, fields, defaults and methods
keep the reference's names. Underneath, every call goes through `Engine` (the declared lifecycle, the pure
planner, the event log); nothing here touches a model or a cache directly. Where the reference misbehaves we
keep the interface and fix the behaviour; MIGRATION.md lists every difference.

The two feature switches the reference installs by replacing methods (`install_chunked_prefill_mllm`,
`install_mtp_mllm`) are plain configuration here. The engine is built lazily on the first `insert`/`next`, so
configuration calls made right after construction (the reference's usage) take effect without any
monkeypatching; calling them later raises, because a running engine's budgets are part of its trace.

The reference's own consumers (`vllm_mlx.mllm_scheduler.MLLMScheduler`, and `BatchedEngine` over it) run on this
class unchanged when `vllm_mlx.mllm_batch_generator` resolves to this module (tests/surfaces/test_dropin.py): they read
`language_model`, `prefix_cache` (`clear()`, `set_ssd_tier()`), `get_mtp_stats()` and pass `sampler=`.
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


class PrefillAbortedError(Exception):
    """The reference raises this inside its prefill loop when a request is aborted mid-prefill. Here an aborted
    prefill ends that request with an "abort" response and nothing is raised; the name is kept so code that
    imports or catches it keeps working."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        super().__init__(f"Prefill aborted for request {request_id}")


@dataclass
class MLLMBatchRequest:
    """Request data, with the reference's fields and defaults. Our engine reads prompt / input_ids, images,
    videos, audio, max_tokens, sampling fields and logits_processors; it maintains num_tokens and output_tokens.
    `temperature=None` means "no sampling of its own": the generator's `sampler=` picks its tokens (greedy
    when there is none, the reference's argmax default). `mllm_draft` (newer reference releases, same default):
    with an external draft model (`install_mtp_mllm(..., draft_model=)`) only requests that set it True draft;
    an MTP module drafts for every request, as there. It is the last field here (0.4.1's field order is kept;
    newer releases put it before `logits_processors`)."""

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
    mllm_draft: bool = False


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
    # image placeholders this generator inserted into the request's prompt (it had none): set on the first
    # response, see MLLMBatchGenerator._prompt_with_placeholders
    placeholders_inserted: int = 0


@dataclass
class MLLMBatch:
    """The decoding requests, with the reference's field names (`MLLMBatchGenerator.active_batch`). A snapshot
    for reading: our engine's batch state (caches, rows) is the executor's, and `cache` is always empty."""

    uids: List[int]
    request_ids: List[str]
    y: Any  # (B,) the last token of each request
    logprobs: List[Any]
    max_tokens: List[int]
    num_tokens: List[int]
    cache: List[Any]
    requests: List[MLLMBatchRequest]
    logits_processors: Optional[List[Optional[List[Callable]]]] = None
    samplers: Optional[List[Optional[Callable]]] = None

    def __len__(self) -> int:
        return len(self.uids)


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


class PrefixCacheHandle:
    """`MLLMBatchGenerator.prefix_cache`: the methods the reference's consumers call on its prefix cache, over
    our engine's prefix cache (which the scheduler owns; clearing is a recorded decision)."""

    def __init__(self, generator: "MLLMBatchGenerator"):
        self._generator = generator

    def clear(self) -> None:
        """Drop every entry. Applied at the start of the next `next()` (a tick boundary, so the trace records
        it and replay re-applies it); every request inserted before that tick already sees the empty cache."""
        engine = self._generator._engine
        if engine is not None:
            engine.clear_prefix_cache()

    def get_stats(self) -> Dict[str, Any]:
        return self._generator.get_prefix_cache_stats()

    def set_ssd_tier(self, tier: Any) -> None:
        raise NotImplementedError("prefix_cache.set_ssd_tier: an SSD cold tier for the prefix cache is not built "
                                  "in mlxsched (see MIGRATION.md); run without ssd_cache_dir")

    def save_to_disk(self, cache_dir: str) -> bool:
        raise NotImplementedError("prefix_cache.save_to_disk: persisting the prefix cache is not built in mlxsched "
                                  "(see MIGRATION.md)")

    def load_from_disk(self, cache_dir: str) -> int:
        raise NotImplementedError("prefix_cache.load_from_disk: persisting the prefix cache is not built in "
                                  "mlxsched (see MIGRATION.md)")

    def __len__(self) -> int:
        return int(self.get_stats()["entry_count"])


_MTP_BYPASS_KEYS = ("prefill", "no_active_batch", "concurrent_batch", "logits_processors")


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
        if sampler is not None and not callable(sampler):
            raise TypeError(f"sampler: must be a callable logprobs -> tokens, got {type(sampler).__name__}")
        self.model = model
        # what the reference's consumers read: the text model inside a VLM (the model itself for a text model)
        self.language_model = getattr(model, "language_model", model)
        self.is_vlm = hasattr(model, "language_model")
        # The default sampler, as in the reference (argmax when none is given): it picks the tokens of a request
        # with no sampling of its own (temperature=None); every other request samples with its own fields. Without
        # one given, such a request is greedy through the vectorised sampler (the same tokens as argmax).
        self.sampler = sampler or (lambda logprobs: mx.argmax(logprobs, axis=-1))
        self._given_sampler = sampler
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
            vision_token_budget=None,  # the reference batches media by request count only
            vision_cache_bytes=vision_cache_size * VISION_ENTRY_BYTES if enable_vision_cache else 0,
            prefix_cache_bytes=_prefix_cache_bytes(prefix_cache_config),
            max_kv_size=max_kv_size or None,
            logprob_vectors=True,
            processor_history="output",  # the reference's processors and penalties see generated tokens only
            trace_path=trace_path,
        )
        self.prefix_cache: Optional[PrefixCacheHandle] = (
            PrefixCacheHandle(self) if self._config.prefix_cache_bytes else None)
        self._event_sinks = event_sinks
        self._mtp_head: Any = None
        self._draft_model: Any = None
        self._mtp_requested: Optional[int] = None  # num_draft_tokens asked of install_mtp_mllm (None: not installed)
        self._mtp_effective = 0
        self._mtp_bypass = dict.fromkeys(_MTP_BYPASS_KEYS, 0)
        self._engine: Engine | None = None
        self._uid_counter = 0
        self._requests: dict[int, MLLMBatchRequest] = {}  # live, by uid
        self._uid_of: dict[str, int] = {}  # engine request id -> uid
        self._removed: set[int] = set()  # removed uids: their outputs are dropped, never returned
        self._pending_error_responses: list[MLLMBatchResponse] = []
        self._pending_removal_uids: set[int] = set()
        self._pending_removal_lock = threading.Lock()
        self._placeholders: dict[str, int] = {}  # request id -> image placeholders inserted (until its first token)
        self._stats = MLLMBatchStats()

    # ---- configuration ----------------------------------------------------------------------------------
    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = Engine(self.model, self.processor, self._config, event_sinks=self._event_sinks,
                                  mtp_head=self._mtp_head, draft_model=self._draft_model)
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
        own_sampling = req.temperature is not None
        sampling = SamplingParams(
            max_tokens=req.max_tokens if req.max_tokens is not None else self.max_tokens,
            temperature=req.temperature if own_sampling else 0.0,
            top_p=req.top_p if own_sampling and req.top_p and req.top_p > 0 else 1.0,
            top_k=req.top_k if own_sampling else 0, min_p=req.min_p if own_sampling else 0.0,
            presence_penalty=req.presence_penalty,
            repetition_penalty=req.repetition_penalty, stop_token_ids=tuple(sorted(self.stop_tokens)),
            logits_processors=tuple(req.logits_processors or ()),
            sampler=None if own_sampling else self._given_sampler,
            # an external draft model drafts only for the requests that ask for it (the reference's opt-in)
            allow_drafts=bool(req.mllm_draft) if self._draft_model is not None else True,
        )
        media = dict(images=req.images or None, videos=req.videos or None, audio=req.audio or None)
        if req.input_ids is not None:
            tokens = req.input_ids
            # vllm-mlx hands (1, L) batches of one; any other shape is refused by add_request
            if getattr(tokens, "ndim", None) == 2 and tokens.shape[0] == 1:
                tokens = tokens[0]
            elif isinstance(tokens, list) and len(tokens) == 1 and isinstance(tokens[0], list):
                tokens = tokens[0]
            self.engine.add_request(prompt_tokens=tokens, sampling=sampling, request_id=req.request_id, **media)
        else:
            prompt, inserted = self._prompt_with_placeholders(req)
            self.engine.add_request(prompt=prompt, sampling=sampling, request_id=req.request_id, **media)
            self._placeholders[req.request_id] = inserted
        req.is_text_only = not (req.images or req.videos or req.audio)
        self._requests[req.uid] = req
        self._uid_of[req.request_id] = req.uid

    def _prompt_with_placeholders(self, req: MLLMBatchRequest) -> Tuple[Any, int]:
        """An image request whose prompt has no image placeholder (the raw "What's in this image?" the
        reference's own tests send) is rendered as one user message through the model's chat template, which
        puts the placeholders where the model expects them; the first response says how many were inserted.
        A prompt that is already templated (it holds the tokenizer's special tokens) is left alone: where its
        placeholders go cannot be known, so the engine refuses it with a clear error (an "error" response)."""
        vlm = self.engine.vlm
        image_token = getattr(vlm, "image_token", None)
        if not req.images or vlm is None or not image_token or not isinstance(req.prompt, str):
            return req.prompt, 0
        if image_token in req.prompt:
            return req.prompt, 0
        tokenizer = getattr(self.processor, "tokenizer", self.processor)
        specials = [t for t in getattr(tokenizer, "all_special_tokens", ()) if t and t != image_token]
        if any(t in req.prompt for t in specials):
            return req.prompt, 0
        return [{"role": "user", "content": req.prompt}], len(req.images)

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
        outputs = engine.step()
        if self._mtp_requested is not None:
            self._count_mtp_bypasses(outputs)
        for out in outputs:
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
                    placeholders_inserted=self._placeholders.pop(req.request_id, 0),
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
            self._placeholders.pop(req.request_id, None)

    def _count_mtp_bypasses(self, outputs: List[Any]) -> None:
        """The reference's bypass counters, per `next()` and per condition (overlapping): a step with no running
        request, a step where a request got its first token (prefill: it cannot draft yet) and a step where a
        request with logits processors (or, with a draft model, one without `mllm_draft`) decoded undrafted. Concurrent batches
        never bypass here: every row drafts and is verified on its own."""
        if not outputs:
            self._mtp_bypass["no_active_batch"] += 1
            return
        produced = [(o, self._requests.get(self._uid_of.get(o.request_id, -1))) for o in outputs if o.token_ids]
        produced = [(o, req) for o, req in produced if req is not None]
        if any(not req.output_tokens for _, req in produced):  # counted before this step's tokens are appended
            self._mtp_bypass["prefill"] += 1
        if any(req.logits_processors or (self._draft_model is not None and not req.mllm_draft)
               for _, req in produced):
            self._mtp_bypass["logits_processors"] += 1

    def has_pending(self) -> bool:
        return bool(self._pending_error_responses) or (self._engine is not None and self._engine.has_pending())

    @property
    def active_batch(self) -> Optional[MLLMBatch]:
        """The decoding requests as an `MLLMBatch` snapshot (None when nothing decodes)."""
        if self._engine is None:
            return None
        reqs = [self._requests[self._uid_of[rid]] for rid in self._engine.scheduler.decoding if rid in self._uid_of]
        if not reqs:
            return None
        return MLLMBatch(uids=[r.uid for r in reqs], request_ids=[r.request_id for r in reqs],
                         y=mx.array([r.output_tokens[-1] if r.output_tokens else 0 for r in reqs]),
                         logprobs=[], max_tokens=[r.max_tokens for r in reqs], num_tokens=[r.num_tokens for r in reqs],
                         cache=[], requests=reqs,
                         logits_processors=[r.logits_processors for r in reqs] if any(r.logits_processors for r in reqs)
                         else None)

    def get_mtp_stats(self) -> Dict[str, Any]:
        """The reference's MTP stats keys. Counts are draft tokens: attempted = proposed, accepted / rejected by
        per-row verification (the reference counts one attempt per batch step); errors = drafter failures (those
        steps decoded plainly)."""
        stats = self._engine.draft_stats() if self._engine is not None else None
        drafted = stats["drafted"] if stats else 0
        accepted = stats["accepted"] if stats else 0
        return {
            "enabled": self._mtp_requested is not None,
            "requested_draft_tokens": self._mtp_requested or 0,
            "effective_draft_tokens": self._mtp_effective,
            "mode": "per_row_exact_verified" if self._mtp_requested is not None else "disabled",
            "attempted": drafted,
            "accepted": accepted,
            "rejected": drafted - accepted,
            "errors": stats["drafter_failures"] if stats else 0,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "bypass_counts": dict(self._mtp_bypass),
            "bypass_counts_semantics": "per_condition_overlapping_not_total_steps",
        }

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


def install_mtp_mllm(batch_gen: MLLMBatchGenerator, language_model: Any = None, num_draft_tokens: int = 1, *,
                     draft_model: Any = None, draft_block_size: Optional[int] = None) -> None:
    """Speculative decoding, verified in the same batched forward with exact acceptance per row (greedy rows:
    unchanged output; sampled rows: unchanged distribution). Plain configuration: call it before the first
    `insert()`/`next()`. The drafter, by what is given:

    - `draft_model=` (newer reference releases, where it is an mlx-vlm MTP assistant drafter; here an mlx-lm
      model sharing the target's vocabulary: an mlx-vlm assistant drafter is refused): `draft_block_size - 1`
      drafts per step (the block holds the target's own token too; default: `num_draft_tokens`), only for the
      requests with `mllm_draft=True`, as there;
    - `language_model` with the model's native MTP module (`.mtp` and `.mtp_forward(hidden, tokens, mtp_cache=)`,
      with `return_hidden=True` on its call: what the reference's scheduler passes): one draft per step, as the
      native head predicts only the token after next;
    - `language_model` an `scheduler.execution.mtp.MTPHead` (or an object carrying one as `.mtp_head`): up to
      `num_draft_tokens` chained drafts per step.

    A configuration the engine refuses (drafting on a model whose caches cannot be rolled back, a model whose
    logits the MTP seam cannot reproduce, ...) raises here, and the generator stays as it was.
    """
    from scheduler.execution.mtp import MTPHead, has_native_mtp

    if not isinstance(num_draft_tokens, int) or isinstance(num_draft_tokens, bool) or num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens: must be an integer >= 1, got {num_draft_tokens!r}")
    if draft_block_size is not None and (not isinstance(draft_block_size, int) or draft_block_size < 1):
        raise ValueError(f"draft_block_size: must be an integer >= 1 or None, got {draft_block_size!r}")
    if draft_model is not None:
        if callable(getattr(draft_model, "set_shared_kv", None)):
            raise TypeError("draft_model: an mlx-vlm MTP assistant drafter (shared-KV) is not supported: pass an "
                            "mlx-lm model with the target's vocabulary, or the model's native MTP module as "
                            "language_model (see MIGRATION.md)")
        drafter, head = "draft-model", None
        k = max(1, draft_block_size - 1) if draft_block_size is not None else num_draft_tokens
    elif isinstance(language_model, MTPHead) or isinstance(getattr(language_model, "mtp_head", None), MTPHead):
        head = language_model if isinstance(language_model, MTPHead) else language_model.mtp_head
        drafter, k = "mtp", num_draft_tokens
    elif has_native_mtp(language_model):
        drafter, head, k = "mtp", language_model, 1
    else:
        raise TypeError("install_mtp_mllm needs a drafter: a language model with its native MTP module (.mtp and "
                        ".mtp_forward), an MTP head (scheduler.execution.mtp.MTPHead, or an object with .mtp_head), "
                        "or draft_model=<mlx-lm model>")
    before = batch_gen._config
    # draft_gate=False: the reference verifies a draft every step for each request that asked, and so does its
    # drop-in (the engine's tick-level gate would decline drafts that do not pay for the batch)
    batch_gen._configure(draft_tokens=k, drafter=drafter, draft_gate=False,
                         max_batched_tokens=batch_gen._config.max_batched_tokens + k * batch_gen.completion_batch_size)
    try:  # what the engine would refuse (a model whose caches cannot roll back, a VLM, ...) is refused here,
        # by building one as configured (no trace, no sinks) and dropping it: the real one is built at first use
        Engine(batch_gen.model, batch_gen.processor, dataclasses.replace(batch_gen._config, trace_path=None),
               mtp_head=head, draft_model=draft_model)
    except Exception:
        batch_gen._config = before  # the generator stays usable without drafting
        raise
    batch_gen._mtp_head, batch_gen._draft_model = head, draft_model
    batch_gen._mtp_requested, batch_gen._mtp_effective = num_draft_tokens, k
