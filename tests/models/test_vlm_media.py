"""Media input through the engine (tiny Qwen2-VL): PIL images, paths, bytes and data: URLs are the same image
(same media key, same tokens as solo mlx_vlm); with `remote_media=False`, http(s) URLs are refused at add_request
with a typed error (fetching them: test_media_fetch.py); OpenAI-style content parts carry the media in the
messages; several images per request; an image budget per request; families that cannot batch are refused at
load."""

import base64
import io

import numpy as np
import pytest
from PIL import Image

from scheduler import Engine, EngineConfig, SamplingParams
from scheduler.models.families import UnsupportedFamily
from scheduler.request import InvalidRequest

from ..helpers import drive

MAX_TOKENS = 8


def noise_image(width, height, seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vlm(vlm_model_dir):
    import mlx_vlm

    return mlx_vlm.load(str(vlm_model_dir))


def user(text, n):
    content = [{"type": "image"}] * n + [{"type": "text", "text": text}] if n else text
    return [{"role": "user", "content": content}]


def solo(vlm, messages, images):
    import mlx_vlm
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = vlm
    prompt = apply_chat_template(processor, model.config, messages, num_images=len(images))
    last = None
    for last in mlx_vlm.stream_generate(model, processor, prompt, image=images or None, max_tokens=MAX_TOKENS,
                                        temperature=0.0):
        pass
    return list(last.token_ids)


def run_all(engine, requests):
    run = drive(engine, [(0, dict(r, sampling=SamplingParams(max_tokens=MAX_TOKENS))) for r in requests])
    assert not run.errors, run.errors
    return list(run.tokens.values())


def test_every_image_source_is_the_same_image(vlm, tmp_path):
    model, processor = vlm
    image = noise_image(84, 112, seed=3)
    data = png_bytes(image)
    path = tmp_path / "a.png"
    path.write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    sources = [image, path, str(path), data, url]
    engine = Engine(model, processor, EngineConfig(check_invariants=True))
    keys = {engine.vlm.prepare(user("what?", 1), [s]).media_key for s in sources}
    assert len(keys) == 1
    outputs = run_all(engine, [{"prompt": user("what?", 1), "images": [s]} for s in sources])
    assert outputs == [solo(vlm, user("what?", 1), [image])] * len(sources)


@pytest.mark.parametrize("url", ["https://example.com/cat.png", "http://example.com/cat.png"])
def test_remote_urls_are_refused_at_add_request_when_remote_media_is_off(vlm, url):
    model, processor = vlm
    engine = Engine(model, processor, EngineConfig(check_invariants=True, remote_media=False))
    with pytest.raises(InvalidRequest, match="remote URLs are not fetched") as info:
        engine.add_request(prompt=user("what?", 1), images=[url])
    assert info.value.field == "images"
    parts = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                          {"type": "text", "text": "what?"}]}]
    with pytest.raises(InvalidRequest, match="remote URLs"):
        engine.add_request(prompt=parts)
    assert not engine.has_pending()


def test_openai_content_parts_and_several_images(vlm, tmp_path):
    """Image parts (a data: URL and a path, as {"url": ...} or a bare string) where the images are; the same
    tokens as the images= form and as solo mlx_vlm."""
    model, processor = vlm
    a, b = noise_image(56, 84, seed=4), noise_image(112, 56, seed=5)
    path = tmp_path / "b.png"
    path.write_bytes(png_bytes(b))
    url = "data:image/png;base64," + base64.b64encode(png_bytes(a)).decode()
    parts = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                          {"type": "image_url", "image_url": str(path)},
                                          {"type": "text", "text": "Compare them."}]}]
    engine = Engine(model, processor, EngineConfig(check_invariants=True))
    outputs = run_all(engine, [{"prompt": parts}, {"prompt": user("Compare them.", 2), "images": [a, b]}])
    assert outputs == [solo(vlm, user("Compare them.", 2), [a, b])] * 2
    with pytest.raises(InvalidRequest, match="not both"):
        engine.add_request(prompt=parts, images=[a])
    with pytest.raises(InvalidRequest, match="unsupported content part"):
        engine.add_request(prompt=[{"role": "user", "content": [{"type": "file", "file": "x"}]}])


def test_max_images_per_request(vlm):
    model, processor = vlm
    engine = Engine(model, processor, EngineConfig(max_images_per_request=2, check_invariants=True))
    images = [noise_image(56, 56, seed=i) for i in range(3)]
    with pytest.raises(InvalidRequest, match="3 images in one request; at most 2") as info:
        engine.add_request(prompt=user("three", 3), images=images)
    assert info.value.field == "images"
    assert run_all(engine, [{"prompt": user("two", 2), "images": images[:2]}]) == [
        solo(vlm, user("two", 2), images[:2])]


def test_max_videos_per_request(vlm):
    """Videos are bounded per request too (each is up to video_max_frames frames), before any is decoded: the
    sources here are not even files."""
    model, processor = vlm
    engine = Engine(model, processor, EngineConfig(max_videos_per_request=1, check_invariants=True))
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "video"}, {"type": "text", "text": "two"}]}]
    with pytest.raises(InvalidRequest, match=r"2 videos in one request; at most 1 \(max_videos_per_request\)") as info:
        engine.add_request(prompt=messages, videos=["a.mp4", "b.mp4"])
    assert info.value.field == "videos" and not engine.has_pending()


def _tiny_paligemma():
    from mlx_vlm.models import paligemma

    text = paligemma.TextConfig(hidden_size=64, num_hidden_layers=1, intermediate_size=128, num_attention_heads=2,
                                num_key_value_heads=1, head_dim=32, vocab_size=512)
    vision = paligemma.VisionConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                    num_attention_heads=2, image_size=28, patch_size=14)
    return paligemma.Model(paligemma.ModelConfig(text_config=text, vision_config=vision, vocab_size=512,
                                                 hidden_size=64, image_token_index=5))


def _tiny_mllama():
    from mlx_vlm.models import mllama

    text = mllama.TextConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2, cross_attention_layers=[1])
    vision = mllama.VisionConfig(image_size=28, patch_size=14, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=2, num_global_layers=1,
                                 vision_output_dim=64, intermediate_layers_indices=[0])
    return mllama.Model(mllama.ModelConfig(text_config=text, vision_config=vision, model_type="mllama"))


def test_families_that_do_not_batch_are_refused_at_load():
    """Real mlx-vlm models: a family left out (paligemma: its bidirectional prompt attention; `LEFT_OUT`), one no
    row knows of, and a declared refusal (mllama: cross-attention to per-request vision states) raise
    UnsupportedFamily (a TypeError) with the reason."""
    model = _tiny_paligemma()
    with pytest.raises(UnsupportedFamily, match="^model_type 'paligemma': it is not batched here: its checkpoints "
                                                "attend bidirectionally"):
        Engine(model, None)
    model.config.model_type = "paligemma_next"
    with pytest.raises(UnsupportedFamily, match="^model_type 'paligemma_next': no VLM family spec for it; supported: "):
        Engine(model, None)
    with pytest.raises(UnsupportedFamily, match="'mllama' cannot be batched: its language model cross-attends"):
        Engine(_tiny_mllama(), None)
    assert isinstance(UnsupportedFamily("x"), TypeError)
