"""Vision-language families mlx-vlm runs that the scheduler refuses at load (``FamilySpec.refused`` in
scheduler/models/families.py): each is refused with its reason, and the mlx-vlm behaviour that makes it unbatchable
is asserted here, on tiny models built from mlx-vlm's own config classes, so that a change in mlx-vlm fails here and
the refusal is looked at again. Each section is self-contained."""

from __future__ import annotations

import contextlib
import io

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from scheduler import Engine
from scheduler.models.families import FAMILIES, UnsupportedFamily

# ---------------------------------------------------------------------------------------------- hunyuan_vl


def _tiny_hunyuan_vl():
    """Hunyuan-VL's model at hidden 64: 2 layers with q / k norms, XD-RoPE over 4 axes (4 frequencies each of
    head_dim 32's 16), a 1-block tower; random weights, float32."""
    from mlx_vlm.models import hunyuan_vl

    rope = {"alpha": 1000.0, "beta_fast": 32, "beta_slow": 1, "factor": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "type": "xdrope", "xdrope_section": [4, 4, 4, 4]}
    text = hunyuan_vl.TextConfig(vocab_size=512, org_vocab_size=512, hidden_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=32, attention_head_dim=32,
                                 intermediate_size=128, rope_scaling=rope, dtype="float32")
    vision = hunyuan_vl.VisionConfig(hidden_size=32, out_hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64)
    mx.random.seed(0)
    model = hunyuan_vl.Model(hunyuan_vl.ModelConfig(text_config=text, vision_config=vision, vocab_size=512,
                                                    org_vocab_size=512, image_token_id=500, image_start_token_id=501,
                                                    image_end_token_id=502, image_newline_token_id=503))
    mx.eval(model.parameters())
    return model


def _prefill(language_model, ids: list[int], **kwargs):
    """A fresh cache of mlx-vlm's kind holding ``ids`` (one row), and the forward's logits."""
    from mlx_vlm.models.cache import make_prompt_cache

    cache = make_prompt_cache(language_model)
    logits = language_model(mx.array([ids]), cache=cache, **kwargs).logits
    return cache, logits


def test_hunyuan_vl_is_refused_at_load():
    assert FAMILIES["hunyuan_vl"].refused
    with pytest.raises(UnsupportedFamily, match="'hunyuan_vl' cannot be batched: its language model takes no per-row "
                                                "positions"):
        Engine(_tiny_hunyuan_vl(), None)


def test_hunyuan_vl_rotates_every_row_of_a_batch_by_the_caches_shared_offset():
    """Past offset 0 mlx-vlm's Hunyuan-VL attention rotates queries and keys by the batch cache's one shared
    timeline (`cache_position_offset`), not by each row's own offset. Two prompts of 5 and 9 tokens prefilled alone,
    their caches merged into the engine's left-padded batch and one decode step taken for both: the longest row
    (unpadded) gets the logits it gets alone, the shorter one other logits (its new token is rotated as position 9,
    not 5). mlx-lm's Llama, which rotates each row by its own offset, gets both rows' own logits."""
    from mlx_lm.models import llama
    from mlx_lm.models.cache import make_prompt_cache

    from caches.layers import merge_caches

    prompts, following = ([11, 12, 13, 14, 15], [21, 22, 23, 24, 25, 26, 27, 28, 29]), [[7], [8]]
    hunyuan = _tiny_hunyuan_vl().language_model
    alone, caches = [], []
    for ids, nxt in zip(prompts, following):
        hunyuan._position_ids = None  # the previous prompt's positions (the next test)
        cache, _ = _prefill(hunyuan, ids)
        alone.append(hunyuan(mx.array([nxt]), cache=cache).logits[0, -1])
        hunyuan._position_ids = None
        caches.append(_prefill(hunyuan, ids)[0])
    batched = hunyuan(mx.array(following), cache=merge_caches(caches)).logits[:, -1]
    assert mx.allclose(batched[1], alone[1], atol=1e-5).item()  # the longest row
    assert mx.max(mx.abs(batched[0] - alone[0])).item() > 1e-3  # the left-padded row

    mx.random.seed(0)
    control = llama.Model(llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2,
                                          intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                                          rms_norm_eps=1e-5, vocab_size=512, head_dim=32))
    alone, caches = [], []
    for ids, nxt in zip(prompts, following):
        cache, merged = make_prompt_cache(control), make_prompt_cache(control)
        control(mx.array([ids]), cache=cache)
        control(mx.array([ids]), cache=merged)
        alone.append(control(mx.array([nxt]), cache=cache)[0, -1])
        caches.append(merged)
    batched = control(mx.array(following), cache=merge_caches(caches))[:, -1]
    assert all(mx.allclose(batched[i], alone[i], atol=1e-5).item() for i in range(2))


def test_hunyuan_vl_prefill_reads_positions_a_previous_request_left_on_the_instance():
    """A forward at cache offset 0 stores its XD-RoPE positions on the language model instance (`_position_ids`),
    and the next forward at offset 0 (another request's prefill, on its own fresh cache) slices them instead of
    computing its own: a second prompt's logits follow the first prompt's positions until the attribute is
    cleared."""
    hunyuan = _tiny_hunyuan_vl().language_model
    first, second = [11, 12, 13, 14, 15, 16], [31, 32, 33, 34]
    hunyuan._position_ids = None
    # the first request's own positions, the axes apart as an image's are (a shift of all of them alike would leave
    # the attention as it is), none past the second prompt's length (the rotary table covers the forward's tokens)
    positions = mx.array(np.random.default_rng(0).integers(0, len(second), (1, 4, len(first))))
    _prefill(hunyuan, first, position_ids=positions)
    assert np.array_equal(np.array(hunyuan._position_ids), np.array(positions))  # kept on the instance
    _, reused = _prefill(hunyuan, second)  # a new request: no positions of its own given
    hunyuan._position_ids = None
    _, own = _prefill(hunyuan, second)  # the same prompt computing its own (0..3 on every axis)
    hunyuan._position_ids = None
    _, shifted = _prefill(hunyuan, second, position_ids=positions[:, :, :4])
    assert mx.max(mx.abs(reused - own)).item() > 1e-3
    assert mx.allclose(reused, shifted, atol=1e-6).item()


# ---------------------------------------------------------------------------------------------------------------
# LLaVA-style splice: phi4-siglip (Phi-4-reasoning-vision), llava_qwen2 (Apple's FastVLM), llava-qwen2 and
# bunny-llama (Bunny). mlx-vlm's input preparation writes ONE id (-200) where a prompt holds an image and the merge
# puts the image's feature rows in its place, so the embedded prompt is longer than its ids, as for llava_next.
# Tiny models are built here from mlx-vlm's config classes and run on tensors shaped as their processors give them
# (no checkpoint, no processor): the tower and the merge are mlx-vlm's own.

SPLICE_HIDDEN = 64


def _splice_text(module, model_type):
    return module.TextConfig(model_type=model_type, hidden_size=SPLICE_HIDDEN, num_hidden_layers=1,
                             intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-6,
                             vocab_size=512)


def _tiny_phi4_siglip():
    """A SigLIP2 NaFlex tower with patches of 4 px and at most 16 patches an image."""
    from mlx_vlm.models import phi4_siglip

    vision = phi4_siglip.VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, patch_size=4, num_patches=16)
    return phi4_siglip.Model(phi4_siglip.ModelConfig(text_config=_splice_text(phi4_siglip, "phi4-siglip"),
                                                     vision_config=vision, mm_hidden_size=32,
                                                     mm_vision_select_layer=-1))


def _tiny_fastvlm():
    """FastViTHD at 128 px (it downsamples by 64: a 2x2 grid of rows). Its stage layout (layers, embed_dims,
    mlp_ratios) is class attributes of mlx-vlm's VisionConfig, not dataclass fields, so this one instance's are
    set after construction; mlx-vlm's class is left as it is."""
    from mlx_vlm.models import fastvlm

    vision = fastvlm.VisionConfig(hidden_size=128, intermediate_size=256, image_size=128, projection_dim=64)
    vision.layers, vision.embed_dims, vision.mlp_ratios = [1] * 5, [8, 16, 32, 64, 128], [2] * 5
    # the tower's last stage widens its 128 channels by cls_ratio 2.0: the projector takes 256
    return fastvlm.Model(fastvlm.ModelConfig(text_config=_splice_text(fastvlm, "qwen2"), vision_config=vision,
                                             mm_hidden_size=256))


