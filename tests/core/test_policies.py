"""Policies: registry, ordering, and the no-starvation guarantees, model-free on the real scheduler."""

import pytest

from scheduler.config import EngineConfig
from scheduler.policy import POLICIES, FCFS, PrefixAware, Priority, ShortestPromptFirst, make_policy
from scheduler.request import Request, SamplingParams

from ..helpers import simulate_planning


def _req(rid, prompt_len, priority=0, arrival=0):
    return Request(rid, [5] * prompt_len, SamplingParams(), priority=priority, arrival_tick=arrival)


def test_registry_by_name_and_custom_objects():
    assert set(POLICIES) == {"fcfs", "priority", "shortest-prompt-first", "prefix-aware"}
    for name in POLICIES:
        assert make_policy(name).name == name
    custom = FCFS()
    assert make_policy(custom) is custom
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("random")


def test_orders():
    reqs = [_req("a", 50, priority=0), _req("b", 5, priority=2), _req("c", 20, priority=1)]
    assert [r.request_id for r in FCFS().order_waiting(reqs, 0)] == ["a", "b", "c"]
    assert [r.request_id for r in Priority().order_waiting(reqs, 0)] == ["b", "c", "a"]
    assert [r.request_id for r in ShortestPromptFirst().order_waiting(reqs, 0)] == ["b", "c", "a"]
    cached = {"a": 40, "b": 0, "c": 10}
    assert [r.request_id for r in PrefixAware().order_waiting(reqs, 0, lambda r: cached[r.request_id])] == \
        ["a", "c", "b"]


def test_aging_lifts_old_requests():
    p = Priority(aging_ticks=10)
    old = _req("old", 5, priority=0, arrival=0)
    for now, first in ((20, "fresh"), (100, "old")):
        fresh = _req("fresh", 5, priority=3, arrival=now)
        assert [r.request_id for r in p.order_waiting([fresh, old], now)][0] == first


def test_low_priority_finishes_under_a_constant_stream_of_high_priority():
    config = EngineConfig(max_seqs=2, max_batched_tokens=20, prefill_chunk=16)
    # an urgent request every tick: more than two slots can serve, so urgent work is always waiting
    stream = [(t, 4, 4, 10) for t in range(0, 300)]
    low = [(5, 4, 4, 0)]
    _, _, finished = simulate_planning(config, low + stream, policy=Priority(aging_ticks=8))
    low_done, _ = finished["r0"]
    last_urgent = max(tick for rid, (tick, _) in finished.items() if rid != "r0")
    assert low_done < 300 < last_urgent, "aging let the low-priority request in while urgent ones kept coming"
    # without aging pressure (huge aging period) it waits until the stream ends
    _, _, starved = simulate_planning(config, low + stream, policy=Priority(aging_ticks=10**9))
    assert starved["r0"][0] > low_done


def test_shortest_prompt_first_lowers_mean_completion_of_short_prompts():
    config = EngineConfig(max_seqs=1, max_batched_tokens=64, prefill_chunk=64)
    work = [(0, 600, 2)] + [(0, 8, 2)] * 6
    _, _, fcfs = simulate_planning(config, work, policy=FCFS())
    _, _, spf = simulate_planning(config, work, policy=ShortestPromptFirst())
    short = [f"r{i}" for i in range(1, 7)]
    assert sum(spf[r][0] for r in short) < sum(fcfs[r][0] for r in short)


def test_prefill_first_trades_decode_stalls_for_time_to_first_token():
    # sixteen streams decoding (they take 16 of the 40 tokens of every decode-first tick), then a long prompt
    work = [(0, 3, 60)] * 16 + [(5, 400, 2)]
    results = {}
    for mix in ("decode-first", "prefill-first"):
        config = EngineConfig(max_seqs=20, max_batched_tokens=40, prefill_chunk=64, mix=mix)
        _, plans, finished = simulate_planning(config, work)
        first_token = next(p.tick for p in plans if any(c.request_id == "r16" and c.completes for c in p.prefill))
        paused = sum(1 for p in plans if p.prefill and not p.decode and p.tick > 5)
        results[mix] = (first_token, paused, finished["r0"][0])
    (df_first, df_paused, df_r0), (pf_first, pf_paused, pf_r0) = results["decode-first"], results["prefill-first"]
    assert pf_first < df_first, "prefill-first gives the long prompt its first token sooner"
    assert df_paused == 0 and pf_paused > 0, "prefill-first pauses the decoding streams meanwhile"
    assert pf_r0 > df_r0, "so the running streams finish later"
