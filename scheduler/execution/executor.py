"""MLXExecutor: runs a TickPlan on a real model (mlx-lm, or mlx-vlm through a runner).

Per tick: (1) drop rows the scheduler released or preempted, (2) encode the media of requests planned for
vision work, together (vision-cache hits skipped, the misses in as few encoder calls as the family allows), (3)
feed each prefill chunk into that request's own single-request cache (exactly the cache `mlx_lm.generate` would
build; chunks that can share a forward are fed together and split back into those caches, `_prefill_groups`),
(4) merge the caches of requests whose
prefill completes into the running batch cache, (5) one batched forward over every decoding row (a
completing request's row is fed its last prompt token, so its first token is sampled in the same tick), then
vectorised sampling. Per-row state (sampling arrays, penalty context, step counters) is rebuilt only when
batch membership changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import mlx.core as mx
import numpy as np

from caches.kv import KVCacheManager, QuantizeRule
from kernels.sampling import (DrawGroups, RowSampling, SamplingArrays, TokenDraw, draw_tokens, greedy_pick,
                              logprobs_from_logits, most_likely, sample_tokens)
from caches.layers import PrefillSharing, restore_batch, rollback_reads, rollback_rows, snapshot_batch
from caches.prefix import checkpoint_position
from kernels.speculative import (
    greedy_accept,
    greedy_accept_rows,
    pad_drafts,
    processed_logprobs,
    sampled_accept,
    stack_draft_logprobs,
    stochastic_accept,
)

from scheduler.plan import (DECODE_FAILED, PREFILL_FAILED, PREFILL_PAD_RATIO, PrefillFallback, PrefixStore,
                            PromptLogprobs, TickPlan, TickResult)
from scheduler.request import Request, SamplingParams
from scheduler.execution.draft_gate import DraftGate
from scheduler.execution.drafters import Draft, DraftRequest
from scheduler.execution.runners import Runner, TextRunner
from scheduler.execution.structured import GrammarCompiler, GrammarProcessor


@dataclass
class DraftStats:
    """Speculative decoding, all requests together."""

    drafted: int = 0
    accepted: int = 0
    verify_forwards: int = 0
    rows_verified: int = 0
    tokens_emitted: int = 0
    failures: int = 0  # propose() calls that raised (those ticks decoded plainly)
    last_failure: str | None = None

    def record(self, drafted: int, accepted: int, rows: int, emitted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.verify_forwards += 1
        self.rows_verified += rows
        self.tokens_emitted += emitted

    def as_dict(self) -> dict[str, Any]:
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "rejected": self.drafted - self.accepted,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "verify_forwards": self.verify_forwards,
            # tokens a row gets per target forward in the ticks that verified drafts
            "tokens_per_row_forward": self.tokens_emitted / self.rows_verified if self.rows_verified else 0.0,
            "drafter_failures": self.failures,
            "last_drafter_failure": self.last_failure,
        }


@dataclass
class PrefillStats:
    """Batched prefill (several requests' chunks in one forward), all ticks together."""

    batched_groups: int = 0
    batched_rows: int = 0
    cached_rows: int = 0  # of those, rows whose cache already held tokens (a later chunk, a prefix hit)
    padded_tokens: int = 0  # right-pad positions those forwards computed on top of the planned tokens
    fallbacks: int = 0  # groups whose batched forward raised and were prefilled one by one

    def record(self, rows: int, cached: int, padded: int) -> None:
        self.batched_groups += 1
        self.batched_rows += rows
        self.cached_rows += cached
        self.padded_tokens += padded

    def as_dict(self) -> dict[str, int]:
        return {"batched_groups": self.batched_groups, "batched_rows": self.batched_rows,
                "cached_rows": self.cached_rows, "padded_tokens": self.padded_tokens, "fallbacks": self.fallbacks}


@dataclass
class GreedyStats:
    """Greedy picks (`kernels.sampling.GreedyPick`: the greedy rows of plain ticks, every position of all-greedy
    verify ticks), all ticks together: the positions read back, and how many of them took their log-softmax (a
    near-tie at the top that rounding could have decided: rare in float32, frequent in bfloat16)."""

    positions: int = 0
    recomputed: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"positions": self.positions, "recomputed": self.recomputed}


# prompt positions whose float32 log-softmax is computed at once (`_prompt_logprobs`)
PROMPT_LOGPROB_BLOCK = 256


def _pad_groups(chunks: list[tuple[str, int, int]], pad_ratio: float) -> list[tuple[list, int, int]]:
    """(request id, start, n) chunks -> groups of two or more: (chunks, width, pad positions). Longest first;
    a group takes the next chunk while its pads stay within `pad_ratio` x its real tokens (a shorter chunk
    only adds more pads for fewer tokens, so the first that does not fit closes the group)."""
    ordered = sorted(chunks, key=lambda c: -c[2])
    groups, i = [], 0
    while i < len(ordered):
        width = ordered[i][2]
        j, real, pads = i + 1, width, 0
        while j < len(ordered) and pads + width - ordered[j][2] <= pad_ratio * (real + ordered[j][2]):
            real, pads = real + ordered[j][2], pads + width - ordered[j][2]
            j += 1
        if j - i > 1:
            groups.append((ordered[i:j], width, pads))
        i = j
    return groups


def prefill_groups(chunks: list[tuple[str, int, int]], sharing: PrefillSharing,
                   pad_ratio: float) -> list[tuple[list, int, int]]:
    """The forwards (request id, start, n) chunks share under a runner's `PrefillSharing`: ANY, `_pad_groups` at
    `pad_ratio`; ALIGNED, chunks at one start of one length (rows holding as many tokens: nothing is padded);
    NONE, none."""
    if sharing is PrefillSharing.ANY:
        return _pad_groups(chunks, pad_ratio)
    if sharing is PrefillSharing.NONE:
        return []
    by_start: dict[int, list] = {}
    for chunk in chunks:
        by_start.setdefault(chunk[1], []).append(chunk)
    return [group for same in by_start.values() for group in _pad_groups(same, 0.0)]


