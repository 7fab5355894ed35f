"""Model-type names against mlx-vlm's own: every vision-language package mlx-vlm ships is a row of the family
table, a type left out with its reason (`LEFT_OUT`), or out of scope here (below: not a generative
image/video/audio-to-text model, or a text-only one); the other names mlx-vlm loads a row's model under
(`MODEL_REMAPPING`) resolve to that row (`ALIASES`, each tested here under its alias) or are listed with why they do
not. An mlx-vlm upgrade that adds a package or an alias fails here, naming it."""

from __future__ import annotations

import json
import os

import pytest

from scheduler.models.families import ALIASES, FAMILIES, LEFT_OUT

# mlx-vlm 0.7.10 packages with a vision, audio or processing module that are not generative image/video/audio-to-text
# models (or are text-only ones: mlx-lm's text family table covers those that decode)
OUT_OF_SCOPE = {
    "d1_omni": "a decision model: scores a question's options with a head over a bidirectional trunk",
    "flint": "a text-only mixture-of-experts decoder; its get_input_embeddings ignores pixel_values",
    "gpt_oss": "text only (its processing module fills the tokenizer's Harmony response template)",
    "laguna": "text only (a tokenizer-only processor)",
    "embedding_gemma2": "an embedding model (mean-pooled vectors)",
    "falcon_perception": "a detector and segmenter: boxes and masks from heads over its hidden states",
    "hrm_text": "text only",
    "diffusion_gemma": "generates text by diffusion denoising of masked blocks, not token by token",
    "minimax_h3": "a video and audio generator (VAE decoders, a diffusion scheduler)",
    "moge3": "monocular geometry estimation (point, depth and normal maps)",
    "rfdetr": "an object detector",
    "rt_detr_v2": "an object detector",
    "sam3": "open-vocabulary detection, segmentation and tracking (masks and boxes, no text)",
    "sam3_1": "open-vocabulary detection, segmentation and tracking (masks and boxes, no text)",
    "sam3d_body": "3-D body mesh recovery",
    "sam3d_objects": "3-D object reconstruction",
    "video_depth_anything": "video depth estimation",
}

# aliases mlx-vlm loads as a batched row's model that do not resolve to it here, with why
UNRESOLVED_ALIASES = {
    "granite4-vision": "mlx-vlm's chat formatting is keyed by model type and writes no image placeholder under this "
                       "name: solo mlx_vlm.generate of a renamed tiny build fails (0 <image> tokens for 1 image)",
    "granite-vision": "as granite4-vision (Granite Vision 3's row): solo mlx_vlm.generate of a renamed tiny build "
                      "fails (0 <image> tokens for 1 image)",
    "cohere2_vision": "Command A Vision: mlx-vlm loads it with Aya Vision's model, but its checkpoints bring another "
                      "processor (transformers' Cohere2VisionProcessor); not built or tested",
    "nemotron_h_omni": "a tiny Nemotron-3 Nano Omni build renamed to it does not load: transformers finds no "
                       "processor class for the name",
    "nemotronh_nano_omni_reasoning_v3": "as nemotron_h_omni",
}


def _packages() -> list[str]:
    import mlx_vlm.models

    root = mlx_vlm.models.__path__[0]
    return sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)) and not d.startswith("__")
                  and any(f.endswith(".py") and any(k in f for k in ("vision", "audio", "process"))
                          for f in os.listdir(os.path.join(root, d))))


def test_every_vision_language_package_of_mlx_vlm_is_classified():
    from mlx_vlm.utils import MODEL_REMAPPING

    packages = _packages()
    rows_by_package = {MODEL_REMAPPING.get(name, name) for name in FAMILIES}
    unclassified = [p for p in packages if p not in rows_by_package and p not in LEFT_OUT and p not in OUT_OF_SCOPE]
    assert not unclassified, f"mlx-vlm packages with no row, no LEFT_OUT reason and not out of scope: {unclassified}"
    assert not set(OUT_OF_SCOPE) & (set(FAMILIES) | set(LEFT_OUT))
    assert set(OUT_OF_SCOPE) <= set(packages) and set(LEFT_OUT) <= set(packages)  # no stale entry


def test_left_out_types_are_in_the_readmes_list():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert [name for name in LEFT_OUT if f"`{name}`" not in readme] == []


def test_every_alias_of_a_batched_row_resolves_or_says_why_not():
    from mlx_vlm.utils import MODEL_REMAPPING

    batched = {name for name, spec in FAMILIES.items() if not spec.refused}
    assert {alias: MODEL_REMAPPING.get(alias) for alias in ALIASES} == ALIASES  # mlx-vlm's names, as ours
    of_rows = {alias for alias, package in MODEL_REMAPPING.items() if package in batched and alias != package}
    assert of_rows == set(ALIASES) | set(UNRESOLVED_ALIASES)
    assert not set(ALIASES) & set(FAMILIES)


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_a_checkpoint_under_an_alias_batches_as_its_row(alias, tmp_path):
    """A row's tiny build with its config's model_type renamed to the alias: mlx_vlm.load keeps that name on the
    config, the engine takes the row, and a text request, an image request and a two-image request batched together
    equal mlx_vlm.stream_generate alone."""
    import mlx_vlm

    from scheduler import Engine, SamplingParams
    from scheduler.fixtures.vlm_families import build_tiny_vlm

    from ..helpers import drive
    from .test_vlm_families import FAMILY_CASES, MAX_TOKENS, solo, workload

    row = ALIASES[alias]
    model_dir = FAMILY_CASES[row].build(tmp_path / "model") if row in FAMILY_CASES else build_tiny_vlm(
        row, tmp_path / "model")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(dict(config, model_type=alias)))
    model, processor = mlx_vlm.load(str(model_dir))
    assert model.config.model_type == alias
    engine = Engine(model, processor)
    assert engine._runner.adapter.spec is FAMILIES[row]
    requests = [r for r in workload(FAMILIES[row].images_per_request) if len(r[1]) <= 2][:3]
    references = [list(solo(model, processor, messages, images).token_ids) for messages, images in requests]
    run = drive(engine, [(0, {"prompt": m, "images": im, "sampling": SamplingParams(max_tokens=MAX_TOKENS)})
                         for m, im in requests])
    assert list(run.tokens.values()) == references
