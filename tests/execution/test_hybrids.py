"""Hybrid and state-space models (recurrent state next to attention KV, or instead of it) where their caches
differ from plain KV: the prefix cache reuses exact checkpoints of the state (stored at the block boundaries
the prefill passed), the KV budget counts the fixed state and really preempts, and a family mlx-lm itself
cannot batch is refused at load. Each against `mlx_lm.generate` alone, on tiny seeded builds."""

from __future__ import annotations

import dataclasses
import json

import mlx.core as mx
import pytest
from mlx_lm import load

from caches import layers
from scheduler import Engine, EngineConfig
from scheduler.execution import library
from scheduler.execution.runners import TextRunner
from scheduler.families import FAMILIES, UnsupportedModel
from scheduler.fixtures.families import build_family_model
from scheduler.request import Request, SamplingParams
from scheduler.tools.replay import load_trace, replay
from scheduler.tools.simulate import fit_cost_model, load_recorded, simulate
from scheduler.tools.workload import arrivals_from_trace

from ..helpers import drive, engine_with_log, greedy, mixed_prompts, solo_tokens
from .family_conformance import kv_budget_forcing_preemption

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


@pytest.mark.parametrize("model_type", [t for t, f in FAMILIES.items() if f.honors_lengths
                                        and not f.capabilities.splittable])
def test_chunks_of_different_lengths_and_positions_share_forwards_exactly(model_type, tmp_path):
    """Recurrent state and sliding windows skip the right pads of a shared prefill forward where the family's
    forward honors the lengths its batch cache is prepared with (`Family.honors_lengths`), so they share
    forwards as plain KV does (`PrefillSharing.ANY`): first chunks of different lengths (padded), and later
    chunks whose caches hold different numbers of tokens (past the sliding windows of 16); every output equals
    `mlx_lm.generate` alone."""
    model, tokenizer = load(str(build_family_model(model_type, tmp_path)))
    engine = Engine(model, tokenizer, EngineConfig())
    assert engine._runner.prefill_sharing is layers.PrefillSharing.ANY
    engine.close()
    # first chunks of 44..46 tokens at once: one forward of four rows, at most two pads a row
    first = mixed_prompts(4, 45, 47, seed=21)
    # prefill_chunk 16 and one arrival a tick: chunks of 16 on caches of different lengths meet in a tick
    later = mixed_prompts(4, 50, 70, seed=22)
    for prompts, config, stagger in ((first, EngineConfig(check_invariants=True), 0),
                                     (later, EngineConfig(max_batched_tokens=128, prefill_chunk=16,
                                                          check_invariants=True), 1)):
        got, engine, sink = _run(model, tokenizer, config, prompts, stagger=stagger)
        assert got == [solo_tokens(model, tokenizer, p, MAX_TOKENS) for p in prompts], model_type
        stats = engine.prefill_stats()
        assert stats["fallbacks"] == 0, stats
        if stagger:
            assert stats["cached_rows"] >= 2, stats
            starts = [{start for _, start, end, _ in plan["prefill"] if start > 0 and end - start == 16}
                      for plan in sink.of_kind("plan")]
            assert any(len(s) >= 2 for s in starts), "later chunks at different positions met in a tick"
        else:
            assert (stats["batched_groups"], stats["batched_rows"]) == (1, 4), stats
            assert stats["padded_tokens"] == sum(46 - (len(p) - 1) for p in prompts) > 0, stats
        assert engine.executor.cache_bytes() == 0


@pytest.mark.parametrize("model_type", ["qwen3_next", "gemma3_text"])
def test_a_family_not_declared_to_honor_lengths_shares_only_unpadded_chunks(model_type, tmp_path, monkeypatch):
    """Without `Family.honors_lengths` (a family not in the table, or one whose forward ignores the lengths),
    recurrent state and sliding windows would take right pads in, so only rows that hold as many tokens and take
    chunks of one length share a forward (`PrefillSharing.ALIGNED`): prompts of one length arriving together
    share every prefill forward, first and later chunks, the prompt of another length goes alone, and every
    output equals `mlx_lm.generate` alone."""
    monkeypatch.setitem(FAMILIES, model_type, dataclasses.replace(FAMILIES[model_type], honors_lengths=False))
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