def _prompt_logprobs(request: Request, start: int, logits: Any) -> PromptLogprobs | None:
    """For a request that asked (`SamplingParams.prompt_logprobs`): the logprobs of the prompt tokens a feed from
    `start` predicts, from its (1, n, V) logits; None when it did not ask or the feed predicts no prompt token.
    The logits at position p score token p + 1; positions past the prompt (outputs re-fed after a preemption)
    score nothing new. A float32 log-softmax per block of `PROMPT_LOGPROB_BLOCK` positions: the logits themselves
    (the feed's positions x the vocabulary, in the model's dtype) are what mlx-lm's own last prefill step makes;
    the float32 copy on top is bounded by the block."""
    k = request.sampling.prompt_logprobs
    if k is None or logits is None:
        return None
    n = min(logits.shape[1], request.prompt_len - 1 - start)  # positions whose next token is a prompt token
    if n <= 0:
        return None
    piece = PromptLogprobs(start + 1, [], [])
    for a in range(0, n, PROMPT_LOGPROB_BLOCK):
        b = min(a + PROMPT_LOGPROB_BLOCK, n)
        logprobs = logprobs_from_logits(logits[0, a:b].astype(mx.float32))
        targets = mx.array(request.prompt_tokens[start + 1 + a: start + 1 + b], dtype=mx.int32)
        picked = mx.take_along_axis(logprobs, mx.maximum(targets, 0)[:, None], axis=1)[:, 0]
        # a spliced image's id (-200, scheduler.models.splice) is no token the logits score
        picked = mx.where(targets < 0, -mx.inf, picked)
        ranks = (logprobs >= picked[:, None]).sum(axis=1)  # vLLM's rank: ties with the token count before it
        if not k:
            mx.eval(picked, ranks)
            piece.logprobs += picked.tolist()
            piece.ranks += ranks.tolist()
            piece.top += [[] for _ in range(b - a)]
            continue
        ids, values = most_likely(logprobs, min(k, logprobs.shape[-1]))
        mx.eval(picked, ranks, ids, values)
        piece.logprobs += picked.tolist()
        piece.ranks += ranks.tolist()
        piece.top += [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return piece


def _fed(chunk: Any) -> int:
    """Prompt positions a planned chunk feeds: a chunk that completes the prefill keeps its last token back (it is
    the first decode step's input)."""
    return (chunk.end - 1 if chunk.completes else chunk.end) - chunk.start


@dataclass(frozen=True)
class _Feed:
    """Prefill positions [start, end) of one request, fed in one forward (its own or a shared one); `checkpoint`:
    the cache after it is offered to the prefix cache."""

    request_id: str
    start: int
    end: int
    checkpoint: bool = False


def _embeddable(draft: Draft) -> Draft:
    """``draft`` cut before its first negative id: no embedding holds one, and a prompt lookup copies a spliced
    family's image id (-200, ``scheduler.models.splice``) out of the prompt like any other."""
    cut = next((i for i, t in enumerate(draft.tokens) if t < 0), None)
    if cut is None:
        return draft
    logprobs = None if draft.logprobs is None else draft.logprobs[:cut]
    return dataclasses.replace(draft, tokens=draft.tokens[:cut], logprobs=logprobs)


def _leads_into(output: list[int], word: tuple[int, ...]) -> bool:
    """Whether the output so far ends with all of `word` but its last token (a one-token word: always)."""
    head = len(word) - 1
    return head == 0 or (len(output) >= head and output[len(output) - head:] == list(word[:-1]))


def _bans_tokens(sampling: SamplingParams) -> bool:
    """Whether `_banned` may name tokens for a row: it has min_tokens or bad words."""
    return bool(sampling.min_tokens or sampling.bad_words_ids)


def _masks_logits(sampling: SamplingParams) -> bool:
    """Whether a row's logits pass through `_apply_processors` beyond the min_tokens and bad-words mask: a logit
    bias, logits processors, allowed token ids or a structured output (each changes position 0's logits only)."""
    return bool(sampling.logits_processors or sampling.logit_bias or sampling.allowed_token_ids is not None
                or sampling.structured_output is not None)


def _row_sampling(request: Request) -> RowSampling:
    s = request.sampling
    return RowSampling(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
                       presence_penalty=s.presence_penalty, repetition_penalty=s.repetition_penalty,
                       frequency_penalty=s.frequency_penalty,
                       seed=request.seed)


@dataclass
class _Row:
    request: Request
    step: int  # output tokens already produced
    sampling: RowSampling = field(init=False)  # its parameters as the kernels take them (made once, at the join)

    def __post_init__(self) -> None:
        self.sampling = _row_sampling(self.request)


class MLXExecutor:
    def __init__(self, runner: Runner | Any, penalty_context: int = 20, prefix_cache: Any = None,
                 logprob_vectors: bool = False, drafter: Any = None, on_event: Any = None,
                 processor_history: str = "prompt+output", quantize: QuantizeRule | None = None,
                 draft_gate: DraftGate | None = None, pad_ratio: float = PREFILL_PAD_RATIO,
                 grammars: GrammarCompiler | None = None, model_stop_ids: Iterable[int] = (),
                 loras: Any = None):
        # KV decisions carried out (kv_merge, kv_filter, kv_rollback) are events: (kind, **fields)
        self._on_event = on_event or (lambda kind, **fields: None)
        self.drafter = drafter  # proposes draft tokens for the rows a plan lets draft
        # cuts each tick's drafts to the verify width that pays for the whole batch (None: verify them all)
        self.draft_gate = draft_gate
        self.draft_stats = DraftStats()
        self.prefill_stats = PrefillStats()
        self.greedy_stats = GreedyStats()
        # batched prefill pads a group by at most this fraction of its real tokens (0: equal lengths only).
        # The engine checks PREFILL_PAD_RATIO; a larger ratio is for probes (bench/prefill_mix.py) only.
        if pad_ratio < 0:
            raise ValueError(f"pad_ratio must be >= 0, got {pad_ratio}")
        self.pad_ratio = pad_ratio
        # hidden-state drafters (MTP heads) need each row's last hidden state from the previous forward
        self._keeps_hidden = bool(getattr(drafter, "needs_hidden", False))
        self._native_hidden = bool(getattr(drafter, "native_hidden", False))  # the model's own return_hidden
        self._last_hidden: mx.array | None = None  # (B, H)
        self._has_hidden: list[bool] = []
        self.logprob_vectors = logprob_vectors  # hand every row's full log-softmax vector back (compat API)
        self.runner: Runner = runner if hasattr(runner, "decode") and hasattr(runner, "make_cache") else TextRunner(runner)
        # whether rejected drafts can be dropped per row in place; if not, a verify is undone by a re-feed
        self._rolls_back = self.runner.capabilities.rollback
        self.prefix_cache = prefix_cache  # read here (payloads to restore); the scheduler decides what is in it
        self.penalty_context = penalty_context
        # what processors and penalties see: every token so far (mlx-lm) or the generated ones only (vllm-mlx)
        self.output_only_history = processor_history == "output"
        # kv_bits: when each request's cache switches to quantized storage (None: never)
        self.quantize = quantize
        self.kv = KVCacheManager(self.runner.make_cache, getattr(self.runner, "merge", None), quantize)
        # A cache that cannot be trimmed (recurrent state, a rotating window) is reusable only as an exact
        # checkpoint: its prefill stores one at the block boundaries it passes (`_feeds`).
        self._checkpoints = prefix_cache is not None and getattr(self.runner, "prefix_checkpoints", False)
        self._encoded: dict[str, Any] = {}  # request id -> model inputs prepared for prefill (VLM embeddings)
        self._rows: list[_Row] = []
        self._row_index: dict[str, int] = {}
        self._next_inputs: mx.array | None = None  # (B,) token fed to each row next
        self._rope_deltas: mx.array | None = None  # (B,) VLM position offsets (0 for text rows)
        self._params: SamplingArrays | None = None
        self._argmax_only = False  # a verify tick takes a bare argmax per row (set with _params)
        self._may_ban = False  # some row has min_tokens or bad words (set with _params)
        self._draw_groups: DrawGroups | None = None  # set with _params: None where a plain tick cannot draw apart
        self._context: mx.array | None = None  # (B, W) recent tokens for penalties, -1 padded
        self._released: set[str] = set()
        self._no_draft: set[str] = set()  # rows the draft model could not take: they decode plainly
        # this executor's own copy of each request it works on (from the plan's new_requests), with the tokens
        # it produced appended: what prefill, sampling and drafting read; never the scheduler's objects
        self._requests: dict[str, Request] = {}
        # structured outputs: the engine's compiler, and each constrained row's matcher (built on its first token)
        self.grammars = grammars
        self._grammar_rows: dict[str, GrammarProcessor] = {}
        self._allowed_masks: dict[str, np.ndarray] = {}  # request id -> its allowed_token_ids as a (V,) mask
        # the model's end-of-sequence tokens: what `min_tokens` masks (with the request's stop_token_ids) until a
        # row has that many tokens, unless it ignores eos
        self.model_stop_ids = tuple(sorted(set(model_stop_ids)))
        # the LoRA adapters installed on the model (`scheduler.models.lora.LoRASet`; None: none): every forward
        # is told which one each of its rows runs on (`_on_loras`)
        self.loras = loras

    def _on_loras(self, requests: Iterable[Request]) -> contextlib.AbstractContextManager:
        """Around a forward whose rows are `requests`, in batch order: each row on its own LoRA adapter."""
        if self.loras is None:
            return contextlib.nullcontext()
        return self.loras.rows([r.lora for r in requests])

    # ---- bookkeeping the scheduler drives -------------------------------------------------------
    def release(self, request_ids: Iterable[str]) -> None:
        """Forget requests that ended (finished, aborted, failed): their caches are freed now, with one batch
        filter for all of them."""
        request_ids = list(request_ids)
        if self.drafter is not None:
            self.drafter.release(request_ids)
        if self.draft_gate is not None:
            for rid in request_ids:
                self.draft_gate.release(rid)
        for rid in request_ids:
            self.kv.drop_request(rid)
            self._encoded.pop(rid, None)
            self._no_draft.discard(rid)
            self._requests.pop(rid, None)
            self._grammar_rows.pop(rid, None)
            self._allowed_masks.pop(rid, None)
            if rid in self._row_index:
                self._released.add(rid)
        self._drop_released()

    def cache_bytes(self) -> int:
        """KV held now: the target's caches and a draft model's (both count against kv_memory_bytes)."""
        return self.kv.nbytes() + self._draft_cache_bytes()

    def _draft_cache_bytes(self) -> int:
        return self.drafter.cache_bytes() if hasattr(self.drafter, "cache_bytes") else 0

    def live_request_ids(self) -> set[str]:
        return (self.kv.request_ids() | set(self._row_index) | set(self._encoded) | set(self._requests)
                | set(self._grammar_rows))

    # ---- one tick ---------------------------------------------------------------------------------
    def execute(self, plan: TickPlan) -> TickResult:
        result = TickResult()
        dropped = list(plan.preempted) + [rid for rid, _ in plan.failed]
        if dropped:
            self.release(dropped)
        requests = self._requests
        for new in plan.new_requests:
            requests[new.request_id] = Request.from_new_request(new)
        result = self._execute(plan, requests, result)
        for rid, token in result.sampled.items():  # the copies follow what was produced (accepted drafts first)
            requests[rid].output_tokens += [*result.accepted_drafts.get(rid, ()), token]
        return result

    def _execute(self, plan: TickPlan, requests: Mapping[str, Request], result: TickResult) -> TickResult:
        t0 = time.perf_counter()
        if plan.encode:
            self._encode(list(plan.encode), requests, result)
        t_vision = time.perf_counter()
        restored = {}
        for rid, entry_id, length in plan.prefix_hits:  # before any store of this tick can evict them
            self.kv.restore(rid, self.prefix_cache.payload(entry_id), length)
            self._quantize_if_due(requests[rid], length)
            restored[rid] = length
        joining: list[str] = []
        # each chunk as one or two feeds (two around the prefix checkpoint it stores); the first feeds of every
        # chunk, then the second ones, each round in as few forwards as `_prefill_groups` finds
        feeds = [self._feeds(requests[c.request_id], c.start, c.start + _fed(c)) for c in plan.prefill]
        checkpoints: dict[str, PrefixStore] = {}
        for step in range(2):
            self._feed([f[step] for f in feeds if len(f) > step and f[step].request_id not in result.errors],
                       requests, result, checkpoints)
        for chunk in plan.prefill:
            request = requests[chunk.request_id]
            fed = _fed(chunk)
            result.prefill_tokens += fed
            if chunk.request_id in result.errors:
                continue
            if chunk.request_id in checkpoints:  # stored in chunk order, before the prefill end's offer
                result.prefix_stores.append(checkpoints[chunk.request_id])
            result.computed_tokens += fed
            if chunk.completes:
                joining.append(chunk.request_id)
                self._offer_prefix(request, restored.get(request.request_id, 0), result)
        t1 = time.perf_counter()
        try:
            if joining:
                self._join(joining, requests, result)
            if self._rows and (plan.decode or joining):  # a prefill-only tick pauses the rows
                self._decode(result, dict(plan.draft))
        except Exception as exc:  # e.g. out of memory in the batched forward: that work item fails, not the engine
            self._fail_batch(joining, result, f"{DECODE_FAILED}: {type(exc).__name__}: {exc}")
        t2 = time.perf_counter()
        result.vision_time = t_vision - t0
        result.prefill_time = t1 - t_vision
        result.decode_time = t2 - t1
        return result

    def _encode(self, request_ids: list[str], requests: Mapping[str, Request], result: TickResult) -> None:
        """The tick's vision work: vision-cache hits are not encoded again, the misses go through the encoders in
        as few calls as the family allows, each call a `vision_encode` event (an execution detail with its
        time: replay does not compare it). A request whose media fail (unreadable, a failing tower) fails alone:
        a failing call over several requests is redone one request at a time."""
        def on_call(call: Any) -> None:
            self._on_event("vision_encode", request_ids=[request_ids[i] for i in call.items], images=call.images,
                           **({"error": call.error} if call.error else {}), measure={"seconds": call.seconds})

        outcomes = self.runner.encode_many([requests[rid] for rid in request_ids], on_call)
        for rid, encoded in zip(request_ids, outcomes):
            if isinstance(encoded, Exception):
                result.errors[rid] = f"vision encoding failed: {type(encoded).__name__}: {encoded}"
                continue
            self._encoded[rid] = encoded
            result.encoded[rid] = {"rope_delta": encoded.rope_delta, "vision_cache_hit": encoded.vision_cache_hit,
                                   "vision_time_s": encoded.vision_time_s, "items_encoded": encoded.encoded_items,
                                   "media_tokens_encoded": encoded.encoded_media_tokens}

    def _fail_batch(self, joining: list[str], result: TickResult, error: str) -> None:
        """The batched decode is one work item: every row in it (and every request joining it) fails, the
        batch state is dropped, and the executor is ready for the next tick."""
        in_batch = [row.request.request_id for row in self._rows]
        if in_batch:
            self._on_event("kv_filter", request_ids=in_batch)
        for rid in in_batch + [rid for rid in joining if rid not in self._row_index]:
            result.errors[rid] = error
            result.sampled.pop(rid, None)
            self.kv.drop_request(rid)
            self._encoded.pop(rid, None)
        self.kv.clear_batch()
        self._rows, self._row_index = [], {}
        self._next_inputs = self._rope_deltas = self._context = self._params = self._last_hidden = None
        self._has_hidden = []
        self._released.clear()

    def _feeds(self, request: Request, start: int, end: int) -> list[_Feed]:
        """A chunk's feeds: one, or, for a cache that cannot be trimmed, two around the block boundary where it
        offers its state to the prefix cache (a checkpoint: a later prompt that shares those blocks restores it
        exactly). At most one checkpoint per chunk, so small chunks checkpoint every block and large ones cost one
        extra split. The prefill end is offered whole at completion (`_offer_prefix`), so it is not a checkpoint
        here."""
        rid = request.request_id
        # (a first chunk that must reach past its media is one forward: `Request.first_chunk_reach`)
        at = self._checkpoint_at(request, start, end) if start >= request.first_chunk_reach else None
        if at is None:
            return [_Feed(rid, start, end)]
        return [_Feed(rid, start, at, checkpoint=True), _Feed(rid, at, end)]

    def _feed(self, feeds: list[_Feed], requests: Mapping[str, Request], result: TickResult,
              checkpoints: dict[str, PrefixStore]) -> None:
        """Run one round of feeds (at most one per request): those that can share a forward in groups, the rest
        one by one; a feed that ends at a checkpoint snapshots the request's cache into `checkpoints`. A failing
        request fails alone (its error in the result, its cache dropped); the others continue."""
        grouped = self._prefill_groups(feeds, requests, result)
        for feed in feeds:
            rid = feed.request_id
            try:
                if rid not in grouped:
                    self._prefill(requests[rid], feed.start, feed.end, result)
                if feed.checkpoint:
                    payload, nbytes, whole_only = self.kv.snapshot(rid)
                    checkpoints[rid] = PrefixStore(rid, feed.end, nbytes, whole_only, payload)
            except Exception as exc:
                self.kv.drop_request(rid)
                checkpoints.pop(rid, None)
                result.errors[rid] = f"{PREFILL_FAILED}: {type(exc).__name__}: {exc}"

    def _prefill_groups(self, feeds: list[_Feed], requests: Mapping[str, Request], result: TickResult) -> set[str]:
        """Prefill feeds that can share a forward do: first and later chunks, fresh prompts and prefix-cache
        hits, the pieces of chunks split at a prefix checkpoint, of any lengths. The same computation row by row
        (each row's cache is merged left-padded and split back; a shorter feed is right-padded to the group's
        width, which no real position attends to, and windows and recurrent state are told each row's length),
        but bigger matrices for the BLAS than one forward per request.

        Each shared forward is a `prefill_forward` event (its rows, their starts and lengths, the width and pads;
        its seconds under `measure`): an execution detail, like `vision_encode`, that replay does not compare.

        Grouping is this executor's decision, never the planner's: float and quantized rows apart (a batch cache
        holds one storage), feeds sorted longest first, a group grows
        while its pad positions stay within `pad_ratio` of its real tokens (`PREFILL_PAD_RATIO`, the bound the
        engine checks); pads are counted in the tick's result and in `prefill_stats`. Returns the request ids
        prefilled here; the rest go the one-request way: for a family whose windows or recurrent state would take
        pads in (`PrefillSharing.ALIGNED`: its forward is not declared to honor the lengths), every feed but those
        that start at the same position with one length; a feed inside which kv_bits converts,
        a request whose model inputs fail to build (fed alone, where the error is its own), and any group whose
        forward raised (a `PrefillFallback` in the tick's result, counted, never silent)."""
        sharing = getattr(self.runner, "prefill_sharing", PrefillSharing.NONE)
        if sharing is PrefillSharing.NONE:
            return set()
        eligible = [(f.request_id, f.start, f.end - f.start) for f in feeds
                    if self._groupable(requests[f.request_id], f.start, f.end - f.start)]
        # rows of one storage per forward: a batch cache is float or quantized (mlx-vlm's BatchQuantizedKVCache)
        by_storage: dict[bool, list] = {}
        for feed in eligible:
            by_storage.setdefault(feed[1] > 0 and self.kv.is_quantized(feed[0]), []).append(feed)
        groups = [g for part in by_storage.values() for g in prefill_groups(part, sharing, self.pad_ratio)]
        done: set[str] = set()
        for group, width, padded in groups:
            rows = [(requests[rid], self._encoded[rid], self.kv.request_cache(rid) if start else None, start, n)
                    for rid, start, n in group]
            t0 = time.perf_counter()
            try:
                with self._on_loras(row[0] for row in rows):
                    caches, logits = self.runner.prefill_many(rows)
                # rows that asked read their own positions (kept only if the whole group succeeds: a row retried
                # alone reads its own forward's)
                pieces = [_prompt_logprobs(requests[rid], start, logits[i:i + 1, :n])
                          for i, (rid, start, n) in enumerate(group)]
            except Exception as exc:  # retried one by one, where an error is attributed to its own request
                self.prefill_stats.fallbacks += 1
                result.prefill_fallbacks.append(PrefillFallback(tuple(rid for rid, _, _ in group), width,
                                                                f"{type(exc).__name__}: {exc}"))
                continue
            for (rid, _, _), piece in zip(group, pieces):
                if piece is not None:
                    result.prompt_logprobs.setdefault(rid, []).append(piece)
            self.prefill_stats.record(len(group), sum(start > 0 for _, start, _ in group), padded)
            result.padded_tokens += padded
            self._on_event("prefill_forward", request_ids=[rid for rid, _, _ in group],
                           starts=[start for _, start, _ in group], lengths=[n for *_, n in group], width=width,
                           padded_tokens=padded, measure={"seconds": time.perf_counter() - t0})
            for (rid, start, n), cache in zip(group, caches):
                self.kv.adopt(rid, cache)
                self._quantize_if_due(requests[rid], start + n)
                done.add(rid)
        return done

    def _groupable(self, request: Request, start: int, n: int) -> bool:
        rid = request.request_id
        if n <= 0 or (start > 0) != self.kv.has_request(rid):  # a later chunk has its cache (restored or fed)
            return False
        if self.quantize is not None and start <= self.quantize.point(request.prompt_len) < start + n:
            return False  # it converts inside this chunk: its forward is split, one request at a time
        try:
            encoded = self._encoded_input(request)
        except Exception:  # fed alone, where its error is its own
            return False
        return self.runner.shares_prefill(encoded, start, n)  # False: a chunk the model must see alone

    def _checkpoint_at(self, request: Request, start: int, end: int) -> int | None:
        if not self._checkpoints:
            return None
        return checkpoint_position(start, end, request.prefill_len, self.prefix_cache.block_size,
                                   request.media_offset)

    def _prefill(self, request: Request, start: int, end: int, result: TickResult) -> None:
        rid = request.request_id
        cache = self.kv.request_cache(rid)
        self._encoded_input(request)
        if end <= start:
            return
        point = self.quantize.point(request.prompt_len) if self.quantize is not None else None
        if point is not None and start < point < end and not self.kv.is_quantized(rid):
            # mlx-lm converts at `point`: the tokens before it are computed from float keys and values, the
            # tokens after it from quantized ones, so the forward is split there
            with self._on_loras([request]):
                logits = self.runner.prefill(cache, request, self._encoded[rid], start, point)
            self._note_prompt_logprobs(request, start, logits, result)
            self._quantize_if_due(request, point)
            cache, start = self.kv.request_cache(rid), point
        with self._on_loras([request]):
            logits = self.runner.prefill(cache, request, self._encoded[rid], start, end)
        self._note_prompt_logprobs(request, start, logits, result)
        self._quantize_if_due(request, end)

    @staticmethod
    def _note_prompt_logprobs(request: Request, start: int, logits: Any, result: TickResult) -> None:
        piece = _prompt_logprobs(request, start, logits)
        if piece is not None:
            result.prompt_logprobs.setdefault(request.request_id, []).append(piece)

    def _encoded_input(self, request: Request) -> Any:
        """What the runner prefills this request from, made on first use for requests the vision step did not
        encode: text requests (token ids: None; a VLM's runner: embeddings of the text, delta 0)."""
        rid = request.request_id
        if rid not in self._encoded:
            self._encoded[rid] = self.runner.encode(request)
        return self._encoded[rid]

    def _quantize_if_due(self, request: Request, tokens: int) -> None:
        """Convert a prefilling request's cache once it holds `tokens` >= its conversion point. Not at the end
        of its prefill: there the cache is offered to the prefix cache first (a float snapshot, reusable by
        prompts whose own conversion comes later) and converted when it joins the batch."""
        if self.quantize is None or tokens >= request.prefill_len - 1:
            return
        if tokens >= self.quantize.point(request.prompt_len) and self.kv.quantize_request(request.request_id):
            self._on_event("kv_quantize", request_ids=[request.request_id], tokens=tokens)

    def _offer_prefix(self, request: Request, restored_now: int, result: TickResult) -> None:
        """At prefill end the request's own cache holds prefill_tokens[:-1]: offer it to the prefix cache (the cache
        object is dropped right after the merge, so the payload is never written again)."""
        if self.prefix_cache is None:
            return
        n = request.prefill_len - 1
        if n < self.prefix_cache.block_size or restored_now == n:
            return  # too short to index, or restored whole from an entry this tick: nothing new
        if self.quantize is not None and self.kv.is_quantized(request.request_id):
            # converted inside its prefill (past mlx-lm's first 2048-token step, or a recompute): a prompt
            # sharing a shorter prefix would need those tokens in float storage, which is gone
            return
        payload, nbytes, whole_only = self.kv.snapshot(request.request_id)
        result.prefix_stores.append(PrefixStore(request.request_id, n, nbytes, whole_only, payload))

    def _join(self, request_ids: list[str], requests: Mapping[str, Request], result: TickResult) -> None:
        encoded = [self._encoded.pop(rid, None) for rid in request_ids]  # prompt embeddings are not needed now
        points = None
        if self.quantize is not None:
            points = [self.quantize.point(requests[rid].prompt_len) for rid in request_ids]
            converted = [rid for rid, point in zip(request_ids, points)  # left for the end of prefill
                         if requests[rid].prefill_len - 1 >= point and self.kv.quantize_request(rid)]
            if converted:
                self._on_event("kv_quantize", request_ids=converted)
        self.kv.join(request_ids, points)
        self._on_event("kv_merge", request_ids=list(request_ids))
        self._warm_drafter(request_ids, requests, result)
        last = mx.array([_last_prefill_token(requests[rid]) for rid in request_ids], dtype=mx.uint32)
        deltas = mx.array([getattr(e, "rope_delta", 0) for e in encoded], dtype=mx.int32)
        self._next_inputs = last if self._next_inputs is None else mx.concatenate([self._next_inputs, last])
        if self._keeps_hidden and self._last_hidden is not None:  # joiners have no hidden state yet
            zeros = mx.zeros((len(request_ids), self._last_hidden.shape[-1]), dtype=self._last_hidden.dtype)
            self._last_hidden = mx.concatenate([self._last_hidden, zeros])
        self._has_hidden += [False] * len(request_ids)
        self._rope_deltas = deltas if self._rope_deltas is None else mx.concatenate([self._rope_deltas, deltas])
        for rid in request_ids:
            self._row_index[rid] = len(self._rows)
            # the sampling step continues where a preempted request left off (seeded draws stay the same)
            self._rows.append(_Row(requests[rid], requests[rid].num_output_tokens))
        self._params = None
        if self._context is not None or self._needs_context():
            self._context = self._extend_context(request_ids, requests)

    def _warm_drafter(self, request_ids: list[str], requests: Mapping[str, Request], result: TickResult) -> None:
        """A draft model's cache takes a row when the target's batch does (in the same tick, so the plan's KV
        bound, which counts the draft model's layers in every merge, covers it), for the rows that may draft. If
        that fails, those rows never draft (a row joining later, in a tick without a merge, would be unbounded)."""
        if not hasattr(self.drafter, "warm"):
            return
        rows = [DraftRequest(rid, requests[rid].prefill_tokens(0, requests[rid].prefill_len))
                for rid in request_ids if requests[rid].draft_eligible]
        if not rows:
            return
        try:
            self.drafter.warm(rows)
        except Exception as exc:  # a failing drafter costs its speed-up, never a request
            self.draft_stats.failures += 1
            self.draft_stats.last_failure = result.drafter_error = f"{type(exc).__name__}: {exc}"
            self.drafter.release([r.request_id for r in rows])
            self._no_draft.update(r.request_id for r in rows)

    def _drop_released(self) -> None:
        if not self._released:
            return
        keep = [i for i, row in enumerate(self._rows) if row.request.request_id not in self._released]
        self._on_event("kv_filter", request_ids=[row.request.request_id for row in self._rows
                                                 if row.request.request_id in self._released])
        self._released.clear()
        self._rows = [self._rows[i] for i in keep]
        self._row_index = {row.request.request_id: i for i, row in enumerate(self._rows)}
        self.kv.keep_rows(keep)
        if keep:
            idx = mx.array(keep)
            self._next_inputs = self._next_inputs[idx]
            self._rope_deltas = self._rope_deltas[idx]
            if self._last_hidden is not None:
                self._last_hidden = self._last_hidden[idx]
            self._has_hidden = [self._has_hidden[i] for i in keep]
            if self._context is not None:
                self._context = self._context[idx]
        else:
            self._next_inputs = self._rope_deltas = self._last_hidden = None
            self._context = None
            self._has_hidden = []
        self._params = None

    # ---- decode ---------------------------------------------------------------------------------
    def _needs_context(self) -> bool:
        return any(row.request.sampling.has_penalty for row in self._rows)

    def _extend_context(self, request_ids: list[str], requests: Mapping[str, Request]) -> mx.array:
        """Penalty context for new rows: the tail of their prompt, like mlx-lm's processors see it.

        The last prompt token is excluded here because it is appended as the row's first decode input. With an
        output-only history the tail starts after the prompt (a resumed request keeps its re-fed outputs).
        """
        w = self.penalty_context
        rows = []
        for rid in request_ids:
            r = requests[rid]
            first = max(r.prompt_len if self.output_only_history else 0, r.prefill_len - w)
            tail = r.prefill_tokens(first, r.prefill_len - 1) if w > 1 and first < r.prefill_len - 1 else []
            rows.append([-1] * (w - len(tail)) + tail)
        new = mx.array(rows, dtype=mx.int32)
        if self._context is None:
            n_old = len(self._rows) - len(request_ids)
            old = mx.full((n_old, w), -1, dtype=mx.int32)
            return mx.concatenate([old, new]) if n_old else new
        return mx.concatenate([self._context, new])

    def _sampling_arrays(self) -> SamplingArrays:
        if self._params is None:
            rows = [row.sampling for row in self._rows]
            self._params = SamplingArrays.from_rows(rows)
            # no custom sampler (it reads a row's log-softmax vector) and no logprob vectors anywhere: a plain tick
            # then draws greedy and sampled rows apart (`draw_tokens`; processors, biases and grammars act on the
            # logits before it, penalties inside it), and takes the log-softmax only of the rows asking for logprobs
            drawable = not self.logprob_vectors and not any(row.request.sampling.sampler is not None
                                                            for row in self._rows)
            self._draw_groups = DrawGroups.from_rows(rows) if drawable else None
            # a verify tick's bare argmax per row at every position: greedy, no penalty, no logprobs, and nothing
            # that changes position 0's logits only (processors, biases, grammars)
            self._argmax_only = (drawable and self._params.all_greedy and not self._params.any_penalty
                                 and not any(row.request.sampling.logprobs or _masks_logits(row.request.sampling)
                                             for row in self._rows))
            self._may_ban = any(_bans_tokens(row.request.sampling) for row in self._rows)
        return self._params

    def _decode(self, result: TickResult, draft_k: dict[str, int]) -> None:
        """One batched forward over every row. Rows the plan lets draft propose up to k tokens each and the
        forward verifies `[input, d_1..d_k]` for all rows at once (rows without drafts are padded and rolled
        back); otherwise it is a plain one-token step. Where the batch cannot roll back (`_refeed_drafts`),
        rejected positions are undone by restoring the cache and feeding the accepted ones again."""
        snapshot = None
        if draft_k and not self._rolls_back:
            draft_k = self._refeed_grants(draft_k)
        drafts = self._propose(draft_k, result) if draft_k else None
        if drafts:
            drafts = self._gate(drafts)
        if drafts and not self._rolls_back:
            drafts = self._refeed_drafts(drafts)
            snapshot = snapshot_batch(self.kv.batch) if drafts else None
        width = max((len(d.tokens) for d in drafts.values()), default=0) if drafts else 0
        inputs = self._next_inputs
        all_hidden = None
        result.computed_tokens += len(self._rows) * (1 + width)  # every row runs at the widest draft
        if width == 0 and not self._keeps_hidden:
            logits = self._decode_groups(inputs)
            all_logits = None
        else:
            padded = [drafts[row.request.request_id].tokens if drafts and row.request.request_id in drafts else []
                      for row in self._rows]
            draft_tokens, draft_lens = pad_drafts(padded, width)
            verify_inputs = mx.concatenate([inputs[:, None].astype(mx.int32), draft_tokens], axis=1)
            with self._on_loras(row.request for row in self._rows):
                if self._keeps_hidden:  # (B, width + 1, V) logits and (B, width + 1, H) hidden states
                    all_logits, all_hidden = self.runner.forward_with_hidden(self.kv.batch, verify_inputs,
                                                                             native=self._native_hidden)
                else:
                    all_logits = self.runner.verify(self.kv.batch, verify_inputs, self._rope_deltas)
            logits = all_logits[:, 0, :]
        params = self._sampling_arrays()  # (first: it sets what the masks below read, `_may_ban`)
        banned = self._banned()  # (once a tick: the masks and the verify tick's pick both read it)
        logits = self._apply_processors(logits, result, banned)
        # a verify tick whose rows only need argmaxes reads back every row's greedy choice at every position (the
        # tokens and the verdict are decided from it on the host): `greedy_pick`, which skips the log-softmax
        # wherever that provably gives the same token (`sample_tokens` would agree)
        pick = greedy_pick(all_logits) if width and self._argmax_only and not banned else None
        # a plain tick that can: greedy rows picked, sampled rows drawn, each group apart (`draw_tokens`)
        draw = self._draw(inputs, logits, params) if not width and self._draw_groups else None
        top_rows = None
        if pick is not None:
            tokens, logprobs = None, None
            mx.eval(*pick.arrays(), *rollback_reads(self.kv.batch))  # one sync for both
            top_rows, recomputed = pick.tokens()
            self.greedy_stats.positions += pick.argmax.size
            self.greedy_stats.recomputed += recomputed
        elif draw is not None:
            tokens, logprobs = None, None
            mx.eval(*draw.arrays())
            drawn, recomputed = draw.tokens()
            self.greedy_stats.positions += len(self._draw_groups.greedy)
            self.greedy_stats.recomputed += recomputed
        else:
            tokens, logprobs = self._sample(inputs, logits, params, result)
        want_logprobs = [i for i, row in enumerate(self._rows) if row.request.sampling.logprobs]
        picked = alternatives = None
        if want_logprobs:  # (top_logprobs needs logprobs)
            idx = mx.array(want_logprobs)
            if draw is not None:  # only these rows' log-softmax, of the (penalised) logits the tokens came from
                tokens = mx.array(drawn, dtype=mx.uint32)
                scored = logprobs_from_logits(draw.logits[idx])
            else:
                scored = logprobs[idx]
            picked = mx.take_along_axis(scored, tokens[idx][:, None].astype(mx.int32), axis=1)[:, 0]
            alternatives = self._top_logprobs(want_logprobs, scored)
        emitted: dict[int, list[int]] = {}
        if width:  # (the sampled tokens are evaluated with the verdict: one sync for both)
            emitted = self._verify(all_logits, draft_tokens, draft_lens, drafts, width, result,
                                   () if tokens is None else tokens if picked is None else (tokens, picked),
                                   None if snapshot is None else (snapshot, verify_inputs), top_rows)
        if all_hidden is not None:  # each row's hidden state at the last position it kept
            kept = mx.array([len(emitted[i]) - 1 if i in emitted else 0 for i in range(len(self._rows))])
            self._last_hidden = all_hidden[mx.arange(len(self._rows)), kept]
            self._has_hidden = [True] * len(self._rows)
        if top_rows is not None:  # read back already: each row's choice at position 0
            token_list = [row_top[0] for row_top in top_rows]
        elif draw is not None:
            token_list = drawn
            if picked is not None:
                mx.eval(picked, *(() if alternatives is None else alternatives[1:]))
        else:
            mx.eval(tokens, *(() if picked is None else (picked,)), *(() if alternatives is None else alternatives[1:]))
            token_list = tokens.tolist()
        for i, (row, token) in enumerate(zip(self._rows, token_list)):
            out = emitted.get(i)
            if out is not None:  # a drafting row: accepted drafts, then the target's own token
                *accepted, token = out
                if accepted:
                    result.accepted_drafts[row.request.request_id] = accepted
                token_list[i] = token
            result.sampled[row.request.request_id] = token
            row.step += 1 + len(result.accepted_drafts.get(row.request.request_id, ()))
        self._next_inputs = (mx.array(token_list, dtype=mx.uint32) if emitted or tokens is None
                             else tokens.astype(mx.uint32))
        if picked is not None:
            for i, lp in zip(want_logprobs, picked.tolist()):
                result.logprobs[self._rows[i].request.request_id] = lp
        if alternatives is not None:
            rows, ids, values = alternatives
            for i, row_ids, row_values in zip(rows, ids.tolist(), values.tolist()):
                k = self._rows[i].request.sampling.top_logprobs
                result.top_logprobs[self._rows[i].request.request_id] = list(zip(row_ids[:k], row_values[:k]))
        if self.logprob_vectors:  # one (V,) vector per emitted token
            if emitted:
                verified = all_logits - mx.logsumexp(all_logits, axis=-1, keepdims=True)
            for i, row in enumerate(self._rows):
                n = len(emitted.get(i, ()))
                result.logprob_vectors[row.request.request_id] = (
                    [verified[i, j] for j in range(n)] if n else [logprobs[i]])

    def _top_logprobs(self, want: list[int], scored: mx.array) -> tuple[list[int], mx.array, mx.array] | None:
        """(rows, ids, values) of the most likely tokens of the rows that asked for `top_logprobs`, as many as
        the most any of them asked for, most likely first; None when no row asked. `scored`: the log-softmax of
        the rows `want` (those asking for logprobs), in that order."""
        asked = [j for j, i in enumerate(want) if self._rows[i].request.sampling.top_logprobs]
        if not asked:
            return None
        rows = [want[j] for j in asked]
        lp = scored[mx.array(asked)]
        k = min(max(self._rows[i].request.sampling.top_logprobs for i in rows), lp.shape[-1])
        return (rows, *most_likely(lp, k))

    def _sample(self, inputs: mx.array, logits: mx.array, params: SamplingArrays,
                result: TickResult) -> tuple[mx.array, mx.array]:
        """Every row's token from its position-0 logits: penalties (with each row's recent tokens), the vectorised
        sampler, then custom samplers. Returns (tokens, log-probs)."""
        tokens, logprobs = sample_tokens(logits, params, self._steps(), self._penalty_context(inputs, params))
        return self._apply_samplers(tokens, logprobs, result), logprobs

    def _draw(self, inputs: mx.array, logits: mx.array, params: SamplingArrays) -> TokenDraw:
        """`_sample`'s tokens without the batch's log-softmax (`draw_tokens`: none where no token needs it)."""
        return draw_tokens(logits, params, self._draw_groups, self._steps(), self._penalty_context(inputs, params))

    def _steps(self) -> mx.array:
        return mx.array([row.step for row in self._rows], dtype=mx.uint32)

    def _penalty_context(self, inputs: mx.array, params: SamplingArrays) -> mx.array | None:
        """Each row's recent tokens with this tick's inputs appended, where some row has a penalty."""
        if not params.any_penalty:
            return None
        fed = inputs.astype(mx.int32)
        if self.output_only_history:  # a fresh row's first input is its last prompt token: not history here
            fed = mx.where(mx.array([row.step > 0 for row in self._rows]), fed, -1)
        self._context = mx.concatenate([self._context[:, 1:], fed[:, None]], axis=1)
        return self._context

    def _decode_groups(self, inputs: mx.array) -> mx.array:
        """The one-token forward of every row. Under kv_bits, rows whose context has not reached their
        conversion point are in a float batch of their own: one forward per group, logits back in row order,
        then rows that reached their point move to the quantized batch."""
        groups = self.kv.groups()
        if len(groups) == 1 and groups[0][0] == [row.request.request_id for row in self._rows]:
            with self._on_loras(row.request for row in self._rows):
                logits = self.runner.decode(groups[0][1], inputs, self._rope_deltas)
        else:
            parts, order = [], []
            for rids, cache in groups:
                idx = [self._row_index[rid] for rid in rids]
                sel = mx.array(idx)
                with self._on_loras(self._rows[i].request for i in idx):
                    parts.append(self.runner.decode(cache, inputs[sel], self._rope_deltas[sel]))
                order += idx
            inverse = [0] * len(order)
            for position, i in enumerate(order):
                inverse[i] = position
            logits = mx.concatenate(parts)[mx.array(inverse)]
        if self.quantize is not None:
            moved = self.kv.after_decode()
            if moved:
                self._on_event("kv_quantize", request_ids=moved)
        return logits

    # ---- drafting -------------------------------------------------------------------------------
    def _propose(self, draft_k: dict[str, int], result: TickResult) -> dict[str, Any]:
        rows = [
            DraftRequest(row.request.request_id, row.request.prompt_tokens + row.request.output_tokens,
                         max_tokens=draft_k[row.request.request_id],
                         sampling=row.sampling, step=row.step,
                         hidden=self._last_hidden[i] if self._keeps_hidden and self._has_hidden[i] else None)
            for i, row in enumerate(self._rows)
            if row.request.request_id in draft_k and row.request.request_id not in self._no_draft
        ]
        if not rows:
            return {}
        try:
            drafts = self.drafter.propose(rows, max(draft_k.values()))
        except Exception as exc:  # a failing drafter costs its speed-up, never a request: plain decoding
            self.draft_stats.failures += 1
            self.draft_stats.last_failure = result.drafter_error = f"{type(exc).__name__}: {exc}"
            return {}
        return {d.request_id: _embeddable(d) for d in drafts}

    def _refeed_grants(self, draft_k: dict[str, int]) -> dict[str, int]:
        """Drafting on a batch that cannot roll back (recurrent state, rotating windows): a verify of w drafts
        may be followed by a re-feed of up to w positions (`_verify`), 2w + 1 positions per row in all, so w is
        k // 2 to stay inside what the plan granted (1 + k). Every row verifies to the same accepted length,
        so a tick drafts only when every row may."""
        grants = {rid: k // 2 for rid, k in draft_k.items() if k // 2 > 0}
        return grants if len(grants) == len(self._rows) else {}

    def _refeed_drafts(self, drafts: dict[str, Any]) -> dict[str, Any]:
        """The rows' drafts if every row has one, else none (a row without a draft accepts 0, so every row
        would: a verify for nothing)."""
        have = {rid: d for rid, d in drafts.items() if len(d.tokens)}
        return have if len(have) == len(self._rows) else {}

    def _gate(self, drafts: dict[str, Draft]) -> dict[str, Draft]:
        """Cut every draft to the width the gate chose for this tick (`draft_gate.py`). Rows keep their entry
        (a row cut to nothing verifies nothing, as when its drafter proposed nothing); a declined tick has no
        drafts, so it is a plain step. A draft that rides along (`Draft.rides_along`: a paused row's) is not
        judged: it is cut to the width the others chose, and dropped in a plain tick (or with no gate)."""
        judged = {rid: 0 if d.rides_along else len(d.tokens) for rid, d in drafts.items()}
        if self.draft_gate is None:
            cut = {rid: n for rid, n in judged.items() if n}
        else:
            cut = self.draft_gate.apply(len(self._rows), judged)
        if not cut:
            return {}
        keep = max(cut.values())  # the chosen width - 1: the widest judged draft is cut to it
        lengths = {rid: min(len(d.tokens), keep) if d.rides_along else cut.get(rid, 0) for rid, d in drafts.items()}
        return {rid: d if len(d.tokens) == lengths[rid] else
                Draft(rid, d.tokens[: lengths[rid]], None if d.logprobs is None else d.logprobs[: lengths[rid]])
                for rid, d in drafts.items()}

    def _verify(self, all_logits, draft_tokens, draft_lens, drafts, width, result, sampled=(),
                refeed: tuple[Any, mx.array] | None = None, top_rows: list | None = None) -> dict[int, list[int]]:
        """Accept per row (greedy: longest matching prefix; sampled: exact min(1, p/q) rule with residual
        resampling), roll every row's cache back to what it accepted, and return each drafting row's emitted
        tokens by row index.

        With `refeed` (the batch's snapshot from before the verify forward, and that forward's inputs), the
        cache cannot drop positions per row: every row keeps the shortest accepted length a (a row that
        accepted more emits its (a+1)-th draft as its token: the target's own choice there, greedy or accepted
        by the sampling rule), and unless a is every draft, the cache is restored and `[input, d_1..d_a]`
        fed again, one forward of a + 1 positions for all rows.

        `top_rows` (every row's greedy choice at every position, read back with the lengths the rollback reads:
        `greedy_pick`) decides on the host; otherwise the verdict, the sampled tokens and those lengths are
        evaluated together: one sync per verify tick either way."""
        index = [i for i, row in enumerate(self._rows) if row.request.request_id in drafts]
        if top_rows is not None:
            accepted, emitted_rows = greedy_accept_rows([top_rows[i] for i in index],
                                                        [drafts[self._rows[i].request.request_id].tokens for i in index])
        else:
            accepted, emitted_rows = self._accept(all_logits, draft_tokens, draft_lens, drafts, width, index, sampled)
        if refeed is not None:
            accepted = [min(accepted)] * len(accepted)
        drop = [width] * len(self._rows)
        out: dict[int, list[int]] = {}
        for j, i in enumerate(index):
            a = accepted[j]
            drop[i] = width - a
            out[i] = emitted_rows[j][: a + 1]
            rid = self._rows[i].request.request_id
            proposed = len(drafts[rid].tokens)
            result.drafts[rid] = (proposed, a)
            self.drafter.accept(rid, a, out[i])
            if self.draft_gate is not None:
                self.draft_gate.observe(rid, proposed, a)
        if refeed is None:
            rollback_rows(self.kv.batch, drop)
        elif accepted[0] < width:
            snapshot, verify_inputs = refeed
            restore_batch(self.kv.batch, snapshot)
            with self._on_loras(row.request for row in self._rows):
                self.runner.verify(self.kv.batch, verify_inputs[:, : accepted[0] + 1], self._rope_deltas)
            result.computed_tokens += len(self._rows) * (accepted[0] + 1)
        self._on_event("kv_rollback", rows=[[row.request.request_id, n] for row, n in zip(self._rows, drop)])
        self.draft_stats.record(sum(len(d.tokens) for d in drafts.values()), sum(accepted), len(self._rows),
                                sum(len(o) for o in out.values()) + len(self._rows) - len(out))
        return out

    def _accept(self, all_logits, draft_tokens, draft_lens, drafts, width, index, sampled) -> tuple[list, list]:
        """Acceptance on the device for the drafting rows `index` (greedy: longest matching prefix; deterministic
        drafts for sampled rows: the longest prefix matching what the row's seed draws at each position, so the
        tokens are those of decoding without drafts; drafts drawn from a q: the exact min(1, p/q) rule):
        (accepted, emitted tokens) per drafting row, read back with `sampled`."""
        idx = mx.array(index)
        rows = [self._rows[i] for i in index]
        target = all_logits[idx]
        if all(row.request.sampling.is_greedy for row in rows):
            res = greedy_accept(target, draft_tokens[idx], draft_lens[idx])
        else:
            params = SamplingArrays.from_rows([row.sampling for row in rows])
            steps = mx.array([r.step for r in rows], dtype=mx.uint32)
            if all(drafts[row.request.request_id].logprobs is None for row in rows):
                res = sampled_accept(target, draft_tokens[idx], draft_lens[idx], params, steps)
            else:
                target_lp = target - mx.logsumexp(target, axis=-1, keepdims=True)
                draft_lp = stack_draft_logprobs([drafts[r.request.request_id].tokens for r in rows],
                                                [drafts[r.request.request_id].logprobs for r in rows], width,
                                                target.shape[-1])
                res = stochastic_accept(processed_logprobs(target_lp, params), draft_lp, draft_tokens[idx],
                                        draft_lens[idx], params.seed, steps)
        mx.eval(res.accepted, res.emitted, sampled, *rollback_reads(self.kv.batch))
        return res.accepted.tolist(), res.emitted.tolist()

    def _banned(self) -> list[tuple[int, tuple[int, ...]]]:
        """(row, the token ids it may not sample now) for each row that has some: its stops while within
        `min_tokens` (`_stops_held`), and the last token of each of its `bad_words_ids` the output so far leads
        into (a one-token word: always). None for a batch where no row has either (`_may_ban`)."""
        if not self._may_ban:
            return []
        banned = dict(self._stops_held())
        for i, row in enumerate(self._rows):
            words = row.request.sampling.bad_words_ids
            if words:
                ends = tuple(word[-1] for word in words if _leads_into(row.request.output_tokens, word))
                if ends:
                    banned[i] = banned.get(i, ()) + ends
        return list(banned.items())

    def _stops_held(self) -> list[tuple[int, tuple[int, ...]]]:
        """(row, the token ids it may not sample yet) for each row whose next token is within its `min_tokens`: the
        model's end-of-sequence tokens (unless it ignores them) and its stop_token_ids."""
        held = []
        for i, row in enumerate(self._rows):
            request = row.request
            if request.sampling.min_tokens and request.before_min_tokens:
                own = request.sampling.stop_token_ids
                held.append((i, own if request.sampling.ignore_eos else (*self.model_stop_ids, *own)))
        return held

    def _mask_banned(self, logits: mx.array, banned: list[tuple[int, tuple[int, ...]]]) -> mx.array:
        """`min_tokens` and `bad_words_ids`: -inf at the tokens `banned` (this tick's `_banned`) names, one scatter
        for the batch (vLLM applies these masks first, before the logit bias). Ids past the vocabulary are not there
        to mask."""
        vocab = logits.shape[-1]
        pairs = [(i, t) for i, ids in banned for t in ids if t < vocab]
        if not pairs:
            return logits
        rows, ids = zip(*pairs)
        return logits.at[mx.array(rows), mx.array(ids)].minimum(mx.array(-mx.inf, dtype=logits.dtype))

    def _apply_processors(self, logits: mx.array, result: TickResult,
                          banned: list[tuple[int, tuple[int, ...]]]) -> mx.array:
        """The `min_tokens` and bad-words mask (`_mask_banned`), then logit bias, then user logits processors,
        then the mask of allowed token ids or a structured output's, per row (processors are arbitrary Python);
        rows without them are untouched. The bias is mlx-lm's `logit_bias` processor
        (`logits.at[:, ids].add(biases)`), first as in its `make_logits_processors`; the grammar's mask is a
        `GrammarProcessor`, the processor a solo mlx-lm run is given for the same constraint.

        Like mlx-lm, a processor sees every token so far (prompt + output); with an output-only history (vllm-mlx)
        the generated tokens only. One that raises fails its own request (reported in `result.errors`); its row
        samples from the unprocessed logits and is dropped.
        """
        logits = self._mask_banned(logits, banned)
        rows = [i for i, row in enumerate(self._rows) if _masks_logits(row.request.sampling)]
        if not rows:
            return logits
        parts, changed = list(logits), False
        masks: dict[int, Any] = {}  # row -> what its grammar allows (applied to the batch in one op below)
        banned_now = dict(banned)
        for i in rows:
            request = self._rows[i].request
            row_logits = logits[i : i + 1]
            bias = request.sampling.logit_bias
            if bias:
                row_logits = row_logits.at[:, mx.array([t for t, _ in bias])].add(mx.array([b for _, b in bias]))
                parts[i], changed = row_logits[0].astype(logits.dtype), True  # (the batch keeps one dtype)
            if request.sampling.logits_processors:
                history = (request.output_tokens if self.output_only_history
                           else request.prompt_tokens + request.output_tokens)
                try:
                    context = mx.array(history, dtype=mx.uint32)
                    for processor in request.sampling.logits_processors:
                        row_logits = processor(context, row_logits)
                    parts[i], changed = mx.reshape(row_logits, logits.shape[1:]).astype(logits.dtype), True
                except Exception as exc:  # user code: contain it to its own request
                    result.errors[request.request_id] = f"logits processor failed: {type(exc).__name__}: {exc}"
                    parts[i] = logits[i]
                    continue
            if request.sampling.allowed_token_ids is not None:
                masks[i] = self._allowed_mask(request, logits.shape[-1])
            if request.sampling.structured_output is not None:
                try:  # (a matcher reads only what was generated: it is fed the outputs, whatever the history)
                    allowed = self._grammar_row(request).allowed(request.output_tokens, logits.shape[-1])
                except Exception as exc:  # a constraint that cannot go on fails its own request
                    result.errors[request.request_id] = f"structured output failed: {type(exc).__name__}: {exc}"
                    parts[i] = logits[i]
                    continue
                if allowed is not None:
                    masks[i] = allowed
            if i in masks and i in banned_now and _masked_out(masks[i], banned_now[i]):
                # each token the row's mask allows ends a bad word the output leads into, or is a stop token
                # min_tokens holds (add_request refuses what is masked from the start): logits that are all -inf
                # would give token 0, which nothing allows
                result.errors[request.request_id] = ("nothing left to sample: every token its allowed_token_ids or "
                                                     "structured output allows is masked here (bad_words_ids, or "
                                                     "stops within min_tokens)")
                del masks[i]
                parts[i] = logits[i]
        out = mx.stack(parts) if changed else logits
        if masks:  # GrammarProcessor.__call__'s where, for every constrained row at once (and allowed ids')
            allowed = np.ones(logits.shape, dtype=bool)
            for i, row_allowed in masks.items():
                allowed[i] = row_allowed
            out = mx.where(mx.array(allowed), out, mx.array(-mx.inf, dtype=out.dtype))
        return out

    def _allowed_mask(self, request: Request, vocab: int) -> np.ndarray:
        """The (V,) mask of the tokens a request with `allowed_token_ids` may sample, made once per request."""
        mask = self._allowed_masks.get(request.request_id)
        if mask is None:
            mask = np.zeros(vocab, dtype=bool)
            mask[list(request.sampling.allowed_token_ids)] = True
            self._allowed_masks[request.request_id] = mask
        return mask

    def _grammar_row(self, request: Request) -> GrammarProcessor:
        """The row's matcher, built on its first constrained token; fed the row's outputs (after a preemption,
        all of them so far on its first call)."""
        processor = self._grammar_rows.get(request.request_id)
        if processor is None:
            if self.grammars is None:
                raise ValueError("this executor has no grammar compiler (MLXExecutor(grammars=...))")
            processor = self._grammar_rows[request.request_id] = self.grammars.processor(
                request.sampling.structured_output, prompt_len=0)
        return processor

    def _apply_samplers(self, tokens: mx.array, logprobs: mx.array, result: TickResult) -> mx.array:
        """Rows with a custom sampler (`SamplingParams.sampler`) take its token, drawn from their log-softmax
        vector like mlx-lm's samplers are; one that raises fails its own request, like a logits processor."""
        rows = [i for i, row in enumerate(self._rows) if row.request.sampling.sampler is not None]
        if not rows:
            return tokens
        index = mx.arange(tokens.shape[0])
        for i in rows:
            request = self._rows[i].request
            try:
                token = mx.reshape(request.sampling.sampler(logprobs[i : i + 1]), ()).astype(tokens.dtype)
            except Exception as exc:  # user code: contain it to its own request
                result.errors[request.request_id] = f"sampler failed: {type(exc).__name__}: {exc}"
                continue
            tokens = mx.where(index == i, token, tokens)
        return tokens


def _masked_out(allowed: np.ndarray, banned: tuple[int, ...]) -> bool:
    """Whether every token a (V,) mask allows is among `banned`."""
    ids = np.unique(np.asarray(banned, dtype=np.int64))
    ids = ids[ids < allowed.shape[-1]]
    return int(allowed.sum()) <= int(allowed[ids].sum())


def _last_prefill_token(request: Request) -> int:
    return request.prefill_tokens(request.prefill_len - 1, request.prefill_len)[0]
