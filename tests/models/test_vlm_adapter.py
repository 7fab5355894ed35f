"""scheduler/models/adapter.py: the generic adapter on Qwen2-VL gives, solo and batched, exactly the tokens of mlx-vlm run alone; bad
images fail with MediaError naming the image; and the mlx-vlm internals the adapter relies on are pinned here so
an upgrade that moves them fails loudly in this file."""

import dataclasses
import io
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from PIL import Image  # noqa: E402

from caches.layers import PrefillSharing  # noqa: E402
from scheduler.execution import library  # noqa: E402
from scheduler.models.adapter import EncodedRequest, MediaError, PreparedRequest, VLMAdapter, adapter_for  # noqa: E402

MAX_TOKENS = 12
CHUNK = 7
IMAGE_SIZES = [(112, 140), (56, 56), (84, 112), (140, 84)]  # (width, height)
TEXTS = [
    "Hi.",
    "What does the cat see today?",
    "The old man reads many books in the morning, and the teacher brings a warm coat.",
    "Why does the river see the green door? The machine loads a new token; then the farmer keeps it "
    "with care before lunch, and every child counts three apples near the house.",
]


# ---------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def vlm(vlm_model_dir):
    import mlx_vlm

    return mlx_vlm.load(str(vlm_model_dir))


@pytest.fixture(scope="module")
def adapter(vlm):
    return VLMAdapter(*vlm)


def noise_image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def image_messages(text: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


def text_messages(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def eos_ids(model) -> set[int]:
    eos = model.config.eos_token_id
    return set(eos) if isinstance(eos, (list, tuple)) else {eos}


def solo(vlm, messages, images) -> list[int]:
    """Ground truth: the request alone through mlx_vlm.stream_generate (ids of the final result; an eos that
    stopped it is included)."""
    import mlx_vlm
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = vlm
    prompt = apply_chat_template(processor, model.config, messages, num_images=len(images))
    last = None
    for last in mlx_vlm.stream_generate(model, processor, prompt, image=list(images) or None,
                                        max_tokens=MAX_TOKENS, temperature=0.0):
        pass
    return list(last.token_ids)


def prefilled(adapter, messages, images, chunk=CHUNK):
    """Prepare, encode and prefill everything but the last prompt token, in chunks of `chunk` tokens."""
    prepared = adapter.prepare(messages, images)
    encoded = adapter.encode(prepared)
    cache = adapter.make_cache()
    n = encoded.num_tokens - 1
    for start in range(0, n, chunk):
        adapter.prefill(cache, encoded, start, min(start + chunk, n))
    return prepared, encoded, cache


def greedy_solo(adapter, messages, images, deltas=None) -> list[int]:
    """The adapter alone: chunked prefill then a greedy loop of one-row decode steps."""
    prepared, encoded, cache = prefilled(adapter, messages, images)
    delta = encoded.rope_delta if deltas is None else deltas
    token, out, eos = prepared.input_ids[-1], [], eos_ids(adapter.model)
    for _ in range(MAX_TOKENS):
        logits = adapter.decode(cache, mx.array([token]), mx.array([delta]))
        token = int(mx.argmax(logits, axis=-1).item())
        out.append(token)
        if token in eos:
            break
    return out


REQUESTS = (
    [(image_messages(f"Describe picture {i}: {TEXTS[i % 2]}"), [noise_image(w, h, seed=i)])
     for i, (w, h) in enumerate(IMAGE_SIZES)]
    + [(text_messages(t), []) for t in TEXTS]
)


@pytest.fixture(scope="module")
def references(vlm):
    return [solo(vlm, messages, images) for messages, images in REQUESTS]


# ---------------------------------------------------------------------------------------------- solo


@pytest.mark.parametrize("which", [0, 4], ids=["image", "text-only"])
def test_solo_chunked_prefill_and_decode_equal_mlx_vlm(adapter, references, which):
    messages, images = REQUESTS[which]
    assert greedy_solo(adapter, messages, images) == references[which]


def test_two_images_in_one_request(vlm, adapter):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                             {"type": "image"}, {"type": "text", "text": "compare them"}]}]
    images = [noise_image(84, 112, seed=10), noise_image(140, 84, seed=11)]
    prepared = adapter.prepare(messages, images)
    assert prepared.num_images == 2 and prepared.num_media_tokens == 12 + 15
    assert greedy_solo(adapter, messages, images) == solo(vlm, messages, images)


