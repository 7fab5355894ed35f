"""The pure planner: (view of request states, budgets, policy) -> TickPlan.

Deterministic and model-free: it reads no clock, no device and no randomness, so a recorded run replays to
the same plans. Invariants it guarantees (tests assert them on every plan):
  * every decoding request decodes one token every tick (running streams never stall);
  * prefill tokens + decode tokens <= max_batched_tokens, where a tick that verifies drafts counts what its
    forward computes: every row of the forward at the widest draft (`TickPlan.decode_tokens`);
    admitted + running <= max_seqs;
  * no chunk is longer than prefill_chunk;
  * with kv_memory_bytes, the bound on KV bytes at the tick's peak (caches/kv.py: after the tick, plus what a
    merge holds while it runs; a draft model's layers included) stays within it: the planner preempts (newest
    first) when decoding rows outgrow it and admits only what fits with headroom.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from caches.kv import KVLayout

from .config import EngineConfig
from .plan import PrefillChunk, Reason, TickPlan, WaitReason
from .policy import Policy
from .request import Request


@dataclass(frozen=True)
class SchedulerView:
    """What the planner may look at. Request objects are read, never written."""

    tick: int
    waiting: Sequence[Request]
    prefilling: Sequence[Request]
    decoding: Sequence[Request]
    encoding: Sequence[Request] = ()  # admitted media requests whose media is not encoded yet
    # cache summary: the prefix-cache entry (id, tokens) a waiting request would start from, or None
    prefix_match: Callable[[Request], tuple[int, int] | None] = lambda _request: None
    kv_layout: KVLayout | None = None  # per-token KV cost, for the kv_memory_bytes budget

    def cached_prefix(self, request: Request) -> int:
        match = self.prefix_match(request)
        return match[1] if match else 0


def _chunk(request: Request, start: int, budget: int, config: EngineConfig, hold_last: bool = False) -> PrefillChunk | None:
    """The next chunk of `request`, or None when there is nothing to feed. With `hold_last`, the last prompt
    token is kept back: it is fed with a decode step, which a prefill-only tick does not run."""
    limit = request.prefill_len - (1 if hold_last else 0)
    end = start + min(limit - start, config.prefill_chunk, budget)
    if end <= start:
        return None
    return PrefillChunk(request.request_id, start, end, end == request.prefill_len)


class _KVTracker:
    """What the KV caches hold at the tick's peak, in tokens, bounded in bytes by the layout.

    Decoding rows hold prompt + outputs after this tick's decode; prefilling requests hold their computed
    tokens; a request whose prefill completes joins the rows, and while it joins, its own cache, the batch
    before the merge and the merge's copies are held next to that (`KVLayout.join_bytes`).
    """

    def __init__(self, layout: KVLayout, budget: int, headroom_tokens: int):
        self.layout, self.budget, self.headroom = layout, budget, headroom_tokens
        self.rows: dict[str, int] = {}
        self.prefilling: dict[str, tuple[int, int]] = {}
        self.joining: dict[str, tuple[int, int]] = {}  # joiners' own caches at the merge: (tokens, last chunk)

    def bytes(self, rows: dict[str, int] | None = None, prefilling: dict | None = None, grow: int = 0,
              joining: dict | None = None) -> int:
        rows = self.rows if rows is None else rows
        prefilling = self.prefilling if prefilling is None else prefilling
        joining = self.joining if joining is None else joining
        old_rows = [n + grow for rid, n in rows.items() if rid not in joining]
        return (self.layout.footprint([n + grow for n in rows.values()], list(prefilling.values()))
                + self.layout.join_bytes(old_rows, list(joining.values())))

    def fits(self) -> bool:
        return self.bytes() <= self.budget

    def with_chunk(self, request: Request, chunk: PrefillChunk) -> tuple[dict, dict, dict]:
        rows, prefilling, joining = dict(self.rows), dict(self.prefilling), dict(self.joining)
        if chunk.completes:
            prefilling.pop(request.request_id, None)
            rows[request.request_id] = request.prefill_len
            joining[request.request_id] = (request.prefill_len, chunk.num_tokens)
        else:
            prefilling[request.request_id] = (chunk.end, chunk.num_tokens)
        return rows, prefilling, joining

    def try_chunk(self, request: Request, chunk: PrefillChunk, admission: bool) -> bool:
        """Take the chunk if the tick's peak stays within the budget (a completing chunk: its merge
        included; if that does not fit, the request waits, holding its cache, until the rows free memory)."""
        rows, prefilling, joining = self.with_chunk(request, chunk)
        if self.bytes(rows, prefilling, joining=joining) > self.budget:
            return False
        if admission:
            # Admit only if the whole prompt fits next to every row grown by the headroom: a request that is
            # let in must not be preempted again a few ticks later (no preempt/readmit thrash). Steady state:
            # a merge's transient is checked in the tick it happens, above.
            full_rows = dict(rows)
            full_rows[request.request_id] = request.prefill_len
            full_prefilling = {k: v for k, v in prefilling.items() if k != request.request_id}
            if self.bytes(full_rows, full_prefilling, grow=self.headroom, joining={}) > self.budget:
                return False
        self.rows, self.prefilling, self.joining = rows, prefilling, joining
        return True


class _VisionBudget:
    """Images encoded per tick. A request with more images than the whole budget is encoded alone in a tick
    rather than never."""

    def __init__(self, images: int):
        self.total = self.left = images
        self.chosen: list[str] = []

    def take(self, request: Request) -> bool:
        """Whether `request`'s media is encoded this tick."""
        if request.num_images <= self.left or (not self.chosen and self.left == self.total):
            self.chosen.append(request.request_id)
            self.left -= request.num_images
            return True
        return False


