"""Vision encoding in batches (``FamilySpec.vision_batch``, ``VLMAdapter.encode_many``): the media of several
requests go through the encoders in one call where the family allows it.

* the features of a batched call equal, image by image, those of the request encoded alone (exactly with the
  wheel's BLAS; within 1e-5 under OpenBLAS, whose GEMM and conv round a few 1e-7 differently on more rows);
* the engine's greedy output with several image (and, for the Qwen families, video) requests admitted in one
  tick equals ``mlx_vlm.stream_generate`` run on each alone, and the tick's media went through one call
  (``ONE``) or one call per group of equal-shape tensors (``EQUAL_SHAPE``), counted from the ``vision_encode``
  events;
* vision-cache hits are not encoded again: only the misses are in the tick's call (media repeated within the
  tick are encoded once);
* the families that key media per item encode each image once, whatever requests hold it and in which order
  (per-item units);
* a bad medium in a batched call fails only its own request (the call is redone one unit at a time).
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from scheduler import EngineConfig, SamplingParams
from scheduler.fixtures.tiny_models import build_model
from scheduler.fixtures.vlm_families import build_tiny_vlm
from scheduler.models.adapter import _shape_but
from scheduler.models.families import FAMILIES, VisionBatch
from scheduler.plan import NewRequest, TickPlan

from ..helpers import drive, engine_with_log

MAX_TOKENS = 12
#: every family that batches its encoders, by its build's name (phi4_siglip's model type is phi4-siglip), with the
#: build seed tests/models/test_vlm_families.py uses
BATCHING = {"qwen2_vl": None, "qwen2_5_vl": 1, "qwen3_vl": 0, "qwen3_5": 0, "idefics3": 4, "smolvlm": 4,
            "mistral3": 5, "pixtral": 0, "llava": 0, "qwen3_vl_moe": 0, "qwen3_5_moe": 1, "lfm2_vl": 0,
            "idefics2": 0, "aya_vision": 0, "mage_vl": 0, "glm4v_moe": 0, "glm_ocr": 2, "paddleocr_vl": 0,
            "dots_ocr": 0, "llava_onevision": 0, "qwen3_omni_moe": 0, "plamo2vl": 0, "inkling": 0, "indic_ocr": 0,
            "muse_glimmer": 0, "mimo_v2": 3, "glm5_next": 0, "phi4_siglip": 0}


def test_the_batching_families_are_the_table_s():
    from scheduler.fixtures.vlm_families import VLM_FAMILIES

    assert {VLM_FAMILIES[n].model_type if n in VLM_FAMILIES else n for n in BATCHING} == {
        n for n, s in FAMILIES.items() if not s.refused and s.vision_batch is not VisionBatch.PER_REQUEST}
    assert {n for n, s in FAMILIES.items() if s.vision_batch is VisionBatch.ONE} == {
        "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe", "mage_vl", "glm4v_moe",
        "glm_ocr", "paddleocr_vl", "dots_ocr", "qwen3_omni_moe", "indic_ocr", "muse_glimmer", "mimo_v2", "glm5_next"}


def noise_image(width, height, seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def frames(seed, count, width, height):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)) for _ in range(count)]


def user(text, n, kind="image"):
    return [{"role": "user", "content": [{"type": kind}] * n + [{"type": "text", "text": text}]}]


def image_requests(images_per_request: int | None = None):
    """(messages, images): three of one size, one wider, one with two images (one for a family whose processor
    takes one a prompt: ``FamilySpec.images_per_request``), all different pixels."""
    return [
        (user("Describe it.", 1), [noise_image(56, 56, 1)]),
        (user("What is in the picture?", 1), [noise_image(56, 56, 2)]),
        (user("Which colour is most common here?", 1), [noise_image(56, 56, 3)]),
        (user("A wide one.", 1), [noise_image(84, 56, 4)]),
        (user("Compare the two pictures, please.", 2), [noise_image(56, 56, 5), noise_image(56, 56, 6)])
        if images_per_request != 1 else (user("And this one?", 1), [noise_image(56, 56, 5)]),
    ]


def video_requests():
    return [(user("What happens?", 1, "video"), frames(7, 4, 56, 56)),
            (user("Describe the clip, please.", 1, "video"), frames(8, 4, 56, 56))]


@pytest.fixture(scope="module", params=list(BATCHING))
def family(request, tmp_path_factory):
    import mlx_vlm

    name = request.param
    out = tmp_path_factory.mktemp(f"vb-{name}")
    model_dir = build_model("vlm", out) if name == "qwen2_vl" else build_tiny_vlm(name, out, seed=BATCHING[name])
    model, processor = mlx_vlm.load(str(model_dir))
    return name, model, processor


def _adapter(model, processor, **options):
    from scheduler.models.adapter import VLMAdapter

    return VLMAdapter(model, processor, **options)


def test_batched_features_equal_one_by_one(family):
    name, model, processor = family
    adapter = _adapter(model, processor)
    prepared = [adapter.prepare(m, images=im) for m, im in image_requests(adapter.spec.images_per_request)]
    calls = []
    many = adapter.encode_many([(p, ()) for p in prepared], on_call=calls.append)
    alone = [adapter.encode(p) for p in prepared]
    spec = adapter.spec
    if spec.vision_batch is VisionBatch.ONE:
        assert len(calls) == 1 and calls[0].items == tuple(range(len(prepared)))
    else:  # one call per group of equal tensor shapes (the two-image request is one of a group only if alike)
        shapes = {tuple((k, tuple(v.shape[:spec.media_axis] + v.shape[spec.media_axis + 1:]))
                        for k, v in sorted(p.media_inputs.items())) for p in prepared}
        assert len(calls) == len(shapes) < len(prepared), [c.items for c in calls]
    assert sorted(i for c in calls for i in c.items) == list(range(len(prepared)))
    assert sum(c.images for c in calls) == sum(p.num_media_items for p in prepared)
    for i, (got, want) in enumerate(zip(many, alone)):
        assert not isinstance(got, Exception), got
        assert got.embeddings.shape == want.embeddings.shape
        assert mx.allclose(got.embeddings, want.embeddings, rtol=1e-5, atol=1e-5).item(), (
            name, i, mx.max(mx.abs(got.embeddings - want.embeddings)).item())
        for key in want.media_rows:
            assert mx.allclose(got.media_rows[key], want.media_rows[key], rtol=1e-5, atol=1e-5).item()
        assert got.rope_delta == want.rope_delta and got.vision_cache_hit is False
        if want.position_ids is not None:
            assert mx.array_equal(got.position_ids, want.position_ids).item()


def _solo(model, processor, messages, images=(), videos=()):
    import mlx_vlm
    from mlx_vlm.prompt_utils import apply_chat_template

    if videos:
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        prompt = apply_chat_template(processor, model.config, messages, num_images=len(images))
    last = None
    for last in mlx_vlm.stream_generate(model, processor, prompt, image=list(images) or None,
                                        video=[list(videos)] if videos else None, max_tokens=MAX_TOKENS,
                                        temperature=0.0):
        pass
    return list(last.token_ids)


def test_engine_batches_one_tick_of_media_exactly(family):
    """Every request arrives at tick 0 and the vision budget takes all their media in that tick: greedy output
    equals solo mlx_vlm per request, and the tick's encoder calls are the family's groups."""
    name, model, processor = family
    spec = FAMILIES[model.config.model_type]
    requests = image_requests(spec.images_per_request)
    arrivals = [{"prompt": m, "images": im} for m, im in requests]
    refs = [_solo(model, processor, m, images=im) for m, im in requests]
    if "video" in spec.media:
        arrivals += [{"prompt": m, "videos": [v]} for m, v in video_requests()]
        refs += [_solo(model, processor, m, videos=v) for m, v in video_requests()]
    arrivals.append({"prompt": [{"role": "user", "content": "Hi. The cat sat on the mat."}]})
    refs.append(None)  # a text request in the same ticks (not compared: it only has to run beside them)
    engine, log = engine_with_log(model, processor, EngineConfig(vision_budget=64, max_seqs=16,
                                                                 check_invariants=True))
    run = drive(engine, [(0, dict(kw, sampling=SamplingParams(max_tokens=MAX_TOKENS))) for kw in arrivals])
    assert not run.errors, run.errors
    outputs = list(run.tokens.values())
    mismatches = [i for i, (got, want) in enumerate(zip(outputs, refs)) if want is not None and got != want]
    assert not mismatches, f"{name}: requests {mismatches} differ from solo mlx_vlm"
    calls = log.of_kind("vision_encode")
    media_ids = [rid for rid, kw in zip(run.tokens, arrivals) if "images" in kw or "videos" in kw]
    assert sorted(r for c in calls for r in c["request_ids"]) == sorted(media_ids)  # each encoded once
    assert len({c["tick"] for c in calls}) == 1, "the media were not all encoded in one tick"
    assert all("seconds" in c["measure"] and "error" not in c for c in calls)
    if spec.vision_batch is VisionBatch.ONE:
        assert len(calls) == 1 + ("video" in spec.media), [c["request_ids"] for c in calls]  # images; videos
    else:
        assert max(len(c["request_ids"]) for c in calls) >= 3, [c["request_ids"] for c in calls]


@pytest.mark.parametrize("name", ["qwen2_vl", "idefics3"])
def test_vision_cache_hits_are_not_encoded_again(name, tmp_path):
    """A tick whose requests repeat earlier images: the hits are not in its encoder call, only the miss is."""
    import mlx_vlm

    model_dir = build_model("vlm", tmp_path) if name == "qwen2_vl" else build_tiny_vlm(name, tmp_path,
                                                                                        seed=BATCHING[name])
    model, processor = mlx_vlm.load(str(model_dir))
    first = image_requests()[:2]
    engine, log = engine_with_log(model, processor, EngineConfig(vision_budget=64, check_invariants=True))
    sampling = SamplingParams(max_tokens=4)
    drive(engine, [(0, {"prompt": m, "images": im, "sampling": sampling}) for m, im in first])
    before = len(log.of_kind("vision_encode"))
    new = image_requests()[2]
    again = [(user("Once more, what is it?", 1), first[0][1]), (user("And this?", 1), first[1][1]), new,
             (user("The same new one, again?", 1), new[1])]  # the last repeats a miss of its own tick
    run = drive(engine, [(0, {"prompt": m, "images": im, "sampling": sampling}) for m, im in again])
    assert not run.errors
    calls = log.of_kind("vision_encode")[before:]
    assert [(c["request_ids"], c["images"]) for c in calls] == [([list(run.tokens)[2]], 1)]
    hits = {r: info["vision_cache_hit"] for o in log.of_kind("outcome") for r, info in o["encoded"].items()
            if r in run.tokens}
    assert hits == dict(zip(run.tokens, [True, True, False, True]))


def test_cached_and_repeated_images_cost_no_vision_budget(tmp_path):
    """With room for one image a tick, a tick's requests whose images are in the vision cache, or repeat the one
    image the tick encodes, are encoded with it (nothing of theirs goes through the encoders), and their
    outputs equal solo mlx_vlm. The trace replays identically, following the vision cache from its
    store / evict events; without those events (or read as an engine before the rule, which counted every
    image) replay plans otherwise, so the rule is what the engine ran."""
    import mlx_vlm

    from scheduler.tools.replay import load_trace, replay

    model, processor = mlx_vlm.load(str(build_model("vlm", tmp_path)))
    (seen_msgs, seen), (new_msgs, new) = image_requests()[:2]
    engine, log = engine_with_log(model, processor, EngineConfig(vision_budget=1, check_invariants=True))
    sampling = SamplingParams(max_tokens=MAX_TOKENS)
    drive(engine, [(0, {"prompt": seen_msgs, "images": seen, "sampling": sampling})])
    before = len(log.of_kind("vision_encode"))
    turn = [(user("Once more, what is it?", 1), seen), (new_msgs, new), (user("The new one, again?", 1), new),
            (user("And the first one?", 1), seen)]
    run = drive(engine, [(engine.tick, {"prompt": m, "images": im, "sampling": sampling}) for m, im in turn])
    assert not run.errors
    ids = list(run.tokens)
    encoding = [p for p in log.of_kind("plan") if set(p["encode"]) & set(ids)]
    assert len(encoding) == 1 and sorted(encoding[0]["encode"]) == sorted(ids)
    assert [(c["request_ids"], c["images"]) for c in log.of_kind("vision_encode")[before:]] == [([ids[1]], 1)]
    assert list(run.tokens.values()) == [_solo(model, processor, m, im) for m, im in turn]

    events = list(log.events)
    assert replay(load_trace(events)).identical
    blind = [e for e in events if e["event"] != "vision_store"]
    assert not replay(load_trace(blind)).identical  # the first image no longer cached: its repeat waits
    older = [dict(events[0], vision_budget_counts=None), *events[1:]]
    assert not replay(load_trace(older)).identical


@pytest.mark.parametrize("name", ["qwen2_vl", "llava", "mistral3", "idefics3"])
def test_images_are_encoded_once_whatever_request_holds_them(name, tmp_path):
    """The families that key media per item (``FamilySpec.item_split``: one of each layout, GRID, STACK,
    SIZED_STACK and TILES) encode and cache each image on its own (``PreparedRequest.media_items``): requests that hold
    the same images in other combinations and orders encode each image once (in one call where the family's
    ``vision_batch`` puts them together: images of one size on the stacking families), and each request's
    embeddings equal those of the request encoded alone; a later request made of images seen before is all
    vision-cache hits, with no encoder call. The engine's outputs equal solo mlx_vlm."""
    import mlx_vlm

    from scheduler.models.families import ItemSplit

    model_dir = (build_model("vlm", tmp_path) if name == "qwen2_vl"
                 else build_tiny_vlm(name, tmp_path, seed=BATCHING[name]))
    model, processor = mlx_vlm.load(str(model_dir))
    a, b, c = noise_image(56, 84, 31), noise_image(84, 56, 32), noise_image(56, 56, 33)
    first = [(user("Both?", 2), [a, b]), (user("Both, the other way?", 2), [b, a]), (user("And these?", 2), [c, b])]
    adapter = _adapter(model, processor, vision_cache=_cache())
    assert adapter.spec.item_split is not ItemSplit.WHOLE
    prepared = [adapter.prepare(m, images=im) for m, im in first]
    assert [len(p.media_items) for p in prepared] == [2, 2, 2]
    assert prepared[0].media_items[0].key == prepared[1].media_items[1].key  # a, whatever shares its request
    assert prepared[0].media_items[1].key == prepared[1].media_items[0].key == prepared[2].media_items[1].key
    shapes = {tuple(sorted((k, _shape_but(v, adapter._axis(k))) for k, v in item.inputs.items()))
              for item in (*prepared[0].media_items, prepared[2].media_items[0])}
    calls = []
    many = adapter.encode_many([(p, ()) for p in prepared], on_call=calls.append)
    assert sum(call.images for call in calls) == 3  # a, b and c: the second request has none new
    assert len(calls) == (1 if adapter.spec.vision_batch is VisionBatch.ONE else len(shapes))
    assert {i for call in calls for i in call.items} == {0, 2}
    alone = [_adapter(model, processor).encode(p) for p in prepared]  # each alone, no cache
    for got, want in zip(many, alone):
        assert mx.allclose(got.embeddings, want.embeddings, rtol=1e-5, atol=1e-5).item()
    assert [got.vision_cache_hit for got in many] == [False, True, False]  # the second: both of its images were
    later = adapter.prepare(user("Just this one?", 1), images=[c])       # encoded for the first
    calls.clear()
    assert adapter.encode_many([(later, ())], on_call=calls.append)[0].vision_cache_hit is True and not calls
    engine, log = engine_with_log(model, processor, EngineConfig(vision_budget=64, check_invariants=True))
    run = drive(engine, [(0, {"prompt": m, "images": im, "sampling": SamplingParams(max_tokens=MAX_TOKENS)})
                         for m, im in first])
    assert list(run.tokens.values()) == [_solo(model, processor, m, im) for m, im in first]
    assert sum(c["images"] for c in log.of_kind("vision_encode")) == 3


