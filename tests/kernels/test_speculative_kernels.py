"""Tests for kernels.speculative: batched acceptance rules and the per-row KV rollback.

The kernels are compared exactly with plain per-row numpy loops (the stochastic rule with identical
uniforms), the noise is checked to be the counter-based streams it claims to be, the stochastic rule is
checked statistically (emitted tokens distributed as the target, over 20000 seeded rows in one call), and
the rollback is checked against caches that never saw the dropped tokens, with the real tiny model.
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as mlx_cache

from kernels import sampling as ks
from kernels.sampling import RowSampling, SamplingArrays
from kernels.speculative import (
    AcceptResult,
    accept_uniforms,
    greedy_accept,
    greedy_accept_rows,
    pad_drafts,
    processed_logprobs,
    rollback_rows,
    sampled_accept,
    speculative_uniforms,
    stochastic_accept,
    stack_draft_logprobs,
    stochastic_accept_from_uniforms,
)
from scheduler.execution import library


# ---------------------------------------------------------------------------
# Plain references (one row at a time, loops)
# ---------------------------------------------------------------------------


def ref_greedy(logits: np.ndarray, drafts: np.ndarray, lens: np.ndarray) -> list[list[int]]:
    out = []
    for b in range(logits.shape[0]):
        emitted = []
        for i in range(int(lens[b])):
            top = int(np.argmax(logits[b, i]))
            if int(drafts[b, i]) != top:
                break
            emitted.append(top)
        emitted.append(int(np.argmax(logits[b, len(emitted)])))
        out.append(emitted)
    return out


def ref_stochastic(p: np.ndarray, q: np.ndarray | None, drafts, lens, accept_u, sample_u) -> list[list[int]]:
    """The textbook rule, row by row, float32, with the given uniforms."""
    p = p.astype(np.float32)
    q = None if q is None else q.astype(np.float32)
    out = []
    with np.errstate(divide="ignore", invalid="ignore"):
        for b in range(p.shape[0]):
            emitted = []
            a = 0
            n = int(lens[b])
            while a < n:
                d = int(drafts[b, a])
                ratio = p[b, a, d] - (0.0 if q is None else q[b, a, d])
                if np.log(accept_u[b, a]) <= ratio:
                    emitted.append(d)
                    a += 1
                else:
                    break
            w = np.exp(p[b, a])
            if a < n:  # rejection: the residual
                d = int(drafts[b, a])
                if q is None:
                    w = w.copy()
                    w[d] = 0.0
                else:
                    w = np.maximum(np.exp(p[b, a]) - np.exp(q[b, a]), np.float32(0))
                if not (w > 0).any():
                    w = np.exp(p[b, a])
            # a draw from normalize(w) by exponential race (= Gumbel-max on log w)
            emitted.append(int(np.argmax(w / -np.log(sample_u[b, a]))))
            out.append(emitted)
    return out


def rows_of(res: AcceptResult) -> list[list[int]]:
    emitted, n = np.array(res.emitted), np.array(res.num_emitted)
    assert (np.array(res.accepted) + 1 == n).all()
    for b in range(len(n)):
        assert (emitted[b, n[b]:] == -1).all()
    return [emitted[b, : n[b]].tolist() for b in range(len(n))]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return (x - np.log(np.exp(x).sum(axis=-1, keepdims=True))).astype(np.float32)


def random_case(B: int, k: int, V: int, seed: int, sharp: float = 2.0):
    """Target and draft log-probs that agree often (q is p plus noise), drafts drawn from q, mixed lens."""
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(B, k + 1, V)) * sharp
    p = log_softmax(base)
    q = log_softmax(base[:, :k] + rng.normal(size=(B, k, V)) * 0.7)
    drafts = np.zeros((B, k), dtype=np.int32)
    for b in range(B):
        for i in range(k):
            drafts[b, i] = rng.choice(V, p=np.exp(q[b, i].astype(np.float64)) / np.exp(q[b, i].astype(np.float64)).sum())
    lens = rng.integers(0, k + 1, size=B).astype(np.int32)
    lens[:4] = k  # some full-length rows for sure
    return p, q, drafts, lens


# ---------------------------------------------------------------------------
# Greedy
# ---------------------------------------------------------------------------


def _greedy_case(seed: int, B: int = 64, k: int = 5, V: int = 40):
    """Random target logits, drafts that follow the target's argmax except where a quarter are corrupted, and
    random draft lengths: (logits, the argmax, drafts, lengths)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(B, k + 1, V)).astype(np.float32)
    top = logits.argmax(-1)
    drafts = top[:, :k].copy()
    corrupt = rng.random((B, k)) < 0.25
    drafts[corrupt] = (drafts[corrupt] + 1 + rng.integers(0, V - 1, size=corrupt.sum())) % V
    lens = rng.integers(0, k + 1, size=B).astype(np.int32)
    return logits, top, drafts, lens


