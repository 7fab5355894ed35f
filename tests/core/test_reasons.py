"""Every decision carries its reason: each binding constraint of the vocabulary is produced by a constructed
scenario and shows up in `explain`; reasons are recorded only when they change; replay flags an edited
reason; the vLLM-shaped step fields agree with the plan; older traces without these fields still replay."""

from caches.kv import KVLayout, LayerLayout
from scheduler.config import EngineConfig
from scheduler.events import EventLog, MemorySink
from scheduler.plan import PLAN_RECORD_GROUPS, Reason, TickResult
from scheduler.fixtures.executors import FixedTokenExecutor
from scheduler.loop import TickLoop
from scheduler.request import MediaItemRef, Request, SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.tools.explain import explain

TOKEN = 100  # an ordinary token (no stop ids in these schedulers)


def _scheduler(config, layout=None, **kwargs):
    sink = MemorySink()
    events = EventLog([sink])
    events.emit("engine_start", 0, config={}, plan_records=list(PLAN_RECORD_GROUPS))
    return Scheduler(config, events, kv_layout=layout, **kwargs), sink


def _run(sched, ticks, arrivals=()):
    """Plan and apply `ticks` ticks with synthetic outcomes; `arrivals`: (tick, Request)."""
    plans = []
    for tick in range(ticks):
        for at, request in arrivals:
            if at == tick:
                sched.add(request, tick)
        if not sched.requests:
            break
        ran = TickLoop(sched, FixedTokenExecutor(TOKEN)).run_tick(tick)
        plans.append(ran.plan)
        result = ran.result or TickResult()
        sched.events.emit("outcome", tick, sampled=result.sampled, encoded=result.encoded,
                          measure={"t": tick + 1.0, "tick_start_t": float(tick), "tick_s": 1.0})
    return plans


def _req(rid, n=10, images=0, max_tokens=1000):
    return Request(rid, [TOKEN] * n, SamplingParams(max_tokens=max_tokens), num_images=images,
                   media_key=f"img-{rid}" if images else None)


def _reasons_of(plan):
    return {r.request_id: (r.reason, r.others) for r in plan.reasons}


def _explained(sink, rid):
    story = explain(sink.events, [rid])[0]
    return {(w.reason, w.others) for w in story.waits}


def test_max_seqs_and_prefill_chunk():
    sched, sink = _scheduler(EngineConfig(max_seqs=1, max_batched_tokens=64, prefill_chunk=4))
    plans = _run(sched, 3, [(0, _req("a")), (0, _req("b"))])
    assert _reasons_of(plans[0]) == {"a": (Reason.PREFILL_CHUNK, ()), "b": (Reason.MAX_SEQS, ())}
    assert (Reason.MAX_SEQS, ()) in _explained(sink, "b")
    assert (Reason.PREFILL_CHUNK, ()) in _explained(sink, "a")
    # recorded when it changes, not every tick: b's max_seqs appears once in three plans
    recorded = [r for e in sink.of_kind("plan") for r in e.get("reasons", [])]
    assert [r for r in recorded if r[0] == "b"] == [["b", "max_seqs", []]]
    story = explain(sink.events, ["b"])[0]
    assert story.waits[0].ticks == 3  # still waiting at the end of the trace: the wait spans every tick


def test_token_budget_and_prefill_token_cap():
    sched, sink = _scheduler(EngineConfig(max_seqs=4, max_batched_tokens=10, prefill_chunk=16))
    plans = _run(sched, 1, [(0, _req("a", 20)), (0, _req("b", 20))])
    assert _reasons_of(plans[0]) == {"a": (Reason.TOKEN_BUDGET, ()), "b": (Reason.TOKEN_BUDGET, ())}
    assert (Reason.TOKEN_BUDGET, ()) in _explained(sink, "b")

    sched, sink = _scheduler(EngineConfig(max_seqs=4, max_batched_tokens=64, prefill_chunk=16,
                                          max_prefill_tokens=6))
    plans = _run(sched, 1, [(0, _req("a", 20)), (0, _req("b", 20))])
    assert _reasons_of(plans[0]) == {"a": (Reason.PREFILL_TOKEN_CAP, ()), "b": (Reason.PREFILL_TOKEN_CAP, ())}
    assert (Reason.PREFILL_TOKEN_CAP, ()) in _explained(sink, "a")