def _cache():
    from caches.vision import VisionCache

    return VisionCache(64 << 20)


def _executor(model, processor, events):
    from scheduler.execution.executor import MLXExecutor
    from scheduler.execution.runners import VisionLanguageRunner

    adapter = _adapter(model, processor)
    executor = MLXExecutor(VisionLanguageRunner(adapter), on_event=lambda kind, **f: events.append((kind, f)))
    return adapter, executor


def _encode_plan(prepared: dict) -> TickPlan:
    new = tuple(NewRequest(rid, tuple(p.input_ids), SamplingParams(), 0, media=p, media_key=p.media_key,
                           num_images=p.num_images) for rid, p in prepared.items())
    return TickPlan(tick=0, admitted=tuple(prepared), encode=tuple(prepared), new_requests=new)


@pytest.mark.parametrize("name", ["qwen2_vl", "pixtral"])
def test_a_bad_medium_fails_only_its_own_request(name, tmp_path):
    """One request's media tensor is corrupt (qwen2_vl: patches of the wrong width; pixtral: an image size of
    0x0, so its tensors still stack with the others and the tower raises): the batched call raises, is redone
    one request at a time, and only that request fails."""
    import mlx_vlm

    model_dir = build_model("vlm", tmp_path) if name == "qwen2_vl" else build_tiny_vlm(name, tmp_path)
    model, processor = mlx_vlm.load(str(model_dir))
    events: list = []
    adapter, executor = _executor(model, processor, events)
    prepared = {f"r{i}": adapter.prepare(m, images=im) for i, (m, im) in enumerate(image_requests()[:3])}
    bad = prepared["r1"]
    (item,) = bad.media_items  # media keyed per item: the item is what the encoders take
    if name == "qwen2_vl":
        pixels = item.inputs["pixel_values"]
        broken = {"pixel_values": pixels[:, : pixels.shape[1] - 3]}
    else:
        broken = {"image_sizes": mx.zeros_like(item.inputs["image_sizes"])}
    broken_item = dataclasses.replace(item, key="broken", inputs={**item.inputs, **broken})
    prepared["r1"] = dataclasses.replace(bad, media_items=(broken_item,), media_key="broken")
    result = executor.execute(_encode_plan(prepared))
    assert set(result.errors) == {"r1"} and result.errors["r1"].startswith("vision encoding failed")
    assert set(result.encoded) == {"r0", "r2"}
    calls = [f for kind, f in events if kind == "vision_encode"]
    assert calls[0]["request_ids"] == ["r0", "r1", "r2"] and "error" in calls[0]  # the batched call raised
    assert [(c["request_ids"], "error" in c) for c in calls[1:]] == [(["r0"], False), (["r1"], True),
                                                                     (["r2"], False)]


