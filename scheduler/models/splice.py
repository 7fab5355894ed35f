"""Spliced images: the families whose input preparation writes ONE id per image and whose merge cuts the prompt's
embeddings at that id and puts the image's feature rows in its place (mlx-vlm's LLaVA-style merges: Bunny, Janus).
Their embedded prompt is longer than their token ids, by each image's rows less one, and ``mlx_vlm.generate``
prefills, positions and caches the embedded length.

The scheduler plans everything on token ids, one embedding row per id: prefill chunks, the KV budget, the context
limit, the prefix cache's keys, replay. So ``VLMAdapter.prepare`` expands each image's one id into as many ids as
the merge gives it rows (``expand``), from what is known before the tower runs (``image_rows``, by the family's
``FamilySpec.splice``), and the encoders get each image back as the one id their merge expects (``collapse``, or a
unit of one id per image). Every id of the expanded prompt then has its row, at the position ``mlx_vlm.generate``
gives it. A row count the merge contradicts is caught where the encoders' output is cut up (``VLMAdapter``'s
length check), so a wrong rule fails the request loudly, never shifts its text.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from scheduler.models.families import SpliceRows


def image_rows(rule: SpliceRows, model: Any, media_inputs: dict[str, Any], num_images: int) -> tuple[int, ...]:
    """The embedding rows each of a request's ``num_images`` images becomes in the merge, in prompt order."""
    if rule is SpliceRows.TOWER_GRID:
        vision = model.config.vision_config
        side = vision.image_size // vision.patch_size
        return (side * side,) * num_images
    if rule is SpliceRows.VALID_PATCHES:
        valid = np.asarray(media_inputs["pixel_attention_mask"]).reshape(num_images, -1)
        return tuple(int(n) for n in valid.astype(bool).sum(axis=1))
    raise ValueError(f"no row count for {rule}")


def _check_markers(ids: Sequence[int], marker: int, images: int) -> None:
    found = sum(1 for t in ids if t == marker)
    if found != images:
        raise ValueError(f"the processor wrote {found} image ids ({marker}) for {images} image(s)")


def expand(ids: Sequence[int], marker: int, rows: Sequence[int]) -> list[int]:
    """``ids`` with its k-th ``marker`` written ``rows[k]`` times: one id per embedding row of the merge."""
    _check_markers(ids, marker, len(rows))
    out: list[int] = []
    k = 0
    for t in ids:
        if t == marker:
            out.extend([marker] * rows[k])
            k += 1
        else:
            out.append(t)
    return out


def expand_along(values: np.ndarray, ids: Sequence[int], marker: int, rows: Sequence[int]) -> np.ndarray:
    """A (1, L) per-id array (the processor's attention mask) laid over the expanded ids: an image's one value
    repeated over its rows."""
    repeats = np.ones(len(ids), dtype=np.int64)
    at = [i for i, t in enumerate(ids) if t == marker]
    repeats[at] = rows
    return np.repeat(np.asarray(values).reshape(1, -1), repeats, axis=1)


def collapse(ids: Sequence[int], marker: int, rows: Sequence[int]) -> list[int]:
    """The inverse of ``expand`` on a prompt that may go on past it (re-fed outputs, never the marker): each
    image's run of ``rows[k]`` markers as one. Two images side by side make one run; ``rows`` cuts it."""
    out: list[int] = []
    i, k = 0, 0
    while i < len(ids):
        if ids[i] == marker:
            if k == len(rows) or list(ids[i: i + rows[k]]) != [marker] * rows[k]:
                raise ValueError(f"the prompt's image ids ({marker}) do not match its images' rows {tuple(rows)}")
            out.append(marker)
            i += rows[k]
            k += 1
        else:
            out.append(int(ids[i]))
            i += 1
    if k != len(rows):
        raise ValueError(f"the prompt holds {k} spliced images of {len(rows)}")
    return out


def collapse_along(values: np.ndarray, ids: Sequence[int], marker: int, rows: Sequence[int]) -> np.ndarray:
    """A (1, L) per-id array over the expanded ids, cut back to the collapsed prompt (an image's first value)."""
    keep, i, k = [], 0, 0
    while i < len(ids):
        keep.append(i)
        if ids[i] == marker and k < len(rows):
            i += rows[k]
            k += 1
        else:
            i += 1
    return np.asarray(values).reshape(1, -1)[:, keep]