def test_prepared_request_shapes(adapter):
    prepared = adapter.prepare(*REQUESTS[0])
    assert isinstance(prepared, PreparedRequest)
    assert prepared.num_media_tokens == 20  # 112x140 -> grid (1, 10, 8) -> 20 merged tokens
    assert prepared.input_ids.count(adapter.model.config.image_token_id) == 20
    assert prepared.image_grid_thw.tolist() == [[1, 10, 8]]
    assert prepared.media_key is not None and prepared.mask is not None
    text = adapter.prepare(*REQUESTS[4])
    assert text.pixel_values is None and text.media_key is None and text.num_media_tokens == 0
    encoded = adapter.encode(prepared)
    assert isinstance(encoded, EncodedRequest)
    length = len(prepared.input_ids)
    assert encoded.embeddings.shape == (1, length, 128)
    assert encoded.position_ids.shape == (3, 1, length)
    # text before the image is n0 tokens, the 5x4 image grid spans positions n0..n0+4, the rest follows: the
    # delta is 5 - 20 = -15 whatever the text lengths.
    assert encoded.rope_delta == -15
    assert adapter.encode(text).rope_delta == 0


def test_str_prompt_is_taken_as_templated(vlm, adapter):
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = vlm
    messages, images = REQUESTS[1]
    templated = apply_chat_template(processor, model.config, messages, num_images=1)
    assert adapter.prepare(templated, images).input_ids == adapter.prepare(messages, images).input_ids


def test_image_inputs_as_path_bytes_and_pil_agree(adapter, tmp_path):
    image = noise_image(84, 112, seed=3)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    path = tmp_path / "a.png"
    path.write_bytes(buf.getvalue())
    messages = image_messages("what is it?")
    keys = {adapter.prepare(messages, [src]).media_key for src in (image, buf.getvalue(), path, str(path))}
    assert len(keys) == 1


# ---------------------------------------------------------------------------------------------- batched


def run_batch(adapter, requests, join_at=None, stop_after=None, deltas_override=None):
    """Drive a continuous batch through the adapter: each request is prefilled into its own cache, joins the
    batch cache at step `join_at[i]` (merge + extend_batch), is fed its last prompt token as first input, and
    leaves (filter_batch) after eos, MAX_TOKENS or `stop_after[i]` tokens. One batched forward per step."""
    n = len(requests)
    join_at = join_at or [0] * n
    stop_after = stop_after or {}
    eos = eos_ids(adapter.model)
    staged = []
    for messages, images in requests:
        prepared, encoded, cache = prefilled(adapter, messages, images)
        staged.append((prepared, encoded, cache))
    outputs: list[list[int]] = [[] for _ in range(n)]
    batch: list = []
    rows: list[int] = []  # request index of each batch row
    inputs = deltas = None
    step = 0
    while step <= max(join_at) or rows:
        joining = [i for i in range(n) if join_at[i] == step]
        if joining:
            merged = library.merge_caches([staged[i][2] for i in joining])
            batch = library.extend_batch(batch, merged)
            new_inputs = mx.array([staged[i][0].input_ids[-1] for i in joining], dtype=mx.uint32)
            new_deltas = mx.array([staged[i][1].rope_delta if deltas_override is None else deltas_override
                                   for i in joining], dtype=mx.int32)
            inputs = new_inputs if inputs is None else mx.concatenate([inputs, new_inputs])
            deltas = new_deltas if deltas is None else mx.concatenate([deltas, new_deltas])
            rows += joining
        if rows:
            logits = adapter.decode(batch, inputs, deltas)
            inputs = mx.argmax(logits, axis=-1).astype(mx.uint32)
            keep = []
            for row, (i, token) in enumerate(zip(rows, inputs.tolist())):
                outputs[i].append(token)
                done = token in eos or len(outputs[i]) >= stop_after.get(i, MAX_TOKENS)
                if not done:
                    keep.append(row)
            if len(keep) < len(rows):
                batch = library.filter_batch(batch, keep)
                rows = [rows[r] for r in keep]
                if keep:
                    idx = mx.array(keep)
                    inputs, deltas = inputs[idx], deltas[idx]
                else:
                    inputs = deltas = None
        step += 1
    return outputs


