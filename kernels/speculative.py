"""Speculative decoding: batched acceptance kernels and per-row KV rollback.

One verification step, per row ``b`` of a batch:

* a drafter proposed ``draft_lens[b] <= k`` tokens ``d_1..d_n`` (rows are padded to ``k``);
* the target ran one forward over ``[last, d_1..d_k]`` and produced ``k+1`` next-token distributions
  ``p_0..p_k`` (``p_i`` predicts the token after ``d_i``; ``p_0`` the token after ``last``);
* the row accepts a prefix ``d_1..d_a`` and emits ``a + 1`` tokens: the accepted drafts and one token from
  the target (the correction at the first rejection, or a bonus token from ``p_n`` if all ``n`` drafts are
  accepted);
* the caller keeps ``a + 1`` of the ``k + 1`` positions it fed to the target's KV cache
  (``[last, d_1..d_a]``) and drops the other ``k - a``: :func:`rollback_rows`.

Every function works on whole ``(B, ...)`` arrays: no Python loop over rows.

Three acceptance rules:

* :func:`greedy_accept` -- greedy target: ``a`` = longest draft prefix equal to the target argmax at the
  same positions; the emitted token after it is the argmax at position ``a``. The output is exactly the
  target's greedy output, token for token.
* :func:`sampled_accept` -- deterministic drafts (prompt lookup, a greedy draft model, an MTP head: ``q``
  one-hot) for rows that may sample: the same rule with the target's *sampled* token at every position
  (``kernels.sampling.sample`` with the row's seed at that output index) in place of its argmax. That is
  exact speculative sampling for one-hot ``q`` (a draft ``d`` is accepted with probability ``p(d)``, and the
  token drawn at a rejection, being a draw from ``p`` that is not ``d``, is distributed as the residual),
  with the acceptance test coupled to the draw, and the tokens are the very ones decoding without drafts
  draws with the same seed: drafts change how many tokens a tick emits, never which.
* :func:`stochastic_accept` -- sampled target: the exact speculative-sampling rule (Leviathan et al. 2023,
  Chen et al. 2023). Draft ``i`` is accepted with probability ``min(1, p_i(d_i) / q_i(d_i))``; at the
  first rejection the emitted token is drawn from ``normalize(max(p_i - q_i, 0))``; if all drafts are
  accepted a bonus token is drawn from ``p_n``. The emitted tokens are distributed exactly as tokens
  sampled one by one from ``p`` (they are *not* the same tokens a non-speculative seeded run draws: the
  random stream is consumed differently). ``draft_logprobs=None`` means the drafter is deterministic
  (prompt lookup, or a greedy draft model): ``q_i`` is one-hot on ``d_i``, so a draft is accepted with
  probability ``p_i(d_i)`` and the residual is ``p_i`` without ``d_i``, renormalised -- also exact. The
  engine verifies deterministic drafts with :func:`sampled_accept` (the same distribution, and the tokens
  of decoding without drafts); this rule is for drafts drawn from a ``q`` (a sampling draft model).

**p and q must be the processed distributions**: what the row would actually sample from, after penalties,
top-p / min-p / top-k filtering and temperature (greedy rows: one-hot on the argmax). The drafter's ``q``
must be the distribution its tokens were really drawn from. :func:`processed_logprobs` turns raw log-probs
plus a row's :class:`~kernels.sampling.SamplingArrays` into exactly that (mlx-lm's filter order, like
``kernels.sampling.sample``); greedy rows become one-hot, so greedy and sampled rows can share one
:func:`stochastic_accept` call (a one-hot ``p`` reproduces :func:`greedy_accept`).

Randomness is counter-based like ``kernels/sampling.py``: every random number is a hash of
``(seed[row], output index, purpose[, vocab index])`` -- output index = ``steps[row] + position`` -- never
the global MLX RNG, so a seeded row gives the same result alone or anywhere in any batch. Purposes:

* acceptance test at output index ``j``: one uniform from the ``"accept"`` stream;
* the emitted target token at output index ``j`` (correction or bonus): a draw over the vocabulary from the
  *same* uniforms ``kernels.sampling.sample`` turns into Gumbel noise at step ``j``
  (``_hash_uniform(seed, j, V)``), as an exponential race ``argmax w / -log(u)`` -- mathematically the same
  draw as Gumbel-max on ``log w``, with fewer transcendental passes;
* a sampling draft model (``scheduler.execution.drafters``) draws its draft at index ``j`` from the ``"draft"``
  stream.

Each used random number is fresh: within a tick a row reads the accept stream at indices
``steps .. steps + a`` and the sample stream at ``steps + a``; the next tick starts at ``steps + a + 1``.

Cache helper: :func:`rollback_rows` drops a different number of trailing positions per row from mlx-lm's
left-padded ``BatchKVCache`` (as masked holes in the engine's batch, ``caches.layers._HoleBatchKVCache``; by
re-aligning the rows in mlx-lm's own class); it reaches into mlx-lm cache internals: it belongs next to ``scheduler/execution/library.py`` and is pinned by ``tests/kernels/test_speculative_kernels.py``).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import mlx.core as mx
import numpy as np
from caches.layers import rollback_rows  # noqa: F401  (re-exported)

from .sampling import SamplingArrays, _filter, _fmix32, _row_keys, logprobs_from_logits, sample

__all__ = [
    "AcceptResult",
    "greedy_accept",
    "greedy_accept_rows",
    "sampled_accept",
    "stochastic_accept",
    "stochastic_accept_from_uniforms",
    "speculative_uniforms",
    "accept_uniforms",
    "draft_uniforms",
    "processed_logprobs",
    "pad_drafts",
    "stack_draft_logprobs",
    "rollback_rows",
    "PURPOSE_ACCEPT",
    "PURPOSE_DRAFT",
]

#: Stream tags mixed into the row key (arbitrary odd constants; 0 would be the plain sampling stream).
PURPOSE_ACCEPT = 0x5BD1E995
PURPOSE_DRAFT = 0x1B873593

_NEG_INF = -float("inf")


class AcceptResult(NamedTuple):
    """What each row emits after one verification.

    accepted (B,) int32: drafts accepted (``0 <= accepted[b] <= draft_lens[b]``).
    emitted (B, k+1) int32: row b's emitted tokens in ``emitted[b, :num_emitted[b]]`` (the accepted drafts,
    then one target token), padded with -1.
    num_emitted (B,) int32: ``accepted + 1`` (always >= 1).
    """

    accepted: mx.array
    emitted: mx.array
    num_emitted: mx.array


# ---------------------------------------------------------------------------
# Counter-based noise
# ---------------------------------------------------------------------------


def _uniform_from_keys(keys: mx.array) -> mx.array:
    """One uniform in (0, 1) per uint32 key (the same bit recipe as kernels.sampling._hash_uniform)."""
    x = _fmix32(keys ^ mx.array(0x68E31DA4, dtype=mx.uint32))
    return ((x >> 9).astype(mx.float32) + 0.5) * (1.0 / (1 << 23))


def _columns_from_keys(keys: mx.array, vocab_size: int) -> mx.array:
    """keys (...,) uint32 -> (..., V) uniforms; with ``keys = _row_keys(seed, step)`` this is exactly
    ``kernels.sampling._hash_uniform(seed, step, V)``."""
    key = keys[..., None]
    idx = mx.arange(vocab_size, dtype=mx.uint32)
    x = _fmix32(idx * 0xCC9E2D51 + key)
    x = _fmix32(x ^ key)
    return ((x >> 9).astype(mx.float32) + 0.5) * (1.0 / (1 << 23))


def _purpose_keys(seeds: mx.array, steps: mx.array, n: int, purpose: int) -> mx.array:
    """(B, n) uint32 keys for output indices steps[b] + 0..n-1 of stream ``purpose`` (0 = plain sampling)."""
    B = seeds.shape[0]
    idx = steps.astype(mx.uint32)[:, None] + mx.arange(n, dtype=mx.uint32)[None, :]
    seed = mx.broadcast_to(seeds.astype(mx.uint32)[:, None], (B, n))
    keys = _row_keys(seed.reshape(-1), idx.reshape(-1)).reshape(B, n)
    if purpose:
        keys = _fmix32(keys ^ mx.array(purpose, dtype=mx.uint32))
    return keys


def accept_uniforms(seeds: mx.array, steps: mx.array, k: int) -> mx.array:
    """(B, k) uniforms for the acceptance tests at output indices steps[b] + i."""
    return _uniform_from_keys(_purpose_keys(seeds, steps, k, PURPOSE_ACCEPT))


def draft_uniforms(seeds: mx.array, steps: mx.array, vocab_size: int, offset: int = 0) -> mx.array:
    """(B, V) uniforms for a sampling drafter's token at output index steps[b] + offset (Gumbel-max noise)."""
    keys = _purpose_keys(seeds, steps + offset, 1, PURPOSE_DRAFT)[:, 0]
    return _columns_from_keys(keys, vocab_size)


