"""Video inputs for the Qwen2-VL family: frame selection (scheduler/models/media.py) honours fps by timestamp and the
max_frames cap on a synthetic OpenCV video whose frames say which frame they are; a video request prefilled and
decoded through the adapter, batched with image and text requests, gives exactly the tokens of
mlx_vlm.stream_generate run alone with the same frames; a repeated video hits the vision cache; bad videos
fail with MediaError naming the video."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import math  # noqa: E402
import time  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from PIL import Image  # noqa: E402

from caches.vision import VisionCache  # noqa: E402
from scheduler.execution import library  # noqa: E402
from scheduler.models.media import load_video, sample_frame_indices, validate_video_sampling  # noqa: E402
from scheduler.models.adapter import MediaError, VLMAdapter  # noqa: E402

import cv2  # noqa: E402  (a declared dependency: a broken install fails here, it does not skip)

MAX_TOKENS = 12
CHUNK = 7
SOURCE_FPS, SECONDS, WIDTH, HEIGHT = 30, 3, 64, 48
NUM_FRAMES = SOURCE_FPS * SECONDS


# ------------------------------------------------------------------------------------- synthetic video


def frame_colour(i: int) -> tuple[int, int, int]:
    """RGB of source frame i: red is its tens digit, green its units, 25 / 22 levels apart, so lossy codecs
    (MJPG, mp4v) cannot confuse two frames."""
    return (20 + 25 * (i // 10), 20 + 22 * (i % 10), 128)


def frame_number(frame: np.ndarray) -> int:
    """Which source frame a decoded RGB frame is (from its mean colour)."""
    red, green = (float(frame[..., c].mean()) for c in (0, 1))
    return 10 * int(round((red - 20) / 25)) + int(round((green - 20) / 22))


def write_video(path, n=NUM_FRAMES, fps=SOURCE_FPS, size=(WIDTH, HEIGHT), fourcc="MJPG", colour=frame_colour):
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*fourcc), float(fps), size)
    assert writer.isOpened(), f"OpenCV cannot write {fourcc}"
    for i in range(n):
        rgb = np.zeros((size[1], size[0], 3), np.uint8)
        rgb[...] = colour(i)
        writer.write(cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
    writer.release()
    return path


@pytest.fixture(scope="module")
def video_path(tmp_path_factory):
    return write_video(tmp_path_factory.mktemp("video") / "count.avi")


def noise_frames(n, width=56, height=56, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (height, width, 3), dtype=np.uint8) for _ in range(n)]


def noise_image(width, height, seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


# ------------------------------------------------------------------------------------------ frame selection


@pytest.mark.parametrize("total, source, fps, cap, want", [
    (90, 30, 2, 32, [0, 15, 30, 45, 60, 75]),  # by timestamp: t = 0, 0.5, ... 2.5 s
    (90, 30, 1, 32, [0, 30, 60]),
    (90, 30, 0.5, 32, [0, 60]),
    (90, 30, 2, 6, [0, 15, 30, 45, 60, 75]),  # the cap does not bind at exactly 6
    (90, 30, 2, 4, [0, 22, 45, 67]),  # cap binds: 4 frames spread over the whole clip
    (90, 30, 2, 1, [0]),
    (90, 30, 60, 1000, list(range(90))),  # above the source rate: every frame once, never twice
    (90, 30, 60, 3, [0, 30, 60]),
    (5, 30, 2, 32, [0]),  # shorter than one sample period
    (100, 25, 3, 32, [0, 8, 16, 25, 33, 41, 50, 58, 66, 75, 83, 91]),  # floor(k * 25 / 3)
])
def test_sample_frame_indices(total, source, fps, cap, want):
    assert sample_frame_indices(total, source, fps, cap) == want


@pytest.mark.parametrize("fps", [0, -1, float("nan"), float("inf"), True, "2", None])
def test_bad_fps_is_refused(fps):
    with pytest.raises(ValueError, match="fps"):
        validate_video_sampling(fps, 8)


@pytest.mark.parametrize("cap", [0, -3, 1.5, True, "8", None])
def test_bad_max_frames_is_refused(cap):
    with pytest.raises(ValueError, match="max_frames"):
        validate_video_sampling(2.0, cap)


@pytest.mark.parametrize("fps, cap, want", [
    (2.0, 32, [0, 15, 30, 45, 60, 75]),
    (1.0, 32, [0, 30, 60]),
    (2.0, 4, [0, 22, 45, 67]),
    (10.0, 3, [0, 30, 60]),
])
def test_decoded_frames_are_the_selected_ones(video_path, fps, cap, want):
    clip = load_video(video_path, 0, fps, cap)
    assert list(clip.indices) == want and clip.total_frames == NUM_FRAMES and clip.source_fps == SOURCE_FPS
    assert [frame_number(f) for f in clip.frames] == want  # the pixels really are those frames
    assert all(f.shape == (HEIGHT, WIDTH, 3) and f.dtype == np.uint8 for f in clip.frames)
    assert clip.timestamps == [i / SOURCE_FPS for i in want]


def test_bytes_path_and_mp4_decode_alike(video_path, tmp_path):
    by_path = load_video(video_path, 0, 2.0, 32)
    by_bytes = load_video(video_path.read_bytes(), 0, 2.0, 32)
    by_str = load_video(str(video_path), 0, 2.0, 32)
    assert by_bytes.indices == by_path.indices == by_str.indices
    assert all(np.array_equal(a, b) for a, b in zip(by_path.frames, by_bytes.frames))
    try:
        mp4 = write_video(tmp_path / "count.mp4", fourcc="mp4v")
    except AssertionError:
        pytest.skip("no mp4v writer in this OpenCV build")
    clip = load_video(mp4, 0, 2.0, 32)
    assert [frame_number(f) for f in clip.frames] == list(clip.indices) == [0, 15, 30, 45, 60, 75]


def test_frame_lists_are_taken_as_selected_and_thinned_to_the_cap():
    frames = noise_frames(10)
    clip = load_video(frames, 0, fps=0.001, max_frames=32)  # fps does not apply to frames without timestamps
    assert clip.indices == tuple(range(10)) and clip.source_fps is None
    thinned = load_video([Image.fromarray(f) for f in frames], 0, fps=2.0, max_frames=4)
    assert thinned.indices == (0, 2, 5, 7)
    assert all(np.array_equal(a, frames[i]) for a, i in zip(thinned.frames, thinned.indices))
    stacked = load_video(np.stack(frames), 0, 2.0, 32)
    assert all(np.array_equal(a, b) for a, b in zip(stacked.frames, frames))
    gray_rgba = load_video([frames[0][..., 0], np.dstack([frames[1], frames[1][..., :1]])], 0, 2.0, 32)
    assert gray_rgba.frames[0].shape == (56, 56, 3) and np.array_equal(gray_rgba.frames[1], frames[1])


def test_frame_list_is_copied():
    frames = noise_frames(2)
    clip = load_video(frames, 0, 2.0, 8)
    frames[0][...] = 0
    assert clip.frames[0].any()


# --------------------------------------------------------------------------------------------- adapter


@pytest.fixture(scope="module")
def vlm(vlm_model_dir):
    import mlx_vlm

    return mlx_vlm.load(str(vlm_model_dir))


@pytest.fixture(scope="module")
def adapter(vlm):
    return VLMAdapter(*vlm)


def video_messages(text, n=1):
    return [{"role": "user", "content": [{"type": "video"}] * n + [{"type": "text", "text": text}]}]


def image_messages(text):
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


def text_messages(text):
    return [{"role": "user", "content": text}]


def eos_ids(model):
    eos = model.config.eos_token_id
    return set(eos) if isinstance(eos, (list, tuple)) else {eos}


def solo(vlm, prompt, images=(), videos=()):
    """Ground truth: mlx_vlm.stream_generate alone. Videos go in as the frames we selected (a list of PIL
    images per video): mlx-vlm's prepare_inputs samples only video *files* (with its own rule: linspace over
    the clip, frame count rounded to 2, min_frames 4), and hands frame lists to the processor unchanged."""
    import mlx_vlm

    model, processor = vlm
    video = [[Image.fromarray(f) for f in clip] for clip in videos] or None
    last = None
    for last in mlx_vlm.stream_generate(model, processor, prompt, image=list(images) or None, video=video,
                                        max_tokens=MAX_TOKENS, temperature=0.0):
        pass
    return list(last.token_ids)


def prefill(adapter, prepared, chunk=CHUNK):
    encoded = adapter.encode(prepared)
    cache = adapter.make_cache()
    last = len(prepared.input_ids) - 1
    for start in range(0, last, chunk):
        adapter.prefill(cache, encoded, start, min(start + chunk, last))
    return encoded, cache


def run_batch(adapter, prepared_list, join_at=None, deltas_override=None):
    """Continuous batch over already-prepared requests: own-cache chunked prefill, merge into the batch cache at
    step join_at[i], one batched decode forward per step, rows leave after eos or MAX_TOKENS."""
    n = len(prepared_list)
    join_at = join_at or [0] * n
    eos = eos_ids(adapter.model)
    staged = [(p, *prefill(adapter, p)) for p in prepared_list]
    outputs = [[] for _ in range(n)]
    batch, rows, inputs, deltas, step = [], [], None, None, 0
    while step <= max(join_at) or rows:
        joining = [i for i in range(n) if join_at[i] == step]
        if joining:
            batch = library.extend_batch(batch, library.merge_caches([staged[i][2] for i in joining]))
            new_in = mx.array([staged[i][0].input_ids[-1] for i in joining], dtype=mx.uint32)
            new_d = mx.array([staged[i][1].rope_delta if deltas_override is None else deltas_override
                              for i in joining], dtype=mx.int32)
            inputs = new_in if inputs is None else mx.concatenate([inputs, new_in])
            deltas = new_d if deltas is None else mx.concatenate([deltas, new_d])
            rows += joining
        if rows:
            inputs = mx.argmax(adapter.decode(batch, inputs, deltas), axis=-1).astype(mx.uint32)
            keep = []
            for row, (i, token) in enumerate(zip(rows, inputs.tolist())):
                outputs[i].append(token)
                if token not in eos and len(outputs[i]) < MAX_TOKENS:
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


@pytest.fixture(scope="module")
def mixed(vlm, adapter, video_path):
    """A file video (6 frames at 2 fps), an odd-length frame-list video (5 frames: padded to 6 by the
    processor), two videos in one request, an image request and a text request; each with its solo reference."""
    specs = [
        (video_messages("What happens in the video?"), dict(videos=[video_path], fps=2.0)),
        (video_messages("Describe it"), dict(videos=[noise_frames(5, 84, 56, seed=1)])),
        (video_messages("Compare the two clips", n=2), dict(videos=[video_path, noise_frames(4, seed=2)], fps=1.0)),
        (image_messages("Describe picture 0"), dict(images=[noise_image(112, 140, seed=0)])),
        (text_messages("What does the cat see today?"), dict()),
    ]
    prepared = [adapter.prepare(messages, **kw) for messages, kw in specs]
    references = []
    for p, (messages, kw) in zip(prepared, specs):
        clips = [load_video(v, i, kw.get("fps", adapter.video_fps), adapter.video_max_frames).frames
                 for i, v in enumerate(kw.get("videos", []))]
        references.append(solo(vlm, p.prompt, kw.get("images", ()), clips))
    return prepared, references


def test_video_prepare_shapes(adapter, mixed, video_path):
    prepared, _ = mixed
    video = prepared[0]
    assert video.num_videos == 1 and video.num_images == 0 and video.pixel_values is None
    assert video.video_frame_indices == ((0, 15, 30, 45, 60, 75),)
    # 6 frames of 64x48 -> resized to 56x56 -> grid (t=3, 4, 4) -> 3 * 16 / 4 = 12 video tokens
    assert video.media_inputs["video_grid_thw"].tolist() == [[3, 4, 4]]
    assert video.num_media_tokens == 12 == video.input_ids.count(adapter.model.config.video_token_id)
    assert video.media_inputs["pixel_values_videos"].shape == (3 * 4 * 4, 3 * 2 * 14 * 14)
    assert video.num_media_items == 3  # one vision-budget unit per temporal patch
    assert prepared[1].media_inputs["video_grid_thw"].tolist()[0][0] == 3  # 5 frames padded to 6
    assert prepared[2].num_videos == 2 and prepared[2].video_frame_indices[0] == (0, 30, 60)
    assert prepared[2].num_media_items == 2 + 2
    assert prepared[3].num_media_items == 1 and prepared[4].num_media_items == 0
    assert prepared[4].media_key is None
    encoded = adapter.encode(video)
    assert encoded.position_ids.shape == (3, 1, len(video.input_ids))
    # the 12 video tokens span t in [0, 3) and merged h, w in [0, 2): the text after them continues from
    # n0 + 3, so the delta is 3 - 12 whatever the text lengths
    assert encoded.rope_delta == 3 - 12


def test_solo_video_equals_mlx_vlm(adapter, mixed):
    prepared, references = mixed
    for i in range(3):
        assert run_batch(adapter, [prepared[i]])[0] == references[i], f"video request {i}"


def test_batched_video_image_text_equal_each_alone(adapter, mixed):
    prepared, references = mixed
    assert len({adapter.encode(p).rope_delta for p in prepared}) >= 4  # rows with different deltas
    for join_at in ([0, 0, 0, 0, 0], [0, 2, 1, 4, 0]):
        outputs = run_batch(adapter, prepared, join_at=join_at)
        for i, (got, want) in enumerate(zip(outputs, references)):
            assert got == want, f"request {i} (joins at {join_at[i]}): batched {got} != solo {want}"


def test_video_rows_need_their_own_positions(adapter, mixed):
    prepared, references = mixed
    outputs = run_batch(adapter, prepared[:3], deltas_override=0)
    assert any(got != want for got, want in zip(outputs, references[:3]))


def test_the_video_content_matters(adapter, mixed, tmp_path):
    prepared, references = mixed
    other = write_video(tmp_path / "other.avi", colour=lambda i: (200 - 2 * i, 30, 40 + 2 * i))
    p = adapter.prepare(video_messages("What happens in the video?"), videos=[other], fps=2.0)
    assert p.input_ids == prepared[0].input_ids and p.media_key != prepared[0].media_key
    assert run_batch(adapter, [p])[0] != references[0]


def test_templated_string_and_messages_agree(vlm, adapter, video_path):
    _, processor = vlm
    messages = [{"role": "system", "content": "Be brief."}] + video_messages("what now?")
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    a = adapter.prepare(messages, videos=[video_path])
    assert a.prompt == text and text.count("<|video_pad|>") == 1  # the system turn holds no video
    assert adapter.prepare(text, videos=[video_path]).input_ids == a.input_ids


# ------------------------------------------------------------------------------------------- vision cache


class Counting:
    def __init__(self, adapter):
        self.calls = 0
        inner = adapter.media_encoder

        def counted(ids, media, mask):
            self.calls += 1
            return inner(ids, media, mask)

        adapter.media_encoder = counted


def test_repeated_video_hits_the_vision_cache(vlm, video_path, mixed):
    _, references = mixed
    cache = VisionCache(64 << 20)
    adapter = VLMAdapter(*vlm, vision_cache=cache)
    counter = Counting(adapter)
    messages = video_messages("What happens in the video?")
    first = adapter.prepare(messages, videos=[video_path], fps=2.0)
    again = adapter.prepare(messages, videos=[video_path.read_bytes()], fps=2.0)  # same frames, other source
    frames = adapter.prepare(messages, videos=[load_video(video_path, 0, 2.0, 32).frames])  # the frames themselves
    assert first.media_key == again.media_key == frames.media_key
    assert run_batch(adapter, [first])[0] == references[0]
    assert counter.calls == 1 and cache.stats()["misses"] == 1
    encoded = adapter.encode(again)
    assert encoded.vision_cache_hit is True and encoded.vision_time_s == 0.0
    assert run_batch(adapter, [again, frames]) == [references[0], references[0]]
    assert counter.calls == 1 and cache.stats()["hits"] >= 3
    # another prompt over the same video still hits (features, not embeddings, are cached)
    other_prompt = adapter.prepare(video_messages("and then?"), videos=[video_path], fps=2.0)
    assert adapter.encode(other_prompt).vision_cache_hit is True and counter.calls == 1


def test_other_frame_selection_is_another_key(adapter, video_path):
    messages = video_messages("x")
    prepared = {(fps, cap): adapter.prepare(messages, videos=[video_path], fps=fps, max_frames=cap)
                for fps, cap in [(2.0, 32), (2.0, 6), (1.0, 32), (2.0, 3), (1.5, 32), (2.0, 5)]}
    frames = {k: p.video_frame_indices[0] for k, p in prepared.items()}
    keys = {k: p.media_key for k, p in prepared.items()}
    # the same frames, however they were asked for, are the same key...
    assert frames[(2.0, 32)] == frames[(2.0, 6)] and keys[(2.0, 32)] == keys[(2.0, 6)]
    assert frames[(1.0, 32)] == frames[(2.0, 3)] == (0, 30, 60) and keys[(1.0, 32)] == keys[(2.0, 3)]
    # ...other frames are another key, also at the same frame count
    assert frames[(1.5, 32)] == (0, 20, 40, 60, 80) and frames[(2.0, 5)] == (0, 18, 36, 54, 72)
    assert keys[(1.5, 32)] != keys[(2.0, 5)]
    assert len({keys[k] for k in [(2.0, 32), (1.0, 32), (1.5, 32), (2.0, 5)]}) == 4
    image = noise_image(56, 56, seed=0)
    as_image = VLMAdapter(adapter.model, adapter.processor).prepare(image_messages("x"), images=[image])
    as_video = adapter.prepare(messages, videos=[[image, image]])
    assert as_image.media_key != as_video.media_key  # an image and a still video are different keys


def test_adapter_default_sampling_and_engine_style_options(vlm, video_path):
    from scheduler.models.adapter import adapter_for

    adapter = adapter_for(*vlm, video_fps=1.0, video_max_frames=2)
    p = adapter.prepare(video_messages("x"), videos=[video_path])
    assert p.video_frame_indices == ((0, 45),)  # 3 samples at 1 fps > cap 2: spread
    assert adapter.prepare(video_messages("x"), videos=[video_path], fps=2.0, max_frames=3).video_frame_indices \
        == ((0, 30, 60),)
    with pytest.raises(ValueError, match="fps"):
        adapter_for(*vlm, video_fps=0)
    with pytest.raises(ValueError, match="max_frames"):
        adapter.prepare(video_messages("x"), videos=[video_path], max_frames=0)


# -------------------------------------------------------------------------------------------- bad videos


def _truncated(path, tmp_path):
    data = path.read_bytes()
    out = tmp_path / "cut.avi"
    out.write_bytes(data[: len(data) // 2])
    return out


def _empty_file(tmp_path):
    out = tmp_path / "empty.mp4"
    out.write_bytes(b"")
    return out


def _junk_file(tmp_path):
    out = tmp_path / "junk.mp4"
    out.write_bytes(b"not a video at all " * 64)
    return out


BAD = {
    "missing-file": lambda vp, tp: tp / "nope.mp4",
    "directory": lambda vp, tp: tp,
    "empty-file": lambda vp, tp: _empty_file(tp),
    "junk-file": lambda vp, tp: _junk_file(tp),
    "junk-bytes": lambda vp, tp: b"\x00\x01garbage" * 100,
    "empty-bytes": lambda vp, tp: b"",
    "header-only-bytes": lambda vp, tp: vp.read_bytes()[:2000],
    "truncated-file": lambda vp, tp: _truncated(vp, tp),
    "zero-frames": lambda vp, tp: [],
    "frames-differ-in-size": lambda vp, tp: noise_frames(2, 56, 56) + noise_frames(1, 84, 56),
    "float-frames": lambda vp, tp: [np.zeros((56, 56, 3), np.float32)],
    "bad-frame-type": lambda vp, tp: ["frame.png"],
    "too-small-for-the-processor": lambda vp, tp: noise_frames(2, 10, 10),
    "url": lambda vp, tp: "https://example.com/clip.mp4",
    "int": lambda vp, tp: 7,
    "none": lambda vp, tp: None,
}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_video_raises_media_error_naming_it(adapter, video_path, tmp_path, kind):
    bad = BAD[kind](video_path, tmp_path)
    with pytest.raises(MediaError) as info:
        adapter.prepare(video_messages("hm", n=2), videos=[video_path, bad])
    assert info.value.index == 1 and info.value.kind == "video"
    assert str(info.value).startswith("video 1:")


def test_prompt_and_media_mismatches_are_value_errors(adapter, video_path):
    with pytest.raises(ValueError, match="video placeholder"):
        adapter.prepare(video_messages("x", n=2), videos=[video_path])
    with pytest.raises(ValueError, match="video placeholder"):
        adapter.prepare("<|im_start|>user\nno video<|im_end|>\n<|im_start|>assistant\n", videos=[video_path])
    with pytest.raises(ValueError, match="both images and videos"):
        adapter.prepare(image_messages("x"), images=[noise_image(56, 56, 0)], videos=[video_path])
    with pytest.raises(ValueError, match="must not end"):
        adapter.prepare("look <|vision_start|><|video_pad|>", videos=[video_path])


def test_frame_selection_validation_is_not_a_media_error(adapter, video_path):
    for fps in (0, math.nan):
        with pytest.raises(ValueError) as info:
            adapter.prepare(video_messages("x"), videos=[video_path], fps=fps)
        assert not isinstance(info.value, MediaError)


# ------------------------------------------------------------------------------------ through the engine


from scheduler import Engine, EngineConfig, SamplingParams, UnreadableMedia  # noqa: E402


def _drive(engine, arrivals):
    from ..helpers import drive

    return drive(engine, arrivals)


@pytest.mark.parametrize("budgets", [dict(), dict(max_batched_tokens=24, prefill_chunk=7, max_seqs=4, vision_budget=1)],
                         ids=["default", "small-budgets"])
def test_engine_video_image_text_match_solo(vlm, adapter, mixed, video_path, budgets):
    """Through the engine (vision_encoding under the budget, chunked prefill, batched decode), staggered: each
    request equals its solo mlx_vlm run; a video counts one budget unit per temporal patch."""
    from ..helpers import engine_with_log

    model, processor = vlm
    prepared, references = mixed
    media = [dict(videos=[video_path]), dict(videos=[noise_frames(5, 84, 56, seed=1)]),
             dict(videos=[video_path, noise_frames(4, seed=2)]),
             dict(images=[noise_image(112, 140, seed=0)]), dict()]
    # the engine samples every video at its one video_fps: the 2-fps requests here, the 1-fps one below
    config = EngineConfig(**budgets, video_fps=2.0, check_invariants=True)
    engine, log = engine_with_log(model, processor, config)
    picks = [0, 1, 3, 4]
    run = _drive(engine, [(t, {"prompt": prepared[i].prompt, **media[i], "sampling": SamplingParams(max_tokens=MAX_TOKENS)})
                          for t, i in enumerate(picks)])
    assert list(run.tokens.values()) == [references[i] for i in picks]
    plans = log.of_kind("plan")
    assert engine.stats().num_images_processed == 3 + 3 + 1  # media items: 3 + 3 temporal patches + 1 image
    if budgets:
        assert all(len(p["encode"]) <= 1 for p in plans)
    engine_1fps = Engine(model, processor, EngineConfig(**budgets, video_fps=1.0, check_invariants=True))
    run = _drive(engine_1fps, [(0, {"prompt": prepared[2].prompt, **media[2],
                                     "sampling": SamplingParams(max_tokens=MAX_TOKENS)})])
    assert list(run.tokens.values()) == [references[2]]


@pytest.fixture(scope="module")
def stamped(tmp_path_factory):
    """The tiny Qwen3-VL: its processor writes each frame group's time ("<t.t seconds>") into the prompt."""
    import mlx_vlm

    from scheduler.fixtures.vlm_families import build_tiny_vlm

    return mlx_vlm.load(str(build_tiny_vlm("qwen3_vl", tmp_path_factory.mktemp("qwen3-vl") / "model", seed=0)))


