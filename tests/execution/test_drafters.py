"""Tests for scheduler.execution.drafters: prompt lookup and the draft-model drafter, and an end-to-end greedy
speculative loop (drafter -> one batched verification forward -> greedy_accept -> rollback_rows) whose
output must equal each request generated alone by mlx-lm."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from kernels.sampling import RowSampling, SamplingArrays
from kernels.speculative import greedy_accept, pad_drafts, processed_logprobs, rollback_rows, stochastic_accept
from scheduler.execution import library
from scheduler.execution.drafters import (
    Draft,
    DraftModelDrafter,
    DraftRequest,
    NgramIndex,
    PromptLookupDrafter,
)
from tests.helpers import solo_tokens


def _req(rid, tokens, **kw):
    return DraftRequest(rid, list(tokens), **kw)


# ---------------------------------------------------------------------------
# Prompt lookup
# ---------------------------------------------------------------------------


def test_prompt_lookup_proposes_the_continuation_of_a_repeat():
    phrase = list(range(100, 120))
    history = phrase * 3 + phrase[:5]
    d = PromptLookupDrafter()
    [draft] = d.propose([_req("a", history)], 4)
    assert draft == Draft("a", phrase[5:9], None)
    # the history wraps: the continuation runs over the phrase boundary
    [draft] = d.propose([_req("b", phrase * 2 + phrase[:18])], 5)
    assert draft.tokens == phrase[18:] + phrase[:3]


def test_prompt_lookup_proposes_nothing_without_repeats():
    tokens = list(range(7, 512))
    random.Random(0).shuffle(tokens)
    d = PromptLookupDrafter()
    assert d.propose([_req("a", tokens[:300])], 5)[0].tokens == []
    assert d.stats()["rows_with_draft"] == 0


def test_prompt_lookup_respects_k_and_max_tokens():
    history = [1, 2, 3, 4, 5, 6, 7] * 3
    d = PromptLookupDrafter()
    out = d.propose([_req("a", history), _req("b", history, max_tokens=1), _req("c", history, max_tokens=0)], 3)
    assert [len(x.tokens) for x in out] == [3, 1, 0]
    assert out[0].tokens == [1, 2, 3]
    assert d.propose([_req("a", history)], 0)[0].tokens == []
    assert len(d.propose([_req("a", history)], 12)[0].tokens) == 12  # periodic continuation beyond history


def test_prompt_lookup_prefers_longest_ngram_then_most_recent_occurrence():
    # "1 2 3" occurred once (-> 10); the 2-gram "2 3" occurred more recently (-> 11): the 3-gram wins
    d = PromptLookupDrafter(ngram_max=3, ngram_min=1)
    assert d.propose([_req("a", [1, 2, 3, 10, 5, 2, 3, 11, 1, 2, 3])], 1)[0].tokens == [10]
    # the most recent of several occurrences
    assert d.propose([_req("b", [1, 2, 4, 9, 1, 2, 5, 9, 1, 2])], 2)[0].tokens == [5, 9]
    d2 = PromptLookupDrafter(ngram_max=2, ngram_min=2)
    assert d2.propose([_req("c", [4, 1, 2, 3, 5, 1])], 3)[0].tokens == []  # a 1-gram match is not enough
    assert d2.matches_by_n == {2: 0}
    with pytest.raises(ValueError):
        PromptLookupDrafter(ngram_max=1, ngram_min=2)


def test_prompt_lookup_incremental_index_equals_recomputation():
    rng = random.Random(3)
    tokens = [rng.randrange(0, 6) for _ in range(400)]  # small vocabulary: many repeats
    d = PromptLookupDrafter(ngram_max=4, ngram_min=1)
    n = 1
    while n < len(tokens):
        n = min(len(tokens), n + rng.randint(1, 5))  # tokens arrive in bursts, as after acceptance
        history = tokens[:n]
        got = d.propose([_req("r", history)], 4)[0].tokens
        fresh = PromptLookupDrafter(ngram_max=4, ngram_min=1).propose([_req("r", history)], 4)[0].tokens
        assert got == fresh
        assert d.index_of("r").maps == NgramIndex(1, 4, history).maps
    assert d.rebuilds == 0
    assert d.stats()["rows_with_draft"] > 0


def test_prompt_lookup_rebuilds_on_a_history_that_does_not_extend_the_old_one():
    d = PromptLookupDrafter()
    d.propose([_req("r", [5, 6, 7, 5, 6])], 2)
    out = d.propose([_req("r", [1, 2, 1])], 2)  # a different history under the same id
    assert out[0].tokens == [2, 1]
    assert d.rebuilds == 1 and d.index_of("r").tokens == [1, 2, 1]


def test_prompt_lookup_index_is_incremental_not_quadratic():
    """Appending a token indexes only the n-grams that end at the newly followed position (one per n), never
    the history again; the result equals an index built from scratch. (Speed is a bench matter: ~10 us per
    step at a 50k-token history was measured, where a rescan would cost ~10 ms.)"""
    history = [random.Random(1).randrange(512) for _ in range(50_000)]
    index = NgramIndex(1, 3, history)
    for t in range(2000):
        before = index._indexed
        index.extend([t % 512])
        assert index._indexed - before == 1  # exactly one new position indexed per appended token
        index.lookup(5)
    fresh = NgramIndex(1, 3, history + [t % 512 for t in range(2000)])
    assert index.maps == fresh.maps and index.lookup(5) == fresh.lookup(5)


def test_prompt_lookup_accept_release_stats():
    d = PromptLookupDrafter()
    history = [3, 4, 5] * 4
    d.propose([_req("a", history), _req("b", [9])], 3)
    d.accept("a", 2, [3, 4, 9])
    d.accept("b", 0, [8])
    s = d.stats()
    assert s["proposed_tokens"] == 3 and s["verified_tokens"] == 3 and s["accepted_tokens"] == 2
    assert s["acceptance_rate"] == pytest.approx(2 / 3)
    d.propose([_req("a", history)], 2)
    with pytest.raises(ValueError):
        d.accept("a", 3)  # more than it drafted
    d.release(["a", "b", "never-seen"])
    assert d.stats()["live_requests"] == 0
    with pytest.raises(ValueError):
        d.propose([_req("x", [1]), _req("x", [1])], 2)
    with pytest.raises(ValueError):
        d.propose([_req("e", [])], 2)


def test_batch_lookup_takes_a_longer_match_from_another_live_request():
    """A row whose own history has no earlier occurrence of its suffix drafts what followed it in another
    row's history (as far as that history goes); `scope="request"` never does."""
    template = [40, 41, 42, 43, 44, 45, 46, 47]
    a = [9, 8] + template  # a has written the template
    b = [7, 6, 40, 41, 42]  # b is starting it
    batch, own = PromptLookupDrafter(scope="batch"), PromptLookupDrafter(scope="request")
    drafts = batch.propose([_req("a", a), _req("b", b)], 4)
    assert drafts[1].tokens == [43, 44, 45, 46]
    assert batch.stats()["shared_matches"] == 1 and batch.stats()["scope"] == "batch"
    assert own.propose([_req("a", a), _req("b", b)], 4)[1].tokens == []
    assert own.stats()["shared_matches"] == 0
    # the copy stops where the other history ends (no periodic continuation of someone else's text)
    assert batch.propose([_req("a", a), _req("c", [1, 45, 46])], 4)[1].tokens == [47]