def _tiny_bunny(model_type):
    """Bunny's SigLIP tower, one small layer, at the 384 px (patches of 14) its merge asserts: 729 rows."""
    from mlx_vlm.models import llava_bunny

    vision = llava_bunny.VisionConfig(model_type="siglip_vision_model", num_hidden_layers=1, hidden_size=32,
                                      intermediate_size=64, num_attention_heads=2)
    return llava_bunny.Model(llava_bunny.ModelConfig(
        text_config=_splice_text(llava_bunny, model_type), vision_config=vision, model_type=model_type,
        auto_map={}, hidden_size=SPLICE_HIDDEN, mm_hidden_size=32))


def _phi4_image():
    """One image as Phi4SigLipProcessor packs it: 3x4 patches of 4x4x3 pixels, padded to the 16 patches the tower
    takes, with its patch grid and a mask of its 12 valid patches."""
    mask = mx.concatenate([mx.ones((1, 12)), mx.zeros((1, 4))], axis=1)
    return 12, (mx.random.normal((1, 16, 3 * 4 * 4)),), {"spatial_shapes": mx.array([[3, 4]]),
                                                          "pixel_attention_mask": mask}


def _fastvlm_image():
    return 4, (mx.random.normal((1, 3, 128, 128)),), {}


def _bunny_image():
    return 729, (mx.random.normal((1, 3, 384, 384)),), {}


# model_type (as mlx_vlm.load gives it) -> (mlx-vlm's module for it, tiny build, one image's inputs)
SPLICED = {
    "phi4-siglip": ("phi4_siglip", _tiny_phi4_siglip, _phi4_image),
    "llava_qwen2": ("fastvlm", _tiny_fastvlm, _fastvlm_image),
    "llava-qwen2": ("llava_bunny", lambda: _tiny_bunny("llava-qwen2"), _bunny_image),
    "bunny-llama": ("llava_bunny", lambda: _tiny_bunny("bunny-llama"), _bunny_image),
}
SPLICE_ID = -200


@pytest.mark.parametrize("model_type", sorted(SPLICED))
def test_llava_splice_families_load_as_their_model_types(model_type):
    """The model type a checkpoint's config.json carries is the one mlx_vlm.load resolves to the module (its
    MODEL_REMAPPING) and the model's config.model_type: the engine's family table is keyed by it. FastVLM is refused
    (no tiny build of it can be made to test it); the others batch (tests/models/test_vlm_families_splice.py)."""
    from mlx_vlm.utils import MODEL_REMAPPING

    module, build, _image = SPLICED[model_type]
    assert MODEL_REMAPPING[model_type] == module
    model = build()
    assert model.config.model_type == model_type
    if model_type == "llava_qwen2":
        with pytest.raises(UnsupportedFamily, match="'llava_qwen2' cannot be batched: not tested against mlx_vlm "
                           "here: its FastViTHD tower's stage layout is fixed"):
            Engine(model, None)
    else:
        assert FAMILIES[model_type].splice is not None and not FAMILIES[model_type].refused


@pytest.mark.parametrize("model_type", sorted(SPLICED))
def test_llava_splice_embeds_an_image_id_as_many_rows(model_type):
    """The fact splice.py builds on, on mlx-vlm's own tower and merge: a prompt of 5 ids holding one image id
    (-200, the id mlx-vlm's config and processor use) embeds as 4 + the image's rows (phi4-siglip: its valid
    packed patches; FastVLM: (image_size / 64)^2; Bunny: 729), the text around it unmoved; the engine expands the
    id to that many before planning. If mlx-vlm's merge changes, this fails: look at splice.image_runs again."""
    from scheduler.models import library, splice

    _module, build, image = SPLICED[model_type]
    model = build()
    assert library.splice_marker(model) == SPLICE_ID  # phi4-siglip's: its module's constant
    rows, pixels, extra = image()
    ids = mx.array([[1, 2, SPLICE_ID, 3, 4]])
    rule = FAMILIES[model_type].splice
    if rule is not None:  # the engine's count, before the tower, is the merge's
        assert splice.image_runs(rule, model, extra, ids[0].tolist(), SPLICE_ID, 1) == ((1, rows),)
    embeds = model.get_input_embeddings(ids, *pixels, **extra).inputs_embeds
    mx.eval(embeds)
    assert embeds.shape == (1, 4 + rows, SPLICE_HIDDEN) and rows > 1
    text = model.language_model.model.embed_tokens(mx.array([1, 2, 3, 4]))  # the text around it, unmoved
    assert mx.array_equal(embeds[0, :2], text[:2]) and mx.array_equal(embeds[0, -2:], text[2:])


# ------------------------------------------------------------------------------ deepseek_vl_v2

_DEEPSEEK_BOS, _DEEPSEEK_EOS, _DEEPSEEK_PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
# every token its processor adds, specials of the tokenizer (ids below 512)
_DEEPSEEK_TOKENS = (_DEEPSEEK_BOS, _DEEPSEEK_EOS, _DEEPSEEK_PAD, "<image>", "<|ref|>", "<|/ref|>", "<|det|>",
                    "<|/det|>", "<|grounding|>", "<|User|>", "<|Assistant|>")
# views of 56 px (4x4 patches of 14, downsampled 2x2): a global view and up to 2x2 local tiles an image
_DEEPSEEK_RESOLUTIONS = [[56, 56], [56, 112], [112, 56], [112, 112]]


def _deepseek_tokenizer():
    from transformers import PreTrainedTokenizerFast

    from scheduler.fixtures.tiny_models import _train_bpe

    return PreTrainedTokenizerFast(tokenizer_object=_train_bpe(_DEEPSEEK_TOKENS), bos_token=_DEEPSEEK_BOS,
                                   eos_token=_DEEPSEEK_EOS, pad_token=_DEEPSEEK_PAD)


def _tiny_deepseek_vl_v2(image_token: int):
    """DeepSeek-VL2 as mlx_vlm.load builds it from a config.json: a one-layer DeepSeek-V2 decoder with multi-head
    latent attention, a one-layer SigLIP tower on 56-pixel views and the 2x2 downsample projector."""
    from scheduler.fixtures.vlm_families import _construct

    text = {"model_type": "deepseek_v2", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
            "moe_intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
            "n_shared_experts": 1, "n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
            "q_lora_rank": None, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
            "v_head_dim": 16, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
    return _construct({
        "model_type": "deepseek_vl_v2", "language_config": text,
        "vision_config": {"model_type": "vision", "layers": 1, "width": 32, "intermediate_size": 64,
                          "num_attention_heads": 2, "image_size": 56, "patch_size": 14, "mlp_ratio": 2.0},
        "projector_config": {"projector_type": "downsample_mlp_gelu", "input_dim": 32, "n_embed": 64, "depth": 2,
                             "mlp_ratio": 1, "downsample_ratio": 2},
        "tile_tag": "2D", "global_view_pos": "head", "candidate_resolutions": _DEEPSEEK_RESOLUTIONS,
        "image_token_index": image_token, "vocab_size": 512})


def test_deepseek_vl_v2_reads_the_spatial_crops_past_their_end():
    """Why deepseek_vl_v2 is refused. Its processor returns, for a one-image prompt, pixel_values of the image's
    tiles (a global view and its 2x2 local tiles: 5) and images_spatial_crop with one row (one image);
    get_input_embeddings walks images_spatial_crop for as many rows as pixel_values has tiles, so it reads rows
    that do not exist. Given as a bounds-checked numpy array it raises at row 1; MLX does not check, and the tile
    count summed from that memory kept or dropped tiles at random (5 of 8 runs of one request merged other image
    rows; solo mlx_vlm itself is not deterministic). Padded with zero rows to the tile count (where its loop
    stops), the same inputs embed. If mlx-vlm bounds its loop by the image count, this fails: look again."""
    from mlx_vlm.models.deepseek_vl_v2.processing_deepsek_vl_v2 import DeepseekVLV2Processor

    tokenizer = _deepseek_tokenizer()
    with contextlib.redirect_stdout(io.StringIO()):  # it prints the special tokens it adds
        processor = DeepseekVLV2Processor(tokenizer=tokenizer, candidate_resolutions=_DEEPSEEK_RESOLUTIONS,
                                          patch_size=14, downsample_ratio=2)
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (140, 112, 3), dtype=np.uint8))
    inputs = processor(text="<|User|>: <image>\nDescribe it.\n\n<|Assistant|>:", images=[image])
    pixels, crops, mask = inputs["images"], inputs["images_spatial_crop"], inputs["images_seq_mask"]
    assert pixels.shape[:2] == (1, 5) and crops.shape == (1, 1, 2), (pixels.shape, crops.shape)
    model = _tiny_deepseek_vl_v2(tokenizer.convert_tokens_to_ids("<image>"))
    with pytest.raises(IndexError, match="index 1 is out of bounds"):
        model.get_input_embeddings(inputs["input_ids"], pixels, np.array(crops), mask)
    padded = np.concatenate([np.array(crops), np.zeros((1, pixels.shape[1] - crops.shape[1], 2), np.int64)], axis=1)
    embedded = model.get_input_embeddings(inputs["input_ids"], pixels, padded, mask).inputs_embeds
    assert embedded.shape == (*inputs["input_ids"].shape, 64)


