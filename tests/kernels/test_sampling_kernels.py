"""Tests for kernels.sampling: batched per-row sampling kernels.

Each kernel is checked against a straightforward row-by-row numpy reference and
against mlx-lm's own single-row implementations; sampling is checked for
greedy exactness, batch-position independence and distribution.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings, HealthCheck
from hypothesis import strategies as st

from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
    make_frequency_penalty,
    make_presence_penalty,
    make_repetition_penalty,
)

from kernels.sampling import (
    DEFAULT_PENALTY_CONTEXT,
    RowSampling,
    SamplingArrays,
    apply_penalties,
    filter_logprobs,
    logprobs_from_logits,
    sample,
    sample_tokens,
)
from kernels import sampling as ks


@pytest.fixture(autouse=True)
def _eager_unless_asked(request):
    """Run kernels eagerly (mx.disable_compile) except in tests that request the
    ``compiled_mode`` fixture.

    On the CPU backend every fused graph mx.compile builds is JIT-compiled with
    the system C++ compiler (~0.3 s a kernel, cached in $TMPDIR/mlx), and new
    vocabulary sizes make new kernels; eager mode keeps this file fast on a cold
    cache. Compiled == eager is checked bit-for-bit in test_compiled_path_agrees_with_eager.
    """
    if "compiled_mode" in request.fixturenames:
        mx.enable_compile()
        yield
        return
    mx.disable_compile()
    try:
        yield
    finally:
        mx.enable_compile()


def _np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a)


def _log_softmax_np(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))


# ---------------------------------------------------------------------------
# Numpy references (row by row, written plainly)
# ---------------------------------------------------------------------------


def ref_penalties_row(logits: np.ndarray, context: list[int], row: RowSampling) -> np.ndarray:
    out = logits.astype(np.float32).copy()
    tokens = sorted({t for t in context if t >= 0})
    if row.repetition_penalty != 1.0:
        p = np.float32(row.repetition_penalty)
        for t in tokens:
            out[t] = out[t] * p if out[t] < 0 else out[t] / p
    if row.presence_penalty != 0.0:
        for t in tokens:
            out[t] = out[t] - np.float32(row.presence_penalty)
    if row.frequency_penalty != 0.0:
        for t in context:  # once per occurrence
            if t >= 0:
                out[t] = out[t] - np.float32(row.frequency_penalty)
    return out


def ref_filter_row(logprobs: np.ndarray, row: RowSampling) -> np.ndarray:
    """Kept-token mask (bool, (V,)) for top_p -> min_p -> top_k on one row."""
    V = logprobs.shape[0]
    lp = logprobs.astype(np.float64)
    keep = np.ones(V, dtype=bool)
    if 0.0 < row.top_p < 1.0:
        probs = np.exp(lp)
        order = np.argsort(-lp, kind="stable")
        cum_before = 0.0
        total = probs.sum()
        kept = np.zeros(V, dtype=bool)
        for i in order:
            if cum_before < row.top_p * total:
                kept[i] = True
            cum_before += probs[i]
        keep &= kept
    if row.min_p != 0.0:
        pmax = np.exp(lp[keep]).max()
        keep &= np.exp(lp) >= row.min_p * pmax
    if 0 < row.top_k < V:
        vals = np.where(keep, lp, -np.inf)
        kth = np.sort(vals)[::-1][row.top_k - 1]
        keep &= vals >= kth
    return keep


def mlx_lm_filter_row(logprobs_row: mx.array, row: RowSampling) -> mx.array:
    """make_sampler's chain for one row, using mlx-lm's own functions."""
    x = logprobs_row[None]
    if 0 < row.top_p < 1.0:
        x = apply_top_p(x, row.top_p)
    if row.min_p != 0.0:
        x = apply_min_p(x, row.min_p, 1)
    if row.top_k > 0:
        x = apply_top_k(x, row.top_k)
    return x[0]


# ---------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------

MIXED_ROWS = [
    RowSampling(),  # everything off, greedy
    RowSampling(temperature=1.0, seed=1),  # sampled, all filters off
    RowSampling(temperature=0.8, top_p=0.9, seed=2),
    RowSampling(temperature=1.2, min_p=0.1, seed=3),
    RowSampling(temperature=0.7, top_k=5, seed=4),
    RowSampling(temperature=1.0, top_p=0.7, min_p=0.05, top_k=10, seed=5),
    RowSampling(repetition_penalty=1.3),  # greedy with penalty
    RowSampling(temperature=0.9, presence_penalty=0.8, seed=7),
    RowSampling(temperature=1.1, repetition_penalty=0.8, presence_penalty=-0.5, top_k=3, seed=8),
    RowSampling(top_p=0.5, top_k=2, min_p=0.2),  # greedy with filters set (ignored by sample)
    RowSampling(frequency_penalty=0.7),  # greedy with a frequency penalty
    RowSampling(temperature=0.9, repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=-0.45, seed=9),
    RowSampling(temperature=2.0, top_p=0.95, repetition_penalty=1.1, seed=2**32 - 1),
]


def _random_logits(B: int, V: int, seed: int, scale: float = 3.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, V)) * scale).astype(np.float32)


def _random_context(B: int, W: int, V: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ctx = rng.integers(0, V, size=(B, W), dtype=np.int32)
    # duplicates and -1 padding of varying length (row 0 keeps a full window)
    ctx[:, 1] = ctx[:, 0]
    ctx[::2, 2] = ctx[::2, 0]  # three of a kind in every other row (the frequency penalty counts them)
    for b in range(1, B):
        pad = rng.integers(0, W + 1)
        ctx[b, W - pad :] = -1
    ctx[-1, :] = -1  # one row with empty context
    return ctx


# ---------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------


def test_from_rows_arrays_and_flags():
    p = SamplingArrays.from_rows(MIXED_ROWS)
    assert p.temperature.dtype == mx.float32 and p.temperature.shape == (len(MIXED_ROWS),)
    assert p.top_k.dtype == mx.int32
    assert p.seed.dtype == mx.uint32
    assert p.seed.tolist()[-1] == 2**32 - 1
    assert not p.all_greedy and p.any_penalty
    assert p.any_top_p and p.any_top_k and p.any_min_p

    g = SamplingArrays.from_rows([RowSampling(), RowSampling(top_k=3)])
    assert g.all_greedy and not g.any_penalty
    with_frequency = SamplingArrays.from_rows([RowSampling(), RowSampling(frequency_penalty=0.5)])
    assert with_frequency.any_penalty and with_frequency.any_frequency_penalty
    assert not SamplingArrays.from_rows([RowSampling(presence_penalty=0.5)]).any_frequency_penalty
    # filters on greedy rows do not count: sample never applies them
    assert not (g.any_top_p or g.any_top_k or g.any_min_p)

    t = SamplingArrays.from_rows([RowSampling(temperature=1.0, top_k=4)])
    assert t.any_top_k and not t.any_top_p and not t.any_min_p
    assert SamplingArrays.from_rows([RowSampling(seed=-1)]).seed.tolist() == [2**32 - 1]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-1.0),
        dict(top_p=1.5),
        dict(top_k=-1),
        dict(min_p=-0.1),
        dict(repetition_penalty=0.0),
        dict(presence_penalty=float("nan")),
        dict(frequency_penalty=float("inf")),
    ],
)
def test_row_sampling_validation(kwargs):
    with pytest.raises(ValueError):
        RowSampling(**kwargs)


# ---------------------------------------------------------------------------
# Penalties
# ---------------------------------------------------------------------------


def test_penalties_match_numpy_reference_and_off_rows_untouched():
    B, V, W = len(MIXED_ROWS), 64, DEFAULT_PENALTY_CONTEXT
    logits = _random_logits(B, V, 0)
    ctx = _random_context(B, W, V, 1)
    params = SamplingArrays.from_rows(MIXED_ROWS)
    out = np.array(apply_penalties(mx.array(logits), mx.array(ctx), params))
    for b, row in enumerate(MIXED_ROWS):
        ref = ref_penalties_row(logits[b], ctx[b].tolist(), row)
        np.testing.assert_allclose(out[b], ref, rtol=0, atol=1e-6)
        if not row.has_penalty or (ctx[b] < 0).all():
            assert np.array_equal(out[b].view(np.uint32), logits[b].view(np.uint32))
        else:
            assert not np.array_equal(out[b], logits[b])
    # tokens outside the context are never touched
    for b in range(B):
        outside = np.setdiff1d(np.arange(V), ctx[b][ctx[b] >= 0])
        assert np.array_equal(out[b, outside], logits[b, outside])


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_penalties_match_mlx_lm_bitwise(dtype):
    B, V, W = len(MIXED_ROWS), 96, DEFAULT_PENALTY_CONTEXT
    logits = mx.array(_random_logits(B, V, 2)).astype(dtype)
    ctx = _random_context(B, W, V, 3)
    params = SamplingArrays.from_rows(MIXED_ROWS)
    out = apply_penalties(logits, mx.array(ctx), params)
    assert out.dtype == dtype
    for b, row in enumerate(MIXED_ROWS):
        toks = [int(t) for t in ctx[b] if t >= 0]
        ref = mx.array(logits[b : b + 1])
        tok_arr = mx.array(toks, dtype=mx.int32)
        if row.repetition_penalty != 1.0:
            ref = make_repetition_penalty(row.repetition_penalty, W)(tok_arr, ref)
        if row.presence_penalty != 0.0:
            ref = make_presence_penalty(row.presence_penalty, W)(tok_arr, ref)
        if row.frequency_penalty != 0.0:
            ref = make_frequency_penalty(row.frequency_penalty, W)(tok_arr, ref)
        assert mx.array_equal(out[b], ref[0]).item(), (b, row)


def test_penalties_ignore_padding_and_out_of_range_ids():
    V = 10
    logits = mx.array(np.linspace(-3, 3, V, dtype=np.float32)[None].repeat(2, 0))
    params = SamplingArrays.from_rows(
        [RowSampling(repetition_penalty=2.0, presence_penalty=1.0)] * 2
    )
    ctx = mx.array([[-1, -1, -1], [0, 9, -1]], dtype=mx.int32)
    out = np.array(apply_penalties(logits, ctx, params))
    base = np.array(logits)
    assert np.array_equal(out[0], base[0])
    assert out[1, 0] == np.float32(base[1, 0] * 2.0 - 1.0)
    assert out[1, 9] == np.float32(base[1, 9] / 2.0 - 1.0)
    assert np.array_equal(out[1, 1:9], base[1, 1:9])


# ---------------------------------------------------------------------------
# Filters
# ---------------------------------------------------------------------------


def test_filters_match_numpy_reference():
    B, V = len(MIXED_ROWS), 200
    for trial in range(3):
        lp = logprobs_from_logits(mx.array(_random_logits(B, V, 10 + trial)))
        params = SamplingArrays.from_rows(MIXED_ROWS)
        out = np.array(filter_logprobs(lp, params))
        lp_np = np.array(lp)
        for b, row in enumerate(MIXED_ROWS):
            keep = ref_filter_row(lp_np[b], row)
            assert np.array_equal(np.isfinite(out[b]), keep), (trial, b, row)
            assert np.array_equal(out[b][keep], lp_np[b][keep])
            assert np.all(out[b][~keep] == -np.inf)
            if row.top_p in (0.0, 1.0) and row.min_p == 0.0 and row.top_k == 0:
                assert np.array_equal(out[b], lp_np[b])


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_filters_match_mlx_lm(dtype):
    V = 300
    rows = [r for r in MIXED_ROWS] + [
        RowSampling(temperature=1.0, top_p=0.3),
        RowSampling(temperature=1.0, min_p=0.5),
        RowSampling(temperature=1.0, top_k=1),
        RowSampling(temperature=1.0, top_k=V - 1),
        RowSampling(temperature=1.0, top_p=0.99, min_p=0.01, top_k=50),
    ]
    lp = logprobs_from_logits(mx.array(_random_logits(len(rows), V, 20))).astype(dtype)
    params = SamplingArrays.from_rows(rows)
    out = filter_logprobs(lp, params)
    for b, row in enumerate(rows):
        ref = mlx_lm_filter_row(lp[b], row)
        ours_keep = np.array(mx.isfinite(out[b]))
        ref_keep = np.array(mx.isfinite(ref))
        assert np.array_equal(ours_keep, ref_keep), (b, row)
        assert mx.array_equal(out[b], ref).item(), (b, row)


def test_top_k_two_support():
    V = 16
    logits = mx.array(_random_logits(1, V, 30))
    lp = logprobs_from_logits(logits)
    top2 = set(np.argsort(-np.array(lp[0]))[:2].tolist())
    B = 4000
    params = SamplingArrays.from_rows([RowSampling(temperature=3.0, top_k=2, seed=9)] * B)
    toks = sample(mx.broadcast_to(lp, (B, V)), params, mx.arange(B, dtype=mx.uint32))
    got = set(np.array(toks).tolist())
    assert got == top2


# ---------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------


def test_greedy_rows_equal_argmax_of_unfiltered():
    B, V = len(MIXED_ROWS), 128
    lp = logprobs_from_logits(mx.array(_random_logits(B, V, 40)))
    params = SamplingArrays.from_rows(MIXED_ROWS)
    toks = np.array(sample(lp, params, mx.zeros((B,), dtype=mx.uint32)))
    am = np.array(greedy_sampler(lp))
    for b, row in enumerate(MIXED_ROWS):
        if row.greedy:
            assert toks[b] == am[b]
    # fast path: identical to mlx-lm's greedy sampler, same dtype
    gp = SamplingArrays.from_rows([RowSampling(top_k=2)] * B)
    g = sample(lp, gp, mx.zeros((B,), dtype=mx.uint32))
    assert g.dtype == am.dtype == np.uint32 or g.dtype == mx.uint32
    assert mx.array_equal(g, greedy_sampler(lp)).item()


def test_sampled_tokens_in_filtered_support():
    B, V = len(MIXED_ROWS), 64
    params = SamplingArrays.from_rows(MIXED_ROWS)
    for step in range(5):
        lp = logprobs_from_logits(mx.array(_random_logits(B, V, 50 + step)))
        filt = np.array(filter_logprobs(lp, params))
        toks = np.array(sample(lp, params, mx.full((B,), step, dtype=mx.uint32)))
        for b in range(B):
            assert np.isfinite(filt[b, toks[b]])


def _run_row_alone(logits_rows, row, steps):
    p = SamplingArrays.from_rows([row])
    return [
        int(sample(logprobs_from_logits(mx.array(l[None])), p, mx.array([s], dtype=mx.uint32)).item())
        for l, s in zip(logits_rows, steps)
    ]


def test_seeded_row_independent_of_batch_position_and_neighbours():
    V, T = 100, 12
    target = RowSampling(temperature=1.0, top_p=0.95, top_k=40, seed=1234)
    rng = np.random.default_rng(60)
    target_logits = [(rng.standard_normal(V) * 2).astype(np.float32) for _ in range(T)]
    steps = list(range(T))
    alone = _run_row_alone(target_logits, target, steps)

    others = [
        RowSampling(),
        RowSampling(temperature=0.5, seed=1234),  # same seed, other params
        RowSampling(temperature=1.0, min_p=0.2, seed=99),
        RowSampling(temperature=1.5, top_k=3, seed=5),
        RowSampling(repetition_penalty=1.2),
    ]
    for pos in (0, 2, 5):
        for neighbours in (others, others[:1], others[2:4]):
            rows = list(neighbours)
            rows.insert(min(pos, len(rows)), target)
            ti = rows.index(target)
            params = SamplingArrays.from_rows(rows)
            got = []
            for t in range(T):
                logits = rng.standard_normal((len(rows), V)).astype(np.float32) * 2
                logits[ti] = target_logits[t]
                stp = rng.integers(0, 1000, size=len(rows)).astype(np.uint32)
                stp[ti] = steps[t]
                toks = sample(logprobs_from_logits(mx.array(logits)), params, mx.array(stp))
                got.append(int(toks[ti].item()))
            assert got == alone, (pos, len(rows))


def test_seed_and_step_change_the_draw_and_global_rng_unused():
    V, B = 50, 256
    lp = logprobs_from_logits(mx.zeros((B, V)))  # uniform: every token possible
    p1 = SamplingArrays.from_rows([RowSampling(temperature=1.0, seed=1)] * B)
    p2 = SamplingArrays.from_rows([RowSampling(temperature=1.0, seed=2)] * B)
    steps = mx.arange(B, dtype=mx.uint32)
    mx.random.seed(0)
    state_before = [np.array(s) for s in mx.random.state]
    a = np.array(sample(lp, p1, steps))
    state_after = [np.array(s) for s in mx.random.state]
    assert all(np.array_equal(x, y) for x, y in zip(state_before, state_after))
    mx.random.seed(12345)
    assert np.array_equal(a, np.array(sample(lp, p1, steps)))  # global seed irrelevant
    b = np.array(sample(lp, p2, steps))
    assert (a != b).mean() > 0.9  # different seeds -> different streams
    assert len(set(a.tolist())) > 40  # steps vary the draw


def test_hash_uniforms_well_distributed():
    B, V = 64, 4096
    seed = mx.array(np.arange(B) * 7 + 3, dtype=mx.uint32)
    step = mx.array(np.arange(B) % 5, dtype=mx.uint32)
    u = np.array(ks._hash_uniform(seed, step, V)).astype(np.float64)
    assert u.min() > 0.0 and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 0.003
    assert abs(u.var() - 1 / 12) < 0.002
    counts, _ = np.histogram(u, bins=64, range=(0, 1))
    expected = u.size / 64
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 120  # 63 dof: mean 63, sd ~11
    # neighbouring columns and neighbouring rows uncorrelated
    assert abs(np.corrcoef(u[:, :-1].ravel(), u[:, 1:].ravel())[0, 1]) < 0.02
    assert abs(np.corrcoef(u[:-1].ravel(), u[1:].ravel())[0, 1]) < 0.02
    # extreme inputs stay strictly inside (0, 1) and gumbel noise stays finite
    ext = mx.array([0, 2**32 - 1], dtype=mx.uint32)
    g = np.array(ks._gumbel(ext, ext, 1 << 16))
    assert np.isfinite(g).all()


def _empirical(probs_logits: np.ndarray, temperature: float, n: int, seed: int) -> np.ndarray:
    V = probs_logits.shape[0]
    lp = logprobs_from_logits(mx.array(probs_logits[None]))
    params = SamplingArrays.from_rows([RowSampling(temperature=temperature, seed=seed)] * n)
    toks = np.array(sample(mx.broadcast_to(lp, (n, V)), params, mx.arange(n, dtype=mx.uint32)))
    return np.bincount(toks, minlength=V) / n


LOGITS8 = np.log(np.array([0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.02], dtype=np.float32))


@pytest.mark.parametrize("temperature", [1.0, 0.5, 1.7])
def test_distribution_matches_softmax(temperature):
    n = 20000
    emp = _empirical(LOGITS8, temperature, n, seed=2024)
    target = np.exp(_log_softmax_np(LOGITS8 / temperature))
    tv = 0.5 * np.abs(emp - target).sum()
    assert tv < 0.02, (tv, emp, target)


def test_distribution_with_top_p_renormalises():
    n, V = 20000, 8
    lp = logprobs_from_logits(mx.array(LOGITS8[None]))
    params = SamplingArrays.from_rows([RowSampling(temperature=1.0, top_p=0.6, seed=77)] * n)
    toks = np.array(sample(mx.broadcast_to(lp, (n, V)), params, mx.arange(n, dtype=mx.uint32)))
    emp = np.bincount(toks, minlength=V) / n
    # top_p=0.6 keeps {0.30, 0.20, 0.15} (mass before token 2 is 0.50 < 0.6)
    target = np.zeros(V)
    target[:3] = [0.30, 0.20, 0.15]
    target /= target.sum()
    assert 0.5 * np.abs(emp - target).sum() < 0.02


# ---------------------------------------------------------------------------
# sample_tokens
# ---------------------------------------------------------------------------


def test_sample_tokens_logprobs_are_penalised_log_softmax():
    B, V, W = len(MIXED_ROWS), 80, 8
    logits = mx.array(_random_logits(B, V, 70))
    ctx = mx.array(_random_context(B, W, V, 71))
    params = SamplingArrays.from_rows(MIXED_ROWS)
    steps = mx.arange(B, dtype=mx.uint32)
    toks, lp = sample_tokens(logits, params, steps, ctx)
    pen = apply_penalties(logits, ctx, params)
    np.testing.assert_allclose(np.array(lp), _log_softmax_np(np.array(pen)), atol=1e-5)
    assert mx.array_equal(toks, sample(logprobs_from_logits(pen), params, steps)).item()
    # no context -> no penalties
    _, lp2 = sample_tokens(logits, params, steps)
    np.testing.assert_allclose(np.array(lp2), _log_softmax_np(np.array(logits)), atol=1e-5)
    # all greedy, no penalty: tokens == argmax(logits), like mlx-lm
    g = SamplingArrays.from_rows([RowSampling()] * B)
    t3, _ = sample_tokens(logits, g, steps, ctx)
    assert mx.array_equal(t3, mx.argmax(logits, axis=-1)).item()


@pytest.fixture
def compiled_mode():
    """Marker fixture: keep mx.compile enabled for this test."""
    return True


@pytest.mark.parametrize("rows", [MIXED_ROWS, MIXED_ROWS[5:6]], ids=["B11", "B1"])
def test_compiled_path_agrees_with_eager(rows, compiled_mode):
    """The mx.compile'd sampled path (the default on GPU) gives exactly the
    eager tokens, for a mixed batch and a single row with the same flags."""
    B, V = len(rows), 512
    params = SamplingArrays.from_rows(rows)
    assert params.any_top_p and params.any_min_p and params.any_top_k
    kmax = ks._kmax_bucket(params.max_top_k, V) if params.any_top_k else -1
    flags = (params.any_top_p, params.any_min_p, params.any_top_k)
    comp_fn = ks._sampled_fn(*flags, True, kmax)
    eager_fn = ks._sampled_fn(*flags, False, kmax)
    for step in range(3):
        lp = logprobs_from_logits(mx.array(_random_logits(B, V, 80 + step)))
        steps = mx.arange(B, dtype=mx.uint32) * 3 + step
        args = (lp, lp, params.temperature, params.top_p, params.top_k, params.min_p, params.seed, steps)
        comp = comp_fn(*args)
        assert mx.array_equal(comp, eager_fn(*args)).item()
        ks.set_compile(True)
        try:
            assert mx.array_equal(comp, sample(lp, params, steps)).item()
        finally:
            ks.set_compile(None)


def test_compile_auto_mode_follows_device():
    ks.set_compile(None)
    assert ks._compile_enabled() == (mx.default_device().type == mx.DeviceType.gpu)
    ks.set_compile(False)
    assert not ks._compile_enabled()
    ks.set_compile(None)


# ---------------------------------------------------------------------------
# Property tests
# ---------------------------------------------------------------------------

_row_strategy = st.builds(
    RowSampling,
    temperature=st.sampled_from([0.0, 0.3, 1.0, 2.5]),
    top_p=st.sampled_from([1.0, 0.99, 0.8, 0.5, 0.1, 0.0]),
    top_k=st.integers(0, 12),
    min_p=st.sampled_from([0.0, 0.01, 0.1, 0.5, 0.9]),
    seed=st.integers(0, 2**32 - 1),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(_row_strategy, min_size=1, max_size=5),
    V=st.integers(2, 24),
    data=st.data(),
)
def test_property_filters_keep_argmax_and_sample_in_support(rows, V, data):
    B = len(rows)
    flat = data.draw(
        st.lists(
            st.floats(-20, 20, allow_nan=False, allow_infinity=False, width=32),
            min_size=B * V,
            max_size=B * V,
        )
    )
    logits = mx.array(np.array(flat, dtype=np.float32).reshape(B, V))
    lp = logprobs_from_logits(logits)
    params = SamplingArrays.from_rows(rows)
    filt = np.array(filter_logprobs(lp, params))
    am = np.array(mx.argmax(lp, axis=-1))
    assert np.isfinite(filt[np.arange(B), am]).all()
    steps = mx.array(data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=B, max_size=B)), dtype=mx.uint32)
    toks = np.array(sample(lp, params, steps))
    assert np.isfinite(filt[np.arange(B), toks]).all()
    for b, row in enumerate(rows):
        if row.greedy:
            assert toks[b] == am[b]
        if 0 < row.top_k < V:
            # never outside the row's top-k values (ties at the k-th value allowed)
            kth = np.sort(np.array(lp[b]))[::-1][row.top_k - 1]
            assert np.array(lp[b])[toks[b]] >= kth


def test_partial_topk_path_matches_full_sort():
    import dataclasses

    B, V = 9, 300
    rows = [
        RowSampling(temperature=1.0, top_k=k, min_p=m, seed=s)
        for s, (k, m) in enumerate(
            [(0, 0.0), (1, 0.0), (5, 0.0), (17, 0.02), (40, 0.0), (3, 0.3), (0, 0.1), (33, 0.0), (8, 0.0)]
        )
    ]
    lp = logprobs_from_logits(mx.array(_random_logits(B, V, 90)))
    params = SamplingArrays.from_rows(rows)
    assert params.max_top_k == 40 and not params.any_top_p
    assert ks._kmax_bucket(params.max_top_k, V) == 64
    full = dataclasses.replace(params, max_top_k=-1)
    filt_partial = ks._filter(lp, params.top_p, params.top_k, params.min_p, False, True, True, 64)
    assert mx.array_equal(filt_partial, filter_logprobs(lp, params)).item()
    for step in range(4):
        s = mx.full((B,), step, dtype=mx.uint32)
        assert mx.array_equal(sample(lp, params, s), sample(lp, full, s)).item()


# ---------------------------------------------------------------------------
# greedy tokens without the log-softmax (GreedyPick)
# ---------------------------------------------------------------------------


def _exact_greedy(logits: mx.array) -> list:
    """mlx-lm's greedy token: the argmax of the log-softmax (what `sample` takes for a greedy row)."""
    return mx.argmax(logprobs_from_logits(logits), axis=-1).tolist()


