"""caches/vision.py: content-keyed LRU of vision-encoder outputs under a byte budget, and its use by the Qwen2-VL
adapter (a repeated image skips the vision tower; tokens are the same with a hit as with a miss)."""

import io
import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from PIL import Image  # noqa: E402

from caches.vision import VisionCache, content_key  # noqa: E402

# ------------------------------------------------------------------------------------------ the cache alone


def feats(n: int, value: float = 1.0) -> mx.array:
    """n float32 rows of 8: n * 32 bytes."""
    return mx.full((n, 8), value, dtype=mx.float32)


def recorder():
    events = []
    return events, (lambda kind, key, info: events.append((kind, key, dict(info))))


def test_miss_store_hit_and_stats():
    events, on_event = recorder()
    cache = VisionCache(max_bytes=10_000, on_event=on_event)
    assert cache.get("a") is None
    assert cache.put("a", feats(4), encode_time_s=0.25)
    got = cache.get("a")
    assert mx.array_equal(got, feats(4))
    cache.get("a")
    stats = cache.stats()
    assert stats["hits"] == 2 and stats["misses"] == 1
    assert stats["hit_rate"] == pytest.approx(2 / 3)
    assert stats["entries"] == 1 and stats["bytes"] == 4 * 8 * 4
    assert stats["evictions"] == 0
    assert stats["encoder_time_saved_s"] == pytest.approx(0.5)
    assert [e[0] for e in events] == ["miss", "store", "hit", "hit"]
    assert all(e[1] == "a" for e in events)
    assert events[1][2]["bytes"] == 128 and events[1][2]["encode_time_s"] == 0.25
    assert events[2][2]["encode_time_s"] == 0.25


def test_lru_eviction_under_the_byte_budget():
    events, on_event = recorder()
    cache = VisionCache(max_bytes=3 * 128, on_event=on_event)  # room for three 4-row entries
    for key in "abc":
        cache.put(key, feats(4))
    cache.get("a")  # a is now the most recent; b is the least
    cache.put("d", feats(4))
    assert cache.keys() == ["c", "a", "d"]
    assert ("evict", "b", {"bytes": 128, "reason": "lru", "entries": 2, "total_bytes": 256}) in events
    cache.put("e", feats(8))  # 256 bytes: evicts c and a
    assert cache.keys() == ["d", "e"]
    stats = cache.stats()
    assert stats["evictions"] == 3 and stats["bytes"] == 384 <= cache.max_bytes
    assert "b" not in cache and cache.get("b") is None


def test_entry_larger_than_the_budget_is_not_stored():
    events, on_event = recorder()
    cache = VisionCache(max_bytes=100, on_event=on_event)
    cache.put("small", feats(2))
    assert not cache.put("huge", feats(100))
    assert "huge" not in cache and "small" in cache  # nothing was evicted for it
    assert events[-1][0] == "evict" and events[-1][2]["reason"] == "too_large"
    assert cache.stats()["rejected"] == 1 and cache.stats()["evictions"] == 0


def test_replacing_a_key_keeps_byte_accounting():
    cache = VisionCache(max_bytes=10_000)
    cache.put("a", feats(4))
    cache.put("a", feats(8))
    assert len(cache) == 1 and cache.stats()["bytes"] == 256


def test_clear_and_remove():
    """Both drop entries without counting evictions, and say so in events: whoever follows the cache's keys from
    its stores and evictions (replay) sees them go."""
    events = []
    cache = VisionCache(max_bytes=10_000, on_event=lambda kind, key, info: events.append((kind, key, info.get("reason"))))
    cache.put("a", feats(1))
    cache.put("b", feats(1))
    cache.put("c", feats(1))
    assert cache.remove("a") and not cache.remove("a")
    cache.clear()
    stats = cache.stats()
    assert stats["entries"] == 0 and stats["bytes"] == 0 and stats["stores"] == 3 and stats["evictions"] == 0
    assert [e for e in events if e[0] == "evict"] == [("evict", "a", "removed"), ("evict", "b", "cleared"),
                                                      ("evict", "c", "cleared")]
    cache.reset_stats()
    assert cache.stats()["stores"] == 0


def test_returned_arrays_cannot_corrupt_entries():
    cache = VisionCache(max_bytes=10_000)
    stored = feats(2)
    cache.put("a", stored)
    stored[0] = 99.0  # the caller mutates what it passed in
    got = cache.get("a")
    got[1] = -5.0  # and what it got back
    assert mx.array_equal(cache.get("a"), feats(2))