# ------------------------------------------------------------------------------------ jina_vlm

def _tiny_jina_vlm():
    """Jina VLM (config model_type "jvlm", as its checkpoints name it): a one-layer Qwen3-style decoder and a
    two-layer SigLIP-style tower, from mlx-vlm's config classes."""
    from mlx_vlm.models import jina_vlm

    text = jina_vlm.TextConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                               head_dim=32, vocab_size=512, additional_vocab_size=0, intermediate_size=128,
                               rope_theta=10000.0)
    vision = jina_vlm.VisionConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, head_dim=16,
                                   image_size=28, patch_size=14, intermediate_size=64, vit_layers=(-1, -2),
                                   output_size=64, connector_hidden_size=64)
    return jina_vlm.Model(jina_vlm.ModelConfig(text_config=text, vision_config=vision, model_type="jvlm",
                                               vocab_size=512))


def test_jina_vlm_rotates_every_row_of_a_batch_at_the_longest_rows_positions():
    """Why jvlm is refused. Its language model's RoPE turns a batch cache's per-row offsets into one position
    (offset.max()) and its attention takes no position ids: a row rotated with offsets [3, 9] is rotated at 9,
    not 3. Two prompts of 3 and 7 tokens, each prefilled alone and merged into one batch cache, then decoded one
    token: the longer row's logits are its own, the shorter row's are not. If mlx-vlm rotates each row at its own
    offset, this fails: look again."""
    from mlx_vlm.models.cache import KVCache
    from mlx_vlm.models.jina_vlm.language import RoPE

    from caches import layers

    mx.random.seed(0)
    rope = RoPE(32, theta=10000.0)
    x = mx.random.normal((2, 1, 1, 32))
    both = rope(x, offset=mx.array([3, 9]))
    assert mx.array_equal(both[0], rope(x[:1], offset=9)[0]).item()
    assert not mx.allclose(both[0], rope(x[:1], offset=3)[0], atol=1e-3).item()
    assert mx.array_equal(both[1], rope(x[1:], offset=9)[0]).item()

    lm = _tiny_jina_vlm().language_model
    prompts = [mx.array([[5, 6, 7]]), mx.array([[8, 9, 10, 11, 12, 13, 14]])]

    def prefilled(ids):
        cache = [KVCache() for _ in lm.layers]
        lm(ids, cache=cache)
        return cache

    following = mx.array([[20], [21]])
    batched = lm(following, cache=layers.merge_caches([prefilled(p) for p in prompts])).logits[:, -1]
    alone = [lm(following[i:i + 1], cache=prefilled(p)).logits[0, -1] for i, p in enumerate(prompts)]
    assert mx.allclose(batched[1], alone[1], atol=1e-5).item()  # the longest row: no other position to take
    assert mx.abs(batched[0] - alone[0]).max().item() > 1e-2  # the shorter one, rotated at the longest's positions


# ------------------------------------------------------------------------------------- at load

def test_the_refused_families_are_refused_at_load_with_their_reason():
    """Engine() on the tiny models above raises UnsupportedFamily (a TypeError) naming why."""
    with pytest.raises(UnsupportedFamily, match="'deepseek_vl_v2' cannot be batched: mlx-vlm's get_input_embeddings "
                       "reads images_spatial_crop .* past its end"):
        Engine(_tiny_deepseek_vl_v2(image_token=3), None)
    with pytest.raises(UnsupportedFamily, match=r"'jvlm' cannot be batched: its language model's RoPE turns a batch "
                       r"cache's per-row offsets into one position \(offset.max\(\)\)"):
        Engine(_tiny_jina_vlm(), None)


# ------------------------------------------------------------------------------------------ granite_vision
# Batched as a spliced family (splice.py); the facts its row count is built on are pinned here

_GRANITE_VIEW = 42  # SigLIP views of 3x3 patches of 14: 9 rows a view
_GRANITE_GRID = [[42, 42], [42, 84], [84, 42], [84, 84]]
_GRANITE_TOKENS = ("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<image>", "<|pad|>")
_GRANITE_HIDDEN = 64


def _tiny_granite_vision():
    """Granite Vision's model (mlx-vlm's granite_vision: a LLaVA-NeXT-style SigLIP tower, projector and image
    newline over a Granite decoder) from its config classes: one block each, 42-pixel views; and its processor
    (mlx-vlm's GraniteVisionProcessor over transformers' LLaVA-NeXT image processor), with a tiny tokenizer."""
    from mlx_vlm.models import granite_vision
    from mlx_vlm.models.granite_vision.processing_granite_vision import GraniteVisionProcessor
    from transformers import LlavaNextImageProcessorPil, PreTrainedTokenizerFast

    from scheduler.fixtures.tiny_models import _train_bpe

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=_train_bpe(_GRANITE_TOKENS), eos_token="<|end_of_text|>",
                                        pad_token="<|pad|>")
    images = LlavaNextImageProcessorPil(size={"shortest_edge": _GRANITE_VIEW}, image_grid_pinpoints=_GRANITE_GRID,
                                        crop_size={"height": _GRANITE_VIEW, "width": _GRANITE_VIEW},
                                        image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor = GraniteVisionProcessor(image_processor=images, tokenizer=tokenizer, patch_size=14,
                                       vision_feature_select_strategy="full")
    text = granite_vision.TextConfig(hidden_size=_GRANITE_HIDDEN, num_hidden_layers=1, intermediate_size=128,
                                     num_attention_heads=2, num_key_value_heads=1, vocab_size=512)
    vision = granite_vision.VisionConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                         num_attention_heads=2, image_size=_GRANITE_VIEW, patch_size=14)
    mx.random.seed(0)
    model = granite_vision.Model(granite_vision.ModelConfig(
        text_config=text, vision_config=vision, image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        image_grid_pinpoints=_GRANITE_GRID, vocab_size=512))
    mx.eval(model.parameters())
    return model, processor


def _granite_prompt(images: int) -> str:
    return ("<|start_of_role|>user<|end_of_role|>" + "<image>\n" * images
            + "Describe it.<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>")


def test_granite_vision_embeds_a_prompt_in_other_rows_than_its_ids():
    """The splice granite_vision is batched by (splice.py, SpliceRows.VIEW_BLOCKS). Its processor expands each
    <image> into one id per feature row (LLaVA-NeXT's count: the base view's rows, the unpadded grid's and a newline
    per grid row); mlx-vlm's merge ignores that count: it concatenates the views' features (views, 9, H) with as
    many blocks of the newline row, puts one block of 9 rows in place of each of the first 2 x views image ids,
    drops the later image ids and the text between them. The embedded prompt is as long as the text ids and those
    blocks, not as its ids: the engine's count before the tower. Its tower also encodes pixel_values[0] only:
    another second image embeds the same (one image a prompt). If mlx-vlm fills the expanded ids, this fails: look
    at splice.image_runs again."""
    from scheduler.models import splice

    model, processor = _tiny_granite_vision()
    rng = np.random.default_rng(1)
    image, other = (Image.fromarray(rng.integers(0, 256, (140, 112, 3), dtype=np.uint8)) for _ in range(2))
    inputs = processor(text=[_granite_prompt(1)], images=[image])
    ids, pixels = inputs["input_ids"], inputs["pixel_values"]
    image_ids = int((ids == model.config.image_token_index).sum().item())
    views = pixels.shape[1]
    assert pixels.shape == (1, views, 3, _GRANITE_VIEW, _GRANITE_VIEW) and views > 1 and image_ids > 2 * views
    embeds = model.get_input_embeddings(ids, pixels).inputs_embeds
    mx.eval(embeds)
    text_ids = ids.shape[1] - image_ids
    assert embeds.shape == (1, text_ids + 2 * views * 9, _GRANITE_HIDDEN) and embeds.shape[1] != ids.shape[1]
    assert splice.image_runs(FAMILIES["granite_vision"].splice, model, inputs, ids[0].tolist(),
                             model.config.image_token_index, 1) == ((image_ids, 2 * views * 9),)

    two = processor(text=[_granite_prompt(2)], images=[image, image])
    swapped = processor(text=[_granite_prompt(2)], images=[image, other])
    assert not mx.array_equal(two["pixel_values"][1], swapped["pixel_values"][1]).item()
    first = model.get_input_embeddings(two["input_ids"], two["pixel_values"]).inputs_embeds
    second = model.get_input_embeddings(swapped["input_ids"], swapped["pixel_values"]).inputs_embeds
    assert mx.array_equal(first, second).item()