def _layer_arrays(layer) -> list:
    """What a single-request cache layer holds for its tokens: plain KV up to its offset, a rotating window's
    last `max_size - 1` positions in temporal order (how many older ones it still keeps depends on the writes
    that reached it, and no later query reads them) and its token count, a recurrent state's arrays."""
    from mlx_lm.models.cache import ArraysCache, CacheList, RotatingKVCache

    if isinstance(layer, CacheList):
        return [a for sub in layer.caches for a in _layer_arrays(sub)]
    if isinstance(layer, ArraysCache):
        return [a for a in layer.cache if a is not None]
    if isinstance(layer, RotatingKVCache):
        keys, values = (layer._temporal_order(x) for x in (layer.keys, layer.values))
        keep = min(keys.shape[2], layer.max_size - 1)
        return [keys[..., -keep:, :], values[..., -keep:, :], mx.array(layer.offset)]
    return [layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :]]


def _shared_forward_against_solo(model_type, tmp_path, held=(0, 9, 30)):
    """Three requests in one `prefill_many` forward taking 21, 14 and 6 tokens (right pads 7 and 15), on caches
    that hold `held` tokens (by default a fresh one and two holding 9 and 30: the 30-token one past the windows
    of 16). Returns, per row, the largest difference of its logits and of each cache array from the same chunks
    fed alone."""
    model, _ = load(str(build_family_model(model_type, tmp_path)))
    runner = TextRunner(model)
    prompts = [mixed_prompts(1, n, n, seed=31 + n)[0] for n in (21, 23, 36)]
    rows = [(Request(f"r{i}", p, SamplingParams()), h, n)
            for i, (p, h, n) in enumerate(zip(prompts, held, (21, 14, 6)))]
    caches = []
    for request, start, _ in rows:
        cache = None
        if start:
            cache = runner.make_cache()
            runner.prefill(cache, request, None, 0, start)
        caches.append(cache)
    shared, logits = runner.prefill_many([(r, None, c, start, n) for (r, start, n), c in zip(rows, caches)])
    diffs = []
    for i, ((request, start, n), row_cache) in enumerate(zip(rows, shared)):
        solo = runner.make_cache()
        if start:
            runner.prefill(solo, request, None, 0, start)
        solo_logits = runner.prefill(solo, request, None, start, start + n)
        worst = float(mx.abs(logits[i, :n] - solo_logits[0]).max())
        for got, want in zip(row_cache, solo):
            for a, b in zip(_layer_arrays(got), _layer_arrays(want)):
                assert a.shape == b.shape, (model_type, i, type(got).__name__)
                worst = max(worst, float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max()))
        diffs.append(worst)
    return diffs


@pytest.mark.parametrize("model_type", [t for t, f in FAMILIES.items() if f.honors_lengths
                                        and not f.capabilities.splittable])
def test_a_padded_shared_forward_leaves_each_row_what_its_own_forward_would(model_type, tmp_path):
    """The cache-level check under the greedy-token tests above (a tiny model's greedy tokens can survive a
    wrong state for a few steps): each row of a shared, right-padded forward gets the logits, keys, values,
    window and recurrent state of its own forward, to float rounding (other matrix shapes)."""
    assert max(_shared_forward_against_solo(model_type, tmp_path)) < 1e-4
    # fresh rows only: their merged recurrent caches start empty (a left padding of zeros in mlx-lm's merge)
    assert max(_shared_forward_against_solo(model_type, tmp_path / "fresh", held=(0, 0, 0))) < 1e-4


def test_nemotron_h_is_not_declared_to_honor_lengths_because_its_state_takes_the_pads(tmp_path):
    """mlx-lm 0.32's Nemotron-H Mamba-2 mixer passes the padding mask to `ssm_update` but not the lengths, so a
    right-padded row's new state is read at a pad position, where the mask zeroes the chunk's contribution:
    the row loses its chunk. So nemotron_h shares only unpadded chunks (`Family.honors_lengths` False). When
    mlx-lm passes the lengths there, this fails: declare it then."""
    assert not FAMILIES["nemotron_h"].honors_lengths
    diffs = _shared_forward_against_solo("nemotron_h", tmp_path)
    assert diffs[0] < 1e-4 and min(diffs[1:]) > 1e-2, diffs  # the unpadded row is right, the padded ones not


