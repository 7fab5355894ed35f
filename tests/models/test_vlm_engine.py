"""Vision-language requests through the engine on the tiny Qwen2-VL: every request of a mixed image/text
batch yields exactly the tokens of mlx_vlm.stream_generate run alone (all at once, staggered, small budgets);
the vision cache skips the encoder without changing tokens; media is admitted while text keeps arriving; bad
images fail only their own request."""

import io

import numpy as np
import pytest
from PIL import Image

from scheduler import Engine, EngineConfig, FinishReason, SamplingParams, UnreadableMedia
from scheduler.tools.replay import load_trace, replay

from ..helpers import drive, engine_with_log

MAX_TOKENS = 12
SIZES = [(112, 140), (56, 56), (84, 112), (140, 84)]
TEXTS = ["Hi.", "What does the cat see today?",
         "The old man reads many books in the morning, and the teacher brings a warm coat.",
         "Why does the river see the green door? The machine loads a new token; then the farmer keeps it."]


def noise_image(width, height, seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def vlm(vlm_model_dir):
    import mlx_vlm

    return mlx_vlm.load(str(vlm_model_dir))


def templated(vlm, text, n_images):
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = vlm
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}] if n_images else text
    return apply_chat_template(processor, model.config, [{"role": "user", "content": content}], num_images=n_images)


def solo(vlm, prompt, images):
    import mlx_vlm

    model, processor = vlm
    last = None
    for last in mlx_vlm.stream_generate(model, processor, prompt, image=list(images) or None,
                                        max_tokens=MAX_TOKENS, temperature=0.0):
        pass
    return list(last.token_ids)


@pytest.fixture(scope="module")
def workload(vlm):
    """16 requests: 8 with images (4 sizes, 2 seeds each), 8 text-only of different lengths."""
    requests = []
    for i in range(8):
        w, h = SIZES[i % 4]
        requests.append((templated(vlm, f"Picture {i}: {TEXTS[i % 2]}", 1), [noise_image(w, h, seed=i)]))
    for i in range(8):
        requests.append((templated(vlm, " ".join(TEXTS[: 1 + i % 4]) + f" ({i})", 0), []))
    order = [0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15]  # interleave image and text
    requests = [requests[i] for i in order]
    return requests, [solo(vlm, p, imgs) for p, imgs in requests]


CONFIGS = {
    "default": dict(),
    "small-budgets": dict(max_batched_tokens=24, prefill_chunk=7, max_seqs=6, vision_budget=1),
    # prefill-first: rows pause for prefill chunks only, not for a tick that only encodes media
    "prefill-first": dict(max_batched_tokens=24, prefill_chunk=7, max_seqs=6, vision_budget=1, mix="prefill-first"),
}


