"""Quantized KV cache under continuous batching (EngineConfig.kv_bits / kv_group_size / quantized_kv_start).

The reference is mlx-lm alone with the same three settings (`stream_generate` hands them to `generate_step`):
batched greedy output equals it token for token in the usual schedules, for two plain-attention families and
a hybrid one. The tiny builds use head_dim 64 (mx.quantize groups head_dim in 32, 64 or 128 values)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models import cache as mlx_cache

from caches import layers
from caches.kv import STEP, QuantizeRule
from scheduler import Engine, EngineConfig, InvalidRequest, SamplingParams
from scheduler.execution import library
from scheduler.families import UnsupportedFeature
from scheduler.fixtures.families import build_family_model
from scheduler.events import read_jsonl
from scheduler.tools.replay import load_trace, replay

from ..helpers import drain, drive, engine_with_log, greedy, interleave, mixed_prompts, solo_tokens

MAX_TOKENS = 10
HEAD_DIM_64 = {"head_dim": 64}
SETTINGS = [(4, 0), (8, 24)]  # (kv_bits, quantized_kv_start): 24 lies inside some prompts, after others


def _quantized(bits: int, start: int) -> dict:
    return {"kv_bits": bits, "kv_group_size": 64, "quantized_kv_start": start}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def family(request, tmp_path_factory):
    model_type = request.param
    model, tokenizer = load(str(build_family_model(model_type, tmp_path_factory.mktemp(model_type),
                                                   overrides=HEAD_DIM_64)))
    shared = mixed_prompts(1, 20, 20, seed=3)[0]
    prompts = mixed_prompts(5, 1, 40, seed=1) + [shared + [9, 10, 11], shared + [12, 13]]
    references = {s: [solo_tokens(model, tokenizer, p, MAX_TOKENS, **_quantized(*s)) for p in prompts]
                  for s in SETTINGS}
    plain = [solo_tokens(model, tokenizer, p, MAX_TOKENS) for p in prompts]
    return model_type, model, tokenizer, prompts, references, plain


def _run(model, tokenizer, config, prompts, stagger=0):
    engine, sink = engine_with_log(model, tokenizer, config)
    run = drive(engine, [(i * stagger, {"prompt_tokens": p, "sampling": greedy(MAX_TOKENS), "request_id": f"r{i}"})
                         for i, p in enumerate(prompts)])
    assert not run.errors, run.errors
    assert engine.executor.cache_bytes() == 0
    return [run.tokens[f"r{i}"] for i in range(len(prompts))], engine, sink


SCHEDULES = {
    "all-at-once": (dict(max_batched_tokens=512, max_seqs=16, prefill_chunk=256), 0),
    "staggered-small-chunks": (dict(max_batched_tokens=24, max_seqs=8, prefill_chunk=8), 2),
    "fewer-slots": (dict(max_batched_tokens=64, max_seqs=2, prefill_chunk=16), 0),
    "prefix-cache": (dict(max_batched_tokens=64, max_seqs=4, prefill_chunk=16, prefix_cache_bytes=1 << 26), 3),
}


def test_the_reference_is_sensitive_to_quantization(family):
    """4-bit KV changes mlx-lm's own greedy output on these builds, so equality below is not the float one."""
    _, _, _, _, references, plain = family
    assert references[(4, 0)] != plain


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: f"q{s[0]}-start{s[1]}")
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_batched_greedy_equals_mlx_lm_alone_with_the_same_kv_bits(family, schedule, setting, tmp_path):
    model_type, model, tokenizer, prompts, references, _ = family
    config, stagger = SCHEDULES[schedule]
    trace = tmp_path / "q.jsonl"
    got, engine, sink = _run(model, tokenizer, EngineConfig(**config, **_quantized(*setting), trace_path=str(trace)),
                             prompts, stagger)
    assert got == references[setting], f"{model_type} / {schedule} / {setting}"
    engine.close()
    # replay re-derives every conversion from the recorded QuantizeRule and compares it
    report = replay(load_trace(trace))
    assert report.identical, report.format()
    assert sum(len(e["request_ids"]) for e in sink.of_kind("kv_quantize")) == engine.kv_cache_stats()["conversions"]
    stats = engine.kv_cache_stats()
    assert stats["conversions"] == sum(1 for p in prompts if len(p) - 1 + MAX_TOKENS >= max(setting[1], 1))
    if setting[1] > 0:  # rows that joined below the start decoded in the float group, then moved
        assert sink.of_kind("kv_quantize"), "some row converted while decoding"
    if schedule == "prefix-cache":
        assert engine.prefix_cache_stats()["hits"] >= 1, "the shared-prefix prompt reuses a stored entry"


