"""Batched prefill for any mix of chunks: first and later chunks, of different lengths, fresh prompts and
prefix-cache hits share forwards (right-padded within PREFILL_PAD_RATIO), and every request's greedy output
still equals mlx-lm's for that request alone. Each test also checks that grouping really happened (the
executor's prefill_stats, the outcome events' padded_tokens), so a path that silently fell back to one
forward per request would fail."""

import numpy as np
import pytest

from scheduler import Engine, EngineConfig
from scheduler.events import MemorySink
from scheduler.plan import PREFILL_PAD_RATIO

from ..helpers import drive, greedy, mixed_prompts, solo_tokens

MAX_TOKENS = 12


def _run(model, tokenizer, config, prompts, executor=None, staggered=False):
    log = MemorySink()
    engine = Engine(model, tokenizer, EngineConfig(**{**config.__dict__, "check_invariants": True}),
                    executor=executor, event_sinks=[log])
    run = drive(engine, [(i if staggered else 0, {"prompt_tokens": p, "sampling": greedy(MAX_TOKENS)})
                         for i, p in enumerate(prompts)])
    return engine, log, list(run.tokens.values())


def _pads_within_bound(log):
    for outcome in log.of_kind("outcome"):
        assert outcome.get("padded_tokens", 0) <= PREFILL_PAD_RATIO * outcome["computed_tokens"]


def test_first_chunks_of_different_lengths_share_forwards_and_stay_exact(text_model):
    model, tokenizer = text_model
    prompts = mixed_prompts(10, 45, 47, seed=21)  # chunks of 44..46: at most 2 pads a row, within the ratio
    engine, log, outputs = _run(model, tokenizer, EngineConfig(), prompts)
    stats = engine.prefill_stats()
    assert stats == {"batched_groups": 1, "batched_rows": len(prompts), "cached_rows": 0, "fallbacks": 0,
                     "padded_tokens": sum(46 - (len(p) - 1) for p in prompts)}
    assert sum(o.get("padded_tokens", 0) for o in log.of_kind("outcome")) == stats["padded_tokens"]
    # the shared forward is in the log: its rows, where each starts, how many positions each feeds, the pads
    [forward] = log.of_kind("prefill_forward")
    assert len(forward["request_ids"]) == len(prompts) and forward["starts"] == [0] * len(prompts)
    assert sorted(forward["lengths"]) == sorted(len(p) - 1 for p in prompts) and forward["width"] == 46
    assert forward["padded_tokens"] == stats["padded_tokens"] and forward["measure"]["seconds"] > 0
    _pads_within_bound(log)
    assert outputs == [solo_tokens(model, tokenizer, p, MAX_TOKENS) for p in prompts]


def test_later_chunks_at_different_offsets_share_forwards_and_stay_exact(text_model):
    """prefill_chunk 16 and one arrival a tick: every prompt is fed in several ticks, so chunks of 16 whose
    caches hold different numbers of tokens meet in a tick, and share its forward."""
    model, tokenizer = text_model
    prompts = mixed_prompts(6, 60, 90, seed=22)
    config = EngineConfig(max_batched_tokens=200, max_seqs=8, prefill_chunk=16)
    engine, log, outputs = _run(model, tokenizer, config, prompts, staggered=True)
    stats = engine.prefill_stats()
    assert stats["cached_rows"] > 0 and stats["fallbacks"] == 0
    # some tick had later chunks of 16 at different offsets (each eligible, so grouped, or cached_rows is short)
    later = [[start for _, start, end, _ in plan["prefill"] if start > 0 and end - start == 16]
             for plan in log.of_kind("plan")]
    assert any(len(set(starts)) >= 2 for starts in later)
    assert stats["cached_rows"] >= sum(len(starts) for starts in later if len(starts) >= 2)
    _pads_within_bound(log)
    assert outputs == [solo_tokens(model, tokenizer, p, MAX_TOKENS) for p in prompts]


def test_prefix_cache_hits_join_prefill_groups_and_stay_exact(text_model):
    model, tokenizer = text_model
    rng = np.random.default_rng(23)
    system = [int(t) for t in rng.integers(7, 512, 48)]
    prompts = [system + [int(t) for t in rng.integers(7, 512, n)] for n in (20, 21, 22, 23)]
    config = EngineConfig(prefix_cache_bytes=16 << 20, check_invariants=True)
    log = MemorySink()
    engine = Engine(model, tokenizer, config, event_sinks=[log])
    first = drive(engine, [(0, {"prompt_tokens": prompts[0], "sampling": greedy(MAX_TOKENS)})])
    before = engine.prefill_stats()["cached_rows"]
    rest = drive(engine, [(0, {"prompt_tokens": p, "sampling": greedy(MAX_TOKENS)}) for p in prompts[1:]])
    assert engine.prefix_cache_stats()["hits"] == 3
    assert engine.prefill_stats()["cached_rows"] - before == 3  # the three hits' chunks ran in one group
    outputs = list(first.tokens.values()) + list(rest.tokens.values())
    assert outputs == [solo_tokens(model, tokenizer, p, MAX_TOKENS) for p in prompts]


