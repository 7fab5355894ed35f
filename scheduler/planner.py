"""The pure planner: (view of request states, budgets, policy) -> TickPlan.

Deterministic and model-free: it reads no clock, no device and no randomness, so a recorded run replays to
the same plans. Invariants it guarantees (tests assert them on every plan):
  * every decoding request decodes one token every tick (running streams never stall);
  * prefill tokens + decode tokens <= max_batched_tokens, where a tick that verifies drafts counts what its
    forward computes: every row of the forward at the widest draft (`TickPlan.decode_tokens`);
    admitted + running <= max_seqs;
  * no chunk is longer than prefill_chunk, but a first chunk that must reach its `first_chunk_reach` in one forward
    (from position 0, and no prefix hit shorter than it is taken), which is as long as that (`chunk_cap`); such a
    request gets that chunk or none, and then holds back the prefills behind it until the budget can pay for it;
  * with kv_memory_bytes, the bound on KV bytes after the tick (caches/kv.py) stays within it: the planner
    preempts (newest first) when decoding rows outgrow it and admits only what fits with headroom.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from caches.kv import KVLayout

from .config import EngineConfig, chunk_cap
from .plan import DraftGrant, PlannedFailure, PrefillChunk, PrefixHit, Reason, TickPlan, WaitReason
from .policy import Policy
from .request import Request


def nothing_cached(_key: str) -> bool:
    """The vision cache's membership where there is none (a text model, a model-free run): it holds nothing."""
    return False


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
    # cache summary: whether the vision cache holds a media unit's rows, by its key (`Request.media_units`). A
    # unit it holds, or one another request encodes this tick, costs no vision budget: the executor does not
    # encode it again. None: every unit counts, as in engines before this rule (the replay of their traces).
    vision_cached: Callable[[str], bool] | None = nothing_cached

    def cached_prefix(self, request: Request) -> int:
        match = self.prefix_match(request)
        return match[1] if match else 0


def _chunk(request: Request, start: int, budget: int, config: EngineConfig, hold_last: bool = False) -> PrefillChunk | None:
    """The next chunk of `request`, or None when there is nothing to feed or it cannot reach the request's
    `first_chunk_reach`. With `hold_last`, the last prompt token is kept back: it is fed with a decode step, which a
    prefill-only tick does not run."""
    limit = request.prefill_len - (1 if hold_last else 0)
    end = start + min(limit - start, chunk_cap(config.prefill_chunk, request.first_chunk_reach, start), budget)
    if end <= start or end < request.first_chunk_reach:  # (such a first chunk is not cut: it waits)
        return None
    return PrefillChunk(request.request_id, start, end, end == request.prefill_len)