def test_a_text_path_that_raises_fails_only_its_own_request(tmp_path, monkeypatch):
    """The tick's text embeddings come from one call over the requests' prompts side by side; a call that raises
    is redone one request at a time, so only the request whose own call raises fails (here: the model refuses a
    prompt holding one token id), and the others' embeddings equal those of each encoded alone."""
    import mlx_vlm

    model, processor = mlx_vlm.load(str(build_model("vlm", tmp_path)))
    adapter = _adapter(model, processor)
    prepared = [adapter.prepare(user(text, 0)) for text in ("Hello there.", "Tell me a story, please.", "Why?")]
    alone = [adapter.encode(p) for p in prepared]
    refused = next(t for t in prepared[1].input_ids if t not in prepared[0].input_ids + prepared[2].input_ids)
    original = model.get_input_embeddings

    def refusing(input_ids, pixel_values=None, **kwargs):
        if pixel_values is None and refused in input_ids.tolist()[0]:
            raise ValueError("refused token")
        return original(input_ids, pixel_values, **kwargs)

    monkeypatch.setattr(model, "get_input_embeddings", refusing)
    many = adapter.encode_many([(p, ()) for p in prepared])
    assert isinstance(many[1], ValueError) and "refused token" in str(many[1])
    for got, want in ((many[0], alone[0]), (many[2], alone[2])):
        assert mx.array_equal(got.embeddings, want.embeddings).item()


