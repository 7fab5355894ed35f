"""The plan carries what an executor needs of a request it has not seen (`TickPlan.new_requests`), so
executors never get the scheduler's `Request` objects: each request is new exactly at its first work after
an admission (its first chunk; a media request's encoding tick), again after a preemption with the outputs
it must recompute, and never otherwise; the field is derived data (not recorded, not part of plan equality)."""

from caches.kv import KVLayout, LayerLayout
from scheduler.config import EngineConfig
from scheduler.events import EventLog
from scheduler.fixtures.executors import FixedTokenExecutor
from scheduler.loop import TickLoop
from scheduler.request import Request, SamplingParams
from scheduler.scheduler import Scheduler


class _Recording(FixedTokenExecutor):
    def __init__(self):
        super().__init__(100)
        self.plans = []

    def execute(self, plan):
        self.plans.append(plan)
        return super().execute(plan)


def _run(config, requests, layout=None, max_ticks=2000):
    sched = Scheduler(config, EventLog(), kv_layout=layout)
    executor = _Recording()
    loop = TickLoop(sched, executor)
    for request in requests:
        sched.add(request, 0)
    tick = 0
    while sched.has_live():
        loop.run_tick(tick)
        tick += 1
        assert tick < max_ticks
    return sched, executor.plans


def _prompt(n, seed):
    return [7 + (seed * 31 + i * 7) % 400 for i in range(n)]


def test_each_text_request_is_new_once_at_its_first_chunk_with_its_values():
    config = EngineConfig(max_seqs=2, max_batched_tokens=12, prefill_chunk=4)
    requests = [Request(f"r{i}", _prompt(10 + i, i), SamplingParams(max_tokens=3, temperature=0.5), seed=40 + i)
                for i in range(4)]
    _, plans = _run(config, requests)
    seen = {}
    for plan in plans:
        first_chunks = {c.request_id for c in plan.prefill if c.start == 0}
        assert {n.request_id for n in plan.new_requests} == first_chunks
        for new in plan.new_requests:
            assert new.request_id not in seen, "a request is new once (no preemption here)"
            seen[new.request_id] = new
    assert set(seen) == {r.request_id for r in requests}
    for r in requests:
        new = seen[r.request_id]
        assert (list(new.prompt_tokens), new.sampling, new.seed) == (r.prompt_tokens, r.sampling, r.seed)
        assert (new.output_tokens, new.recompute_tokens) == ((), 0)


def test_a_preempted_request_is_new_again_with_the_outputs_it_recomputes():
    layout = KVLayout((LayerLayout(16, None),))
    config = EngineConfig(max_seqs=8, max_batched_tokens=64, prefill_chunk=16, kv_memory_bytes=20_000,
                          kv_headroom_tokens=0)
    requests = [Request(f"r{i}", _prompt(30, i), SamplingParams(max_tokens=40)) for i in range(6)]
    _, plans = _run(config, requests, layout)
    readmitted = [(plan, new) for plan in plans for new in plan.new_requests if new.recompute_tokens]
    assert readmitted, "the budget was tight enough to preempt"
    for plan, new in readmitted:
        assert len(new.output_tokens) == new.recompute_tokens > 0
        assert set(new.output_tokens) == {100}  # what the executor produced before the preemption
        assert new.request_id in {c.request_id for c in plan.prefill if c.start == 0}


def test_a_media_request_is_new_at_its_encoding_tick_only():
    config = EngineConfig(max_seqs=4, max_batched_tokens=16, prefill_chunk=8)
    requests = [Request("img", _prompt(12, 1), SamplingParams(max_tokens=2), num_images=1, media_key="k",
                        media="prepared inputs"),
                Request("txt", _prompt(5, 2), SamplingParams(max_tokens=2))]
    _, plans = _run(config, requests)
    new_at = {n.request_id: (plan.tick, n) for plan in plans for n in plan.new_requests}
    encode_tick = next(p.tick for p in plans if "img" in p.encode)
    assert new_at["img"][0] == encode_tick
    assert (new_at["img"][1].media, new_at["img"][1].num_images, new_at["img"][1].media_key) == \
        ("prepared inputs", 1, "k")
    first_chunk_tick = next(p.tick for p in plans if any(c.request_id == "img" for c in p.prefill))
    assert first_chunk_tick > encode_tick
    assert sum(n.request_id == "img" for p in plans for n in p.new_requests) == 1


def test_new_requests_are_neither_recorded_nor_part_of_a_plans_identity():
    import dataclasses

    config = EngineConfig(max_seqs=2, max_batched_tokens=8, prefill_chunk=4)
    _, plans = _run(config, [Request("a", _prompt(6, 0), SamplingParams(max_tokens=2))])
    first = plans[0]
    assert first.new_requests
    assert "new_requests" not in first.to_record()
    assert dataclasses.replace(first, new_requests=()) == first