def test_pad_ratio_zero_groups_only_equal_lengths(text_model):
    from scheduler.execution.executor import MLXExecutor
    from scheduler.execution.runners import TextRunner

    model, tokenizer = text_model
    prompts = [p[:40] for p in mixed_prompts(4, 40, 60, seed=4)] + [p[:39] for p in mixed_prompts(3, 39, 50, seed=5)]
    engine, log, outputs = _run(model, tokenizer, EngineConfig(), prompts,
                                executor=MLXExecutor(TextRunner(model), pad_ratio=0))
    # 4 chunks of 39 and 3 of 38: one pad each would be within PREFILL_PAD_RATIO, but not within 0
    assert engine.prefill_stats() == {"batched_groups": 2, "batched_rows": 7, "cached_rows": 0,
                                      "padded_tokens": 0, "fallbacks": 0}
    assert not any("padded_tokens" in o for o in log.of_kind("outcome"))
    assert outputs == [solo_tokens(model, tokenizer, p, MAX_TOKENS) for p in prompts]


@pytest.mark.parametrize("lengths", [[5], [9, 9, 9], [100, 90, 80, 10, 9, 8, 8, 1], [300, 16, 290, 40, 41, 200]])
@pytest.mark.parametrize("ratio", [0.0, 0.125, PREFILL_PAD_RATIO])
def test_pad_groups_stay_within_their_ratio_and_take_each_chunk_once(lengths, ratio):
    from scheduler.execution.executor import _pad_groups

    chunks = [(f"r{i}", 0, n) for i, n in enumerate(lengths)]
    groups = _pad_groups(chunks, ratio)
    taken = [c for group, _, _ in groups for c in group]
    assert len(taken) == len(set(taken)) and set(taken) <= set(chunks)
    for group, width, pads in groups:
        assert len(group) >= 2 and width == max(n for *_, n in group)
        assert pads == sum(width - n for *_, n in group) <= ratio * sum(n for *_, n in group)
    if ratio == 0:
        assert all(len({n for *_, n in group}) == 1 for group, _, _ in groups)
    if lengths == [9, 9, 9]:
        assert len(groups) == 1 and groups[0][2] == 0


def test_a_rotating_cache_shares_padded_chunks(sliding_model):
    """The sliding-window model's rotating caches keep right pads out of their windows when the batch is prepared
    with each row's length (its family honors them: `Family.honors_lengths`), so they group as plain KV does: of
    four fresh prompts (chunks of 29, 29, 32, 33), the three that fit the pad ratio share one forward with 5
    pads, the fourth goes alone, and outputs are exact (hybrids, gemma3_text and gpt_oss, with later chunks and
    the caches compared: tests/execution/test_hybrids.py)."""
    model, tokenizer = sliding_model
    prompts = mixed_prompts(2, 30, 30, seed=24) + mixed_prompts(2, 33, 34, seed=25)
    engine, _, outputs = _run(model, tokenizer, EngineConfig(), prompts)
    stats = engine.prefill_stats()
    assert (stats["batched_groups"], stats["batched_rows"], stats["padded_tokens"]) == (1, 3, 5), stats
    assert outputs == [solo_tokens(model, tokenizer, p, MAX_TOKENS) for p in prompts]


def test_explain_tells_which_chunks_shared_a_forward(text_model, tmp_path):
    """`explain` reads the `prefill_forward` events of a trace: a request fed in a shared forward says so, one fed
    alone says nothing about it."""
    from scheduler.tools.explain import explain, format_story

    model, tokenizer = text_model
    trace = tmp_path / "trace.jsonl"
    together = mixed_prompts(3, 45, 47, seed=21)
    engine = Engine(model, tokenizer, EngineConfig(trace_path=str(trace)))
    run = drive(engine, [(0, {"prompt_tokens": p, "sampling": greedy(2), "request_id": f"r{i}"})
                         for i, p in enumerate(together)]
                + [(20, {"prompt_tokens": together[0][:30], "sampling": greedy(2), "request_id": "alone"})])
    engine.close()
    assert not run.errors
    stories = {s.request_id: format_story(s) for s in explain(str(trace))}
    assert all("Prefill: 1 chunk(s) fed in forwards shared with other requests (up to 3 rows)." in stories[f"r{i}"]
               for i in range(3)), stories
    assert "Prefill:" not in stories["alone"]
