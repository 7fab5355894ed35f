"""Bounded context (max_kv_size) on rotating caches: batched output equals the matching single-request
mlx-lm setup (RotatingKVCache(max_kv_size, keep=0)), with chunked prefill, staggered joins and the prefix
cache; models with their own cache layout refuse max_kv_size instead of silently ignoring it."""

import pytest
from mlx_lm.models.cache import RotatingKVCache

from scheduler import Engine, EngineConfig

from ..helpers import drive, greedy, mixed_prompts, solo_tokens

MAX_KV = 48
PROMPTS = mixed_prompts(10, 1, 160, seed=9)


@pytest.fixture(scope="module")
def reference(text_model):
    model, tokenizer = text_model
    return [solo_tokens(model, tokenizer, p, 40,
                        prompt_cache=[RotatingKVCache(max_size=MAX_KV, keep=0) for _ in model.layers])
            for p in PROMPTS]


@pytest.mark.parametrize("prefix_cache_bytes", [0, 32 << 20])
def test_max_kv_size_matches_single_request_rotating_generation(text_model, reference, prefix_cache_bytes):
    model, tokenizer = text_model
    engine = Engine(model, tokenizer, EngineConfig(max_kv_size=MAX_KV, max_batched_tokens=40, prefill_chunk=13,
                                                   max_seqs=6, prefix_cache_bytes=prefix_cache_bytes,
                                                   check_invariants=True))
    arrivals = [(i, {"prompt_tokens": p, "sampling": greedy(40)}) for i, p in enumerate(PROMPTS)]
    if prefix_cache_bytes:  # shared prefixes: repeat two prompts (one short, one longer than the window)
        arrivals += [(60, {"prompt_tokens": PROMPTS[1] + [7, 8], "sampling": greedy(40)}),
                     (60, {"prompt_tokens": PROMPTS[2], "sampling": greedy(40)})]
    run = drive(engine, arrivals)
    outputs = list(run.tokens.values())
    assert outputs[: len(PROMPTS)] == reference
    # qwen3 honors the lengths a prepared batch cache carries (`Family.honors_lengths`): its rotating rows share
    # prefill forwards, padded chunks included
    stats = engine.prefill_stats()
    assert stats["batched_groups"] > 0 and stats["padded_tokens"] > 0 and stats["fallbacks"] == 0, stats
    if prefix_cache_bytes:
        extra = [solo_tokens(model, tokenizer, PROMPTS[1] + [7, 8], 40,
                             prompt_cache=[RotatingKVCache(max_size=MAX_KV, keep=0) for _ in model.layers]),
                 reference[2]]
        assert outputs[len(PROMPTS):] == extra
        assert engine.prefix_cache_stats()["hits"] >= 1
    assert engine.executor.cache_bytes() == 0


def test_bounded_context_really_differs_from_full_context(text_model, reference):
    model, tokenizer = text_model
    full = [solo_tokens(model, tokenizer, p, 40) for p in PROMPTS]
    assert full != reference  # otherwise the test above would prove nothing about rotation


def test_models_with_their_own_caches_refuse_max_kv_size(sliding_model):
    model, tokenizer = sliding_model
    with pytest.raises(ValueError, match="max_kv_size"):
        Engine(model, tokenizer, EngineConfig(max_kv_size=64))


def test_a_window_wider_than_an_allocation_step_shrinks_when_its_long_rows_leave(text_model):
    """A window of more than STEP positions, and a row that wraps it and finishes first: the short rows left in
    the batch hold fewer than longest + STEP positions a layer (the planner's KV bound, checked after every tick
    with a budget set), where mlx-lm's `BatchRotatingKVCache.filter` kept the long row's whole window. Greedy
    output stays the single-request rotating generation's."""
    model, tokenizer = text_model
    window = 300
    prompts = [mixed_prompts(1, 330, 330, seed=4)[0]] + mixed_prompts(3, 5, 12, seed=5)
    max_tokens = [2, 30, 30, 30]
    engine = Engine(model, tokenizer, EngineConfig(max_kv_size=window, max_batched_tokens=512, prefill_chunk=512,
                                                   max_seqs=4, kv_memory_bytes=1 << 30, check_invariants=True))
    run = drive(engine, [(0, {"prompt_tokens": p, "sampling": greedy(n), "request_id": f"r{i}"})
                         for i, (p, n) in enumerate(zip(prompts, max_tokens))])
    assert not run.errors, run.errors
    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        want = solo_tokens(model, tokenizer, p, n,
                           prompt_cache=[RotatingKVCache(max_size=window, keep=0) for _ in model.layers])
        assert run.tokens[f"r{i}"] == want, i
    assert engine.executor.cache_bytes() == 0
