"""Drafters for speculative decoding: who proposes the k tokens the target verifies.

A drafter sees, per row, the request's full token history (prompt + output so far; the last token is the
one the target is fed next) and proposes up to ``k`` tokens. Acceptance is ``kernels/speculative.py``;
the target's KV rollback is ``kernels.speculative.rollback_rows``.

* :class:`PromptLookupDrafter` -- no model: match the last n tokens against the request's own history and
  propose what followed the most recent earlier occurrence; with ``LookupScope.BATCH`` (the engine's default)
  a longer match in another live request's history is taken where the row's own is shorter. Deterministic, so
  ``Draft.logprobs`` is ``None`` (``q`` one-hot on the draft: a sampled row verifies it with
  ``kernels.speculative.sampled_accept``, and keeps the tokens it draws without drafts).
* :class:`DraftModelDrafter` -- a smaller mlx-lm model with the target's vocabulary. One left-padded batch
  cache (mlx-lm ``BatchKVCache``) for all its rows, so drafting k tokens for B rows is k batched forwards,
  not k x B. The cache is kept in sync with the *history passed to* :meth:`propose` (longest common prefix
  with what the cache holds, per row, then one per-row rollback), so correctness never depends on
  :meth:`accept` being called: a tick without drafting, a partial acceptance or a preemption all resync.

**Adaptive draft length** (:class:`AdaptivePace`, on by default in both drafters): each row's k follows its
recent acceptance (a fully accepted draft lets the next one grow by one, a wholly rejected one halves it),
and a row whose drafts are rejected ``patience`` times in a row pauses: it drafts nothing
until its history has grown by a back-off (doubling per further miss) or, for prompt lookup, until a match
of the longest n-gram appears at a new distance (a different earlier occurrence: the context changed). A
paused row costs nothing: a tick where no row drafts is a plain one-token decode step. That is what keeps
drafting within a few percent of plain decoding where drafts are not accepted.

Protocol::

    drafts = drafter.propose([DraftRequest(rid, tokens, ...), ...], k)   # one Draft per row, same order
    ... verify, accept ...
    drafter.accept(rid, num_accepted, emitted)                          # bookkeeping (stats)
    drafter.release([rid, ...])                                          # request ended / preempted
    drafter.stats()
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from itertools import repeat
from typing import Any, Hashable, Iterable, Optional, Protocol, Sequence

import mlx.core as mx

from kernels.sampling import RowSampling, SamplingArrays
from kernels.speculative import draft_uniforms, processed_logprobs, rollback_rows

from scheduler.execution import library

__all__ = [
    "AdaptivePace",
    "Draft",
    "DraftRequest",
    "Drafter",
    "DraftModelDrafter",
    "LookupScope",
    "PromptLookupDrafter",
]


@dataclass(frozen=True)
class DraftRequest:
    """One row to draft for.

    tokens: the request's whole history, prompt + output so far (any sequence of ints supporting ``len`` and
    slicing; drafters read only its tail after the first call). Its last token is the one the target is fed
    next (the last sampled token, or the last prompt token), so it must not be empty.
    max_tokens: cap on this row's draft (e.g. the remaining output budget), ``None`` = ``k``.
    sampling / step: for a sampling draft model only: the row's parameters (q is processed with them, the
    draw uses ``sampling.seed``) and the output index of the first drafted token (the row's output count).
    """

    request_id: str
    tokens: Sequence[int]
    max_tokens: Optional[int] = None
    sampling: Optional[RowSampling] = None
    step: int = 0
    hidden: Optional[mx.array] = None  # (H,) the target's last hidden state for this row, for drafters that ask


@dataclass(frozen=True)
class Draft:
    """A proposal: ``tokens`` (0..k ids) and ``logprobs`` = the distribution they were drawn from,
    ``(len(tokens), V)`` float32 log-probs, or ``None`` when the drafter is deterministic (q one-hot).

    ``rides_along``: the draft of a row its pacing has paused (``AdaptivePace(cap_k=False)``, under the draft
    gate): verified, cut to the tick's width, only when other rows' drafts make the tick verify anyway (its
    positions are computed either way), never a reason to verify or widen."""

    request_id: str
    tokens: list[int]
    logprobs: Optional[mx.array] = None
    rides_along: bool = False


class Drafter(Protocol):
    def propose(self, rows: Sequence[DraftRequest], k: int) -> list[Draft]: ...

    def accept(self, request_id: str, num_accepted: int, emitted: Sequence[int] = ()) -> None: ...

    def release(self, request_ids: Iterable[str]) -> None: ...

    def stats(self) -> dict[str, Any]: ...


class _Stats:
    """Proposal/acceptance counters shared by both drafters."""

    def __init__(self) -> None:
        self.calls = 0
        self.rows = 0  # rows asked for a draft
        self.rows_with_draft = 0
        self.proposed = 0  # tokens proposed
        self.verified = 0  # proposed tokens whose verification was reported through accept()
        self.accepted = 0
        self.last: dict[str, int] = {}  # request id -> length of its latest draft

    def record(self, drafts: Sequence[Draft]) -> None:
        self.calls += 1
        for d in drafts:
            self.rows += 1
            self.rows_with_draft += bool(d.tokens)
            self.proposed += len(d.tokens)
            self.last[d.request_id] = len(d.tokens)

    def accept(self, request_id: str, num_accepted: int) -> None:
        drafted = self.last.pop(request_id, None)
        if drafted is None:
            return  # nothing proposed since the last accept: nothing to score
        if not 0 <= num_accepted <= drafted:
            raise ValueError(f"{request_id}: accepted {num_accepted} of a {drafted}-token draft")
        self.verified += drafted
        self.accepted += num_accepted

    def as_dict(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "rows": self.rows,
            "rows_with_draft": self.rows_with_draft,
            "proposed_tokens": self.proposed,
            "verified_tokens": self.verified,
            "accepted_tokens": self.accepted,
            "acceptance_rate": self.accepted / self.verified if self.verified else None,
        }


@dataclass
class _Pace:
    """One row's drafting pace (see :class:`AdaptivePace`)."""

    k: int = 1 << 30  # cap on the next draft's length (none until a draft was partly rejected)
    misses: int = 0  # consecutive verified drafts with nothing accepted
    paused_until: int = 0  # history length from which a paused row drafts again (0: not paused)
    paused_distance: Hashable = 0  # prompt lookup: the match source its last rejected draft came from
    drafted: int = 0  # length of the draft awaiting its accept() (0: none)
    distance: Hashable = 0  # the match source of that draft (NgramIndex.match's distance, or a shared match's)


class AdaptivePace:
    """Per-row draft length that follows acceptance, and pauses for rows whose drafts are rejected.

    * k: no cap at first (the caller's k). After a verification with ``a`` of ``d`` drafted tokens accepted:
      ``a == d`` sets the cap to ``d + 1`` (up to the caller's k), ``a == 0`` halves it (at least 1), a partial
      acceptance keeps it. Measured on the trained tiny model (bench/README.md): capping at ``a + 1`` after a
      partial acceptance lost more tokens per verify forward than the shorter verify saved.
    * pause: ``patience`` consecutive drafts with nothing accepted pause the row for ``backoff`` tokens of
      history growth, doubling with each further miss up to ``max_backoff``. A prompt-lookup match of length
      ``resume_ngram`` (or more) at a distance other than the one that failed ends the pause early: a new
      earlier occurrence is new context. An accepted token resets the misses.

    ``cap_k=False`` keeps the pauses only: every row that is not paused may propose the caller's k, and a
    paused one proposes a draft that rides along (``Draft.rides_along``). For a drafter whose proposals cost
    nothing (prompt lookup) under the tick-level draft gate (`scheduler/execution/draft_gate.py`), which cuts
    every draft to the width it chose for the batch: a per-row cap would only shorten drafts inside positions
    the tick computes anyway, and a paused row's draft is verified only where those positions are computed
    anyway. A riding draft with a token accepted ends the pause; one with none extends it.

    Pure bookkeeping (no MLX): tested on its own in tests/execution/test_drafters.py.
    """

    def __init__(self, patience: int = 2, backoff: int = 4, max_backoff: int = 64, resume_ngram: int | None = None,
                 cap_k: bool = True):
        if patience < 1 or backoff < 1 or max_backoff < backoff:
            raise ValueError(f"need patience >= 1, 1 <= backoff <= max_backoff, got {patience}, {backoff}, "
                             f"{max_backoff}")
        self.patience, self.backoff, self.max_backoff = patience, backoff, max_backoff
        self.resume_ngram = resume_ngram
        self.cap_k = cap_k
        self._rows: dict[str, _Pace] = {}
        self.paused_proposals = 0  # proposals withheld because the row was paused
        self.pauses = 0
        self.early_resumes = 0

    def limit(self, request_id: str, k: int, history_len: int, ngram: int = 0, distance: Hashable = 0) -> int:
        """The draft length this row may propose now (0: paused). ``ngram`` / ``distance``: the prompt-lookup
        match this draft would come from (its length, and its source: how far back in the row's own history,
        or ``(request id, offset)`` in another request's, the offset between the row's last position and the
        source's), 0 if unknown. Only equality of sources is read: the same copy continued keeps its source."""
        pace = self._rows.get(request_id)
        if pace is None:
            pace = self._rows[request_id] = _Pace()
        if pace.paused_until:
            new_context = (self.resume_ngram is not None and ngram >= self.resume_ngram
                           and distance != pace.paused_distance)
            if history_len < pace.paused_until and not new_context:
                self.paused_proposals += 1
                return 0
            self.early_resumes += history_len < pace.paused_until
            pace.paused_until = 0
        return min(k, pace.k) if self.cap_k else k

    def drafted(self, request_id: str, n: int, distance: Hashable = 0) -> None:
        """Record the length (and match distance) of the draft just proposed."""
        pace = self._rows.get(request_id)
        if pace is not None:
            pace.drafted, pace.distance = n, distance

    def update(self, request_id: str, accepted: int, k: int, history_len: int) -> None:
        """A verification of the row's last draft: ``accepted`` of its tokens were accepted."""
        pace = self._rows.get(request_id)
        if pace is None or not pace.drafted:
            return
        drafted, pace.drafted = pace.drafted, 0
        if accepted >= drafted:
            pace.k = min(k, drafted + 1)
        elif not accepted:
            pace.k = max(1, drafted // 2)
        if accepted:
            pace.misses = pace.paused_until = 0  # a riding draft that paid ends its row's pause
            return
        pace.misses += 1
        if pace.misses >= self.patience:
            self.pauses += not pace.paused_until
            wait = min(self.max_backoff, self.backoff << (pace.misses - self.patience))
            pace.paused_until = history_len + wait
            pace.paused_distance = pace.distance

    def release(self, request_id: str) -> None:
        self._rows.pop(request_id, None)

    def stats(self) -> dict[str, int]:
        return {"pauses": self.pauses, "paused_proposals": self.paused_proposals,
                "early_resumes": self.early_resumes,
                "paused_rows": sum(1 for p in self._rows.values() if p.paused_until)}


def _row_k(row: DraftRequest, k: int) -> int:
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if len(row.tokens) == 0:
        raise ValueError(f"{row.request_id}: empty token history")
    return k if row.max_tokens is None else max(0, min(k, int(row.max_tokens)))


def _unique(rows: Sequence[DraftRequest]) -> None:
    ids = [r.request_id for r in rows]
    if len(set(ids)) != len(ids):
        raise ValueError("duplicate request ids in one propose call")


# ---------------------------------------------------------------------------
# Prompt lookup
# ---------------------------------------------------------------------------


def _ngrams_ending(tokens: Sequence[int], ends: range, sizes: Iterable[int]
                   ) -> Iterable[tuple[int, Iterable[tuple[int, ...]], range]]:
    """Per size n: (n, the n-grams of ``tokens`` ending at the positions of ``ends`` where one fits, those
    positions), the n-grams in position order. Built from slices with ``zip`` (no Python loop per position: a
    50,000-token prompt is indexed at every admission)."""
    for n in sizes:
        first = max(ends.start, n - 1)
        if first < ends.stop:
            yield n, zip(*(tokens[first + 1 - n + j: ends.stop + 1 - n + j] for j in range(n))), range(first, ends.stop)


class NgramIndex:
    """The n-grams of one token history: ``maps[n][ngram] = e``, the end position of its most recent
    occurrence among those with a following token (``e <= len - 2``). Updated incrementally: appending t
    tokens costs t x (ngram_max - ngram_min + 1) dict writes, whatever the history length."""

    __slots__ = ("ngram_min", "ngram_max", "tokens", "maps", "_indexed")

    def __init__(self, ngram_min: int, ngram_max: int, tokens: Sequence[int] = ()):
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.tokens: list[int] = []
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(ngram_min, ngram_max + 1)}
        self._indexed = 0  # n-grams ending at positions < _indexed are in maps
        self.extend(tokens)

    def extend(self, new_tokens: Sequence[int]) -> range:
        """Append ``new_tokens``; returns the end positions of the n-grams this indexed."""
        toks = self.tokens
        toks.extend(int(t) for t in new_tokens)
        last = len(toks) - 1  # the n-gram ending at the last position has no follower yet
        added = range(self._indexed, last)
        for n, keys, ends in _ngrams_ending(toks, added, self.maps):
            self.maps[n].update(zip(keys, ends))  # in position order: the most recent occurrence wins
        self._indexed = max(self._indexed, last)
        return added

    @property
    def indexed(self) -> range:
        """The end positions of every indexed n-gram."""
        return range(self._indexed)

    def lookup(self, k: int) -> tuple[list[int], int]:
        """Up to k tokens following the most recent earlier occurrence of the longest matching suffix
        n-gram (n from ngram_max down to ngram_min), and the n that matched (0: no match). A match close to
        the end continues periodically (the proposal itself extends the history), so ``a b a b`` proposes
        ``a b a ...``."""
        out, n, _ = self.match(k)
        return out, n

    def match(self, k: int) -> tuple[list[int], int, int]:
        """:meth:`lookup` plus the match's distance: how many positions back its source occurrence ends
        (``len - 1 - e``; the same copy continued keeps its distance, a new occurrence has another)."""
        toks = self.tokens
        L = len(toks)
        if k <= 0:
            return [], 0, 0
        for n in range(self.ngram_max, self.ngram_min - 1, -1):
            if L < n + 1:
                continue
            e = self.maps[n].get(tuple(toks[L - n :]))
            if e is None:
                continue
            out: list[int] = []
            for i in range(k):
                j = e + 1 + i
                out.append(toks[j] if j < L else out[j - L])
            return out, n, L - 1 - e
        return [], 0, 0


class LookupScope(str, Enum):
    """Whose histories prompt lookup drafts from."""

    REQUEST = "request"  # each request's own history only
    # its own history first; another live request's history where that holds a longer match (the same
    # template, schema or code a batch shares). Greedy and seeded sampled output are unchanged; what one
    # request's context can reveal of another's is the acceptance, hence the speed, of its drafts
    BATCH = "batch"
    # BATCH, and the histories of the requests that finished most recently, up to a token budget (requests
    # one after another that share a template: an agent's tool calls, a client's JSON answers)
    RECENT = "recent"


class SharedNgrams:
    """The n-grams of several requests' histories: ``find`` gives, for a suffix, the request that indexed it
    most recently and where. Each request's entries are added as its index grows and removed with the index
    (``drop``), so every entry points into a history the drafter holds (a live request's, or a pooled finished
    one's). One holder per n-gram, the latest: the drafter asks only for n-grams longer than the asking row's
    own match, which its own history does not hold, so the holder is another request; dropping a request loses
    the older holders of its n-grams (a 32768-token history of distinct n-grams: 11 MiB for the row's own
    index, 10.5 MiB here, where keeping every holder took 25 MiB)."""

    def __init__(self, ngram_min: int, ngram_max: int):
        # n -> n-gram -> (request id, end position) of its latest holder
        self.maps: dict[int, dict[tuple[int, ...], tuple[str, int]]] = {
            n: {} for n in range(ngram_min, ngram_max + 1)}

    def add(self, request_id: str, index: NgramIndex, ends: range) -> None:
        for n, keys, at in _ngrams_ending(index.tokens, ends, self.maps):
            self.maps[n].update(zip(keys, zip(repeat(request_id), at)))

    def drop(self, request_id: str, index: NgramIndex) -> None:
        for n, keys, _ in _ngrams_ending(index.tokens, index.indexed, self.maps):
            table = self.maps[n]
            for key in keys:
                holder = table.get(key)
                if holder is not None and holder[0] == request_id:
                    del table[key]

    def find(self, suffix: Sequence[int], request_id: str) -> tuple[str, int] | None:
        """(request id, end position) of the latest holder of ``suffix`` if that is not ``request_id``."""
        holder = self.maps[len(suffix)].get(tuple(suffix))
        return holder if holder is not None and holder[0] != request_id else None


class PromptLookupDrafter:
    """Prompt-lookup (n-gram) drafting; no model, q one-hot.

    One :class:`NgramIndex` per request, updated with the tokens that arrived since the last call (the new
    tail of ``DraftRequest.tokens``); if the history no longer extends what was indexed (its token at the
    last indexed position differs, or it got shorter) the index is rebuilt. A row's draft follows the longest
    suffix n-gram of its own history that occurred before; with ``scope=LookupScope.BATCH`` a longer match in
    another live request's history (the requests this drafter holds an index of) wins over it, and is copied
    as far as that history goes. Measured on the trained model's batch-4 prompts (bench/README.md):
    2.3 -> 2.7 tokens per verify forward at k = 4. With ``scope=LookupScope.RECENT`` a released request's index
    stays in a pool of finished histories, the most recent first, up to ``pool_tokens`` tokens in all.
    """

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1, adaptive: bool = True, cap_k: bool = True,
                 scope: LookupScope | str = LookupScope.REQUEST, pool_tokens: int = 0):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        if pool_tokens < 0:
            raise ValueError(f"pool_tokens must be >= 0, got {pool_tokens}")
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.scope = LookupScope(scope)
        self._shared = None if self.scope is LookupScope.REQUEST else SharedNgrams(ngram_min, ngram_max)
        # finished requests' indexes (RECENT), oldest first, and the tokens they hold
        self.pool_tokens = pool_tokens if self.scope is LookupScope.RECENT else 0
        self._pool: OrderedDict[str, NgramIndex] = OrderedDict()
        self._pooled = 0
        self.shared_matches = 0  # drafts taken from another request's history
        self._riding: set[str] = set()  # rows whose latest draft rides along (paused rows, under the gate)
        self.riding = {"proposed": 0, "verified": 0, "accepted_tokens": 0}
        # adaptive=False: always propose up to k (the fixed-k behaviour, for comparisons); cap_k=False: pauses
        # only, and paused rows' drafts ride along (under the draft gate, which chooses the width)
        self.pace = AdaptivePace(resume_ngram=ngram_max, cap_k=cap_k) if adaptive else None
        self._k: dict[str, int] = {}  # the k each row was last asked for
        self._index: dict[str, NgramIndex] = {}
        self._stats = _Stats()
        self.matches_by_n: dict[int, int] = {n: 0 for n in range(ngram_min, ngram_max + 1)}
        self.rebuilds = 0

    def index_of(self, request_id: str) -> NgramIndex:
        return self._index[request_id]

    def _sync(self, row: DraftRequest) -> NgramIndex:
        rid = row.request_id
        index = self._index.get(rid)
        tokens = row.tokens
        if index is not None:
            n = len(index.tokens)
            if len(tokens) >= n and (n == 0 or int(tokens[n - 1]) == index.tokens[-1]):
                if len(tokens) > n:
                    added = index.extend(tokens[n:])
                    if self._shared is not None:
                        self._shared.add(rid, index, added)
                return index
            self.rebuilds += 1
            if self._shared is not None:
                self._shared.drop(rid, index)
        self._unpool(rid)  # a request that comes back under a finished one's id replaces its history
        index = self._index[rid] = NgramIndex(self.ngram_min, self.ngram_max, tokens)
        if self._shared is not None:
            self._shared.add(rid, index, index.indexed)
        return index

    def _pool_history(self, request_id: str, index: NgramIndex) -> None:
        """Keep a finished request's index for later lookups (RECENT), evicting the oldest over the budget."""
        self._unpool(request_id)
        if len(index.tokens) > self.pool_tokens:
            self._shared.drop(request_id, index)
            return
        self._pool[request_id] = index
        self._pooled += len(index.tokens)
        while self._pooled > self.pool_tokens:
            self._unpool(next(iter(self._pool)))

    def _unpool(self, request_id: str) -> None:
        index = self._pool.pop(request_id, None)
        if index is not None:
            self._pooled -= len(index.tokens)
            self._shared.drop(request_id, index)

    def _history(self, request_id: str) -> list[int]:
        """A live or pooled request's indexed tokens."""
        index = self._index.get(request_id)
        return (index if index is not None else self._pool[request_id]).tokens

    def _match(self, request_id: str, index: NgramIndex, k: int) -> tuple[list[int], int, Hashable]:
        """The row's draft, the n that matched and the match's source (``AdaptivePace``'s distance)."""
        tokens, n, distance = index.match(k)
        if self._shared is None or k <= 0:
            return tokens, n, distance
        own = index.tokens
        for m in range(min(self.ngram_max, len(own)), max(n, self.ngram_min - 1), -1):
            found = self._shared.find(own[len(own) - m:], request_id)
            if found is not None:
                holder, e = found
                source = self._history(holder)
                self.shared_matches += 1
                # where the source sits against the row's own position: a continued copy keeps it
                return source[e + 1 : e + 1 + k], m, (holder, len(own) - 1 - e)
        return tokens, n, distance

    def propose(self, rows: Sequence[DraftRequest], k: int) -> list[Draft]:
        _unique(rows)
        indexes = [self._sync(row) for row in rows]  # every history first: shared matches see this tick's
        drafts = []
        for row, index in zip(rows, indexes):
            kb = _row_k(row, k)
            tokens, n, distance = self._match(row.request_id, index, kb)
            if n:
                self.matches_by_n[n] += 1
            rides = False
            if self.pace is not None and tokens:
                self._k[row.request_id] = kb
                allowed = self.pace.limit(row.request_id, kb, len(index.tokens), n, distance)
                rides = not allowed and not self.pace.cap_k  # paused, under the gate
                tokens = tokens if rides else tokens[:allowed]
                if rides:
                    self._riding.add(row.request_id)
                    self.riding["proposed"] += 1
                else:
                    self._riding.discard(row.request_id)
                self.pace.drafted(row.request_id, len(tokens), distance)
            drafts.append(Draft(row.request_id, tokens, None, rides_along=rides))
        self._stats.record(drafts)
        return drafts

    def accept(self, request_id: str, num_accepted: int, emitted: Sequence[int] = ()) -> None:
        """Stats and the row's pace; the index catches up from the history at the next propose."""
        self._stats.accept(request_id, num_accepted)
        if request_id in self._riding:
            self._riding.discard(request_id)
            self.riding["verified"] += 1
            self.riding["accepted_tokens"] += num_accepted
        if self.pace is not None:
            index = self._index.get(request_id)
            history = (len(index.tokens) if index is not None else 0) + len(emitted)
            self.pace.update(request_id, num_accepted, self._k.get(request_id, 0), history)

    def release(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            index = self._index.pop(rid, None)
            if index is not None and self._shared is not None:
                if self.pool_tokens:
                    self._pool_history(rid, index)
                else:
                    self._shared.drop(rid, index)
            self._riding.discard(rid)
            self._stats.last.pop(rid, None)
            self._k.pop(rid, None)
            if self.pace is not None:
                self.pace.release(rid)

    def stats(self) -> dict[str, Any]:
        out = self._stats.as_dict()
        out.update(kind="prompt_lookup", scope=self.scope.value, live_requests=len(self._index),
                   matches_by_n={str(n): c for n, c in self.matches_by_n.items()},  # JSON-ready keys
                   shared_matches=self.shared_matches, pooled_requests=len(self._pool),
                   pooled_tokens=self._pooled,
                   riding_drafts=dict(self.riding),
                   rebuilds=self.rebuilds, adaptive=self.pace.stats() if self.pace is not None else None)
        return out


# ---------------------------------------------------------------------------
# Draft model
# ---------------------------------------------------------------------------


class DraftModelDrafter:
    """Drafts with a smaller mlx-lm model sharing the target's tokenizer and vocabulary.

    **Cache design.** One left-padded ``BatchKVCache`` per layer for every row the drafter knows (built the
    way ``scheduler/execution/executor.py`` builds the target's: a new request's history minus its last token is
    prefilled alone in a single-request ``make_prompt_cache`` cache, then merged in). Drafting k tokens for
    B rows is then k batched forwards instead of k x B single-row ones, which is what matters when the
    draft model is small and per-call overhead dominates. ``_seq[rid]`` is always exactly the token list
    whose KV the row holds; at each :meth:`propose` the row's history is compared with it (O(k): only the
    tail after the part already known to be committed), the row drops what differs (one
    :func:`~kernels.speculative.rollback_rows` for all rows) and feeds what is missing. Rows whose missing
    part is shorter than the longest one re-feed a few already-cached tokens, so every row feeds the same
    width and no right-padding (and no second rollback) is needed; draft tokens beyond a row's accepted
    prefix simply stay in the cache until the next sync drops them.

    Rows known to the drafter but absent from a propose call ride along in the batched forwards (they
    re-feed their own last tokens; their state stays consistent): release rows that stop drafting.

    **Modes.** ``sample=False`` (default): greedy drafting (argmax); the draft is deterministic, so
    ``Draft.logprobs`` is ``None`` (q one-hot on the draft -- returning the softmax here would make
    :func:`~kernels.speculative.stochastic_accept` biased: q must be what the token was drawn from).
    ``sample=True``: each row draws from ``q = processed_logprobs(draft log-probs, row.sampling)`` with the
    ``"draft"`` noise stream keyed by ``(seed, step + i)``, and ``Draft.logprobs`` is that q (rows without
    ``sampling`` are greedy: one-hot q).

    Only plain ``KVCache`` draft models (rotating / sliding-window caches cannot be rolled back).
    """

    def __init__(self, draft_model: Any, *, sample: bool = False, prefill_step_size: int = 512,
                 adaptive: bool = True):
        kinds = {type(layer).__name__ for layer in library.make_request_cache(draft_model)}
        if kinds != {"KVCache"}:
            raise TypeError(f"DraftModelDrafter needs a draft model with plain KVCache layers (its cache must be "
                            f"rolled back per row), got {sorted(kinds)}")
        self.model = draft_model
        self.sample = sample
        self.pace = AdaptivePace() if adaptive else None  # adaptive=False: always draft up to k
        self._k: dict[str, int] = {}
        self.prefill_step_size = prefill_step_size
        self._rows: list[str] = []
        self._seq: dict[str, list[int]] = {}
        self._committed: dict[str, int] = {}  # _seq[rid][:n] is known to equal the request's history
        self._cache: library.Cache = []
        self._stats = _Stats()
        self.forwards = 0
        self.rolled_back = 0  # cache positions dropped by resyncs

    # ---- bookkeeping -----------------------------------------------------------------------------
    def release(self, request_ids: Iterable[str]) -> None:
        request_ids = list(request_ids)
        gone = {rid for rid in request_ids if rid in self._seq}
        for rid in request_ids:
            self._stats.last.pop(rid, None)
            self._k.pop(rid, None)
            if self.pace is not None:
                self.pace.release(rid)
        if not gone:
            return
        keep = [i for i, rid in enumerate(self._rows) if rid not in gone]
        self._cache = library.filter_batch(self._cache, keep)
        self._rows = [self._rows[i] for i in keep]
        for rid in gone:
            del self._seq[rid], self._committed[rid]

    def accept(self, request_id: str, num_accepted: int, emitted: Sequence[int] = ()) -> None:
        """Report a verification (stats and the row's pace). The cache is resynced from the history at the
        next propose, so this is not needed for correctness."""
        self._stats.accept(request_id, num_accepted)
        if self.pace is not None:
            history = self._committed.get(request_id, 0) + len(emitted)
            self.pace.update(request_id, num_accepted, self._k.get(request_id, 0), history)

    def cached_tokens(self, request_id: str) -> list[int]:
        """The tokens whose KV the drafter holds for this request (for tests and debugging)."""
        return list(self._seq[request_id])

    def cache_bytes(self) -> int:
        return library.cache_nbytes(self._cache)

    def stats(self) -> dict[str, Any]:
        out = self._stats.as_dict()
        out.update(kind="draft_model", live_requests=len(self._rows), forwards=self.forwards,
                   rolled_back_positions=self.rolled_back, cache_bytes=self.cache_bytes(),
                   adaptive=self.pace.stats() if self.pace is not None else None)
        return out

    # ---- proposing -------------------------------------------------------------------------------
    def _prefill(self, tokens: Sequence[int]) -> library.Cache:
        cache = library.make_request_cache(self.model)
        toks = list(tokens)
        for start in range(0, len(toks), self.prefill_step_size):
            self.model(mx.array(toks[start : start + self.prefill_step_size])[None], cache=cache)
            mx.eval(library.cache_arrays(cache))
        return cache

    def _join(self, rows: Sequence[DraftRequest]) -> None:
        """Prefill the new rows alone, then merge them into the batch layer by layer (`join_rows`, as the
        target's KV manager does)."""
        caches = [self._prefill(r.tokens[:-1]) for r in rows]
        self._cache, _ = library.join_rows(self._cache, caches)
        for r in rows:
            self._rows.append(r.request_id)
            self._seq[r.request_id] = [int(t) for t in r.tokens[:-1]]
            self._committed[r.request_id] = len(r.tokens) - 1

    def _common(self, rid: str, history: Sequence[int], n: int) -> int:
        """Length of the longest common prefix of the cached tokens and ``history[:n]``, starting from the
        part known to be committed (so O(k) per call, not O(history))."""
        seq = self._seq[rid]
        limit = min(len(seq), n)
        c = min(self._committed[rid], limit)
        if c and seq[c - 1] != int(history[c - 1]):
            c = 0  # the history is not an extension of what we saw: compare from the start
        while c < limit and seq[c] == int(history[c]):
            c += 1
        return c

    def warm(self, rows: Sequence[DraftRequest]) -> None:
        """Prefill the draft cache of requests not known yet (history minus its last token), without
        drafting: call it when a request's target prefill completes, so its first :meth:`propose` does not
        pay a whole-prompt prefill inside a decode tick."""
        _unique(rows)
        new = [r for r in rows if r.request_id not in self._seq and len(r.tokens) > 0]
        if new:
            self._join(new)

    def propose(self, rows: Sequence[DraftRequest], k: int) -> list[Draft]:
        _unique(rows)
        ks = self._paced_k(rows, k)
        active = [r for r in rows if ks[r.request_id] > 0]
        if not active:
            drafts = [Draft(r.request_id, [], None) for r in rows]
            self._stats.record(drafts)
            return drafts
        new = [r for r in active if r.request_id not in self._seq]
        if new:
            self._join(new)
        by_id = {r.request_id: r for r in active}
        logits = self._catch_up(by_id)
        drafted, q_all = self._draft_steps(logits, by_id, max(ks.values()))
        row_of = {rid: b for b, rid in enumerate(self._rows)}
        drafts = []
        for r in rows:
            kb = ks[r.request_id]
            if kb == 0:
                drafts.append(Draft(r.request_id, [], None))
                continue
            b = row_of[r.request_id]
            drafts.append(Draft(r.request_id, drafted[b][:kb], q_all[b, :kb] if q_all is not None else None))
            if self.pace is not None:
                self.pace.drafted(r.request_id, kb)
        self._stats.record(drafts)
        return drafts

    def _paced_k(self, rows: Sequence[DraftRequest], k: int) -> dict[str, int]:
        """Each row's number of drafts this call: its own cap, then the pacing's limit."""
        ks = {r.request_id: _row_k(r, k) for r in rows}
        if self.pace is not None:
            for r in rows:
                if ks[r.request_id]:
                    self._k[r.request_id] = ks[r.request_id]
                    ks[r.request_id] = self.pace.limit(r.request_id, ks[r.request_id], len(r.tokens))
        return ks

    def _catch_up(self, by_id: dict[str, DraftRequest]) -> mx.array:
        """Feed every drafting row the history its draft cache lacks, in one forward of equal width (re-feeding
        cached tokens rather than padding where a row lacks fewer); returns each row's logits at its last real
        position."""
        # 1. what each row must feed: the history it lacks (active rows, >= 1 token), nothing (others)
        keep_len, pending = [], []
        for rid in self._rows:
            row = by_id.get(rid)
            if row is None:  # idle this call: keep its committed history (drop old drafts, so it never grows)
                keep_len.append(min(self._committed[rid], len(self._seq[rid])))
                pending.append([])
                continue
            history = row.tokens
            m = self._common(rid, history, len(history) - 1)
            keep_len.append(m)
            pending.append([int(t) for t in history[m:]])
        width = max(len(p) for p in pending)

        # 2. equal width: re-feed cached tokens (pad only when a row holds too few)
        drop, feed, pad = [], [], []
        for rid, m, p in zip(self._rows, keep_len, pending):
            seq = self._seq[rid]
            refeed = min(width - len(p), m)
            drop.append(len(seq) - (m - refeed))
            feed.append(seq[m - refeed : m] + p)
            pad.append(width - refeed - len(p))
        if any(drop):
            rollback_rows(self._cache, drop)
            self.rolled_back += sum(drop)
        for rid, d in zip(self._rows, drop):
            if d:
                del self._seq[rid][len(self._seq[rid]) - d :]
        inputs = mx.array([f + [0] * pd for f, pd in zip(feed, pad)], dtype=mx.uint32)
        logits = self.model(inputs, cache=self._cache)
        self.forwards += 1
        if any(pad):
            rollback_rows(self._cache, pad)
        last_pos = mx.array([max(width - pd - 1, 0) for pd in pad])[:, None, None]
        for rid, f in zip(self._rows, feed):
            self._seq[rid].extend(f)
        for rid, row in by_id.items():
            self._committed[rid] = len(row.tokens)
        return mx.take_along_axis(logits, last_pos, axis=1)[:, 0, :]

    def _draft_steps(self, logits: mx.array, by_id: dict[str, DraftRequest],
                     K: int) -> tuple[list[list[int]], mx.array | None]:
        """K draft tokens per row from `logits` on (K - 1 more forwards, one token per row each), greedy or
        sampled with each row's own stream; returns them as lists, and (sampling) their (B, K, V) log-probs."""
        params = seeds = steps = None
        if self.sample:
            params = SamplingArrays.from_rows([
                (by_id[rid].sampling if rid in by_id and by_id[rid].sampling is not None else RowSampling())
                for rid in self._rows
            ])
            seeds = params.seed
            steps = mx.array([by_id[rid].step if rid in by_id else 0 for rid in self._rows], dtype=mx.uint32)
        tokens, qs = [], []
        for i in range(K):
            if self.sample:
                lp = logits.astype(mx.float32)
                q = processed_logprobs(lp - mx.logsumexp(lp, axis=-1, keepdims=True), params)
                u = draft_uniforms(seeds, steps, q.shape[-1], offset=i)
                tok = mx.argmax(q + (-mx.log(-mx.log(u))), axis=-1)
                qs.append(q)
            else:
                tok = mx.argmax(logits, axis=-1)
            tok = tok.astype(mx.uint32)
            tokens.append(tok)
            if i < K - 1:
                logits = self.model(tok[:, None], cache=self._cache)[:, -1, :]
                self.forwards += 1
                mx.async_eval(tok)
        drafted = mx.stack(tokens, axis=1)  # (B, K)
        q_all = mx.stack(qs, axis=1) if qs else None  # (B, K, V)
        mx.eval(drafted, *([q_all] if q_all is not None else []))
        drafted_list = drafted.tolist()
        for rid, toks in zip(self._rows, drafted_list):
            self._seq[rid].extend(toks[: K - 1])  # the last drafted token was not fed
        return drafted_list, q_all