# --------------------------------------------------------------------------------------------------- llama4

_LLAMA4_CHUNK = 8


def _tiny_llama4():
    """Llama 4's model (mlx-vlm's llama4) from its config classes: 4 decoder layers, the first three chunked
    attention with RoPE (chunks of 8), the fourth full attention without RoPE, every other layer a mixture of 2
    experts; a one-block vision tower."""
    from mlx_vlm.models import llama4

    text = llama4.TextConfig(model_type="llama4_text", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                             rms_norm_eps=1e-5, vocab_size=512, num_key_value_heads=2, head_dim=16,
                             num_hidden_layers=4, attention_chunk_size=_LLAMA4_CHUNK, interleave_moe_layer_step=2,
                             intermediate_size_mlp=128, num_local_experts=2, num_experts_per_tok=1,
                             rope_scaling=None)
    vision = llama4.VisionConfig(model_type="llama4_vision_model", hidden_size=32, image_size=28,
                                 initializer_range=0.02, intermediate_size=64, norm_eps=1e-5, num_attention_heads=2,
                                 num_channels=3, num_hidden_layers=1, patch_size=14, pixel_shuffle_ratio=0.5,
                                 projector_dropout=0.0, projector_input_dim=64, projector_output_dim=64,
                                 rope_theta=10000.0, vision_feature_layer=-1, vision_feature_select_strategy="default",
                                 vision_output_dim=64)
    mx.random.seed(0)
    model = llama4.Model(llama4.ModelConfig(text_config=text, vision_config=vision, model_type="llama4"))
    mx.eval(model.parameters())
    return model


def test_llama4_is_refused_at_load():
    with pytest.raises(UnsupportedFamily, match="'llama4' cannot be batched: its chunked-attention layers keep a "
                                                "ChunkedKVCache"):
        Engine(_tiny_llama4(), None)


def test_llama4_chunked_layers_have_no_batch_cache_and_ignore_left_padding():
    """Why llama4 is refused. mlx-vlm's make_cache gives its chunked-attention layers a ChunkedKVCache, which the
    engine's caches have no batch form of (as mlx-lm's BatchGenerator refuses it). And with plain caches in its
    place, batching still differs: its language model builds the chunked layers' mask from one offset (the batch
    cache's largest, `offset.max().item()`), in place of the padding mask. Two prompts of 5 and 12 tokens, each
    prefilled alone, merged into the engine's left-padded batch and decoded one token: the longer (unpadded) row
    gets the logits it gets alone on mlx-vlm's own caches, the shorter one other logits (it attends its pads and
    the chunks of the longer row's positions). If mlx-vlm masks per row, this fails: look again."""
    from mlx_vlm.models.cache import KVCache

    from caches import layers

    lm = _tiny_llama4().language_model
    kinds = [type(c).__name__ for c in lm.make_cache()]
    assert kinds == ["ChunkedKVCache"] * 3 + ["KVCache"]
    with pytest.raises(layers.UnsupportedCache, match="ChunkedKVCache"):
        layers.capabilities(lm.make_cache())

    rng = np.random.default_rng(0)
    prompts = [mx.array([rng.integers(10, 500, n).tolist()]) for n in (5, 12)]
    following = mx.array([[7], [9]])
    alone = []
    for i, ids in enumerate(prompts):  # as mlx_vlm.generate runs each: its own make_cache()
        cache = lm.make_cache()
        lm(ids, cache=cache)
        alone.append(lm(following[i:i + 1], cache=cache).logits[0, -1])

    def prefilled(ids):
        cache = [KVCache() for _ in lm.layers]
        lm(ids, cache=cache)
        return cache

    batched = lm(following, cache=layers.merge_caches([prefilled(p) for p in prompts])).logits[:, -1]
    assert mx.allclose(batched[1], alone[1], atol=1e-5).item()  # the longest row
    assert mx.abs(batched[0] - alone[0]).max().item() > 1e-2  # the left-padded one


# ------------------------------------------------------------------------------ multi_modality and phi4mm
# Two more splices, each from its own path: Janus / DeepSeek-VL (multi_modality, batched: splice.py) splices its
# tower's rows in at one image id inside get_input_embeddings; phi4mm (refused) puts an image's valid NaFlex patch
# rows in place of its -200 id, and rewrites the language model's weights by the media it embeds.

_JANUS_IMAGE, _JANUS_PATCH = 384, 32  # mlx-vlm's ImageProcessor resizes every image to 384 px: a 12x12 grid
_JANUS_TOKENS = ("<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>", "<image>", "<pad>")
_PHI4MM_IMAGE_ID = -200  # mlx-vlm's processing_phi4mm.IMAGE_TOKEN_INDEX, the config's image_token_index