def test_a_kv_budget_that_preempts_decoding_rows_still_matches_mlx_lm_alone(family, tmp_path):
    """Rows that joined below quantized_kv_start decode in float storage and grow until they convert: the
    budget preempts one of them while decoding; it recomputes prompt + outputs with the conversion point of its
    original prompt, and every output still equals mlx-lm alone. The trace replays identically (the layout it
    records carries the quantized bytes)."""
    _, model, tokenizer, _, _, _ = family
    prompts, max_tokens, settings = mixed_prompts(4, 200, 260, seed=4), 40, _quantized(8, 280)
    reference = [solo_tokens(model, tokenizer, p, max_tokens, **settings) for p in prompts]
    rule = library.quantize_rule(8, 64, 280)
    layout = library.quantized_kv_layout(model, library.kv_layout(model), rule)
    trace = tmp_path / "q.jsonl"
    engine, sink = engine_with_log(model, tokenizer, EngineConfig(
        max_batched_tokens=256, max_seqs=8, prefill_chunk=64, kv_memory_bytes=layout.batch_bytes([265] * 2),
        kv_headroom_tokens=0, trace_path=str(trace), **settings))
    run = drive(engine, [(0, {"prompt_tokens": p, "sampling": greedy(max_tokens), "request_id": f"r{i}"})
                         for i, p in enumerate(prompts)])
    engine.close()
    assert [run.tokens[f"r{i}"] for i in range(len(prompts))] == reference
    assert "decoding" in [e["from"] for e in sink.of_kind("transition") if e["trigger"] == "preempt"]
    assert replay(load_trace(trace)).identical
    # a trace whose conversions differ from the rule's diverges there (replay compares kv_quantize)
    events = read_jsonl(trace)
    first = next(e for e in events if e["event"] == "kv_quantize")
    events.remove(first)
    report = replay(load_trace(events))
    assert not report.identical and report.divergence.tick == first["tick"]
    assert report.divergence.differing_fields == ["kv_quantize"]


def test_a_prompt_past_mlx_lms_first_prefill_step_converts_inside_its_prefill(family, tmp_path):
    """mlx-lm alone converts after its first 2048-token prefill step; the engine's chunks (300 tokens) straddle
    that point, so the chunk is split there. Such a cache is not offered to the prefix cache (a shorter shared
    prefix would need its first tokens in float storage). Replay re-derives the conversion at 2048."""
    _, model, tokenizer, _, _, _ = family
    trace = tmp_path / "q.jsonl"
    long_prompt = mixed_prompts(1, 2100, 2100, seed=5)[0]
    short = mixed_prompts(1, 30, 30, seed=6)[0]
    settings = _quantized(4, 0)
    reference = [solo_tokens(model, tokenizer, p, 4, **settings) for p in (long_prompt, short)]
    engine, sink = engine_with_log(model, tokenizer, EngineConfig(
        max_batched_tokens=700, prefill_chunk=300, prefix_cache_bytes=1 << 26, trace_path=str(trace), **settings))
    run = drive(engine, [(0, {"prompt_tokens": p, "sampling": greedy(4), "request_id": f"r{i}"})
                         for i, p in enumerate((long_prompt, short))])
    engine.close()
    assert [run.tokens["r0"], run.tokens["r1"]] == reference
    converted_in_prefill = [e for e in sink.of_kind("kv_quantize") if e.get("tokens") == 2048]
    assert [e["request_ids"] for e in converted_in_prefill] == [["r0"]]
    assert [e["request_id"] for e in sink.of_kind("prefix_store")] == ["r1"]
    report = replay(load_trace(trace))
    assert report.identical, report.format()


