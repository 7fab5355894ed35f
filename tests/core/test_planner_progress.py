"""Progress: whatever the config, every request finishes. Model-free planning runs (a fixed-token executor;
generation is tested on real models elsewhere) over configs that combine the features whose interplay once
livelocked the planner: prefill-first mixing, a KV memory budget and media requests (vision encoding)."""

import math
import random

import pytest

from caches.kv import KVLayout, LayerLayout
from scheduler.config import EngineConfig
from scheduler.events import EventLog
from scheduler.plan import Reason
from scheduler.request import FinishReason, Request, SamplingParams
from scheduler.scheduler import Scheduler

from ..helpers import simulate_planning as simulate

BYTES_PER_TOKEN = 16
LAYOUT = KVLayout((LayerLayout(BYTES_PER_TOKEN, None),))


def _reason(plan, rid):
    return next((r.reason for r in plan.reasons if r.request_id == rid), None)


def test_the_prefill_first_media_livelock_ends():
    """Regression (found by the planner refactor, 11 of 300 random configs): each tick a media request was
    admitted (with no KV check) and encoded, and the next tick preempted to make room; in prefill-first mode
    that admit/encode-only plan counted as prefill work, so the decoding rows, whose memory it needed, stayed
    paused for ever. Minimal workload, shrunk from a random one, under the config it was seen with."""
    config = EngineConfig(max_batched_tokens=128, max_seqs=4, prefill_chunk=16, max_prefill_tokens=24,
                          policy="prefix-aware", mix="prefill-first", kv_memory_bytes=20000, kv_headroom_tokens=4)
    # (arrival tick, prompt tokens, max tokens, priority, images)
    requests = [(1, 1, 1, 0, 1), (0, 2, 2, 0, 0), (0, 1, 2, 0, 1), (1, 1, 1, 0, 1), (0, 75, 2, 0, 1)]
    _, plans, finished_at = simulate(config, requests, kv_layout=LAYOUT, max_ticks=60)
    assert {rid: reason for rid, (_, reason) in finished_at.items()} == {
        f"r{i}": FinishReason.LENGTH for i in range(len(requests))}
    assert len(plans) < 20
    assert sum(len(p.preempted) for p in plans) <= 1


def test_media_admission_is_checked_against_the_kv_budget():
    """A media request is admitted (to vision encoding) only if its whole prompt fits next to the rows grown
    by the headroom, like a text request: it used to be let in unchecked and preempted the next tick."""
    layout = KVLayout((LayerLayout(1, None),))  # one byte per token: bounds are token counts
    # the decoding row "r0" takes 10 + STEP tokens; a second request of 10 tokens does not fit next to it
    config = EngineConfig(max_seqs=4, max_batched_tokens=64, prefill_chunk=64, kv_memory_bytes=400,
                          kv_headroom_tokens=2)
    _, plans, finished_at = simulate(config, [(0, 10, 6), (2, 10, 3, 0, 1)], kv_layout=layout)
    assert not any(p.preempted for p in plans)
    r1_admitted = next(p.tick for p in plans if "r1" in p.admitted)
    assert r1_admitted > finished_at["r0"][0]  # it waited for r0's memory...
    assert all(_reason(p, "r1") is Reason.KV_BUDGET for p in plans[2:r1_admitted])  # ...and said so
    assert finished_at["r1"][1] is FinishReason.LENGTH


def test_kv_admission_counts_the_media_already_admitted():
    """Two media requests that each fit, but not together: the second waits (its reason: kv_budget) instead
    of being admitted next to the first and preempted when both start to prefill."""
    layout = KVLayout((LayerLayout(1, None),))
    config = EngineConfig(max_seqs=4, max_batched_tokens=64, prefill_chunk=64, kv_memory_bytes=300,
                          kv_headroom_tokens=0)
    _, plans, _ = simulate(config, [(0, 20, 2, 0, 1), (0, 20, 2, 0, 1)], kv_layout=layout)
    assert plans[0].admitted == ("r0",) and _reason(plans[0], "r1") is Reason.KV_BUDGET
    assert not any(p.preempted for p in plans)


def test_kv_admission_counts_the_whole_prompts_already_prefilling():
    """Regression: admission counted a request still prefilling at the chunks it had so far, so a request
    let in behind a long prompt took the memory that prompt's later chunks needed; then either the newcomer
    was preempted two ticks later (budget 700 here) or the older prompt waited behind it and was preempted
    for it (750-800). Now the newcomer waits (kv_budget) until the long prompt's memory is free, and nothing
    is preempted."""
    layout = KVLayout((LayerLayout(1, None),))
    for budget in (700, 750, 800):
        config = EngineConfig(max_seqs=4, max_batched_tokens=64, prefill_chunk=32, kv_memory_bytes=budget,
                              kv_headroom_tokens=2)
        _, plans, finished_at = simulate(config, [(0, 200, 4), (1, 100, 40)], kv_layout=layout)
        assert not any(p.preempted for p in plans), budget
        r1_admitted = next(p.tick for p in plans if "r1" in p.admitted)
        assert r1_admitted > finished_at["r0"][0]
        assert all(_reason(p, "r1") is Reason.KV_BUDGET for p in plans[1:r1_admitted])
        assert finished_at["r0"][0] == 9  # (7 prefill ticks of 32 tokens, then 3 more decode ticks)
        assert {reason for _, reason in finished_at.values()} == {FinishReason.LENGTH}