def _janus_config(image_token: int) -> dict:
    """Janus as its config.json names it (model_type multi_modality): a one-layer llama, a one-layer SigLIP tower
    (CLIPVisionTower) on 384-pixel images in patches of 32, the MLP aligner."""
    return {"model_type": "multi_modality",
            "text_config": {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "intermediate_size": 128,
                            "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 512},
            "vision_config": {"cls": "CLIPVisionTower", "model_type": "vision", "num_hidden_layers": 1,
                              "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
                              "image_size": _JANUS_IMAGE, "patch_size": _JANUS_PATCH, "num_channels": 3,
                              "params": {"image_size": _JANUS_IMAGE, "model_name": "siglip_large_patch16_384",
                                         "select_feature": "same", "select_layer": -1}},
            "projector_config": {"cls": "MlpProjector", "model_type": "aligner",
                                 "params": {"depth": 2, "input_dim": 32, "n_embed": 64, "projector_type": "mlp_gelu"}},
            "image_token_index": image_token, "num_image_tokens": (_JANUS_IMAGE // _JANUS_PATCH) ** 2,
            "vocab_size": 512}


def _tiny_janus(image_token: int = 2):
    from scheduler.fixtures.vlm_families import _construct

    return _construct(_janus_config(image_token))


def _tiny_phi4mm():
    """Phi-4-multimodal as mlx_vlm.load builds it from a config.json: a one-layer Phi-4 decoder (fused qkv_proj,
    partial rotary), a two-layer SigLIP2 NaFlex tower in patches of 4 px, a one-block Conformer audio encoder."""
    from scheduler.fixtures.vlm_families import _construct

    audio = {"attention_dim": 32, "attention_heads": 2, "num_blocks": 1, "linear_units": 64, "input_size": 80,
             "time_reduction": 8, "kernel_size": 3, "ext_pw_out_channel": 32, "depthwise_seperable_out_channel": 32,
             "conv_channels": 32, "t5_bias_max_distance": 500, "left_chunk": 18}
    return _construct({
        "model_type": "phi4mm", "hidden_size": 64, "num_hidden_layers": 1, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": False,
        "mm_hidden_size": 32, "text_config": {"model_type": "phi4mm"},
        "vision_config": {"model_type": "siglip2_vision_model", "hidden_size": 32, "intermediate_size": 64,
                          "num_attention_heads": 2, "num_hidden_layers": 2, "patch_size": 4, "num_channels": 3},
        "audio_processor": {"name": "cascades", "config": audio}})


def test_a_janus_checkpoint_with_the_hybrid_tower_is_refused_at_load():
    """deepseek-vl-7b's SAM + SigLIP tower (its vision_config.params names a high_res_cfg, which mlx-vlm reads as a
    dict) is refused at load with why; the SigLIP-only checkpoints batch (test_vlm_families_splice.py)."""
    from scheduler.models.families import JANUS_HYBRID_TOWER

    assert FAMILIES["multi_modality"].refused is None
    assert FAMILIES["multi_modality"].refused_options == (("vision_config.params.high_res_cfg", JANUS_HYBRID_TOWER),)
    model = _tiny_janus()
    model.config.vision_config.params["high_res_cfg"] = {"image_size": 1024}
    with pytest.raises(UnsupportedFamily, match="'multi_modality' with vision_config.params.high_res_cfg set cannot be "
                                                "batched: its SAM \\+ SigLIP hybrid vision tower is not tested"):
        Engine(model, None)


def test_phi4mm_is_refused_at_load():
    with pytest.raises(UnsupportedFamily, match=r"'phi4mm' cannot be batched: its get_input_embeddings merges the "
                       r"vision or the speech LoRA .* \(set_modality\)"):
        Engine(_tiny_phi4mm(), None)


def test_multi_modality_writes_one_id_an_image_and_embeds_it_as_the_images_rows(tmp_path):
    """The splice multi_modality is batched by (splice.py). mlx_vlm.load sets the processor's image_processor to the
    model module's own ImageProcessor (load_image_processor reads only config.json), a BaseImageProcessor, for which
    mlx-vlm's prepare_inputs splits the prompt at "<image>" and writes ONE image_token_index between the pieces (not
    the num_image_tokens ids mlx-vlm's MultiModalityProcessor would write); get_input_embeddings then expands that id
    into num_image_tokens ids and merges the image's rows (the tower's 12x12 grid) there, dropping the other ids. An
    image prompt of L ids embeds as L + 144 - 1 rows, the count the engine expands the id to before the tower. If
    mlx-vlm writes as many ids as rows (or embeds one row per id), this fails: look at splice.image_runs again."""
    from scheduler.models import splice
    import json

    from transformers import PreTrainedTokenizerFast

    from mlx_vlm.models.base import BaseImageProcessor
    from mlx_vlm.utils import load_image_processor, prepare_inputs
    from scheduler.fixtures.tiny_models import _train_bpe

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=_train_bpe(_JANUS_TOKENS), bos_token=_JANUS_TOKENS[1],
                                        eos_token=_JANUS_TOKENS[0], pad_token="<pad>")
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    config = _janus_config(image_token)
    (tmp_path / "config.json").write_text(json.dumps(config))
    image_processor = load_image_processor(tmp_path)  # as mlx_vlm.load sets it on the processor it loads
    assert isinstance(image_processor, BaseImageProcessor)
    tokenizer.image_processor = image_processor
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (140, 112, 3), dtype=np.uint8))
    inputs = prepare_inputs(tokenizer, images=[image], prompts="<|User|>: <image>\nDescribe it.\n\n<|Assistant|>:",
                            image_token_index=image_token)
    ids, pixels = inputs["input_ids"], inputs["pixel_values"]
    assert (ids == image_token).sum().item() == 1 and pixels.shape == (1, 3, _JANUS_IMAGE, _JANUS_IMAGE)
    model = _tiny_janus(image_token)
    embedded = model.get_input_embeddings(ids, pixels).inputs_embeds
    rows = (_JANUS_IMAGE // _JANUS_PATCH) ** 2
    assert embedded.shape == (1, ids.shape[1] + rows - 1, 64) and rows == 144
    assert splice.image_runs(FAMILIES["multi_modality"].splice, model, {}, ids[0].tolist(), image_token, 1) == (
        (1, rows),)


def _phi4mm_image():
    """One 12x16 image as mlx-vlm's Phi4MMImageProcessor packs it for 4-pixel patches: 3x4 valid patches, padded
    to the 16 it is allowed."""
    from mlx_vlm.models.phi4mm.processing_phi4mm import Phi4MMImageProcessor

    processor = Phi4MMImageProcessor(patch_size=4, max_num_patches=16, min_num_patches=4)
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (12, 16, 3), dtype=np.uint8))
    inputs = processor([image])
    assert inputs["pixel_values"].shape == (1, 16, 48) and inputs["spatial_shapes"].tolist() == [[3, 4]]
    return inputs["pixel_values"], {"pixel_attention_mask": inputs["pixel_attention_mask"],
                                    "spatial_shapes": inputs["spatial_shapes"]}


def test_phi4mm_embeds_an_image_id_as_its_valid_patch_rows():
    """phi4mm's merge is a splice (as phi4-siglip's, which is batched; phi4mm is refused for set_modality, below): 5
    ids holding one image id (-200, the config's image_token_index) embed as 4 + the image's 12 valid patch rows, the
    text around it unmoved."""
    model = _tiny_phi4mm()
    assert model.config.image_token_index == _PHI4MM_IMAGE_ID
    pixels, extra = _phi4mm_image()
    embedded = model.get_input_embeddings(mx.array([[1, 2, _PHI4MM_IMAGE_ID, 3, 4]]), pixels, **extra).inputs_embeds
    assert embedded.shape == (1, 4 + 12, 64)
    text = model.language_model.model.embed_tokens(mx.array([1, 2, 3, 4]))
    assert mx.array_equal(embedded[0, :2], text[:2]) and mx.array_equal(embedded[0, -2:], text[2:])