def test_a_prompt_whose_float_prefill_peak_cannot_fit_is_refused_on_arrival(family):
    """Admission under kv_bits also needs a prompt's float prefill peak to fit, so a prompt whose quantized row
    fits but whose peak never does is refused when it arrives (it used to be queued, never admitted, and held
    back every request behind it for ever); a shorter one still runs."""
    _, model, tokenizer, _, _, _ = family
    settings = _quantized(4, 0)
    rule = library.quantize_rule(4, 64, 0)
    layout = library.quantized_kv_layout(model, library.kv_layout(model), rule)
    long_prompt, short_prompt = mixed_prompts(1, 60, 60, seed=8)[0], mixed_prompts(1, 12, 12, seed=9)[0]
    budget = layout.admit_alone_bytes(len(long_prompt), 1, 16) - 1
    assert layout.footprint([len(long_prompt) + 1], []) <= budget  # its row alone would fit
    engine = Engine(model, tokenizer, EngineConfig(prefill_chunk=16, kv_memory_bytes=budget, kv_headroom_tokens=1,
                                                   check_invariants=True, **settings))
    with pytest.raises(InvalidRequest, match="kv_memory_bytes"):
        engine.add_request(prompt_tokens=long_prompt, sampling=greedy(MAX_TOKENS))
    run = drive(engine, [(0, {"prompt_tokens": short_prompt, "sampling": greedy(MAX_TOKENS), "request_id": "s"})])
    assert run.tokens["s"] == solo_tokens(model, tokenizer, short_prompt, MAX_TOKENS, **settings)


@pytest.mark.parametrize("seed", range(6))
def test_random_schedules_drain_and_replay_with_their_conversions(family, seed, tmp_path):
    """Random interleavings under kv_bits (conversion points inside, at the end of and beyond the prompts, a
    KV budget, the prefix cache, prefill-first mixing, aborts): every run drains, and replay re-derives each
    conversion (`kv_quantize`) from the recorded rule."""
    import random

    _, model, tokenizer, _, _, _ = family
    rng = random.Random(seed)
    trace = tmp_path / "q.jsonl"
    engine = Engine(model, tokenizer, EngineConfig(
        max_batched_tokens=rng.choice([16, 40, 128]), max_seqs=rng.randint(1, 6), prefill_chunk=rng.choice([5, 8, 32]),
        kv_bits=rng.choice([4, 8]), kv_group_size=64, quantized_kv_start=rng.choice([0, 5, 24, 60]),
        prefix_cache_bytes=rng.choice([0, 1 << 24]), prefix_block_size=8,
        mix=rng.choice(["decode-first", "prefill-first"]),
        kv_memory_bytes=rng.choice([None, 800_000, 1_200_000]), kv_headroom_tokens=rng.choice([0, 4]),
        trace_path=str(trace), check_invariants=True))
    shared = mixed_prompts(1, 20, 20, seed=seed)[0]

    def add():
        body = [rng.randrange(7, 500) for _ in range(rng.randint(1, 70))]
        try:
            return engine.add_request(prompt_tokens=(shared + body) if rng.random() < 0.4 else body,
                                      sampling=SamplingParams(max_tokens=rng.randint(1, 40)))
        except InvalidRequest:  # a prompt the budget can never hold
            return None

    interleave(engine, rng, 30, add, add_below=0.4, abort_below=0.5, burst=3)
    drain(engine)
    engine.close()
    assert engine.executor.cache_bytes() == 0
    report = replay(load_trace(trace))
    assert report.identical, report.format()


def test_a_hybrid_family_quantizes_its_attention_layers_and_leaves_recurrent_state(tmp_path):
    """nemotron_h: Mamba-2 state (ArraysCache) stays as it is, as mlx-lm's own conversion leaves it."""
    model, tokenizer = load(str(build_family_model("nemotron_h", tmp_path / "nh", overrides=HEAD_DIM_64)))
    prompts = mixed_prompts(4, 3, 40, seed=2)
    settings = _quantized(4, 12)
    reference = [solo_tokens(model, tokenizer, p, MAX_TOKENS, **settings) for p in prompts]
    got, engine, _ = _run(model, tokenizer, EngineConfig(max_batched_tokens=24, max_seqs=4, prefill_chunk=8,
                                                         **settings), prompts, stagger=1)
    assert got == reference
    cache = library.make_request_cache(model)
    assert layers.check_quantizable(cache) == [isinstance(c, mlx_cache.KVCache) for c in cache]
    assert engine.kv_layout.layers[0].quantized_bytes_per_token is None  # an ArraysCache layer


# ---- the conversion rule, the cache kind, the bytes ------------------------------------------------------