def test_greedy_matches_reference():
    B, k = 64, 5
    logits, _top, drafts, lens = _greedy_case(0, B, k)
    res = greedy_accept(mx.array(logits), mx.array(drafts), mx.array(lens))
    assert res.emitted.shape == (B, k + 1)
    assert rows_of(res) == ref_greedy(logits, drafts, lens)
    acc = np.array(res.accepted)
    assert acc.min() == 0 and acc.max() == k  # both extremes occur


def test_greedy_on_the_host_equals_greedy_accept():
    """`greedy_accept_rows` (the all-greedy verify tick's decision, from the argmax read back) accepts and emits
    what `greedy_accept` does on the device, row by row, for drafts of every length."""
    logits, top, drafts, lens = _greedy_case(3)
    res = greedy_accept(mx.array(logits), mx.array(drafts), mx.array(lens))
    accepted, emitted = greedy_accept_rows(top.tolist(), [d[:n].tolist() for d, n in zip(drafts, lens)])
    assert accepted == res.accepted.tolist()
    assert emitted == rows_of(res)


def test_greedy_padding_is_ignored_and_bonus_comes_from_the_last_valid_position():
    V = 10
    logits = np.full((2, 4, V), -5.0, dtype=np.float32)
    for i, t in enumerate([3, 4, 5, 6]):
        logits[:, i, t] = 5.0
    # row 0: draft [3, 4] valid, padding would also match (5) but is beyond its length
    # row 1: draft [3, 9, 5]: rejected at position 1 -> emits 3 then the correction 4
    drafts = np.array([[3, 4, 5], [3, 9, 5]], dtype=np.int32)
    lens = np.array([2, 3], dtype=np.int32)
    res = greedy_accept(mx.array(logits), mx.array(drafts), mx.array(lens))
    assert rows_of(res) == [[3, 4, 5], [3, 4]]
    assert res.accepted.tolist() == [2, 1]


def test_greedy_without_drafts_is_argmax():
    logits = mx.array(np.random.default_rng(1).normal(size=(5, 1, 17)).astype(np.float32))
    res = greedy_accept(logits, mx.zeros((5, 0), mx.int32), mx.zeros((5,), mx.int32))
    assert res.accepted.tolist() == [0] * 5
    assert res.emitted[:, 0].tolist() == mx.argmax(logits[:, 0], axis=-1).tolist()


def test_shape_errors():
    with pytest.raises(ValueError):
        greedy_accept(mx.zeros((2, 3, 5)), mx.zeros((2, 3), mx.int32), mx.zeros((2,), mx.int32))
    with pytest.raises(ValueError):
        stochastic_accept(mx.zeros((2, 3, 5)), mx.zeros((2, 2, 4)), mx.zeros((2, 2), mx.int32),
                          mx.zeros((2,), mx.int32), mx.zeros((2,), mx.uint32), mx.zeros((2,), mx.uint32))


def test_pad_drafts():
    tokens, lens = pad_drafts([[5, 6], [], [7, 8, 9]], k=4)
    assert tokens.tolist() == [[5, 6, 0, 0], [0, 0, 0, 0], [7, 8, 9, 0]]
    assert lens.tolist() == [2, 0, 3]
    assert pad_drafts([[1], [2, 3]])[0].shape == (2, 2)
    assert pad_drafts([[], []])[0].shape == (2, 0) and pad_drafts([], k=3)[0].shape == (0, 3)
    assert pad_drafts([])[1].shape == (0,) and pad_drafts([[], []], k=2)[0].tolist() == [[0, 0], [0, 0]]
    with pytest.raises(ValueError):
        pad_drafts([[1, 2, 3]], k=2)


def test_stack_draft_logprobs_mixes_model_and_deterministic_rows():
    V, k = 9, 3
    q0 = mx.log(mx.softmax(mx.array(np.random.default_rng(0).normal(size=(2, V)).astype(np.float32)), axis=-1))
    assert stack_draft_logprobs([[1], [2, 3]], [None, None], k, V) is None
    out = stack_draft_logprobs([[4, 5], [7], []], [q0, None, None], k, V)
    assert out.shape == (3, k, V)
    assert mx.array_equal(out[0, :2], q0) and (np.array(out[0, 2]) == 0).all()
    row1 = np.array(out[1, 0])
    assert row1[7] == 0 and np.isneginf(np.delete(row1, 7)).all()
    with pytest.raises(ValueError):
        stack_draft_logprobs([[1, 2]], [q0[:1]], k, V)


