"""`SimExecutor`: carries out a plan in virtual time with the cost model instead of a model."""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Mapping, Sequence

from scheduler.plan import TickPlan, TickResult
from scheduler.tools.simulation.cost_model import CostModel, context_features
from scheduler.tools.workload import FIRST_ORDINARY_ID, SimArrival


class SimExecutor:
    """Executor stand-in: advances `clock` by the cost model, returns synthetic tokens.

    A request produces `ordinary_token` until its `output_len`-th token, which is the stop token (unless
    output_len == max_tokens: then `max_tokens` ends it). A request with `error_after = k` gets an error instead
    of its (k+1)-th token. The token count survives a preemption (the request resumes where it stopped, as
    the real executor's sampling step does). With `prefix_block_size`, a request whose prefill completes
    offers prompt[:-1] to the prefix cache, as `MLXExecutor._offer_prefix` does (`kv_bytes_per_token` sizes
    the entry; no payload); with `prefix_checkpoints` (a model whose caches cannot be trimmed) those entries
    are whole-only and each prefill chunk also stores the checkpoint the real executor stores
    (`caches.prefix.checkpoint_position`). The `Executor` protocol (scheduler/loop.py), as `ReplayExecutor`: `execute(plan)`,
    `release(ids)`.
    """

    def __init__(self, cost_model: CostModel, arrivals: Iterable[SimArrival],
                 stop_token_ids: Sequence[int] = (0,), ordinary_token: int | None = None,
                 prefix_block_size: int | None = None, kv_bytes_per_token: int = 0,
                 prefix_checkpoints: bool = False, vision_cache_bytes: int | None = None,
                 vision_unit_bytes: Mapping[str, int] | None = None):
        self.cost_model = cost_model
        self.prefix_checkpoints = prefix_checkpoints
        self._prefill_len: dict[str, int] = {}  # prompt + outputs re-fed after a preemption
        self.clock = 0.0
        stops = set(stop_token_ids)
        if not stops:
            raise ValueError("SimExecutor needs at least one stop token id")
        self.stop_token = min(stops)
        token = FIRST_ORDINARY_ID if ordinary_token is None else ordinary_token
        while token in stops:
            token += 1
        self.ordinary_token = token
        self.prefix_block_size = prefix_block_size
        self.kv_bytes_per_token = kv_bytes_per_token
        # id -> index of the token that is the stop (or -1), index that errors (or -1)
        self._stop_at: dict[str, int] = {}
        self._error_at: dict[str, int] = {}
        self._prompt_len: dict[str, int] = {}
        # id -> its encoder units: (key, media items, media tokens) per item where the trace keys them per item,
        # else one unit (its media key, all its items and media tokens)
        self._media: dict[str, tuple[tuple[str | None, int, int], ...]] = {}
        self._media_offset: dict[str, int] = {}  # id -> its first media position (where it checkpoints)
        self._first_chunk_reach: dict[str, int] = {}  # id -> Request.first_chunk_reach, where it has one
        # The vision cache as the engine's holds it: unit key -> bytes, least recently used first, under
        # `vision_cache_bytes` (0: no cache; None: unbounded). A unit's bytes are what the recording stored for
        # it (`vision_unit_bytes`), 0 where unknown (a synthetic workload's: those never fill the cache).
        self._vision: OrderedDict[str, int] = OrderedDict()
        self._vision_capacity = vision_cache_bytes
        self._vision_unit_bytes = dict(vision_unit_bytes or {})
        self._vision_used = 0  # bytes the simulated cache holds
        self.media_items_encoded = 0  # over the run: the vision-cache misses the encoders ran on
        self._samples: set[str] = set()  # requests that go through the sampler (their decode rows cost more)
        for a in arrivals:
            self._stop_at[a.request_id] = a.output_len - 1 if a.output_len < a.max_tokens else -1
            self._error_at[a.request_id] = -1 if a.error_after is None else a.error_after
            self._prompt_len[a.request_id] = a.prompt_len
            if a.samples:
                self._samples.add(a.request_id)
            if a.media_marks:
                self._media_offset[a.request_id] = a.media_marks[0][0]
            if a.first_chunk_reach:
                self._first_chunk_reach[a.request_id] = a.first_chunk_reach
            if a.num_images:  # the media tokens: what the encoder's cost grows with
                self._media[a.request_id] = tuple((i.key, i.count, i.tokens) for i in a.media_items) or (
                    (a.media_key, a.num_images, sum(1 for t in a.prompt_tokens if t in cost_model.media_token_ids)),)
        self._produced: dict[str, int] = {}

    def vision_cached(self, key: str) -> bool:
        """Whether the simulated vision cache holds a media unit (no LRU touch: the planner's look)."""
        return key in self._vision

    def _encode(self, plan: TickPlan) -> tuple[dict[str, dict], int, int]:
        """The tick's vision work as `VLMAdapter.encode_many` does it: every unit looked up first (a hit is used
        again), a unit an earlier request of the tick has is not encoded twice, then the misses stored in order,
        evicting the least recently used. Returns the outcome's `encoded` records, the media items and the media
        tokens that went through the encoders."""
        encoded: dict[str, dict] = {}
        images = vision_tokens = 0
        misses: list[str] = []
        for rid in plan.encode:
            items = tokens = 0
            for key, count, unit_tokens in self._media.get(rid, ((None, 1, 0),)):
                if key is not None and (key in misses or self._vision_hit(key)):
                    continue
                items, tokens = items + count, tokens + unit_tokens
                if key is not None:
                    misses.append(key)
            images, vision_tokens = images + items, vision_tokens + tokens
            encoded[rid] = {"rope_delta": 0, "vision_cache_hit": items == 0, "items_encoded": items,
                            "media_tokens_encoded": tokens}
        for key in misses:
            self._vision_store(key)
        self.media_items_encoded += images
        return encoded, images, vision_tokens

    def _vision_hit(self, key: str) -> bool:
        if key not in self._vision:
            return False
        self._vision.move_to_end(key)
        return True

    def _vision_store(self, key: str) -> None:
        capacity, size = self._vision_capacity, self._vision_unit_bytes.get(key, 0)
        if capacity == 0 or (capacity is not None and size > capacity):
            return  # no cache, or an entry larger than all of it (the engine's cache rejects it)
        while capacity is not None and self._vision and self._vision_used + size > capacity:
            self._vision_used -= self._vision.popitem(last=False)[1]
        self._vision[key] = size
        self._vision_used += size

    def execute(self, plan: TickPlan) -> TickResult:
        for new in plan.new_requests:
            self._prefill_len[new.request_id] = len(new.prompt_tokens) + new.recompute_tokens
        encoded, images, vision_tokens = self._encode(plan)
        # a decode row attends over its prompt and what it produced (as the fit counts it from a trace)
        completing = [c.request_id for c in plan.prefill if c.completes]
        context, merged = context_features([self._prompt_len[rid] + self._produced.get(rid, 0)
                                            for rid in [*plan.decode, *completing]], bool(completing))
        seconds = self.cost_model.plan_seconds(plan, images, self._media.__contains__, vision_tokens, context,
                                               self._samples.__contains__, merged)
        self.clock += seconds
        sampled: dict[str, int] = {}
        errors: dict[str, str] = {}
        produced, stop_at, error_at = self._produced, self._stop_at, self._error_at
        ordinary, stop = self.ordinary_token, self.stop_token
        rows = [c.request_id for c in plan.prefill if c.completes]
        result = TickResult(sampled=sampled, errors=errors, prefill_time=seconds, decode_time=0.0, encoded=encoded)
        if self.prefix_checkpoints and self.prefix_block_size is not None:
            self._offer_checkpoints(plan, result)
        if rows and self.prefix_block_size is not None:
            self._offer_prefixes(plan, rows, result)
        rows.extend(plan.decode)
        for rid in rows:
            n = produced.get(rid, 0)
            if n == error_at[rid]:
                errors[rid] = f"simulated error after {n} tokens"
                continue
            sampled[rid] = stop if n == stop_at[rid] else ordinary
            produced[rid] = n + 1
        # Errors come only with sampling here; the real executor can also fail a request mid-prefill.
        return result

    def _offer_prefixes(self, plan: TickPlan, completing: list[str], result: TickResult) -> None:
        from scheduler.plan import PrefixStore  # the prefix-cache contract (absent from older plan modules)

        restored = {rid: length for rid, _entry, length in getattr(plan, "prefix_hits", ())}
        for rid in completing:
            n = self._prompt_len[rid] - 1
            if n < self.prefix_block_size or restored.get(rid, 0) == n:
                continue
            result.prefix_stores.append(PrefixStore(rid, n, n * self.kv_bytes_per_token, self.prefix_checkpoints,
                                                    None))

    def _offer_checkpoints(self, plan: TickPlan, result: TickResult) -> None:
        from caches.prefix import checkpoint_position
        from scheduler.plan import PrefixStore

        for c in plan.prefill:
            if c.start < self._first_chunk_reach.get(c.request_id, 0):
                continue  # one forward, never split at a checkpoint (as `MLXExecutor._feeds`)
            n = self._prefill_len.get(c.request_id, self._prompt_len[c.request_id])
            at = checkpoint_position(c.start, c.end - 1 if c.completes else c.end, n, self.prefix_block_size,
                                     self._media_offset.get(c.request_id))
            if at is not None:
                result.prefix_stores.append(PrefixStore(c.request_id, at, at * self.kv_bytes_per_token, True, None))

    def release(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._produced.pop(rid, None)
            self._prefill_len.pop(rid, None)