def test_phi4mm_embedding_a_prompt_rewrites_the_language_models_weights():
    """Why phi4mm is refused (the adapters): a checkpoint carries its language model's base weights with a vision
    and a speech LoRA; mlx-vlm's sanitize merges the vision one on load and keeps the rest on the model instance,
    and get_input_embeddings calls set_modality, which writes base + the adapter of the prompt's media into the
    language model's weights (a text-only prompt switches nothing). Here on one projection (rank 4): after an audio
    prompt's embedding the weights are base + speech, after an image prompt's base + vision again. A batch's rows
    share one set of weights, so an image row, an audio row and a text row cannot run in one forward as each runs
    alone. If get_input_embeddings stops rewriting the weights, this fails: look again."""
    model = _tiny_phi4mm()
    key = "model.layers.0.self_attn.qkv_proj"
    base = model.language_model.model.layers[0].self_attn.qkv_proj.weight
    rng = np.random.default_rng(0)
    checkpoint, merged = {f"{key}.base_layer.weight": base}, {}
    for adapter in ("vision", "speech"):
        a = mx.array(rng.normal(size=(4, base.shape[1])).astype(np.float32))
        b = mx.array(rng.normal(size=(base.shape[0], 4)).astype(np.float32))
        checkpoint.update({f"{key}.lora_A.{adapter}.weight": a, f"{key}.lora_B.{adapter}.weight": b})
        merged[adapter] = base + b @ a  # scale 1: the config names no LoRA rank / alpha
    model.load_weights(list(model.sanitize(checkpoint).items()), strict=False)

    def weights():
        return model.language_model.model.layers[0].self_attn.qkv_proj.weight

    assert mx.allclose(weights(), merged["vision"]).item()  # merged on load
    audio_id, frames = model.config.audio_token_index, 80  # 80 feature frames, time reduction 8: 10 rows
    model.get_input_embeddings(mx.array([[1, 2] + [audio_id] * (frames // 8) + [3]]), None,
                               input_audio_embeds=mx.array(rng.normal(size=(1, frames, 80)).astype(np.float32)),
                               audio_attention_mask=mx.ones((1, frames), dtype=mx.bool_))
    assert mx.allclose(weights(), merged["speech"]).item()
    model.get_input_embeddings(mx.array([[1, 2, 3]]))
    assert mx.allclose(weights(), merged["speech"]).item()  # text only: left as the last media prompt set them
    pixels, extra = _phi4mm_image()
    model.get_input_embeddings(mx.array([[1, _PHI4MM_IMAGE_ID, 3]]), pixels, **extra)
    assert mx.allclose(weights(), merged["vision"]).item()


# ------------------------------------------------------------------------ deepseek_v4, minimax_m3_vl, qwen4_exp
# Three sparse-attention successors, each refused for what its language model does (FamilySpec.refused); each built
# from mlx-vlm's config classes at hidden 64 with random weights.

_V4_VOCAB = 512


def _tiny_deepseek_v4():
    """DeepSeek-V4 with its vision tower (vision_n_layers 1): a sliding-window layer and a compressed one (ratio 4,
    with the sparse indexer), 2 hyper-connection streams, one hash-routed MoE layer."""
    from mlx_vlm.models import deepseek_v4

    config = deepseek_v4.ModelConfig(
        vocab_size=_V4_VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, head_dim=32, q_lora_rank=32, qk_rope_head_dim=16, n_routed_experts=4,
        num_experts_per_tok=2, compress_ratios=[0, 4], hc_mult=2, num_hash_layers=1, sliding_window=8, o_groups=2,
        o_lora_rank=16, index_n_heads=2, index_head_dim=16, index_topk=4, index_block=4, index_keep=2,
        max_position_embeddings=4096, vision_n_layers=1, vision_dim=32, vision_n_heads=2, vision_inter_dim=64,
        vision_max_n_token=16)
    mx.random.seed(0)
    model = deepseek_v4.Model(config)
    mx.eval(model.parameters())
    return model


def _minimax_m3_text(sparse: bool) -> dict:
    """MiniMax-M3's text at hidden 64: four layers, the middle two sparse attention (blocks of 4, the top 3 kept,
    the local one forced) unless `sparse` is False; MoE past the first."""
    kinds = ["full_attention", "minimax_m3_sparse", "minimax_m3_sparse", "full_attention"]
    return dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                vocab_size=512, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                shared_intermediate_size=32, dense_intermediate_size=128,
                mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
                layer_types=kinds if sparse else ["full_attention"] * 4,
                sparse_attention_config={"sparse_num_index_heads": 2, "sparse_index_dim": 16, "sparse_block_size": 4,
                                         "sparse_topk_blocks": 3, "sparse_local_block": 1})


def _tiny_minimax_m3_vl(sparse: bool = True):
    from mlx_vlm.models import minimax_m3_vl

    vision = minimax_m3_vl.VisionConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                        num_hidden_layers=1, projection_dim=64)
    mx.random.seed(0)
    model = minimax_m3_vl.Model(minimax_m3_vl.ModelConfig(
        text_config=minimax_m3_vl.TextConfig(**_minimax_m3_text(sparse)), vision_config=vision, vocab_size=512))
    mx.eval(model.parameters())
    return model


def _tiny_qwen4_exp(budget: int = 8):
    """Qwen4-Exp at hidden 64: a gated-delta layer and a QSA layer (its indexer keeps `budget` tokens, blocks of 4:
    8 keeps the top 2 blocks), 2 hyper-connection streams, MoE, a one-block Qwen3-VL tower."""
    from mlx_vlm.models import qwen4_exp

    text = qwen4_exp.TextConfig(
        model_type="qwen4_exp", hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        shared_expert_intermediate_size=32, moe_intermediate_size=32, rms_norm_eps=1e-6, vocab_size=512,
        max_position_embeddings=4096, full_attention_interval=2, hc_count=2, hc_lowrank=16, indexer_n_heads=2,
        indexer_head_dim=16, indexer_budget=budget, indexer_compress_ratio=4,
        rope_parameters={"type": "default", "mrope_section": [4, 2, 2], "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5, "mrope_interleaved": True})
    vision = qwen4_exp.VisionConfig(depth=1, hidden_size=32, intermediate_size=64, out_hidden_size=64, num_heads=2,
                                    patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                                    num_position_embeddings=64)
    mx.random.seed(0)  # the budget changes no weight's shape: both budgets get the same weights
    model = qwen4_exp.Model(qwen4_exp.ModelConfig(text_config=text, vision_config=vision, model_type="qwen4_exp",
                                                  vocab_size=512, image_token_id=500, video_token_id=501,
                                                  vision_start_token_id=502, vision_end_token_id=503))
    mx.eval(model.parameters())
    return model


def test_sparse_attention_successors_are_refused_at_load():
    for model_type, build in (("deepseek_v4", _tiny_deepseek_v4), ("minimax_m3_vl", _tiny_minimax_m3_vl),
                              ("qwen4_exp", _tiny_qwen4_exp)):
        assert FAMILIES[model_type].refused
        with pytest.raises(UnsupportedFamily) as info:
            Engine(build(), None)
        assert str(info.value) == f"model_type {model_type!r} cannot be batched: {FAMILIES[model_type].refused}"


def test_deepseek_v4_images_attend_both_ways_and_must_come_in_one_prefill_from_offset_0():
    """What deepseek_v4's image prompts need (not why it is refused: see the next test). Its language model finds
    the image sentinels in the input ids (ids from the vocabulary size on: start, pad, image, newline, end) and
    builds a mask in which an image's tokens see the later ones of the same image; a forward holding sentinels on a
    cache past offset 0 raises. So an image prompt's first chunk must hold every sentinel, from offset 0, as a
    Gemma 4 image prompt's does (`Request.first_chunk_reach`). Its caches are not the reason either: its compressed
    layers keep PoolingCaches in a CacheList, which the cache protocol batches (the Pooling kind, GLM-5-Next's). If
    mlx-vlm changes any of this, this fails: look again."""
    from mlx_vlm.models.deepseek_v4.language import create_image_attention_mask

    from caches import layers

    model = _tiny_deepseek_v4()
    cache = model.make_cache()
    assert [type(c).__name__ for c in cache[1].caches] == ["RotatingKVCache", "PoolingCache", "PoolingCache"]
    assert [c.kind for c in layers.capabilities(cache).layers] == [
        "RotatingKVCache", "CacheList[RotatingKVCache+PoolingCache+PoolingCache]"]

    v = _V4_VOCAB
    ids = mx.array([[5, 6, v, v + 2, v + 2, v + 2, v + 4, 7, 8]])  # text, an image's start, 3 image tokens, end
    mask = np.array(create_image_attention_mask(ids, v, 8, 16)[0, 0])
    assert mask[3, 5] and mask[2, 6]  # an image token sees a later one, the start sees the end
    assert not mask[1, 2] and not mask[7, 8]  # text stays causal

    cache = model.make_cache()
    model.language_model(mx.array([[5, 6, 7]]), cache=cache)
    with pytest.raises(ValueError, match="image sentinels must be supplied in one prefill"):
        model.language_model(mx.array([[v, v + 2, v + 4]]), cache=cache)


def test_deepseek_v4_pooled_keys_depend_on_where_a_prefill_splits():
    """Why deepseek_v4 is refused. Its ratio-4 layers pool keys in windows that overlap the window before, and each
    forward pools its first new window against zeros (mlx-vlm's PoolingCache keeps no earlier window): a 44-token
    text prompt prefilled in one forward and in chunks of 8 gets other last logits, so its outputs depend on the
    engine's chunking and on holding its last token back, which mlx_vlm.generate does not do. If mlx-vlm carries
    the overlap across forwards, this fails: look again."""
    model = _tiny_deepseek_v4()
    lm = model.language_model
    ids = mx.array([[int(t) for t in np.random.default_rng(3).integers(3, _V4_VOCAB, 44)]])
    whole = lm(ids, cache=model.make_cache()).logits[0, -1]
    cache = model.make_cache()
    for start in range(0, 44, 8):
        chunked = lm(ids[:, start:start + 8], cache=cache).logits[0, -1]
    assert float(mx.abs(whole - chunked).max()) > 1e-2


def _alone_and_batched_minimax(model, prompts):
    """Each prompt's last logits prefilled alone, and in one left-padded batch on mlx-vlm's own batch caches
    (MiniMaxM3BatchKVCache on the sparse layers, BatchKVCache on the others)."""
    from mlx_vlm.models.cache import BatchKVCache
    from mlx_vlm.models.minimax_m3_vl.language import MiniMaxM3BatchKVCache, MiniMaxM3KVCache

    lm = model.language_model
    longest = max(len(p) for p in prompts)
    pads = [longest - len(p) for p in prompts]
    cache = [MiniMaxM3BatchKVCache(pads) if isinstance(c, MiniMaxM3KVCache) else BatchKVCache(pads)
             for c in lm.make_cache()]
    batched = lm(mx.array([[0] * pad + p for pad, p in zip(pads, prompts)]), cache=cache).logits[:, -1]
    alone = []
    for p in prompts:
        lm._position_ids = lm._rope_deltas = None  # positions the model keeps on its instance from the last call
        alone.append(lm(mx.array([p]), cache=lm.make_cache()).logits[0, -1])
    return batched, alone


def test_minimax_m3_vl_sparse_layers_attend_other_blocks_in_a_left_padded_batch():
    """Why minimax_m3_vl is refused (as its text family in scheduler/families.py, through mlx-lm): its sparse layers
    cut key blocks over cache slots, so a row's left padding moves its block boundaries. Two prompts of 17 and 30
    tokens prefilled in one left-padded batch on mlx-vlm's own batch caches: the longer (unpadded) row gets its
    logits alone, the padded one others; the same model with every layer full attention gets both rows' own. Its
    sparse layers' cache (MiniMaxM3KVCache) also has no batch form in the engine. If mlx-vlm keeps blocks on
    positions, this fails: look again."""
    from caches import layers

    with pytest.raises(layers.UnsupportedCache, match="MiniMaxM3KVCache"):
        layers.capabilities(_tiny_minimax_m3_vl().make_cache())
    rng = np.random.default_rng(1)
    prompts = [rng.integers(10, 500, n).tolist() for n in (17, 30)]
    batched, alone = _alone_and_batched_minimax(_tiny_minimax_m3_vl(), prompts)
    assert mx.allclose(batched[1], alone[1], atol=1e-5).item()  # the unpadded row
    assert mx.abs(batched[0] - alone[0]).max().item() > 1e-1  # the left-padded one
    batched, alone = _alone_and_batched_minimax(_tiny_minimax_m3_vl(sparse=False), prompts)
    assert all(mx.allclose(batched[i], alone[i], atol=1e-5).item() for i in range(2))


def _qwen4_exp_decode_alone_and_merged(budget: int, lengths: tuple[int, int]):
    """One decode step of two prompts prefilled alone: each alone, and merged by mlx-vlm's own batch caches
    (BatchQSAKVCache.merge, ArraysCache.merge), as the engine merges them."""
    lm = _tiny_qwen4_exp(budget).language_model
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 500, n).tolist() for n in lengths]
    following = mx.array([[7], [8]])
    alone, caches = [], []
    for i, p in enumerate(prompts):
        cache = lm.make_cache()
        lm(mx.array([p]), cache=cache)
        alone.append(lm(following[i:i + 1], cache=cache).logits[0, -1])
        cache = lm.make_cache()
        lm(mx.array([p]), cache=cache)
        caches.append(cache)
    merged = [type(layer).merge([c[j] for c in caches]) for j, layer in enumerate(caches[0])]
    assert [type(c).__name__ for c in merged] == ["ArraysCache", "BatchQSAKVCache"]
    batched = lm(following, cache=merged).logits[:, -1]
    return [mx.abs(batched[i] - alone[i]).max().item() for i in range(2)]


def test_qwen4_exp_sparse_attention_differs_in_a_batch_of_rows_of_other_lengths():
    """Why qwen4_exp is refused. Its QSA layer keeps a QSAKVCache (a KVCache subclass holding the indexer's keys
    and positions too) whose batch form is mlx-vlm's BatchQSAKVCache. Two prompts of 9 and 27 tokens, each
    prefilled alone, merged by mlx-vlm's own merge and decoded one token: with the indexer keeping 2 blocks of 4 a
    row's logits differ from the row alone (here the unpadded one's, by about 0.1); with a budget covering every
    block (256 tokens, the same weights) both rows agree, as they do for two prompts of one length. The engine
    batches rows of other lengths in every schedule (on the tiny build, its staggered schedule gave 6 of 9 requests
    other tokens than solo mlx-vlm). If mlx-vlm's batched selection matches its single-row one, this fails: look
    again."""
    assert max(_qwen4_exp_decode_alone_and_merged(8, (9, 27))) > 1e-2
    assert max(_qwen4_exp_decode_alone_and_merged(256, (9, 27))) < 1e-5
    assert max(_qwen4_exp_decode_alone_and_merged(8, (20, 20))) < 1e-5


# ------------------------------------------------------------------------------------------------ falcon_ocr
# Falcon-OCR: one decoder over text tokens and raw 16-pixel patches (projected by one linear layer, no tower). Its
# processor writes each image as <|image_cls|>, 4 register tokens, a <|img|> per patch and <|img_end|>.

_FALCON_CLS, _FALCON_REGS, _FALCON_IMG, _FALCON_END = 244, [245, 246, 247, 248], 227, 230  # the config's defaults


def _tiny_falcon_ocr():
    """Falcon-OCR's model (mlx-vlm's falcon_ocr) from its config class: 2 layers of 4 heads (2 kv heads) of 16 at
    width 64, patches of 8 pixels; random weights, float32, the 2-D ("golden") rotary frequencies (zeros in
    mlx-vlm) drawn so that the image tokens' spatial rotation is not the identity."""
    from mlx_vlm.models import falcon_ocr

    config = falcon_ocr.ModelConfig.from_dict({"model_type": "falcon_ocr", "dim": 64, "n_layers": 2, "n_heads": 4,
                                               "head_dim": 16, "n_kv_heads": 2, "vocab_size": 512, "ffn_dim": 128,
                                               "max_seq_len": 256, "spatial_patch_size": 8})
    mx.random.seed(0)
    model = falcon_ocr.Model(config)
    inner = model.language_model.model
    inner.freqs_cis_golden = mx.random.normal(inner.freqs_cis_golden.shape)
    mx.eval(model.parameters())
    return model


def _falcon_image_prompt():
    """Token ids of text, one 2x2-patch image as the processor expands it, and text; its pixels (1, 16, 16, 3)."""
    ids = [5, 6, 7, _FALCON_CLS, *_FALCON_REGS, *[_FALCON_IMG] * 4, _FALCON_END, 8, 9, 10]
    pixels = mx.array(np.random.default_rng(0).standard_normal((1, 16, 16, 3)).astype(np.float32))
    return mx.array([ids]), pixels, mx.array([[2, 2]])


def test_falcon_ocr_is_refused_at_load():
    assert FAMILIES["falcon_ocr"].refused
    with pytest.raises(UnsupportedFamily, match="'falcon_ocr' cannot be batched: mlx-vlm's get_input_embeddings "
                                                "returns a prefill mask"):
        Engine(_tiny_falcon_ocr(), None)


def test_falcon_ocr_prefills_an_image_bidirectionally_at_shared_positions():
    """Why falcon_ocr is refused. With an image, mlx-vlm's get_input_embeddings returns `attention_mask_4d`, a
    causal mask but for each image block (<|image_cls|>, the registers and the patches), whose tokens attend to each
    other both ways; mlx-vlm's generate passes it on, the model declares `no_chunked_prefill` (the prompt is
    prefilled in one forward), and the language model honours it: the prompt's last logits differ from a causal
    prefill's. It also returns the prompt's positions (every image block token at its <|image_cls|> position, text after
    it one past: a rope delta) and per-token 2-D positions of the patches (`pos_hw`), which the language model reads
    only from these keywords (and `rope_deltas` from state it keeps on the instance). The scheduler prefills causally,
    in chunks shared across requests, at positions counted from each row's cache: if mlx-vlm drops the mask, this fails
    (the positions would still need M-RoPE-like handling)."""
    from mlx_vlm.models.cache import make_prompt_cache

    model = _tiny_falcon_ocr()
    assert model.no_chunked_prefill
    ids, pixels, grid = _falcon_image_prompt()
    embedded = model.get_input_embeddings(ids, pixels, image_grid_hw=grid)
    mask = embedded.attention_mask_4d
    n = ids.shape[1]
    block = list(range(3, 3 + 1 + 4 + 4 + 1))  # <|image_cls|> .. <|img_end|>
    assert mask.shape == (1, 1, n, n) and mask.dtype == mx.bool_
    causal = np.tril(np.ones((n, n), dtype=bool))
    expected = causal.copy()
    expected[np.ix_(block[:-1], block[:-1])] = True  # <|img_end|> closes the block: it attends causally
    assert (np.array(mask[0, 0]) == expected).all()
    assert embedded.position_ids.reshape(-1).tolist() == [0, 1, 2] + [3] * len(block) + [4, 5, 6]
    assert embedded.rope_deltas.item() == 7 - n

    def last_logits(**kwargs):
        extra = {"position_ids": embedded.position_ids, "pos_hw": embedded.pos_hw,
                 "rope_deltas": embedded.rope_deltas}
        logits = model.language_model(ids, inputs_embeds=embedded.inputs_embeds,
                                      cache=make_prompt_cache(model.language_model), **extra, **kwargs).logits
        return logits[0, -1]

    honoured = last_logits(attention_mask_4d=mask)  # the keyword mlx-vlm's generate passes
    assert mx.allclose(honoured, last_logits(mask=mask), atol=1e-6).item()
    assert mx.abs(honoured - last_logits(mask=mx.array(causal)[None, None])).max().item() > 1e-3


# ---------------------------------------------------------------------------------------------------- inkling
# Exact in tests/models/test_vlm_families.py as built there (log_scaling_n_floor unset); a checkpoint that sets the
# option is refused (`FamilySpec.refused_options`).


def _inkling_with_log_scaling(tiny_vlm_dir, floor: int | None):
    """The tiny Inkling build, its global layers' query scaling switched on from position `floor` (None: off)."""
    import mlx_vlm

    model, processor = mlx_vlm.load(str(tiny_vlm_dir("inkling")))
    model.config.text_config.log_scaling_n_floor = floor
    for layer in model.language_model.model.layers:
        if not layer.self_attn.is_sliding:
            layer.self_attn.log_floor = floor
    return model, processor


def test_inkling_with_log_scaling_is_refused_at_load(tiny_vlm_dir):
    from scheduler.models.families import INKLING_LOG_SCALING

    assert FAMILIES["inkling"].refused is None
    assert FAMILIES["inkling"].refused_options == (("text_config.log_scaling_n_floor", INKLING_LOG_SCALING),)
    Engine(*_inkling_with_log_scaling(tiny_vlm_dir, None)).close()
    with pytest.raises(UnsupportedFamily, match="'inkling' with text_config.log_scaling_n_floor set cannot be "
                                                "batched: mlx-vlm's Inkling attention scales"):
        Engine(*_inkling_with_log_scaling(tiny_vlm_dir, 2))


def test_inkling_log_scaling_reads_padded_positions(tiny_vlm_dir):
    """Why log scaling is refused. mlx-vlm's Inkling attention takes each query's position for its scaling (tau, in
    the global layers past log_scaling_n_floor) from the cache's key count, S - L, the same for every row of a
    batch. Two prompts of 5 and 12 tokens, each prefilled alone, merged into the engine's left-padded batch and
    decoded one token: without the scaling both rows get the logits they get alone; with it (floor 2) the longer
    (unpadded) row still does, the shorter one other logits (the scaling of its position plus its 7 pads). If
    mlx-vlm counts positions per row (its left_padding), this fails: lift the refusal."""
    from caches import layers

    rng = np.random.default_rng(0)
    prompts = [mx.array([rng.integers(10, 500, n).tolist()]) for n in (5, 12)]
    following = mx.array([[7], [9]])

    def apart(floor):  # max |batched - alone| of each row's logits
        lm = _inkling_with_log_scaling(tiny_vlm_dir, floor)[0].language_model
        alone, caches = [], []
        for i, ids in enumerate(prompts):  # as mlx_vlm.generate runs each: its own make_cache()
            cache = lm.make_cache()
            lm(ids, cache=cache)
            caches.append(cache)
            again = lm.make_cache()
            lm(ids, cache=again)
            alone.append(lm(following[i:i + 1], cache=again).logits[0, -1])
        batched = lm(following, cache=layers.merge_caches(caches)).logits[:, -1]
        return [mx.abs(batched[i] - alone[i]).max().item() for i in range(2)]

    assert max(apart(None)) < 1e-5
    short, longest = apart(2)
    assert short > 1e-2 and longest < 1e-5, (short, longest)


# ---------------------------------------------------------------------------------------------- molmo_point

_MOLMO_POINT_IDS = {"image_start_token_id": 448, "image_end_token_id": 449, "image_patch_id": 450,
                    "image_high_res_id": 450, "image_col_id": 451, "image_non_indexable_patch_id": 452,
                    "frame_start_token_id": 453, "frame_end_token_id": 454, "patch_token_id": 455,
                    "subpatch_token_id": 456, "location_token_id": 457}  # in the additional vocabulary (448..511)


def _tiny_molmo_point():
    """MolmoPoint at hidden 64: Molmo 2's decoder (2 layers, a base vocabulary of 448 and 64 additional ids), a
    1-layer ViT of width 32 on 56-pixel crops of 4x4 patches, the connector and the point predictor (patch keys of
    32); random weights, float32."""
    from mlx_vlm.models import molmo_point

    config = molmo_point.config
    text = config.TextConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                             vocab_size=448, additional_vocab_size=64, num_hidden_layers=2, intermediate_size=128,
                             rope_theta=10000.0)
    vision = config.VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=2, head_dim=16, image_default_input_size=(56, 56),
                                 image_patch_size=14, image_num_pos=16)
    adapter = config.AdapterConfig(vit_layers=(-1,), hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                                   head_dim=16, intermediate_size=64, text_hidden_size=64)
    mx.random.seed(0)
    model = molmo_point.Model(config.ModelConfig(text_config=text, vision_config=vision, adapter_config=adapter,
                                                 patch_embed_dim=32, **_MOLMO_POINT_IDS))
    mx.eval(model.parameters())
    return model


