"""Engine: the loop that ties plan -> execute -> apply together, and the public surface.

One thread owns the loop (`step()`); `add_request` and `abort` may be called from any thread: they go into a
locked inbox drained at the top of each tick, so a tick's plan sees a consistent set of requests.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import mlx.core as mx

from caches.layers import MaskLayout, QuantizationRefused, capabilities as cache_capabilities

from .execution import library
from .calibration import Calibration, calibrate
from .config import EngineConfig, chunk_cap
from .plan import ENCODED_RECORD, PLAN_RECORD_GROUPS, PREFILL_PAD_RATIO, VISION_BUDGET_COUNTS
from .events import EventLog, JsonlSink
from .execution.executor import MLXExecutor
from .execution.runners import TextRunner, VisionLanguageRunner
from .execution.structured import GrammarCompiler
from .families import UnsupportedFeature
from .lifecycle import RequestState
from .loop import TickLoop
from .models.fetch import FetchPolicy
from .models.lora import LoRAInUse, LoRASet, UnknownLoRA
from .models.prompt import MediaInputs, PromptResolver, ResolvedPrompt
from .policy import policy_record
from .request import (
    FinishReason,
    InvalidRequest,
    Request,
    SamplingParams,
    UnknownRequest,
)
from .sampling_checks import check_sampling
from .scheduler import InvariantViolation, Scheduler, StepOutput

_ENDED_MEMORY = 65536  # how many ended ids `abort`/`state_of` still recognise


@dataclass
class RequestOutput:
    """A finished request, as `generate` returns it."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: Any
    error: str | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # SamplingParams.top_logprobs
    # SamplingParams.prompt_logprobs: each prompt token's logprob (None for the first), its alternatives, and its
    # rank (StepOutput.prompt_logprob_ranks)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprob_ranks: list[int | None] | None = None
    prompt_token_ids: list[int] | None = None  # the prompt as the engine ran it (StepOutput.prompt_token_ids)


def prompt_scores(out: StepOutput | None) -> dict[str, Any]:
    """A RequestOutput's prompt fields, from the request's first output (None: it produced none): the prompt,
    and its logprobs where the request asked for them."""
    if out is None:
        return {}
    return {"prompt_logprobs": out.prompt_logprobs, "prompt_top_logprobs": out.prompt_top_logprobs,
            "prompt_logprob_ranks": out.prompt_logprob_ranks, "prompt_token_ids": out.prompt_token_ids}


class Throughput:
    """tok/s from token and time counters (shared with the vllm-mlx compatible stats)."""

    prompt_tokens: int
    prompt_time: float
    generation_tokens: int
    generation_time: float

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_time if self.prompt_time else 0.0

    @property
    def generation_tps(self) -> float:
        return self.generation_tokens / self.generation_time if self.generation_time else 0.0


@dataclass
class EngineStats(Throughput):
    prompt_tokens: int = 0
    prompt_time: float = 0.0
    generation_tokens: int = 0
    generation_time: float = 0.0
    ticks: int = 0
    vision_encoding_time: float = 0.0
    num_images_processed: int = 0
    peak_memory_bytes: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    time_in_state: dict[str, float] = field(default_factory=dict)
    # the caches' and the drafter's own stats, as their separate calls give them (None: that cache is off)
    kv_cache: dict[str, Any] = field(default_factory=dict)
    prefix_cache: dict[str, Any] | None = None
    vision_cache: dict[str, Any] | None = None
    drafting: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "prompt_time": self.prompt_time,
            "prompt_tps": self.prompt_tps,
            "generation_tokens": self.generation_tokens,
            "generation_time": self.generation_time,
            "generation_tps": self.generation_tps,
            "ticks": self.ticks,
            "vision_encoding_time": self.vision_encoding_time,
            "num_images_processed": self.num_images_processed,
            "peak_memory_bytes": self.peak_memory_bytes,
            "requests_finished": self.requests_finished,
            "requests_aborted": self.requests_aborted,
            "time_in_state": dict(self.time_in_state),
            "kv_cache": dict(self.kv_cache),
            "prefix_cache": None if self.prefix_cache is None else dict(self.prefix_cache),
            "vision_cache": None if self.vision_cache is None else dict(self.vision_cache),
            "drafting": dict(self.drafting),
        }


@dataclass
class _Arrival:
    request_id: str
    prompt: ResolvedPrompt
    sampling: SamplingParams
    priority: int
    arrival_time: float
    lora: str | None = None
    cache_salt: str | None = None