class _Reasons:
    """The binding constraint per live request that got less than it could use (first noted wins, except a
    preemption, which overrides what it was waiting for)."""

    def __init__(self, config: EngineConfig, decode_rows: int):
        self.by_id: dict[str, WaitReason] = {}
        cap = config.max_prefill_tokens
        # When the tick's token budget runs out, which limit was it: the prefill cap, if it is the tighter one
        self.exhausted = (Reason.PREFILL_TOKEN_CAP
                          if cap is not None and cap < config.max_batched_tokens - decode_rows else Reason.TOKEN_BUDGET)
        self.prefill_chunk = config.prefill_chunk

    def note(self, request_id: str, reason: Reason, others: tuple[str, ...] = ()) -> None:
        if request_id not in self.by_id:
            self.by_id[request_id] = WaitReason(request_id, reason, others)

    def preempted(self, request_id: str, by: str | None) -> None:
        self.by_id[request_id] = WaitReason(request_id, Reason.PREEMPTED_BY, (by,) if by is not None else ())

    def chunk_given(self, request: Request, chunk: PrefillChunk, hold_last: bool) -> None:
        """A chunk shorter than what is left to feed was cut by prefill_chunk or by the budget."""
        self.by_id.pop(request.request_id, None)
        if chunk.end < request.prefill_len - (1 if hold_last else 0):
            self.note(request.request_id, Reason.PREFILL_CHUNK if chunk.num_tokens == self.prefill_chunk
                      else self.exhausted)

    def held_back(self, requests: Sequence[Request], reason: Reason, others: tuple[str, ...] = ()) -> None:
        for request in requests:
            self.note(request.request_id, reason, others)


def _make_room(view: SchedulerView, kv: _KVTracker) -> tuple[list[str], list[tuple[str, str]]]:
    """Preempt (newest prefilling first, then newest decoding) until the tick fits; a request that cannot
    fit even alone fails instead of deadlocking the engine."""
    preempted: list[str] = []
    failed: list[tuple[str, str]] = []
    victims = [r.request_id for r in view.decoding] + [r.request_id for r in view.prefilling]
    while not kv.fits() and victims:
        rid = victims.pop()
        alone = len(kv.rows) + len(kv.prefilling) == 1
        kv.rows.pop(rid, None)
        kv.prefilling.pop(rid, None)
        if alone:
            failed.append((rid, f"needs more KV memory than kv_memory_bytes ({kv.budget} bytes) allows"))
        else:
            preempted.append(rid)
    return preempted, failed


