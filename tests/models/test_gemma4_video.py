"""Gemma 4 videos (mlx-vlm ``gemma4``, the tiny ``build_model("audio")`` with the released video processor settings).
Its processor takes a video as one (frames, 3, H, W) array (``FamilySpec.video_channels_first``) and writes each
frame's ``mm:ss`` from one rate per video, frame j at j / fps (``FamilySpec.video_rate``): the engine passes a file's
sampling rate (``media.sampling_rate``), so each frame is stamped with the time it is on screen, and caps a video at
the processor's 32 frames. A prompt with videos and no audio is prefilled in one forward through its last frame token
(video tokens are vision to its two-way attention), as with images. Every output equals solo
``mlx_vlm.stream_generate`` given the same frames, as (frames, 3, H, W) arrays, at the same rate."""

from __future__ import annotations

import re

import numpy as np
import pytest

from scheduler import EngineConfig, SamplingParams
from scheduler.fixtures.tiny_models import build_model
from scheduler.models.adapter import VLMAdapter
from scheduler.models.media import load_video

from ..helpers import drive, engine_with_log
from .test_gemma4_images import noise
from .test_video import write_video

MAX_TOKENS = 8
SOURCE_FPS = 4


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    import mlx_vlm

    return mlx_vlm.load(str(build_model("audio", tmp_path_factory.mktemp("tiny-gemma4"))))


def video_prompt(processor, text: str, videos: int = 0, images: int = 0) -> str:
    content = [{"type": "image"}] * images + [{"type": "video"}] * videos + [{"type": "text", "text": text}]
    # the model's own template (mlx-vlm's Gemma4Processor.apply_chat_template renders a video part only with a source)
    return processor.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                   tokenize=False)


def noise_frames(n: int, seed: int, h: int = 48, w: int = 64) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for _ in range(n)]


def stamps(processor, ids) -> list[int]:
    """The seconds each frame of the prompt is stamped with (``mm:ss <boi>``, in order)."""
    text = processor.tokenizer.decode(ids)
    return [60 * int(m) + int(s) for m, s in re.findall(r"(\d\d):(\d\d) " + re.escape(processor.boi_token), text)]


def solo(gemma, text, images=(), video=None, rate=None) -> list[int]:
    """mlx-vlm alone, a video given as its frames (frames, 3, H, W) at ``rate`` (None: mlx-vlm's default)."""
    import mlx_vlm

    model, processor = gemma
    kwargs = {} if rate is None else {"fps": [rate]}
    last = None
    for last in mlx_vlm.stream_generate(model, processor, text, image=list(images) or None,
                                        video=None if video is None else [np.stack(video).transpose(0, 3, 1, 2)],
                                        max_tokens=MAX_TOKENS, temperature=0.0, **kwargs):
        pass
    return list(last.token_ids)


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    """3.25 s at 4 fps (13 frames), sampled at video_fps=1: frames 0, 4, 8, 12 at 0, 1, 2, 3 s (rate 1; the mean
    rate over the clip, 4 frames in 3.25 s, would stamp 00:00 00:00 00:01 00:02)."""
    return write_video(tmp_path_factory.mktemp("gemma4-video") / "clip.avi", n=13, fps=SOURCE_FPS, size=(32, 32))


def test_video_requests_batch_exactly_with_images_and_text(gemma, clip):
    """A frame list and a file (sampled by the engine), an image, a text request and an image with a video (its
    merge takes both), arriving 2 ticks apart with 8-token chunks and drafting: each video prompt's first chunk
    runs from 0 through its last frame token in a forward of its own, and every output equals solo mlx-vlm given
    the same frames at the same rate."""
    model, processor = gemma
    listed = noise_frames(2, seed=7)
    sampled = load_video(str(clip), 0, 1.0, 32)
    assert sampled.indices == (0, 4, 8, 12) and sampled.rate == 1.0
    requests = [
        (video_prompt(processor, "what happens in the video", 1), dict(videos=[listed]),
         solo(gemma, video_prompt(processor, "what happens in the video", 1), video=listed)),
        (video_prompt(processor, "describe this clip", 1), dict(videos=[str(clip)]),
         solo(gemma, video_prompt(processor, "describe this clip", 1), video=sampled.frames, rate=1.0)),
        (video_prompt(processor, "and this picture", images=1), dict(images=[noise(3)]),
         solo(gemma, video_prompt(processor, "and this picture", images=1), images=[noise(3)])),
        (video_prompt(processor, "hello there, how are you today"), {},
         solo(gemma, video_prompt(processor, "hello there, how are you today"))),
        (video_prompt(processor, "the picture, then the video", 1, 1), dict(images=[noise(4)], videos=[listed]),
         solo(gemma, video_prompt(processor, "the picture, then the video", 1, 1), [noise(4)], listed)),
    ]
    engine, log = engine_with_log(model, processor, EngineConfig(
        max_batched_tokens=320, prefill_chunk=8, max_seqs=4, draft_tokens=2, video_fps=1.0, check_invariants=True))
    run = drive(engine, [(2 * i, {"prompt": text, **media, "sampling": SamplingParams(max_tokens=MAX_TOKENS)})
                         for i, (text, media, _) in enumerate(requests)])
    assert list(run.tokens.values()) == [want for _, _, want in requests]
    reach = {e["request_id"]: e.get("first_chunk_reach", 0) for e in log.of_kind("arrival")}
    ids = list(run.tokens)
    assert reach[ids[0]] > 100 and reach[ids[1]] > 200 and reach[ids[3]] == 0 and reach[ids[4]] > 100, reach
    chunks = [c for e in log.of_kind("plan") for c in e["prefill"]]
    assert all(start >= reach[rid] or (start == 0 and end >= reach[rid]) for rid, start, end, _ in chunks)
    engine.close()


