"""The typed contract between deciding and doing: what one tick will compute.

`TickPlan` is the only thing an executor receives from the scheduler. It names requests by id and says how
many prompt tokens to feed for each; what an executor needs to know of a request it has not seen yet travels
in the plan as a `NewRequest` (values, not the scheduler's `Request`): executors never see scheduler objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple


class Reason(str, Enum):
    """Why a live request got less than it could use this tick: the constraint that bound (closed set)."""

    MAX_SEQS = "max_seqs"  # queued: every slot is taken
    TOKEN_BUDGET = "token_budget"  # max_batched_tokens is used up (by decode rows and chunks given before it)
    PREFILL_CHUNK = "prefill_chunk"  # its chunk is cut at prefill_chunk tokens
    PREFILL_TOKEN_CAP = "prefill_token_cap"  # max_prefill_tokens (the prefill share of a tick) is used up
    KV_BUDGET = "kv_budget"  # its next chunk (or admission with headroom) does not fit kv_memory_bytes
    # its media waits: this tick's vision_budget items or vision_token_budget tokens are taken
    VISION_BUDGET = "vision_budget"
    POLICY_ORDER = "policy_order"  # it would fit, but a blocked request ahead of it may not be jumped
    WAITING_FOR_MEDIA = "waiting_for_media"  # its media is encoded this tick; its prefill starts next tick
    PREEMPTED_BY = "preempted_by"  # preempted (caches dropped) to make room for `others[0]`
    # a running row's (ROW_REASONS):
    PREFILL_FIRST = "prefill_first"  # its decode is paused: mix="prefill-first" gives this tick to prefill
    DRAFT_BUDGET = "draft_budget"  # fewer draft positions than draft_tokens (or none): what the tick's token
    # budget left after the decode rows and the prefill chunks pays for fewer per row of the verify forward
    DRAFT_INELIGIBLE = "draft_ineligible"  # it never drafts: logprobs, processors, a bias, a constraint, penalties
    # it does not draft yet: its next token is within min_tokens, whose masked stop tokens a verify forward's
    # later positions would not see
    DRAFT_MIN_TOKENS = "draft_min_tokens"


#: Reasons of running (decoding) rows rather than of requests waiting to run; recorded since the `row_reasons`
#: plan-record group (a trace without it was written before they existed, and replay leaves them out).
ROW_REASONS = frozenset({Reason.PREFILL_FIRST, Reason.DRAFT_BUDGET, Reason.DRAFT_INELIGIBLE,
                         Reason.DRAFT_MIN_TOKENS})


@dataclass(frozen=True)
class WaitReason:
    """One request's binding constraint this tick. `others`: for POLICY_ORDER the requests ahead of it that
    hold it back; for PREEMPTED_BY the request it made room for; otherwise empty."""

    request_id: str
    reason: Reason
    others: tuple[str, ...] = ()

    def to_record(self) -> list:
        return [self.request_id, self.reason.value, list(self.others)]

    @classmethod
    def from_record(cls, record: list) -> "WaitReason":
        rid, reason, others = record
        return cls(rid, Reason(reason), tuple(others))


@dataclass(frozen=True)
class PrefillChunk:
    """Feed prompt positions [start, end) of a request.

    When `completes` (end == prompt length), the last prompt token is fed as that row's input in this tick's
    batched decode forward, which samples the request's first token: prefill and first token share a tick.
    """

    request_id: str
    start: int
    end: int
    completes: bool

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


class DraftGrant(NamedTuple):
    """A decoding row may propose up to `tokens` draft tokens, verified in this tick's forward."""

    request_id: str
    tokens: int


class PrefixHit(NamedTuple):
    """A first chunk starts after `tokens` prompt tokens restored from prefix-cache entry `entry_id`."""

    request_id: str
    entry_id: int
    tokens: int


class PlannedFailure(NamedTuple):
    """A request failed by the plan (it can never fit the KV budget), with the reason."""

    request_id: str
    reason: str


# (The three records above are named tuples: they unpack as the plain tuples older code and traces use, and
# are written to a trace as the same JSON lists.)