@pytest.mark.parametrize("model_type", ["qwen3_next", "gemma3_text", "nemotron_h"])
def test_chunks_that_store_prefix_checkpoints_share_forwards(model_type, tmp_path):
    """With the prefix cache on, a cache that cannot be trimmed stores a checkpoint in each chunk that passes a
    block boundary, so the chunk is fed in two pieces around it; the pieces of several requests share forwards as
    any chunks do (the first pieces of the tick, then the second ones): chunks of 20 on blocks of 16 give pieces
    [0, 16) [16, 20) [20, 32) [32, 40) ... Padded where the family honors the lengths (qwen3_next, gemma3_text),
    at one length otherwise (nemotron_h: the first wave's prompts are of one length there). The checkpoints are
    stored as before (one entry per prefix) and a second wave restores them; every output equals
    `mlx_lm.generate` alone."""
    model, tokenizer = load(str(build_family_model(model_type, tmp_path)))
    shared = mixed_prompts(1, 40, 40, seed=41)[0]
    aligned = not FAMILIES[model_type].honors_lengths
    first = [shared + tail for tail in mixed_prompts(3, 5, 5 if aligned else 7, seed=42)]
    second = [shared + tail for tail in mixed_prompts(2, 3, 3, seed=43)]
    prompts = first + second
    config = EngineConfig(max_batched_tokens=128, prefill_chunk=20, prefix_cache_bytes=1 << 26,
                          prefix_block_size=BLOCK, check_invariants=True)
    engine, sink = engine_with_log(model, tokenizer, config)
    run = drive(engine, [(0 if i < len(first) else 30, {"prompt_tokens": p, "sampling": greedy(MAX_TOKENS),
                                                        "request_id": f"r{i}"}) for i, p in enumerate(prompts)])
    assert not run.errors, run.errors
    assert [run.tokens[f"r{i}"] for i in range(len(prompts))] == [
        solo_tokens(model, tokenizer, p, MAX_TOKENS) for p in prompts], model_type
    stats = engine.prefill_stats()
    # every piece of the first wave in a shared forward: [0, 16) [16, 20) [20, 32) [32, 40) [40, n - 1)
    assert stats["batched_groups"] >= 5 and stats["batched_rows"] >= 15 and stats["fallbacks"] == 0, stats
    stores = {(e["request_id"], e["tokens"]) for e in sink.of_kind("prefix_store")}
    assert {("r0", 16), ("r0", 32)} <= stores, stores  # r1's and r2's equal checkpoints are the same entries
    hits = {e["request_id"]: (e["length"], e["reuse"]) for e in sink.of_kind("prefix_hit")}
    assert hits == {"r3": (32, "checkpoint"), "r4": (32, "checkpoint")}, hits
    engine.close()
    assert engine.executor.cache_bytes() == 0


@pytest.mark.parametrize("model_type,seed", [(m, s) for m in ("qwen3_next", "gemma3_text", "nemotron_h")
                                             for s in range(1, 5)])
def test_random_schedules_with_shared_prefill_stay_exact_and_replay(model_type, seed, tmp_path):
    """Random arrivals, budgets and chunk sizes, prompts that share a prefix, the prefix cache (checkpoint pieces)
    and a KV budget that preempts, on a recurrent hybrid, a windowed family (both may pad shared chunks) and
    nemotron_h (chunks at one position of one length): every output equals `mlx_lm.generate` alone, nothing is
    left in the caches, and the trace replays."""
    import random

    rng = random.Random(seed)
    model, tokenizer = load(str(build_family_model(model_type, tmp_path)))
    shared = mixed_prompts(1, 24, 24, seed=seed)[0]
    # bodies of near-equal lengths, so that padded groups fit the pad ratio, and a few short ones
    prompts = [(shared if rng.random() < 0.5 else []) + mixed_prompts(1, *rng.choice([(30, 33), (30, 33), (1, 12)]),
                                                                     seed=100 * seed + i)[0]
               for i in range(12)]
    budget, _ = kv_budget_forcing_preemption(model, prompts, rows=4)
    trace = tmp_path / "trace.jsonl"
    config = EngineConfig(max_batched_tokens=rng.choice([24, 64, 128]), max_seqs=rng.randint(3, 8),
                          prefill_chunk=rng.choice([7, 16, 24]), prefix_cache_bytes=rng.choice([0, 1 << 26]),
                          prefix_block_size=8, kv_memory_bytes=rng.choice([None, budget]), kv_headroom_tokens=0,
                          mix=rng.choice(["decode-first", "prefill-first"]), trace_path=str(trace),
                          check_invariants=True)
    engine, _ = engine_with_log(model, tokenizer, config)
    ticks = sorted(rng.randint(0, 6) for _ in prompts)
    run = drive(engine, [(t, {"prompt_tokens": p, "sampling": greedy(MAX_TOKENS), "request_id": f"r{i}"})
                         for i, (t, p) in enumerate(zip(ticks, prompts))])
    engine.close()
    assert not run.errors, run.errors
    assert [run.tokens[f"r{i}"] for i in range(len(prompts))] == [
        solo_tokens(model, tokenizer, p, MAX_TOKENS) for p in prompts], (model_type, config)
    assert engine.prefill_stats()["fallbacks"] == 0
    assert engine.executor.cache_bytes() == 0
    report = replay(load_trace(trace))
    assert report.identical, report.format()