def _molmo_point_request(side: int, seed: int) -> tuple[mx.array, dict]:
    """A prompt with one image of one crop whose 4x4 patches are pooled 2x2 into side x side rows (side <= 2), and
    the processor's tensors for it; the merge counts a prompt's images by its <im_end> tokens (two an image)."""
    rng = np.random.default_rng(seed)
    patches = np.arange(16).reshape(4, 4)
    pooling = [patches[r:r + 2, c:c + 2].reshape(-1) for r in range(0, 2 * side, 2) for c in range(0, 2 * side, 2)]
    ids = _MOLMO_POINT_IDS
    prompt = [1, 2, ids["image_start_token_id"]] + [ids["image_patch_id"]] * side * side \
        + [ids["image_end_token_id"]] * 2 + [3, 4]
    return mx.array([prompt]), {"pixel_values": mx.array(rng.normal(size=(1, 16, 14 * 14 * 3)).astype(np.float32)),
                                "image_token_pooling": mx.array(np.stack(pooling)),
                                "image_grids": mx.array([[side, side, 0, 0]]), "image_num_crops": mx.array([1])}


def test_molmo_point_is_refused_at_load():
    assert FAMILIES["molmo_point"].refused
    with pytest.raises(UnsupportedFamily, match="'molmo_point' cannot be batched: mlx-vlm's MolmoPoint keeps the last "
                                                "embedded prompt's image state on the model instance"):
        Engine(_tiny_molmo_point(), None)