# ---------------------------------------------------------------------------
# Stochastic: exact against the reference with the same uniforms
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("with_q", [True, False])
def test_stochastic_matches_reference_with_same_uniforms(with_q):
    B, k, V = 96, 4, 32
    p, q, drafts, lens = random_case(B, k, V, seed=3 + with_q)
    rng = np.random.default_rng(11)
    accept_u = rng.uniform(1e-6, 1 - 1e-6, size=(B, k)).astype(np.float32)
    sample_u = rng.uniform(1e-6, 1 - 1e-6, size=(B, k + 1, V)).astype(np.float32)
    res = stochastic_accept_from_uniforms(
        mx.array(p), mx.array(q) if with_q else None, mx.array(drafts), mx.array(lens),
        mx.array(accept_u), mx.array(sample_u),
    )
    ref = ref_stochastic(p, q if with_q else None, drafts, lens, accept_u, sample_u)
    assert rows_of(res) == ref
    acc = np.array(res.accepted)
    assert 0 < (acc == lens).mean() < 1 and (acc < lens).any()  # both acceptances and rejections happen


def test_stochastic_hash_noise_is_what_the_kernel_reads():
    B, k, V = 48, 3, 29
    p, q, drafts, lens = random_case(B, k, V, seed=5)
    seeds = mx.array(np.arange(B, dtype=np.uint32) * 7919)
    steps = mx.array(np.random.default_rng(2).integers(0, 1000, size=B).astype(np.uint32))
    args = (mx.array(p), mx.array(q), mx.array(drafts), mx.array(lens))
    direct = stochastic_accept(*args, seeds, steps)
    explicit = stochastic_accept_from_uniforms(*args, *speculative_uniforms(seeds, steps, k, V))
    assert rows_of(direct) == rows_of(explicit)


def test_sample_noise_is_the_plain_sampler_stream_and_accept_noise_is_separate():
    seeds = mx.array([0, 1, 12345, 2**32 - 1], dtype=mx.uint32)
    steps = mx.array([0, 5, 77, 3], dtype=mx.uint32)
    accept_u, sample_u = speculative_uniforms(seeds, steps, 3, 50)
    for i in range(4):
        plain = ks._hash_uniform(seeds, steps + i, 50)
        assert mx.array_equal(sample_u[:, i], plain)
    assert accept_u.shape == (4, 3)
    # the acceptance uniform at output index j does not depend on the position it is read from
    shifted = accept_uniforms(seeds, steps + 1, 2)
    assert mx.array_equal(shifted, accept_u[:, 1:])
    assert float(accept_u.min()) > 0 and float(accept_u.max()) < 1


def test_stochastic_row_is_independent_of_batch_composition():
    B, k, V = 24, 3, 21
    p, q, drafts, lens = random_case(B, k, V, seed=8)
    seeds = np.arange(B, dtype=np.uint32) * 31 + 5
    steps = np.arange(B, dtype=np.uint32) % 7
    full = rows_of(stochastic_accept(mx.array(p), mx.array(q), mx.array(drafts), mx.array(lens),
                                     mx.array(seeds), mx.array(steps)))
    perm = np.random.default_rng(0).permutation(B)[:9]
    part = rows_of(stochastic_accept(mx.array(p[perm]), mx.array(q[perm]), mx.array(drafts[perm]),
                                     mx.array(lens[perm]), mx.array(seeds[perm]), mx.array(steps[perm])))
    assert part == [full[i] for i in perm]
    alone = rows_of(stochastic_accept(mx.array(p[5:6]), None, mx.array(drafts[5:6]), mx.array(lens[5:6]),
                                      mx.array(seeds[5:6]), mx.array(steps[5:6])))
    again = rows_of(stochastic_accept(mx.array(p), None, mx.array(drafts), mx.array(lens),
                                      mx.array(seeds), mx.array(steps)))
    assert alone[0] == again[5]


def test_one_hot_target_reproduces_greedy_accept():
    """Greedy rows in a stochastic batch: processed p is one-hot on the argmax, and the exact rule then
    emits exactly what greedy_accept emits (with a q or without)."""
    B, k, V = 40, 4, 30
    p, q, drafts, lens = random_case(B, k, V, seed=12)
    top = p.argmax(-1)
    use_top = np.random.default_rng(1).random((B, k)) < 0.6
    drafts = np.where(use_top, top[:, :k], drafts).astype(np.int32)
    params = SamplingArrays.from_rows([RowSampling(temperature=0.0)] * B)
    p1 = processed_logprobs(mx.array(p), params)
    assert (np.array(p1) == 0).sum() == B * (k + 1)
    greedy = rows_of(greedy_accept(mx.array(p), mx.array(drafts), mx.array(lens)))
    seeds, steps = mx.arange(B).astype(mx.uint32), mx.zeros((B,), mx.uint32)
    for qq in (mx.array(q), None):
        assert rows_of(stochastic_accept(p1, qq, mx.array(drafts), mx.array(lens), seeds, steps)) == greedy