@pytest.mark.parametrize("fps, cap, want", [
    (2.0, 32, ["0.2", "1.2", "2.2"]),  # frames 0, 15, ... 75: what the processor's own 2 fps assumes, too
    (1.0, 32, ["0.5", "2.0"]),  # frames 0, 30, 60 (the last group repeats 60); not 0.2, 1.2
    (2.0, 4, ["0.4", "1.9"]),  # the cap binds: frames 0, 22, 45, 67 spread over the 3 s
])
def test_a_video_file_is_stamped_with_its_frames_own_times(stamped, video_path, fps, cap, want):
    """Each frame group's time in the prompt is that of the source frames we selected (index / source fps, as
    mlx-vlm's load_video reports a file it samples itself), at any video_fps and under the max_frames cap: given
    the frames alone, mlx-vlm takes them as sampled from frame 0 at the processor's 2 fps, and a 40 s clip capped
    at 32 frames was told it ended at 15.2 s."""
    import re

    model, processor = stamped
    prepared = VLMAdapter(model, processor).prepare(video_messages("When does it change?"), videos=[video_path],
                                                    fps=fps, max_frames=cap)
    assert re.findall(r"<([\d.]+) seconds>", processor.tokenizer.decode(prepared.input_ids)) == want


def test_engine_stamped_video_files_match_solo_given_their_metadata(stamped, video_path):
    """Through the engine at video_fps=1, staggered in small chunks next to a frame-list video, an image and a text
    request: each equals mlx_vlm.stream_generate alone given the same frames, with the file's metadata
    (``video_metadata``, as mlx-vlm's own load_video gives it) and none for the frame list."""
    import mlx_vlm
    from mlx_vlm.utils import VideoMetadata

    model, processor = stamped
    adapter = VLMAdapter(model, processor, video_fps=1.0)
    media = [dict(videos=[video_path]), dict(), dict(videos=[noise_frames(5, 84, 56, seed=1)]),
             dict(images=[noise_image(112, 140, seed=0)])]
    texts = [video_messages("When does it change?"), text_messages("What does the cat see today?"),
             video_messages("Describe it"), image_messages("Describe picture 0")]
    prompts, references = [], []
    for messages, kw in zip(texts, media):
        prompts.append(adapter.prepare(messages, **kw).prompt)
        solo_kw = dict(image=kw.get("images"))
        if kw.get("videos"):
            clip = load_video(kw["videos"][0], 0, 1.0, adapter.video_max_frames)
            solo_kw["video"] = [np.stack(clip.frames)]
            if clip.source_fps is not None:
                solo_kw["video_metadata"] = [VideoMetadata(total_num_frames=clip.total_frames, fps=clip.source_fps,
                                                           frames_indices=list(clip.indices))]
        last = None
        for last in mlx_vlm.stream_generate(model, processor, prompts[-1], max_tokens=MAX_TOKENS, temperature=0.0,
                                            **solo_kw):
            pass
        references.append(list(last.token_ids))
    engine = Engine(model, processor, EngineConfig(max_batched_tokens=24, prefill_chunk=7, max_seqs=4, video_fps=1.0,
                                                   check_invariants=True))
    run = _drive(engine, [(2 * t, {"prompt": prompts[t], **media[t], "sampling": SamplingParams(max_tokens=MAX_TOKENS)})
                          for t in range(len(prompts))])
    assert not run.errors, run.errors
    assert list(run.tokens.values()) == references


