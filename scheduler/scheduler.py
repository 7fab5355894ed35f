"""The Scheduler: owns the live requests, plans ticks (pure) and applies their results (transitions, tokens,
finish detection, events). It never touches a model; the engine hands `apply` what an executor returned.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from caches.kv import KVLayout
from caches.prefix import PrefixCache

from .config import EngineConfig, chunk_cap
from .events import EventLog
from .lifecycle import Lifecycle, RequestState, Trigger
from .plan import ROW_REASONS, NewRequest, PromptLogprobs, TickPlan, TickResult, WaitReason
from .planner import SchedulerView, nothing_cached, plan_tick
from .policy import Policy, make_policy
from .request import FinishReason, Request


@dataclass
class StepOutput:
    """What one request did in one tick. `token_ids` are the tokens new this tick."""

    request_id: str
    token_ids: list[int]
    state: RequestState
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    logprobs: list[float] = field(default_factory=list)
    # per token, its `top_logprobs` most likely (token, logprob), most likely first (SamplingParams.top_logprobs)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    logprob_vectors: list = field(default_factory=list)  # (V,) log-softmax per token (EngineConfig.logprob_vectors)
    num_drafted: int = 0  # speculative decoding: draft tokens proposed for this request this tick
    # with the request's first token, when it asked for them (SamplingParams.prompt_logprobs): each prompt
    # token's logprob (None for the first), its position's most likely (token, logprob)s, and its rank there
    # (how many vocabulary entries score at least as high, itself included; None for the first)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprob_ranks: list[int | None] | None = None
    # the prompt as the engine runs it (templated, tokenized, truncated: what the logprobs above are of), with the
    # request's first token
    prompt_token_ids: list[int] | None = None


@dataclass
class AppliedTick:
    outputs: list[StepOutput]
    released: list[str]  # requests that ended this tick: their caches must be freed


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        events: EventLog,
        stop_token_ids: Iterable[int] = (),
        policy: str | Policy | None = None,
        kv_layout: KVLayout | None = None,
        max_model_len: int | None = None,
        record_plans: bool | None = None,
        record_row_reasons: bool = True,
        vision_cached: Callable[[str], bool] | None = None,
        count_cached_media: bool = False,
    ):
        self.config = config
        # The context limit of every request (prompt + outputs): the engine passes the resolved one (config or
        # the model's), replay the recorded one; a model-free run falls back to the config's.
        self.max_model_len = max_model_len if max_model_len is not None else config.max_model_len
        self.events = events
        self.policy = make_policy(policy if policy is not None else config.policy)
        self.lifecycle = Lifecycle()
        self.model_stop_ids = frozenset(stop_token_ids)
        self.kv_layout = kv_layout
        # Insertion-ordered dicts: arrival order for waiting, admission order for the rest.
        self.waiting: dict[str, Request] = {}
        self.encoding: dict[str, Request] = {}
        self.prefilling: dict[str, Request] = {}
        self.decoding: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}  # every live request
        self.time_in_state: dict[str, float] = {}  # measurement: seconds summed over requests
        self._tick = 0  # the tick being planned/applied (for cache events)
        self.prefix_cache = (
            PrefixCache(config.prefix_cache_bytes, config.prefix_block_size, on_event=self._cache_event)
            if config.prefix_cache_bytes else None
        )
        self._prefix_memo: dict[str, tuple[int, tuple[int, int] | None]] = {}
        # request ids in the drafting state; a dict (ordered) so transitions fire in plan order in every process
        # (a set's order follows string hashing, which differs between the recording and its replay)
        self._drafting: dict[str, None] = {}
        # Plan records (the `plan` event; replay builds them with no sink): reasons are recorded when they
        # change, so the last recorded reason per live request and the ids ended since the last plan are kept.
        self._record_plans = record_plans  # None: whenever the event log has a sink
        # False only to replay a trace written before running rows had reasons (plan.ROW_REASONS)
        self._record_row_reasons = record_row_reasons
        self.last_plan_record: dict[str, Any] | None = None
        self._recorded_reasons: dict[str, WaitReason] = {}
        self._ended_since_plan: list[str] = []
        # Whether the vision cache holds a media unit (by key): the engine's cache, replay's model of it, a
        # simulation's. Units it holds cost no vision budget. None: nothing is cached; `count_cached_media`:
        # every unit counts, as in engines before that rule (only the replay of their traces sets it).
        self._vision_cached = None if count_cached_media else vision_cached or nothing_cached

    @property
    def record_plans(self) -> bool:
        return self.events.enabled if self._record_plans is None else self._record_plans

    def _cache_event(self, kind: str, **fields) -> None:
        self.events.emit(kind, self._tick, **fields)

    def clear_prefix_cache(self, tick: int) -> None:
        """Empty the prefix cache at the start of `tick` (before its plan): later lookups miss until new stores."""
        if self.prefix_cache is not None:
            self._tick = tick
            self.prefix_cache.clear()

    # ---- requests in and out ----------------------------------------------------------------------
    def add(self, request: Request, tick: int) -> None:
        """Queue an arrival."""
        if self.max_model_len is not None:
            request.max_model_len = self.max_model_len
        self.lifecycle.attach(request)
        request.state_entered_time = request.arrival_time
        self.requests[request.request_id] = request
        self.waiting[request.request_id] = request
        self.events.emit(
            "arrival", tick, request_id=request.request_id, prompt_tokens=request.prompt_tokens,
            sampling=request.sampling.to_record(), priority=request.priority, seed=request.seed,
            num_images=request.num_images, media_key=request.media_key, draft_eligible=request.draft_eligible,
            **({"num_media_tokens": request.num_media_tokens} if request.num_media_tokens else {}),
            **({"media_marks": [list(m) for m in request.media_marks]} if request.media_marks else {}),
            **({"media_items": [item.to_record() for item in request.media_items]} if request.media_items else {}),
            **({"first_chunk_reach": request.first_chunk_reach} if request.first_chunk_reach else {}),
            **({"lora": request.lora} if request.lora is not None else {}),
            **({"cache_salt": request.cache_salt} if request.cache_salt is not None else {}),
            measure={"t": request.arrival_time, "admitted_to_engine_t": self.events.clock()},
        )

    def abort(self, request_id: str, tick: int, reason: str = "aborted by caller") -> StepOutput:
        request = self.requests[request_id]
        request.finish_reason = FinishReason.ABORT
        self._end(request, Trigger.ABORT, tick, reason)
        return StepOutput(request_id, [], request.state, True, FinishReason.ABORT)

    def fail(self, request_id: str, tick: int, error: str) -> StepOutput:
        request = self.requests[request_id]
        request.error = error
        request.finish_reason = FinishReason.ERROR
        self._end(request, Trigger.FAIL, tick, error)
        return StepOutput(request_id, [], request.state, True, FinishReason.ERROR, error)

    def has_live(self) -> bool:
        return bool(self.requests)

    # ---- deciding ---------------------------------------------------------------------------------
    def view(self, tick: int) -> SchedulerView:
        self._tick = tick
        return SchedulerView(
            tick=tick,
            waiting=tuple(self.waiting.values()),
            prefilling=tuple(self.prefilling.values()),
            decoding=tuple(self.decoding.values()),
            encoding=tuple(self.encoding.values()),
            prefix_match=self._prefix_match if self.prefix_cache is not None else (lambda _r: None),
            kv_layout=self.kv_layout,
            vision_cached=self._vision_cached,
        )

    def _prefix_match(self, request: Request) -> tuple[int, int] | None:
        """(entry id, cached tokens) for a waiting request; memoised until the prefix cache changes."""
        cache = self.prefix_cache
        if request.sampling.prompt_logprobs is not None:
            return None  # every prompt position is computed: its logits are what it asked for
        memo = self._prefix_memo.get(request.request_id)
        if memo is not None and memo[0] == cache.version:
            return memo[1]
        # At least the last prompt token must be computed: it is the row's first decode input.
        match = cache.lookup(request.prefix_key(request.prefill_len), max_len=request.prefill_len - 1)
        found = (match.entry_id, match.length) if match else None
        self._prefix_memo[request.request_id] = (cache.version, found)
        return found

    def plan(self, view: SchedulerView) -> TickPlan:
        plan = plan_tick(view, self.config, self.policy)
        new = self._new_requests(plan)
        if new:
            plan = dataclasses.replace(plan, new_requests=new)
        if self.record_plans:
            self.last_plan_record = self._plan_record(plan)
            self.events.emit("plan", view.tick, **self.last_plan_record)
        return plan

    def _new_requests(self, plan: TickPlan) -> tuple[NewRequest, ...]:
        """The plan's requests that an executor has not seen since their (re)admission: media planned for
        encoding, and first chunks of requests with nothing computed whose media (if any) is not encoded yet
        (an encoded request came with its encoding tick)."""
        ids = list(plan.encode)
        for chunk in plan.prefill:
            request = self.requests[chunk.request_id]
            if request.num_computed_tokens == 0 and not request.media_encoded:
                ids.append(chunk.request_id)
        new = []
        for rid in dict.fromkeys(ids):
            r = self.requests[rid]
            new.append(NewRequest(rid, tuple(r.prompt_tokens), r.sampling, r.seed, tuple(r.output_tokens),
                                  r.recompute_tokens, r.media, r.media_key, r.num_images, r.media_marks, r.lora,
                                  r.first_chunk_reach))
        return tuple(new)

    def _plan_record(self, plan: TickPlan) -> dict[str, Any]:
        """The plan's decisions, plus (a) the reasons that changed since the last plan: `reasons` lists a
        request's new or changed binding constraint, `reasons_cleared` the live requests that had one and no
        longer have it (a request blocked the same way tick after tick is recorded once); and (b) `step`, the
        vLLM-shaped step fields (scheduled ids in order, tokens per scheduled id, preempted ids, ids that
        ended since the previous step). Keys with nothing to say are left out."""
        record = plan.to_record()
        previous = self._recorded_reasons
        now = {r.request_id: r for r in plan.reasons if self._record_row_reasons or r.reason not in ROW_REASONS}
        changed = [r.to_record() for rid, r in now.items() if previous.get(rid) != r]
        cleared = [rid for rid in previous if rid not in now]
        if changed:
            record["reasons"] = changed
        if cleared:
            record["reasons_cleared"] = cleared
        self._recorded_reasons = now
        ids, tokens = plan.scheduled()
        record["step"] = {"scheduled": ids, "num_scheduled_tokens": tokens, "preempted": list(plan.preempted),
                          "finished": self._ended_since_plan}
        self._ended_since_plan = []
        return record

    # ---- applying ---------------------------------------------------------------------------------
    def apply(self, plan: TickPlan, result: TickResult) -> AppliedTick:
        """The tick's outcome, phase by phase in a fixed order (replay relies on it): planned failures and
        preemptions, admissions, the executor's errors, encoded media, prefix-cache lookups and stores,
        prefill progress (a completed prompt's first token), drafting moves, then every decoding row's tokens.
        Every token goes through `_emit`."""
        tick = self._tick = plan.tick
        applied = AppliedTick([], [])
        self._apply_planned_ends(plan, tick, applied)
        self._apply_admissions(plan, tick)
        self._apply_errors(result, tick, applied)
        self._apply_encoded(plan, result, tick)
        if self.prefix_cache is not None:
            self._apply_prefix_cache(plan, result)
        self._apply_prefill(plan, result, tick, applied)
        if plan.draft or self._drafting:
            self._move_drafting(plan, tick)
        self._apply_decode(plan, result, tick, applied)
        return applied

    def _apply_planned_ends(self, plan: TickPlan, tick: int, applied: AppliedTick) -> None:
        for rid, reason in plan.failed:
            applied.outputs.append(self.fail(rid, tick, reason))
            applied.released.append(rid)
        for rid in plan.preempted:
            self._preempt(self.requests[rid], tick)

    def _apply_admissions(self, plan: TickPlan, tick: int) -> None:
        for rid in plan.admitted:
            request = self.waiting.pop(rid)
            if request.has_media():
                self.encoding[rid] = request
                self._move(request, Trigger.START_VISION, tick)
            else:
                self.prefilling[rid] = request
                self._move(request, Trigger.START_PREFILL, tick)

    def _apply_errors(self, result: TickResult, tick: int, applied: AppliedTick) -> None:
        for rid, error in result.errors.items():
            if rid in self.requests:
                applied.outputs.append(self.fail(rid, tick, error))
                applied.released.append(rid)

    def _apply_encoded(self, plan: TickPlan, result: TickResult, tick: int) -> None:
        for rid in plan.encode:
            request = self.requests.get(rid)
            if request is None:  # its encoding failed
                continue
            request.media_encoded = True
            self.prefilling[rid] = self.encoding.pop(rid)
            self._move(request, Trigger.START_PREFILL, tick)

    def _apply_prefix_cache(self, plan: TickPlan, result: TickResult) -> None:
        self._record_lookups(plan, {rid: (entry_id, length) for rid, entry_id, length in plan.prefix_hits})
        for store in result.prefix_stores:
            request = self.requests.get(store.request_id)
            if request is None:  # it failed this tick: a failing request fails alone and stores nothing
                continue
            self.prefix_cache.store(request.prefix_key(store.num_tokens), store.nbytes, store.payload,
                                    whole_only=store.whole_only, request_id=store.request_id)

    def _apply_prefill(self, plan: TickPlan, result: TickResult, tick: int, applied: AppliedTick) -> None:
        """Computed tokens advance; a chunk that completes the prompt brings its first token and the move to
        decoding."""
        for chunk in plan.prefill:
            request = self.requests.get(chunk.request_id)
            if request is None:  # failed above
                continue
            request.num_computed_tokens = chunk.end
            for piece in result.prompt_logprobs.get(request.request_id, ()):
                _add_prompt_logprobs(request, piece)
            if chunk.completes:
                applied.outputs.append(self._emit(request, [result.sampled[request.request_id]], result, tick,
                                                  applied.released, completes_prefill=True))

    def _apply_decode(self, plan: TickPlan, result: TickResult, tick: int, applied: AppliedTick) -> None:
        """Every decoding row's tokens: a drafting row's accepted drafts, then the target's token."""
        live, sampled, drafts, accepted = self.requests, result.sampled, result.drafts, result.accepted_drafts
        for rid in plan.decode:
            request = live.get(rid)
            if request is None:
                continue
            if rid in drafts:
                out = self._emit(request, [*accepted.get(rid, ()), sampled[rid]], result, tick, applied.released)
                out.num_drafted = drafts[rid][0]  # proposed (the accepted ones are in the tokens)
            else:
                out = self._emit(request, [sampled[rid]], result, tick, applied.released)
            applied.outputs.append(out)

    def _record_lookups(self, plan: TickPlan, hits: dict[str, tuple[int, int]]) -> None:
        """Hits and misses of this tick's first chunks, before any store of the tick: a store may evict the
        entry a hit names (LRU eviction is the steady state of a full cache). The executor restored it
        before running the tick, so the hit stands."""
        for chunk in plan.prefill:
            request = self.requests.get(chunk.request_id)
            if request is None or request.num_computed_tokens != 0:  # failed above, or not its first chunk
                continue
            self._prefix_memo.pop(request.request_id, None)
            if request.sampling.prompt_logprobs is not None:
                continue  # not looked up (`_prefix_match`): neither a hit nor a miss
            if request.request_id in hits:
                self.prefix_cache.record_hit(*hits[request.request_id], request_id=request.request_id)
            else:
                self.prefix_cache.record_miss(request.request_id)

    def _move_drafting(self, plan: TickPlan, tick: int) -> None:
        """Rows the plan lets draft are in `drafting` while they do; they go back to `decoding` when a plan
        stops letting them (a transition only when that changes, not every tick)."""
        drafting_now = dict.fromkeys(rid for rid, _ in plan.draft)
        for rid in [r for r in drafting_now if r not in self._drafting]:
            request = self.requests.get(rid)
            if request is not None and request.state is RequestState.DECODING:
                self._move(request, Trigger.START_DRAFT, tick)
        for rid in [r for r in self._drafting if r not in drafting_now]:
            request = self.requests.get(rid)
            if request is not None and request.state is RequestState.DRAFTING:
                self._move(request, Trigger.END_DRAFT, tick)
        self._drafting = {rid: None for rid in drafting_now if rid in self.requests}

    def _preempt(self, request: Request, tick: int) -> None:
        """Back to the queue (at its head) with no cache: prompt and outputs so far are recomputed later."""
        rid = request.request_id
        for container in (self.encoding, self.prefilling, self.decoding):
            container.pop(rid, None)
        self._drafting.pop(rid, None)
        self.waiting = {rid: request, **self.waiting}
        request.media_encoded = False
        request.num_computed_tokens = 0
        request.recompute_tokens = request.num_output_tokens
        request.num_preemptions += 1
        self._move(request, Trigger.PREEMPT, tick, "kv memory budget")

    def _emit(self, request: Request, tokens: list[int], result: TickResult, tick: int,
              released: list[str], completes_prefill: bool = False) -> StepOutput:
        """The one token-append path. `tokens` (a drafting row's accepted drafts and the target's token, else
        the one sampled token; a fresh list, it becomes the StepOutput's) are appended one by one up to the
        first that ends the request (tokens after a stop are dropped): a stop token ends it with STOP (it is
        emitted), reaching `output_limit` (max_tokens or the context limit) with LENGTH. A row that did not draft also gets its logprob (requests that want
        logprobs never draft: `Request.draft_eligible`). A prompt's first token moves the request to decoding
        before it can finish. Every decoding row passes here every tick: the common case returns early."""
        rid, out, sampling = request.request_id, request.output_tokens, request.sampling
        limit, model_stops = request.output_limit, frozenset() if sampling.ignore_eos else self.model_stop_ids
        first = completes_prefill and not out
        with_prompt = first and sampling.prompt_logprobs is not None
        for n, token in enumerate(tokens, 1):
            out.append(token)
            # (within min_tokens a stop token was masked out of sampling; only a custom sampler can pick it)
            if (token in model_stops or token in sampling.stop_token_ids) and len(out) > sampling.min_tokens:
                request.finish_reason = FinishReason.STOP
            elif len(out) >= limit:
                request.finish_reason = FinishReason.LENGTH
            else:
                continue
            tokens = tokens[:n]
            break
        if completes_prefill:
            del self.prefilling[rid]
            self.decoding[rid] = request
            self._move(request, Trigger.START_DECODE, tick)
        output = self._emit_logprobs(request, tokens, result, tick, released)
        if with_prompt:  # the first token brings the prompt's logprobs (its prefill computed every position)
            output.prompt_logprobs = list(request.prompt_logprobs) or [None]
            output.prompt_top_logprobs = list(request.prompt_top_logprobs) or [[]]
            output.prompt_logprob_ranks = list(request.prompt_logprob_ranks) or [None]
        if first:
            output.prompt_token_ids = list(request.prompt_tokens)
        return output

    def _emit_logprobs(self, request: Request, tokens: list[int], result: TickResult, tick: int,
                       released: list[str]) -> StepOutput:
        """`_emit`'s output: the tokens with their logprobs, and the request's end when it has a finish reason."""
        rid, sampling, reason = request.request_id, request.sampling, request.finish_reason
        if reason is None and not result.logprob_vectors and not sampling.logprobs:
            return StepOutput(rid, tokens, request.state)
        logprobs, top = [], []
        if sampling.logprobs and rid not in result.drafts:
            request.output_logprobs.append(result.logprobs[rid])
            logprobs = [result.logprobs[rid]]
            if sampling.top_logprobs:
                request.output_top_logprobs.append(result.top_logprobs[rid])
                top = [result.top_logprobs[rid]]
        vectors = result.logprob_vectors.get(rid, [])[: len(tokens)]
        if reason is None:
            return StepOutput(rid, tokens, request.state, logprobs=logprobs, top_logprobs=top, logprob_vectors=vectors)
        self._end(request, Trigger.FINISH, tick, reason.value)
        released.append(rid)
        return StepOutput(rid, tokens, request.state, True, reason, logprobs=logprobs, top_logprobs=top,
                          logprob_vectors=vectors)

    # ---- transitions ------------------------------------------------------------------------------
    def _move(self, request: Request, trigger: Trigger, tick: int, reason: str | None = None) -> None:
        source, dest = self.lifecycle.fire(request, trigger)
        now = self.events.clock()
        spent = now - request.state_entered_time
        request.state_entered_time = now
        self.time_in_state[source.value] = self.time_in_state.get(source.value, 0.0) + spent
        if self.events.enabled:
            self.events.emit(
                "transition", tick, request_id=request.request_id, trigger=trigger.value,
                reason=reason, **{"from": source.value, "to": dest.value}, measure={"t": now, "in_source_s": spent},
            )

    def _end(self, request: Request, trigger: Trigger, tick: int, reason: str) -> None:
        self._move(request, trigger, tick, reason)
        rid = request.request_id
        if self.record_plans:
            self._ended_since_plan.append(rid)
            self._recorded_reasons.pop(rid, None)
        for container in (self.waiting, self.encoding, self.prefilling, self.decoding, self.requests,
                          self._prefix_memo):
            container.pop(rid, None)
        self._drafting.pop(rid, None)

    # ---- invariants -------------------------------------------------------------------------------
    def check_invariants(self, plan: TickPlan) -> None:
        """Raise InvariantViolation if bookkeeping is inconsistent (EngineConfig.check_invariants; the test
        suite turns it on for every engine). Explicit checks, not `assert`: they hold under `python -O`."""
        cfg = self.config
        prefill_tokens = sum(c.num_tokens for c in plan.prefill)
        require(plan.num_batched_tokens <= cfg.max_batched_tokens, "num_batched_tokens over max_batched_tokens", plan)
        require(plan.num_seqs <= cfg.max_seqs, "num_seqs over max_seqs", plan)
        for c in plan.prefill:
            reach = self.requests[c.request_id].first_chunk_reach if c.request_id in self.requests else 0
            require(c.num_tokens <= chunk_cap(cfg.prefill_chunk, reach, c.start), "a chunk over prefill_chunk", plan)
            require(c.start >= reach or (c.start == 0 and c.end >= reach),
                    f"{c.request_id}: its first chunk [{c.start}, {c.end}) does not reach {reach} from 0", plan)
        if cfg.max_prefill_tokens is not None:
            require(prefill_tokens <= cfg.max_prefill_tokens, "prefill over max_prefill_tokens", plan)
        require(prefill_tokens + plan.decode_tokens == plan.num_batched_tokens,
                "num_batched_tokens is not what the tick computes", plan)
        containers = {
            (RequestState.QUEUED,): self.waiting,
            (RequestState.VISION_ENCODING,): self.encoding,
            (RequestState.CHUNK_PREFILLING,): self.prefilling,
            (RequestState.DECODING, RequestState.DRAFTING): self.decoding,  # the running rows
        }
        seen = 0
        for states, container in containers.items():
            for rid, request in container.items():
                require(request.state in states, f"{rid} is {request.state} in the container of {states}")
                require((request.state is RequestState.DRAFTING) == (rid in self._drafting),
                        f"{rid}: drafting state and drafting set disagree")
                require(self.requests.get(rid) is request, f"{rid} is not the live request of that id")
            seen += len(container)
        require(seen == len(self.requests), "a live request is in no container or in two")
        for request in self.waiting.values():
            require(request.num_computed_tokens == 0, f"{request.request_id} waits with computed tokens")
        for request in self.prefilling.values():
            require(0 <= request.num_computed_tokens < request.prefill_len,
                    f"{request.request_id} prefills outside its prompt")
        for request in self.decoding.values():
            require(request.num_computed_tokens == request.prefill_len,
                    f"{request.request_id} decodes before its prefill completed")
            require(request.recompute_tokens < request.num_output_tokens < request.output_limit,
                    f"{request.request_id} decodes with an impossible output count")
        for request in self.requests.values():  # nothing runs past the model's context
            require(request.max_model_len is None
                    or request.prompt_len + request.num_output_tokens <= request.max_model_len,
                    f"{request.request_id} runs past the model's context")
        cache = self.prefix_cache
        if cache is not None:
            entries = list(cache._entries.values())
            require(cache.bytes == sum(e.nbytes for e in entries) <= cache.max_bytes,
                    "prefix-cache bytes are not the sum of its entries, or over its budget")
            for entry in entries:  # recorded sizes are the real arrays' sizes
                if entry.payload is not None:
                    require(entry.nbytes == _array_bytes(entry.payload),
                            f"prefix entry {entry.entry_id}: recorded size is not its arrays' size")
        require(len(self.encoding) + len(self.prefilling) + len(self.decoding) <= cfg.max_seqs,
                "more live sequences than max_seqs")
        if cfg.kv_memory_bytes is not None and plan.kv_bytes_bound is not None:
            require(plan.kv_bytes_bound <= cfg.kv_memory_bytes, "the KV bound is over kv_memory_bytes", plan)


class InvariantViolation(RuntimeError):
    """The engine's bookkeeping broke one of its invariants (a bug, never bad input)."""


def require(condition: bool, what: str, context: Any = None) -> None:
    if not condition:
        raise InvariantViolation(what if context is None else f"{what}: {context}")


def _array_bytes(payload: Any) -> int:
    """Bytes of every array in an opaque prefix-cache payload (nested tuples and lists of arrays and metadata;
    the payload's layout belongs to the cache-layer protocol, so this only walks it)."""
    if isinstance(payload, (list, tuple)):
        return sum(_array_bytes(x) for x in payload)
    if isinstance(payload, (int, float, str, type)) or payload is None:
        return 0
    return int(getattr(payload, "nbytes", 0))


def _add_prompt_logprobs(request: Request, piece: PromptLogprobs) -> None:
    """Extend the request's prompt logprobs with what one prefill feed computed. Entry i is prompt token i's;
    a recompute after a preemption computes positions it already has, which are kept as they were."""
    if not request.prompt_logprobs:
        request.prompt_logprobs.append(None)  # the first token has nothing before it
        request.prompt_top_logprobs.append([])
        request.prompt_logprob_ranks.append(None)
    have = len(request.prompt_logprobs)
    if piece.first > have:
        raise InvariantViolation(f"request {request.request_id}: prompt logprobs from token {piece.first}, but "
                                 f"only {have} are known")
    skip = have - piece.first
    request.prompt_logprobs.extend(piece.logprobs[skip:])
    request.prompt_top_logprobs.extend(piece.top[skip:])
    request.prompt_logprob_ranks.extend(piece.ranks[skip:])
