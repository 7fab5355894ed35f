"""Our M-RoPE positions (scheduler/models/positions.py, ``mrope_index``) equal what each M-RoPE family's own
``get_rope_index`` in mlx-vlm computes, positions and rope delta, on the tiny builds of the M-RoPE families: prompts
the processors make (images, videos, several of them) and seeded synthetic ones (blocks anywhere, left padding
masked out, text only). If mlx-vlm changes how a family places tokens, this file fails first."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from scheduler.models import library
from scheduler.models.families import FAMILIES, Positions
from scheduler.models.positions import MRopeLayout, for_family, mrope_index

MROPE_FAMILIES = sorted(name for name, spec in FAMILIES.items() if spec.positions is Positions.MROPE)
# M-RoPE families whose media take no grids: MiniCPM-V 4.6's positions count every token (all three axes equal,
# images included; its get_rope_index refuses grids), which mrope_index's text-only branch computes
GRIDLESS = {"minicpmv4_6", "minicpmo", "minicpmv4_7"}
# M-RoPE families whose prompt positions mlx-vlm's generate takes from get_input_embeddings, not from the language
# model's get_rope_index: MiniCPM-o's stores token counting on the instance (its Qwen3-VL language model's
# get_rope_index reads image token ids its config does not have), MiniCPM-V 4.7's returns its canvas positions (its
# get_rope_index refuses image tokens). Their processor prompts are compared with what get_input_embeddings gives
EMBEDDING_POSITIONS = {"minicpmo", "minicpmv4_7"}

# Families whose get_rope_index places the masked (left-padding) columns of a prompt otherwise than Qwen2-VL's, which
# mrope_index follows: there only the unmasked columns (and the delta) are compared. GLM-OCR's leaves them at 0
# where Qwen2-VL's puts 1. Nothing reads them: the engine never left-pads a prompt (each row's positions come from
# its own prompt, and a batch's pads are on the right of a chunk, placed by the adapter).
MASKED_COLUMNS_DIFFER = {"glm_ocr"}
# Families whose get_rope_index takes a video as runs of video tokens a frame group each (GLM-OCR's, as GLM-4.6V's):
# the synthetic prompts' one block a video raises there. Their processors take images only, so no video reaches it.
NO_SYNTHETIC_VIDEO = {"glm_ocr"}
# Families whose get_rope_index gives a left-padded text-only prompt another rope delta than Qwen2-VL's, which
# mrope_index follows: Qwen3-Omni's counts the unmasked tokens (max position + 1 - unmasked: 0), Qwen2-VL's every
# column (-pad). There only the positions are compared. Nothing reads it: the engine never left-pads a prompt.
PADDED_TEXT_DELTA_DIFFERS = {"qwen3_omni_moe"}


def test_the_families_under_test_are_the_mrope_ones():
    assert MROPE_FAMILIES == ["ernie4_5_moe_vl", "glm4v", "glm4v_moe", "glm_ocr", "indic_ocr", "minicpmo",
                              "minicpmv4_6", "minicpmv4_7", "paddleocr_vl", "qwen2_5_vl", "qwen2_vl", "qwen3_5",
                              "qwen3_5_moe", "qwen3_omni_moe", "qwen3_vl", "qwen3_vl_moe"]


# ERNIE 4.5 VL's get_rope_index reads no attention mask (left pads take positions as tokens do): its prompts are
# compared unpadded, as the engine places every request's tokens (one row, no pads)
MASK_IGNORED = {"ernie4_5_moe_vl"}


@pytest.fixture(scope="module", params=MROPE_FAMILIES)
def loaded(request, tiny_vlm_dir, vlm_model_dir):
    import mlx_vlm

    name = request.param
    model, processor = mlx_vlm.load(str(vlm_model_dir if name == "qwen2_vl" else tiny_vlm_dir(name)))
    return name, model, processor


def _theirs(model, ids: np.ndarray, mask: np.ndarray | None, image_grids, video_grids) -> tuple[np.ndarray, int]:
    positions, deltas = model.language_model.get_rope_index(
        mx.array(ids[None]), None if image_grids is None else mx.array(image_grids),
        None if video_grids is None else mx.array(video_grids), None if mask is None else mx.array(mask[None]))
    positions = np.array(positions)
    if positions.ndim == 2:
        positions = np.broadcast_to(positions[None], (3, *positions.shape))
    elif FAMILIES[model.config.model_type].positions_last:  # (B, L, 3)
        positions = positions.transpose(2, 0, 1)
    return positions[:, 0, :], int(np.array(deltas).reshape(-1)[0])


def _layout(name: str, model) -> MRopeLayout:
    return MRopeLayout(*library.mrope_tokens(model), video_block_per_frame=FAMILIES[name].video_block_per_frame)


def _synthetic(rng: np.random.Generator, layout: MRopeLayout, per_frame: bool, kinds: list[str]):
    """Token ids with a vision block per entry of ``kinds`` between random text, and the grids they need. Where
    videos share the image token (ERNIE 4.5 VL, whose processor here takes images only) every block is an image."""
    if layout.video_token == layout.image_token:
        kinds = ["image"] * len(kinds)
    media_ids = {layout.image_token, layout.video_token, layout.vision_start}
    text_ids = [i for i in range(5, 400) if i not in media_ids]
    merge = layout.spatial_merge
    tokens: list[int] = list(rng.choice(text_ids, rng.integers(0, 6)))
    grids: dict[str, list] = {"image": [], "video": []}
    for kind in kinds:
        t = 1 if kind == "image" else int(rng.integers(1, 4))
        h, w = (int(rng.integers(1, 4)) * merge for _ in range(2))
        grids[kind].append([t, h, w])
        token = layout.image_token if kind == "image" else layout.video_token
        frames = t if kind == "video" and per_frame else 1
        per_block = (t // frames) * (h // merge) * (w // merge)
        for _ in range(frames):
            tokens += [layout.vision_start] + [token] * per_block + list(rng.choice(text_ids, rng.integers(1, 4)))
    tokens += list(rng.choice(text_ids, rng.integers(0, 5)))
    return (np.array(tokens, dtype=np.int64), np.array(grids["image"]) if grids["image"] else None,
            np.array(grids["video"]) if grids["video"] else None)


def test_synthetic_prompts_match_get_rope_index(loaded):
    name, model, _ = loaded
    if name == "minicpmo":  # mlx-vlm places its prompts without its language model's rope index (see above)
        return
    if name in GRIDLESS:  # no vision blocks to place: its rope index takes no grids at all
        with pytest.raises(ValueError, match="does not support"):
            model.language_model.get_rope_index(mx.array([[20, 21, 22, 23]]), mx.array([[1, 2, 2]]))
        return
    layout = _layout(name, model)
    rng = np.random.default_rng(0)
    shapes = [["image"], ["video"], ["image", "image", "image"], ["video", "video"], ["image", "video", "image"],
              ["video", "image"]]
    if name in NO_SYNTHETIC_VIDEO:
        assert "video" not in FAMILIES[name].media
        shapes = [kinds for kinds in shapes if "video" not in kinds]
    compared = 0
    for case in range(24):
        kinds = shapes[case % len(shapes)]
        tokens, image_grids, video_grids = _synthetic(rng, layout, layout.video_block_per_frame, kinds)
        pad = int(rng.integers(0, 4)) if case % 3 == 0 and name not in MASK_IGNORED else 0  # left padding, masked out
        ids = np.concatenate([np.full(pad, 7, dtype=np.int64), tokens])
        mask = np.concatenate([np.zeros(pad, dtype=np.int64), np.ones(len(tokens), dtype=np.int64)])
        want = _theirs(model, ids, mask, image_grids, video_grids)
        got = mrope_index(ids, mask, layout, image_grids, video_grids)
        kept = mask == 1 if name in MASKED_COLUMNS_DIFFER else slice(None)
        np.testing.assert_array_equal(got[0][:, kept], want[0][:, kept],
                                      err_msg=f"{name} case {case}: {kinds}, pad {pad}")
        if name in MASKED_COLUMNS_DIFFER and pad:  # what the exclusion is for (if mlx-vlm changes, drop it)
            assert not want[0][:, :pad].any() and (got[0][:, :pad] == 1).all(), (want[0][:, :pad], got[0][:, :pad])
        assert got[1] == want[1], (name, case, kinds, pad)
        compared += 1
    assert compared == 24


@pytest.mark.parametrize("pad", [0, 3])
def test_text_only_prompts_match_get_rope_index(loaded, pad):
    name, model, _ = loaded
    ids = np.arange(20, 40, dtype=np.int64)
    mask = (np.arange(20) >= pad).astype(np.int64)
    if name == "minicpmo":  # its get_input_embeddings counts every column (it reads no mask): the engine never pads
        got = mrope_index(ids, np.ones(20, dtype=np.int64), None, None, None)
        want = _embedded(model, ids, {})
        np.testing.assert_array_equal(got[0], want[0])
        assert got[1] == want[1] == 0
        return
    if pad and name in MASK_IGNORED:  # the fact that keeps its padded prompts out of this file
        unmasked = _theirs(model, ids, None, None, None)
        np.testing.assert_array_equal(_theirs(model, ids, mask, None, None)[0], unmasked[0])
        return
    for given_mask in ([mask] if pad else [mask, None]):
        want = _theirs(model, ids, given_mask, None, None)
        got = mrope_index(ids, np.ones(20, dtype=np.int64) if given_mask is None else given_mask,
                          None if name in GRIDLESS else _layout(name, model), None, None)
        kept = mask == 1 if name in MASKED_COLUMNS_DIFFER else slice(None)
        np.testing.assert_array_equal(got[0][:, kept], want[0][:, kept])
        if pad and name in PADDED_TEXT_DELTA_DIFFERS:  # what the exclusion is for (if mlx-vlm changes, drop it)
            assert (want[1], got[1]) == (0, -pad)
            continue
        assert got[1] == want[1]


def _image(seed: int, size: tuple[int, int]) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size[::-1], 3), dtype=np.uint8))


def _embedded(model, ids: np.ndarray, media_inputs: dict) -> tuple[np.ndarray, int]:
    """The positions and delta that get_input_embeddings gives a prompt (returned, or stored on the language model
    instance, which is put back as it was)."""
    inputs = dict(media_inputs)
    lm = model.language_model
    kept = {name: getattr(lm, name, None) for name in ("_position_ids", "_rope_deltas")}
    try:
        out = model.get_input_embeddings(mx.array(ids[None]), inputs.pop("pixel_values", None), **inputs)
        positions = getattr(out, "position_ids", None)
        deltas = getattr(out, "rope_deltas", None)
        positions, deltas = (lm._position_ids, lm._rope_deltas) if positions is None else (positions, deltas)
    finally:
        for name, value in kept.items():
            setattr(lm, name, value)
    return np.array(positions)[:, 0, :], int(np.array(deltas).reshape(-1)[0])


def test_processor_prompts_match_get_rope_index(loaded):
    """Prompts as the engine prepares them (the family's processor expands the placeholders), through the
    strategy the adapter uses."""
    from scheduler.models.adapter import VLMAdapter

    name, model, processor = loaded
    adapter = VLMAdapter(model, processor)
    strategy = for_family(FAMILIES[name])
    frames = [np.asarray(_image(10 + i, (56, 84))) for i in range(4)]

    def parts(n_images: int, n_videos: int) -> list[dict]:
        return ([{"type": "image"}] * n_images + [{"type": "video"}] * n_videos
                + [{"type": "text", "text": "What is in it?"}])

    requests = [
        ([{"role": "user", "content": parts(1, 0)}], [_image(1, (56, 56))], []),
        ([{"role": "user", "content": parts(2, 0)}], [_image(2, (84, 56)), _image(3, (112, 84))], []),
        ([{"role": "user", "content": parts(0, 1)}], [], [frames]),
        ([{"role": "user", "content": parts(0, 2)}], [], [frames, frames[:2]]),
        ([{"role": "user", "content": "no media at all"}], [], []),
    ]
    for messages, images, videos in requests:
        if videos and "video" not in FAMILIES[name].media:  # glm4v's processor takes images only
            continue
        if len(images) > (FAMILIES[name].images_per_request or len(images)):  # paddleocr_vl's: one a prompt
            continue
        prepared = adapter.prepare(messages, images=images, videos=videos)
        ids = np.array(prepared.input_ids, dtype=np.int64)
        mask = None if prepared.mask is None else np.array(prepared.mask).reshape(-1)
        grids = {k: prepared.media_inputs.get(k) for k in ("image_grid_thw", "video_grid_thw")}
        want = _embedded(model, ids, prepared.media_inputs) if name in EMBEDDING_POSITIONS else \
            _theirs(model, ids, mask, *(None if g is None else np.array(g) for g in grids.values()))
        got_positions, got_delta = strategy.prompt(model, mx.array(ids[None]), prepared.media_inputs,
                                                   None if mask is None else mx.array(mask[None]))
        assert got_positions.shape == (3, 1, len(ids)) and got_positions.dtype == mx.int32
        np.testing.assert_array_equal(np.array(got_positions)[:, 0, :], want[0], err_msg=f"{name}: {messages}")
        assert got_delta == want[1], (name, messages)


def test_inconsistent_grids_are_refused():
    layout = MRopeLayout(image_token=3, video_token=4, vision_start=2, spatial_merge=2)
    tokens = np.array([9, 2, 3, 3, 9])  # one image block of 2 tokens
    with pytest.raises(ValueError, match="cover"):
        mrope_index(tokens, np.ones(5), layout, np.array([[1, 4, 4]]), None)  # a grid of 4 tokens
    with pytest.raises(ValueError, match="more image blocks"):
        mrope_index(tokens, np.ones(5), layout, np.zeros((0, 3)), None)