def test_engine_repeated_video_hits_the_vision_cache_and_bad_videos_are_refused_alone(vlm, mixed, video_path, tmp_path):
    model, processor = vlm
    prepared, references = mixed
    engine = Engine(model, processor, EngineConfig(video_fps=2.0, check_invariants=True))
    prompt = prepared[0].prompt
    sampling = SamplingParams(max_tokens=MAX_TOKENS)
    first = _drive(engine, [(0, {"prompt": prompt, "videos": [video_path], "sampling": sampling})])
    for rid, video in (("missing", tmp_path / "nope.mp4"), ("junk", b"junk" * 64)):
        with pytest.raises(UnreadableMedia, match="^videos: unreadable video 0: ") as info:
            engine.add_request(prompt=prompt, videos=[video], sampling=sampling, request_id=rid)
        assert (info.value.field, info.value.kind, info.value.index) == ("videos", "video", 0)
    assert not engine.has_pending()
    second = _drive(engine, [(0, {"prompt": prompt, "videos": [video_path.read_bytes()], "sampling": sampling})])
    assert list(first.tokens.values()) == [references[0]]
    assert list(second.tokens.values()) == [references[0]]
    stats = engine.vision_cache_stats()
    assert (stats["hits"], stats["misses"]) == (1, 1)