class _KVTracker:
    """What the KV caches will hold after this tick, in tokens, bounded in bytes by the layout.

    Decoding rows hold prompt + outputs after this tick's decode; prefilling requests hold their computed
    tokens; a request whose prefill completes joins the rows.
    """

    def __init__(self, layout: KVLayout, budget: int, headroom_tokens: int, max_chunk: int):
        self.layout, self.budget, self.headroom = layout, budget, headroom_tokens
        self.max_chunk = max_chunk  # prefill_chunk: the largest chunk a prompt's prefill peak is asked for
        self.rows: dict[str, int] = {}
        self.prefilling: dict[str, tuple[int, int]] = {}
        # Admitted media requests not prefilling yet (encoding, or admitted this tick): they hold no KV after
        # this tick, but their whole prompts are reserved in every admission check, so what is let in behind
        # them cannot take the memory they are about to prefill into.
        self.pending: dict[str, int] = {}
        # The whole prompt of every request that is prefilling (or starts to this tick): an admission check
        # counts each at its full size, not at the chunks it has so far, so a request let in behind a long
        # prompt cannot take the memory that prompt's later chunks need (it would then wait behind the newer
        # request, or be preempted for it).
        self.prompts: dict[str, int] = {}

    def bytes(self, rows: dict[str, int] | None = None, prefilling: dict | None = None, grow: int = 0) -> int:
        rows = self.rows if rows is None else rows
        prefilling = self.prefilling if prefilling is None else prefilling
        return self.layout.footprint([n + grow for n in rows.values()], list(prefilling.values()))

    def fits(self) -> bool:
        return self.bytes() <= self.budget

    def with_chunk(self, request: Request, chunk: PrefillChunk) -> tuple[dict, dict]:
        rows, prefilling = dict(self.rows), dict(self.prefilling)
        if chunk.completes:
            prefilling.pop(request.request_id, None)
            rows[request.request_id] = request.prefill_len
        else:
            prefilling[request.request_id] = (chunk.end, chunk.num_tokens)
        return rows, prefilling

    def try_chunk(self, request: Request, chunk: PrefillChunk, admission: bool) -> bool:
        rows, prefilling = self.with_chunk(request, chunk)
        if admission:
            fits = self.admits(request, rows, prefilling) and self.prefill_peak_fits(request, rows, prefilling)
        else:
            fits = self.bytes(rows, prefilling) <= self.budget
        if not fits:
            return False
        self.rows, self.prefilling = rows, prefilling
        self.prompts[request.request_id] = request.prefill_len
        return True

    def try_admit_media(self, request: Request) -> bool:
        """A media request is admitted to encoding under the same rule as a text request's admission (it
        holds no KV until its first chunk, next tick at the earliest), its prefill peak asked for its largest
        chunk; once admitted its prompt is reserved."""
        if not (self.admits(request, self.rows, self.prefilling)
                and self.prefill_peak_fits(request, self.rows, self.prefilling)):
            return False
        self.pending[request.request_id] = request.prefill_len
        return True

    def admits(self, request: Request, rows: dict[str, int], prefilling: dict) -> bool:
        """Admit only if the whole prompt fits next to every row grown by the headroom, the prompts reserved
        for admitted media and the whole prompts of the requests already prefilling: a request that is let in
        must not be preempted again a few ticks later, nor make an older one wait or be preempted (no
        preempt/readmit thrash)."""
        full_rows = {**rows, **self.pending, **self.whole_prompts(prefilling, but=request),
                     request.request_id: request.prefill_len}
        return self.bytes(full_rows, {}, grow=self.headroom) <= self.budget

    def whole_prompts(self, prefilling: dict, but: Request) -> dict[str, int]:
        """The requests prefilling other than `but`, each at its whole prompt (as the batch row it becomes)."""
        return {rid: self.prompts[rid] for rid in prefilling if rid != but.request_id}

    def prefill_peak_fits(self, request: Request, rows: dict[str, int], prefilling: dict) -> bool:
        """A prompt's own cache can hold more while it prefills than its row will: a sliding window's holds the
        window and the chunk being fed, and under kv_bits a prompt stays in float storage until its conversion
        point. Admit only if this tick's state fits, and the prompt's prefill peak (all but its last token, after
        its largest chunk: what `KVLayout.admit_alone_bytes` asks on arrival, so what fits alone is admitted
        alone) fits next to the rows and whole prompts grown by the headroom. (For plain layers the row check,
        `admits`, is the stricter one.)"""
        full_rows = {k: v for k, v in {**rows, **self.pending, **self.whole_prompts(prefilling, but=request)}.items()
                     if k != request.request_id}
        peak = max(request.prefill_len - 1, 1)
        full_prefilling = {request.request_id: (peak, min(chunk_cap(self.max_chunk, request.first_chunk_reach, 0),
                                                          peak))}
        return (self.bytes(full_rows, full_prefilling, grow=self.headroom) <= self.budget
                and self.bytes(rows, prefilling) <= self.budget)