def test_batched_decode_equals_each_request_alone(adapter, references):
    assert len({e for e in (adapter.encode(adapter.prepare(*r)).rope_delta for r in REQUESTS[:4])}) == 4
    outputs = run_batch(adapter, REQUESTS)
    for i, (got, want) in enumerate(zip(outputs, references)):
        assert got == want, f"request {i}: batched {got} != solo {want}"


def test_batched_staggered_joins_and_an_early_leave(adapter, references):
    join_at = [0, 2, 0, 5, 1, 3, 3, 0]
    stop_after = {2: 4}  # request 2 leaves after 4 tokens while the others run on
    outputs = run_batch(adapter, REQUESTS, join_at=join_at, stop_after=stop_after)
    for i, (got, want) in enumerate(zip(outputs, references)):
        want = want[: stop_after.get(i, MAX_TOKENS)]
        assert got == want, f"request {i}: batched {got} != solo {want}"


def test_per_row_positions_matter(adapter, references):
    """The check above has teeth: giving image rows the text-only delta (what a shared delta would do) changes
    their tokens."""
    outputs = run_batch(adapter, REQUESTS[:4], deltas_override=0)
    assert any(got != want for got, want in zip(outputs, references[:4]))


# ------------------------------------------------------------------------------------------ bad images


def _png_bytes(image):
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _jpeg_bytes(image):
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _empty_file(path):
    path.write_bytes(b"")
    return path


def _two_image_messages():
    return [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "hm"}]}]


@pytest.mark.parametrize("kind", ["truncated-jpeg", "truncated-png", "garbage-bytes", "empty-bytes", "missing-file",
                                  "empty-file", "directory", "zero-size", "int", "none", "url", "aspect-ratio"])