def test_identical_p_and_q_always_accept():
    B, k, V = 64, 4, 16
    p, _, drafts, _ = random_case(B, k, V, seed=9)
    lens = np.full(B, k, np.int32)
    res = stochastic_accept(mx.array(p), mx.array(p[:, :k]), mx.array(drafts), mx.array(lens),
                            mx.arange(B).astype(mx.uint32), mx.zeros((B,), mx.uint32))
    assert res.accepted.tolist() == [k] * B


def test_none_equals_explicit_one_hot_q():
    B, k, V = 64, 3, 24
    p, _, drafts, lens = random_case(B, k, V, seed=21)
    onehot = np.where(np.arange(V)[None, None, :] == drafts[..., None], 0.0, -np.inf).astype(np.float32)
    seeds, steps = mx.arange(B).astype(mx.uint32) * 3, mx.full((B,), 9, mx.uint32)
    a = stochastic_accept(mx.array(p), None, mx.array(drafts), mx.array(lens), seeds, steps)
    b = stochastic_accept(mx.array(p), mx.array(onehot), mx.array(drafts), mx.array(lens), seeds, steps)
    assert a.accepted.tolist() == b.accepted.tolist()
    assert rows_of(a) == rows_of(b)
    stacked = stack_draft_logprobs([d[:n].tolist() for d, n in zip(drafts, lens)], [None, None] + [None] * (B - 2),
                                   k, V)
    assert stacked is None
    half = stack_draft_logprobs([d[:n].tolist() for d, n in zip(drafts, lens)],
                                [mx.array(onehot[b, : lens[b]]) if b % 2 else None for b in range(B)], k, V)
    c = stochastic_accept(mx.array(p), half, mx.array(drafts), mx.array(lens), seeds, steps)
    assert rows_of(c) == rows_of(a)


# ---------------------------------------------------------------------------
# Stochastic: statistics (B = 20000 seeded rows in one call)
# ---------------------------------------------------------------------------

V_SMALL = 6
# chi-square critical value, 5 degrees of freedom, 99.9%: a deterministic (seeded) check with a margin
CHI2_5_999 = 20.515


def _dist(x):
    x = np.asarray(x, dtype=np.float64)
    return x / x.sum()


P = [_dist([0.30, 0.25, 0.20, 0.12, 0.08, 0.05]),
     _dist([0.05, 0.10, 0.40, 0.05, 0.30, 0.10]),
     _dist([0.15, 0.15, 0.15, 0.15, 0.20, 0.20])]
Q = [_dist([0.05, 0.40, 0.05, 0.30, 0.10, 0.10]),  # a poor drafter: mass where p has little
     _dist([0.10, 0.10, 0.30, 0.10, 0.20, 0.20])]


def _check_matches(tokens: np.ndarray, p: np.ndarray) -> None:
    n = len(tokens)
    counts = np.bincount(tokens, minlength=V_SMALL).astype(np.float64)
    tv = 0.5 * np.abs(counts / n - p).sum()
    chi2 = ((counts - n * p) ** 2 / (n * p)).sum()
    # 0.02 for the full 20000 rows; subsets (rows that accepted) get a bound that scales with 1/sqrt(n)
    assert tv < max(0.02, 0.75 * np.sqrt(V_SMALL / n)), (tv, n, counts / n, p)
    assert chi2 < CHI2_5_999, (chi2, counts / n, p)


def _spec_trial(with_q: bool, B: int = 20000, seed: int = 0):
    rng = np.random.default_rng(seed)
    k = 2
    p = np.log(np.stack(P)).astype(np.float32)  # (k+1, V)
    q = np.log(np.stack(Q)).astype(np.float32)  # (k, V)
    if with_q:
        drafts = np.stack([rng.choice(V_SMALL, size=B, p=Q[i]) for i in range(k)], axis=1)
    else:  # a deterministic drafter: any proposal that does not look at the acceptance noise (here: p's
        # argmax for 70% of the rows, a uniform token for the rest)
        good = rng.random((B, k)) < 0.7
        drafts = np.where(good, np.stack([P[i] for i in range(k)]).argmax(-1)[None, :],
                          rng.integers(0, V_SMALL, size=(B, k)))
    res = stochastic_accept(
        mx.array(np.broadcast_to(p, (B, k + 1, V_SMALL)).copy()),
        mx.array(np.broadcast_to(q, (B, k, V_SMALL)).copy()) if with_q else None,
        mx.array(drafts.astype(np.int32)), mx.full((B,), k, mx.int32),
        mx.array(np.arange(B, dtype=np.uint32) + 1000 * seed), mx.array((np.arange(B) % 13).astype(np.uint32)),
    )
    return np.array(res.emitted), np.array(res.num_emitted), drafts