def speculative_uniforms(seeds: mx.array, steps: mx.array, k: int, vocab_size: int) -> tuple[mx.array, mx.array]:
    """Every random number :func:`stochastic_accept` may read, materialised (for tests and debugging):
    ``accept_u (B, k)`` and ``sample_u (B, k+1, V)`` (sample_u[:, i] = the plain sampler's uniforms at
    step ``steps + i``). ``stochastic_accept_from_uniforms(..., *speculative_uniforms(...))`` equals
    ``stochastic_accept(...)``; the latter computes only the one (B, V) slice it needs."""
    accept_u = accept_uniforms(seeds, steps, k)
    sample_u = _columns_from_keys(_purpose_keys(seeds, steps, k + 1, 0), vocab_size)
    return accept_u, sample_u


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------


def pad_drafts(drafts: Sequence[Sequence[int]], k: Optional[int] = None) -> tuple[mx.array, mx.array]:
    """Per-row draft token lists -> ``(draft_tokens (B, k) int32 padded with 0, draft_lens (B,) int32)``.
    ``k`` defaults to the longest draft; a draft longer than ``k`` is an error."""
    lens = [len(d) for d in drafts]
    k = max(lens, default=0) if k is None else k
    if any(n > k for n in lens):
        raise ValueError(f"a draft is longer than k={k}: {max(lens)}")
    if not drafts:
        return mx.zeros((0, k), dtype=mx.int32), mx.zeros((0,), dtype=mx.int32)
    # (plain lists: a verify tick pads a handful of short drafts, where numpy's per-call costs dominate)
    return mx.array([[*d, *([0] * (k - len(d)))] for d in drafts], dtype=mx.int32), mx.array(lens, dtype=mx.int32)