class _VisionBudget:
    """Media encoded per tick: items (`vision_budget`) and media tokens (`vision_token_budget`, None: no token
    bound). A request pays for the units the encoders will run on for it: not those in the vision cache, nor
    those an earlier request of the tick pays for (`SchedulerView.vision_cached`). A request over either whole
    budget is encoded alone (the only encoder work of its tick) rather than never; one with nothing to encode
    is always taken."""

    def __init__(self, items: int, tokens: int | None, cached: Callable[[str], bool] | None):
        self.items_left = items
        self.tokens_left = tokens
        self.cached = cached
        self.paid: set[str] = set()  # unit keys the encoders run on this tick
        self.spent = False  # whether any encoder work is taken this tick
        self.chosen: list[str] = []

    def _cost(self, request: Request) -> tuple[int, int, set[str]]:
        """(media items, media tokens, unit keys) that encoding `request` this tick adds."""
        if self.cached is None:
            return request.num_images, request.num_media_tokens, set()
        items = tokens = 0
        keys: set[str] = set()
        for key, count, unit_tokens in request.media_units():
            if key is not None and (key in self.paid or key in keys or self.cached(key)):
                continue
            items, tokens = items + count, tokens + unit_tokens
            if key is not None:
                keys.add(key)
        return items, tokens, keys

    def take(self, request: Request) -> bool:
        """Whether `request`'s media is encoded this tick."""
        items, tokens, keys = self._cost(request)
        if items or tokens:
            fits = items <= self.items_left and (self.tokens_left is None or tokens <= self.tokens_left)
            if not fits and self.spent:
                return False
            self.spent = True
            self.items_left -= items
            if self.tokens_left is not None:
                self.tokens_left -= tokens
        self.paid |= keys
        self.chosen.append(request.request_id)
        return True


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
            cap = chunk_cap(self.prefill_chunk, request.first_chunk_reach, chunk.start)
            self.note(request.request_id, Reason.PREFILL_CHUNK if chunk.num_tokens == cap else self.exhausted)

    def held_back(self, requests: Sequence[Request], reason: Reason, others: tuple[str, ...] = ()) -> None:
        for request in requests:
            self.note(request.request_id, reason, others)


def plan_tick(view: SchedulerView, config: EngineConfig, policy: Policy) -> TickPlan:
    """decode-first: every decoding row decodes every tick and prefill gets the rest of the budget.
    prefill-first: while any prompt has tokens left to prefill, a tick is prefill only (decoding rows pause,
    and prompts stop one token short: that token goes with the next decode step); otherwise as decode-first.
    Only prefill chunks make a tick prefill only: media encoding (and admitting media to it) runs next to the
    decoding rows, or a tick that only encodes would pause them for nothing (and, when those admissions are
    preempted again next tick, for ever)."""
    if config.mix == "prefill-first":
        plan = _plan(view, config, policy, prefill_only=True)
        if plan.prefill:
            return plan
    return _plan(view, config, policy, prefill_only=False)


def _plan(view: SchedulerView, config: EngineConfig, policy: Policy, prefill_only: bool) -> TickPlan:
    """One tick's plan, phase by phase; each phase spends what the ones before it left."""
    tick = _TickBuilder(view, config, policy, prefill_only)
    tick.make_room()
    tick.pick_media()
    tick.continue_prefills()
    tick.unstick()
    tick.admit()
    tick.grant_drafts()
    return tick.build()


