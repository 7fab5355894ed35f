"""PrefixCache: the index on its own, then on the real engine: output never changes, hits happen, entries are
never mutated, bytes return to baseline, and replay reproduces the cache's decisions."""

import mlx.core as mx
import numpy as np
import pytest

from caches.prefix import PrefixCache
from scheduler import Engine, EngineConfig, SamplingParams
from scheduler.events import read_jsonl
from scheduler.tools.replay import load_trace, replay

from ..helpers import drive, greedy, mixed_prompts, solo_tokens

B = 4  # block size in the unit tests


def _cache(max_bytes=1000, events=None):
    return PrefixCache(max_bytes, block_size=B, on_event=(lambda kind, **f: events.append((kind, f))) if events is not None else None)


def test_match_kinds():
    c = _cache()
    base = list(range(100, 120))  # 20 tokens
    eid = c.store(base, nbytes=10)
    m = c.lookup(base + [1, 2], max_len=20)
    assert (m.entry_id, m.length, m.kind) == (eid, 20, "exact")
    m = c.lookup(base + [1, 2, 3, 4, 5], max_len=24)
    assert (m.length, m.kind) == (20, "shorter")
    m = c.lookup(base[:10], max_len=9)
    assert (m.length, m.kind) == (9, "longer")
    m = c.lookup(base[:13] + [7, 7, 7, 7], max_len=16)
    assert (m.length, m.kind) == (13, "lcp")
    assert c.lookup([1, 2, 3, 4, 5, 6], max_len=5) is None  # no shared block
    assert c.lookup(base[:3], max_len=2) is None  # shorter than one block


def test_whole_only_entries_are_never_trimmed():
    c = _cache()
    c.store(list(range(50, 62)), nbytes=10, whole_only=True)
    assert c.lookup(list(range(50, 58)), max_len=7) is None
    m = c.lookup(list(range(50, 70)), max_len=19)
    assert m.length == 12


def test_the_deepest_checkpoint_that_fits_is_found_above_the_deepest_shared_block():
    """Checkpoints (whole-only entries) at 4, 8 and 11 tokens of one prompt: a prompt that shares 10 tokens
    shares block 2, where only the 8- and 11-token entries are indexed; the 11 does not fit, the 8 does. One
    that shares 6 tokens falls back to block 1's checkpoint. Hits say how they used their entry."""
    events = []
    c = _cache(events=events)
    stored = list(range(50, 61))
    ids = {n: c.store(stored[:n], nbytes=1, whole_only=True) for n in (4, 8, 11)}
    m = c.lookup(stored[:10] + [1, 1], max_len=11)
    assert (m.entry_id, m.length, m.reuse) == (ids[8], 8, "checkpoint")
    m = c.lookup(stored[:6] + [1, 1, 1], max_len=8)
    assert (m.entry_id, m.length, m.reuse) == (ids[4], 4, "checkpoint")
    assert c.lookup(stored + [1], max_len=11).entry_id == ids[11]
    assert c.lookup(stored[:3] + [1] * 6, max_len=8) is None  # shares no full block
    kv = c.store(list(range(200, 212)), nbytes=1)
    assert c.lookup(list(range(200, 209)) + [1], max_len=9).reuse == "trimmed"
    assert c.lookup(list(range(200, 212)) + [1], max_len=12).reuse == "whole"
    c.record_hit(ids[8], 8, "r1")
    c.record_hit(kv, 9, "r2")
    hits = [f["reuse"] for kind, f in events if kind == "prefix_hit"]
    assert hits == ["checkpoint", "trimmed"]