@dataclass(frozen=True)
class NewRequest:
    """What an executor needs of a request whose first work is in this plan (its admission, or its readmission
    after a preemption): vLLM's `NewRequestData`. The executor keeps its own copy from here on and appends the
    tokens it produces itself; the plan names the request by id only afterwards."""

    request_id: str
    prompt_tokens: tuple[int, ...]
    sampling: Any  # scheduler.request.SamplingParams (a value; logits processors travel by reference)
    seed: int  # the effective sampling seed
    output_tokens: tuple[int, ...] = ()  # produced before a preemption: re-fed as prompt (recompute_tokens)
    recompute_tokens: int = 0
    media: Any = field(default=None, compare=False)  # the model layer's prepared inputs (VLM), by reference
    media_key: str | None = None
    num_images: int = 0
    media_marks: tuple[tuple[int, str], ...] = ()  # Request.media_marks (its first: where it checkpoints)
    lora: str | None = None  # the LoRA adapter its forwards run on (None: the base model)
    first_chunk_reach: int = 0  # Request.first_chunk_reach (its first chunk is one forward of its own)


#: What an outcome records of each request a tick encoded (`TickResult.encoded`): its rope delta, whether all
#: its media came from the vision cache, and the media items and media tokens that went through the encoders for
#: it (fewer than it has where some of its items were in the cache: the families keyed per item). Traces from
#: before the last two do not carry them.
ENCODED_RECORD = ("rope_delta", "vision_cache_hit", "items_encoded", "media_tokens_encoded")


#: Optional groups of plan-record keys, named in `engine_start.plan_records` by the traces that carry them. A
#: trace without a group (older mlxsched) did not record it, and replay does not compare it.
PLAN_RECORD_GROUPS: dict[str, tuple[str, ...]] = {
    "reasons": ("reasons", "reasons_cleared"),
    "step": ("step",),
    "row_reasons": (),  # no keys of its own: `reasons` also carries the ROW_REASONS of running rows
}


#: What the vision budget pays for, as `engine_start.vision_budget_counts` records it: the media units the
#: encoders run on, not those in the vision cache nor a tick's repeats (`planner._VisionBudget`). A trace without
#: it (older mlxsched) counted every unit of every request, and replay plans it that way.
VISION_BUDGET_COUNTS = "uncached"


@dataclass(frozen=True)
class TickPlan:
    tick: int
    admitted: tuple[str, ...] = ()  # queued -> chunk_prefilling (text) or vision_encoding (media) this tick
    encode: tuple[str, ...] = ()  # requests whose media is encoded this tick (vision budget)
    prefill: tuple[PrefillChunk, ...] = ()
    decode: tuple[str, ...] = ()  # already decoding: one token each
    draft: tuple[DraftGrant, ...] = ()  # decoding rows that may propose up to k draft tokens to verify
    prefix_hits: tuple[PrefixHit, ...] = ()  # first chunks that start from a prefix-cache entry
    preempted: tuple[str, ...] = ()  # back to queued, caches dropped before this tick's work
    failed: tuple[PlannedFailure, ...] = ()  # can never fit the KV budget
    kv_bytes_bound: int | None = None  # upper bound on KV bytes after this tick (with a KV budget)
    num_batched_tokens: int = 0
    num_seqs: int = 0  # requests holding a slot after this tick's admissions
    reasons: tuple[WaitReason, ...] = ()  # every live request that got less than it could use, and why
    # requests whose first work since (re)admission is in this plan (Scheduler.plan fills it in): derived from
    # the decisions above, so not part of a plan's identity, and not recorded (a trace has the arrivals)
    new_requests: tuple[NewRequest, ...] = field(default=(), compare=False)

    @property
    def verify_width(self) -> int:
        """Draft positions per row of this tick's batched forward: the longest draft any row may propose. The
        executor verifies every row of the forward at this width (rows with shorter drafts are padded), so
        that is what the tick computes."""
        return max((k for _, k in self.draft), default=0)

    @property
    def forward_rows(self) -> int:
        """Rows of the batched decode forward: the decoding rows and the requests whose prefill completes
        (their last prompt token is that forward's input)."""
        return len(self.decode) + sum(1 for c in self.prefill if c.completes)

    @property
    def decode_tokens(self) -> int:
        """Positions the batched decode forward computes beyond the prefill chunks' tokens: one per decoding
        row, plus `verify_width` draft positions for every row of the forward (a completing chunk's last token
        is counted in its chunk)."""
        return len(self.decode) + self.forward_rows * self.verify_width

    @property
    def is_empty(self) -> bool:
        return not (self.prefill or self.decode or self.encode or self.preempted or self.failed)

    def to_record(self) -> dict:
        """Decision fields for the event log (compact, JSON-ready)."""
        return {
            "admitted": list(self.admitted),
            "encode": list(self.encode),
            "prefill": [[c.request_id, c.start, c.end, c.completes] for c in self.prefill],
            "decode": list(self.decode),
            "draft": [list(d) for d in self.draft],
            "prefix_hits": [list(h) for h in self.prefix_hits],
            "preempted": list(self.preempted),
            "failed": [list(f) for f in self.failed],
            "kv_bytes_bound": self.kv_bytes_bound,
            "num_batched_tokens": self.num_batched_tokens,
            "num_seqs": self.num_seqs,
        }

    def scheduled(self) -> tuple[list[str], list[int]]:
        """vLLM-shaped step view: request ids given tokens this tick in scheduling order (decode rows, then
        prefill chunks in plan order) and the tokens each is given (1 + draft tokens for a decode row, the
        chunk length for a prefill). Requests that only encode media are not listed (vLLM schedules encoder
        inputs apart from tokens)."""
        drafts = dict(self.draft)
        ids = list(self.decode) + [c.request_id for c in self.prefill]
        tokens = [1 + drafts.get(rid, 0) for rid in self.decode] + [c.num_tokens for c in self.prefill]
        return ids, tokens


