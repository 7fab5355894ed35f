"""Gemma 4 images (mlx-vlm ``gemma4``) under ``use_bidirectional_attention: "vision"``, which released checkpoints
set and the tiny build (``build_model("audio")``) sets too. ``mlx_vlm.generate`` prefills a prompt with images and
no audio in one forward, in which each image's tokens attend to each other both ways (its chunked-prefill policy
and the token types it passes). The engine prefills such a prompt from position 0 through its last image token in
one forward of its own (``Request.first_chunk_reach``), the text after it in chunks, and batches the rest; every
output equals solo ``mlx_vlm.stream_generate``."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from PIL import Image

from scheduler import Engine, EngineConfig, InvalidRequest, SamplingParams
from scheduler.fixtures.tiny_models import build_model

from ..helpers import drive, engine_with_log
from .test_audio import RATE, tone

MAX_TOKENS = 12
LONG = "one two three four five six seven eight nine ten " * 3


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    import mlx_vlm

    return mlx_vlm.load(str(build_model("audio", tmp_path_factory.mktemp("tiny-gemma4"))))


def noise(seed: int, h: int = 64, w: int = 80) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


def prompt(processor, text: str, images: int = 0, audio: int = 0, system: str | None = None) -> str:
    content = [{"type": "image"}] * images + [{"type": "audio"}] * audio + [{"type": "text", "text": text}]
    turns = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return processor.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)


@contextlib.contextmanager
def causal_images(model):
    """The checkpoint as if it left ``use_bidirectional_attention`` unset (the option's default): its policy and
    its masks read it from the language model's configs."""
    configs = (model.language_model.config, model.language_model.model.config)
    kept = [c.use_bidirectional_attention for c in configs]
    for c in configs:
        c.use_bidirectional_attention = None
    try:
        yield
    finally:
        for c, value in zip(configs, kept):
            c.use_bidirectional_attention = value


def solo(gemma, request) -> list[int]:
    import mlx_vlm

    model, processor = gemma
    text, images, audio = request
    last = None
    for last in mlx_vlm.stream_generate(model, processor, text, image=images or None,
                                        audio=[clip for clip, _ in audio] or None, max_tokens=MAX_TOKENS,
                                        temperature=0.0):
        pass
    return list(last.token_ids)


@pytest.fixture(scope="module")
def workload(gemma):
    """(templated prompt, images, audio) per request: images alone, two images, an image before a long text, an
    image with audio (a prompt mlx-vlm keeps causal and chunks), audio alone, text alone; with solo outputs."""
    _, processor = gemma
    requests = [
        (prompt(processor, "describe the image please", 1), [noise(0)], []),
        (prompt(processor, "what is in this picture", 1), [noise(1, 96, 64)], []),
        (prompt(processor, "compare these two", 2), [noise(2), noise(3, 48, 112)], []),
        (prompt(processor, "hello there, how are you today"), [], []),
        (prompt(processor, "listen and look", 1, 1), [noise(4)], [(tone(0.6, 1), RATE)]),
        (prompt(processor, "just audio", 0, 1), [], [(tone(0.5, 2), RATE)]),
        (prompt(processor, "a long text after the image: " + LONG, 1), [noise(5)], []),
    ]
    return requests, [solo(gemma, r) for r in requests]


IMAGES_ALONE = (0, 1, 2, 6)  # the requests mlx-vlm prefills in one forward


def arrivals(requests, spacing: int) -> list[tuple[int, dict]]:
    return [(spacing * i, {"prompt": text, "images": images, "audio": audio,
                           "sampling": SamplingParams(max_tokens=MAX_TOKENS)})
            for i, (text, images, audio) in enumerate(requests)]


def test_the_two_way_image_attention_decides_solo_tokens_on_this_build(gemma, workload):
    """Without the option, solo mlx-vlm gives other tokens for some prompts with images alone (and the same for
    the others, which it computes causally either way): the engine test below fails if the engine's forward is
    causal (with the engine's first chunks prefilled causally, 2 of the 7 requests differed)."""
    requests, references = workload
    with causal_images(gemma[0]):
        causal = [solo(gemma, r) for r in requests]
    differs = {i for i, (a, b) in enumerate(zip(causal, references)) if a != b}
    assert differs and differs <= set(IMAGES_ALONE), differs


@pytest.mark.parametrize("budgets", [
    dict(),
    dict(max_batched_tokens=64, prefill_chunk=40, max_seqs=4, vision_budget=1, draft_tokens=2),
    dict(max_batched_tokens=48, prefill_chunk=40, mix="prefill-first"),
], ids=["default", "small-budgets-drafting", "prefill-first"])
def test_image_prompts_batch_exactly(gemma, workload, budgets, tmp_path):
    """Each image-alone prompt's first chunk starts at 0 and holds its last image token, in a forward of its own
    (later chunks and the other requests' chunks may share forwards), with small budgets and drafting, and when
    prefill-first ticks keep each prompt's last token back; every output equals solo mlx-vlm, and the trace
    replays decision by decision."""
    from scheduler.tools.replay import load_trace, replay

    model, processor = gemma
    requests, references = workload
    trace = tmp_path / "trace.jsonl"
    engine, log = engine_with_log(model, processor, EngineConfig(**budgets, check_invariants=True,
                                                                 trace_path=str(trace)))
    run = drive(engine, arrivals(requests, 2 if budgets else 0))
    assert list(run.tokens.values()) == references
    ids = list(run.tokens)
    reach = {e["request_id"]: e.get("first_chunk_reach", 0) for e in log.of_kind("arrival")}
    image_token = model.config.image_token_id
    for i, rid in enumerate(ids):
        ids_of = engine.vlm.prepare(requests[i][0], requests[i][1], audio=requests[i][2]).input_ids
        want = max(p for p, t in enumerate(ids_of) if t == image_token) + 1 if i in IMAGES_ALONE else 0
        assert reach[rid] == want, (i, reach[rid], want)
    chunks = [c for e in log.of_kind("plan") for c in e["prefill"]]
    for rid, start, end, _ in chunks:
        assert start >= reach[rid] or (start == 0 and end >= reach[rid]), (rid, start, end)
    forwards = log.of_kind("prefill_forward")  # shared forwards: never an image-alone first chunk
    assert all(s >= reach[r] for e in forwards for r, s in zip(e["request_ids"], e["starts"]))
    if budgets:  # the text after the long prompt's image came in later chunks
        assert [(s, e) for r, s, e, _ in chunks if r == ids[6]][1:]
    assert engine.executor.cache_bytes() == 0 and not engine.executor.live_request_ids()
    engine.close()
    report = replay(load_trace(trace))
    assert report.identical, report.format()


def test_preempted_image_prompts_recompute_their_first_chunk_whole(gemma, workload):
    """A KV budget of three rows: image requests are preempted and recomputed, each recompute's first chunk again
    from 0 through its last image token (prompt and outputs embedded anew), and every output equals solo."""
    model, processor = gemma
    requests, references = workload
    longest = max(len(engine_prompt.input_ids) for engine_prompt in
                  (Engine(model, processor).vlm.prepare(t, i, audio=a) for t, i, a in requests[:3])) + 2
    budget = Engine(model, processor).kv_layout.batch_bytes([longest] * 3)
    engine, log = engine_with_log(model, processor, EngineConfig(kv_memory_bytes=budget, kv_headroom_tokens=0,
                                                                 check_invariants=True))
    run = drive(engine, arrivals(requests, 0))
    assert list(run.tokens.values()) == references
    ids = list(run.tokens)
    preempted = {e["request_id"] for e in log.of_kind("transition") if e["to"] == "queued" and e["from"] != "queued"}
    assert preempted & {ids[i] for i in IMAGES_ALONE}, preempted
    reach = {e["request_id"]: e.get("first_chunk_reach", 0) for e in log.of_kind("arrival")}
    firsts = [(rid, end) for e in log.of_kind("plan") for rid, start, end, _ in e["prefill"] if start == 0]
    assert all(end >= reach[rid] for rid, end in firsts)
    assert len([rid for rid, _ in firsts if rid in preempted]) > len(preempted)  # first chunks again


def test_a_prefix_hit_is_taken_only_past_the_images(gemma, workload):
    """The same image prompt again restores its whole prompt from the prefix cache (the entry was computed in the
    one forward); one with the same system text and another image finds that text only, short of its images, so
    it starts from position 0. Both equal solo mlx-vlm."""
    model, processor = gemma
    system = "You look at pictures. " + LONG
    first = (prompt(processor, "what is it", 1, system=system), [noise(7)], [])
    other = (prompt(processor, "what is it", 1, system=system), [noise(8)], [])
    engine, log = engine_with_log(model, processor, EngineConfig(prefix_cache_bytes=8 << 20, prefix_block_size=8,
                                                                 check_invariants=True))
    got = []
    for request in (first, first, other):
        run = drive(engine, arrivals([request], 0))
        got += list(run.tokens.values())
    assert got == [solo(gemma, first)] * 2 + [solo(gemma, other)]
    arrivals_ = log.of_kind("arrival")
    reach = [e["first_chunk_reach"] for e in arrivals_]
    hits = {e["request_id"]: e["length"] for e in log.of_kind("prefix_hit")}
    assert hits.get(arrivals_[1]["request_id"], 0) >= reach[1] > 0, (hits, reach)
    assert arrivals_[2]["request_id"] not in hits, hits
    assert engine.prefix_cache_stats()["hits"] >= 1


def test_a_first_chunk_runs_past_prefill_chunk_and_one_past_the_token_budget_is_refused_alone(gemma, workload):
    """prefill_chunk 8, shorter than every image prompt's first chunk: those chunks run whole anyway (the rest in
    chunks of 8) and every output equals solo mlx-vlm. With max_batched_tokens shorter than one, that request is
    refused at add_request naming the limit, and the other requests run and equal solo mlx-vlm."""
    model, processor = gemma
    requests, references = workload
    engine, log = engine_with_log(model, processor, EngineConfig(prefill_chunk=8, max_batched_tokens=96,
                                                                 check_invariants=True))
    run = drive(engine, arrivals(requests, 1))
    assert list(run.tokens.values()) == references
    reach = {e["request_id"]: e.get("first_chunk_reach", 0) for e in log.of_kind("arrival")}
    lengths = [(end - start, reach[rid] if start == 0 else 0) for e in log.of_kind("plan")
               for rid, start, end, _ in e["prefill"]]
    assert all(n <= max(8, r) for n, r in lengths) and any(n > 8 for n, _ in lengths), lengths

    engine = Engine(model, processor, EngineConfig(prefill_chunk=8, max_batched_tokens=24, max_seqs=4,
                                                   check_invariants=True))
    text, images, audio = requests[2]  # two images: its first chunk is longer than 24 tokens
    with pytest.raises(InvalidRequest, match=r"must be prefilled in one forward.* at most 24 "
                                             r"\(max_batched_tokens=24\)"):
        engine.add_request(prompt=text, images=images, sampling=SamplingParams(max_tokens=MAX_TOKENS))
    assert not engine.has_pending()
    run = drive(engine, arrivals([requests[i] for i in (3, 4, 5)], 0))
    assert list(run.tokens.values()) == [references[i] for i in (3, 4, 5)]


# Gemma 4 26B-A4B's released options (its config.json: text_config 30 layers, five sliding to one full, a mixture of
# experts beside each dense MLP (128 experts, top 8, 704 wide), full layers with keys as values and 2 global KV heads
# against 8, no per-layer inputs, no KV sharing; vision_config standardize; audio_config null), on six tiny layers;
# the image processor's max_soft_tokens at 70 (one of its budgets: 70, 140, 280, 560, 1120), so each image is
# longer than the tiny sliding window (64), as a 560- or 1120-token image is longer than a real 512 / 1024 one.
A4B_TEXT_OPTIONS = {
    "num_hidden_layers": 6, "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    "sliding_window_pattern": 6, "num_attention_heads": 4, "num_key_value_heads": 4, "num_global_key_value_heads": 1,
    "attention_k_eq_v": True, "global_head_dim": 64, "hidden_size_per_layer_input": 0, "enable_moe_block": True,
    "num_experts": 16, "top_k_experts": 8, "moe_intermediate_size": 16, "intermediate_size": 48,
    "rope_parameters": {
        "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
}


def test_a_checkpoint_without_audio_takes_images_with_26b_a4b_options(tmp_path, monkeypatch):
    """26B-A4B and 31B ship no audio tower: such a checkpoint loads and takes images and videos (refusing audio
    alone, as the server then does), and with 26B-A4B's options and 70-token images its image prompts, whose solo
    tokens the two-way attention decides, batch exactly in small chunks with drafting."""
    import mlx_vlm

    from scheduler.fixtures import tiny_models

    plain, plain_processor = tiny_models.audio_config, tiny_models.audio_processor_config

    def a4b(tokenizer):
        config = plain(tokenizer)
        config["text_config"].update(A4B_TEXT_OPTIONS)
        config["vision_config"].update(standardize=True, use_clipped_linears=False)
        return dict(config, audio_config=None)

    def budget_70():
        config = plain_processor()
        config["image_processor"]["max_soft_tokens"] = 70
        return config

    monkeypatch.setattr(tiny_models, "audio_config", a4b)
    monkeypatch.setattr(tiny_models, "audio_processor_config", budget_70)
    gemma = mlx_vlm.load(str(build_model("audio", tmp_path / "model")))
    model, processor = gemma
    assert model.audio_tower is None and model.language_model.model.layers[0].enable_moe
    engine = Engine(model, processor, EngineConfig(max_batched_tokens=160, prefill_chunk=16, max_seqs=4,
                                                   draft_tokens=2, check_invariants=True))
    assert engine.vlm.media_kinds == {"image", "video"} and engine.vlm.sample_rate is None
    with pytest.raises(ValueError, match="no audio encoder"):
        engine.add_request(prompt=prompt(processor, "listen", 0, 1), audio=[(tone(0.5, 1), RATE)],
                           sampling=SamplingParams(max_tokens=MAX_TOKENS))
    requests = [
        (prompt(processor, "describe the image please", 1), [noise(0)], []),
        (prompt(processor, "compare these two", 2), [noise(2), noise(3, 48, 112)], []),
        (prompt(processor, "hello there, how are you today"), [], []),
        (prompt(processor, "a long text after the image: " + LONG, 1), [noise(5)], []),
    ]
    references = [solo(gemma, r) for r in requests]
    with causal_images(model):
        assert [solo(gemma, r) for r in requests] != references
    reach = engine.vlm.prepare(*requests[0][:2]).first_chunk_reach
    assert reach > model.language_model.config.sliding_window, reach
    run = drive(engine, arrivals(requests, 2))
    assert list(run.tokens.values()) == references