def test_kv_budget_and_policy_order():
    layout = KVLayout((LayerLayout(1, None),))  # one byte per token: bounds are token counts
    sched, sink = _scheduler(EngineConfig(max_seqs=4, max_batched_tokens=64, prefill_chunk=64,
                                          kv_memory_bytes=300, kv_headroom_tokens=0), layout)
    plans = _run(sched, 2, [(0, _req("a")), (1, _req("b")), (1, _req("c"))])
    assert plans[0].admitted == ("a",)
    assert _reasons_of(plans[1]) == {"b": (Reason.KV_BUDGET, ()), "c": (Reason.POLICY_ORDER, ("b",))}
    assert (Reason.KV_BUDGET, ()) in _explained(sink, "b")
    assert (Reason.POLICY_ORDER, ("b",)) in _explained(sink, "c")


def test_preempted_by_the_request_it_made_room_for():
    layout = KVLayout((LayerLayout(1, None),))
    sched, sink = _scheduler(EngineConfig(max_seqs=4, max_batched_tokens=64, prefill_chunk=64,
                                          kv_memory_bytes=600, kv_headroom_tokens=0), layout)
    plans = _run(sched, 60, [(0, _req("a")), (0, _req("b"))])
    preempting = [p for p in plans if p.preempted]
    assert preempting and preempting[0].preempted == ("b",)
    assert _reasons_of(preempting[0])["b"] == (Reason.PREEMPTED_BY, ("a",))
    story = explain(sink.events, ["b"])[0]
    assert (Reason.PREEMPTED_BY, ("a",)) in {(w.reason, w.others) for w in story.waits}
    assert story.preemptions == [(preempting[0].tick, "a")]


def test_vision_budget_and_waiting_for_media():
    sched, sink = _scheduler(EngineConfig(max_seqs=4, max_batched_tokens=64, prefill_chunk=64, vision_budget=1))
    plans = _run(sched, 3, [(0, _req("a", images=1)), (0, _req("b", images=1))])
    assert plans[0].admitted == ("a", "b") and plans[0].encode == ("a",)
    assert _reasons_of(plans[0]) == {"a": (Reason.WAITING_FOR_MEDIA, ()), "b": (Reason.VISION_BUDGET, ())}
    assert _reasons_of(plans[1])["b"] == (Reason.WAITING_FOR_MEDIA, ())
    assert {(Reason.VISION_BUDGET, ()), (Reason.WAITING_FOR_MEDIA, ())} <= _explained(sink, "b")
    assert (Reason.WAITING_FOR_MEDIA, ()) in _explained(sink, "a")


def test_the_vision_token_budget_bounds_encoder_work_by_size():
    """Small images share a tick up to vision_token_budget media tokens, whatever their count; an image larger
    than the whole token budget is encoded alone in a tick, not never; None bounds items only."""
    def media(rid, tokens):
        return Request(rid, [TOKEN] * (tokens + 4), SamplingParams(max_tokens=1000), num_images=1,
                       num_media_tokens=tokens, media_key=rid)

    config = dict(max_seqs=8, max_batched_tokens=4096, prefill_chunk=64, vision_budget=16)
    sched, sink = _scheduler(EngineConfig(**config, vision_token_budget=100))
    plans = _run(sched, 3, [(0, media("a", 40)), (0, media("b", 40)), (0, media("c", 40)), (0, media("d", 300)),
                            (0, media("e", 10))])
    # 40 + 40 tokens, then c's 40 would pass 100 and d's 300 too; e's 10 fit what is left
    assert plans[0].encode == ("a", "b", "e") and plans[1].encode == ("c",) and plans[2].encode == ("d",)
    assert _reasons_of(plans[0])["c"] == (Reason.VISION_BUDGET, ())
    assert _reasons_of(plans[1])["d"] == (Reason.VISION_BUDGET, ())
    sched, _ = _scheduler(EngineConfig(**config, vision_token_budget=None))
    plans = _run(sched, 1, [(0, media(r, 300)) for r in "abc"])
    assert plans[0].encode == ("a", "b", "c")


