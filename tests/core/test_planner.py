"""The pure planner, model-free: budgets hold on every plan, decoding never stalls, everyone finishes, and the
same view always gives the same plan. A stand-in executor (planning logic only; generation correctness is
tested on real models elsewhere) returns a fixed token."""

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.config import EngineConfig
from scheduler.events import EventLog
from scheduler.planner import plan_tick
from scheduler.policy import FCFS
from scheduler.request import FinishReason, Request, SamplingParams
from scheduler.scheduler import Scheduler

from ..helpers import simulate_planning as simulate


configs = st.builds(
    lambda seqs, extra, chunk: EngineConfig(max_seqs=seqs, max_batched_tokens=seqs + extra, prefill_chunk=chunk),
    st.integers(1, 8), st.integers(1, 64), st.integers(1, 64),
)
workloads = st.lists(st.tuples(st.integers(0, 20), st.integers(1, 200), st.integers(1, 12)), min_size=1, max_size=24)


@settings(max_examples=60, deadline=None)
@given(configs, workloads)
def test_budgets_hold_and_everyone_finishes(config, requests):
    _, plans, finished_at = simulate(config, requests)
    assert len(finished_at) == len(requests)
    for plan in plans:
        assert plan.num_batched_tokens <= config.max_batched_tokens
        assert plan.num_seqs <= config.max_seqs
        assert all(1 <= c.num_tokens <= config.prefill_chunk for c in plan.prefill)
    assert all(reason is FinishReason.LENGTH for _, reason in finished_at.values())


@settings(max_examples=40, deadline=None)
@given(configs, workloads)
def test_prefill_progress_is_contiguous(config, requests):
    _, plans, _ = simulate(config, requests)
    covered = {}
    for plan in plans:
        for c in plan.prefill:
            assert c.start == covered.get(c.request_id, 0), "chunks are contiguous, no gaps or repeats"
            covered[c.request_id] = c.end
    for i, (_, n_prompt, _) in enumerate(requests):
        assert covered[f"r{i}"] == n_prompt


def test_a_long_prompt_does_not_stall_running_streams():
    config = EngineConfig(max_seqs=4, max_batched_tokens=16, prefill_chunk=8)
    _, plans, finished_at = simulate(config, [(0, 3, 40), (0, 3, 40), (2, 1000, 2)])
    decoding_ticks = [p for p in plans if "r0" in p.decode]
    assert len(decoding_ticks) == 39  # one token every tick after the first
    long_chunks = [c for p in plans for c in p.prefill if c.request_id == "r2"]
    assert len(long_chunks) > 100  # the long prompt was spread over many ticks...
    assert finished_at["r0"][0] < finished_at["r2"][0]  # ...while r0 finished on its own pace


def test_the_same_view_gives_the_same_plan():
    config = EngineConfig(max_seqs=3, max_batched_tokens=20, prefill_chunk=6)
    sched = Scheduler(config, EventLog())
    for i in range(6):
        sched.add(Request(f"r{i}", [5] * (10 + i), SamplingParams(max_tokens=4)), 0)
    view = sched.view(0)
    assert plan_tick(view, config, FCFS()) == plan_tick(view, config, FCFS())
    plan = plan_tick(view, config, FCFS())
    assert plan.admitted == ("r0", "r1", "r2") and plan.num_seqs == 3


def test_max_seqs_limits_admission_and_fcfs_keeps_order():
    config = EngineConfig(max_seqs=2, max_batched_tokens=100, prefill_chunk=100)
    _, plans, finished_at = simulate(config, [(0, 5, 3)] * 5)
    admitted = [rid for p in plans for rid in p.admitted]
    assert admitted == [f"r{i}" for i in range(5)]
    assert max(p.num_seqs for p in plans) == 2
