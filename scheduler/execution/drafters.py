"""Drafters for speculative decoding: who proposes the k tokens the target verifies.

A drafter sees, per row, the request's full token history (prompt + output so far; the last token is the
one the target is fed next) and proposes up to ``k`` tokens. Acceptance is ``kernels/speculative.py``;
the target's KV rollback is ``kernels.speculative.rollback_rows``.

* :class:`PromptLookupDrafter` -- no model: match the last n tokens against the request's own history and
  propose what followed the most recent earlier occurrence. Deterministic, so ``Draft.logprobs`` is
  ``None`` (``q`` one-hot on the draft: ``stochastic_accept(draft_logprobs=None)``).
* :class:`DraftModelDrafter` -- a smaller mlx-lm model with the target's vocabulary. One left-padded batch
  cache (mlx-lm ``BatchKVCache``) for all its rows, so drafting k tokens for B rows is k batched forwards,
  not k x B. The cache is kept in sync with the *history passed to* :meth:`propose` (longest common prefix
  with what the cache holds, per row, then one per-row rollback), so correctness never depends on
  :meth:`accept` being called: a tick without drafting, a partial acceptance or a preemption all resync.

Protocol::

    drafts = drafter.propose([DraftRequest(rid, tokens, ...), ...], k)   # one Draft per row, same order
    ... verify, accept ...
    drafter.accept(rid, num_accepted, emitted)                          # bookkeeping (stats)
    drafter.release([rid, ...])                                          # request ended / preempted
    drafter.stats()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional, Protocol, Sequence

import mlx.core as mx

from kernels.sampling import RowSampling, SamplingArrays
from kernels.speculative import draft_uniforms, processed_logprobs, rollback_rows

from scheduler.execution import library

__all__ = [
    "Draft",
    "DraftRequest",
    "Drafter",
    "DraftModelDrafter",
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
    ``(len(tokens), V)`` float32 log-probs, or ``None`` when the drafter is deterministic (q one-hot)."""

    request_id: str
    tokens: list[int]
    logprobs: Optional[mx.array] = None


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

    def extend(self, new_tokens: Sequence[int]) -> None:
        toks = self.tokens
        toks.extend(int(t) for t in new_tokens)
        last = len(toks) - 1  # the n-gram ending at the last position has no follower yet
        for e in range(self._indexed, last):
            for n, table in self.maps.items():
                if e + 1 >= n:
                    table[tuple(toks[e + 1 - n : e + 1])] = e
        self._indexed = max(self._indexed, last)

    def lookup(self, k: int) -> tuple[list[int], int]:
        """Up to k tokens following the most recent earlier occurrence of the longest matching suffix
        n-gram (n from ngram_max down to ngram_min), and the n that matched (0: no match). A match close to
        the end continues periodically (the proposal itself extends the history), so ``a b a b`` proposes
        ``a b a ...``."""
        toks = self.tokens
        L = len(toks)
        if k <= 0:
            return [], 0
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
            return out, n
        return [], 0