def stack_draft_logprobs(
    drafts: Sequence[Sequence[int]], logprobs: Sequence[Optional[mx.array]], k: int, vocab_size: int
) -> Optional[mx.array]:
    """Per-row draft distributions -> ``(B, k, V)`` for :func:`stochastic_accept`, or ``None`` when every row
    is deterministic. Rows with ``None`` in a mixed batch get their one-hot q (0 at the draft token, -inf
    elsewhere: exactly the ``draft_logprobs=None`` rule); positions beyond a row's draft are filled with 0
    and never read."""
    if all(lp is None for lp in logprobs):
        return None
    rows = []
    for toks, lp in zip(drafts, logprobs):
        n = len(toks)
        if lp is None:
            lp = mx.where(mx.arange(vocab_size)[None, :] == mx.array(list(toks), dtype=mx.int32)[:, None], 0.0, _NEG_INF) \
                if n else mx.zeros((0, vocab_size))
        if tuple(lp.shape) != (n, vocab_size):
            raise ValueError(f"draft logprobs must be (len(tokens), V) = {(n, vocab_size)}, got {tuple(lp.shape)}")
        rows.append(mx.concatenate([lp.astype(mx.float32), mx.zeros((k - n, vocab_size), mx.float32)], axis=0))
    return mx.stack(rows)


def _check(target: mx.array, draft_tokens: mx.array, draft_lens: mx.array) -> tuple[int, int, int]:
    if target.ndim != 3:
        raise ValueError(f"target must be (B, k+1, V), got {tuple(target.shape)}")
    B, k1, V = target.shape
    k = k1 - 1
    if tuple(draft_tokens.shape) != (B, k):
        raise ValueError(f"draft_tokens must be (B, k) = {(B, k)}, got {tuple(draft_tokens.shape)}")
    if tuple(draft_lens.shape) != (B,):
        raise ValueError(f"draft_lens must be (B,) = {(B,)}, got {tuple(draft_lens.shape)}")
    return B, k, V