def _picked(logits: mx.array) -> tuple[list, int]:
    pick = ks.greedy_pick(logits)
    mx.eval(*pick.arrays())
    return pick.tokens()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(1, 6), V=st.sampled_from([2, 7, 512, 4099]), scale=st.sampled_from([0.01, 1.0, 8.0, 60.0]),
       dtype=st.sampled_from(["float32", "bfloat16", "float16"]), ties=st.integers(0, 3), data=st.data())
def test_greedy_pick_equals_the_argmax_of_the_log_softmax(rows, V, scale, dtype, ties, data):
    """Random logits with near-ties planted at the top (the runner-up one ulp or a few below the best, equal
    values, a best value repeated later in the row, -inf entries): the pick is the log-softmax's argmax in every
    dtype, bitwise the token mlx-lm's greedy sampler takes."""
    seed = data.draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, V)) * scale).astype(np.float32)
    for r in range(rows):
        best = int(np.argmax(x[r]))
        for _ in range(ties if V > 1 else 0):
            j = int(rng.integers(V))
            x[r, j] = np.nextafter(x[r, best], -np.inf, dtype=np.float32) if rng.random() < 0.5 else x[r, best]
        if rng.random() < 0.2:
            x[r, int(rng.integers(V))] = -np.inf
    logits = mx.array(x).astype(getattr(mx, dtype))
    assert _picked(logits)[0] == _exact_greedy(logits)


