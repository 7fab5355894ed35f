"""`Scheduler.apply` on ticks where several decisions touch the same request or cache entry: a store that
evicts an entry another request hit in the same tick, and a request that completes its prefill and fails in
the same tick with the prefix cache on. Each once crashed the engine loop with a KeyError (issue 24)."""

import random

from scheduler import Engine, EngineConfig, FinishReason, SamplingParams

from ..helpers import solo_tokens

RNG = random.Random(24)
P = [RNG.randrange(7, 512) for _ in range(40)]
C = [RNG.randrange(7, 512) for _ in range(40)]


def _entry_bytes(model, tokenizer) -> int:
    engine = Engine(model, tokenizer, EngineConfig(prefix_cache_bytes=64 << 20))
    engine.generate([P], SamplingParams(max_tokens=1))
    (entry,) = engine.scheduler.prefix_cache._entries.values()
    return entry.nbytes


def test_a_store_that_evicts_an_entry_hit_in_the_same_tick(text_model):
    model, tokenizer = text_model
    nbytes = _entry_bytes(model, tokenizer)
    engine = Engine(model, tokenizer, EngineConfig(prefix_cache_bytes=nbytes * 3 // 2, max_batched_tokens=128,
                                                   prefill_chunk=64, check_invariants=True))
    engine.generate([P], SamplingParams(max_tokens=2))
    cache = engine.scheduler.prefix_cache
    assert len(cache) == 1
    # one tick: P + 3 hits P's entry, and the stores of this tick (P + 3's own and C's) evict it
    hit, cold = P + [11, 12, 13], C
    outs = engine.generate([hit, cold], SamplingParams(max_tokens=4))
    assert cache.hits == 1 and cache.evictions >= 1
    assert [o.token_ids for o in outs] == [solo_tokens(model, tokenizer, p, 4) for p in (hit, cold)]
    assert cache.bytes <= cache.max_bytes


def test_a_request_failing_in_the_tick_its_prefill_completes_fails_alone(text_model):
    model, tokenizer = text_model

    def bad(tokens, logits):
        raise RuntimeError("bad processor")

    engine = Engine(model, tokenizer, EngineConfig(prefix_cache_bytes=64 << 20, max_batched_tokens=128,
                                                   prefill_chunk=64, check_invariants=True))
    outs = engine.generate([P, C], [SamplingParams(max_tokens=3, logits_processors=(bad,)),
                                    SamplingParams(max_tokens=3)])
    assert outs[0].finish_reason is FinishReason.ERROR and "bad processor" in outs[0].error
    assert outs[1].token_ids == solo_tokens(model, tokenizer, C, 3)
    assert engine.executor.cache_bytes() == 0