def test_the_vision_budget_pays_only_for_what_the_encoders_run_on():
    """A media unit the vision cache holds, or one an earlier request of the tick pays for, costs no budget (the
    executor does not encode it again); a request with nothing left to encode neither waits nor keeps an
    over-budget one from going alone; per-item units are counted each on its own; an engine before the rule
    (`count_cached_media`, the replay of its traces) counted every unit."""
    def media(rid, key, tokens=40, items=()):
        return Request(rid, [TOKEN] * (tokens + 4), SamplingParams(max_tokens=1000), num_images=max(1, len(items)),
                       num_media_tokens=tokens, media_key=key,
                       media_items=tuple(MediaItemRef(k, tokens // len(items), 1) for k in items))

    config = EngineConfig(max_seqs=8, max_batched_tokens=4096, prefill_chunk=64, vision_budget=2,
                          vision_token_budget=100)
    cached = {"seen", "seen-2"}
    arrivals = [(0, media("a", "new-1")), (0, media("b", "new-1")), (0, media("c", "seen", tokens=300)),
                (0, media("d", "new-2")), (0, media("e", "big", tokens=300)),
                (0, media("f", "k", tokens=80, items=("seen", "new-3"))),  # half cached: pays 40 tokens
                (0, media("g", "k2", tokens=80, items=("seen-2", "new-1")))]  # nothing left to encode
    sched, _ = _scheduler(config, vision_cached=cached.__contains__)
    plans = _run(sched, 2, arrivals)
    # a pays 40 and 1 item; b repeats a's image; c is cached (300 tokens, free); d pays the second item; e
    # (300 > 100) waits while the tick has encoder work; f's new item would be a third item; g is all paid for
    assert plans[0].encode == ("a", "b", "c", "d", "g")
    assert _reasons_of(plans[0])["e"] == (Reason.VISION_BUDGET, ())
    assert _reasons_of(plans[0])["f"] == (Reason.VISION_BUDGET, ())
    assert plans[1].encode == ("e",)  # alone: over the whole token budget
    # the tick's only encoder work is what makes an over-budget request go alone, not a free request before it
    sched, _ = _scheduler(config, vision_cached=cached.__contains__)
    assert _run(sched, 1, [(0, media("c", "seen", tokens=300)), (0, media("e", "big", tokens=300))])[0].encode \
        == ("c", "e")
    sched, _ = _scheduler(config, vision_cached=cached.__contains__, count_cached_media=True)
    plans = _run(sched, 1, arrivals)
    assert plans[0].encode == ("a", "b")  # 2 items: every unit counted, the repeat too


def test_prefill_first_pauses_the_running_rows():
    sched, sink = _scheduler(EngineConfig(max_seqs=4, max_batched_tokens=64, prefill_chunk=8, mix="prefill-first"))
    plans = _run(sched, 6, [(0, _req("a", 4)), (3, _req("b", 20))])
    assert plans[2].decode == ("a",) and "a" not in _reasons_of(plans[2])
    assert plans[3].decode == () and _reasons_of(plans[3])["a"] == (Reason.PREFILL_FIRST, ())
    assert (Reason.PREFILL_FIRST, ()) in _explained(sink, "a")
    story = explain(sink.events, ["a"])[0]
    paused = next(w for w in story.waits if w.reason is Reason.PREFILL_FIRST)
    # b's 19 tokens before its last take ticks 3..5 (8 + 8 + 3): a pauses over exactly those
    assert (paused.first_tick, paused.ticks) == (3, 3)


def test_draft_budget_and_draft_ineligible():
    sched, sink = _scheduler(EngineConfig(max_seqs=4, max_batched_tokens=10, prefill_chunk=16, draft_tokens=3))
    penalised = Request("c", [TOKEN] * 4, SamplingParams(max_tokens=1000, presence_penalty=0.5))
    plans = _run(sched, 4, [(0, _req("a", 4)), (0, penalised), (2, _req("b", 20))])
    # tick 1: two rows, 8 tokens left: a drafts all 3; c never drafts
    assert plans[1].draft == (("a", 3),) and _reasons_of(plans[1]) == {"c": (Reason.DRAFT_INELIGIBLE, ())}
    # tick 2: b's first chunk takes the 8 tokens the rows leave: no draft positions are left for a
    assert plans[2].draft == () and _reasons_of(plans[2])["a"] == (Reason.DRAFT_BUDGET, ())
    assert (Reason.DRAFT_BUDGET, ()) in _explained(sink, "a")
    assert (Reason.DRAFT_INELIGIBLE, ()) in _explained(sink, "c")


def test_a_row_within_its_min_tokens_does_not_draft_until_it_has_them():
    """min_tokens masks the stop tokens of a row's first tokens, which a verify forward's later positions would
    not see: the row is held back (draft_min_tokens) until it has them, then drafts like any other."""
    sched, sink = _scheduler(EngineConfig(max_seqs=4, max_batched_tokens=32, prefill_chunk=16, draft_tokens=3))
    bound = Request("m", [TOKEN] * 4, SamplingParams(max_tokens=1000, min_tokens=3))
    plans = _run(sched, 6, [(0, _req("a", 4)), (0, bound)])
    # tick 0 prefills both and samples their first tokens; m has 1, 2 tokens at ticks 1, 2: held back there
    for tick in (1, 2):
        assert plans[tick].draft == (("a", 3),) and _reasons_of(plans[tick]) == {"m": (Reason.DRAFT_MIN_TOKENS, ())}
    assert ("m", 3) in plans[3].draft and "m" not in _reasons_of(plans[3])
    assert (Reason.DRAFT_MIN_TOKENS, ()) in _explained(sink, "m")


def test_the_prefill_cap_leaves_drafts_the_rest_of_the_tick():
    """max_prefill_tokens caps prefill only: a tick whose prefill takes the whole cap still verifies drafts
    with what max_batched_tokens has left, and the plan counts both."""
    sched, _ = _scheduler(EngineConfig(max_seqs=4, max_batched_tokens=64, prefill_chunk=16, max_prefill_tokens=6,
                                       draft_tokens=3))
    plans = _run(sched, 4, [(0, _req("a", 4)), (2, _req("b", 40))])
    # tick 2: b's chunk takes the whole prefill cap (6 tokens); a still drafts all 3 from the 63 the row leaves
    assert [c.num_tokens for c in plans[2].prefill] == [6]
    assert plans[2].draft == (("a", 3),) and "a" not in _reasons_of(plans[2])
    assert plans[2].num_batched_tokens == 1 + 6 + 3  # a's row, b's chunk, a's drafts (b does not decode yet)


def test_a_row_near_its_end_drafts_what_it_can_use_without_a_reason():
    sched, _ = _scheduler(EngineConfig(max_seqs=4, max_batched_tokens=64, prefill_chunk=16, draft_tokens=3))
    plans = _run(sched, 3, [(0, _req("a", 4, max_tokens=3))])
    assert plans[1].draft == (("a", 1),) and plans[1].reasons == ()  # 1 output, 2 left: 1 draft + its token


def test_every_reason_is_covered_by_a_scenario_above():
    source = open(__file__, encoding="utf-8").read()
    assert all(f"Reason.{r.name}" in source.split("def test_every_reason")[0] for r in Reason)