class PromptLookupDrafter:
    """Prompt-lookup (n-gram) drafting against each request's own history; no model, q one-hot.

    One :class:`NgramIndex` per request, updated with the tokens that arrived since the last call (the new
    tail of ``DraftRequest.tokens``); if the history no longer extends what was indexed (its token at the
    last indexed position differs, or it got shorter) the index is rebuilt.
    """

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self._index: dict[str, NgramIndex] = {}
        self._stats = _Stats()
        self.matches_by_n: dict[int, int] = {n: 0 for n in range(ngram_min, ngram_max + 1)}
        self.rebuilds = 0

    def index_of(self, request_id: str) -> NgramIndex:
        return self._index[request_id]

    def _sync(self, row: DraftRequest) -> NgramIndex:
        index = self._index.get(row.request_id)
        tokens = row.tokens
        if index is not None:
            n = len(index.tokens)
            if len(tokens) >= n and (n == 0 or int(tokens[n - 1]) == index.tokens[-1]):
                if len(tokens) > n:
                    index.extend(tokens[n:])
                return index
            self.rebuilds += 1
        index = self._index[row.request_id] = NgramIndex(self.ngram_min, self.ngram_max, tokens)
        return index

    def propose(self, rows: Sequence[DraftRequest], k: int) -> list[Draft]:
        _unique(rows)
        drafts = []
        for row in rows:
            kb = _row_k(row, k)
            index = self._sync(row)
            tokens, n = index.lookup(kb)
            if n:
                self.matches_by_n[n] += 1
            drafts.append(Draft(row.request_id, tokens, None))
        self._stats.record(drafts)
        return drafts

    def accept(self, request_id: str, num_accepted: int, emitted: Sequence[int] = ()) -> None:
        """Bookkeeping only: the index catches up from the history at the next propose."""
        self._stats.accept(request_id, num_accepted)

    def release(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._index.pop(rid, None)
            self._stats.last.pop(rid, None)

    def stats(self) -> dict[str, Any]:
        out = self._stats.as_dict()
        out.update(kind="prompt_lookup", live_requests=len(self._index), matches_by_n=dict(self.matches_by_n),
                   rebuilds=self.rebuilds)
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

    def __init__(self, draft_model: Any, *, sample: bool = False, prefill_step_size: int = 512):
        kinds = {type(layer).__name__ for layer in library.make_request_cache(draft_model)}
        if kinds != {"KVCache"}:
            raise TypeError(f"DraftModelDrafter needs a draft model with plain KVCache layers (its cache must be "
                            f"rolled back per row), got {sorted(kinds)}")
        self.model = draft_model
        self.sample = sample
        self.prefill_step_size = prefill_step_size
        self._rows: list[str] = []
        self._seq: dict[str, list[int]] = {}
        self._committed: dict[str, int] = {}  # _seq[rid][:n] is known to equal the request's history
        self._cache: library.Cache = []
        self._stats = _Stats()
        self.forwards = 0
        self.rolled_back = 0  # cache positions dropped by resyncs
        self.tick_peak_bytes = 0  # the most the draft cache held at once since start_tick(), merges included

    # ---- bookkeeping -----------------------------------------------------------------------------
    def release(self, request_ids: Iterable[str]) -> None:
        request_ids = list(request_ids)
        gone = {rid for rid in request_ids if rid in self._seq}
        for rid in request_ids:
            self._stats.last.pop(rid, None)
        if not gone:
            return
        keep = [i for i, rid in enumerate(self._rows) if rid not in gone]
        self._cache = library.filter_batch(self._cache, keep)
        self._rows = [self._rows[i] for i in keep]
        for rid in gone:
            del self._seq[rid], self._committed[rid]

    def accept(self, request_id: str, num_accepted: int, emitted: Sequence[int] = ()) -> None:
        """Report a verification (stats). The cache is resynced from the history at the next propose, so
        this is not needed for correctness."""
        self._stats.accept(request_id, num_accepted)

    def cached_tokens(self, request_id: str) -> list[int]:
        """The tokens whose KV the drafter holds for this request (for tests and debugging)."""
        return list(self._seq[request_id])

    def cache_bytes(self) -> int:
        return library.cache_nbytes(self._cache)

    def stats(self) -> dict[str, Any]:
        out = self._stats.as_dict()
        out.update(kind="draft_model", live_requests=len(self._rows), forwards=self.forwards,
                   rolled_back_positions=self.rolled_back, cache_bytes=self.cache_bytes())
        return out

    # ---- proposing -------------------------------------------------------------------------------
    def _prefill(self, tokens: Sequence[int]) -> library.Cache:
        cache = library.make_request_cache(self.model)
        toks = list(tokens)
        for start in range(0, len(toks), self.prefill_step_size):
            self.model(mx.array(toks[start : start + self.prefill_step_size])[None], cache=cache)
            mx.eval(library.cache_arrays(cache))
        return cache

    def start_tick(self) -> None:
        self.tick_peak_bytes = self.cache_bytes()

    def _join(self, rows: Sequence[DraftRequest]) -> None:
        """Prefill the new rows alone, then merge them into the batch layer by layer (`join_rows`, as the
        target's KV manager does), noting the most the draft cache held at once."""
        caches = [self._prefill(r.tokens[:-1]) for r in rows]
        self._cache, peak = library.join_rows(self._cache, caches)
        self.tick_peak_bytes = max(self.tick_peak_bytes, peak)
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
        ks = {r.request_id: _row_k(r, k) for r in rows}
        active = [r for r in rows if ks[r.request_id] > 0]
        K = max(ks.values(), default=0)
        if not active:
            drafts = [Draft(r.request_id, [], None) for r in rows]
            self._stats.record(drafts)
            return drafts
        new = [r for r in active if r.request_id not in self._seq]
        if new:
            self._join(new)
        by_id = {r.request_id: r for r in active}

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
        logits = mx.take_along_axis(logits, last_pos, axis=1)[:, 0, :]
        for rid, f in zip(self._rows, feed):
            self._seq[rid].extend(f)
        for rid, row in by_id.items():
            self._committed[rid] = len(row.tokens)

        # 3. K draft steps (K - 1 more forwards), one token per row each
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

        row_of = {rid: b for b, rid in enumerate(self._rows)}
        drafts = []
        for r in rows:
            kb = ks[r.request_id]
            if kb == 0:
                drafts.append(Draft(r.request_id, [], None))
                continue
            b = row_of[r.request_id]
            lps = q_all[b, :kb] if q_all is not None else None
            drafts.append(Draft(r.request_id, drafted_list[b][:kb], lps))
        self._stats.record(drafts)
        return drafts