def _valid_mask(draft_lens: mx.array, k: int) -> mx.array:
    return mx.arange(k)[None, :] < draft_lens.astype(mx.int32)[:, None]


def _emit(draft_tokens: mx.array, accepted: mx.array, last: mx.array, k: int) -> AcceptResult:
    pos = mx.arange(k + 1)[None, :]
    acc = accepted[:, None]
    drafts = mx.concatenate([draft_tokens.astype(mx.int32), mx.zeros((draft_tokens.shape[0], 1), mx.int32)], axis=1)
    emitted = mx.where(pos < acc, drafts, mx.where(pos == acc, last.astype(mx.int32)[:, None], -1))
    return AcceptResult(accepted, emitted, accepted + 1)


# ---------------------------------------------------------------------------
# Greedy
# ---------------------------------------------------------------------------


def greedy_accept(target_logits: mx.array, draft_tokens: mx.array, draft_lens: mx.array) -> AcceptResult:
    """Greedy verification (``target_logits`` may be logits or log-probs: only the argmax is used).

    target_logits (B, k+1, V); draft_tokens (B, k) int, padded beyond ``draft_lens[b]``; draft_lens (B,).
    ``accepted[b]`` = longest prefix of row b's draft equal to the target argmax at the same positions;
    the row emits those drafts and then the argmax at position ``accepted[b]`` (correction or bonus).
    """
    _check(target_logits, draft_tokens, draft_lens)
    return _accept_matching(mx.argmax(target_logits, axis=-1).astype(mx.int32), draft_tokens, draft_lens)


def sampled_accept(target_logits: mx.array, draft_tokens: mx.array, draft_lens: mx.array, params: SamplingArrays,
                   steps: mx.array) -> AcceptResult:
    """Verification of deterministic drafts for rows that may sample (module docstring).

    target_logits (B, k+1, V): the target's logits at ``[last, d_1..d_k]`` (no penalties: rows with penalties do
    not draft); params: the rows' :class:`~kernels.sampling.SamplingArrays`; steps (B,): each row's output index
    of position 0. Every position's token is what ``kernels.sampling.sample_tokens`` draws from that position's
    logits at output index ``steps[b] + i`` (greedy rows: the argmax); ``accepted[b]`` is the longest draft prefix
    equal to those tokens, and the row emits them up to and including position ``accepted[b]``."""
    B, k, V = _check(target_logits, draft_tokens, draft_lens)
    n = k + 1
    flat = target_logits.reshape(B * n, V)
    flat_steps = (steps.astype(mx.uint32)[:, None] + mx.arange(n, dtype=mx.uint32)[None, :]).reshape(-1)
    top = sample(logprobs_from_logits(flat), params.repeated(n), flat_steps, logits=flat)
    return _accept_matching(top.reshape(B, n).astype(mx.int32), draft_tokens, draft_lens)


def _accept_matching(top: mx.array, draft_tokens: mx.array, draft_lens: mx.array) -> AcceptResult:
    """Accept each row's longest draft prefix equal to ``top`` (B, k+1), the target's token at every position,
    then emit ``top`` at the first position that differs (or after the last draft)."""
    B, k = draft_tokens.shape
    match = (draft_tokens.astype(mx.int32) == top[:, :k]) & _valid_mask(draft_lens, k)
    accepted = mx.cumprod(match.astype(mx.int32), axis=1).sum(axis=1).astype(mx.int32) if k else mx.zeros((B,), mx.int32)
    last = mx.take_along_axis(top, accepted[:, None], axis=1)[:, 0]
    return _emit(draft_tokens, accepted, last, k)