class Engine:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        config: EngineConfig | None = None,
        executor: Any = None,
        event_sinks: Sequence[Any] = (),
        policy: Any = None,
        draft_model: Any = None,
        mtp_head: Any = None,
        shard_group: Any = None,
        clock: Callable[[], float] = time.perf_counter,
        on_shard_lost: Sequence[Callable[[Any], None]] = (),
        loras: Mapping[str, str | Path] | None = None,
    ):
        """`loras`: LoRA adapters a request may choose (`add_request(lora=name)`), by name -> adapter directory
        (the layout `mlx_lm.lora` and mlx-vlm's trainer write, or Hugging Face PEFT's; a vision-language model's
        adapt its language model only). They are installed on `model` in place (`scheduler/models/lora.py`): its
        adapted layers compute the base model wherever no row chooses an adapter, so requests on the base model and
        on any adapters share every batch. Raises LoRAError for an adapter that cannot be read or does not fit the
        model.

        `on_shard_lost`: with a sharded model, called with the `ShardLost` error when this rank's forward
        stalls after a peer died (`EngineConfig.shard_stall_timeout_s`), from the watchdog's thread, after the
        trace is flushed and just before the process exits; a lost peer that MLX reports is raised as usual.

        `clock` stamps every time the engine records (arrivals, state changes, ticks, trace events): wall
        time by default. Another clock may stop only between calls into the engine (durations measured inside
        one call stay true on it): `tools.side_by_side` runs two engines tick by tick on one machine, each on a
        clock that stops while the other works."""
        self.model = model
        self.config = config or EngineConfig()
        sinks = list(event_sinks)
        # one trace for a sharded model: rank 0's (the other ranks decide nothing)
        if self.config.trace_path and (shard_group is None or shard_group.rank() == 0):
            sinks.append(JsonlSink(self.config.trace_path))
        self.clock = clock
        self.events = EventLog(sinks, clock=clock)
        # here, on the constructing thread: the engine may be stepped from another (AsyncEngine, the server)
        library.materialize(model, draft_model, mtp_head)
        # how media given as http(s) URLs are fetched (None: refused); the server fetches by the same policy
        self.media_fetch = _media_fetch(self.config)
        family = _model_family(model, tokenizer, self.config, self._vision_event, self.media_fetch)
        self.loras = _install_loras(model, loras, family.vlm is not None, shard_group) if loras else None
        self._runner = family.runner
        self.vlm, self.vision_cache = family.vlm, family.vision_cache
        self.tokenizer, self.vocab_size = family.tokenizer, family.vocab_size
        # structured outputs: constraints are compiled and checked on arrival, enforced by the executor
        self.grammars = GrammarCompiler(family.tokenizer, family.vocab_size, family.stop_ids)
        limit = family.vlm.position_limit if family.vlm is not None else None
        if limit is not None and (self.config.max_model_len or 0) > limit[0]:
            # past the limit batched rows would get other rows' positions (VLMAdapter.position_limit)
            raise ValueError(f"max_model_len: this checkpoint batches exactly only up to {limit[0]} positions "
                             f"({limit[1]}); got {self.config.max_model_len}")
        self.max_model_len = self.config.max_model_len or family.max_positions or 1 << 30
        self.prompts = PromptResolver(self.tokenizer, self.vlm, self.vocab_size, self.max_model_len,
                                      self.config.video_fps, self.config.video_max_frames, family.min_prompt,
                                      self.config.one_forward_limit())
        if self.config.max_kv_size is not None and not library.supports_max_kv_size(
                model.language_model if self.vlm is not None else model):
            raise ValueError("max_kv_size: this model builds its own caches (e.g. sliding windows); "
                             "mlx-lm ignores max_kv_size for it and so would the results")
        sharded = shard_group is not None and shard_group.size() > 1
        watchdog = _stall_watchdog(shard_group.rank(), self, tuple(on_shard_lost)) if sharded else None
        with contextlib.ExitStack() as undo:  # a construction that fails stops the watchdog it started
            if watchdog is not None:
                undo.callback(watchdog.close)
            # The KV layout is measured for text models even without a budget: the trace records it, so a what-if
            # simulation can try a budget on any trace. With a sharded model its probe forwards are collectives
            # like any tick's, so they run under the stall watchdog too.
            with watchdog.guard("the KV-layout probe forward") if watchdog is not None else contextlib.nullcontext():
                self.kv_layout = (self.vlm.kv_layout() if self.vlm is not None
                                  else library.kv_layout(model, self.config.max_kv_size))
                if self.vlm is None:
                    library.check_rows_at_different_positions(model, self.config.max_kv_size)
                if draft_model is not None:  # (it decodes a row per request too)
                    library.check_rows_at_different_positions(draft_model)
                self.quantize = self._quantize_rule(model)  # kv_bits: and the layout counts quantized bytes
            if self.kv_layout is not None and draft_model is not None and self.config.drafter == "draft-model":
                # the draft model keeps a row per decoding request too: the budget counts its layers as well
                self.kv_layout = self.kv_layout.combined(library.kv_layout(draft_model))
            budget_layout = self.kv_layout if self.config.kv_memory_bytes is not None else None
            self.scheduler = Scheduler(self.config, self.events, family.stop_ids, policy, budget_layout,
                                       max_model_len=self.max_model_len,
                                       vision_cached=None if family.vision_cache is None
                                       else family.vision_cache.__contains__)
            # A model sharded across processes (tensor_group / pipeline_group in from_pretrained): rank 0 runs this
            # engine, the other ranks `follow()` it (scheduler/execution/distributed.py).
            self.shard = _Shard.create(shard_group, self, watchdog) if sharded else None
            prefix_payloads = self.shard.prefix_payloads if self.shard is not None else self.scheduler.prefix_cache
            self.executor = executor or MLXExecutor(family.runner, penalty_context=self.config.penalty_context,
                                                    processor_history=self.config.processor_history,
                                                    prefix_cache=prefix_payloads,
                                                    logprob_vectors=self.config.logprob_vectors,
                                                    drafter=self._make_drafter(draft_model, mtp_head),
                                                    draft_gate=self._make_draft_gate(),
                                                    on_event=self._executor_event, quantize=self.quantize,
                                                    grammars=self.grammars, model_stop_ids=family.stop_ids,
                                                    loras=self.loras)
            if self.shard is not None:
                self.executor = self.shard.wrap(self.executor)
            self.loop = TickLoop(self.scheduler, self.executor)
            undo.pop_all()
        # and again after the probe forwards above: a model may keep arrays its first forward builds lazily (mlx-vlm's
        # Kimi K3 caches its attention-residual weights, `_attn_res_w_eff`, on the layer), which would otherwise
        # belong to this thread's stream when another thread's forward first needs them
        library.materialize(model, draft_model, mtp_head)
        self.tick = 0
        self._lock = threading.Lock()
        self._inbox: list[_Arrival] = []
        self._abort_inbox: list[str] = []
        self._clear_prefix_requested = False  # clear_prefix_cache(): applied at the start of the next tick
        self._known_live: set[str] = set()  # ids accepted and not ended (guarded by _lock)
        # LoRA adapters (guarded by _lock): the names a request may choose, the adapter of each live request on
        # one, and adapters loaded or unloaded while running, applied at the start of the next tick
        self._lora_names: set[str] = set(self.loras.names) if self.loras is not None else set()
        self._lora_of: dict[str, str] = {}
        self._lora_changes: list[tuple[str, Any]] = []
        self._ended: OrderedDict[str, RequestState] = OrderedDict()
        self._ids = itertools.count()
        self._stats = EngineStats()
        self.events.emit(
            "engine_start", 0, config={**_config_record(self.config), "policy": self.scheduler.policy.name},
            policy=policy_record(self.scheduler.policy),
            model=library.model_identity(model.language_model if self.vlm else model),
            vocab_size=self.vocab_size, max_model_len=self.max_model_len,
            stop_token_ids=sorted(self.scheduler.model_stop_ids),
            kv_layout=None if self.kv_layout is None else self.kv_layout.record(),
            # kv_bits: when each request's cache converts follows from this rule (replay re-derives it)
            kv_quantize=None if self.quantize is None else self.quantize.record(),
            # prefix-cache entries are exact checkpoints (a what-if simulation stores them the same way)
            prefix_checkpoints=bool(getattr(family.runner, "prefix_checkpoints", False)),
            plan_records=list(PLAN_RECORD_GROUPS),  # the optional plan-record keys this engine writes
            # the vision budget pays for the media units the encoders run on (not the vision cache's, nor a
            # tick's repeats): replay follows the cache from its vision_store / vision_evict events
            vision_budget_counts=VISION_BUDGET_COUNTS,
            # the prompt tokens that stand for media (a what-if's cost model counts them: the vision encoder's
            # cost grows with them)
            media_token_ids=sorted(self.vlm.media_token_ids) if self.vlm is not None else [],
            # the adapters requests may choose (`Request.lora`: the arrivals name theirs)
            loras=list(self.loras.names) if self.loras is not None else [],
        )

    def _quantize_rule(self, model: Any) -> Any:
        """The QuantizeRule for EngineConfig.kv_bits (None when off), after checking at configuration that this
        model's caches can be quantized and batched that way; self.kv_layout then counts quantized bytes."""
        cfg = self.config
        if cfg.kv_bits is None:
            return None
        if self.vlm is not None:  # mlx-vlm's conversion (`mlx_vlm.generate_step`), the same rule as mlx-lm's
            if self.vlm.spec.kv_bits_refused:  # a family whose quantized batch is known not to be exact
                raise UnsupportedFeature(self.vlm.spec.model_type, "kv_bits", self.vlm.spec.kv_bits_refused)
            try:
                rule = self.vlm.quantize_rule(cfg.kv_bits, cfg.kv_group_size, cfg.quantized_kv_start)
                self.kv_layout = self.vlm.quantized_kv_layout(self.kv_layout, rule)
            except QuantizationRefused as exc:
                raise UnsupportedFeature(self.vlm.spec.model_type, "kv_bits", str(exc)) from None
            return rule
        family = self._runner.family
        if family.mask is not MaskLayout.HEADS:
            raise UnsupportedFeature(family.model_type, "kv_bits", f"its attention needs the {family.mask.value} "
                                     "mask layout, which the quantized batch cache does not build")
        rule = library.quantize_rule(cfg.kv_bits, cfg.kv_group_size, cfg.quantized_kv_start)
        try:
            self.kv_layout = library.quantized_kv_layout(model, self.kv_layout, rule)
        except QuantizationRefused as exc:
            raise UnsupportedFeature(family.model_type, "kv_bits", str(exc)) from None
        return rule

    def _make_drafter(self, draft_model: Any, mtp_head: Any) -> Any:
        cfg = self.config
        if not cfg.draft_tokens:
            if draft_model is not None:
                raise ValueError("draft_model given but draft_tokens is 0: set EngineConfig(draft_tokens=k)")
            return None
        if self.vlm is not None and cfg.drafter == "mtp":
            raise UnsupportedFeature(self.vlm.spec.model_type, "drafter='mtp'",
                                     "an MTP head reads a text model's hidden states; no mlx-vlm family here has one")
        runner = self._runner
        if not runner.capabilities.rollback and cfg.drafter == "mtp":
            raise UnsupportedFeature(runner.family.model_type, "drafter='mtp'",
                                     "MTP drafting reads the hidden state of the verify forward, which caches that "
                                     "cannot be rolled back in place undo and feed again: not built for them")
        if not runner.capabilities.rollback and cfg.draft_tokens < 2:
            # rejected drafts are undone by restoring the cache and feeding the accepted ones again, so a row
            # verifies draft_tokens // 2 drafts (MLXExecutor._refeed_grants): none at 1
            kinds = [c.kind for c in runner.capabilities.layers if not c.rollback]
            raise UnsupportedFeature(runner.family.model_type, "draft_tokens",
                                     f"its {sorted(set(kinds))} layers cannot be rolled back in place, so a "
                                     "verify is undone by feeding the accepted tokens again and drafts "
                                     "draft_tokens // 2 tokens: set draft_tokens >= 2")
        from .execution.drafters import DraftModelDrafter, PromptLookupDrafter

        if cfg.drafter == "mtp":
            if mtp_head is None:
                raise ValueError("drafter='mtp' needs Engine(..., mtp_head=...): an MTPHead (from_pretrained loads "
                                 "the head stored next to the model, if any), or the model itself when it carries "
                                 "its own MTP module (.mtp and .mtp_forward)")
            from .execution.mtp import MTPDrafter, NativeMTPDrafter

            if library.has_native_mtp(mtp_head):
                if mtp_head is not self.model:
                    raise ValueError("a native MTP module drafts for its own model: pass mtp_head=<the engine's model>")
                return NativeMTPDrafter(self.model)
            return MTPDrafter(mtp_head, self.model)
        if cfg.drafter == "draft-model":
            if draft_model is None:
                raise ValueError("drafter='draft-model' needs Engine(..., draft_model=<mlx-lm model>)")
            draft_caps = cache_capabilities(library.make_request_cache(draft_model))
            if not draft_caps.rollback:  # the drafter rolls its own batch cache back per row
                raise UnsupportedFeature(library.model_family(draft_model).model_type, "draft_model",
                                         f"a draft model's caches must roll back per row; its {list(draft_caps.kinds)}"
                                         " do not")
            if library.vocab_size(draft_model) != self.vocab_size:
                raise ValueError("the draft model must share the target's vocabulary")
            return DraftModelDrafter(draft_model, adaptive=cfg.adaptive_drafting)
        # lookup proposals cost nothing, so under the draft gate (which picks the width) rows propose all of k
        return PromptLookupDrafter(adaptive=cfg.adaptive_drafting, cap_k=not cfg.draft_gate,
                                   scope=cfg.prompt_lookup_scope, pool_tokens=cfg.prompt_lookup_pool_tokens)

    def _make_draft_gate(self) -> Any:
        """Adaptive drafting judges each tick's width for the whole batch (`execution/draft_gate.py`); fixed-k
        drafting (`adaptive_drafting=False`) or `draft_gate=False` verifies every draft at full length."""
        if not (self.config.draft_tokens and self.config.adaptive_drafting and self.config.draft_gate):
            return None
        from .execution.draft_gate import DraftGate, VerifyCost

        cost = self.config.draft_cost
        return DraftGate() if cost is None else DraftGate(cost=VerifyCost(*cost))

    def draft_stats(self) -> dict[str, Any]:
        """Speculative decoding: drafted, accepted, rejected, acceptance rate, verify forwards and tokens per
        row per verify forward (zeros when drafting is off), the draft gate's counts (`gate`: ticks judged,
        declined, narrowed; None without a gate) and the drafter's own (`drafter`: for prompt lookup its scope,
        matches by n-gram length, matches taken from another request's history, pauses; None when off)."""
        gate = getattr(self.executor, "draft_gate", None)
        drafter = getattr(self.executor, "drafter", None)
        return {**self.executor.draft_stats.as_dict(), "gate": gate.stats() if gate is not None else None,
                "drafter": drafter.stats() if drafter is not None else None}

    def prefill_stats(self) -> dict[str, int]:
        """Batched first-chunk prefill: groups and rows that took the one-forward path, and fallbacks (groups
        whose batched forward raised and were prefilled one by one; each is also in its tick's outcome event)."""
        return self.executor.prefill_stats.as_dict()

    def greedy_stats(self) -> dict[str, int]:
        """Greedy rows' picks (`kernels.sampling.GreedyPick`: the greedy rows of plain ticks, every position of
        all-greedy verify ticks): positions read back, and how many of them took their log-softmax because
        rounding could have decided a near-tie at the top (ARCHITECTURE.md, "Sampling")."""
        return self.executor.greedy_stats.as_dict()

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, config: EngineConfig | None = None, *,
                        tensor_group: Any = None, pipeline_group: Any = None, adapter_path: str | Path | None = None,
                        loras: Mapping[str, str | Path] | None = None, **kwargs: Any) -> "Engine":
        """Load a local mlx-lm model directory, or an mlx-vlm one (a config with a `vision_config`).

        `tensor_group` / `pipeline_group` (an `mx.distributed` group, names as mlx-lm's `sharded_load`) load the
        model sharded across the group's ranks; call this on every rank, then use the engine on rank 0 and
        `engine.follow()` on the others (README: "One model across processes").

        `adapter_path`: a local LoRA adapter directory, applied to the model by its loader (`mlx_lm.load` /
        `mlx_vlm.load(adapter_path=...)`; the layout `mlx_lm.lora` or mlx-vlm's trainer writes). One adapter for
        every request; not with sharding (mlx-lm's sharded load takes none).

        `loras`: adapters each request chooses from (`add_request(lora=name)`; `Engine`'s `loras`); not with
        `adapter_path`, which adapts every request already.
        """
        if not Path(model_dir).is_dir():  # mlx-lm would take it for a Hugging Face repo id and try to download
            raise FileNotFoundError(f"{model_dir}: no such model directory (a local mlx-lm or mlx-vlm model "
                                    "directory; nothing is downloaded)")
        if adapter_path is not None:
            if not Path(adapter_path).is_dir():
                raise FileNotFoundError(f"{adapter_path}: no such adapter directory (a local LoRA adapter: "
                                        "adapter_config.json and adapters.safetensors)")
            if tensor_group is not None or pipeline_group is not None:
                raise ValueError("adapter_path: a sharded model loads without adapters (mlx-lm's sharded_load "
                                 "takes none); fuse the adapter into the model first (mlx_lm.fuse)")
            if loras:
                raise ValueError("adapter_path and loras: adapter_path adapts every request; give the adapter in "
                                 "loras instead and let requests choose it")
            adapter_path = str(adapter_path)
        if loras:
            kwargs["loras"] = loras  # (Engine refuses them with a sharded model)
        if tensor_group is not None or pipeline_group is not None:
            if library.is_vision_language_dir(model_dir):
                raise ValueError("tensor_group / pipeline_group: sharding is built for mlx-lm text models only")
            from mlx_lm.utils import sharded_load

            model, tokenizer = sharded_load(str(model_dir), pipeline_group=pipeline_group, tensor_group=tensor_group)
            return cls(model, tokenizer, config, shard_group=tensor_group or pipeline_group, **kwargs)
        if library.is_vision_language_dir(model_dir):
            from mlx_vlm import load as load_vlm

            model, processor = load_vlm(str(model_dir), adapter_path=adapter_path)
            return cls(model, processor, config, **kwargs)
        from mlx_lm import load

        from .execution.mtp import load_mtp_head

        model, tokenizer = load(str(model_dir), adapter_path=adapter_path)
        if config is not None and config.drafter == "mtp" and "mtp_head" not in kwargs:
            kwargs["mtp_head"] = load_mtp_head(model_dir)
        return cls(model, tokenizer, config, **kwargs)

    def _executor_event(self, kind: str, **fields: Any) -> None:
        """KV decisions the executor carries out (batch merges, filters, draft rollbacks), at this tick."""
        self.events.emit(kind, self.tick, **fields)

    def _vision_event(self, kind: str, key: str, info: dict) -> None:
        self.events.emit(f"vision_{kind}", self.tick, key=key,
                         **{k: v for k, v in info.items() if not k.endswith("_s")},
                         measure={k: v for k, v in info.items() if k.endswith("_s")})

    # ---- requests in ----------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[dict] | None = None,
        prompt_tokens: Sequence[int] | None = None,
        images: Sequence[Any] | None = None,
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        videos: Sequence[Any] | None = None,
        audio: Sequence[Any] | None = None,
        tools: Sequence[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request; returns its id. Raises InvalidRequest (nothing queued) for bad input.

        `lora`: the name of one of the engine's LoRA adapters (`Engine(loras=...)`) the request runs on; None:
        the base model. `cache_salt` (vLLM's): a non-empty string; the prefix cache shares prefixes only between
        requests with the same salt (None: between the requests without one).

        `tools` (OpenAI-style function schemas) and `chat_template_kwargs` (e.g. `enable_thinking`) go into the
        chat template with chat-message prompts of a text model, as `tokenizer.apply_chat_template(messages,
        tools=tools, **chat_template_kwargs)` renders them; parsing tool calls or reasoning out of the output is
        the caller's (the server's) business.

        Images (PIL images, file paths or bytes), videos (file paths, bytes or frame lists; frames selected at
        `config.video_fps`, at most `config.video_max_frames`) and audio (WAV paths, bytes or
        (samples, sample_rate)) need a model whose adapter takes them and a prompt (templated text or chat
        messages). Media that cannot be read, or that the model's processor refuses, raises UnreadableMedia (an
        InvalidRequest naming the item: `kind`, `index`).
        """
        if sampling is None:
            sampling = SamplingParams()
        elif not isinstance(sampling, SamplingParams):
            raise InvalidRequest("sampling", f"must be a SamplingParams, got {type(sampling).__name__}")
        check_sampling(sampling, self.vocab_size, self.scheduler.model_stop_ids)
        if sampling.structured_output is not None:
            self.grammars.compile(sampling.structured_output)  # InvalidRequest where it does not compile
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequest("priority", f"must be an integer, got {priority!r}")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidRequest("cache_salt", f"must be a non-empty string, got {cache_salt!r}")
        if self.shard is not None:
            self.shard.check_request(sampling)
        resolved = self.prompts.resolve(prompt, prompt_tokens, MediaInputs.of(images, videos, audio), request_id,
                                        tools, chat_template_kwargs, sampling.truncate_prompt_tokens)
        tokens = resolved.token_ids
        if self.kv_layout is not None and self.config.kv_memory_bytes is not None:
            # what the planner requires to admit it alone (with kv_bits, its float prefill peak included)
            n = len(tokens)
            chunk = chunk_cap(self.config.prefill_chunk, resolved.first_chunk_reach, 0)
            need = self.kv_layout.admit_alone_bytes(n, max(1, self.config.kv_headroom_tokens),
                                                    min(chunk, max(n - 1, 1)))
            if need > self.config.kv_memory_bytes:
                raise InvalidRequest("prompt", f"needs {need} bytes of KV cache, more than kv_memory_bytes "
                                               f"({self.config.kv_memory_bytes})", request_id)
        with self._lock:
            if request_id is None:
                request_id = f"req-{next(self._ids)}"
                while request_id in self._known_live or request_id in self._ended:
                    request_id = f"req-{next(self._ids)}"
            elif not isinstance(request_id, str) or not request_id:
                raise InvalidRequest("request_id", f"must be a non-empty string, got {request_id!r}")
            elif request_id in self._known_live or request_id in self._ended:
                raise InvalidRequest("request_id", f"duplicate request id {request_id!r}", request_id)
            if lora is not None:  # (under the lock: an adapter is not unloaded between this check and its use)
                if lora not in self._lora_names:
                    raise InvalidRequest("lora", f"no adapter {lora!r} (this engine has "
                                                 f"{', '.join(map(repr, sorted(self._lora_names))) or 'none'})")
                self._lora_of[request_id] = lora
            self._known_live.add(request_id)
            self._inbox.append(_Arrival(request_id, resolved, sampling, priority, self.clock(), lora, cache_salt))
        return request_id

    def fetch_media(self, prompt: Any = None, images: Sequence[Any] | None = None, videos: Sequence[Any] | None = None,
                    audio: Sequence[Any] | None = None, request_id: str | None = None) -> tuple[Any, MediaInputs]:
        """Fetch a request's media URLs now, before `add_request` (which would fetch them itself): the prompt and
        media with each http(s) URL replaced by its bytes (content parts moved out of chat messages), to pass on
        to `add_request`. Lets a caller fetch on threads of its own (`AsyncEngine` does). Raises UnreadableMedia
        naming an item it cannot fetch. Thread-safe: it touches no engine state."""
        return self.prompts.fetch_remote(prompt, MediaInputs.of(images, videos, audio), request_id)

    def tokenize(self, prompt: Any, images: Sequence[Any] | None = None, videos: Sequence[Any] | None = None,
                 audio: Sequence[Any] | None = None, tools: Sequence[dict] | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The prompt token ids `add_request` would queue for these arguments (the chat template with its tools
        and arguments, media placeholders expanded by the model's processor), queueing nothing. Raises what
        `add_request` raises for them (InvalidRequest, UnreadableMedia). Call it where `add_request` is called:
        it uses the tokenizer and processor, which are not all safe to share between threads."""
        return self.prompts.resolve(prompt, None, MediaInputs.of(images, videos, audio), None, tools,
                                    chat_template_kwargs).token_ids

    def abort(self, request_id: str) -> bool:
        """Abort a live request (any non-terminal state) at the start of the next tick.

        Returns True if it was live, False if it had already ended (a no-op). Raises UnknownRequest for an id
        the engine never accepted.
        """
        with self._lock:
            if request_id in self._known_live:
                self._abort_inbox.append(request_id)
                return True
            if request_id in self._ended:
                return False
        raise UnknownRequest(request_id)

    def load_lora(self, name: str, path: str | Path) -> None:
        """Add LoRA adapter `name` (a directory in mlx-lm's or PEFT's layout) while the engine runs; thread-safe. It
        is read and checked here (LoRAError: nothing changes) and installed at the start of the next tick;
        requests may name it from the moment this returns. ValueError for a name already loaded, and for a
        sharded model (as `Engine(loras=...)`)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"an adapter's name must be a non-empty string, got {name!r}")
        with self._lock:
            if name in self._lora_names:
                raise ValueError(f"an adapter named {name!r} is loaded already")
            if self.loras is None:
                self.loras = _install_loras(self.model, {}, self.vlm is not None, self.shard)
        prepared = self.loras.prepare(name, path)
        with self._lock:
            if name in self._lora_names:  # loaded by another thread meanwhile
                raise ValueError(f"an adapter named {name!r} is loaded already")
            self._lora_names.add(name)
            self._lora_changes.append(("load", prepared))

    def unload_lora(self, name: str) -> None:
        """Remove LoRA adapter `name`; thread-safe. Requests added after this returns cannot name it; it leaves
        the model at the start of the next tick. UnknownLoRA for a name not loaded; LoRAInUse while a live
        request runs on it (abort those, or wait for them)."""
        with self._lock:
            if name not in self._lora_names:
                raise UnknownLoRA(f"no adapter {name!r} (this engine has "
                                  f"{', '.join(map(repr, sorted(self._lora_names))) or 'none'})")
            users = sum(lora == name for lora in self._lora_of.values())
            if users:
                raise LoRAInUse(f"adapter {name!r} is in use by {users} live request(s)")
            self._lora_names.discard(name)
            self._lora_changes.append(("unload", name))

    @property
    def lora_names(self) -> tuple[str, ...]:
        """The LoRA adapters a request may name now, sorted."""
        with self._lock:
            return tuple(sorted(self._lora_names))

    def clear_prefix_cache(self) -> bool:
        """Empty the prefix cache at the start of the next tick, like an abort (so the trace records it at a
        tick and replay applies it there); requests arriving before that tick see an empty cache too. Returns
        False when this engine has no prefix cache."""
        if self.scheduler.prefix_cache is None:
            return False
        if self.shard is not None:
            raise RuntimeError("clear_prefix_cache: not built for a sharded engine (the followers hold payloads)")
        with self._lock:
            self._clear_prefix_requested = True
        return True

    # ---- the loop -------------------------------------------------------------------------------
    def has_pending(self) -> bool:
        with self._lock:
            return bool(self._known_live)

    def state_of(self, request_id: str) -> RequestState:
        request = self.scheduler.requests.get(request_id)
        if request is not None:
            return request.state
        with self._lock:
            if request_id in self._ended:
                return self._ended[request_id]
            if request_id in self._known_live:
                return RequestState.QUEUED  # still in the inbox
        raise UnknownRequest(request_id)

    def step(self) -> list[StepOutput]:
        """Run one tick: drain the inbox, plan, execute, apply. Returns what each request did."""
        if self.shard is not None and self.shard.rank != 0:
            raise RuntimeError("this rank follows rank 0: call engine.follow(), not step()")
        tick = self.tick
        tick_start = self.clock()
        outputs = self._drain_inbox(tick)
        ran = self.loop.run_tick(tick)
        plan, result = ran.plan, ran.result
        if result is not None:
            outputs.extend(ran.applied.outputs)
            self._account(plan, result)
            stores = [[s.request_id, s.num_tokens, s.nbytes, s.whole_only] for s in result.prefix_stores]
            encoded = {rid: {k: e[k] for k in ENCODED_RECORD if k in e} for rid, e in result.encoded.items()}
            self.events.emit("outcome", tick, sampled=result.sampled, logprobs=result.logprobs,
                             errors=result.errors, prefix_stores=stores,
                             encoded=encoded, accepted_drafts=result.accepted_drafts,
                             drafts={rid: list(d) for rid, d in result.drafts.items()},
                             computed_tokens=result.computed_tokens,
                             **({"top_logprobs": {rid: [list(pair) for pair in pairs]
                                                  for rid, pairs in result.top_logprobs.items()}}
                                if result.top_logprobs else {}),
                             **({"padded_tokens": result.padded_tokens} if result.padded_tokens else {}),
                             **({"prefill_fallbacks": [[list(f.request_ids), f.num_tokens, f.error]
                                                       for f in result.prefill_fallbacks]}
                                if result.prefill_fallbacks else {}),
                             **({"drafter_error": result.drafter_error} if result.drafter_error else {}), measure={
                "t": (now := self.clock()), "tick_start_t": tick_start, "tick_s": now - tick_start,
                "vision_s": result.vision_time, "prefill_s": result.prefill_time, "decode_s": result.decode_time,
            })
        if self.config.check_invariants:
            self.scheduler.check_invariants(plan)
            self._check_executor(plan, result)
        self._record_ends(outputs)
        self.tick += 1
        return outputs

    def _drain_inbox(self, tick: int) -> list[StepOutput]:
        with self._lock:
            arrivals, self._inbox = self._inbox, []
            aborts, self._abort_inbox = self._abort_inbox, []
            clear_prefix, self._clear_prefix_requested = self._clear_prefix_requested, False
            lora_changes, self._lora_changes = self._lora_changes, []
        for change, what in lora_changes:  # before the arrivals that may name them
            if change == "load":
                self.loras.commit(what)
                self.executor.loras = self.loras
                self.events.emit("lora_load", tick, name=what.adapter.name)
            else:
                self.loras.remove(what)
                self.events.emit("lora_unload", tick, name=what)
        for a in arrivals:
            request = Request(
                request_id=a.request_id, prompt_tokens=a.prompt.token_ids, sampling=a.sampling,
                priority=a.priority, arrival_tick=tick, arrival_time=a.arrival_time,
                seed=a.sampling.seed if a.sampling.seed is not None else _derived_seed(self.config.seed, a.request_id),
                media=a.prompt.media, num_images=a.prompt.num_media_items, media_key=a.prompt.media_key,
                num_media_tokens=a.prompt.num_media_tokens, media_marks=a.prompt.media_marks,
                media_items=a.prompt.media_items, first_chunk_reach=a.prompt.first_chunk_reach, lora=a.lora,
                cache_salt=a.cache_salt,
            )
            self.scheduler.add(request, tick)
        outputs = [
            self.scheduler.abort(rid, tick)
            for rid in dict.fromkeys(aborts)  # an id aborted twice in one tick is aborted once
            if rid in self.scheduler.requests
        ]
        self.loop.release(o.request_id for o in outputs)
        if clear_prefix:
            self.scheduler.clear_prefix_cache(tick)
        return outputs

    def _record_ends(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            if out.finished:
                if out.finish_reason is not None and out.finish_reason.value in ("abort", "error"):
                    self._stats.requests_aborted += 1
                else:
                    self._stats.requests_finished += 1
        ended = [o for o in outputs if o.finished]
        if ended:
            with self._lock:
                for out in ended:
                    self._known_live.discard(out.request_id)
                    self._lora_of.pop(out.request_id, None)
                    self._ended[out.request_id] = out.state
                while len(self._ended) > _ENDED_MEMORY:
                    self._ended.popitem(last=False)

    def _account(self, plan: Any, result: Any) -> None:
        s = self._stats
        s.ticks += 1
        s.prompt_tokens += sum(c.num_tokens for c in plan.prefill)
        s.vision_encoding_time += result.vision_time
        s.num_images_processed += sum(self._images_of(rid) for rid in result.encoded)
        s.prompt_time += result.prefill_time
        s.generation_tokens += len(result.sampled) + sum(len(t) for t in result.accepted_drafts.values())
        s.generation_time += result.decode_time
        s.peak_memory_bytes = max(s.peak_memory_bytes, mx.get_peak_memory())

    def _check_executor(self, plan: Any, result: Any) -> None:
        """What the executor really did stays inside what was planned: the positions it computed within
        num_batched_tokens, the KV bytes it held within the plan's bound (and so the budget)."""
        if result is not None and result.computed_tokens > plan.num_batched_tokens:
            raise InvariantViolation(f"tick {plan.tick} computed {result.computed_tokens} token positions, "
                                     f"planned {plan.num_batched_tokens}")
        if result is not None and result.padded_tokens > PREFILL_PAD_RATIO * result.prefill_tokens:
            # batched prefill's pad positions are computed on top of the plan, within a documented bound
            raise InvariantViolation(f"tick {plan.tick} padded {result.padded_tokens} positions for "
                                     f"{result.prefill_tokens} prefill tokens (bound {PREFILL_PAD_RATIO})")
        if self.config.kv_memory_bytes is not None:
            # real <= bound <= budget after the tick. A merge holds more while it runs (at most
            # KVLayout.join_bytes on top, measured in tests/caches/test_kv_peak.py); the budget does not include it.
            held = self.executor.cache_bytes()
            if plan.kv_bytes_bound is not None and held > plan.kv_bytes_bound:
                raise InvariantViolation(f"tick {plan.tick}: KV caches hold {held} bytes after the tick, over the "
                                         f"planned bound {plan.kv_bytes_bound}")
            if held > self.config.kv_memory_bytes:
                raise InvariantViolation(f"KV caches hold {held} bytes after the tick, over the budget")
        live_in_executor = self.executor.live_request_ids()
        if not live_in_executor <= set(self.scheduler.requests):
            raise InvariantViolation(
                f"executor holds caches of ended requests: {live_in_executor - set(self.scheduler.requests)}")

    def prefill_progress(self, request_id: str) -> tuple[int, int] | None:
        """(prompt tokens computed, prompt tokens) of a live request, prefix-cache hits included; None once
        it has ended or before it reached the engine's loop. After a preemption the request recomputes its
        prompt and then its outputs so far: only the prompt part is counted here, so it never passes 100%."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return None
        return min(request.num_computed_tokens, request.prompt_len), request.prompt_len

    def _images_of(self, request_id: str) -> int:
        request = self.scheduler.requests.get(request_id)
        return request.num_images if request is not None else 0

    def kv_cache_stats(self) -> dict[str, Any]:
        """Bytes held for running requests (exact), peak, merges and filters; with the budget if one is set."""
        stats = self.executor.kv.stats()
        stats["budget_bytes"] = self.config.kv_memory_bytes
        return stats

    def vision_cache_stats(self) -> dict[str, Any] | None:
        return self.vision_cache.stats() if self.vision_cache is not None else None

    def prefix_cache_stats(self) -> dict[str, Any] | None:
        cache = self.scheduler.prefix_cache
        return cache.stats() if cache is not None else None

    def stats(self) -> EngineStats:
        """Everything in one place: tokens, time, tok/s, peak memory, time per state, and the KV cache, prefix
        cache, vision cache and drafting stats (`kv_cache_stats()`, `prefix_cache_stats()`,
        `vision_cache_stats()`, `draft_stats()` give each alone)."""
        s = self._stats
        s.time_in_state = dict(self.scheduler.time_in_state)
        s.kv_cache = self.kv_cache_stats()
        s.prefix_cache = self.prefix_cache_stats()
        s.vision_cache = self.vision_cache_stats()
        s.drafting = self.draft_stats()
        return s

    # ---- conveniences -----------------------------------------------------------------------------
    def calibrate(self, prompt_lens: tuple[int, ...] = (16, 256), step_tokens: int = 4, seed: int = 0) -> Calibration:
        """Decode at every batch size from `max_seqs` down to 1 on synthetic requests, into the trace, so that a
        what-if simulation of this trace can tell the per-row decode cost from the per-forward one
        (scheduler/calibration.py). Call it on an idle engine, before the workload."""
        return calibrate(self, prompt_lens, step_tokens, seed)

    def generate(
        self,
        prompts: Sequence[str | list[dict] | Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: Any = None,
        images: Sequence[Sequence[Any] | None] | None = None,
        videos: Sequence[Sequence[Any] | None] | None = None,
        audio: Sequence[Sequence[Any] | None] | None = None,
        loras: Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run `prompts` (strings, chat messages or token-id lists; with `images[i]` / `videos[i]` / `audio[i]`
        for prompt i on a multimodal model, on LoRA adapter `loras[i]`) to completion; outputs in prompt order.

        Bad input raises InvalidRequest as `add_request` does, and then none of `prompts` runs (those already
        queued are aborted), so a refused batch leaves nothing behind.
        """
        if isinstance(prompts, (str, bytes, dict)) or not isinstance(prompts, Sequence):
            raise InvalidRequest("prompts", f"must be a list of prompts, got {type(prompts).__name__} (wrap a "
                                            "single prompt in a list)")
        samplings = sampling if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        per_prompt = {"sampling": samplings, "images": images, "videos": videos, "audio": audio, "loras": loras}
        for name, values in per_prompt.items():
            if values is not None and len(values) != len(prompts):
                raise InvalidRequest(name, f"one entry per prompt: {len(values)} for {len(prompts)} prompts")
        none = [None] * len(prompts)
        ids: list[str] = []
        try:
            for p, sp, imgs, vids, auds, lora in zip(prompts, samplings, images or none, videos or none,
                                                     audio or none, loras or none):
                media = dict(images=imgs, videos=vids, audio=auds, sampling=sp, lora=lora)
                if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], dict)):
                    ids.append(self.add_request(prompt=p, **media))
                else:
                    ids.append(self.add_request(prompt_tokens=p, **media))
        except BaseException:
            for rid in ids:
                self.abort(rid)
            raise
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        logprobs: dict[str, list[float]] = {i: [] for i in ids}
        top_logprobs: dict[str, list[list[tuple[int, float]]]] = {i: [] for i in ids}
        firsts: dict[str, StepOutput] = {}  # a request's first output: it brings the prompt (and its logprobs)
        results: dict[str, RequestOutput] = {}
        while len(results) < len(ids):
            for out in self.step():
                if out.request_id not in tokens:
                    continue  # someone else's request
                tokens[out.request_id].extend(out.token_ids)
                logprobs[out.request_id].extend(out.logprobs)
                top_logprobs[out.request_id].extend(out.top_logprobs)
                if out.prompt_token_ids is not None:
                    firsts[out.request_id] = out
                if out.finished:
                    toks = tokens[out.request_id]
                    # the text leaves out the stop token that ended it (as mlx-lm's generate does); token_ids keep it
                    shown = toks[:-1] if out.finish_reason is FinishReason.STOP else toks
                    results[out.request_id] = RequestOutput(
                        request_id=out.request_id, token_ids=toks,
                        text=self._text(shown),
                        finish_reason=out.finish_reason, error=out.error, logprobs=logprobs[out.request_id],
                        top_logprobs=top_logprobs[out.request_id],
                        **prompt_scores(firsts.get(out.request_id)),
                    )
                    if progress is not None:
                        progress(out)
        return [results[i] for i in ids]

    def _text(self, tokens: list[int]) -> str:
        """The text of `tokens` as mlx-lm's generate builds it: through the tokenizer's streaming detokenizer
        where it has one (its first-token spacing differs from a plain decode), else a plain decode."""
        if not tokens:
            return ""
        detokenizer = getattr(self.tokenizer, "detokenizer", None)
        if detokenizer is None:
            return self.tokenizer.decode(tokens)
        for token in tokens:
            detokenizer.add_token(token)
        detokenizer.finalize()
        return detokenizer.text

    def stream(self, prompt: Any = None, prompt_tokens: Sequence[int] | None = None, images: Sequence[Any] | None = None,
               sampling: SamplingParams | None = None, request_id: str | None = None,
               videos: Sequence[Any] | None = None, audio: Sequence[Any] | None = None,
               lora: str | None = None) -> Iterator[StepOutput]:
        """Add one request and yield its outputs as the engine steps (other requests keep running)."""
        rid = self.add_request(prompt=prompt, prompt_tokens=prompt_tokens, images=images, sampling=sampling,
                               request_id=request_id, videos=videos, audio=audio, lora=lora)
        while True:
            for out in self.step():
                if out.request_id == rid:
                    yield out
                    if out.finished:
                        return

    def follow(self) -> Any:
        """On a rank other than 0 of a sharded engine: execute rank 0's ticks until rank 0 closes its engine.
        Returns the follower's stats; raises `ShardLost` if rank 0 goes away, `ShardDivergence` if the ranks
        ever sample different tokens."""
        if self.shard is None or self.shard.rank == 0:
            raise RuntimeError("follow() is for the ranks other than 0 of a sharded engine")
        return self.shard.follower(self.executor).run()

    def close(self) -> None:
        """Flush the trace; on rank 0 of a sharded engine, also let the followers' `follow()` return."""
        try:
            if self.shard is not None and self.shard.rank == 0:
                self.executor.shutdown()
        finally:  # (the trace is flushed whatever the followers' link does)
            if self.shard is not None and self.shard.watchdog is not None:
                self.shard.watchdog.close()
            self.events.close()