def test_media_keys_share_the_text_before_the_media_and_nothing_after():
    """Request.prefix_key: token ids up to the first media mark, (media key, id) pairs from there. A request
    with other media (or none) shares the text before the media; only the same media goes further."""
    from scheduler.request import Request

    c = _cache()
    text, media, after = list(range(10, 22)), [5] * 8, [30, 31, 32, 33]  # 12 text tokens, 8 media positions

    def request(key, prompt_tail, offset=12):
        return Request("r", text + prompt_tail, SamplingParams(), media_key=key,
                       media_marks=() if key is None else ((offset, key),))

    stored = request("image-a", media + after)
    assert stored.prefix_key(14)[:12] == tuple(text) and stored.prefix_key(14)[12:] == (("image-a", 5),) * 2
    c.store(stored.prefix_key(24), nbytes=10)
    assert c.lookup(request("image-a", media + after + [1]).prefix_key(25), max_len=24).length == 24
    assert c.lookup(request("image-b", media + after + [1]).prefix_key(25), max_len=24).length == 12
    assert c.lookup(request(None, [40] * 9).prefix_key(21), max_len=20).length == 12  # text only
    # the same ids as the media positions, but text: still only the text before them
    assert c.lookup(request(None, media + after + [1]).prefix_key(25), max_len=24).length == 12
    # the same media starting earlier: only the text before its first media token is shared
    assert c.lookup(request("image-a", media + after, offset=8).prefix_key(24), max_len=23).length == 8


def test_per_item_marks_share_the_media_so_far():
    """Marks per media item, each key covering the items up to it (a chat turn that adds an image): a prompt
    matches through every item both have, in order, and stops at the first that differs."""
    from scheduler.request import Request

    c = _cache()
    text, image, between = list(range(10, 18)), [5] * 4, [40, 41, 42, 43]

    def request(keys):  # text, then per key: an image and text after it
        prompt, marks = list(text), []
        for key in keys:
            marks.append((len(prompt), key))
            prompt += image + between
        return Request("r", prompt + [1], SamplingParams(), media_key=keys[-1], media_marks=tuple(marks))

    a = request(["A"])
    assert a.prefix_key(12) == (*text, *(("A", 5),) * 4) and a.prefix_key(6) == tuple(text[:6])
    c.store(a.prefix_key(16), nbytes=10)
    assert c.lookup(request(["A", "A+B"]).prefix_key(25), max_len=24).length == 16  # turn one, whole
    assert c.lookup(request(["C", "C+B"]).prefix_key(25), max_len=24).length == 8  # other first image: the text
    c.store(request(["A", "A+B"]).prefix_key(24), nbytes=10)
    assert c.lookup(request(["A", "A+D"]).prefix_key(25), max_len=24).length == 16  # up to the second image


def test_lru_eviction_under_the_byte_budget_and_stats():
    events = []
    c = _cache(max_bytes=30, events=events)
    a = c.store(list(range(0, 8)), nbytes=10)
    b = c.store(list(range(100, 108)), nbytes=10)
    c.store(list(range(200, 208)), nbytes=10)
    c.record_hit(a, 7, "r1")  # a becomes most recent, b is now the oldest
    c.store(list(range(300, 308)), nbytes=10)
    assert c.bytes == 30 and len(c) == 3
    assert c.lookup(list(range(100, 108)) + [1], max_len=8) is None  # b evicted
    assert c.lookup(list(range(0, 8)) + [1], max_len=8).entry_id == a
    assert c.store(list(range(400, 408)), nbytes=31) is None  # bigger than the budget: refused
    c.record_miss("r2")
    stats = c.stats()
    assert set(stats) == {"hits", "misses", "hit_rate", "evictions", "tokens_saved", "current_memory_mb",
                          "max_memory_mb", "memory_utilization", "entry_count"}
    assert (stats["hits"], stats["misses"], stats["evictions"], stats["tokens_saved"], stats["entry_count"]) == (1, 1, 1, 7, 3)
    assert stats["hit_rate"] == 0.5 and stats["memory_utilization"] == 1.0
    kinds = [k for k, _ in events]
    assert kinds.count("prefix_store") == 4 and "prefix_evict" in kinds and "prefix_hit" in kinds
    c.clear()
    assert c.bytes == 0 and len(c) == 0


def test_storing_the_same_prefix_twice_keeps_one_entry():
    c = _cache()
    assert c.store(list(range(8)), 5) == c.store(list(range(8)), 5)
    assert len(c) == 1 and c.bytes == 5


# ---- on the real engine ---------------------------------------------------------------------------------