def test_ernie_tower_keeps_only_the_first_two_images_of_a_call_apart(tmp_path):
    """Why ernie4_5_moe_vl encodes per request with its media keyed whole (``families.py``): mlx-vlm's DFNRope
    attention splits a call's patches at the ends of its first two images only, so every later image attends to
    the ones after it. Four images in one call: the first two (and the last image alone in its part of a
    three-image call) equal their own calls; the third and fourth of four do not. Were they kept apart, the family
    could encode per item and in one call per tick, as the Qwen towers do."""
    import mlx_vlm

    model, processor = mlx_vlm.load(str(build_tiny_vlm("ernie4_5_moe_vl", tmp_path)))
    images = [noise_image(56, 56, 30 + i) for i in range(4)]
    inputs = processor(text=["".join("<|IMAGE_START|><|image@placeholder|><|IMAGE_END|>" for _ in images)],
                       images=images)
    pixels, grids = inputs["pixel_values"], inputs["image_grid_thw"]
    rows = [int(np.prod(np.array(grid))) for grid in grids.tolist()]
    starts = np.cumsum([0] + rows)

    def features(first: int, last: int) -> list[mx.array]:
        """Each image's rows from one call over images first..last-1."""
        grid = grids[first:last]
        out = model.resampler_model(model.vision_tower(pixels[int(starts[first]):int(starts[last])], grid), grid)
        counts = np.cumsum([0] + [n // 4 for n in rows[first:last]])
        return [out[int(counts[i]):int(counts[i + 1])] for i in range(last - first)]

    alone = [features(i, i + 1)[0] for i in range(4)]
    together = features(0, 4)
    differ = [mx.max(mx.abs(got - want)).item() for got, want in zip(together, alone)]
    assert differ[0] < 1e-5 and differ[1] < 1e-5 and differ[2] > 1e-3 and differ[3] > 1e-3, differ
    assert mx.allclose(features(1, 4)[2], alone[3], rtol=1e-5, atol=1e-5).item()  # the third of three: alone
