"""What the KV caches really hold (issue 24 item 10). A draft model keeps a cache of its own: its layers are
in the layout the planner bounds, so real <= bound <= budget after every tick with drafting on. A merge briefly
holds the joining requests' own caches next to the batch: measured here with MLX's allocator (on caches the
tiny model really filled), it stays within the end-state bound plus `KVLayout.join_bytes`, the margin the
README tells users to leave; the budget itself bounds what is held after each tick (counting the merge
transient in it left the 2-layer test models room for about one row in three)."""

import gc

import mlx.core as mx
import pytest

from caches.kv import KVCacheManager
from scheduler import Engine, EngineConfig, SamplingParams
from scheduler.events import MemorySink
from scheduler.execution import library
from scheduler.tools.replay import load_trace, replay

from ..helpers import drive, mixed_prompts, solo_tokens


def _filled(model, n):
    cache = library.make_request_cache(model)
    model(mx.array([[7 + i % 500 for i in range(n)]]), cache=cache)
    mx.eval(library.cache_arrays(cache))
    return cache


@pytest.mark.parametrize("old, joining", [([300], [300, 300, 300]), ([100, 20, 70], [200, 10]), ([], [40, 60])],
                         ids=["long-joiners", "mixed", "no-batch-yet"])
def test_a_merge_is_measured_within_the_bound_the_planner_keeps(text_model, old, joining):
    model, _ = text_model
    layout = library.kv_layout(model)
    kv = KVCacheManager(lambda: library.make_request_cache(model))
    for i, n in enumerate(old):
        kv.adopt(f"old{i}", _filled(model, n))
    if old:
        kv.join([f"old{i}" for i in range(len(old))])
    for i, n in enumerate(joining):
        kv.adopt(f"new{i}", _filled(model, n))
    gc.collect()
    held_before = kv.nbytes()
    not_kv = mx.get_active_memory() - held_before  # weights and everything else: untouched by the merge
    mx.reset_peak_memory()
    kv.join([f"new{i}" for i in range(len(joining))])
    measured_peak = mx.get_peak_memory() - not_kv  # the KV arrays at the merge's peak, as allocated
    after = kv.nbytes()
    end_state_bound = layout.footprint(old + joining, [])  # what the tick ends with (the bound before)
    bound = end_state_bound + layout.join_bytes(old, [(n, n) for n in joining])
    assert after <= end_state_bound
    assert after < measured_peak <= bound
    assert kv.peak_bytes <= bound  # the manager's own count of the peak (Engine.kv_cache_stats)
    if joining == [300, 300, 300]:  # the merge really holds more than any end state the old bound counted
        assert measured_peak > end_state_bound


def test_the_budget_counts_the_draft_models_cache(text_model, tmp_path):
    model, tokenizer = text_model
    budget = 2_600_000
    log = MemorySink()
    trace = tmp_path / "draft-kv.jsonl"
    engine = Engine(model, tokenizer, EngineConfig(
        max_batched_tokens=96, max_seqs=6, prefill_chunk=32, kv_memory_bytes=budget, kv_headroom_tokens=4,
        draft_tokens=2, drafter="draft-model", trace_path=str(trace)), draft_model=model, event_sinks=[log])
    # the draft model (the target itself here) has its layers counted next to the target's
    assert len(engine.kv_layout.layers) == 2 * len(library.kv_layout(model).layers)
    prompts = mixed_prompts(6, 10, 110, seed=5)
    drafter = engine.executor.drafter
    pending = [(i // 2, p) for i, p in enumerate(prompts)]
    tokens: dict[str, list[int]] = {}
    draft_held = []
    while pending or engine.has_pending():
        while pending and pending[0][0] <= engine.tick:
            rid = engine.add_request(prompt_tokens=pending.pop(0)[1], sampling=SamplingParams(max_tokens=12))
            tokens[rid] = []
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
        plan = log.of_kind("plan")[-1]
        if plan["kv_bytes_bound"] is None or not (plan["prefill"] or plan["decode"]):
            continue
        # the arrays themselves: the target's caches and the draft model's, after the tick
        real_after = engine.executor.kv.nbytes() + drafter.cache_bytes()
        assert real_after <= plan["kv_bytes_bound"] <= budget, plan["tick"]
        draft_held.append(drafter.cache_bytes())
    engine.close()
    assert max(draft_held) > 0  # the draft model did hold a cache, and it was counted
    assert engine.executor.cache_bytes() == 0
    assert list(tokens.values()) == [solo_tokens(model, tokenizer, p, 12) for p in prompts]
    assert len(load_trace(trace).header["kv_layout"]["layers"]) == 4
    assert replay(load_trace(trace)).identical