def test_greedy_pick_takes_the_log_softmax_where_rounding_could_merge_the_top():
    """Where the best and the runner-up are closer than the rounding of `x - c` could tell apart, the pick computes
    those rows' log-softmax (and only those); a clear winner never does. In bfloat16 a gap of one of its own ulps at
    the top is within that margin; a row of only -inf or with NaN is never trusted."""
    x = np.array([[0.0, 5.0, 1.0, -3.0],  # clear: gap 4
                  [2.0, np.nextafter(np.float32(2.0), np.float32(3.0)), 0.0, -1.0],  # one float32 ulp
                  [-np.inf, -np.inf, -np.inf, -np.inf],
                  [0.0, np.nan, 1.0, 2.0]], dtype=np.float32)
    tokens, unsure = _picked(mx.array(x))
    assert tokens == _exact_greedy(mx.array(x)) and unsure == 3
    bf16 = mx.array([[10.0, 10.0625, -2.0], [10.0, 30.0, -2.0]]).astype(mx.bfloat16)  # 10.0625: one ulp above 10
    tokens, unsure = _picked(bf16)
    assert tokens == _exact_greedy(bf16) and unsure == 1
    # a NaN anywhere in a long row: MLX's argmax lands on it, so the row is never trusted (this fails loudly if
    # MLX's argmax stops treating NaN as the largest)
    long = np.random.default_rng(5).standard_normal((2, 5000)).astype(np.float32)
    long[1, 4000] = np.nan
    tokens, unsure = _picked(mx.array(long))
    assert tokens == _exact_greedy(mx.array(long)) and unsure == 1
    # a batch of shape (B, n, V), as a verify tick's logits are
    three = mx.array(np.random.default_rng(3).standard_normal((2, 3, 50)).astype(np.float32))
    assert _picked(three)[0] == _exact_greedy(three)


