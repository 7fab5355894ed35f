"""Hybrid and state-space models (recurrent state next to attention KV, or instead of it) where their caches
differ from plain KV: the prefix cache reuses exact checkpoints of the state (stored at the block boundaries
the prefill passed), the KV budget counts the fixed state and really preempts, and a family mlx-lm itself
cannot batch is refused at load. Each against `mlx_lm.generate` alone, on tiny seeded builds."""

from __future__ import annotations

import dataclasses
import json

import pytest
from mlx_lm import load

from caches import layers
from scheduler import Engine, EngineConfig
from scheduler.execution import library
from scheduler.families import UnsupportedModel
from scheduler.fixtures.families import build_family_model
from scheduler.tools.replay import load_trace, replay
from scheduler.tools.simulate import fit_cost_model, load_recorded, simulate
from scheduler.tools.workload import arrivals_from_trace

from ..helpers import drive, engine_with_log, greedy, mixed_prompts, solo_tokens
from .test_families import kv_budget_forcing_preemption

HYBRIDS = ["lfm2", "qwen3_next", "granitemoehybrid", "nemotron_h", "mamba2"]
MAX_TOKENS = 6
BLOCK = 16
SHARED = mixed_prompts(1, 40, 40, seed=5)[0]
# r1 shares 35 tokens with r0, r2 shares 40: neither is a prefix of r0's stored prompt, so only a checkpoint at
# a block boundary (32) can be reused; r3 shares nothing.
PROMPTS = [SHARED + [9, 10, 11], SHARED[:35] + [12, 13], SHARED + [14] * 20, mixed_prompts(1, 30, 30, seed=6)[0]]


@pytest.fixture(scope="module", params=HYBRIDS)
def hybrid(request, tmp_path_factory):
    model, tokenizer = load(str(build_family_model(request.param, tmp_path_factory.mktemp(request.param))))
    return request.param, model, tokenizer


def _run(model, tokenizer, config, prompts, stagger):
    engine, sink = engine_with_log(model, tokenizer, config)
    run = drive(engine, [(i * stagger, {"prompt_tokens": p, "sampling": greedy(MAX_TOKENS), "request_id": f"r{i}"})
                         for i, p in enumerate(prompts)])
    assert not run.errors, run.errors
    engine.close()
    return [run.tokens[f"r{i}"] for i in range(len(prompts))], engine, sink


@pytest.mark.parametrize("chunk", [7, 16])
def test_prefix_checkpoints_are_reused_exactly(hybrid, chunk, tmp_path):
    model_type, model, tokenizer = hybrid
    reference = [solo_tokens(model, tokenizer, p, MAX_TOKENS) for p in PROMPTS]
    base = dict(max_batched_tokens=64, max_seqs=4, prefill_chunk=chunk, check_invariants=True)
    off, *_ = _run(model, tokenizer, EngineConfig(**base), PROMPTS, stagger=8)
    trace = tmp_path / "trace.jsonl"
    on, engine, sink = _run(model, tokenizer, EngineConfig(**base, prefix_cache_bytes=1 << 26,
                                                           prefix_block_size=BLOCK, trace_path=str(trace)),
                            PROMPTS, stagger=8)
    assert off == reference, f"{model_type}: prefix cache off"
    assert on == reference, f"{model_type}: prefix cache on"
    stores = {(e["request_id"], e["tokens"]) for e in sink.of_kind("prefix_store")}
    # r0's prefill passed blocks 16 and 32 (checkpoints) and ended at 42 (its prompt but the last token)
    assert {("r0", 16), ("r0", 32), ("r0", 42)} <= stores
    hits = {e["request_id"]: (e["length"], e["reuse"]) for e in sink.of_kind("prefix_hit")}
    assert hits == {"r1": (32, "checkpoint"), "r2": (32, "checkpoint")}, model_type
    assert engine.prefix_cache_stats()["tokens_saved"] == 64

    report = replay(load_trace(trace))
    assert report.identical, report.format()
    # a what-if simulation of the trace stores checkpoints as the engine does (arrivals spread out, so that
    # each one finds everything its predecessors stored): the same checkpoint hits, not trimmed KV ones
    recorded = load_recorded(trace)
    assert recorded.prefix_checkpoints
    arrivals = [dataclasses.replace(a, arrival_time=100.0 * i) for i, a in enumerate(arrivals_from_trace(recorded))]
    saved = {checkpoints: simulate(arrivals, recorded.trace.config, fit_cost_model(recorded),
                                   prefix_checkpoints=checkpoints).summary()["prefix_tokens_saved"]
             for checkpoints in (True, False)}
    assert saved == {True: 32 + 32, False: 35 + 40}
    # replay compares how a hit used its entry: a trace that says otherwise diverges
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    hit = next(e for e in events if e["event"] == "prefix_hit")
    hit["reuse"] = "trimmed"
    edited = tmp_path / "edited.jsonl"
    edited.write_text("".join(json.dumps(e) + "\n" for e in events))
    assert not replay(load_trace(edited)).identical


