"""A request whose first prefill chunk must reach a position (`Request.first_chunk_reach`: Gemma 4's image prompts,
whose image tokens attend to each other both ways in one forward): the planner gives that chunk from position 0
through the reach or nothing, holds back the prefills behind it while it waits, takes no prefix hit short of it,
and the other budgets and everyone's progress hold. Model-free (a fixed-token executor); the model side is
tests/models/test_gemma4_images.py."""

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.config import EngineConfig
from scheduler.events import EventLog
from scheduler.fixtures.executors import FixedTokenExecutor
from scheduler.loop import TickLoop
from scheduler.plan import Reason
from scheduler.planner import SchedulerView, plan_tick
from scheduler.policy import FCFS
from scheduler.request import Request, SamplingParams
from scheduler.scheduler import Scheduler


def run(config, requests, max_ticks=5000):
    """requests: (arrival tick, prompt length, max tokens, first_chunk_reach; 0: a text request). Returns the plans;
    invariants (the reach among them) are checked every tick."""
    sched = Scheduler(config, EventLog())
    loop = TickLoop(sched, FixedTokenExecutor())
    plans, tick, pending = [], 0, sorted(enumerate(requests), key=lambda r: r[1][0])
    while pending or sched.has_live():
        while pending and pending[0][1][0] <= tick:
            i, (_, n, max_tokens, reach) = pending.pop(0)
            sched.add(Request(f"r{i}", [5] * n, SamplingParams(max_tokens=max_tokens), arrival_tick=tick,
                              num_images=1 if reach else 0, media_key=f"m{i}" if reach else None,
                              first_chunk_reach=reach), tick)
        plan = loop.plan(tick)
        loop.carry_out(plan)
        sched.check_invariants(plan)
        plans.append(plan)
        tick += 1
        assert tick < max_ticks, "did not drain"
    return plans


@st.composite
def workloads(draw):
    seqs, extra, chunk = draw(st.integers(1, 6)), draw(st.integers(8, 64)), draw(st.integers(8, 64))
    config = EngineConfig(max_seqs=seqs, max_batched_tokens=seqs + extra, prefill_chunk=chunk,
                          mix=draw(st.sampled_from(["decode-first", "prefill-first"])))
    limit = config.one_forward_limit()[0]
    requests = []
    for _ in range(draw(st.integers(1, 12))):
        n = draw(st.integers(2, 150))
        reach = draw(st.integers(1, min(n - 1, limit))) if draw(st.booleans()) else 0
        requests.append((draw(st.integers(0, 15)), n, draw(st.integers(1, 8)), reach))
    return config, requests


@settings(max_examples=60, deadline=None)
@given(workloads())
def test_first_chunks_reach_and_everyone_finishes(workload):
    config, requests = workload
    plans = run(config, requests)
    fed = {}
    for plan in plans:
        assert plan.num_batched_tokens <= config.max_batched_tokens
        for c in plan.prefill:
            reach = requests[int(c.request_id[1:])][3]
            if c.start < reach:
                assert c.start == 0 and c.end >= reach, (c, reach)
                assert c.num_tokens <= max(config.prefill_chunk, reach)
            else:
                assert c.num_tokens <= config.prefill_chunk
            assert c.start == fed.get(c.request_id, 0)
            fed[c.request_id] = c.end
    assert all(fed[f"r{i}"] == n for i, (_, n, _, _) in enumerate(requests))


def test_a_first_chunk_waits_for_the_budget_and_holds_back_the_prefills_behind_it():
    """r0's long prompt takes 32 of each tick's 40 tokens; r1's first chunk must reach 30, so it waits (the budget
    left) until r0's last chunk leaves it enough, and r2, arriving behind it, waits with it (nobody jumps it); then
    r1's chunk [0, 32) holds its reach, in the tick r2 starts."""
    config = EngineConfig(max_seqs=4, max_batched_tokens=40, prefill_chunk=32)
    plans = run(config, [(0, 100, 4, 0), (0, 40, 4, 30), (2, 20, 4, 0)])
    chunks = [[(c.request_id, c.start, c.end) for c in p.prefill] for p in plans[:4]]
    assert chunks == [[("r0", 0, 32)], [("r0", 32, 64)], [("r0", 64, 96)],
                      [("r0", 96, 100), ("r1", 0, 32), ("r2", 0, 4)]], chunks
    reasons = [{w.request_id: (w.reason, w.others) for w in p.reasons} for p in plans[1:3]]
    assert [r["r1"] for r in reasons] == [(Reason.TOKEN_BUDGET, ())] * 2, reasons
    assert reasons[1]["r2"] == (Reason.POLICY_ORDER, ("r1",)), reasons


def test_a_prefix_hit_is_taken_only_at_or_past_the_reach():
    config = EngineConfig(max_seqs=4, max_batched_tokens=64, prefill_chunk=64)
    for reach, hit, start in ((20, 16, 0), (16, 16, 16), (10, 16, 16)):
        request = Request("r", [5] * 40, SamplingParams(max_tokens=4), first_chunk_reach=reach)
        view = SchedulerView(tick=0, waiting=(request,), prefilling=(), decoding=(),
                             prefix_match=lambda _r, hit=hit: (7, hit))
        plan = plan_tick(view, config, FCFS())
        assert [(c.start, c.end) for c in plan.prefill] == [(start, 40)], (reach, plan.prefill)
        assert [h.tokens for h in plan.prefix_hits] == ([hit] if start else []), (reach, plan.prefix_hits)


def test_a_first_chunk_is_as_long_as_its_reach_past_prefill_chunk():
    """prefill_chunk 16 and a reach of 40: the first chunk is [0, 40), the next ones 16 tokens again, and the cut
    is told as prefill_chunk's."""
    config = EngineConfig(max_seqs=4, max_batched_tokens=64, prefill_chunk=16)
    plans = run(config, [(0, 80, 2, 40)])
    chunks = [(c.start, c.end) for p in plans for c in p.prefill]
    assert chunks == [(0, 40), (40, 56), (56, 72), (72, 80)], chunks
    given = next(p for p in plans if p.prefill)
    assert [(w.request_id, w.reason) for w in given.reasons] == [("r0", Reason.PREFILL_CHUNK)]


def test_the_limit_one_forward_holds_names_the_settings_that_bind():
    assert EngineConfig(prefill_chunk=512, max_batched_tokens=2048).one_forward_limit() == (
        2048, "max_batched_tokens=2048")
    assert EngineConfig(max_batched_tokens=100, max_prefill_tokens=100, max_seqs=8).one_forward_limit() == (
        100, "max_batched_tokens=100 and max_prefill_tokens=100")
    assert EngineConfig(max_prefill_tokens=100).one_forward_limit() == (100, "max_prefill_tokens=100")