def _sharing_workload(seed=5):
    rng = np.random.default_rng(seed)
    system = [int(t) for t in rng.integers(7, 512, 70)]
    other_system = [int(t) for t in rng.integers(7, 512, 40)]
    prompts = [system + [int(t) for t in rng.integers(7, 512, n)] for n in (5, 30, 1, 64)]
    prompts += [other_system + [int(t) for t in rng.integers(7, 512, n)] for n in (3, 50)]
    prompts.append(prompts[1][:60])  # a strict prefix of another prompt (longer-entry match)
    prompts.append(prompts[3] + [9, 8, 7])  # another one is a strict prefix of this one
    return prompts


def _run(model, tokenizer, prompts, config, waves):
    """Run prompts in waves (each wave after the previous finished) so later waves can hit the cache."""
    engine = Engine(model, tokenizer, config)
    outputs = []
    for wave in waves:
        run = drive(engine, [(0, {"prompt_tokens": prompts[i], "sampling": greedy(10)}) for i in wave])
        outputs += list(run.tokens.values())
    return engine, outputs


@pytest.mark.parametrize("model_fixture", ["text_model", pytest.param("sliding_model", marks=pytest.mark.slow)])
def test_prefix_cache_never_changes_output(request, model_fixture):
    model, tokenizer = request.getfixturevalue(model_fixture)
    prompts = _sharing_workload()
    waves = [[0, 4], [1, 2, 3, 5], [6, 7]]
    base = dict(max_batched_tokens=48, max_seqs=4, prefill_chunk=16, check_invariants=True)
    _, cold = _run(model, tokenizer, prompts, EngineConfig(**base), waves)
    engine, warm = _run(model, tokenizer, prompts, EngineConfig(**base, prefix_cache_bytes=64 << 20), waves)
    assert warm == cold
    order = [i for wave in waves for i in wave]
    assert cold == [solo_tokens(model, tokenizer, prompts[i], 10) for i in order]
    stats = engine.prefix_cache_stats()
    assert stats["hits"] > 0 and stats["tokens_saved"] > 0
    assert engine.executor.cache_bytes() == 0


def test_multi_turn_continuation_hits_and_matches(text_model):
    model, tokenizer = text_model
    first = mixed_prompts(1, 90, 90, seed=11)[0]
    engine = Engine(model, tokenizer, EngineConfig(prefix_cache_bytes=16 << 20, check_invariants=True))
    (turn1,) = engine.generate([first], greedy(12))
    second = first + turn1.token_ids + [33, 44, 55]
    (turn2,) = engine.generate([second], greedy(12))
    assert turn2.token_ids == solo_tokens(model, tokenizer, second, 12)
    stats = engine.prefix_cache_stats()
    assert stats["hits"] == 1 and stats["tokens_saved"] >= len(first) - 1


def test_a_stored_entry_is_byte_identical_after_reuse(text_model):
    model, tokenizer = text_model
    prompts = _sharing_workload()
    engine = Engine(model, tokenizer, EngineConfig(prefix_cache_bytes=64 << 20, max_batched_tokens=64, prefill_chunk=16))
    engine.generate([prompts[0]], greedy(4))
    cache = engine.scheduler.prefix_cache
    (entry,) = cache._entries.values()
    before = [np.array(x) for _, state in entry.payload for x in state[:2]]
    engine.generate([prompts[1], prompts[2], prompts[3], prompts[0]], greedy(6))
    assert cache.hits >= 4
    after = [np.array(x) for _, state in entry.payload for x in state[:2]]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


def test_replay_reproduces_prefix_decisions(text_model, tmp_path):
    model, tokenizer = text_model
    prompts = _sharing_workload()
    path = tmp_path / "prefix.jsonl"
    engine = Engine(model, tokenizer, EngineConfig(prefix_cache_bytes=300_000, max_batched_tokens=48,
                                                   prefill_chunk=16, trace_path=str(path)))
    for i, p in enumerate(prompts):
        engine.add_request(prompt_tokens=p, sampling=greedy(6))
        for _ in range(4):
            engine.step()
    while engine.has_pending():
        engine.step()
    engine.close()
    assert engine.prefix_cache_stats()["evictions"] > 0  # small budget: evictions happen and must replay too
    report = replay(load_trace(path))
    assert report.identical, report.format()