def test_prefill_first_decodes_next_to_media_encoding():
    """In prefill-first mode only prefill chunks make a tick prefill only: a tick that only admits and
    encodes media decodes the running rows too."""
    config = EngineConfig(max_seqs=4, max_batched_tokens=64, prefill_chunk=64, mix="prefill-first")
    _, plans, _ = simulate(config, [(0, 5, 8), (3, 5, 2, 0, 1)])
    encoding = next(p for p in plans if p.encode)
    assert encoding.tick == 3 and encoding.encode == ("r1",) and not encoding.prefill
    assert encoding.decode == ("r0",)
    prefilling = plans[4]  # the next tick prefills r1 (prefill only: r0 pauses)
    assert [c.request_id for c in prefilling.prefill] == ["r1"] and prefilling.decode == ()


def _random_case(rng: random.Random):
    config = EngineConfig(
        max_batched_tokens=rng.choice([24, 48, 128]), max_seqs=rng.randint(1, 6),
        prefill_chunk=rng.choice([4, 16, 32]), max_prefill_tokens=rng.choice([None, None, 24]),
        policy=rng.choice(["fcfs", "prefix-aware", "priority"]), mix=rng.choice(["decode-first", "prefill-first"]),
        kv_memory_bytes=rng.choice([None, 12000, 20000]), kv_headroom_tokens=rng.choice([0, 4]),
        vision_budget=rng.randint(1, 3), draft_tokens=rng.choice([0, 0, 2]))
    requests = [(rng.randint(0, 12), rng.randint(1, 80), rng.randint(1, 12), rng.randint(0, 2),
                 rng.choice([0, 0, 1, 2])) for _ in range(rng.randint(1, 12))]
    return config, requests


def _serial_ticks(config: EngineConfig, prompt: int, max_tokens: int) -> int:
    """Ticks the request needs alone: one to encode its media, its chunks, then one per token."""
    chunk = min(config.prefill_chunk, config.max_prefill_tokens or config.prefill_chunk)
    return 1 + math.ceil(prompt / chunk) + max_tokens


def test_every_request_finishes_within_a_bound():
    """The progress property over 300 random configs (prefill-first, KV budget, media, drafting, policies
    mixed): every request finishes by its length, by the last arrival plus twice the ticks all requests need
    one after the other (every tick moves some request on; a preemption's recompute is the slack). A livelock
    never drains."""
    for seed in range(300):
        config, requests = _random_case(random.Random(seed))
        bound = max(r[0] for r in requests) + 2 * sum(_serial_ticks(config, r[1], r[2]) for r in requests)
        _, plans, finished_at = simulate(config, requests, kv_layout=LAYOUT, max_ticks=bound + 1)
        assert len(finished_at) == len(requests), f"seed {seed}: {config}"
        assert all(reason is FinishReason.LENGTH for _, reason in finished_at.values()), f"seed {seed}"


@pytest.mark.parametrize("layout, budgets", [
    # quantized rows: a prompt's float prefill peak is above its quantized row
    (KVLayout((LayerLayout(16, None, quantized_bytes_per_token=4),) * 2, quantized_prefill_from=2048,
              quantized_rows_from=25), (8_000, 14_000)),
    # a sliding window of 8 next to a full layer: the window's cache holds the chunk too while a prompt prefills
    (KVLayout((LayerLayout(16, None), LayerLayout(16, 8))), (7_000, 11_000)),
], ids=["quantized", "sliding"])
@pytest.mark.parametrize("media", [False, True], ids=["text", "media"])
def test_a_prompt_the_engine_accepts_is_one_the_planner_admits_alone(layout, budgets, media):
    """`KVLayout.admit_alone_bytes` (what Engine.add_request checks a prompt against) is exactly the planner's
    admission rule on an empty engine, prefill peaks included (quantized rows' float peak, a sliding window's
    chunk), for a text request and for a media request's admission to encoding: a prompt within it runs to the
    end, one over it is never admitted. Regressions: under kv_bits the engine checked the row alone and queued
    prompts whose float peak never fits, which then held back every request behind them for ever; on a sliding
    window the planner admitted by the row and planned ticks over the budget."""
    rng = random.Random(7)
    admitted = refused = 0
    for _ in range(300):
        n, headroom, chunk = rng.randint(2, 120), rng.choice([1, 4]), rng.choice([8, 32])
        budget = rng.randint(*budgets)
        config = EngineConfig(max_seqs=2, max_batched_tokens=64, prefill_chunk=chunk, kv_memory_bytes=budget,
                              kv_headroom_tokens=headroom, check_invariants=True)
        need = layout.admit_alone_bytes(n, headroom, min(chunk, max(n - 1, 1)))
        images = int(media)
        if need <= budget:
            _, plans, finished_at = simulate(config, [(0, n, 3, 0, images)], kv_layout=layout)
            assert finished_at["r0"][1] is FinishReason.LENGTH and plans[0].admitted == ("r0",)
            admitted += 1
        else:
            scheduler = Scheduler(config, EventLog(), kv_layout=layout)
            scheduler.add(Request("r0", [5] * n, SamplingParams(max_tokens=3), num_images=images,
                                  media_key="img" if media else None), 0)
            plan = scheduler.plan(scheduler.view(0))
            assert plan.admitted == () and _reason(plan, "r0") is Reason.KV_BUDGET
            refused += 1
    assert admitted > 50 and refused > 50