@pytest.mark.parametrize("with_q", [True, False], ids=["draft-q", "one-hot-q"])
def test_emitted_tokens_are_distributed_as_the_target(with_q):
    emitted, n, drafts = _spec_trial(with_q)
    # first emitted token ~ p_0 over all rows
    _check_matches(emitted[:, 0], P[0])
    # second ~ p_1 among rows that went on (they accepted d_1, so p_1 is the right conditional)
    more = n >= 2
    assert (emitted[more, 0] == drafts[more, 0]).all()
    assert more.sum() > 4000
    _check_matches(emitted[more, 1], P[1])
    # third (the bonus, after two acceptances) ~ p_2
    bonus = n == 3
    assert bonus.sum() > 1200
    _check_matches(emitted[bonus, 2], P[2])


def test_acceptance_rate_is_sum_of_min_p_q():
    emitted, n, drafts = _spec_trial(True, seed=1)
    rate = (n >= 2).mean()
    assert abs(rate - np.minimum(P[0], Q[0]).sum()) < 0.015
    # one-hot q: accept with probability p(d), averaged over the drafts
    _, n1, d1 = _spec_trial(False, seed=2)
    assert abs((n1 >= 2).mean() - P[0][d1[:, 0]].mean()) < 0.015


# ---------------------------------------------------------------------------
# Deterministic drafts for sampled rows: the plain sampler's tokens
# ---------------------------------------------------------------------------


def _rows_sampling(B: int) -> list[RowSampling]:
    """Greedy, plain, top-p, top-k and min-p rows in turn, each with its own seed."""
    kinds = [dict(), dict(temperature=0.8), dict(temperature=1.0, top_p=0.9), dict(temperature=0.7, top_k=5),
             dict(temperature=1.2, min_p=0.05)]
    return [RowSampling(seed=100 + b, **kinds[b % len(kinds)]) for b in range(B)]


def test_sampled_accept_emits_what_the_plain_sampler_draws_at_each_position():
    """Each position's token is `sample_tokens` on that position's logits at output index steps + i; a row
    accepts its longest draft prefix equal to them. Drafts: the plain tokens themselves (all accepted, then
    the bonus), the plain tokens with one changed (a correction there) and none."""
    B, k, V = 15, 4, 48
    rng = np.random.default_rng(5)
    logits = (rng.normal(size=(B, k + 1, V)) * 2.0).astype(np.float32)
    rows = _rows_sampling(B)
    params = SamplingArrays.from_rows(rows)
    steps = np.arange(B, dtype=np.uint32) * 7 + 3
    plain = np.stack([np.array(ks.sample_tokens(mx.array(logits[:, i]), params, mx.array(steps + i))[0])
                      for i in range(k + 1)], axis=1)
    drafts = plain[:, :k].astype(np.int32).copy()
    lens = np.full(B, k, dtype=np.int32)
    wrong_at = {b: b % k for b in range(B) if b % 3 == 1}
    for b, i in wrong_at.items():
        drafts[b, i] = (drafts[b, i] + 1) % V
    for b in range(B):
        if b % 3 == 2:
            lens[b] = 0
    res = sampled_accept(mx.array(logits), mx.array(drafts), mx.array(lens), params, mx.array(steps))
    for b, emitted in enumerate(rows_of(res)):
        n = wrong_at.get(b, k) if lens[b] else 0
        assert emitted == plain[b, : n + 1].tolist(), b


def test_sampled_accept_is_exact_speculative_sampling_for_one_hot_drafts():
    """A one-hot draft d is accepted with probability p(d), and a rejected position's token is distributed as
    p without d, renormalised (the residual): 20000 seeded rows of `_spec_trial`'s deterministic drafter."""
    B, k = 20000, 2
    rng = np.random.default_rng(3)
    p = np.log(np.stack(P)).astype(np.float32)
    good = rng.random((B, k)) < 0.7
    drafts = np.where(good, np.stack([P[i] for i in range(k)]).argmax(-1)[None, :],
                      rng.integers(0, V_SMALL, size=(B, k))).astype(np.int32)
    params = SamplingArrays.from_rows([RowSampling(temperature=1.0, seed=s) for s in range(B)])
    res = sampled_accept(mx.array(np.broadcast_to(p, (B, k + 1, V_SMALL)).copy()), mx.array(drafts),
                         mx.full((B,), k, mx.int32), params, mx.array((np.arange(B) % 13).astype(np.uint32)))
    emitted, n = np.array(res.emitted), np.array(res.num_emitted)
    _check_matches(emitted[:, 0], P[0])
    assert abs((n >= 2).mean() - P[0][drafts[:, 0]].mean()) < 0.015
    rejected = (n == 1) & (drafts[:, 0] == 0)  # d = 0 rejected: the residual is P[0] without token 0
    residual = P[0].copy()
    residual[0] = 0.0
    assert (emitted[rejected, 0] != 0).all()
    _check_matches(emitted[rejected, 0], np.where(residual > 0, residual, 1e-12) / residual.sum())
    more = n >= 2
    _check_matches(emitted[more, 1], P[1])