def plan_tick(view: SchedulerView, config: EngineConfig, policy: Policy) -> TickPlan:
    """decode-first: every decoding row decodes every tick and prefill gets the rest of the budget.
    prefill-first: while any prompt has tokens left to prefill, a tick is prefill only (decoding rows pause,
    and prompts stop one token short: that token goes with the next decode step); otherwise as decode-first."""
    if config.mix == "prefill-first":
        plan = _plan(view, config, policy, prefill_only=True)
        if plan.prefill or plan.encode or plan.admitted:
            return plan
    return _plan(view, config, policy, prefill_only=False)


def _grant_drafts(view: SchedulerView, config: EngineConfig, gone: set[str], budget: int,
                  forward_rows: int) -> list[tuple[str, int]]:
    """Draft lengths for the rows that may draft, planned as what the verify forward computes: it runs every
    row of the batched forward (`forward_rows`, drafting or not) at the width of the longest draft, so a width
    of w costs forward_rows x w tokens of `max_batched_tokens`, however few rows draft. One width for all:
    every drafting row gets up to the widest width the budget pays for (at most `draft_tokens`)."""
    width = min(config.draft_tokens, budget // forward_rows) if forward_rows else 0
    if width < 1:
        return []
    draft = []
    for request in view.decoding:
        # the verify forward emits up to k + 1 tokens: drafts never cross max_tokens or the context limit
        k = min(width, request.output_limit - request.num_output_tokens - 1)
        if request.request_id not in gone and k >= 1 and request.draft_eligible:
            draft.append((request.request_id, k))
    return draft


def _plan(view: SchedulerView, config: EngineConfig, policy: Policy, prefill_only: bool) -> TickPlan:
    kv = None
    preempted: list[str] = []
    failed: list[tuple[str, str]] = []
    if config.kv_memory_bytes is not None and view.kv_layout is not None:
        kv = _KVTracker(view.kv_layout, config.kv_memory_bytes, config.kv_headroom_tokens)
        # (+ draft_tokens: a verification holds that many extra positions until it is rolled back)
        kv.rows = {r.request_id: r.prompt_len + r.num_output_tokens + config.draft_tokens for r in view.decoding}
        kv.prefilling = {r.request_id: (r.num_computed_tokens, 0) for r in view.prefilling}
        preempted, failed = _make_room(view, kv)
    gone = set(preempted) | {rid for rid, _ in failed}

    decode = () if prefill_only else tuple(r.request_id for r in view.decoding if r.request_id not in gone)
    why = _Reasons(config, len(decode))
    if preempted:  # they made room for the oldest request that keeps its memory
        kept = [r.request_id for r in (*view.decoding, *view.prefilling) if r.request_id not in gone]
        for rid in preempted:
            why.preempted(rid, kept[0] if kept else None)
    budget = config.max_batched_tokens - len(decode)
    if config.max_prefill_tokens is not None:
        budget = min(budget, config.max_prefill_tokens)
    prefill_budget = budget
    seqs = len(view.decoding) + len(view.prefilling) + len(view.encoding) - len(gone)
    vision = _VisionBudget(config.vision_budget)
    for request in policy.order_prefilling(view.encoding, view.tick):
        why.note(request.request_id, Reason.WAITING_FOR_MEDIA if vision.take(request) else Reason.VISION_BUDGET)

    prefill: list[PrefillChunk] = []
    prefix_hits: list[tuple[str, int, int]] = []

    def next_start(request: Request) -> tuple[int, tuple[int, int] | None]:
        """Where a request's next chunk starts: after its computed tokens or, for its first chunk, after a
        prefix-cache hit (which the plan then records so the executor restores it)."""
        if request.num_computed_tokens:
            return request.num_computed_tokens, None
        match = view.prefix_match(request)
        return (match[1], match) if match else (0, None)

    for request in policy.order_prefilling(view.prefilling, view.tick):
        if request.request_id in gone:
            continue
        if budget <= 0:
            why.note(request.request_id, why.exhausted)
            continue
        start, match = next_start(request)
        chunk = _chunk(request, start, budget, config, hold_last=prefill_only)
        if chunk is None:
            continue  # nothing to feed in a prefill-only tick
        if kv is not None and not kv.try_chunk(request, chunk, admission=False):
            why.note(request.request_id, Reason.KV_BUDGET)
            continue  # waits for memory while decoding frees it
        if match is not None:
            prefix_hits.append((request.request_id, *match))
        prefill.append(chunk)
        why.chunk_given(request, chunk, prefill_only)
        budget -= chunk.num_tokens

    if kv is not None and not prefill and all(r.request_id in gone for r in view.decoding):
        # Nothing decodes and no partly prefilled prompt fits its next chunk: they hold memory waiting for each
        # other. Preempt the newest until the oldest can move (or fail it if it cannot move even alone).
        stuck = [r for r in policy.order_prefilling(view.prefilling, view.tick) if r.request_id not in gone]
        while stuck:
            head = stuck[0]
            start, match = next_start(head)
            chunk = _chunk(head, start, budget, config, hold_last=prefill_only)
            if chunk is None:  # only its last token is left: a decode tick feeds it, nothing is stuck
                break
            if kv.try_chunk(head, chunk, admission=False):
                if match is not None:
                    prefix_hits.append((head.request_id, *match))
                prefill.append(chunk)
                why.chunk_given(head, chunk, prefill_only)
                budget -= chunk.num_tokens
                break
            victim = stuck.pop()
            kv.prefilling.pop(victim.request_id, None)
            gone.add(victim.request_id)
            seqs -= 1
            if victim is head:
                why.by_id.pop(head.request_id, None)
                failed.append((head.request_id, f"needs more KV memory than kv_memory_bytes ({kv.budget} bytes) "
                                                "allows"))
            else:
                why.preempted(victim.request_id, head.request_id)
                preempted.append(victim.request_id)

    admitted: list[str] = []
    queue = policy.order_waiting(view.waiting, view.tick, view.cached_prefix)
    for position, request in enumerate(queue):
        behind = queue[position + 1:]
        if seqs >= config.max_seqs:
            why.held_back(queue[position:], Reason.MAX_SEQS)
            break
        if request.num_images:  # media first goes through vision encoding, under the vision budget
            admitted.append(request.request_id)
            why.note(request.request_id,
                     Reason.WAITING_FOR_MEDIA if vision.take(request) else Reason.VISION_BUDGET)
            seqs += 1
            continue
        if budget <= 0:
            why.held_back(queue[position:], why.exhausted)
            break
        start, match = next_start(request)
        chunk = _chunk(request, start, budget, config, hold_last=prefill_only)
        if chunk is None:  # a one-token prompt (or a whole-prompt hit) waits for a decode tick
            why.held_back(behind, Reason.POLICY_ORDER, (request.request_id,))
            break
        if kv is not None and not kv.try_chunk(request, chunk, admission=True):
            why.note(request.request_id, Reason.KV_BUDGET)  # the head of the queue waits for memory;
            why.held_back(behind, Reason.POLICY_ORDER, (request.request_id,))  # nobody jumps it
            break
        if match is not None:
            prefix_hits.append((request.request_id, *match))
        admitted.append(request.request_id)
        prefill.append(chunk)
        why.chunk_given(request, chunk, prefill_only)
        budget -= chunk.num_tokens
        seqs += 1

    draft: list[tuple[str, int]] = []
    if config.draft_tokens and not prefill_only and decode:  # speculative decoding uses what prefill left
        draft = _grant_drafts(view, config, gone, budget, len(decode) + sum(c.completes for c in prefill))
        budget -= (len(decode) + sum(c.completes for c in prefill)) * max((k for _, k in draft), default=0)

    return TickPlan(
        tick=view.tick,
        admitted=tuple(admitted),
        encode=tuple(vision.chosen),
        prefill=tuple(prefill),
        decode=decode,
        draft=tuple(draft),
        prefix_hits=tuple(prefix_hits),
        preempted=tuple(preempted),
        failed=tuple(failed),
        num_batched_tokens=len(decode) + prefill_budget - budget,
        num_seqs=seqs,
        kv_bytes_bound=kv.bytes() if kv is not None else None,
        reasons=tuple(why.by_id.values()),
    )