@pytest.mark.parametrize("staggered", [False, True], ids=["at-once", "staggered"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_mixed_batch_matches_solo_mlx_vlm(vlm, workload, name, staggered):
    requests, reference = workload
    model, processor = vlm
    engine, log = engine_with_log(model, processor, EngineConfig(**CONFIGS[name], check_invariants=True))
    run = drive(engine, [(i if staggered else 0, {"prompt": p, "images": imgs, "sampling": SamplingParams(max_tokens=MAX_TOKENS)})
                         for i, (p, imgs) in enumerate(requests)])
    outputs = list(run.tokens.values())
    mismatches = [i for i, (got, want) in enumerate(zip(outputs, reference)) if got != want]
    assert not mismatches, f"requests {mismatches} differ from solo mlx_vlm output"
    plans = log.of_kind("plan")
    assert all(len(p["encode"]) <= max(1, CONFIGS[name].get("vision_budget", EngineConfig().vision_budget))
               for p in plans)
    moves = [(e["from"], e["to"]) for e in log.of_kind("transition")]
    assert moves.count(("queued", "vision_encoding")) == 8
    assert moves.count(("vision_encoding", "chunk_prefilling")) == 8
    if name == "small-budgets":
        assert any(p["encode"] and p["decode"] for p in plans), "vision work interleaved with decoding"
    assert engine.stats().num_images_processed == 8
    assert engine.executor.cache_bytes() == 0 and not engine.executor.live_request_ids()


def test_vision_cache_hit_skips_the_encoder_and_keeps_tokens(vlm, tmp_path):
    model, processor = vlm
    image = noise_image(112, 140, seed=42)
    path_a, path_b = tmp_path / "a.png", tmp_path / "b.png"
    image.save(path_a)
    image.save(path_b)
    prompt = templated(vlm, "What is this?", 1)
    engine, log = engine_with_log(model, processor, EngineConfig(check_invariants=True))
    first = drive(engine, [(0, {"prompt": prompt, "images": [str(path_a)], "sampling": SamplingParams(max_tokens=MAX_TOKENS)})])
    second = drive(engine, [(0, {"prompt": prompt, "images": [path_b.read_bytes()], "sampling": SamplingParams(max_tokens=MAX_TOKENS)})])
    other = drive(engine, [(0, {"prompt": prompt, "images": [noise_image(112, 140, seed=43)], "sampling": SamplingParams(max_tokens=MAX_TOKENS)})])
    assert list(first.tokens.values()) == list(second.tokens.values()) == [solo(vlm, prompt, [image])]
    assert list(other.tokens.values()) != list(first.tokens.values())
    stats = engine.vision_cache_stats()
    assert (stats["hits"], stats["misses"]) == (1, 2)
    kinds = [e["event"] for e in log.events if e["event"].startswith("vision_")]
    assert kinds.count("vision_hit") == 1 and kinds.count("vision_miss") == 2


def test_vision_cache_respects_its_byte_budget(vlm):
    model, processor = vlm
    engine = Engine(model, processor, EngineConfig(vision_cache_bytes=30_000))  # about one image's features
    prompt = templated(vlm, "What is this?", 1)
    for seed in range(3):
        drive(engine, [(0, {"prompt": prompt, "images": [noise_image(112, 140, seed)], "sampling": SamplingParams(max_tokens=2)})])
    stats = engine.vision_cache_stats()
    assert stats["bytes"] <= 30_000 and stats["evictions"] >= 1


def test_prefill_first_decodes_while_media_encodes(vlm, workload):
    """In prefill-first mode a tick that only encodes media decodes the running rows too (only prefill chunks
    pause them), and every output is still solo mlx_vlm's."""
    requests, reference = workload
    model, processor = vlm
    text, image = requests[1], requests[0]  # (the workload interleaves image and text requests)
    engine, log = engine_with_log(model, processor, EngineConfig(mix="prefill-first", check_invariants=True))
    run = drive(engine, [(t, {"prompt": p, "images": imgs, "sampling": SamplingParams(max_tokens=MAX_TOKENS)})
                         for t, (p, imgs) in ((0, text), (4, image))])
    assert list(run.tokens.values()) == [reference[1], reference[0]]
    encoding = next(p for p in log.of_kind("plan") if p["encode"])
    assert encoding["tick"] == 4 and not encoding["prefill"] and encoding["decode"] == [list(run.tokens)[0]]


def test_media_is_admitted_while_text_keeps_arriving(vlm):
    model, processor = vlm
    engine = Engine(model, processor, EngineConfig(max_seqs=4, max_batched_tokens=64, prefill_chunk=16,
                                                   check_invariants=True))
    text = templated(vlm, "Tell me more.", 0)
    arrivals = [(t, {"prompt": text, "sampling": SamplingParams(max_tokens=6)}) for t in range(60)]
    arrivals.append((3, {"prompt": templated(vlm, "Look.", 1), "images": [noise_image(56, 56, 1)],
                         "sampling": SamplingParams(max_tokens=6), "request_id": "image"}))
    finished_at = {}
    pending = sorted(arrivals, key=lambda a: a[0])
    while pending or engine.has_pending():
        while pending and pending[0][0] <= engine.tick:
            engine.add_request(**pending.pop(0)[1])
        for out in engine.step():
            if out.finished:
                finished_at[out.request_id] = engine.tick
    assert finished_at["image"] < 40, "the image request did not wait for the text stream to stop"
    assert len(finished_at) == 61


def test_bad_images_are_refused_alone(vlm, tmp_path):
    """An image that does not decode, or that the processor refuses (Qwen2-VL's patch grid allows an aspect
    ratio below 200), raises UnreadableMedia naming the image; nothing is queued and the good request runs."""
    model, processor = vlm
    good = noise_image(56, 56, seed=5)
    buf = io.BytesIO()
    good.save(buf, format="PNG")
    prompt = templated(vlm, "What is this?", 1)
    two = templated(vlm, "And these?", 2)
    bad = {"truncated": (prompt, [buf.getvalue()[:40]], 0), "missing": (prompt, [str(tmp_path / "nope.png")], 0),
           "zero-size": (prompt, [Image.new("RGB", (0, 0))], 0),
           "too-wide": (prompt, [noise_image(2000, 8, seed=6)], 0),
           "second-too-wide": (two, [good, noise_image(8, 2000, seed=7)], 1)}
    engine = Engine(model, processor, EngineConfig(check_invariants=True))
    for name, (text, images, index) in bad.items():
        with pytest.raises(UnreadableMedia) as info:
            engine.add_request(prompt=text, images=images, request_id=name,
                               sampling=SamplingParams(max_tokens=MAX_TOKENS))
        assert (info.value.field, info.value.kind, info.value.index) == ("images", "image", index), name
        assert str(info.value).startswith(f"images: unreadable image {index}: "), name
    assert "aspect ratio" in str(info.value)
    assert not engine.has_pending()
    run = drive(engine, [(0, {"prompt": prompt, "images": [good], "request_id": "good",
                              "sampling": SamplingParams(max_tokens=MAX_TOKENS)})])
    assert run.tokens["good"] == solo(vlm, prompt, [good])
    for name in bad:  # refused ids were never taken: they are free to use
        assert engine.add_request(prompt=prompt, images=[good], request_id=name,
                                  sampling=SamplingParams(max_tokens=1))


def test_text_only_token_prompts_and_replay(vlm, tmp_path):
    model, processor = vlm
    trace = tmp_path / "vlm.jsonl"
    engine = Engine(model, processor, EngineConfig(trace_path=str(trace), prefill_chunk=8, max_batched_tokens=20, max_seqs=4))
    prompt = templated(vlm, "Hello there, how are you?", 0)
    ids = processor.tokenizer.encode(prompt)
    run = drive(engine, [(0, {"prompt_tokens": ids, "sampling": SamplingParams(max_tokens=MAX_TOKENS)}),
                         (1, {"prompt": templated(vlm, "Look.", 1), "images": [noise_image(84, 112, 3)],
                              "sampling": SamplingParams(max_tokens=MAX_TOKENS)})])
    engine.close()
    assert list(run.tokens.values())[0] == solo(vlm, prompt, [])
    assert replay(load_trace(trace)).identical


def test_prefix_cache_is_media_safe(vlm):
    model, processor = vlm
    engine = Engine(model, processor, EngineConfig(prefix_cache_bytes=16 << 20, vision_cache_bytes=0,
                                                   check_invariants=True))
    prompt = templated(vlm, "What is in this picture, in detail, please?", 1)
    a, b = noise_image(112, 140, seed=7), noise_image(112, 140, seed=8)
    outs = []
    for image in (a, b, a):  # b has the same tokens as a (same size) but other pixels
        run = drive(engine, [(0, {"prompt": prompt, "images": [image], "sampling": SamplingParams(max_tokens=MAX_TOKENS)})])
        outs.append(list(run.tokens.values())[0])
    assert outs == [solo(vlm, prompt, [a]), solo(vlm, prompt, [b]), solo(vlm, prompt, [a])]
    stats = engine.prefix_cache_stats()
    assert stats["hits"] == 1 and stats["misses"] == 2  # only the repeat of image a hit


def test_eos_model_stops_where_solo_mlx_vlm_stops(vlm_eos_model_dir):
    """A tiny Qwen2-VL that emits eos (tiny_models vlm-eos): image and text requests stop on the VLM's eos set
    exactly where mlx_vlm.stream_generate run alone stops, and the others run to max_tokens."""
    import mlx_vlm

    eos_vlm = mlx_vlm.load(str(vlm_eos_model_dir))
    model, processor = eos_vlm
    requests = [(templated(eos_vlm, f"Picture {i}: {TEXTS[i % 2]}", 1), [noise_image(*SIZES[i % 4], seed=i)])
                for i in range(6)]
    requests += [(templated(eos_vlm, " ".join(TEXTS[: 1 + i % 4]) + f" ({i})", 0), []) for i in range(6)]
    reference = [solo(eos_vlm, p, imgs) for p, imgs in requests]
    engine = Engine(model, processor, EngineConfig(max_batched_tokens=64, prefill_chunk=16, max_seqs=8))
    run = drive(engine, [(i // 2, {"prompt": p, "images": imgs, "sampling": SamplingParams(max_tokens=MAX_TOKENS)})
                         for i, (p, imgs) in enumerate(requests)])
    assert list(run.tokens.values()) == reference
    eos = engine.vlm.eos_token_ids
    reasons = {rid: run.finish[rid] for rid in run.tokens}
    for rid, tokens in run.tokens.items():
        if tokens[-1] in eos:
            assert reasons[rid] is FinishReason.STOP
        else:
            assert reasons[rid] is FinishReason.LENGTH and len(tokens) == MAX_TOKENS
    assert FinishReason.STOP in reasons.values() and FinishReason.LENGTH in reasons.values()