def test_served_video_chat_equals_the_engine_and_bad_videos_are_refused_by_part(vlm, vlm_model_dir, video_path,
                                                                                tmp_path):
    """`mlxsched serve`: a `video_url` part (a `data:video/...;base64,` URL, or a file under the directory the
    server allows) gives what the engine gives for the same messages and file; a video that does not decode is a
    400 naming its part (refused by the engine's decoder: UnreadableMedia); a `data:` URL of another kind too,
    and a file outside the allowed directory (`..` included). Video parts were refused by the request schema
    before, and the engine's own content-part parser took a data: URL for a file name."""
    import base64

    from ..surfaces.test_serve import _start, _stop, _wait_healthy

    model, processor = vlm
    want = Engine(model, processor, EngineConfig()).generate(
        [video_messages("What happens in the video?")], SamplingParams(max_tokens=MAX_TOKENS),
        videos=[[str(video_path)]])[0]
    data_url = "data:video/x-msvideo;base64," + base64.b64encode(video_path.read_bytes()).decode()

    def body(*videos, text="What happens in the video?"):
        return {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi."}] + [
            {"type": "video_url", "video_url": {"url": url}} for url in videos] + [{"type": "text", "text": text}]}],
            "max_tokens": MAX_TOKENS, "temperature": 0}

    junk = "data:video/mp4;base64," + base64.b64encode(b"not a video at all" * 8).decode()
    def alone(url):
        return {**body(), "messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "What happens in the video?"}]}]}

    server = _start(vlm_model_dir, tmp_path, "video", "--allowed-local-media-path", str(video_path.parent))
    try:
        _wait_healthy(server, time.monotonic() + 120)
        answers = [server.post("/v1/chat/completions", b) for b in (
            alone(data_url), alone(f"file://{video_path}"), alone(video_path.name),  # (relative to the directory)
            body(data_url, junk), body("data:image/png;base64,AAAA"),
            body(str(vlm_model_dir / "config.json")), body(f"{video_path.parent}/../{video_path.parent.name}/x/../"
                                                           f"../{vlm_model_dir.name}/config.json"))]
    finally:
        _stop(server)
    for status, got in answers[:3]:
        assert status == 200, got
        assert got["choices"][0]["message"]["content"] == want.text
        assert got["usage"]["completion_tokens"] == len(want.token_ids)
    refusals = zip(answers[3:], ("messages.0.content.2", "messages.0.content.1", "messages.0.content.1",
                                 "messages.0.content.1"), ("unreadable video", "unreadable video", "outside", "outside"))
    for (status, got), part, why in refusals:
        assert status == 400 and got["error"]["param"] == part, got
        assert why in got["error"]["message"], got