def greedy_accept_rows(top: Sequence[Sequence[int]], drafts: Sequence[Sequence[int]]) -> tuple[list[int], list[list[int]]]:
    """:func:`greedy_accept` on the host, from each row's target argmax already read back.

    top[b]: the target's argmax at positions ``0..k`` of row b (``k + 1`` ints, ``k >= len(drafts[b])``);
    drafts[b]: row b's draft. Returns ``(accepted, emitted)``: ``accepted[b]`` the longest prefix of the draft
    equal to ``top[b]`` at the same positions, ``emitted[b]`` those drafts and then ``top[b][accepted[b]]``.

    The verify tick of an all-greedy batch reads the argmax back anyway (it is every row's token); deciding
    here on those few ints replaces the dozen MLX ops of :func:`greedy_accept` (each costs about as much as
    the arithmetic of a small model's layer on the CPU backend), with the same result."""
    accepted, emitted = [], []
    for row_top, draft in zip(top, drafts):
        a = 0
        while a < len(draft) and draft[a] == row_top[a]:
            a += 1
        accepted.append(a)
        emitted.append([*draft[:a], row_top[a]])
    return accepted, emitted


# ---------------------------------------------------------------------------
# Stochastic
# ---------------------------------------------------------------------------


def _accept_count(
    target: mx.array,
    draft: Optional[mx.array],
    draft_tokens: mx.array,
    draft_lens: mx.array,
    accept_u: mx.array,
    k: int,
) -> mx.array:
    """(B,) accepted drafts: draft i is accepted iff u_i <= p_i(d_i) / q_i(d_i) (in log space: exact
    when p == q, which then never rejects), and only while every earlier one was accepted."""
    if k == 0:
        return mx.zeros((target.shape[0],), mx.int32)
    valid = _valid_mask(draft_lens, k)
    tok = mx.where(valid, draft_tokens.astype(mx.int32), 0)[..., None]
    logp_d = mx.take_along_axis(target[:, :k], tok, axis=-1)[..., 0]
    ratio = logp_d if draft is None else logp_d - mx.take_along_axis(draft, tok, axis=-1)[..., 0]
    ok = (mx.log(accept_u) <= ratio) & valid  # NaN (both -inf) -> reject
    return mx.cumprod(ok.astype(mx.int32), axis=1).sum(axis=1).astype(mx.int32)


def _final_weights(
    target: mx.array,
    draft: Optional[mx.array],
    draft_tokens: mx.array,
    draft_lens: mx.array,
    accepted: mx.array,
    k: int,
) -> mx.array:
    """(B, V) unnormalised probabilities of the emitted target token: the residual max(p - q, 0) at a
    rejection, p at the bonus position. A residual with no mass (p <= q everywhere: only possible through
    rounding) falls back to p. Probability space: the draw is an exponential race (argmax w / E with
    E = -log u), i.e. Gumbel-max on log w, with three transcendental passes over (B, V) instead of five."""
    rows = mx.arange(target.shape[0])
    p = mx.exp(target[rows, accepted])  # (B, V)
    if k == 0:
        return p
    bonus = accepted >= draft_lens.astype(mx.int32)
    qsel = mx.minimum(accepted, k - 1)
    if draft is None:
        d = draft_tokens.astype(mx.int32)[rows, qsel][:, None]  # (B, 1)
        residual = mx.where(mx.arange(target.shape[-1])[None, :] == d, 0.0, p)
    else:
        residual = mx.maximum(p - mx.exp(draft[rows, qsel]), 0.0)
    empty = mx.max(residual, axis=-1, keepdims=True) <= 0.0
    return mx.where(bonus[:, None] | empty, p, residual)


def _race(weights: mx.array, u: mx.array) -> mx.array:
    """argmax_v weights[v] / E[v], E = -log(u): a draw from normalize(weights) (= Gumbel-max on log weights
    with the Gumbel noise -log(-log u))."""
    return mx.argmax(weights / (-mx.log(u)), axis=-1)


def _prep(target_logprobs, draft_logprobs, draft_tokens, draft_lens):
    B, k, V = _check(target_logprobs, draft_tokens, draft_lens)
    target = target_logprobs.astype(mx.float32)
    draft = None
    if draft_logprobs is not None:
        if tuple(draft_logprobs.shape) != (B, k, V):
            raise ValueError(f"draft_logprobs must be (B, k, V) = {(B, k, V)}, got {tuple(draft_logprobs.shape)}")
        draft = draft_logprobs.astype(mx.float32)
    return B, k, V, target, draft