def _stall_watchdog(rank: int, engine: "Engine", on_shard_lost: tuple[Callable[[Any], None], ...]) -> Any:
    """The StallWatchdog bounding each of a sharded rank's forwards (EngineConfig.shard_stall_timeout_s), from
    the first probe forward of its construction on; None when the bound is off."""
    from .execution.stall_watchdog import StallWatchdog

    if engine.config.shard_stall_timeout_s is None:
        return None
    # the trace is flushed first: the process is about to end without returning from the forward
    return StallWatchdog(rank, engine.config.shard_stall_timeout_s,
                         on_stall=(lambda _error: engine.events.close(), *on_shard_lost))


@dataclass
class _Shard:
    """How this engine takes part in a sharded model: the channel, and what rank 0 sends or a follower mirrors."""

    rank: int
    channel: Any
    prefix_payloads: Any  # rank 0: the scheduler's prefix cache; followers: their own shard's payloads
    prefix_watch: Any = None
    watchdog: Any = None  # a StallWatchdog bounding each forward (EngineConfig.shard_stall_timeout_s)

    @classmethod
    def create(cls, group: Any, engine: "Engine", watchdog: Any) -> "_Shard":
        from .execution.distributed import MirroredPayloads, PlanChannel, PrefixEntryWatch

        cfg = engine.config
        if engine.vlm is not None:
            raise ValueError("sharding is built for mlx-lm text models only")
        if cfg.draft_tokens and cfg.drafter != "prompt-lookup":
            raise ValueError(f"drafter={cfg.drafter!r} with a sharded model: only prompt-lookup drafting is built "
                             "(a draft model or MTP head would need its own sharding)")
        rank, prefix = group.rank(), engine.scheduler.prefix_cache
        shard = cls(rank, PlanChannel(group), prefix, watchdog=watchdog)
        if prefix is not None and rank != 0:
            shard.prefix_payloads = MirroredPayloads(prefix.block_size)
        if prefix is not None and rank == 0:
            shard.prefix_watch = PrefixEntryWatch()
            engine.events.add_sink(shard.prefix_watch)
        return shard

    def wrap(self, executor: Any) -> Any:
        from .execution.distributed import ShardedExecutor

        return (ShardedExecutor(executor, self.channel, self.prefix_watch, self.watchdog) if self.rank == 0
                else executor)

    def follower(self, executor: Any) -> Any:
        from .execution.distributed import Follower

        return Follower(executor, self.channel, self.prefix_payloads, self.watchdog)

    @staticmethod
    def check_request(sampling: SamplingParams) -> None:
        if sampling.logits_processors:
            raise InvalidRequest("logits_processors", "run on rank 0 only, so a sharded engine cannot use them "
                                                      "(the other ranks would sample differently)")