class _TickBuilder:
    """The plan being built: the work granted so far and the budgets left (tokens, sequences, KV, images).
    A prefill chunk is only ever given through `grant`, whichever phase gives it."""

    def __init__(self, view: SchedulerView, config: EngineConfig, policy: Policy, prefill_only: bool):
        self.view, self.config, self.policy, self.prefill_only = view, config, policy, prefill_only
        self.kv: _KVTracker | None = None
        self.preempted: list[str] = []
        self.failed: list[PlannedFailure] = []
        self.gone: set[str] = set()  # preempted or failed this tick
        self.decode: tuple[str, ...] = ()
        self.why: _Reasons
        self.budget = 0  # prefill tokens left this tick
        self.prefill_budget = 0  # what prefill started with (max_prefill_tokens caps it)
        self.tick_budget = 0  # max_batched_tokens after decode: prefill and then drafts draw from it
        self.draft_budget_used = 0
        self.seqs = 0  # sequences holding a slot
        self.vision = _VisionBudget(config.vision_budget, config.vision_token_budget, view.vision_cached)
        self.prefill: list[PrefillChunk] = []
        self.prefix_hits: list[PrefixHit] = []
        self.admitted: list[str] = []
        self.draft: list[DraftGrant] = []
        # a request whose first chunk must reach further than the budget left (`Request.first_chunk_reach`): the
        # prefills behind it wait too, so the budget it needs frees up (nobody jumps it)
        self.held_by: str | None = None

    # ---- phases, in order -------------------------------------------------------------------------
    def make_room(self) -> None:
        """Under kv_memory_bytes: preempt (newest prefilling first, then newest decoding) until the tick fits;
        a request that cannot fit even alone fails instead of deadlocking the engine. Then the decode rows and
        the token and sequence budgets are what the survivors leave."""
        view, config = self.view, self.config
        if config.kv_memory_bytes is not None and view.kv_layout is not None:
            kv = self.kv = _KVTracker(view.kv_layout, config.kv_memory_bytes, config.kv_headroom_tokens,
                                      config.prefill_chunk)
            # (+ draft_tokens: a verification holds that many extra positions until it is rolled back)
            kv.rows = {r.request_id: r.prompt_len + r.num_output_tokens + config.draft_tokens for r in view.decoding}
            kv.prefilling = {r.request_id: (r.num_computed_tokens, 0) for r in view.prefilling}
            kv.prompts = {r.request_id: r.prefill_len for r in view.prefilling}
            kv.pending = {r.request_id: r.prefill_len for r in view.encoding}
            victims = [r.request_id for r in view.decoding] + [r.request_id for r in view.prefilling]
            while not kv.fits() and victims:
                rid = victims.pop()
                alone = len(kv.rows) + len(kv.prefilling) == 1
                kv.rows.pop(rid, None)
                kv.prefilling.pop(rid, None)
                if alone:
                    self.failed.append(PlannedFailure(rid, _needs_more_kv(kv)))
                else:
                    self.preempted.append(rid)
        gone = self.gone = set(self.preempted) | {rid for rid, _ in self.failed}
        self.decode = () if self.prefill_only else tuple(r.request_id for r in view.decoding
                                                         if r.request_id not in gone)
        self.why = _Reasons(config, len(self.decode))
        if self.prefill_only:  # (this plan is used only if it prefills: then every running row pauses)
            self.why.held_back([r for r in view.decoding if r.request_id not in gone], Reason.PREFILL_FIRST)
        if self.preempted:  # they made room for the oldest request that keeps its memory
            kept = [r.request_id for r in (*view.decoding, *view.prefilling) if r.request_id not in gone]
            for rid in self.preempted:
                self.why.preempted(rid, kept[0] if kept else None)
        budget = self.tick_budget = config.max_batched_tokens - len(self.decode)
        if config.max_prefill_tokens is not None:
            budget = min(budget, config.max_prefill_tokens)
        self.budget = self.prefill_budget = budget
        self.seqs = len(view.decoding) + len(view.prefilling) + len(view.encoding) - len(gone)

    def pick_media(self) -> None:
        """Admitted media requests not encoded yet take the vision budget in policy order."""
        for request in self.policy.order_prefilling(self.view.encoding, self.view.tick):
            self._note_media(request)

    def continue_prefills(self) -> None:
        """Requests already prefilling get their next chunk, in policy order, while the budget lasts."""
        why = self.why
        for request in self.policy.order_prefilling(self.view.prefilling, self.view.tick):
            if request.request_id in self.gone:
                continue
            if self.held_by is not None:
                why.note(request.request_id, Reason.POLICY_ORDER, (self.held_by,))
                continue
            if self.budget <= 0:
                why.note(request.request_id, why.exhausted)
                continue
            offer = self._offer(request)
            if offer is None:  # nothing to feed in a prefill-only tick, or a first chunk the budget left cannot pay
                if self._first_chunk_waits(request):
                    why.note(request.request_id, why.exhausted)
                    self.held_by = request.request_id
                continue
            if self.kv is not None and not self.kv.try_chunk(request, offer[0], admission=False):
                why.note(request.request_id, Reason.KV_BUDGET)
                continue  # waits for memory while decoding frees it
            self.grant(request, *offer)

    def unstick(self) -> None:
        """Nothing decodes and no partly prefilled prompt fits its next chunk: they hold memory waiting for each
        other. Preempt the newest until the oldest can move (or fail it if it cannot move even alone)."""
        kv = self.kv
        if kv is None or self.prefill or not all(r.request_id in self.gone for r in self.view.decoding):
            return
        stuck = [r for r in self.policy.order_prefilling(self.view.prefilling, self.view.tick)
                 if r.request_id not in self.gone]
        while stuck:
            head = stuck[0]
            offer = self._offer(head)
            if offer is None:  # only its last token is left: a decode tick feeds it, nothing is stuck
                break
            if kv.try_chunk(head, offer[0], admission=False):
                self.grant(head, *offer)
                break
            victim = stuck.pop()
            kv.prefilling.pop(victim.request_id, None)
            self.gone.add(victim.request_id)
            self.seqs -= 1
            if victim is head:
                self.why.by_id.pop(head.request_id, None)
                self.failed.append(PlannedFailure(head.request_id, _needs_more_kv(kv)))
            else:
                self.why.preempted(victim.request_id, head.request_id)
                self.preempted.append(victim.request_id)

    def admit(self) -> None:
        """Waiting requests, in policy order, while a slot and the budgets last; the head of the queue that
        cannot start holds back everyone behind it (nobody jumps it)."""
        why, config = self.why, self.config
        queue = self.policy.order_waiting(self.view.waiting, self.view.tick, self.view.cached_prefix)
        for position, request in enumerate(queue):
            behind = queue[position + 1:]
            if self.seqs >= config.max_seqs:
                why.held_back(queue[position:], Reason.MAX_SEQS)
                break
            if request.num_images:  # media first goes through vision encoding, under the vision budget
                if self.kv is not None and not self.kv.try_admit_media(request):
                    self._hold_for_kv(request, behind)
                    break
                self.admitted.append(request.request_id)
                self._note_media(request)
                self.seqs += 1
                continue
            if self.held_by is not None:
                why.held_back(queue[position:], Reason.POLICY_ORDER, (self.held_by,))
                break
            if self.budget <= 0:
                why.held_back(queue[position:], why.exhausted)
                break
            offer = self._offer(request)
            if offer is None:  # a one-token prompt (or a whole-prompt hit) waits for a decode tick
                why.held_back(behind, Reason.POLICY_ORDER, (request.request_id,))
                break
            if self.kv is not None and not self.kv.try_chunk(request, offer[0], admission=True):
                self._hold_for_kv(request, behind)
                break
            self.admitted.append(request.request_id)
            self.grant(request, *offer)
            self.seqs += 1

    def grant_drafts(self) -> None:
        """Speculative decoding uses what prefill left of `max_batched_tokens` (`max_prefill_tokens` caps prefill
        only: drafts are decoding work). Draft lengths are planned as what the verify forward
        computes: it runs every row of the batched forward (drafting or not) at the width of the longest
        draft, so a width of w costs forward_rows x w tokens of `max_batched_tokens`, however few rows draft.
        One width for all: every drafting row gets up to the widest width the budget pays for (at most
        `draft_tokens`)."""
        config = self.config
        if not (config.draft_tokens and not self.prefill_only and self.decode):
            return
        forward_rows = len(self.decode) + sum(c.completes for c in self.prefill)
        left = self.tick_budget - (self.prefill_budget - self.budget)
        width = min(config.draft_tokens, left // forward_rows) if forward_rows else 0
        for request in self.view.decoding:
            if request.request_id in self.gone:
                continue
            if not request.draft_eligible:
                self.why.note(request.request_id, Reason.DRAFT_INELIGIBLE)
                continue
            if request.before_min_tokens:
                self.why.note(request.request_id, Reason.DRAFT_MIN_TOKENS)
                continue
            # the verify forward emits up to k + 1 tokens: drafts never cross max_tokens or the context limit
            usable = min(config.draft_tokens, request.output_limit - request.num_output_tokens - 1)
            k = min(width, usable)
            if k < usable:  # (a row near its end that drafts all it can use got all it could use)
                self.why.note(request.request_id, Reason.DRAFT_BUDGET)
            if k >= 1:
                self.draft.append(DraftGrant(request.request_id, k))
        self.draft_budget_used = forward_rows * max((k for _, k in self.draft), default=0)

    def build(self) -> TickPlan:
        return TickPlan(
            tick=self.view.tick,
            admitted=tuple(self.admitted),
            encode=tuple(self.vision.chosen),
            prefill=tuple(self.prefill),
            decode=self.decode,
            draft=tuple(self.draft),
            prefix_hits=tuple(self.prefix_hits),
            preempted=tuple(self.preempted),
            failed=tuple(self.failed),
            num_batched_tokens=len(self.decode) + self.prefill_budget - self.budget + self.draft_budget_used,
            num_seqs=self.seqs,
            kv_bytes_bound=self.kv.bytes() if self.kv is not None else None,
            reasons=tuple(self.why.by_id.values()),
        )

    # ---- the one way work is given ------------------------------------------------------------------
    def _offer(self, request: Request) -> tuple[PrefillChunk, tuple[int, int] | None] | None:
        """The chunk `request` would get next, with the prefix-cache hit it starts from (first chunk only), or
        None when there is nothing to feed or its first chunk must reach further than the budget left pays for
        (`_first_chunk_waits`). It starts after the computed tokens or, for a first chunk, after
        the hit (which the plan then records so the executor restores it)."""
        start, match = self._start(request)
        chunk = _chunk(request, start, self.budget, self.config, hold_last=self.prefill_only)
        return None if chunk is None else (chunk, match)

    def _start(self, request: Request) -> tuple[int, tuple[int, int] | None]:
        """Where its next chunk starts, with the prefix-cache hit it starts from (first chunk only)."""
        if request.num_computed_tokens:
            return request.num_computed_tokens, None
        match = self.view.prefix_match(request)
        if match is not None and match[1] < request.first_chunk_reach:
            match = None  # its first chunk would start past 0, short of where it must start
        return (match[1], match) if match else (0, None)

    def _first_chunk_waits(self, request: Request) -> bool:
        """Given no chunk: it is because its first chunk must reach `first_chunk_reach` and the budget left pays
        for less (not because nothing is left to feed)."""
        return request.first_chunk_reach > 0 and self._start(request)[0] < request.first_chunk_reach

    def grant(self, request: Request, chunk: PrefillChunk, match: tuple[int, int] | None) -> None:
        """Give `request` its chunk: the plan records the prefix hit it starts from, the budget pays for it."""
        if match is not None:
            self.prefix_hits.append(PrefixHit(request.request_id, *match))
        self.prefill.append(chunk)
        self.why.chunk_given(request, chunk, self.prefill_only)
        self.budget -= chunk.num_tokens

    def _hold_for_kv(self, request: Request, behind: Sequence[Request]) -> None:
        """The head of the queue waits for memory; nobody jumps it."""
        self.why.note(request.request_id, Reason.KV_BUDGET)
        self.why.held_back(behind, Reason.POLICY_ORDER, (request.request_id,))

    def _note_media(self, request: Request) -> None:
        self.why.note(request.request_id,
                      Reason.WAITING_FOR_MEDIA if self.vision.take(request) else Reason.VISION_BUDGET)


def _needs_more_kv(kv: _KVTracker) -> str:
    return f"needs more KV memory than kv_memory_bytes ({kv.budget} bytes) allows"
