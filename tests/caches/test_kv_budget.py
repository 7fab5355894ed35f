"""KV memory budget: admission only of what fits, preemption when decoding outgrows the budget, recompute
that still gives every request its solo output, and clean failure for what can never fit."""

import pytest

from caches.kv import STEP, KVLayout, LayerLayout
from scheduler import Engine, EngineConfig, FinishReason, InvalidRequest
from scheduler.tools.replay import load_trace, replay

from ..helpers import drain, drive, engine_with_log, greedy, interleave, mixed_prompts, solo_tokens

PROMPTS = mixed_prompts(32, 8, 120, seed=21)
MAX_TOKENS = 48


def test_layout_bounds():
    layout = KVLayout((LayerLayout(100, None), LayerLayout(100, 16)))
    assert layout.bytes_per_token == 200
    assert layout.request_bytes(10, 10) == 100 * (10 + STEP) + 100 * min(10 + STEP, 16 + 10 + STEP)
    assert layout.batch_bytes([5, 300]) == 100 * 2 * (300 + STEP) + 100 * 2 * (16 + STEP)
    assert layout.batch_bytes([]) == 0


@pytest.fixture(scope="module")
def reference(text_model):
    model, tokenizer = text_model
    return [solo_tokens(model, tokenizer, p, MAX_TOKENS) for p in PROMPTS]