@dataclass
class PrefixStore:
    """KV state the executor offers to the prefix cache: the first `num_tokens` tokens of the request's
    prompt. `payload` is opaque to the scheduler (None in replay)."""

    request_id: str
    num_tokens: int
    nbytes: int
    whole_only: bool
    payload: Any = None


# How an executor's error text starts when a request's prefill failed (it never joined the batch) and when
# the batched decode failed (every row was dropped from the batch): replay's model of the batch reads them.
PREFILL_FAILED = "prefill failed"
DECODE_FAILED = "decode failed"


# Batched prefill pads a group of chunks to its longest one (right padding: causal attention keeps every real
# position from seeing a pad). The padded positions are computed but are not planned tokens: the executor
# forms a group only while its pad positions are at most this fraction of the group's real tokens, so a tick's
# prefill computes at most (1 + PREFILL_PAD_RATIO) x its planned prefill tokens (bench/prefill_mix.py measured
# the choice; ARCHITECTURE.md, "Batched prefill"). The engine checks the bound every tick.
PREFILL_PAD_RATIO = 0.0625


@dataclass(frozen=True)
class PrefillFallback:
    """A batched prefill group that raised: its requests were prefilled one by one instead."""

    request_ids: tuple[str, ...]
    num_tokens: int  # the group's width: its longest chunk
    error: str


@dataclass
class PromptLogprobs:
    """Prompt-token logprobs one prefill feed computed: `logprobs[j]` is prompt token `first + j`'s, given the
    tokens before it; `ranks[j]` its rank there (how many vocabulary entries score at least as high, itself
    included: vLLM's); `top[j]` its position's most likely (token, logprob), most likely first (empty lists when
    `SamplingParams.prompt_logprobs` is 0)."""

    first: int
    logprobs: list[float]
    top: list[list[tuple[int, float]]]
    ranks: list[int] = field(default_factory=list)


@dataclass
class TickResult:
    """What an executor reports back: the only input `apply` takes besides the plan."""

    sampled: dict[str, int] = field(default_factory=dict)  # request id -> token sampled this tick
    logprobs: dict[str, float] = field(default_factory=dict)  # only for requests that asked
    # request id -> the sampled token's `top_logprobs` most likely (token, logprob), most likely first
    top_logprobs: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    logprob_vectors: dict[str, list] = field(default_factory=dict)  # (V,) log-softmax per emitted token, if configured
    # request id -> the prompt-token logprobs its prefill feeds computed this tick, in order (prompt_logprobs)
    prompt_logprobs: dict[str, list[PromptLogprobs]] = field(default_factory=dict)
    accepted_drafts: dict[str, list[int]] = field(default_factory=dict)  # drafts emitted before `sampled`
    drafts: dict[str, tuple[int, int]] = field(default_factory=dict)  # request id -> (proposed, accepted)
    drafter_error: str | None = None  # the drafter raised: this tick decoded without drafts
    errors: dict[str, str] = field(default_factory=dict)  # request id -> readable error; that request fails
    prefix_stores: list[PrefixStore] = field(default_factory=list)
    encoded: dict[str, dict] = field(default_factory=dict)  # request id -> its ENCODED_RECORD fields (and more)
    prefill_fallbacks: list[PrefillFallback] = field(default_factory=list)
    computed_tokens: int = 0  # token positions the model actually ran this tick (prefill + decode/verify forward)
    padded_tokens: int = 0  # pad positions batched prefill computed on top (<= PREFILL_PAD_RATIO x prefill tokens)
    prefill_tokens: int = 0  # the real prefill positions of computed_tokens (what the pad bound is taken of)
    vision_time: float = 0.0
    prefill_time: float = 0.0
    decode_time: float = 0.0