@dataclass
class _ModelFamily:
    """What the engine needs to know about a loaded model, whichever library built it."""

    runner: Any
    tokenizer: Any
    vocab_size: int
    max_positions: int | None
    stop_ids: frozenset[int]
    vlm: Any = None  # the family adapter of a vision-language model
    vision_cache: Any = None
    min_prompt: tuple[int, str] | None = None  # a text family's `Family.min_prompt`


def _install_loras(model: Any, loras: Mapping[str, str | Path], vlm: bool, shard_group: Any) -> LoRASet:
    """`Engine`'s `loras` installed on the model (a vision-language model's on its language model only), after
    refusing a sharded model."""
    if shard_group is not None:
        raise ValueError("loras: a sharded model takes no adapters (mlx-lm's sharded_load takes none); fuse the "
                         "adapter into the model first (mlx_lm.fuse)")
    return LoRASet.install(model, loras, within="language_model" if vlm else None)


def _media_fetch(config: EngineConfig) -> FetchPolicy | None:
    if not config.remote_media:
        return None
    return FetchPolicy(timeout_s=config.media_fetch_timeout_s, max_bytes=config.media_fetch_max_bytes,
                       allowed_hosts=config.allowed_media_domains)


def _model_family(model: Any, tokenizer: Any, config: EngineConfig, on_vision_event: Any,
                  media_fetch: FetchPolicy | None) -> _ModelFamily:
    if not library.is_vision_language_model(model):
        runner = TextRunner(model, config.max_kv_size)
        return _ModelFamily(runner, tokenizer, library.vocab_size(model), library.max_positions(model),
                            library.eos_token_ids(tokenizer), min_prompt=runner.family.min_prompt)
    from caches.vision import VisionCache

    from .models.adapter import adapter_for

    vision_cache = VisionCache(config.vision_cache_bytes, on_event=on_vision_event) if config.vision_cache_bytes else None
    # for an mlx-vlm model, `tokenizer` is its processor
    vlm = adapter_for(model, tokenizer, vision_cache, video_fps=config.video_fps,
                      video_max_frames=config.video_max_frames, max_kv_size=config.max_kv_size, media_fetch=media_fetch,
                      media_limits={"image": config.max_images_per_request, "video": config.max_videos_per_request,
                                    "audio": config.max_audio_per_request})
    return _ModelFamily(VisionLanguageRunner(vlm), vlm.tokenizer, vlm.vocab_size, vlm.max_positions,
                        vlm.eos_token_ids, vlm, vision_cache)


def _derived_seed(engine_seed: int, request_id: str) -> int:
    digest = hashlib.blake2b(f"{engine_seed}:{request_id}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def _config_record(config: EngineConfig) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(config)