def test_batch_lookup_keeps_a_rows_own_match_unless_another_is_longer():
    mine = [1, 2, 3, 60, 1, 2, 3, 61, 5, 3]  # own 1-gram match of 3 (-> 61), 2-gram 5 3 unseen
    other = [70, 5, 3, 80, 81]  # holds the 2-gram 5 3 -> 80 81
    d = PromptLookupDrafter(scope="batch")
    assert d.propose([_req("m", mine), _req("o", other)], 2)[0].tokens == [80, 81]
    same = [50, 51, 52, 50, 51, 52]  # own 3-gram match: another row's equal-length match does not replace it
    d2 = PromptLookupDrafter(scope="batch")
    out = d2.propose([_req("s", same), _req("o", [50, 51, 52, 99])], 2)
    assert out[0].tokens == [50, 51] and d2.stats()["shared_matches"] == 0


def test_batch_lookup_sees_every_row_of_the_same_call_and_the_most_recent_holder():
    d = PromptLookupDrafter(scope="batch")
    # the row that asks first sees the later row's history of this very call
    out = d.propose([_req("b", [5, 20, 21]), _req("a", [20, 21, 22, 23])], 2)
    assert out[0].tokens == [22, 23]
    d.propose([_req("c", [20, 21, 30, 31])], 2)  # c indexed 20 21 after a: it is the most recent holder
    assert d.propose([_req("b", [5, 20, 21])], 2)[0].tokens == [30, 31]


