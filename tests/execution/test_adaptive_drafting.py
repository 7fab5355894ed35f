"""Adaptive drafting: each row's draft length follows its acceptance and rejected rows pause until their
context changes (scheduler/execution/drafters.py `AdaptivePace`); and, on the *trained* tiny model
(scheduler/fixtures/trained.py), speculative decoding with prompt lookup keeps greedy output identical to
plain decoding and to mlx-lm run alone, while its drafts are actually accepted on repetitive input."""

from __future__ import annotations

import random

import pytest

from scheduler import Engine, EngineConfig, SamplingParams
from scheduler.execution.drafters import AdaptivePace, DraftRequest, PromptLookupDrafter
from tests.helpers import solo_tokens


# ---------------------------------------------------------------------------------------------- the pace
def test_pace_halves_k_after_a_rejected_draft_and_grows_back():
    pace = AdaptivePace(patience=2, backoff=4, max_backoff=16)
    assert pace.limit("r", 4, 10) == 4  # no evidence yet: the caller's k
    pace.drafted("r", 4)
    pace.update("r", 0, 4, 11)  # nothing accepted: half
    assert pace.limit("r", 4, 11) == 2
    pace.drafted("r", 2)
    pace.update("r", 2, 4, 14)  # all accepted: one more than drafted
    assert pace.limit("r", 4, 14) == 3
    pace.drafted("r", 3)
    pace.update("r", 1, 4, 16)  # partly accepted: kept
    assert pace.limit("r", 4, 16) == 3
    for h in (20, 24):
        pace.drafted("r", pace.limit("r", 4, h))
        pace.update("r", 4, 4, h + 4)
    assert pace.limit("r", 4, 30) == 4  # never above the caller's k
    assert pace.limit("r", 2, 30) == 2


def test_pace_pauses_a_rejected_row_with_a_doubling_backoff():
    pace = AdaptivePace(patience=2, backoff=4, max_backoff=16)
    assert pace.limit("r", 4, 9) == 4
    pace.drafted("r", 4)
    pace.update("r", 0, 4, 10)  # one miss: not paused, but k halves
    assert pace.limit("r", 4, 11) == 2
    pace.drafted("r", 2)
    pace.update("r", 0, 4, 12)  # second miss in a row: paused for 4 tokens of history
    assert [pace.limit("r", 4, h) for h in (12, 13, 15)] == [0, 0, 0]
    assert pace.limit("r", 4, 16) == 1
    pace.drafted("r", 1)
    pace.update("r", 0, 4, 17)  # third miss: 8 tokens
    assert pace.limit("r", 4, 24) == 0 and pace.limit("r", 4, 25) == 1
    pace.drafted("r", 1)
    pace.update("r", 1, 4, 26)  # an accepted token clears the misses
    pace.drafted("r", pace.limit("r", 4, 26))
    pace.update("r", 0, 4, 27)
    assert pace.limit("r", 4, 27) == 1  # one miss again: not paused
    assert pace.stats()["pauses"] == 2


def test_pace_resumes_early_on_a_long_match_at_a_new_distance():
    pace = AdaptivePace(patience=1, backoff=32, max_backoff=32, resume_ngram=3)
    pace.limit("r", 4, 10, ngram=3, distance=7)
    pace.drafted("r", 4, distance=7)
    pace.update("r", 0, 4, 11)  # paused until history 43, on the copy 7 tokens back
    assert pace.limit("r", 4, 12, ngram=3, distance=7) == 0  # the same copy continued: still paused
    assert pace.limit("r", 4, 12, ngram=2, distance=9) == 0  # a short match: not new context enough
    assert pace.limit("r", 4, 12, ngram=3, distance=9) == 2  # another occurrence: drafts again (k halved)
    assert pace.stats()["early_resumes"] == 1