def test_molmo_point_decodes_against_the_image_state_of_the_prompt_embedded_last():
    """Why molmo_point is refused: its language_model is the model itself, and a decode forward (token ids, no
    embeddings) scores point tokens past the vocabulary (one per pooled patch of the image, a no-more-points id, the
    subpatches, 9 locations) against the image state that get_input_embeddings and the first prefill forward leave
    on the instance. Request A (4 pooled patches) decodes with 512 + 4 + 1 + 4 + 9 = 530 logits; once request B (1
    pooled patch) is embedded and prefilled, A's next decode step has B's 527, scored against B's image. If a decode
    forward stops reading the instance's image state, this fails: look again."""
    from mlx_vlm.models.cache import make_prompt_cache

    model = _tiny_molmo_point()
    assert model.language_model is model

    def prefill(side: int, seed: int):
        ids, inputs = _molmo_point_request(side, seed)
        embeds = model.get_input_embeddings(ids, **inputs).inputs_embeds
        cache = make_prompt_cache(model.lm)
        return cache, model(ids, inputs_embeds=embeds, cache=cache).logits

    step = mx.array([[5]])
    cache, logits = prefill(2, 0)
    assert logits.shape[-1] == 530
    assert model(step, cache=cache).logits.shape[-1] == 530  # A's own decode step
    cache, _ = prefill(2, 0)
    _, other = prefill(1, 1)  # another request embedded and prefilled
    assert other.shape[-1] == 527
    assert model(step, cache=cache).logits.shape[-1] == 527  # A's decode step, scored against B's image