def test_released_and_rebuilt_histories_leave_no_shared_entries():
    d = PromptLookupDrafter(scope="batch")
    d.propose([_req("a", [1, 2, 3, 4, 5]), _req("b", [6, 7, 8, 9])], 3)
    d.propose([_req("a", [11, 12, 13])], 3)  # a's history changed under its id: rebuilt
    assert d.rebuilds == 1
    # nothing of a's old history is found any more, from b's side
    assert d.propose([_req("b", [6, 7, 8, 9, 2, 3])], 3)[0].tokens == []
    d.release(["a", "b"])
    assert all(not table for table in d._shared.maps.values())  # no entry outlives its request


def test_recent_scope_drafts_from_finished_requests_within_its_token_budget():
    """`scope="recent"`: a finished request's history stays for later requests to match, the oldest leaving
    first once the pool holds more than `pool_tokens`; `"batch"` forgets it at release."""
    template = [40, 41, 42, 43, 44, 45]
    recent = PromptLookupDrafter(scope="recent", pool_tokens=20)
    batch = PromptLookupDrafter(scope="batch", pool_tokens=20)  # (the budget applies to "recent" only)
    for d in (recent, batch):
        d.propose([_req("done", [1, 2] + template)], 2)
        d.release(["done"])
    assert recent.propose([_req("next", [9, 40, 41])], 3)[0].tokens == [42, 43, 44]
    assert batch.propose([_req("next", [9, 40, 41])], 3)[0].tokens == []
    assert recent.stats()["pooled_requests"] == 1 and recent.stats()["pooled_tokens"] == 8
    assert batch.stats()["pooled_requests"] == 0
    assert not any(holder[0] == "done" for table in batch._shared.maps.values() for holder in table.values())
    # two more finished histories of 8 tokens: 24 > 20, so the oldest ("done") leaves, with its n-grams
    for rid, base in (("b", 60), ("c", 80)):
        recent.propose([_req(rid, list(range(base, base + 8)))], 2)
        recent.release([rid])
    assert recent.stats()["pooled_requests"] == 2 and recent.stats()["pooled_tokens"] == 16
    assert recent.propose([_req("late", [9, 40, 41])], 3)[0].tokens == []
    assert recent.propose([_req("late2", [5, 61, 62])], 2)[0].tokens == [63, 64]
    # a request back under a pooled id replaces that history; a history above the budget is not kept
    recent.propose([_req("b", [7, 7, 7])], 2)
    assert "b" not in recent._pool
    recent.propose([_req("long", list(range(200, 230)))], 2)
    recent.release(["long", "b", "next", "late", "late2"])
    assert "long" not in recent._pool and recent.stats()["pooled_tokens"] <= 20
    held = {holder[0] for table in recent._shared.maps.values() for holder in table.values()}
    assert held <= set(recent._pool)  # every shared entry belongs to a pooled history
    with pytest.raises(ValueError):
        PromptLookupDrafter(scope="recent", pool_tokens=-1)