def test_clear_prefix_cache_is_a_recorded_decision_that_replays(text_model, tmp_path):
    model, tokenizer = text_model
    prompt = mixed_prompts(1, 60, 60, seed=9)[0]
    path = tmp_path / "clear.jsonl"
    engine = Engine(model, tokenizer, EngineConfig(prefix_cache_bytes=1 << 22, trace_path=str(path)))
    expected = solo_tokens(model, tokenizer, prompt, 5)
    outputs, clear_ticks = [], []
    for wave in range(3):
        if wave == 2:
            assert engine.clear_prefix_cache()
            clear_ticks.append(engine.tick)  # applied at the start of the next tick
        rid = engine.add_request(prompt_tokens=prompt, sampling=greedy(5))
        tokens = []
        while engine.has_pending():
            tokens += [t for o in engine.step() if o.request_id == rid for t in o.token_ids]
        outputs.append(tokens)
    engine.close()
    assert outputs == [expected] * 3
    stats = engine.prefix_cache_stats()
    assert stats["hits"] == 1 and stats["misses"] == 2  # the third request found the cache empty
    events = [e for e in read_jsonl(path) if e["event"] == "prefix_clear"]
    assert [e["tick"] for e in events] == clear_ticks and events[0]["entries"] >= 1
    report = replay(load_trace(path))
    assert report.identical, report.format()
    # replay applies the clear: without it, the third request's lookup would hit and the replay would diverge
    edited = tmp_path / "edited.jsonl"
    edited.write_text("".join(line for line in path.read_text().splitlines(keepends=True)
                              if '"prefix_clear"' not in line))
    assert not replay(load_trace(edited)).identical
    no_cache = Engine(model, tokenizer, EngineConfig())
    assert no_cache.clear_prefix_cache() is False


def test_a_cache_salt_shares_prefixes_only_between_requests_with_that_salt(text_model, tmp_path):
    """vLLM's cache_salt: the same prompt under salt "a", with no salt, under salt "b", then "a" and no salt again,
    one after another: only the last two hit (each the entry of its own salt), the output is the model's either
    way, the trace records each salt, replay is identical and the what-if simulation finds the recorded hits."""
    import dataclasses

    from scheduler import InvalidRequest
    from scheduler.tools.simulate import arrivals_from_trace, fit_cost_model, load_recorded, simulate

    model, tokenizer = text_model
    prompt = mixed_prompts(1, 60, 60, seed=12)[0]
    path = tmp_path / "t.jsonl"
    engine = Engine(model, tokenizer, EngineConfig(prefix_cache_bytes=1 << 22, trace_path=str(path),
                                                   check_invariants=True))
    for bad in ("", 7):
        with pytest.raises(InvalidRequest, match="^cache_salt: must be a non-empty string"):
            engine.add_request(prompt_tokens=prompt, cache_salt=bad)
    want = solo_tokens(model, tokenizer, prompt, 6)
    salts = ["a", None, "b", "a", None]
    for salt in salts:
        rid = engine.add_request(prompt_tokens=prompt, sampling=greedy(6), cache_salt=salt)
        tokens = []
        while engine.has_pending():
            tokens += [t for out in engine.step() if out.request_id == rid for t in out.token_ids]
        assert tokens == want
    engine.close()
    events = read_jsonl(path)
    arrivals = [e for e in events if e["event"] == "arrival"]
    assert [e.get("cache_salt") for e in arrivals] == salts
    stored = {e["entry_id"]: e["request_id"] for e in events if e["event"] == "prefix_store"}
    hits = [(e["request_id"], stored[e["entry_id"]]) for e in events if e["event"] == "prefix_hit"]
    ids = [e["request_id"] for e in arrivals]
    assert hits == [(ids[3], ids[0]), (ids[4], ids[1])]
    assert replay(load_trace(path)).identical
    from scheduler.tools.explain import explain, format_story

    assert [", with a cache salt" in format_story(story) for story in explain(path)] == [s is not None for s in salts]
    rec = load_recorded(path)
    config = dataclasses.replace(rec.trace.config, trace_path=None)
    simulated = simulate(arrivals_from_trace(rec), config, fit_cost_model(rec), policy=config.policy,
                         **rec.simulation_settings()).summary()
    assert simulated["cache_hit_rate"] == pytest.approx(2 / 5)