def test_a_tight_budget_preempts_and_every_request_still_matches_solo(text_model, reference, tmp_path):
    model, tokenizer = text_model
    budget = 1_200_000  # room for about three of these at once: rows outgrow the headroom and are preempted
    trace = tmp_path / "kv.jsonl"
    engine, log = engine_with_log(model, tokenizer, EngineConfig(
        max_batched_tokens=128, max_seqs=16, prefill_chunk=32, kv_memory_bytes=budget, kv_headroom_tokens=8,
        check_invariants=True, trace_path=str(trace)))
    run = drive(engine, [(i // 4, {"prompt_tokens": p, "sampling": greedy(MAX_TOKENS)}) for i, p in enumerate(PROMPTS)])
    engine.close()
    assert list(run.tokens.values()) == reference
    preemptions = [e for e in log.of_kind("transition") if e["trigger"] == "preempt"]
    assert preemptions, "the budget was tight enough to force preemption"
    plans = log.of_kind("plan")
    assert all(p["kv_bytes_bound"] <= budget for p in plans)
    assert max(p["num_seqs"] for p in plans) < 16  # memory, not max_seqs, limited the batch
    assert engine.executor.cache_bytes() == 0
    assert replay(load_trace(trace)).identical


def test_a_prompt_that_can_never_fit_is_refused_and_others_run(text_model, reference):
    model, tokenizer = text_model
    engine = Engine(model, tokenizer, EngineConfig(kv_memory_bytes=600_000, check_invariants=True))
    with pytest.raises(InvalidRequest, match="kv_memory_bytes"):
        engine.add_request(prompt_tokens=[9] * 400)
    run = drive(engine, [(0, {"prompt_tokens": PROMPTS[0], "sampling": greedy(MAX_TOKENS)})])
    assert list(run.tokens.values()) == [reference[0]]


def test_a_request_that_outgrows_the_budget_alone_fails_cleanly(text_model, reference):
    model, tokenizer = text_model
    # 2 layers x 512 bytes per token: one row of up to 80 tokens fits (80 + 256 slack) but not 400 + slack
    budget = 2 * 512 * (100 + STEP)
    engine = Engine(model, tokenizer, EngineConfig(kv_memory_bytes=budget, kv_headroom_tokens=0,
                                                   check_invariants=True))
    run = drive(engine, [
        (0, {"prompt_tokens": [11] * 60, "sampling": greedy(300), "request_id": "greedy-grower"}),
        (1, {"prompt_tokens": PROMPTS[0][:20], "sampling": greedy(MAX_TOKENS), "request_id": "small"}),
    ])
    # (alone, this prompt decodes 300 tokens without a stop: it must hit the budget)
    assert run.finish["greedy-grower"] is FinishReason.ERROR
    assert "kv_memory_bytes" in run.errors["greedy-grower"]
    assert 0 < len(run.tokens["greedy-grower"]) < 300
    assert run.tokens["small"] == solo_tokens(model, tokenizer, PROMPTS[0][:20], MAX_TOKENS)
    assert engine.executor.cache_bytes() == 0


def test_exact_sized_caches_stay_under_the_bound(text_model):
    """Regression (found by the stateful test): caches that start exact-sized (split out of a batched first
    chunk, or restored from the prefix cache) grow by whole 256-token steps from that size, so the bound is
    tokens + 256, not round_up(tokens, 256). Real bytes are checked against the budget every tick."""
    import random

    from ..surfaces.test_stateful import SHARED

    model, tokenizer = text_model
    engine = Engine(model, tokenizer, EngineConfig(
        max_batched_tokens=13, max_seqs=6, prefill_chunk=5, kv_memory_bytes=1_500_000, kv_headroom_tokens=4,
        prefix_cache_bytes=8 << 20, mix="prefill-first", check_invariants=True))
    rng = random.Random(0)
    for length, shared, n in [(1, False, 1), (1, True, 1), (74, False, 3), (3, False, 2), (2, False, 1),
                              (3, False, 1), (2, True, 1)]:
        body = [rng.randrange(7, 512) for _ in range(length)]
        engine.add_request(prompt_tokens=(SHARED + body) if shared else body, sampling=greedy(n))
    while engine.has_pending():
        engine.step()  # check_invariants: executor bytes <= kv_memory_bytes after every tick
    assert engine.executor.cache_bytes() == 0


def test_prefilling_requests_never_deadlock_on_memory(text_model):
    """Regression (found by a random interleaving, replayed here draw for draw): with nothing decoding,
    several partly prefilled prompts each held memory while none fitted its next chunk, forever. The planner
    now preempts the newest until the oldest moves; everything ends, within budget (checked every tick)."""
    import random

    from scheduler import SamplingParams

    from ..surfaces.test_stateful import SHARED

    model, tokenizer = text_model
    rng = random.Random(115)
    kv, prefix = rng.choice([None, 1_500_000]), rng.random() < 0.5
    chunk, draft = rng.choice([5, 16, 64]), rng.choice([0, 0, 2])
    mix = rng.choice(["decode-first", "prefill-first"])
    assert (kv, prefix, chunk, draft, mix) == (1_500_000, True, 5, 2, "decode-first")
    engine = Engine(model, tokenizer, EngineConfig(
        max_batched_tokens=chunk + 8 + 6 * draft, max_seqs=6, prefill_chunk=chunk, kv_memory_bytes=kv,
        kv_headroom_tokens=4, prefix_cache_bytes=8 << 20, draft_tokens=draft, mix=mix, check_invariants=True))

    def add():
        length, shared, n, sampled = rng.randint(1, 90), rng.random() < 0.5, rng.randint(1, 12), rng.random() < 0.5
        seed = rng.randint(0, 100)
        body_rng = random.Random(seed)
        body = [body_rng.randrange(7, 512) for _ in range(length)]
        return engine.add_request(prompt_tokens=(SHARED + body) if shared else body, sampling=SamplingParams(
            max_tokens=n, temperature=0.8 if sampled else 0.0, seed=seed))

    interleave(engine, rng, 40, add, add_below=0.45, abort_below=0.6, burst=4)
    drain(engine)
    assert engine.executor.cache_bytes() == 0


def test_a_sliding_window_prompt_is_admitted_only_where_its_prefill_peak_fits(sliding_model):
    """Regression (found by a fuzz of feature mixes): a sliding-window layer's cache holds the window and the
    chunk being fed while a prompt prefills, more than the row it becomes, so admitting a prompt by its row
    alone planned ticks over kv_memory_bytes. Admission now also asks for its prefill peak and this tick's
    state: under a budget of two rows, every plan's bound (checked every tick) and the real bytes stay within
    it, every request equals mlx-lm alone, and the trace replays."""
    from scheduler.execution import library

    model, tokenizer = sliding_model
    layout = library.kv_layout(model)
    window = min(layer.window for layer in layout.layers if layer.window is not None)
    prompts = mixed_prompts(8, window + 20, window + 60, seed=5)
    budget = layout.batch_bytes([window + 80] * 2)
    assert layout.request_bytes(window + 40, 64) > layout.batch_bytes([window + 40])  # the peak is above the row
    engine, log = engine_with_log(model, tokenizer, EngineConfig(
        max_batched_tokens=80, max_seqs=4, prefill_chunk=64, kv_memory_bytes=budget, kv_headroom_tokens=4,
        check_invariants=True))
    run = drive(engine, [(i, {"prompt_tokens": p, "sampling": greedy(12)}) for i, p in enumerate(prompts)])
    assert list(run.tokens.values()) == [solo_tokens(model, tokenizer, p, 12) for p in prompts]
    assert all(p["kv_bytes_bound"] <= budget for p in log.of_kind("plan"))
    assert any(r[1] == "kv_budget" for p in log.of_kind("plan") for r in p.get("reasons", ()))  # it was tight
    assert engine.executor.cache_bytes() == 0
    assert replay(load_trace(log.events)).identical