def test_pace_without_the_k_cap_keeps_only_its_pauses():
    """cap_k=False (prompt lookup under the draft gate): a rejected draft does not shorten the next one, but
    rejections in a row still pause the row."""
    pace = AdaptivePace(patience=2, backoff=4, max_backoff=16, cap_k=False)
    assert pace.limit("r", 4, 10) == 4
    pace.drafted("r", 4)
    pace.update("r", 0, 4, 11)
    assert pace.limit("r", 4, 11) == 4  # the capped pace would halve it (test above)
    pace.drafted("r", 4)
    pace.update("r", 0, 4, 12)
    assert pace.limit("r", 4, 12) == 0 and pace.limit("r", 4, 16) == 4  # paused for 4 tokens, then all of k


def test_pace_rejects_bad_settings():
    with pytest.raises(ValueError):
        AdaptivePace(patience=0)
    with pytest.raises(ValueError):
        AdaptivePace(backoff=8, max_backoff=4)


def test_prompt_lookup_stops_proposing_drafts_that_are_rejected():
    """A history whose lookup keeps proposing the same wrong continuation: the adaptive drafter pauses
    after two rejections, the fixed one proposes every time."""
    phrase = list(range(100, 110))
    adaptive, fixed = PromptLookupDrafter(), PromptLookupDrafter(adaptive=False)
    history = phrase * 2 + [7]  # the target went elsewhere after every repeat
    lengths = {"adaptive": [], "fixed": []}
    for step in range(6):
        history = history + phrase[:3]  # a match (100 101 102) whose continuation gets rejected each time
        for name, d in (("adaptive", adaptive), ("fixed", fixed)):
            [draft] = d.propose([DraftRequest("r", history)], 4)
            lengths[name].append(len(draft.tokens))
            if draft.tokens:
                d.accept("r", 0, [7])
        history = history + [7]
    assert lengths["fixed"] == [4] * 6
    assert lengths["adaptive"][:2] == [4, 2]  # full k, then half after a miss
    assert lengths["adaptive"][2] == 0  # paused after the second miss
    assert sum(lengths["adaptive"]) < sum(lengths["fixed"]) / 2
    assert adaptive.stats()["adaptive"]["pauses"] >= 1


def test_a_paused_row_under_the_gate_proposes_a_draft_that_rides_along():
    """cap_k=False (under the draft gate): a paused row still proposes its whole draft, marked as riding along
    (the gate never lets it widen a tick, `MLXExecutor._gate`); a riding draft that pays ends the pause, and
    with the cap (no gate) a paused row proposes nothing."""
    phrase = list(range(100, 110))
    gated, capped = PromptLookupDrafter(cap_k=False), PromptLookupDrafter()
    history = phrase * 2 + [7]
    seen = {"gated": [], "capped": []}
    for _ in range(3):
        history = history + phrase[:3]
        for name, d in (("gated", gated), ("capped", capped)):
            [draft] = d.propose([DraftRequest("r", history)], 4)
            seen[name].append((len(draft.tokens), draft.rides_along))
            d.accept("r", 0, [7])
        history = history + [7]
    assert seen["gated"] == [(4, False), (4, False), (4, True)]  # paused after two misses: rides along
    assert seen["capped"][2] == (0, False)
    history = history + phrase[:3]
    [draft] = gated.propose([DraftRequest("r", history)], 4)
    assert draft.rides_along
    gated.accept("r", 2, phrase[3:6])  # the riding draft paid: the pause is over
    [draft] = gated.propose([DraftRequest("r", history + phrase[3:6])], 4)
    assert draft.tokens and not draft.rides_along
    assert gated.stats()["riding_drafts"] == {"proposed": 2, "verified": 2, "accepted_tokens": 2}


# ---------------------------------------------------------------------------------------------- trained model
@pytest.fixture(scope="module")
def trained_model(tmp_path_factory):
    from mlx_lm import load

    from scheduler.fixtures import trained

    root = tmp_path_factory.mktemp("trained")
    path = trained.build_trained(root / "model", steps=trained.TEST_STEPS, batch=trained.TEST_BATCH,
                                 cache_dir=root / "cache")
    model, tokenizer = load(str(path))
    return model, tokenizer, (path / "training.json").read_text(), root


