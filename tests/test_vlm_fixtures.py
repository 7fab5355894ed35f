"""The tiny VLM families of scheduler.fixtures.vlm_families load with mlx_vlm.load and run solo mlx_vlm.generate.

For each family: the saved weights are what the loaded model holds (mlx-vlm's sanitize leaves them as built),
greedy generation is deterministic, with images of two sizes and without, the image reaches the language
model (it changes the continuation), and eos is reachable (the eos output row is kept, the other specials'
rows are zero). Families whose processor takes video run a video (a list of frames) the same way.
"""

from __future__ import annotations

import numpy as np
import pytest

from scheduler.fixtures.vlm_families import VLM_FAMILIES, build_tiny_vlm

MAX_TOKENS = 12
PROMPTS = ("What does the cat see?", "Where is the red ball?")
IMAGE_SIZES = ((56, 56), (112, 140))  # (height, width)


def make_image(seed: int, height: int, width: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module", params=sorted(VLM_FAMILIES))
def tiny_vlm(request, tiny_vlm_dir):
    import mlx_vlm

    family = request.param
    directory = tiny_vlm_dir(family)
    model, processor = mlx_vlm.load(str(directory))
    return family, directory, model, processor


def _generate(model, processor, text, images):
    import mlx_vlm
    from mlx_vlm.prompt_utils import apply_chat_template

    prompt = apply_chat_template(processor, model.config, text, num_images=len(images))
    result = mlx_vlm.generate(model, processor, prompt, image=images or None, max_tokens=MAX_TOKENS,
                              temperature=0.0, verbose=False)
    return result


def test_loaded_model_holds_the_saved_weights(tiny_vlm):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    family, directory, model, _ = tiny_vlm
    assert model.config.model_type == VLM_FAMILIES[family].model_type
    saved = mx.load(str(directory / "model.safetensors"))
    loaded = dict(tree_flatten(model.parameters()))
    assert set(saved) == set(loaded)
    changed = [name for name in saved if not mx.array_equal(saved[name], loaded[name])]
    assert changed == []


def test_rebuild_is_identical_and_cached(tiny_vlm, tmp_path):
    family, directory, _, _ = tiny_vlm
    again = build_tiny_vlm(family, tmp_path / "again")
    assert (again / "model.safetensors").read_bytes() == (directory / "model.safetensors").read_bytes()
    assert (again / "tokenizer.json").read_bytes() == (directory / "tokenizer.json").read_bytes()
    before = (again / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_vlm(family, again) == again
    assert (again / "model.safetensors").stat().st_mtime_ns == before  # the cached build, not rewritten
    other_seed = build_tiny_vlm(family, tmp_path / "seed1", seed=1)
    assert (other_seed / "model.safetensors").read_bytes() != (directory / "model.safetensors").read_bytes()


def test_eos_row_is_reachable_and_other_specials_are_muted(tiny_vlm):
    import mlx.core as mx

    family, _, model, processor = tiny_vlm
    spec = VLM_FAMILIES[family]
    tokenizer = processor.tokenizer
    lm = model.language_model
    head = lm.lm_head.weight if hasattr(lm, "lm_head") else lm.model.embed_tokens.weight
    eos = tokenizer.convert_tokens_to_ids(spec.eos_token)
    eos_ids = model.config.eos_token_id
    assert eos in (eos_ids if isinstance(eos_ids, list) else [eos_ids])
    muted = [tokenizer.convert_tokens_to_ids(t) for t in spec.special_tokens if t != spec.eos_token]
    assert not mx.any(head[mx.array(muted)]).item()
    assert mx.all(head[eos] != 0).item()


def test_greedy_generation_is_deterministic_and_sees_the_image(tiny_vlm):
    family, _, model, processor = tiny_vlm
    image_changes_output = False
    images_differ = False
    all_tokens = []
    stopped_on_eos = []
    for text in PROMPTS:
        runs = {}
        for size in (None, *IMAGE_SIZES):
            images = [] if size is None else [make_image(len(runs), *size)]
            first = _generate(model, processor, text, images)
            second = _generate(model, processor, text, images)
            assert first.token_ids == second.token_ids, (family, text, size)
            assert first.text == second.text
            assert 0 < len(first.token_ids) <= MAX_TOKENS
            runs[size] = first.token_ids
            all_tokens.extend(first.token_ids)
            stopped_on_eos.append(len(first.token_ids) < MAX_TOKENS)
        image_changes_output |= any(runs[size] != runs[None] for size in IMAGE_SIZES)
        images_differ |= runs[IMAGE_SIZES[0]] != runs[IMAGE_SIZES[1]]
    assert image_changes_output, f"{family}: the image never changes the continuation"
    assert images_differ, f"{family}: two different images give the same continuation"
    assert len(set(all_tokens)) > 8, f"{family}: greedy decoding collapsed onto {sorted(set(all_tokens))}"
    # eos is reachable but does not win every time: some generations stop early, some run to max_tokens.
    assert any(stopped_on_eos) and not all(stopped_on_eos), (family, stopped_on_eos)


def _frames(seed: int, count: int = 4, size: int = 64):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)) for _ in range(count)]


def test_video_generation_is_deterministic_and_sees_the_frames(tiny_vlm):
    import mlx_vlm

    family, _, model, processor = tiny_vlm
    if "video" not in VLM_FAMILIES[family].media:
        assert not hasattr(processor, "video_processor"), f"{family}: its processor takes video: declare it"
        return
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def run(seed):
        return mlx_vlm.generate(model, processor, prompt, video=[_frames(seed)], max_tokens=MAX_TOKENS,
                                temperature=0.0, verbose=False).token_ids

    first = run(0)
    assert run(0) == first
    assert run(1) != first, f"{family}: two different clips give the same continuation"