def test_get_or_encode_times_and_stores_once():
    calls = []

    def encode():
        calls.append(1)
        return feats(3)

    cache = VisionCache(max_bytes=10_000)
    a, hit_a = cache.get_or_encode("k", encode)
    b, hit_b = cache.get_or_encode("k", encode)
    assert (hit_a, hit_b) == (False, True) and len(calls) == 1
    assert mx.array_equal(a, b)
    assert cache.stats()["encoder_time_saved_s"] > 0  # the hit saved the miss's encoding time


def test_a_failing_callback_does_not_break_the_cache():
    def boom(kind, key, info):
        raise RuntimeError("logger down")

    cache = VisionCache(max_bytes=10_000, on_event=boom)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache.put("a", feats(1))
        assert cache.get("a") is not None
    assert caught and "logger down" in str(caught[0].message)


def test_content_key_separates_dtype_shape_and_order():
    a = np.arange(6, dtype=np.float32)
    assert content_key([a]) == content_key([a.copy()]) == content_key([mx.array(a)])
    assert content_key([a]) != content_key([a.reshape(2, 3)])
    assert content_key([a]) != content_key([a.view(np.int32)])
    assert content_key([a, "x"]) != content_key(["x", a])
    assert content_key([b"ab", b"c"]) != content_key([b"a", b"bc"])


def test_bad_budget():
    with pytest.raises(ValueError):
        VisionCache(max_bytes=-1)


# ------------------------------------------------------------------------------------- with the adapter

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def vlm(vlm_model_dir):
    import mlx_vlm

    return mlx_vlm.load(str(vlm_model_dir))


def noise_image(width, height, seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def messages(text):
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


class CountingAdapter:
    """A VLMAdapter whose vision encoder (its own seam, `adapter.media_encoder`) is wrapped to count calls."""

    def __init__(self, vlm, cache):
        from scheduler.models.adapter import VLMAdapter

        self.adapter = VLMAdapter(*vlm, vision_cache=cache)
        self.calls = 0
        inner = self.adapter.media_encoder

        def counted(ids, media, mask):
            self.calls += 1
            return inner(ids, media, mask)

        self.adapter.media_encoder = counted

    def generate(self, prompt, images):
        """Prepare, encode, chunked prefill and a greedy loop: (tokens, encoded)."""
        adapter = self.adapter
        prepared = adapter.prepare(prompt, images)
        encoded = adapter.encode(prepared)
        cache = adapter.make_cache()
        n = encoded.num_tokens - 1
        for start in range(0, n, 7):
            adapter.prefill(cache, encoded, start, min(start + 7, n))
        token, out = prepared.input_ids[-1], []
        eos = set(adapter.model.config.eos_token_id)
        for _ in range(MAX_TOKENS):
            token = int(mx.argmax(adapter.decode(cache, mx.array([token]), mx.array([encoded.rope_delta])),
                                  axis=-1).item())
            out.append(token)
            if token in eos:
                break
        return out, encoded


def solo(vlm, prompt, images):
    import mlx_vlm
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = vlm
    text = apply_chat_template(processor, model.config, prompt, num_images=len(images))
    last = None
    for last in mlx_vlm.stream_generate(model, processor, text, image=images, max_tokens=MAX_TOKENS,
                                        temperature=0.0):
        pass
    return list(last.token_ids)


def test_same_pixels_under_different_file_names_hit_and_skip_the_tower(vlm, tmp_path):
    image = noise_image(112, 140, seed=7)
    first, second = tmp_path / "holiday.png", tmp_path / "copy-of-something-else.png"
    image.save(first)
    image.save(second)
    events = []
    cache = VisionCache(max_bytes=1 << 20, on_event=lambda kind, key, info: events.append(kind))
    runner = CountingAdapter(vlm, cache)
    miss_tokens, miss = runner.generate(messages("what is this?"), [first])
    assert runner.calls == 1 and miss.vision_cache_hit is False and miss.vision_time_s > 0
    hit_tokens, hit = runner.generate(messages("what is this?"), [second])
    assert runner.calls == 1, "the vision tower ran again on a cached image"
    assert hit.vision_cache_hit is True and hit.vision_time_s == 0
    assert hit_tokens == miss_tokens == solo(vlm, messages("what is this?"), [str(first)])
    assert mx.array_equal(hit.embeddings, miss.embeddings)
    assert events == ["miss", "store", "hit"]
    stats = cache.stats()
    assert stats["hits"] == 1 and stats["misses"] == 1 and stats["entries"] == 1
    assert stats["bytes"] == 20 * 128 * 4  # the 20 merged image tokens x hidden 128, float32
    assert stats["encoder_time_saved_s"] == pytest.approx(miss.vision_time_s)


def test_a_hit_under_another_prompt_still_gives_that_prompts_solo_tokens(vlm):
    image = noise_image(84, 112, seed=8)
    runner = CountingAdapter(vlm, VisionCache(max_bytes=1 << 20))
    runner.generate(messages("first question"), [image])
    other = messages("a different, longer question about the picture")
    tokens, encoded = runner.generate(other, [image.copy()])
    assert runner.calls == 1 and encoded.vision_cache_hit
    assert tokens == solo(vlm, other, [image])


def test_different_images_never_share_an_entry(vlm):
    cache = VisionCache(max_bytes=1 << 20)
    runner = CountingAdapter(vlm, cache)
    a = noise_image(56, 56, seed=1)
    b_pixels = np.array(a)
    b_pixels[0, 0, 0] ^= 1  # one bit of one pixel differs
    b = Image.fromarray(b_pixels)
    keys = {runner.adapter.prepare(messages("x"), [img]).media_key for img in (a, b)}
    assert len(keys) == 2
    for img in (a, b, noise_image(140, 84, seed=2)):
        runner.generate(messages("x"), [img])
    assert runner.calls == 3 and cache.stats()["entries"] == 3 and cache.stats()["hits"] == 0
    # image order is part of the key: [a, b] and [b, a] are different requests for the encoder
    two = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "?"}]}]
    ab = runner.adapter.prepare(two, [a, b]).media_key
    ba = runner.adapter.prepare(two, [b, a]).media_key
    assert ab != ba