def test_sampled_rows_without_a_filter_draw_from_the_logits():
    """A sampled row with no filter draws from its logits (the log-sum-exp shifts a row's scores alike), here the
    very tokens the log-prob draw gives (they could differ only where rounding the shifted scores reorders two of
    them); `sample_tokens` still returns the log-softmax. Where no row reads the log-softmax (no greedy row, no
    filter) it is never computed; a greedy row or a filter reads it. The draws follow the softmax of
    logits / temperature."""
    rng = np.random.default_rng(11)
    B, V = 64, 3000
    logits = mx.array((rng.standard_normal((B, V)) * 4 + 20).astype(np.float32))  # log-sum-exp far from 0
    rows = [RowSampling(temperature=float(t), seed=s) for s, t in enumerate(rng.uniform(0.3, 2.0, B))]
    params = SamplingArrays.from_rows(rows)
    assert not params.needs_logprobs and not any(row.filtered for row in rows)
    steps = mx.arange(B, dtype=mx.uint32)
    tokens, logprobs = sample_tokens(logits, params, steps)
    assert np.array(tokens).tolist() == np.array(sample(logprobs_from_logits(logits), params, steps)).tolist()
    assert np.allclose(np.array(logprobs), np.array(logprobs_from_logits(logits)))
    for other in (RowSampling(), RowSampling(temperature=1.0, top_p=0.9), RowSampling(temperature=1.0, min_p=0.1),
                  RowSampling(temperature=1.0, top_k=5)):
        assert SamplingArrays.from_rows(rows[:3] + [other]).needs_logprobs
        assert other.filtered == (not other.greedy)
    n = 20000  # one row's logits, many seeds: the softmax at temperature 0.7
    row = mx.broadcast_to(mx.array(LOGITS8[None] + 50.0), (n, 8))
    many = SamplingArrays.from_rows([RowSampling(temperature=0.7, seed=s) for s in range(n)])
    drawn = np.array(sample_tokens(row, many, mx.zeros((n,), dtype=mx.uint32))[0])
    target = np.exp(_log_softmax_np(LOGITS8 / 0.7))
    assert 0.5 * np.abs(np.bincount(drawn, minlength=8) / n - target).sum() < 0.02