def test_a_kv_budget_preempts_a_hybrid_and_outputs_stay_exact(hybrid, tmp_path):
    """Three equal prompts fit the budget at admission; two decode steps later the rows outgrow it and the
    newest is preempted, recomputed after the others finish, and still gives its solo output. A model with
    no attention layers (mamba2) holds the same bytes whatever its length: nothing grows, so the budget only
    limits how many rows run, exactly (real bytes are the bound). The trace records the fixed-state bytes of
    the layout, so its replay plans the same bounds."""
    model_type, model, tokenizer = hybrid
    prompts = mixed_prompts(3, 24, 24, seed=9)
    reference = [solo_tokens(model, tokenizer, p, MAX_TOKENS) for p in prompts]
    fixed = sum(layer.fixed_bytes for layer in library.kv_layout(model).layers)
    assert fixed > 0, "a recurrent state is counted in the bound"
    budget, grows = kv_budget_forcing_preemption(model, prompts, rows=2 if model_type == "mamba2" else 3)
    trace = tmp_path / "trace.jsonl"
    config = EngineConfig(max_batched_tokens=128, max_seqs=8, prefill_chunk=64, kv_memory_bytes=budget,
                          kv_headroom_tokens=0, check_invariants=True, trace_path=str(trace))
    got, engine, sink = _run(model, tokenizer, config, prompts, stagger=0)
    assert got == reference, model_type
    plans = sink.of_kind("plan")
    assert all(p["kv_bytes_bound"] <= budget for p in plans)
    preempted = [e["request_id"] for e in sink.of_kind("transition") if e["trigger"] == "preempt"]
    if grows:
        assert preempted == ["r2"], f"{model_type}: the newest row is preempted once"
        assert max(p["num_seqs"] for p in plans) == 3
    else:
        assert preempted == []
        assert max(p["num_seqs"] for p in plans) == 2
        # fixed state: two rows' states are the bound (real <= bound is checked after every tick)
        assert max(p["kv_bytes_bound"] for p in plans) == 2 * fixed
    assert engine.executor.cache_bytes() == 0
    report = replay(load_trace(trace))
    assert report.identical, report.format()


def test_a_family_mlx_lm_cannot_batch_is_refused_at_load(tmp_path):
    """llama4's chunked-attention layers (ChunkedKVCache) have no batch form: mlx-lm's own BatchGenerator
    fails on them, and the engine refuses the model at load, naming the model type and the reason."""
    from mlx_lm.generate import BatchGenerator

    model, tokenizer = load(str(build_family_model("llama4", tmp_path / "llama4")))
    with pytest.raises(UnsupportedModel) as info:
        Engine(model, tokenizer)
    assert info.value.model_type == "llama4" and "ChunkedKVCache" in info.value.reason
    # the declared reason is what the real caches say, and what mlx-lm's batching says
    with pytest.raises(layers.UnsupportedCache) as cache_info:
        layers.check_batchable(library.make_request_cache(model))
    assert cache_info.value.cache_class == "ChunkedKVCache"
    generator = BatchGenerator(model, max_tokens=2)
    generator.insert([[1, 2, 3], [4, 5]])
    with pytest.raises(ValueError, match="ChunkedKVCache"):
        while generator.next():
            pass


@pytest.mark.parametrize("model_type", [*HYBRIDS, "gemma3_text"])
def test_chunks_at_one_position_of_one_length_share_a_forward_exactly(model_type, tmp_path):
    """Recurrent state and sliding windows take no padded chunk (`PrefillSharing.ALIGNED`), but rows that hold as
    many tokens and take chunks of one length need no pads: prompts of one length arriving together share every
    prefill forward, first and later chunks (past gemma3_text's window of 16), the prompt of another length goes
    alone, and every output equals `mlx_lm.generate` alone."""
    model, tokenizer = load(str(build_family_model(model_type, tmp_path)))
    prompts = mixed_prompts(3, 40, 40, seed=7) + mixed_prompts(2, 20, 20, seed=8)[:1]
    engine, _ = engine_with_log(model, tokenizer, EngineConfig(max_batched_tokens=512, prefill_chunk=16,
                                                               check_invariants=True))
    assert engine._runner.prefill_sharing is layers.PrefillSharing.ALIGNED
    run = drive(engine, [(0, {"prompt_tokens": p, "sampling": greedy(MAX_TOKENS), "request_id": f"r{i}"})
                         for i, p in enumerate(prompts)])
    assert not run.errors, run.errors
    assert [run.tokens[f"r{i}"] for i in range(len(prompts))] == [
        solo_tokens(model, tokenizer, p, MAX_TOKENS) for p in prompts]
    stats = engine.prefill_stats()
    # the three 40-token prompts' chunks [0, 16), [16, 32), [32, 39) each in one forward of three rows, the
    # last two on caches of 16 and 32 tokens; the 20-token prompt's [0, 16) joins the first; nothing padded
    assert (stats["batched_groups"], stats["batched_rows"], stats["cached_rows"]) == (3, 10, 6), stats
    assert stats["padded_tokens"] == stats["fallbacks"] == 0, stats
    engine.close()