def test_jpeg_bytes_and_decoded_image_share_a_key(vlm):
    """The key is the decoded, preprocessed content: bytes, a path or the PIL image of the same pixels agree."""
    from scheduler.models.adapter import VLMAdapter
    from scheduler.models.media import load_image

    adapter = VLMAdapter(*vlm)
    buf = io.BytesIO()
    noise_image(112, 140, seed=9).save(buf, format="JPEG")
    decoded = load_image(buf.getvalue(), 0)
    assert adapter.prepare(messages("x"), [buf.getvalue()]).media_key == \
        adapter.prepare(messages("x"), [decoded]).media_key


def test_text_only_requests_do_not_touch_the_cache(vlm):
    cache = VisionCache(max_bytes=1 << 20)
    runner = CountingAdapter(vlm, cache)
    runner.generate([{"role": "user", "content": "hello"}], [])
    assert runner.calls == 0 and cache.stats()["hits"] + cache.stats()["misses"] == 0


def test_budget_eviction_forces_a_re_encode(vlm):
    one_entry = 20 * 128 * 4
    cache = VisionCache(max_bytes=one_entry)  # room for one 112x140 image's features
    runner = CountingAdapter(vlm, cache)
    a, b = noise_image(112, 140, seed=3), noise_image(112, 140, seed=4)
    first, _ = runner.generate(messages("q"), [a])
    runner.generate(messages("q"), [b])  # evicts a
    again, encoded = runner.generate(messages("q"), [a])
    assert runner.calls == 3 and encoded.vision_cache_hit is False
    assert again == first
    assert cache.stats()["evictions"] == 2 and cache.stats()["entries"] == 1


def test_content_key_handles_bfloat16():
    a = mx.arange(6).astype(mx.bfloat16)
    assert content_key([a]) == content_key([mx.array(a)])
    assert content_key([a]) != content_key([a.astype(mx.float16)])


def test_the_key_includes_the_model(vlm, vlm_model_dir):
    """Same pixels through a model with different vision weights must not share an entry."""
    import mlx_vlm

    from scheduler.models.adapter import VLMAdapter

    other_model, other_processor = mlx_vlm.load(str(vlm_model_dir))
    block = other_model.vision_tower.blocks[1].mlp.fc1
    block.weight = block.weight + 1e-3
    image = noise_image(56, 56, seed=5)
    ours = VLMAdapter(*vlm).prepare(messages("x"), [image]).media_key
    again = VLMAdapter(*vlm).prepare(messages("x"), [image]).media_key
    theirs = VLMAdapter(other_model, other_processor).prepare(messages("x"), [image]).media_key
    assert ours == again != theirs