def test_a_second_build_is_the_cached_copy(trained_model):
    from scheduler.fixtures import trained

    root = trained_model[3]
    again = trained.build_trained(root / "again", steps=trained.TEST_STEPS, batch=trained.TEST_BATCH,
                                  cache_dir=root / "cache")
    assert (again / "model.safetensors").read_bytes() == (root / "model" / "model.safetensors").read_bytes()
    assert [p.name for p in (root / "cache").iterdir()] == [f"trained-{trained.cache_key(trained.TEST_STEPS, 0, trained.TEST_BATCH)}"]


def _repetitive(tokenizer, n):
    from scheduler.fixtures import trained

    rng = random.Random("test-adaptive-drafting")
    out = []
    for i in range(n):
        if i % 2 == 0:
            text = "\n".join(trained._record(rng, 20 + j) for j in range(4)) + "\nRecord 24:"
        else:
            text = trained._revised(rng).split("\nRevised: ")[0] + "\nRevised:"
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def test_the_trained_model_learned_its_corpus(trained_model):
    import json

    record = json.loads(trained_model[2])
    assert record["steps"] > 0 and record["loss_last"] < 0.5 * record["loss_first"]


def test_drafting_on_the_trained_model_is_exact_and_accepted(trained_model):
    model, tokenizer = trained_model[:2]
    rng = random.Random(1)
    prompts = _repetitive(tokenizer, 3) + [[rng.randrange(7, 512) for _ in range(40)]]
    new = 24
    solo = [solo_tokens(model, tokenizer, p, new) for p in prompts]
    outputs, stats = {}, {}
    for name, cfg in (("plain", dict()), ("adaptive", dict(draft_tokens=4)),
                      ("own history", dict(draft_tokens=4, prompt_lookup_scope="request")),
                      ("ungated", dict(draft_tokens=4, draft_gate=False)),
                      ("fixed", dict(draft_tokens=4, adaptive_drafting=False))):
        engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=1024, **cfg))
        outs = engine.generate(prompts, SamplingParams(max_tokens=new))
        outputs[name] = [o.token_ids for o in outs]
        stats[name] = engine.draft_stats()
        engine.close()
    assert outputs["plain"] == solo
    assert outputs["adaptive"] == solo
    assert outputs["own history"] == solo
    assert outputs["fixed"] == solo
    assert outputs["ungated"] == solo
    assert stats["adaptive"]["gate"]["judged_ticks"] > 0 and stats["ungated"]["gate"] is None
    # the drafts are accepted: more than one token per row per verify forward on this workload
    assert stats["adaptive"]["accepted"] > 0
    assert stats["adaptive"]["tokens_per_row_forward"] > 1.5
    # the batch's records share their templates: some drafts came from another request's history
    assert stats["adaptive"]["drafter"]["shared_matches"] > 0
    assert stats["own history"]["drafter"]["shared_matches"] == 0


def test_recent_scope_drafts_from_requests_that_finished_before(trained_model):
    """Requests one after another: with `prompt_lookup_scope="recent"` the later ones draft from the earlier
    ones' histories (the same record template), with the batch scope they cannot (nothing else is live). Greedy
    output is mlx-lm's either way."""
    model, tokenizer = trained_model[:2]
    prompts = [_repetitive(tokenizer, 3)[i] for i in (0, 2)]  # two runs of records
    new = 32
    solo = [solo_tokens(model, tokenizer, p, new) for p in prompts]
    stats = {}
    for scope in ("recent", "batch"):
        engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=1024, draft_tokens=4,
                                                       prompt_lookup_scope=scope))
        outs = [engine.generate([p], SamplingParams(max_tokens=new))[0].token_ids for p in prompts]
        assert outs == solo
        stats[scope] = engine.draft_stats()["drafter"]
        engine.close()
    assert stats["recent"]["shared_matches"] > 0 and stats["recent"]["pooled_requests"] == 2
    assert stats["batch"]["shared_matches"] == 0 and stats["batch"]["pooled_requests"] == 0