# ---------------------------------------------------------------------------
# Processed distributions
# ---------------------------------------------------------------------------


def test_processed_logprobs():
    rng = np.random.default_rng(4)
    B, V = 6, 40
    lp = mx.array(log_softmax(rng.normal(size=(B, V)) * 2))
    rows = [RowSampling(temperature=1.0), RowSampling(temperature=0.0), RowSampling(temperature=0.7, top_k=5),
            RowSampling(temperature=1.3, top_p=0.8), RowSampling(temperature=0.5, min_p=0.2),
            RowSampling(temperature=1.0, top_k=3, top_p=0.9, seed=3)]
    params = SamplingArrays.from_rows(rows)
    out = np.array(processed_logprobs(lp, params))
    probs = np.exp(out)
    assert np.allclose(probs.sum(-1), 1.0, atol=1e-5)
    assert np.allclose(out[0], np.array(lp)[0], atol=1e-5)  # temperature 1, no filter: p itself
    assert (out[1] == 0).sum() == 1 and int(out[1].argmax()) == int(np.array(lp[1]).argmax())
    assert np.isfinite(out[2]).sum() == 5
    filtered = np.array(ks.filter_logprobs(lp, params))
    sampled = [0, 2, 3, 4, 5]  # the greedy row is one-hot instead
    assert (np.isfinite(out[sampled]) == np.isfinite(filtered[sampled])).all()
    # (B, n, V) shares each row's parameters across positions
    stacked = mx.stack([lp, lp[::-1]], axis=1)
    out3 = np.array(processed_logprobs(stacked, params))
    assert np.array_equal(out3[:, 0], out)
    # Gumbel-max of the processed distribution with the plain stream picks what kernels.sampling.sample picks
    seeds, steps = params.seed, mx.arange(B).astype(mx.uint32)
    pick = mx.argmax(mx.array(out) + ks._gumbel(seeds, steps, V), axis=-1)
    assert pick.tolist() == ks.sample(lp, params, steps).tolist()


# ---------------------------------------------------------------------------
# Per-row KV rollback with the real tiny model
# ---------------------------------------------------------------------------


def _single(model, tokens):
    cache = library.make_request_cache(model)
    if tokens:
        model(mx.array(tokens)[None], cache=cache)
    return cache


def _batch(model, histories):
    """The executor's layout: each row's history minus its last token, merged left-padded (a batch whose
    rollback leaves masked holes: caches.layers._HoleBatchKVCache)."""
    return library.merge_caches([_single(model, h) for h in histories])


def _shifting_batch(model, histories):
    """The same rows in mlx-lm's own BatchKVCache (mlx-vlm's and other plain batches): rollback moves rows."""
    singles = [_single(model, h) for h in histories]
    return [mlx_cache.BatchKVCache.merge([s[i] for s in singles]) for i in range(len(singles[0]))]


def _decode(model, cache, tokens):
    return model(mx.array(tokens, dtype=mx.uint32)[:, None], cache=cache)[:, -1, :]


def _prompts(seed, lengths, vocab=512):
    rng = random.Random(seed)
    return [[rng.randrange(7, vocab) for _ in range(n)] for n in lengths]


def _row_kv(cache, lengths):
    """Per layer, each row's keys and values over its first lengths[row] real positions (numpy copies)."""
    return [[(np.array(layer.keys[i, :, p:p + n]), np.array(layer.values[i, :, p:p + n]))
             for i, (p, n) in enumerate(zip(layer.left_padding.tolist(), lengths))] for layer in cache]


def _same_kv(a, b):
    return all(np.array_equal(ka, kb) and np.array_equal(va, vb)
               for la, lb in zip(a, b) for (ka, va), (kb, vb) in zip(la, lb))


def _cache_holding(row_kv):
    """A batch cache merged, the executor's way, from single-request caches holding exactly these arrays."""
    singles = []
    for i in range(len(row_kv[0])):
        single = []
        for layer in row_kv:
            c = mlx_cache.KVCache()
            keys, values = layer[i]
            c.update_and_fetch(mx.array(keys)[None], mx.array(values)[None])
            single.append(c)
        singles.append(single)
    return library.merge_caches(singles)


def _assert_close_same_greedy(got, want):
    """Logits computed with other matmul shapes: equal up to rounding (which BLAS decides), same argmax."""
    assert mx.allclose(got, want, atol=1e-4).item()
    assert mx.argmax(got, axis=-1).tolist() == mx.argmax(want, axis=-1).tolist()


