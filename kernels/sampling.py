"""Batched, vectorised sampling kernels.

The engine decodes B rows per step and every row carries its own sampling
parameters.  Everything here works on whole ``(B, V)`` arrays with per-row
``(B,)`` parameter arrays, so a step never loops over rows in Python.

Semantics follow ``mlx_lm.sample_utils`` (mlx-lm 0.32):

* penalties: ``make_repetition_penalty``, ``make_presence_penalty`` then
  ``make_frequency_penalty`` (the order ``make_logits_processors`` builds them
  in);
* filters: ``apply_top_p``, ``apply_min_p`` (``min_tokens_to_keep=1``),
  ``apply_top_k`` in ``make_sampler`` order, each only where mlx-lm would
  enable it (``0 < top_p < 1``, ``min_p != 0``, ``top_k > 0``);
* greedy rows (temperature 0): ``mx.argmax`` of the unfiltered log-probs,
  exactly ``greedy_sampler``;
* sampled rows: ``filtered * (1 / temperature)`` then a categorical draw (a row with no filter draws from its
  logits: the log-sum-exp shift changes no draw; ``sample``);
* where only tokens are wanted, greedy rows may skip the log-softmax where it cannot change the token
  (``GreedyPick``), and a batch of greedy and sampled rows splits so that each group computes only what its
  tokens need (``draw_tokens``).

The categorical draw is Gumbel-max with noise from a counter-based hash of
``(seed[row], step[row], vocab index)`` built from MLX ``uint32`` ops -- the
global ``mx.random`` state is never touched, so a row's token depends only on
its own seed, its own step counter and its own log-probs: a seeded request
gives the same tokens alone and anywhere inside any batch.

Differences from mlx-lm, both deliberate:

* ``apply_top_k`` keeps exactly ``k`` tokens and breaks ties at the k-th value
  arbitrarily (argpartition order); here top-k keeps every token whose value
  is ``>=`` the row's k-th largest value, so exact ties at the boundary are all
  kept (same sets whenever the k-th value is unique).  ``top_k >= V`` is
  treated as off instead of raising.
* The random stream is ours (hash-based), not ``mx.random.categorical``, so a
  seeded row does not reproduce mlx-lm's tokens -- it reproduces its own, at
  any batch position.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

__all__ = [
    "RowSampling",
    "SamplingArrays",
    "apply_penalties",
    "filter_logprobs",
    "sample",
    "logprobs_from_logits",
    "GreedyPick",
    "greedy_pick",
    "DrawGroups",
    "TokenDraw",
    "draw_tokens",
    "most_likely",
    "sample_tokens",
    "DEFAULT_PENALTY_CONTEXT",
    "set_compile",
]

#: Default penalty window, like mlx-lm's ``repetition_context_size``.
DEFAULT_PENALTY_CONTEXT = 20

_U32 = 0xFFFFFFFF


# ---------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RowSampling:
    """Sampling parameters of one request (one batch row)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0) or math.isinf(self.temperature):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not (0.0 <= self.top_p <= 1.0):
            raise ValueError(f"top_p must be in [0, 1] (0 or 1 => off), got {self.top_p}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 => off), got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1] (0 => off), got {self.min_p}")
        if not math.isfinite(self.presence_penalty):
            raise ValueError(f"presence_penalty must be finite, got {self.presence_penalty}")
        if not math.isfinite(self.frequency_penalty):
            raise ValueError(f"frequency_penalty must be finite, got {self.frequency_penalty}")
        if not (self.repetition_penalty > 0.0) or math.isinf(self.repetition_penalty):
            raise ValueError(
                f"repetition_penalty must be finite and > 0 (1 => off), got {self.repetition_penalty}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalty(self) -> bool:
        return self.presence_penalty != 0.0 or self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0

    @property
    def filtered(self) -> bool:
        """A sampled row with a filter set (top_p in (0, 1), min_p != 0, top_k > 0): it draws from its filtered
        log-softmax; a sampled row without one draws from its logits (`sample`)."""
        return not self.greedy and (0.0 < self.top_p < 1.0 or self.min_p != 0.0 or self.top_k > 0)


@dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling parameters for one decode step, as (B,) MLX arrays."""

    temperature: mx.array  # float32, 0 => greedy for that row
    top_p: mx.array  # float32 in (0, 1]; 1 => off
    top_k: mx.array  # int32; 0 => off
    min_p: mx.array  # float32 in [0, 1); 0 => off
    presence_penalty: mx.array  # float32; 0 => off
    repetition_penalty: mx.array  # float32 > 0; 1 => off
    frequency_penalty: mx.array  # float32; 0 => off
    seed: mx.array  # uint32 per-row seed
    all_greedy: bool  # every row has temperature 0 (fast path: plain argmax)
    any_penalty: bool  # some row has a penalty (skip penalty work otherwise)
    # some row is greedy (temperature 0); True = "maybe", as the flags below
    any_greedy: bool = True
    # Optional python flags (default True = "maybe"): let the sampled path skip
    # the sort / min-p work when no *sampled* row uses that filter. from_rows
    # sets them exactly; leaving them True is always correct, just slower.
    any_top_p: bool = True
    any_top_k: bool = True
    any_min_p: bool = True
    # some row has a frequency penalty (its scatter is skipped otherwise); True = "maybe", as above
    any_frequency_penalty: bool = True
    # Largest top_k among sampled rows (-1 = unknown). When no sampled row uses
    # top_p, the sampled path then uses mx.topk(bucket >= max_top_k) instead of a
    # full-vocabulary sort (~10x cheaper on CPU at V=32000).
    max_top_k: int = -1

    @property
    def batch_size(self) -> int:
        return int(self.temperature.shape[0])

    def repeated(self, n: int) -> "SamplingArrays":
        """Each row's parameters n times in a row: the rows of a (B * n, V) reshape of (B, n, V) logits."""
        arrays = {f.name: mx.repeat(getattr(self, f.name), n, axis=0) for f in dataclasses.fields(self)
                  if isinstance(getattr(self, f.name), mx.array)}
        return dataclasses.replace(self, **arrays)

    @property
    def needs_logprobs(self) -> bool:
        """Some row's token reads the log-softmax: a greedy row (its argmax), or a sampled row with a filter."""
        return self.any_greedy or self.any_top_p or self.any_min_p or self.any_top_k

    @classmethod
    def from_rows(cls, rows: Sequence[RowSampling]) -> "SamplingArrays":
        rows = list(rows)
        temp = np.array([r.temperature for r in rows], dtype=np.float32)
        top_p = np.array([r.top_p for r in rows], dtype=np.float32)
        top_k = np.array([int(r.top_k) for r in rows], dtype=np.int32)
        min_p = np.array([r.min_p for r in rows], dtype=np.float32)
        pres = np.array([r.presence_penalty for r in rows], dtype=np.float32)
        rep = np.array([r.repetition_penalty for r in rows], dtype=np.float32)
        freq = np.array([r.frequency_penalty for r in rows], dtype=np.float32)
        seed = np.array([int(r.seed) & _U32 for r in rows], dtype=np.uint32)
        sampled = temp != 0.0
        return cls(
            temperature=mx.array(temp),
            top_p=mx.array(top_p),
            top_k=mx.array(top_k),
            min_p=mx.array(min_p),
            presence_penalty=mx.array(pres),
            repetition_penalty=mx.array(rep),
            frequency_penalty=mx.array(freq),
            seed=mx.array(seed),
            all_greedy=bool(not sampled.any()),
            any_greedy=bool((~sampled).any()),
            any_penalty=bool(((pres != 0.0) | (rep != 1.0) | (freq != 0.0)).any()),
            any_top_p=bool((sampled & (top_p > 0.0) & (top_p < 1.0)).any()),
            any_top_k=bool((sampled & (top_k > 0)).any()),
            any_min_p=bool((sampled & (min_p != 0.0)).any()),
            any_frequency_penalty=bool((freq != 0.0).any()),
            max_top_k=int(np.where(sampled, top_k, 0).max(initial=0)),
        )


# ---------------------------------------------------------------------------
# Penalties
# ---------------------------------------------------------------------------


def _context_mask(context: mx.array, vocab_size: int) -> mx.array:
    """(B, W) ids padded with -1 (or any out-of-range id) -> (B, V) bool presence mask."""
    B = context.shape[0]
    ctx = context.astype(mx.int32)
    valid = (ctx >= 0) & (ctx < vocab_size)
    idx = mx.where(valid, ctx, vocab_size)  # padding goes to a spare column
    mask = mx.zeros((B, vocab_size + 1), dtype=mx.bool_)
    mask = mx.put_along_axis(mask, idx, mx.array(True), axis=-1)
    return mask[:, :vocab_size]


def apply_penalties(
    logits: mx.array, context: mx.array, params: SamplingArrays
) -> mx.array:
    """Repetition, presence then frequency penalty, per row, on tokens present in ``context``.

    logits (B, V); context (B, W) int32 recent token ids per row padded with -1
    (W = penalty window, default 20 like mlx-lm's ``repetition_context_size``).
    Repetition penalty as mlx-lm's ``make_repetition_penalty`` (logit < 0 ->
    logit * p, else logit / p); presence penalty as ``make_presence_penalty``
    (subtract once per distinct token present); frequency penalty as
    ``make_frequency_penalty`` (subtract once per occurrence, one subtraction
    at a time as its scatter does, so the rounding is the same). Rows with a
    penalty off are unchanged bit-for-bit.
    """
    if context.ndim != 2 or context.shape[0] != logits.shape[0]:
        raise ValueError(
            f"context must be (B, W) with B={logits.shape[0]}, got {tuple(context.shape)}"
        )
    if context.shape[1] == 0:
        return logits
    dtype = logits.dtype
    present = _context_mask(context, logits.shape[-1])

    rep = params.repetition_penalty[:, None]
    rep_on = present & (rep != 1.0)
    rep_d = rep.astype(dtype)
    penalised = mx.where(logits < 0, logits * rep_d, logits / rep_d)
    logits = mx.where(rep_on, penalised, logits)

    pres = params.presence_penalty[:, None]
    pres_on = present & (pres != 0.0)
    logits = mx.where(pres_on, logits - pres.astype(dtype), logits)
    if params.any_frequency_penalty:
        logits = _frequency_penalty(logits, context, params.frequency_penalty)
    return logits


def _frequency_penalty(logits: mx.array, context: mx.array, penalty: mx.array) -> mx.array:
    """Subtract each row's penalty from a token's logit once per occurrence of it in the row's context (padding
    ids land in a spare column). A scatter like mlx-lm's: repeated ids subtract one after another, and a row
    whose penalty is 0 subtracts 0.0, which leaves every logit as it was."""
    B, V = logits.shape
    ctx = context.astype(mx.int32)
    idx = mx.where((ctx >= 0) & (ctx < V), ctx, V)
    rows = mx.broadcast_to(mx.arange(B, dtype=mx.int32)[:, None], idx.shape)
    amounts = mx.broadcast_to(penalty.astype(logits.dtype)[:, None], idx.shape)
    spare = mx.concatenate([logits, mx.zeros((B, 1), dtype=logits.dtype)], axis=1)
    return spare.at[rows, idx].subtract(amounts)[:, :V]


# ---------------------------------------------------------------------------
# Filters
# ---------------------------------------------------------------------------


def _filter(
    logprobs: mx.array,
    top_p: mx.array,
    top_k: mx.array,
    min_p: mx.array,
    use_top_p: bool,
    use_min_p: bool,
    use_top_k: bool,
    kmax: int = -1,
) -> mx.array:
    """top_p -> min_p -> top_k on every row (static ``use_*`` flags skip work).

    ``kmax`` > 0 promises that rows whose top-k result matters have ``top_k <=
    kmax``; then, without top_p, only the ``kmax`` largest values are sorted.
    """
    V = logprobs.shape[-1]
    neg_inf = mx.array(-float("inf"), logprobs.dtype)
    partial_k = use_top_k and not use_top_p and 0 < kmax < V
    if use_top_p or (use_top_k and not partial_k):
        sorted_lp = mx.sort(logprobs, axis=-1)  # ascending, length V
    elif partial_k:
        sorted_lp = mx.sort(mx.topk(logprobs, kmax, axis=-1), axis=-1)  # ascending, length kmax
    else:
        sorted_lp = None
    out = logprobs

    if use_top_p:
        # mlx-lm apply_top_p, with a per-row threshold.
        p = top_p[:, None]
        sorted_probs = mx.exp(sorted_lp.astype(mx.float32))
        mass_above = mx.cumsum(sorted_probs, axis=-1, reverse=True, inclusive=False)
        total_mass = mass_above[..., :1] + sorted_probs[..., :1]
        num_dropped = (mass_above >= p * total_mass).sum(axis=-1, keepdims=True)
        num_dropped = mx.minimum(num_dropped, V - 1)
        threshold = mx.take_along_axis(sorted_lp, num_dropped, axis=-1)
        on = (p > 0.0) & (p < 1.0)
        out = mx.where(on & (out < threshold), neg_inf, out)

    if use_min_p:
        # mlx-lm apply_min_p with min_tokens_to_keep=1 (the max always survives).
        m = min_p[:, None]
        top = mx.max(out, axis=-1, keepdims=True)
        scaled = top + mx.log(m).astype(out.dtype)
        on = m != 0.0
        out = mx.where(on & (out < scaled), neg_inf, out)

    if use_top_k:
        # Earlier filters only push values below a threshold to -inf and keep
        # the order of the rest, so the k-th largest of ``out`` is the k-th
        # largest of the original row if it survived, else -inf (keep all).
        k = top_k[:, None].astype(mx.int32)
        on = (k > 0) & (k < V)
        n = sorted_lp.shape[-1]  # V, or kmax for the partial sort
        kth_idx = mx.clip(n - k, 0, n - 1)
        kth = mx.take_along_axis(sorted_lp, kth_idx, axis=-1)
        out = mx.where(on & (out < kth), neg_inf, out)

    return out


def filter_logprobs(logprobs: mx.array, params: SamplingArrays) -> mx.array:
    """Apply, per row, in mlx-lm make_sampler order: top_p, min_p, top_k.

    Masked tokens become -inf; rows with a filter off are unchanged. Applies to
    every row regardless of temperature (``sample`` ignores it for greedy rows).
    """
    return _filter(
        logprobs,
        params.top_p,
        params.top_k,
        params.min_p,
        True,
        True,
        True,
    )


# ---------------------------------------------------------------------------
# Counter-based noise
# ---------------------------------------------------------------------------


def _fmix32(h: mx.array) -> mx.array:
    """murmur3 32-bit finaliser (a bijection on uint32 with full avalanche)."""
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    h = h ^ (h >> 16)
    return h


def _row_keys(seed: mx.array, step: mx.array) -> mx.array:
    """(B,) uint32 key per (seed, step)."""
    s = _fmix32(seed.astype(mx.uint32) * 0x9E3779B1 + 0x7F4A7C15)
    return _fmix32(s ^ (step.astype(mx.uint32) * 0x27D4EB2F + 0x165667B1))


def _hash_uniform(seed: mx.array, step: mx.array, vocab_size: int) -> mx.array:
    """(B, V) float32 uniforms in [2^-24, 1 - 2^-24], a pure function of
    (seed[row], step[row], column)."""
    key = _row_keys(seed, step)[:, None]
    idx = mx.arange(vocab_size, dtype=mx.uint32)[None, :]
    x = _fmix32(idx * 0xCC9E2D51 + key)
    x = _fmix32(x ^ key)
    # Top 23 bits + 0.5, scaled: exact in float32, strictly inside (0, 1).
    return ((x >> 9).astype(mx.float32) + 0.5) * (1.0 / (1 << 23))


def _gumbel(seed: mx.array, step: mx.array, vocab_size: int) -> mx.array:
    u = _hash_uniform(seed, step, vocab_size)
    return -mx.log(-mx.log(u))


# ---------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------


def _row_has_filter(top_p: mx.array, top_k: mx.array, min_p: mx.array) -> mx.array:
    """(B, 1) whether each row has a filter set: `RowSampling.filtered` (for a sampled row) on the device."""
    return (((top_p > 0.0) & (top_p < 1.0)) | (min_p != 0.0) | (top_k > 0))[:, None]


def _sampled_impl(
    logprobs: mx.array,
    logits: mx.array,
    temperature: mx.array,
    top_p: mx.array,
    top_k: mx.array,
    min_p: mx.array,
    seed: mx.array,
    step: mx.array,
    *,
    use_top_p: bool,
    use_min_p: bool,
    use_top_k: bool,
    kmax: int = -1,
    use_greedy: bool = True,
) -> mx.array:
    V = logprobs.shape[-1]
    if use_top_p or use_min_p or use_top_k:  # filtered rows draw from their filtered log-softmax, the rest from logits
        filtered = _filter(logprobs, top_p, top_k, min_p, use_top_p, use_min_p, use_top_k, kmax)
        base = mx.where(_row_has_filter(top_p, top_k, min_p), filtered, logits)
    else:  # no filter anywhere: the log-softmax is not read here (a greedy row's argmax below aside)
        base = logits
    t = temperature[:, None]
    greedy = t == 0.0
    inv_t = 1.0 / mx.where(greedy, 1.0, t)
    scores = base.astype(mx.float32) * inv_t + _gumbel(seed, step, V)
    sampled_tok = mx.argmax(scores, axis=-1)
    if not use_greedy:  # no greedy row: its argmax would be one more pass over the vocabulary for nothing
        return sampled_tok
    return mx.where(temperature == 0.0, mx.argmax(logprobs, axis=-1), sampled_tok)


# mx.compile for the sampled path. Measured on the CPU backend (2 shared cores, B=32, median,
# interleaved runs): compiled is 4-20% faster at steady state (V=512 mixed
# 1.37 vs 1.58 ms; V=32000 top_k-only 41 vs 53 ms) but every fused kernel is
# JIT-built with the system C++ compiler the first time (~7-18 s for the mixed
# graph on a cold $TMPDIR/mlx cache, ~2 s more per new vocabulary size; new
# batch sizes are free). So "auto" compiles on a GPU (Metal JIT is cheap,
# mlx-lm compiles its samplers too) and runs eagerly on CPU.
# Non-shapeless compile: one trace per (B, V, dtype), cached by MLX.
_USE_COMPILE: Optional[bool] = None  # None = auto


def set_compile(enabled: Optional[bool]) -> None:
    """Force mx.compile on/off for the sampled path; ``None`` restores auto
    (compile only when the default device is a GPU)."""
    global _USE_COMPILE
    _USE_COMPILE = enabled


def _compile_enabled() -> bool:
    if _USE_COMPILE is not None:
        return _USE_COMPILE
    return mx.default_device().type == mx.DeviceType.gpu


@lru_cache(maxsize=None)
def _sampled_fn(
    use_top_p: bool, use_min_p: bool, use_top_k: bool, compiled: bool, kmax: int = -1, use_greedy: bool = True
):
    def fn(logprobs, logits, temperature, top_p, top_k, min_p, seed, step):
        return _sampled_impl(
            logprobs,
            logits,
            temperature,
            top_p,
            top_k,
            min_p,
            seed,
            step,
            use_top_p=use_top_p,
            use_min_p=use_min_p,
            use_top_k=use_top_k,
            kmax=kmax,
            use_greedy=use_greedy,
        )

    return mx.compile(fn) if compiled else fn


def _kmax_bucket(max_top_k: int, vocab_size: int) -> int:
    """Round max_top_k up to a power of two (>= 16) so few compiled variants
    exist; -1 (full sort) when unknown or not smaller than the vocabulary."""
    if max_top_k <= 0:
        return -1
    b = max(16, 1 << (max_top_k - 1).bit_length())
    return b if b < vocab_size else -1


def sample(logprobs: mx.array, params: SamplingArrays, step: mx.array, logits: mx.array | None = None) -> mx.array:
    """(B, V) normalised log-probs -> (B,) uint32 token ids.

    Greedy rows (temperature 0) take the argmax of the *unfiltered* logprobs,
    like mlx-lm's ``greedy_sampler``. Sampled rows: filter (top_p, min_p,
    top_k), multiply by 1/temperature, Gumbel-max with noise hashed from
    (seed[row], step[row], vocab index). ``step`` is (B,) uint32: the row's
    output-token index.

    A sampled row with no filter (`RowSampling.filtered`) draws from ``logits`` (the log-probs before the
    log-sum-exp shift: the shift moves all of a row's scores alike, so the draw has the same distribution, and a
    batch where no row reads the log-softmax never computes it); omitted, the log-probs serve. Which values a row
    draws from depends on its own parameters only, so a seeded row draws the same token alone and in any batch.
    The two can give different tokens only where a row's two best scores lie within a few units of rounding.
    """
    if params.all_greedy:
        return mx.argmax(logprobs, axis=-1)
    step = mx.array(step) if not isinstance(step, mx.array) else step
    if step.ndim == 0:
        step = mx.broadcast_to(step, (logprobs.shape[0],))
    fn = _sampled_fn(
        params.any_top_p,
        params.any_min_p,
        params.any_top_k,
        _compile_enabled(),
        _kmax_bucket(params.max_top_k, logprobs.shape[-1]) if params.any_top_k else -1,
        params.any_greedy,
    )
    return fn(
        logprobs,
        logprobs if logits is None else logits,
        params.temperature,
        params.top_p,
        params.top_k,
        params.min_p,
        params.seed,
        step.astype(mx.uint32),
    )


def logprobs_from_logits(logits: mx.array) -> mx.array:
    """logits - logsumexp(logits), per row (as mlx-lm's generate_step)."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


# Machine epsilon of the dtypes logits come in: one rounding is off by at most half of it, relative to the value;
# `logits - c` rounds at most twice (a float32 intermediate, then the dtype), so by at most `eps` (`separated`).
_EPS = {mx.float32: 2.0 ** -23, mx.bfloat16: 2.0 ** -7, mx.float16: 2.0 ** -10}


@dataclass(frozen=True)
class GreedyPick:
    """Every row's greedy token, `argmax(logprobs_from_logits(logits))` as mlx-lm's greedy sampler takes it, computed
    without the log-softmax where that provably gives the same token (`greedy_pick`).

    Why: the log-softmax exponentiates the whole vocabulary of every row, scalar on MLX's CPU backend (about 11 ns
    an element: 90 ms a decode step at batch 32 with a 152k vocabulary, and a tenth of a tiny model's tick), only
    for greedy rows to take its argmax. Subtracting the row's log-sum-exp c is monotonic, so the argmax can change
    only where rounding `x - c` merges the best logit with a smaller one: the best and the runner-up must lie
    within the rounding error of `|best - c|` (at most log V, plus c's own rounding). Where the gap is wider the
    plain argmax is the token; elsewhere (bfloat16 near-ties, non-finite logits) the row's log-softmax is
    computed as before. `arrays()` are evaluated with the tick's other work; `tokens()` then decides on the host."""

    logits: mx.array  # (..., V)
    argmax: mx.array  # (...) lazy
    best: mx.array
    runner_up: mx.array  # the largest logit below `best` (-inf when there is none); both float32

    def arrays(self) -> tuple[mx.array, mx.array, mx.array]:
        return self.argmax, self.best, self.runner_up

    def tokens(self) -> tuple[list, int]:
        """(the tokens as nested lists shaped like `argmax`, how many positions took their log-softmax); call after
        evaluating `arrays()`. The argmax where the gap is provably wide enough, the log-softmax's argmax (one more
        evaluation, of those positions only) where it is not. Decided in plain Python: a tick holds a few dozen
        positions, where numpy's per-call costs came to more than the arithmetic (50 us a tick)."""
        picked, best, runner_up = _flat(self.argmax), _flat(self.best), _flat(self.runner_up)
        eps = _EPS.get(self.logits.dtype, 2.0 ** -7)  # an unknown float type: bfloat16's, the coarsest
        log_v = math.log(self.logits.shape[-1]) + 1
        unsure = [i for i, (b, r) in enumerate(zip(best, runner_up)) if not separated(b, r, eps, log_v)]
        if unsure:
            flat = self.logits.reshape(-1, self.logits.shape[-1])
            exact = mx.argmax(logprobs_from_logits(flat[mx.array(unsure)]), axis=-1).tolist()
            for i, token in zip(unsure, exact):
                picked[i] = token
        if self.argmax.ndim == 2:  # (B, w): back to one list per row
            w = self.argmax.shape[-1]
            picked = [picked[i:i + w] for i in range(0, len(picked), w)]
        return picked[0] if self.argmax.ndim == 0 else picked, len(unsure)


def _flat(x: mx.array) -> list:
    """An evaluated (B,) or (B, w) array's values as one flat list, row by row."""
    if x.ndim > 2:
        raise ValueError(f"greedy picks are (B,) or (B, w), got shape {x.shape}")
    values = x.tolist()
    return [values] if x.ndim == 0 else values if x.ndim == 1 else [v for row in values for v in row]


def separated(best: float, runner_up: float, eps: float, log_v: float) -> bool:
    """Whether rounding `logits - c` (c the row's log-sum-exp as computed, rounded in a dtype of machine epsilon
    `eps`) cannot bring the runner-up level with the best. Each rounded difference is off by at most `eps` times
    its magnitude (two roundings of eps / 2), and a value g below the best sits at |best - c| + g from c, so the two
    stay apart when g (1 - eps) > 2 eps |best - c|. |best - c| is at most log V for the exact log-sum-exp; 1 more
    (in `log_v`: log V + 1) covers how far a computed one may be off (a summation error far beyond what V float32
    terms make), and |best| eps its rounding in the dtype. The threshold is twice that, to spare. False for a
    non-finite best (never assumed); the runner-up is below the best, so finite or -inf."""
    return math.isfinite(best) and best - runner_up > (4 * eps / (1 - eps)) * (log_v + abs(best) * eps)


def greedy_pick(logits: mx.array) -> GreedyPick:
    """The lazy parts of `GreedyPick` over the last axis of `logits`: the argmax, the best value and the
    runner-up (one comparison, one select, one max: no exponentials)."""
    argmax = mx.argmax(logits, axis=-1, keepdims=True)
    best = mx.take_along_axis(logits, argmax, axis=-1)
    runner_up = mx.max(mx.where(logits < best, logits, -mx.inf), axis=-1)
    best = best[..., 0]
    if logits.dtype != mx.float32:  # float32 holds every bfloat16 and float16 value exactly (numpy reads neither)
        best, runner_up = best.astype(mx.float32), runner_up.astype(mx.float32)
    return GreedyPick(logits, argmax[..., 0], best, runner_up)


@dataclass(frozen=True)
class DrawGroups:
    """A batch's rows split for `draw_tokens`: the greedy rows and the sampled rows (by index, in batch order),
    and the sampled rows' own parameters. Made once per batch composition."""

    greedy: tuple[int, ...]
    sampled: tuple[int, ...]
    sampled_params: SamplingArrays | None  # None when no row is sampled

    @classmethod
    def from_rows(cls, rows: Sequence[RowSampling]) -> "DrawGroups":
        rows = list(rows)
        sampled = tuple(i for i, row in enumerate(rows) if not row.greedy)
        return cls(greedy=tuple(i for i, row in enumerate(rows) if row.greedy), sampled=sampled,
                   sampled_params=SamplingArrays.from_rows([rows[i] for i in sampled]) if sampled else None)


@dataclass(frozen=True)
class TokenDraw:
    """Every row's token without the batch's log-softmax (`draw_tokens`): the greedy rows' `GreedyPick` and the
    sampled rows' draws, evaluated together (`arrays()`), then put back in batch order on the host (`tokens()`).
    A caller that wants some rows' log-probs takes them of `logits`, those rows only."""

    groups: DrawGroups
    pick: GreedyPick | None
    drawn: mx.array | None  # (len(groups.sampled),)
    logits: mx.array  # (B, V) what the tokens were chosen from: the logits, penalised (for rows' log-probs)

    def arrays(self) -> tuple[mx.array, ...]:
        return (*(self.pick.arrays() if self.pick is not None else ()), *(() if self.drawn is None else (self.drawn,)))

    def tokens(self) -> tuple[list[int], int]:
        """(every row's token, how many greedy rows took their log-softmax); call after evaluating `arrays()`."""
        out = [0] * (len(self.groups.greedy) + len(self.groups.sampled))
        recomputed = 0
        if self.pick is not None:
            picked, recomputed = self.pick.tokens()
            for i, token in zip(self.groups.greedy, picked):
                out[i] = token
        if self.drawn is not None:
            for i, token in zip(self.groups.sampled, self.drawn.tolist()):
                out[i] = token
        return out, recomputed


def draw_tokens(logits: mx.array, params: SamplingArrays, groups: DrawGroups, step: mx.array,
                context: Optional[mx.array] = None) -> TokenDraw:
    """The tokens `sample_tokens` gives, without the whole batch's log-probs: penalties as there, then the greedy rows
    by `greedy_pick` and the sampled rows by `sample` on their own rows, so the log-softmax is computed only for
    sampled rows with a filter (and for a greedy row only where rounding could change its argmax). A mixed batch
    otherwise pays the log-softmax of every row, and the sampled rows' noise is not computed for greedy rows.

    Each row's token is the one `sample_tokens` gives it: a greedy row's pick is its log-softmax's argmax by
    construction, and a sampled row's draw is row-wise (its log-softmax, filter and noise do not depend on the
    other rows)."""
    if params.any_penalty and context is not None:
        logits = apply_penalties(logits, context, params)
    whole = len(groups.greedy) + len(groups.sampled) == logits.shape[0]
    if not whole:
        raise ValueError(f"draw groups of {len(groups.greedy) + len(groups.sampled)} rows for {logits.shape[0]}")

    def rows(index: tuple[int, ...]) -> mx.array:
        return logits if len(index) == logits.shape[0] else logits[mx.array(index)]

    pick = greedy_pick(rows(groups.greedy)) if groups.greedy else None
    drawn = None
    if groups.sampled:
        own = rows(groups.sampled)
        steps = step if len(groups.sampled) == logits.shape[0] else step[mx.array(groups.sampled)]
        drawn = sample(logprobs_from_logits(own), groups.sampled_params, steps, logits=own)
    return TokenDraw(groups, pick, drawn, logits)


def most_likely(logprobs: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """(ids, values) of each row's k largest logprobs (k <= vocabulary), most likely first: a partition, then a
    sort of the k only."""
    candidates = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]  # the k largest, unordered
    values = mx.take_along_axis(logprobs, candidates, axis=-1)
    order = mx.argsort(-values, axis=-1)
    return mx.take_along_axis(candidates, order, axis=-1), mx.take_along_axis(values, order, axis=-1)


def sample_tokens(
    logits: mx.array,
    params: SamplingArrays,
    step: mx.array,
    context: Optional[mx.array] = None,
) -> tuple[mx.array, mx.array]:
    """Penalties (if ``params.any_penalty`` and ``context`` given) -> logprobs -> sample.

    Returns (tokens (B,), logprobs (B, V)); logprobs are the log-softmax of the
    processed (penalised) logits, before filtering and temperature, like mlx-lm.

    Sampled rows without a filter draw from the (penalised) logits (`sample`), so where no row's token reads the
    log-softmax (`SamplingArrays.needs_logprobs`) it stays lazy: an exponential per vocabulary entry, a third of
    this kernel's time with a 152k vocabulary on the CPU, computed only if the caller reads it.
    """
    if params.any_penalty and context is not None:
        logits = apply_penalties(logits, context, params)
    logprobs = logprobs_from_logits(logits)
    return sample(logprobs, params, step, logits=logits), logprobs