def test_sampled_rows_draw_the_tokens_of_decoding_without_drafts(trained_model):
    """Seeded sampled rows (plain, top-p, top-k) next to greedy ones on the trained model, whose drafts are
    accepted: with prompt lookup every row's tokens are the ones the engine draws without drafting, at batch 4
    and alone (`kernels.speculative.sampled_accept`)."""
    model, tokenizer = trained_model[:2]
    prompts = _repetitive(tokenizer, 4)
    kinds = [dict(temperature=0.7, seed=1), dict(temperature=1.0, top_p=0.9, seed=2), dict(),
             dict(temperature=0.8, top_k=20, seed=3)]
    params = [SamplingParams(max_tokens=40, **kind) for kind in kinds]

    def run(draft_tokens, which):
        engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=1024, draft_tokens=draft_tokens))
        outs = engine.generate([prompts[i] for i in which], [params[i] for i in which])
        stats = engine.draft_stats()
        engine.close()
        return [o.token_ids for o in outs], stats

    plain, _ = run(0, range(4))
    drafted, stats = run(4, range(4))
    assert drafted == plain
    assert stats["accepted"] > 0 and stats["verify_forwards"] > 0
    assert run(4, [1])[0] == [plain[1]]


def test_a_riding_draft_is_verified_only_where_other_rows_draft(trained_model):
    """Random prompts pause their rows (nothing they draft is accepted at first); alone, a paused row's
    riding draft never makes a tick verify, so every one of them is dropped; next to a repetitive row whose
    drafts pay, riding drafts are verified in its ticks. Greedy output is mlx-lm's either way."""
    model, tokenizer = trained_model[:2]
    rng = random.Random(3)
    noise = [[rng.randrange(7, 512) for _ in range(40)] for _ in range(3)]
    new = 32
    riding = {}
    for name, prompts in (("alone", noise[:1]), ("batch", _repetitive(tokenizer, 1) + noise)):
        engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=1024, draft_tokens=4))
        outs = engine.generate(prompts, SamplingParams(max_tokens=new))
        assert [o.token_ids for o in outs] == [solo_tokens(model, tokenizer, p, new) for p in prompts]
        riding[name] = engine.draft_stats()["drafter"]["riding_drafts"]
        engine.close()
    assert riding["alone"]["proposed"] > 0 and riding["alone"]["verified"] == 0
    assert riding["batch"]["verified"] > 0


def test_the_gate_keeps_greedy_output_and_declines_drafts_that_do_not_pay(trained_model):
    """Batch 8 on the trained model, prompts of which only a few repeat: with the gate the output is still
    mlx-lm's token for token, some ticks are declined (a plain step) or narrowed, so fewer ticks run a verify
    forward than without the gate."""
    model, tokenizer = trained_model[:2]
    rng = random.Random(2)
    prompts = _repetitive(tokenizer, 2) + [[rng.randrange(7, 512) for _ in range(30)] for _ in range(6)]
    new = 24
    solo = [solo_tokens(model, tokenizer, p, new) for p in prompts]
    runs = {}
    for name, gate in (("gated", True), ("ungated", False)):
        engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=1024, draft_tokens=4, draft_gate=gate))
        outs = engine.generate(prompts, SamplingParams(max_tokens=new))
        runs[name] = ([o.token_ids for o in outs], engine.draft_stats())
        engine.close()
    assert runs["gated"][0] == solo and runs["ungated"][0] == solo
    gate = runs["gated"][1]["gate"]
    assert gate["judged_ticks"] > 0
    assert gate["declined_ticks"] + gate["narrowed_ticks"] > 0
    assert runs["gated"][1]["verify_forwards"] < runs["ungated"][1]["verify_forwards"]