def _assert_filter_and_extend_still_decode(model, cache, hist):
    """After a run of rollbacks, a row leaves (filter) and one joins (extend), as the executor does between
    ticks: the batch then decodes as one prefilled from scratch (up to rounding, same argmax). `hist`: the
    four rows' histories, the last token of each not yet fed."""
    hist = [h + [t] for h, t in zip(hist, [20, 21, 22, 23])]
    library.filter_batch(cache, [0, 2, 3])
    joining = _prompts(9, [7])[0]
    library.extend_batch(cache, _batch(model, [joining[:-1]]))
    rows = [hist[0], hist[2], hist[3], joining]
    ref = _batch(model, [h[:-1] for h in rows])
    _assert_close_same_greedy(_decode(model, cache, [h[-1] for h in rows]), _decode(model, ref, [h[-1] for h in rows]))


def _verified(model, make_batch, drop):
    """Three rows after a verification forward of their last token and k = 4 drafts each, in a batch cache from
    `make_batch`: (cache, each row's history once it drops drop[b] drafts, the kept positions' keys/values)."""
    prompts = _prompts(0, [5, 12, 8])
    k = 4
    drafts = _prompts(1, [k, k, k])
    cache = make_batch(model, [p[:-1] for p in prompts])
    model(mx.array([[p[-1]] + d for p, d in zip(prompts, drafts)]), cache=cache)  # the verification forward
    kept = [p + d[: k - n] for p, d, n in zip(prompts, drafts, drop)]
    return cache, kept, _row_kv(cache, [len(h) for h in kept])


@pytest.mark.parametrize("drop", [[0, 2, 4], [3, 3, 3], [4, 0, 1], [4, 4, 0]])
def test_rollback_equals_a_cache_that_never_saw_the_dropped_tokens(text_model, drop):
    model, _ = text_model
    cache, kept, before = _verified(model, _shifting_batch, drop)
    lengths = rollback_rows(cache, drop)
    assert lengths == [len(h) for h in kept]
    for layer in cache:
        assert layer.offset.tolist() == lengths
        assert layer._idx == max(lengths)  # shared padding removed: no growth tick after tick
        assert min(layer.left_padding.tolist()) == 0
        assert (layer.left_padding + layer.offset).tolist() == [layer._idx] * 3
    # the rollback moves arrays and computes nothing: every row keeps exactly the values it had, so decoding
    # on it is bit for bit decoding on a clean cache holding those values (same shapes, same computation)
    assert _same_kv(_row_kv(cache, lengths), before)
    clean = _cache_holding(before)
    recomputed = _batch(model, kept)  # prefilled from scratch: other shapes, equal up to rounding
    for step in [[11, 12, 13], [40, 41, 42]]:  # two more decode steps
        got = _decode(model, cache, step)
        assert mx.array_equal(got, _decode(model, clean, step)).item()
        _assert_close_same_greedy(got, _decode(model, recomputed, step))


def test_rollback_over_many_ticks_then_filter_and_extend(text_model):
    """A simulated speculative run: every tick feeds k+1 positions and keeps a random prefix per row;
    padding stays bounded, and the executor's filter/extend still work on the result."""
    model, _ = text_model
    rng = random.Random(5)
    hist = _prompts(2, [3, 9, 6, 1 + 1])
    cache = _shifting_batch(model, [h[:-1] for h in hist])
    k = 3
    for tick in range(6):
        drafts = _prompts(100 + tick, [k] * len(hist))
        model(mx.array([[h[-1]] + d for h, d in zip(hist, drafts)]), cache=cache)
        acc = [rng.randint(0, k) for _ in hist]
        kept_lengths = [len(h) + a for h, a in zip(hist, acc)]
        before = _row_kv(cache, kept_lengths)
        assert rollback_rows(cache, mx.array([k - a for a in acc])) == kept_lengths
        assert _same_kv(_row_kv(cache, kept_lengths), before), tick
        # the row emitted acc drafts and a correction token: the history grows by acc + 1
        hist = [h + d[:a] + [rng.randrange(7, 512)] for h, d, a in zip(hist, drafts, acc)]
        assert cache[0]._idx == max(len(h) - 1 for h in hist)
    step = [h[-1] for h in hist]
    got = _decode(model, cache, step)
    assert mx.array_equal(got, _decode(model, _cache_holding(before), step)).item()
    _assert_close_same_greedy(got, _decode(model, _batch(model, [h[:-1] for h in hist]), step))
    _assert_filter_and_extend_still_decode(model, cache, hist)