def stochastic_accept_from_uniforms(
    target_logprobs: mx.array,
    draft_logprobs: Optional[mx.array],
    draft_tokens: mx.array,
    draft_lens: mx.array,
    accept_u: mx.array,
    sample_u: mx.array,
) -> AcceptResult:
    """:func:`stochastic_accept` with the random numbers given: ``accept_u (B, k)`` uniforms for the
    acceptance tests and ``sample_u (B, k+1, V)`` uniforms that draw the emitted target token at position
    ``accepted[b]`` (exponential race: ``argmax w / -log(u)``, the same draw as Gumbel-max on ``log w``). For tests (identical numbers into a reference) and debugging."""
    B, k, V, target, draft = _prep(target_logprobs, draft_logprobs, draft_tokens, draft_lens)
    accepted = _accept_count(target, draft, draft_tokens, draft_lens, accept_u, k)
    weights = _final_weights(target, draft, draft_tokens, draft_lens, accepted, k)
    last = _race(weights, sample_u[mx.arange(B), accepted])
    return _emit(draft_tokens, accepted, last, k)


def stochastic_accept(
    target_logprobs: mx.array,
    draft_logprobs: Optional[mx.array],
    draft_tokens: mx.array,
    draft_lens: mx.array,
    seeds: mx.array,
    steps: mx.array,
) -> AcceptResult:
    """Exact speculative sampling, per row, vectorised.

    target_logprobs (B, k+1, V): the target's *processed* log-probs at ``[last, d_1..d_k]`` (see
    :func:`processed_logprobs`). draft_logprobs (B, k, V): the drafter's processed log-probs ``q`` that
    ``d_i`` were drawn from, or ``None`` for a deterministic drafter (``q`` one-hot on ``d_i``).
    draft_tokens (B, k), draft_lens (B,); seeds (B,) uint32 per-row seed; steps (B,) uint32: the output
    index of the first token this verification emits (the row's output-token count so far).
    """
    B, k, V, target, draft = _prep(target_logprobs, draft_logprobs, draft_tokens, draft_lens)
    seeds = seeds.astype(mx.uint32)
    steps = steps.astype(mx.uint32)
    accepted = _accept_count(target, draft, draft_tokens, draft_lens, accept_uniforms(seeds, steps, k), k)
    weights = _final_weights(target, draft, draft_tokens, draft_lens, accepted, k)
    last = _race(weights, _columns_from_keys(_row_keys(seeds, steps + accepted.astype(mx.uint32)), V))
    return _emit(draft_tokens, accepted, last, k)


# ---------------------------------------------------------------------------
# Processed distributions
# ---------------------------------------------------------------------------


def processed_logprobs(logprobs: mx.array, params: SamplingArrays) -> mx.array:
    """Normalised log-probs -> log of the distribution each row actually samples from.

    logprobs (B, V) or (B, n, V) (n positions per row share the row's parameters); returns float32 of the
    same shape. Sampled rows: top_p -> min_p -> top_k (``kernels.sampling`` semantics), times
    1/temperature, log-softmax. Greedy rows (temperature 0): one-hot on the argmax of the *unfiltered*
    log-probs (0 there, -inf elsewhere), like ``kernels.sampling.sample``. Penalties are not applied here:
    apply them to the logits first (with each position's own context) if a row has any.
    """
    squeeze = logprobs.ndim == 2
    lp = logprobs[:, None, :] if squeeze else logprobs
    B, n, V = lp.shape
    flat = lp.reshape(B * n, V).astype(mx.float32)

    def rep(a: mx.array) -> mx.array:
        return mx.repeat(a, n, axis=0) if n > 1 else a

    temp = rep(params.temperature)
    filtered = _filter(
        flat, rep(params.top_p), rep(params.top_k), rep(params.min_p),
        params.any_top_p, params.any_min_p, params.any_top_k,
    )
    t = temp[:, None]
    greedy = t == 0.0
    scaled = filtered * (1.0 / mx.where(greedy, 1.0, t))
    sampled = scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
    top = mx.argmax(flat, axis=-1)[:, None]
    onehot = mx.where(mx.arange(V)[None, :] == top, 0.0, _NEG_INF)
    out = mx.where(greedy, onehot, sampled).reshape(B, n, V)
    return out[:, 0, :] if squeeze else out


# Per-row KV rollback is a capability of the cache-layer protocol (`caches.layers.rollback_rows`): only plain
# KV batch layers declare it. Imported here because the acceptance rules and the rollback go together.