def test_the_conversion_point_is_where_mlx_lms_own_check_first_passes():
    rule = QuantizeRule(bits=4, group_size=64, start=0, prefill_step=2048)
    assert rule.point(1) == 1  # no prefill: after the first step
    assert rule.point(40) == 39  # after the prompt (all but its last token)
    assert rule.point(3000) == 2048  # after the first prefill step
    late = QuantizeRule(bits=4, group_size=64, start=24, prefill_step=2048)
    assert late.point(10) == 24  # a decode step
    assert late.point(30) == 29
    assert QuantizeRule(4, 64, 5000, 2048).point(9000) == 6144


def test_left_padding_does_not_change_a_tokens_quantization_groups():
    """mx.quantize groups along head_dim: row b of a left-padded batch quantizes to exactly what the same
    token vectors quantize to alone (same input values, same per-vector operation)."""
    mx.random.seed(0)
    alone = [mx.random.normal((1, 2, n, 64)) for n in (3, 7)]
    padded = mx.concatenate([mx.pad(x, [(0, 0), (0, 0), (7 - x.shape[2], 0), (0, 0)]) for x in alone])
    batch_parts = mx.quantize(padded, group_size=64, bits=4)
    for b, x in enumerate(alone):
        n = x.shape[2]
        for part, single in zip(batch_parts, mx.quantize(x, group_size=64, bits=4)):
            assert mx.array_equal(part[b : b + 1, :, 7 - n :], single)


def _single_quantized(n: int, seed: int) -> object:
    mx.random.seed(seed)
    kv = mlx_cache.KVCache()
    kv.update_and_fetch(mx.random.normal((1, 2, n, 64)), mx.random.normal((1, 2, n, 64)))
    return kv.to_quantized(group_size=64, bits=8)


def test_the_quantized_kind_merges_filters_extends_and_extracts_rows_exactly():
    singles = [_single_quantized(n, seed) for seed, n in enumerate((5, 9, 2))]
    batch = layers.merge_caches([[c] for c in singles])
    assert layers.capabilities(batch).kinds == ("QuantizedKVCache",)
    assert batch[0].left_padding.tolist() == [4, 0, 7]
    layers.filter_batch(batch, [0, 2])
    layers.extend_batch(batch, layers.merge_caches([[_single_quantized(12, 7)]]))
    assert batch[0].offset.tolist() == [5, 2, 12]
    rows = layers.take_rows(batch, [0, 1])
    for row, original in zip(rows, (singles[0], singles[2])):
        assert row[0].offset == original.offset
        for got, want in zip((*row[0].keys, *row[0].values), (*original.keys, *original.values)):
            assert mx.array_equal(got, want[..., : original.offset, :])
    assert layers.cache_nbytes(batch) == sum(x.nbytes for x in (*batch[0].keys, *batch[0].values))


def test_a_quantized_snapshot_restores_a_prefix_and_is_never_written():
    cache = [_single_quantized(20, 3)]
    payload, nbytes, whole_only = layers.snapshot_cache(cache)
    assert not whole_only
    assert nbytes == sum(x.nbytes for x in (*cache[0].keys, *cache[0].values)) * 20 // STEP
    before = [mx.array(x) for x in payload[0][1][0]]
    restored = layers.restore_cache(payload, 12)
    assert restored[0].offset == 12
    restored[0].update_and_fetch(mx.ones((1, 2, 3, 64)), mx.ones((1, 2, 3, 64)))
    mx.eval(layers.cache_arrays(restored))
    assert all(mx.array_equal(a, b) for a, b in zip(before, payload[0][1][0]))