# ---------------------------------------------------------------------------
# tokens without the log-probs: greedy and sampled rows apart (draw_tokens)
# ---------------------------------------------------------------------------

_draw_row = st.builds(
    RowSampling,
    temperature=st.sampled_from([0.0, 0.0, 0.7, 1.0, 1.8]),
    top_p=st.sampled_from([1.0, 1.0, 0.9, 0.3]),
    top_k=st.sampled_from([0, 0, 0, 5, 40]),
    min_p=st.sampled_from([0.0, 0.0, 0.0, 0.1]),
    repetition_penalty=st.sampled_from([1.0, 1.0, 1.3]),
    seed=st.integers(0, 2**32 - 1),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(_draw_row, min_size=1, max_size=7), V=st.sampled_from([7, 512, 4099]),
       dtype=st.sampled_from(["float32", "bfloat16"]), data=st.data())
def test_draw_tokens_are_the_tokens_sample_tokens_gives(rows, V, dtype, data):
    """Greedy rows picked and sampled rows drawn on their own rows (`draw_tokens`) give every row the token
    `sample_tokens` gives it in the whole batch, penalties, filters, near-ties at the top and bfloat16 included;
    and a row's token is the one it gets alone (a seeded row draws the same token in any batch)."""
    B = len(rows)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    x = (rng.standard_normal((B, V)) * rng.choice([0.05, 3.0, 20.0]) + rng.uniform(-30, 30)).astype(np.float32)
    for r in range(B):
        if rng.random() < 0.4:  # a near-tie at the top: one float32 ulp below the best
            x[r, int(rng.integers(V))] = np.nextafter(x[r].max(), -np.inf, dtype=np.float32)
    logits = mx.array(x).astype(getattr(mx, dtype))
    context = mx.array(_random_context(B, 6, V, int(rng.integers(1 << 30))))
    steps = mx.array(rng.integers(0, 1 << 20, B), dtype=mx.uint32)
    params = SamplingArrays.from_rows(rows)
    whole, _ = sample_tokens(logits, params, steps, context)
    draw = ks.draw_tokens(logits, params, ks.DrawGroups.from_rows(rows), steps, context)
    mx.eval(*draw.arrays())
    tokens, recomputed = draw.tokens()
    assert tokens == np.array(whole).tolist()
    assert 0 <= recomputed <= sum(row.greedy for row in rows)
    for i, row in enumerate(rows):
        alone, _ = sample_tokens(logits[i : i + 1], SamplingArrays.from_rows([row]), steps[i : i + 1],
                                 context[i : i + 1])
        assert alone.item() == tokens[i], (i, row)