def test_stamps_are_not_a_rounding_short_of_a_whole_second(gemma):
    """A 246 s clip at 1 fps capped at 32 frames: sample 16 is at 123 s exactly, which the processor's float j /
    fps makes 122.99999999999999 at the plain rate (stamped 02:02); at the rate the engine passes, every stamp
    is its frame's second."""
    from scheduler.models import library
    from scheduler.models.media import sample_frame_indices, sampling_rate

    _, processor = gemma
    rate = sampling_rate(246, 1.0, 2.0, 32)
    frames = np.zeros((32, 3, 16, 16), np.uint8)
    plain = processor.video_processor([frames], fps=[rate])["frame_timestamps"][0]
    passed = processor.video_processor([frames], fps=library.stamp_rates(processor, [rate]))["frame_timestamps"][0]
    want = sample_frame_indices(246, 1.0, 2.0, 32)  # frame i is on screen from i s
    assert [int(t) for t in plain] != want and [int(t) for t in passed] == want


def test_video_messages_render_as_mlx_vlm_renders_a_video_prompt(gemma):
    """Chat messages with a video part render with the tokenizer's template (mlx-vlm's
    Gemma4Processor.apply_chat_template drops a part without a source), as mlx-vlm's generate renders a prompt
    with a video, and the engine takes them."""
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = gemma
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what happens"}]}]
    adapter = VLMAdapter(model, processor)
    want = apply_chat_template(processor, model.config, "what happens", video=["clip.mp4"])
    assert adapter.render_chat(messages, num_videos=1) == want
    assert adapter.prepare(messages, videos=[noise_frames(1, seed=0)]).prompt == want


@pytest.mark.parametrize("frames, video_fps, max_frames, kept, last", [
    (160, 2.0, 32, 32, 38),  # 40 s at 4 fps capped at 32 frames: one every 1.25 s, the last at 38.75 s
    (160, 2.0, 64, 32, 38),  # the engine's cap above the processor's 32 frames: capped at 32, not thinned by it
    (13, 1.0, 32, 4, 3),  # 3.25 s at 1 fps: 0, 1, 2, 3 s (the mean rate, 4 frames in 3.25 s, would end at 00:02)
], ids=["40s-capped", "40s-above-processor-cap", "short-uncapped"])
def test_each_frame_is_stamped_with_its_own_time(gemma, tmp_path, frames, video_fps, max_frames, kept, last):
    """The mm:ss before each frame of the prompt is the time of the source frame the engine chose (its index /
    the source rate), for a 40 s clip capped at 32 frames (not 00:00..00:15 at the processor's default 2 fps) and
    a short clip whose length is no whole number of sample periods."""
    model, processor = gemma
    path = write_video(tmp_path / "clock.avi", n=frames, fps=SOURCE_FPS, size=(16, 16), colour=lambda i: (i, 0, 128))
    adapter = VLMAdapter(model, processor, video_fps=video_fps, video_max_frames=max_frames)
    prepared = adapter.prepare(video_prompt(processor, "when", 1), videos=[str(path)])
    indices = prepared.video_frame_indices[0]
    assert len(indices) == kept
    assert stamps(processor, prepared.input_ids) == [i // SOURCE_FPS for i in indices]
    assert stamps(processor, prepared.input_ids)[-1] == last