def test_the_budget_counts_quantized_bytes_and_admits_more_requests(family):
    """Bytes per token from the probe, real cache bytes against them, and how many requests one fixed
    kv_memory_bytes admits at once: at 8 and 4 bits more than unquantized."""
    _, model, tokenizer, _, _, _ = family
    plain = library.kv_layout(model)
    per_token = {16: plain.bytes_per_token}
    for bits in (8, 4):
        layout = library.quantized_kv_layout(model, plain, library.quantize_rule(bits, 64, 0))
        per_token[bits] = sum(layer.quantized_bytes_per_token for layer in layout.layers)
    # float32 keys + values, 2 kv heads x 64 per layer; quantized: packed values + a scale and a bias per group
    assert per_token[16] == 2 * 2 * 2 * 64 * 4
    assert per_token[8] == 2 * 2 * 2 * (64 + 2 * 4)
    assert per_token[4] == 2 * 2 * 2 * (32 + 2 * 4)
    prompts = mixed_prompts(24, 30, 30, seed=9)
    budget = plain.batch_bytes([40] * 4) + plain.request_bytes(40, 8)
    admitted = {}
    for bits in (16, 8, 4):
        extra = {} if bits == 16 else _quantized(bits, 0)
        config = EngineConfig(max_batched_tokens=512, max_seqs=32, prefill_chunk=64, kv_memory_bytes=budget,
                              kv_headroom_tokens=4, **extra)
        engine, sink = engine_with_log(model, tokenizer, config)
        run = drive(engine, [(0, {"prompt_tokens": p, "sampling": greedy(4)}) for p in prompts])
        assert not run.errors
        admitted[bits] = max(p["num_seqs"] for p in sink.of_kind("plan"))
    assert admitted[16] < admitted[8] < admitted[4], admitted


# ---- refused combinations --------------------------------------------------------------------------------


def test_bad_quantization_settings_are_refused_by_the_config():
    for bad in ({"kv_bits": 3}, {"kv_bits": True}, {"kv_group_size": 16}, {"quantized_kv_start": -1},
                {"kv_bits": 4, "max_kv_size": 64}, {"kv_bits": 8, "draft_tokens": 2}):
        with pytest.raises(ValueError):
            EngineConfig(**bad)


def test_families_whose_caches_cannot_be_quantized_are_refused_at_configuration(tmp_path, sliding_model):
    model, tokenizer = sliding_model  # gemma3_text: sliding-window layers (RotatingKVCache)
    with pytest.raises(UnsupportedFeature, match="kv_bits.*RotatingKVCache"):
        Engine(model, tokenizer, EngineConfig(kv_bits=4))
    model, tokenizer = load(str(build_family_model("llama", tmp_path / "hd16")))  # head_dim 16
    with pytest.raises(UnsupportedFeature, match="divisible by the quantization group size"):
        Engine(model, tokenizer, EngineConfig(kv_bits=8))


def test_vision_language_models_are_refused_with_kv_bits(vlm_model_dir):
    import mlx_vlm

    model, processor = mlx_vlm.load(str(vlm_model_dir))
    with pytest.raises(UnsupportedFeature, match="kv_bits"):
        Engine(model, processor, EngineConfig(kv_bits=8))


def test_later_chunks_of_quantized_rows_share_forwards(family):
    """Two prompts past mlx-lm's first 2048-token prefill step convert inside their prefills (the chunk that holds
    2048 is split there, one request at a time); their later chunks are quantized rows, which share forwards with
    each other (a batch of quantized rows: mlx-vlm's BatchQuantizedKVCache, the right pads cut from the packed
    keys and values), as their float chunks before did. Outputs equal mlx-lm alone with the same kv_bits."""
    _, model, tokenizer, _, _, _ = family
    prompts = [mixed_prompts(1, n, n, seed=7 + n)[0] for n in (2700, 2710)]
    settings = _quantized(4, 0)
    reference = [solo_tokens(model, tokenizer, p, 4, **settings) for p in prompts]
    engine, sink = engine_with_log(model, tokenizer, EngineConfig(max_batched_tokens=1024, prefill_chunk=300,
                                                                  check_invariants=True, **settings))
    run = drive(engine, [(0, {"prompt_tokens": p, "sampling": greedy(4), "request_id": f"r{i}"})
                         for i, p in enumerate(prompts)])
    engine.close()
    assert [run.tokens["r0"], run.tokens["r1"]] == reference
    assert sorted(e["request_ids"][0] for e in sink.of_kind("kv_quantize") if e.get("tokens") == 2048) == ["r0", "r1"]
    # chunks of 300 at one start each tick: [0, 300) .. [1500, 1800) float, in 6 shared forwards; [1800, 2100)
    # converts inside (alone); [2100, 2400) and [2400, 2700) quantized, in 2 more, the last with one pad (r0's
    # prefill end keeps its last token back: it feeds 299); r1's [2700, 2709) goes alone
    stats = engine.prefill_stats()
    assert (stats["batched_groups"], stats["batched_rows"], stats["padded_tokens"], stats["fallbacks"]) == (
        8, 16, 1, 0), stats