def _graph_ops(*arrays: mx.array) -> set[str]:
    """The primitives the (unevaluated) arrays' graph holds."""
    import io
    import re

    dot = io.StringIO()
    mx.export_to_dot(dot, *arrays)
    return set(re.findall(r'label ="(\w+)"', dot.getvalue()))


def test_draw_tokens_skips_the_log_softmax_where_no_token_reads_it():
    """Greedy rows and sampled rows without a filter: the pick and the logits draw put no log-softmax in the graph
    (the whole batch's `sample_tokens` tokens do, for the greedy rows' argmax); a filtered row brings it back, for
    the sampled rows only."""
    rows = [RowSampling(), RowSampling(temperature=1.0, seed=3), RowSampling(), RowSampling(temperature=0.5, seed=9)]
    logits = mx.array(_random_logits(4, 300, 5))
    params = SamplingArrays.from_rows(rows)
    groups = ks.DrawGroups.from_rows(rows)
    assert groups.greedy == (0, 2) and groups.sampled == (1, 3) and not groups.sampled_params.needs_logprobs
    steps = mx.arange(4, dtype=mx.uint32)
    draw = ks.draw_tokens(logits, params, groups, steps)
    assert "LogSumExp" not in _graph_ops(*draw.arrays())
    assert "LogSumExp" in _graph_ops(sample_tokens(logits, params, steps)[0])
    mx.eval(*draw.arrays())
    tokens, recomputed = draw.tokens()
    assert recomputed == 0 and tokens == np.array(sample_tokens(logits, params, steps)[0]).tolist()
    filtered = rows[:3] + [RowSampling(temperature=0.5, top_p=0.9, seed=9)]
    assert "LogSumExp" in _graph_ops(*ks.draw_tokens(logits, SamplingArrays.from_rows(filtered),
                                                     ks.DrawGroups.from_rows(filtered), steps).arrays())
    with pytest.raises(ValueError, match="draw groups of 4 rows for 3"):
        ks.draw_tokens(logits[:3], SamplingArrays.from_rows(rows[:3]), groups, steps[:3])