@pytest.mark.parametrize("drop", [[0, 2, 4], [3, 3, 3], [4, 0, 1], [4, 4, 0]])
def test_rollback_into_holes_decodes_as_a_cache_that_never_saw_the_dropped_tokens(text_model, drop):
    """The executor's batch: what rows drop beyond the shared part stays in place as a masked hole (no copy);
    decoding through the mask gives a clean cache's logits up to rounding, and squeezing the holes out gives
    exactly the shifting rollback's layout and values."""
    model, _ = text_model
    cache, kept, before = _verified(model, _batch, drop)
    idx = cache[0]._idx
    lengths = rollback_rows(cache, drop)
    assert lengths == [len(h) for h in kept]
    for layer in cache:
        assert layer.offset.tolist() == lengths
        assert layer._idx == idx - min(drop)  # only the part every row drops is trimmed
        assert (layer.holes is not None) == (len(set(drop)) > 1)
    recomputed = _batch(model, kept)
    steps = [[11, 12, 13], [40, 41, 42]]
    for step in steps:
        _assert_close_same_greedy(_decode(model, cache, step), _decode(model, recomputed, step))
    for layer in cache:
        layer.compact()
        assert layer.holes is None
        assert (layer.left_padding + layer.offset).tolist() == [layer._idx] * 3
        assert min(layer.left_padding.tolist()) == 0
    assert cache[0].offset.tolist() == [n + len(steps) for n in lengths]
    assert _same_kv(_row_kv(cache, lengths), before)


def test_holes_stay_bounded_and_compact_before_the_buffer_grows(text_model):
    """Many verify ticks with random acceptance on rows near the end of the first 256-position buffer: the
    unused positions stay within HOLE_LIMIT, the buffer grows only from a compact layout (to what a batch
    without holes holds), and decoding, filter and extend agree with caches prefilled from scratch."""
    from caches.layers import HOLE_LIMIT, take_rows

    model, _ = text_model
    rng = random.Random(7)
    hist = _prompts(3, [230, 200, 220, 12])
    cache = _batch(model, [h[:-1] for h in hist])
    k = 4
    grew = 0
    for tick in range(14):
        drafts = _prompts(200 + tick, [k] * len(hist))
        capacity, longest = cache[0].keys.shape[2], max(len(h) - 1 for h in hist)
        model(mx.array([[h[-1]] + d for h, d in zip(hist, drafts)]), cache=cache)
        # as a batch without holes: it grows when its longest row does not fit, from that row's length
        grows = longest + k + 1 > capacity
        assert cache[0].keys.shape[2] == (longest + 256 if grows else capacity)
        grew += grows
        acc = [rng.randint(0, k) for _ in hist]
        assert rollback_rows(cache, [k - a for a in acc]) == [len(h) + a for h, a in zip(hist, acc)]
        hist = [h + d[:a] + [rng.randrange(7, 512)] for h, d, a in zip(hist, drafts, acc)]
        assert cache[0].spare() <= HOLE_LIMIT
    assert grew == 1
    # a row extracted through the holes holds exactly its own positions (as after squeezing them out)
    lengths = [len(h) - 1 for h in hist]
    extracted = take_rows(cache, range(len(hist)))
    assert [single[0].offset for single in extracted] == lengths
    step = [h[-1] for h in hist]
    _assert_close_same_greedy(_decode(model, cache, step), _decode(model, _batch(model, [h[:-1] for h in hist]), step))
    for layer in cache:
        layer.compact()
    compacted = _row_kv(cache, lengths)
    assert all(np.array_equal(np.array(single[j].keys[0]), compacted[j][i][0])
               for i, single in enumerate(extracted) for j in range(len(cache)))
    _assert_filter_and_extend_still_decode(model, cache, hist)


def test_rollback_argument_checks():
    cache = [mlx_cache.BatchKVCache([1, 0])]
    cache[0].update_and_fetch(mx.zeros((2, 1, 3, 4)), mx.zeros((2, 1, 3, 4)))
    assert cache[0].offset.tolist() == [2, 3]
    with pytest.raises(ValueError, match="more positions"):
        rollback_rows(cache, [3, 0])
    with pytest.raises(ValueError, match=">= 0"):
        rollback_rows(cache, [-1, 0])
    with pytest.raises(ValueError, match="rows"):
        rollback_rows(cache, [0, 0, 0])
    assert rollback_rows(cache, [0, 0]) == [2, 3]
    assert rollback_rows(cache, [2, 3]) == [0, 0]
    assert rollback_rows([], []) == []


def test_rollback_refuses_rotating_caches():
    with pytest.raises(TypeError, match="BatchRotatingKVCache"):
        rollback_rows([mlx_cache.BatchRotatingKVCache(16, [0, 0])], [1, 0])
    with pytest.raises(TypeError, match="KVCache"):
        rollback_rows([mlx_cache.KVCache()], [1])