def test_bad_image_raises_media_error_naming_it(adapter, tmp_path, kind):
    good = noise_image(56, 56, seed=0)
    big = noise_image(112, 140, seed=1)
    bad = {
        "truncated-jpeg": lambda: _jpeg_bytes(big)[: len(_jpeg_bytes(big)) // 2],
        "truncated-png": lambda: _png_bytes(big)[: len(_png_bytes(big)) // 2],
        "garbage-bytes": lambda: b"definitely not an image" * 10,
        "empty-bytes": lambda: b"",
        "missing-file": lambda: tmp_path / "nope.png",
        "empty-file": lambda: _empty_file(tmp_path / "empty.png"),
        "directory": lambda: tmp_path,
        "zero-size": lambda: Image.new("RGB", (0, 0)),
        "int": lambda: 42,
        "none": lambda: None,
        "url": lambda: "https://example.com/cat.png",
        "aspect-ratio": lambda: noise_image(3000, 14, seed=2),  # > 200:1, refused by the Qwen image processor
    }[kind]()
    with pytest.raises(MediaError) as info:
        adapter.prepare(_two_image_messages(), [good, bad])
    assert info.value.index == 1
    assert str(info.value).startswith("image 1:")
    assert isinstance(info.value, ValueError)


def test_truncated_file_on_disk(adapter, tmp_path):
    path = tmp_path / "cut.jpg"
    data = _jpeg_bytes(noise_image(112, 140, seed=5))
    path.write_bytes(data[: len(data) - 200])
    with pytest.raises(MediaError, match="image 0:"):
        adapter.prepare(image_messages("x"), [path])


def test_image_count_must_match_placeholders(adapter):
    with pytest.raises(ValueError, match="placeholder"):
        adapter.prepare("<|im_start|>user\nno image here<|im_end|>\n<|im_start|>assistant\n", [noise_image(56, 56, 0)])


def test_prompt_ending_in_image_token_is_refused(adapter):
    with pytest.raises(ValueError, match="must not end"):
        adapter.prepare("look <|vision_start|><|image_pad|>", [noise_image(56, 56, 0)])


def test_video_tokens_are_refused(adapter):
    with pytest.raises(ValueError, match="video"):
        adapter.prepare("<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>hi<|im_end|>\n", [])


def test_model_facts(vlm, adapter):
    model, processor = vlm
    assert adapter.vocab_size == 512 and adapter.max_positions == 4096
    # pinned: what mlx_vlm.stream_generate stops on
    assert adapter.eos_token_ids == frozenset(processor.tokenizer.stopping_criteria.eos_token_ids) == {0, 2}


def test_adapter_for_refuses_other_families(vlm, text_model):
    assert isinstance(adapter_for(*vlm), VLMAdapter)
    with pytest.raises(TypeError):
        adapter_for(*text_model)


# ------------------------------------------------------------- pinned mlx-vlm internals (fail loudly here)


def test_pin_prepare_inputs_keys_and_expansion(vlm, adapter):
    from scheduler.models import library

    model, processor = vlm
    prompt = adapter.prepare(*REQUESTS[0]).prompt
    inputs = library.prepare_inputs(model, processor, prompt, [noise_image(112, 140, seed=0)])
    assert {"input_ids", "pixel_values", "image_grid_thw", "attention_mask"} <= set(inputs)
    assert inputs["input_ids"].shape[0] == 1
    assert inputs["input_ids"][0].tolist().count(model.config.image_token_id) == 20
    assert inputs["pixel_values"].shape == (80, 3 * 2 * 14 * 14)


def test_pin_input_embeddings_and_the_cached_rows_path(vlm):
    """library.input_embeddings is mlx-vlm's own get_input_embeddings (the encoder + merge of a solo run); a
    vision-cache hit rebuilds the same embeddings from the text path and the cached media rows."""
    from caches.vision import VisionCache
    from scheduler.models import library

    model, processor = vlm
    adapter = VLMAdapter(model, processor, vision_cache=VisionCache(1 << 20))
    prepared = adapter.prepare(*REQUESTS[0])
    ids = mx.array(prepared.input_ids)[None]
    plain = model.get_input_embeddings(ids, prepared.pixel_values, image_grid_thw=prepared.image_grid_thw,
                                       mask=prepared.mask)
    ours = library.input_embeddings(model, ids, prepared.media_inputs, prepared.mask)
    assert mx.array_equal(plain.inputs_embeds, ours.inputs_embeds)
    miss = adapter.encode(prepared)
    hit = adapter.encode(adapter.prepare(*REQUESTS[0]))
    assert miss.vision_cache_hit is False and hit.vision_cache_hit is True
    assert mx.array_equal(miss.embeddings, plain.inputs_embeds) and mx.array_equal(hit.embeddings, miss.embeddings)
    assert mx.array_equal(hit.position_ids, plain.position_ids)
    assert miss.rope_delta == int(plain.rope_deltas.reshape(-1)[0].item())


def test_pin_language_model_state_is_neither_read_nor_written(vlm, adapter):
    """Qwen2-VL keeps `_position_ids` / `_rope_deltas` on the instance; encode, prefill and decode must ignore
    whatever is there and leave it alone."""
    lm = adapter.language_model
    assert hasattr(lm, "_position_ids") and hasattr(lm, "_rope_deltas")

    def first_logits():
        prepared, encoded, cache = prefilled(adapter, *REQUESTS[0])
        return adapter.decode(cache, mx.array([prepared.input_ids[-1]]), mx.array([encoded.rope_delta]))

    saved = (lm._position_ids, lm._rope_deltas)
    try:
        junk = (mx.full((3, 1, 500), 1234, dtype=mx.int32), mx.array([[777]]))
        lm._position_ids, lm._rope_deltas = junk
        with_junk = first_logits()
        assert lm._position_ids is junk[0] and lm._rope_deltas is junk[1]
        lm._position_ids, lm._rope_deltas = None, None
        without = first_logits()
        assert lm._position_ids is None and lm._rope_deltas is None
    finally:
        lm._position_ids, lm._rope_deltas = saved
    assert mx.array_equal(with_junk, without)


def test_pin_caches_merge_into_batch_with_per_row_offsets(adapter):
    from mlx_vlm.models.cache import BatchKVCache, KVCache

    encoded = adapter.encode(adapter.prepare(*REQUESTS[4]))
    caches = []
    for n in (3, 5):
        cache = adapter.make_cache()
        assert all(type(c) is KVCache for c in cache)
        adapter.prefill(cache, encoded, 0, n)
        caches.append(cache)
    batch = library.merge_caches(caches)
    assert all(type(layer) is BatchKVCache for layer in batch)
    assert batch[0].offset.tolist() == [3, 5] and batch[0].left_padding.tolist() == [2, 0]
    assert adapter.decode_positions(batch, mx.array([10, -4])).tolist() == [[[13], [1]]] * 3
    adapter.decode(batch, mx.array([7, 8]), mx.array([0, 0]))
    assert batch[0].offset.tolist() == [4, 6]


def test_pin_mlx_vlm_quantized_kv_schedule(vlm, adapter):
    """kv_bits on a VLM follows mlx-vlm's generate_step: the uniform scheme by default, its quantized-KV check
    after each prefill step of its default prefill_step_size, chunked prefill on for this model (no policy turns
    it off), and each plain KV layer converted by its own ``to_quantized``. A model whose chunked-prefill policy
    turns chunking off is refused: mlx-vlm would prefill it in one piece and check elsewhere."""
    import inspect

    from mlx_vlm.generate import generate_step
    from mlx_vlm.models.cache import KVCache, QuantizedKVCache

    from caches.layers import QuantizationRefused
    from scheduler.models import library as vlm_library

    model, _ = vlm
    parameters = inspect.signature(generate_step).parameters
    assert {"kv_bits", "kv_group_size", "quantized_kv_start", "kv_quant_scheme"} <= set(parameters)
    assert vlm_library.quantized_kv_schedule(model) == parameters["prefill_step_size"].default == 2048
    rule = adapter.quantize_rule(4, 32, 24)
    assert (rule.bits, rule.group_size, rule.start, rule.prefill_step) == (4, 32, 24, 2048)
    cache = adapter.make_cache()
    assert all(type(c) is KVCache for c in cache)
    assert isinstance(cache[0].to_quantized(group_size=32, bits=4), QuantizedKVCache)

    class OnePiece:  # what mlx-vlm's florence2 / falcon_ocr declare
        no_chunked_prefill = True

    with pytest.raises(QuantizationRefused, match="in one piece"):
        vlm_library.quantized_kv_schedule(OnePiece())


def _layer_arrays(cache):
    return [(layer.keys[..., :layer.offset, :], layer.values[..., :layer.offset, :]) for layer in cache]


def test_prefill_many_equals_each_chunk_alone(adapter):
    """Fresh image and text chunks and a later chunk of different widths in one forward: each request's cache
    holds exactly its own positions (pads cut) and what its own forward computes (to BLAS rounding: the
    matrices have other shapes)."""
    encoded = [adapter.encode(adapter.prepare(*REQUESTS[i])) for i in (0, 5, 2)]
    later = adapter.make_cache()
    adapter.prefill(later, encoded[1], 0, 5)
    rows = [(None, encoded[0], 0, 20), (later, encoded[1], 5, 18), (None, encoded[2], 0, 13)]
    assert adapter.prefill_sharing is PrefillSharing.ANY
    got, logits = adapter.prefill_many(rows)
    assert logits.shape[:2] == (3, 20)
    for (cache, enc, start, n), batched in zip(rows, got):
        alone = adapter.make_cache()
        adapter.prefill(alone, enc, 0, start + n)
        assert [layer.offset for layer in batched] == [start + n] * len(alone)
        for (k, v), (k0, v0) in zip(_layer_arrays(batched), _layer_arrays(alone)):
            assert k.shape == k0.shape and v.shape == v0.shape
            assert mx.allclose(k, k0, atol=1e-5).item() and mx.allclose(v, v0, atol=1e-5).item()


def test_chunks_with_per_chunk_media_rows_share_a_forward(tmp_path):
    """Qwen3-VL's language model reads media rows per chunk: a (B, L) media mask and deepstack rows it adds at
    each row's masked positions in order (`_deepstack_process`). Chunks that cut through images at different
    points, a later chunk and a text chunk share one forward (each row's mask slice, pads unmasked, the rows'
    media rows concatenated in row order), and each request gets the cache and logits of its own forward, to
    float rounding (other matrix shapes)."""
    import mlx_vlm

    from scheduler.fixtures.vlm_families import build_tiny_vlm

    from ..helpers import prefill_many_against_alone

    model, processor = mlx_vlm.load(str(build_tiny_vlm("qwen3_vl", tmp_path / "qwen3_vl")))
    qwen3 = VLMAdapter(model, processor)
    assert qwen3.spec.media_mask_input and qwen3.spec.media_row_inputs
    encoded = [qwen3.encode(qwen3.prepare(*REQUESTS[i])) for i in (0, 1, 5)]
    media = [np.flatnonzero(np.array(e.media_mask[0])) for e in encoded[:2]]
    assert all(len(m) for m in media)
    # request 0: [0, its 3rd media position) (a chunk ending inside its image); request 1: after 2 of its media
    # positions, 11 more (starting inside its image); request 5: text only
    cut0, cut1 = int(media[0][2]), int(media[1][2])
    later = qwen3.make_cache()
    qwen3.prefill(later, encoded[1], 0, cut1)
    rows = [(None, encoded[0], 0, cut0), (later, encoded[1], cut1, 11), (None, encoded[2], 0, 9)]
    pairs = prefill_many_against_alone(qwen3, rows)
    for i, ((_, _, start, n), (batched, alone)) in enumerate(zip(rows, pairs)):
        assert [layer.offset for layer in batched] == [start + n] * len(alone)
        for (k, v), (k0, v0) in zip(_layer_arrays(batched), _layer_arrays(alone)):
            assert mx.allclose(k, k0, atol=1e-5).item() and mx.allclose(v, v0, atol=1e-5).item(), i
    # the deepstack rows count: without them the image rows' logits differ (so the check above has teeth)
    bare = dataclasses.replace(encoded[0], media_rows={})
    without, _ = qwen3.prefill_many([(None, bare, 0, cut0), (None, encoded[2], 0, 9)])
    keys = _layer_arrays(without[0])[-1][0]
    assert not mx.allclose(keys, _layer_arrays(pairs[0][0])[-1][0], atol=1e-3).item()


def test_prefill_checks_the_range_and_the_cache(adapter):
    encoded = adapter.encode(adapter.prepare(*REQUESTS[5]))
    cache = adapter.make_cache()
    with pytest.raises(ValueError, match="holds 0"):
        adapter.prefill(cache, encoded, 3, 5)
    with pytest.raises(ValueError, match="bad prefill range"):
        adapter.prefill(cache, encoded, 0, encoded.num_tokens + 1)
