"""Spliced images: the families whose merge cuts the prompt's embeddings at an image's ids and puts the image's
feature rows in their place, as many rows as the tower gives, not one per id (mlx-vlm's LLaVA-style merges: Bunny,
Janus, Phi-4-reasoning-vision write ONE id per image; LLaVA-NeXT's processor writes its HF feature count, and
mlx-vlm's merge puts a block per view and as many newline blocks there). Their embedded prompt is longer than their
token ids, and ``mlx_vlm.generate`` prefills, positions and caches the embedded length.

The scheduler plans everything on token ids, one embedding row per id: prefill chunks, the KV budget, the context
limit, the prefix cache's keys, replay. So ``VLMAdapter.prepare`` rewrites each image's run of ids as one id per
row (``expand``), from what is known before the tower runs (``image_runs``, by the family's
``FamilySpec.splice``), and the encoders get each image back as the run their merge expects (``collapse``, or a
unit of the image's one id). Every id of the expanded prompt then has its row, at the position
``mlx_vlm.generate`` gives it. A row count the merge contradicts is caught where the encoders' output is cut up
(``VLMAdapter``'s length check), so a wrong rule fails the request loudly, never shifts its text.

A run is ``(ids, rows)``: how many ids of the processor's prompt an image holds (consecutive image ids), and how
many rows the merge gives it.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from scheduler.models import library
from scheduler.models.families import SpliceRows

Run = tuple[int, int]  # (the image's ids in the processor's prompt, its rows in the merge)


def image_runs(rule: SpliceRows, model: Any, media_inputs: dict[str, Any], ids: Sequence[int], marker: int,
               num_images: int) -> tuple[Run, ...]:
    """Each of a request's ``num_images`` images as a run, in prompt order, from the processor's ``ids`` and media
    tensors and the config; ValueError where the rule cannot count them."""
    if rule is SpliceRows.TOWER_GRID:
        vision = model.config.vision_config
        side = vision.image_size // vision.patch_size
        return ((1, side * side),) * num_images
    if rule is SpliceRows.VALID_PATCHES:
        valid = np.asarray(media_inputs["pixel_attention_mask"]).reshape(num_images, -1)
        return tuple((1, int(n)) for n in valid.astype(bool).sum(axis=1))
    if rule is SpliceRows.VIEW_BLOCKS:
        # mlx-vlm's llava_next merge: the tower's rows of each view of the (first) image, then as many image_newline
        # blocks of the same shape, cut to as many blocks as the image has ids (zip over the image id positions)
        if num_images != 1:
            raise ValueError(f"{num_images} images: mlx-vlm's {model.config.model_type} merge takes one a prompt")
        held = sum(1 for t in ids if t == marker)
        views = int(media_inputs["pixel_values"].shape[1])
        return ((held, min(held, 2 * views) * library.tower_rows_per_view(model)),)
    raise ValueError(f"no row count for {rule}")


def _sources(ids: Sequence[int], marker: int, runs: Sequence[Run], forward: bool) -> list[int]:
    """For each position of the rewritten prompt, the position of ``ids`` it comes from: an image's run of
    ``runs[k]`` ids (forward: from its ids to its rows; else back) all from the run's first position. Text passes
    through; so do positions past the prompt (re-fed outputs, never the marker)."""
    sources: list[int] = []
    i, k = 0, 0
    while i < len(ids):
        if ids[i] != marker:
            sources.append(i)
            i += 1
            continue
        if k == len(runs):
            raise ValueError(f"the prompt holds more image ids ({marker}) than its {len(runs)} image(s) take")
        take, give = runs[k] if forward else runs[k][::-1]
        if list(ids[i: i + take]) != [marker] * take:
            raise ValueError(f"the prompt's image ids ({marker}) do not match its images' runs {tuple(runs)}")
        sources += [i] * give
        i += take
        k += 1
    if k != len(runs):
        raise ValueError(f"the prompt holds {k} image(s) of {len(runs)}: the processor wrote their ids ({marker}) "
                         "otherwise")
    return sources


def expand(ids: Sequence[int], marker: int, runs: Sequence[Run]) -> list[int]:
    """``ids`` with each image's run of ids written once per row of the merge."""
    return [int(ids[i]) for i in _sources(ids, marker, runs, forward=True)]


def collapse(ids: Sequence[int], marker: int, runs: Sequence[Run]) -> list[int]:
    """The inverse of ``expand``, on a prompt that may go on past it (re-fed outputs)."""
    return [int(ids[i]) for i in _sources(ids, marker, runs, forward=False)]


def expand_along(values: Any, ids: Sequence[int], marker: int, runs: Sequence[Run]) -> np.ndarray:
    """A (1, L) per-id array over ``ids`` (the processor's attention mask) laid over the expanded ids."""
    return np.asarray(values).reshape(1, -1)[:, _sources(ids, marker, runs, forward=True)]


def collapse_along(values: Any, ids: Sequence[int], marker: int, runs: Sequence[Run]) -> np.ndarray:
    """A (1, L) per-id array over the expanded ``ids``, laid back over the collapsed prompt."""
    return np.asarray(values).reshape(1, -1)[:, _sources(ids, marker, runs, forward=False)]