def test_a_copy_continued_from_another_history_keeps_its_pace_source():
    """A paused row resumes early only on a match from a new source; a copy continued from another row's
    history keeps its source (the other request, at the same offset from the row's own position), so it
    does not look new."""
    other = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]
    d = PromptLookupDrafter(scope="batch")
    sources = []
    for n in (3, 4, 5):  # the row copies `other` one token further each tick
        d.propose([_req("o", other), _req("r", [1] + other[:n])], 2)
        sources.append(d.pace._rows["r"].distance)
    assert sources[0] == sources[1] == sources[2] == ("o", 1)  # r's last token sits 1 past o's 42, 43, 44


# ---------------------------------------------------------------------------
# Draft model
# ---------------------------------------------------------------------------


def _prompts(seed, lengths, vocab=512):
    rng = random.Random(seed)
    return [[rng.randrange(7, vocab) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def greedy_refs(text_model):
    """Each prompt's greedy continuation by mlx-lm alone."""
    model, tokenizer = text_model
    prompts = _prompts(0, [1, 5, 12, 8])
    return prompts, [solo_tokens(model, tokenizer, p, 10) for p in prompts]


def test_draft_model_same_as_target_proposes_the_greedy_continuation(text_model, greedy_refs):
    model, _ = text_model
    prompts, refs = greedy_refs
    d = DraftModelDrafter(model)
    out = d.propose([_req(str(i), p) for i, p in enumerate(prompts)], 4)
    assert [o.tokens for o in out] == [r[:4] for r in refs]
    assert all(o.logprobs is None for o in out)  # greedy drafting: q is one-hot
    # so greedy verification by the target accepts every draft
    cache = library.merge_caches([_single(model, p[:-1]) for p in prompts])
    tokens, lens = pad_drafts([o.tokens for o in out], 4)
    logits = model(mx.concatenate([mx.array([[p[-1]] for p in prompts]), tokens], axis=1), cache=cache)
    assert greedy_accept(logits, tokens, lens).accepted.tolist() == [4] * len(prompts)


def _single(model, tokens):
    cache = library.make_request_cache(model)
    if tokens:
        model(mx.array(tokens)[None], cache=cache)
    return cache


def test_draft_model_stays_in_sync_after_partial_acceptance(text_model, greedy_refs):
    model, _ = text_model
    prompts, refs = greedy_refs
    d = DraftModelDrafter(model, adaptive=False)  # fixed k: the second drafts are compared with a fresh drafter's
    first = d.propose([_req(str(i), p) for i, p in enumerate(prompts)], 3)
    # verification outcomes: all accepted + bonus / 1 of 3 then a different token / none / 2 of 3
    hist = [list(p) for p in prompts]
    hist[0] += refs[0][:4]
    hist[1] += first[1].tokens[:1] + [7]
    hist[2] += [9]
    hist[3] += first[3].tokens[:2] + [refs[3][2]]
    for i, n in enumerate([3, 1, 0, 2]):
        d.accept(str(i), n, hist[i][len(prompts[i]):])
    again = d.propose([_req(str(i), h) for i, h in enumerate(hist)], 3)
    fresh = DraftModelDrafter(model).propose([_req(str(i), h) for i, h in enumerate(hist)], 3)
    assert [a.tokens for a in again] == [f.tokens for f in fresh]
    for i, h in enumerate(hist):  # the cache holds the history, then the drafts fed so far
        cached = d.cached_tokens(str(i))
        assert cached[: len(h)] == h and cached[len(h):] == again[i].tokens[:2]
    s = d.stats()
    assert s["verified_tokens"] == 12 and s["accepted_tokens"] == 6 and s["acceptance_rate"] == 0.5


def test_draft_model_subsets_new_rows_release_and_caps(text_model):
    model, _ = text_model
    prompts = _prompts(4, [6, 3, 9, 2])
    d = DraftModelDrafter(model)
    d.propose([_req("a", prompts[0]), _req("b", prompts[1])], 2)
    # only "b" drafts this time (a rides along idle), "c" joins, "d" is capped at one token
    hist_b = prompts[1] + [20, 21, 22]  # several tokens produced without drafting
    out = d.propose([_req("c", prompts[2]), _req("b", hist_b), _req("d", prompts[3], max_tokens=1)], 3)
    fresh = DraftModelDrafter(model).propose(
        [_req("c", prompts[2]), _req("b", hist_b), _req("d", prompts[3], max_tokens=1)], 3)
    assert [o.request_id for o in out] == ["c", "b", "d"]
    assert [o.tokens for o in out] == [f.tokens for f in fresh]
    assert len(out[2].tokens) == 1
    # an idle row holds its committed history plus at most the drafts of one call, however long it idles
    for _ in range(3):
        d.propose([_req("b", hist_b)], 3)
    assert d.cached_tokens("a")[: len(prompts[0])] == prompts[0]
    assert len(d.cached_tokens("a")) <= len(prompts[0]) + 2
    d.release(["b"])
    assert d.stats()["live_requests"] == 3
    hist_a = prompts[0] + [30]
    out = d.propose([_req("a", hist_a)], 3)
    assert out[0].tokens == DraftModelDrafter(model).propose([_req("a", hist_a)], 3)[0].tokens
    assert d.propose([_req("a", hist_a, max_tokens=0)], 3)[0].tokens == []
    d.release(["a", "c", "d"])
    assert d.stats()["live_requests"] == 0 and d.cache_bytes() == 0


def test_draft_model_warm_prefills_without_drafting(text_model, greedy_refs):
    model, _ = text_model
    prompts, refs = greedy_refs
    d = DraftModelDrafter(model)
    d.warm([_req(str(i), p) for i, p in enumerate(prompts)])
    assert d.stats()["forwards"] == 0 and d.stats()["live_requests"] == len(prompts)
    assert [d.cached_tokens(str(i)) for i in range(len(prompts))] == [p[:-1] for p in prompts]
    out = d.propose([_req(str(i), p) for i, p in enumerate(prompts)], 3)
    assert [o.tokens for o in out] == [r[:3] for r in refs]
    assert d.stats()["forwards"] == 3


def test_draft_model_sampling_mode_returns_q_and_is_batch_independent(text_model):
    model, _ = text_model
    prompts = _prompts(6, [4, 7, 11])
    rows = [RowSampling(temperature=0.8, seed=1), RowSampling(temperature=1.0, top_k=20, seed=2),
            RowSampling(temperature=0.0)]
    reqs = [_req(str(i), p, sampling=s, step=3) for i, (p, s) in enumerate(zip(prompts, rows))]
    out = DraftModelDrafter(model, sample=True).propose(reqs, 4)
    for o in out:
        assert o.logprobs.shape == (4, 512)
        assert np.allclose(np.exp(np.array(o.logprobs)).sum(-1), 1.0, atol=1e-4)
        lp = np.array(o.logprobs)
        assert all(np.isfinite(lp[i, t]) for i, t in enumerate(o.tokens))  # drawn from q's support
    assert np.isfinite(np.array(out[1].logprobs)).sum(-1).tolist() == [20] * 4  # top_k applied to q
    assert (np.array(out[2].logprobs) == 0).sum() == 4  # greedy row: one-hot q
    alone = DraftModelDrafter(model, sample=True).propose([reqs[1]], 4)[0]
    assert alone.tokens == out[1].tokens  # seeded: the same draw alone or in a batch
    other_step = DraftModelDrafter(model, sample=True).propose([_req("1", prompts[1], sampling=rows[1], step=4)], 4)
    assert other_step[0].tokens != out[1].tokens


def test_draft_model_refuses_rotating_caches(sliding_model):
    model, _ = sliding_model
    with pytest.raises(TypeError, match="KVCache"):
        DraftModelDrafter(model)


# ---------------------------------------------------------------------------
# End to end: the integration recipe, greedy target
# ---------------------------------------------------------------------------


def speculative_greedy(model, prompts, drafter, k, max_new):
    """A batched greedy speculative loop, the way the engine will run it: per tick one propose, one target
    forward over [last, d_1..d_k] for every row, greedy_accept, rollback_rows, accept."""
    ids = [str(i) for i in range(len(prompts))]
    hist = [list(p) for p in prompts]
    out = [[] for _ in prompts]
    cache = library.merge_caches([_single(model, p[:-1]) for p in prompts])
    forwards = 0
    while any(len(o) < max_new for o in out):
        reqs = [DraftRequest(rid, h, max_tokens=max(0, max_new - len(o) - 1)) for rid, h, o in zip(ids, hist, out)]
        drafts = drafter.propose(reqs, k)
        tokens, lens = pad_drafts([d.tokens for d in drafts], k)
        last = mx.array([[h[-1]] for h in hist], dtype=mx.uint32)
        logits = model(mx.concatenate([last, tokens.astype(mx.uint32)], axis=1), cache=cache)
        forwards += 1
        res = greedy_accept(logits, tokens, lens)
        accepted = res.accepted.tolist()
        rollback_rows(cache, [k - a for a in accepted])
        for b, (rid, a) in enumerate(zip(ids, accepted)):
            emitted = res.emitted[b, : a + 1].tolist()
            drafter.accept(rid, a, emitted)
            hist[b] += emitted
            out[b] += emitted
    return [o[:max_new] for o in out], forwards


def test_end_to_end_prompt_lookup_equals_plain_greedy(text_model):
    model, tokenizer = text_model
    phrase = _prompts(11, [20])[0]
    prompts = [phrase * 5, _prompts(12, [9])[0], (phrase[:7] + [50, 51]) * 3]
    max_new = 24
    drafter = PromptLookupDrafter(ngram_max=3, ngram_min=1)
    got, forwards = speculative_greedy(model, prompts, drafter, k=4, max_new=max_new)
    assert got == [solo_tokens(model, tokenizer, p, max_new) for p in prompts]
    assert forwards <= max_new
    assert drafter.stats()["proposed_tokens"] > 0


def test_end_to_end_draft_model_same_as_target_accepts_everything(text_model):
    model, tokenizer = text_model
    prompts = _prompts(13, [3, 10, 6])
    max_new = 13
    drafter = DraftModelDrafter(model)
    got, forwards = speculative_greedy(model, prompts, drafter, k=4, max_new=max_new)
    assert got == [solo_tokens(model, tokenizer, p, max_new) for p in prompts]
    assert forwards == 3  # 5 tokens per forward: 13 tokens in 3 forwards
    assert drafter.stats()["acceptance_rate"] == 1.0


def test_end_to_end_sampled_draft_model_same_as_target_accepts_almost_everything(text_model):
    """Sampling mode, target processed with the same parameters: q == p up to float noise of the two
    forwards, so stochastic_accept accepts (nearly) every draft -- the wiring of q is right."""
    model, _ = text_model
    prompts = _prompts(14, [5, 8])
    rows = [RowSampling(temperature=0.9, seed=5), RowSampling(temperature=1.0, top_p=0.9, seed=6)]
    params = SamplingArrays.from_rows(rows)
    drafter = DraftModelDrafter(model, sample=True)
    k = 3
    drafts = drafter.propose([_req(str(i), p, sampling=s, step=0) for i, (p, s) in enumerate(zip(prompts, rows))], k)
    cache = library.merge_caches([_single(model, p[:-1]) for p in prompts])
    tokens, lens = pad_drafts([d.tokens for d in drafts], k)
    logits = model(mx.concatenate([mx.array([[p[-1]] for p in prompts]), tokens], axis=1), cache=cache)
    p = processed_logprobs(logits - mx.logsumexp(logits, axis=-1, keepdims=True), params)
    q = mx.stack([d.logprobs for d in drafts])
    res = stochastic_accept(p, q, tokens, lens, params.seed, mx.zeros((2,), mx.uint32))
    assert res.accepted.tolist() == [k, k]
