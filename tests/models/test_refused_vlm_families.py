"""Families mlx-vlm runs that the scheduler refuses at load (``FamilySpec.refused``): each is refused with its
reason, and a test pins the mlx-vlm behaviour that makes it unbatchable, so the refusal is looked at again when
mlx-vlm changes. Each section is self-contained."""

import pytest

from scheduler import Engine
from scheduler.models.families import FAMILIES, UnsupportedFamily

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
    import mlx.core as mx

    mask = mx.concatenate([mx.ones((1, 12)), mx.zeros((1, 4))], axis=1)
    return 12, (mx.random.normal((1, 16, 3 * 4 * 4)),), {"spatial_shapes": mx.array([[3, 4]]),
                                                          "pixel_attention_mask": mask}


def _fastvlm_image():
    import mlx.core as mx

    return 4, (mx.random.normal((1, 3, 128, 128)),), {}


def _bunny_image():
    import mlx.core as mx

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
def test_llava_splice_families_are_refused_at_load(model_type):
    """The model type a checkpoint's config.json carries is the one mlx_vlm.load resolves to the module (its
    MODEL_REMAPPING), is the model's config.model_type, and is refused with the splice named."""
    from mlx_vlm.utils import MODEL_REMAPPING

    module, build, _image = SPLICED[model_type]
    assert MODEL_REMAPPING[model_type] == module
    model = build()
    assert model.config.model_type == model_type
    assert "(-200)" in FAMILIES[model_type].refused
    with pytest.raises(UnsupportedFamily, match=f"'{model_type}' cannot be batched: mlx-vlm's .*merge replaces "
                       r".* placeholder id \(-200\) .* longer than its token ids"):
        Engine(model, None)


@pytest.mark.parametrize("model_type", sorted(SPLICED))
def test_llava_splice_embeds_an_image_id_as_many_rows(model_type):
    """The fact behind the refusal, on mlx-vlm's own tower and merge: a prompt of 5 ids holding one image id
    (-200, the id mlx-vlm's config and processor use) embeds as 4 + the image's rows (phi4-siglip: its valid
    packed patches; FastVLM: (image_size / 64)^2; Bunny: 729), where the scheduler plans one row per id."""
    import mlx.core as mx

    _module, build, image = SPLICED[model_type]
    model = build()
    index = getattr(model.config, "image_token_index", None)
    if index is None:  # phi4-siglip's merge reads its module's constant
        from mlx_vlm.models.phi4_siglip.phi4_siglip import IMAGE_TOKEN_INDEX as index
    assert index == SPLICE_ID
    rows, pixels, extra = image()
    ids = mx.array([[1, 2, SPLICE_ID, 3, 4]])
    embeds = model.get_input_embeddings(ids, *pixels, **extra).inputs_embeds
    mx.eval(embeds)
    assert embeds.shape == (1, 4 + rows, SPLICE_HIDDEN) and rows > 1
    text = model.language_model.model.embed_tokens(mx.array([1, 2, 3, 4]))  # the text around it, unmoved
    assert mx.array_equal(embeds[0, :2], text[:2]) and mx.array_equal(embeds[0, -2:], text[2:])
