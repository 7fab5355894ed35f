"""Drafting on caches that cannot roll back in place (recurrent state, sliding windows, `max_kv_size`): a
verify forward is undone by restoring the batch cache as it was before it and feeding the accepted positions
again (`MLXExecutor._verify` with a `caches.layers.BatchSnapshot`).

The drafts come from an oracle (tests/helpers.py) that knows each request's solo greedy continuation and spoils one position
per proposal, at a place that moves from tick to tick: so drafting ticks see rows that would accept
everything, part, or nothing, and the re-feed path (restore, then a shorter forward) runs under every mix.
Batched greedy output must still be `mlx_lm.generate`'s for each request alone, token for token.
"""

from __future__ import annotations

import pytest
from mlx_lm import load
from mlx_lm.models.cache import RotatingKVCache

from scheduler import EngineConfig
from scheduler.families import FAMILIES, UnsupportedFeature
from scheduler.fixtures.families import build_family_model
from scheduler.tools.replay import load_trace, replay

from ..helpers import OracleDrafter, drive, engine_with_log, greedy, mixed_prompts, solo_tokens

MAX_TOKENS = 16
# one of each cache kind that cannot roll back: rotating windows (gemma3_text), gated-delta recurrent state
# next to full attention (qwen3_next), state-space state only (mamba2)
NON_ROLLBACK = ["gemma3_text", "qwen3_next", "mamba2"]


@pytest.fixture(scope="module", params=NON_ROLLBACK)
def family(request, tmp_path_factory):
    model_type = request.param
    model, tokenizer = load(str(build_family_model(model_type, tmp_path_factory.mktemp(model_type))))
    prompts = {f"r{i}": p for i, p in enumerate(mixed_prompts(4, 3, 30, seed=7))}
    references = {rid: solo_tokens(model, tokenizer, p, MAX_TOKENS) for rid, p in prompts.items()}
    return model_type, model, tokenizer, prompts, references


def _run(model, tokenizer, prompts, references, config, stagger=0):
    engine, sink = engine_with_log(model, tokenizer, config)
    oracle = engine.executor.drafter = OracleDrafter(references, engine.vocab_size)
    run = drive(engine, [(i * stagger, {"prompt_tokens": p, "sampling": greedy(MAX_TOKENS), "request_id": rid})
                         for i, (rid, p) in enumerate(prompts.items())])
    assert not run.errors, run.errors
    return run, engine, sink, oracle


@pytest.mark.parametrize("stagger", [0, 2], ids=["together", "staggered"])
def test_refeed_drafting_equals_solo_generation(family, stagger, tmp_path):
    model_type, model, tokenizer, prompts, references = family
    assert not FAMILIES[model_type].capabilities.rollback
    trace = tmp_path / "trace.jsonl"
    config = EngineConfig(draft_tokens=4, max_batched_tokens=64, prefill_chunk=16, check_invariants=True,
                          trace_path=str(trace))
    run, engine, sink, oracle = _run(model, tokenizer, prompts, references, config, stagger)
    engine.close()
    assert run.tokens == references, model_type
    stats = engine.draft_stats()
    assert stats["verify_forwards"] > 0 and stats["accepted"] > 0
    # every kind of tick happened: a verify kept whole (nothing dropped) and one undone in part
    drops = [n for e in sink.of_kind("kv_rollback") for _, n in e["rows"]]
    assert 0 in drops and any(n > 0 for n in drops), drops
    # the planner's grant of 1 + k positions per drafting row holds (check_invariants), and the trace replays
    report = replay(load_trace(trace))
    assert report.identical, report.format()


def test_every_row_keeps_the_shortest_accepted_length(family):
    """One row's verify cannot be undone apart from another's, so each drafting tick every row accepts the
    same number of drafts."""
    model_type, model, tokenizer, prompts, references = family
    run, engine, sink, _ = _run(model, tokenizer, prompts, references,
                                EngineConfig(draft_tokens=4, max_batched_tokens=64, check_invariants=True))
    assert run.tokens == references
    verified = [o["drafts"] for o in sink.of_kind("outcome") if o.get("drafts")]
    assert verified
    for drafts in verified:
        assert len({accepted for _, accepted in drafts.values()}) == 1, drafts
        assert all(proposed <= 2 for proposed, _ in drafts.values())  # k // 2 drafts: verify + re-feed <= 1 + k


def test_max_kv_size_drafting_equals_solo_generation(text_model):
    model, tokenizer = text_model
    prompts = {f"r{i}": p for i, p in enumerate(mixed_prompts(3, 20, 40, seed=2))}
    # the single-request setup max_kv_size matches (tests/caches/test_rotating.py): a window that keeps nothing
    references = {rid: solo_tokens(model, tokenizer, p, MAX_TOKENS,
                                   prompt_cache=[RotatingKVCache(max_size=24, keep=0) for _ in model.layers])
                  for rid, p in prompts.items()}
    run, engine, sink, _ = _run(model, tokenizer, prompts, references,
                                EngineConfig(draft_tokens=4, max_kv_size=24, max_batched_tokens=64,
                                             check_invariants=True))
    assert run.tokens == references
    assert engine.draft_stats()["accepted"] > 0


def test_one_draft_token_is_refused_where_the_cache_cannot_roll_back(family):
    model_type, model, tokenizer, *_ = family
    with pytest.raises(UnsupportedFeature, match="draft_tokens >= 2") as info:
        engine_with_log(model, tokenizer, EngineConfig(draft_tokens=1))
    assert info.value.model_type == model_type


def test_a_draft_model_that_cannot_roll_back_is_refused(family, text_model):
    model_type, model, tokenizer, *_ = family
    target, target_tokenizer = text_model
    from scheduler import Engine

    with pytest.raises(UnsupportedFeature, match="draft model") as info:
        Engine(target, target_tokenizer, EngineConfig(draft_tokens=2, drafter="draft-model"), draft_model=model)
    assert info.value.model_type == model_type


def test_a_draft_model_drafts_for_a_target_that_cannot_roll_back(family, text_model):
    """The draft model's own cache rolls back per row; the target's verify is undone by a re-feed."""
    model_type, model, tokenizer, prompts, references = family
    draft, _ = text_model
    from scheduler import Engine

    engine = Engine(model, tokenizer, EngineConfig(draft_tokens=4, drafter="draft-model", max_batched_tokens=64,
                                                   check_invariants=True), draft_model=draft)
    run = drive(engine, [(i, {"prompt_tokens": p, "sampling": greedy(MAX_TOKENS), "request_id": rid})
                         for i, (rid, p) in enumerate(prompts.items())])
    assert not run.errors and run.tokens == references, model_type
    assert engine.draft_stats()["verify_forwards"] > 0
