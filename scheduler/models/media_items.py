"""A request's media tensors split into items: each image's (or video's) own encoder inputs, the prompt positions
it fills and the tensors its content key hashes, by the layout the family's processor gives them
(``FamilySpec.item_split``):

``GRID``         the Qwen processors: every item's patch rows flattened into one ``pixel_values`` (or
                 ``pixel_values_videos``) with one ``*_grid_thw`` row each; an item fills
                 ``prod(grid row) / merge**2`` positions, and a video counts its temporal patches.
``STACK``        one image per index of ``pixel_values`` axis 0, all of one size (llava: the processor resizes
                 every image to the tower's size), each filling an equal share of the positions (the merge
                 fills them in stack order).
``SIZED_STACK``  ``pixel_values`` (N, C, H, W) padded to the request's largest image, with each image's own
                 ``image_sizes`` row (mistral3, pixtral); an image fills ``(h / patch / merge) x (w / patch / merge)``
                 positions and is cut to its own size, so it hashes and encodes the same whatever images share its
                 request (the tower crops each image to its size: its padding is never read).
``TILES``        ``pixel_values`` (1, views, C, H, W): each image's tile views, then its global view, every view
                 filling an equal share of the positions (idefics3, smolvlm); an image ends with the view whose
                 positions follow the processor's global-image tag. Only where no view is padded (its
                 ``pixel_attention_mask`` all set): a padded view's tensors would depend on the other images.
``PACKED``       ``pixel_values`` (images, patches, patch pixels): each image's patches packed and padded to the
                 processor's ``max_num_patches`` (not to the request's largest image), with its
                 ``pixel_attention_mask`` and ``spatial_shapes`` rows (phi4-siglip's NaFlex processor); an image
                 fills as many positions as its mask sets (its spliced rows, ``splice.py``). It is kept padded: the
                 tower gives other rows for the valid patches alone (0.09 apart on the tiny build).
``WHOLE``        not split (audio; gemma3, see ``families.py``): the request's media are one unit.

A split that does not give the request's items (``num_items``: its images and videos), or does not account for
exactly the prompt's media positions, or tensors the layout does not name, gives ``None``: the media are then
keyed and encoded whole, as for ``WHOLE``. An item encoded alone gives the rows of its share of a call over the
whole request up to the BLAS's rounding on other row counts (bitwise with the wheel's BLAS, a few 1e-7 under
OpenBLAS: tests/models/test_vision_batch.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from scheduler.models import library
from scheduler.models.families import ItemSplit

_GRID_PIXELS = {"image_grid_thw": "pixel_values", "video_grid_thw": "pixel_values_videos"}  # the Qwen processors'


@dataclass(frozen=True)
class ItemInputs:
    """One media item's share of a request's media tensors."""

    tokens: int  # prompt positions it fills
    count: int  # encoder-budget units: 1 per image, ``grid_t`` per video (``num_media_items``)
    parts: tuple  # what its content key hashes: tensor names and host arrays
    inputs: dict[str, mx.array]  # its encoder inputs, by the processor's names (evaluated)


@dataclass(frozen=True)
class RequestMedia:
    """What a split reads besides the tensors: the prompt and the processor's tags."""

    ids: Sequence[int]  # the expanded prompt ids
    positions: Sequence[int]  # its media positions, in order
    num_items: int  # the request's images and videos
    processor: Any


def split_items(split: ItemSplit, model: Any, media_inputs: dict[str, Any], request: RequestMedia
                ) -> list[ItemInputs] | None:
    """The items of one request's media, in prompt order, or None where they are keyed and encoded whole."""
    if split is ItemSplit.WHOLE:
        return None
    items = _SPLITS[split](model, media_inputs, request)
    if not items or len(items) != request.num_items or sum(item.tokens for item in items) != len(request.positions):
        return None
    # Evaluated here: a lazy slice belongs to this thread's stream, and the encoders run on the engine's thread
    # (AsyncEngine prepares on a worker), where evaluating it fails ("no Stream(cpu, N) in current thread";
    # tests/models/test_vlm_families.py, the AsyncEngine test's two-image request).
    mx.eval([value for item in items for value in item.inputs.values()])
    return items


def _host(values: mx.array) -> np.ndarray:
    """The array to hash (numpy has no bfloat16: its 16-bit words)."""
    return np.asarray(values.view(mx.uint16) if values.dtype == mx.bfloat16 else values)


def _grid(model: Any, media_inputs: dict[str, Any], request: RequestMedia) -> list[ItemInputs] | None:
    grids = [name for name in _GRID_PIXELS if name in media_inputs]
    if len(grids) != 1 or set(media_inputs) != {grids[0], _GRID_PIXELS[grids[0]]}:
        return None  # one kind of media per request (FamilySpec.mixed_image_video), nothing else
    grid_name, pixel_name = grids[0], _GRID_PIXELS[grids[0]]
    grid_values, pixel_values = mx.array(media_inputs[grid_name]), mx.array(media_inputs[pixel_name])
    grid = np.asarray(grid_values).astype(np.int64).reshape(-1, 3)
    pixels = _host(pixel_values)
    patches = grid.prod(axis=1)
    if int(patches.sum()) != pixels.shape[0]:
        return None
    merge = library.spatial_merge(model)
    bounds = np.concatenate([[0], np.cumsum(patches)]).tolist()
    videos = grid_name == "video_grid_thw"  # a video counts its temporal patches
    return [ItemInputs(int(n) // merge ** 2, int(grid[i][0]) if videos else 1,
                       (grid_name, grid[i], pixel_name, pixels[bounds[i]: bounds[i + 1]]),
                       {grid_name: grid_values[i: i + 1], pixel_name: pixel_values[bounds[i]: bounds[i + 1]]})
            for i, n in enumerate(patches)]


def _stack(model: Any, media_inputs: dict[str, Any], request: RequestMedia) -> list[ItemInputs] | None:
    if set(media_inputs) != {"pixel_values"}:
        return None
    pixel_values = mx.array(media_inputs["pixel_values"])
    pixels = _host(pixel_values)
    n, num_tokens = (pixels.shape[0] if pixels.ndim == 4 else 0), len(request.positions)
    if not n or num_tokens % n:
        return None
    return [ItemInputs(num_tokens // n, 1, ("pixel_values", pixels[i]), {"pixel_values": pixel_values[i: i + 1]})
            for i in range(n)]


def _sized_stack(model: Any, media_inputs: dict[str, Any], request: RequestMedia) -> list[ItemInputs] | None:
    if set(media_inputs) != {"pixel_values", "image_sizes"}:
        return None
    pixel_values, sizes = mx.array(media_inputs["pixel_values"]), mx.array(media_inputs["image_sizes"])
    pixels = _host(pixel_values)
    rows = np.asarray(sizes).astype(np.int64).reshape(-1, 2)
    if pixels.ndim != 4 or rows.shape[0] != pixels.shape[0]:
        return None
    patch, merge = library.patch_grid(model)
    items = []
    for i, (h, w) in enumerate(rows.tolist()):
        if not (0 < h <= pixels.shape[2] and 0 < w <= pixels.shape[3]):
            return None
        items.append(ItemInputs((h // patch // merge) * (w // patch // merge), 1,
                                ("image_sizes", rows[i], "pixel_values", pixels[i, :, :h, :w]),
                                {"pixel_values": pixel_values[i: i + 1, :, :h, :w], "image_sizes": sizes[i: i + 1]}))
    return items


def _tiles(model: Any, media_inputs: dict[str, Any], request: RequestMedia) -> list[ItemInputs] | None:
    if set(media_inputs) != {"pixel_values", "pixel_attention_mask"}:
        return None
    pixel_values, pixel_mask = mx.array(media_inputs["pixel_values"]), mx.array(media_inputs["pixel_attention_mask"])
    if pixel_values.ndim != 5 or pixel_values.shape[0] != 1 or pixel_mask.shape[:2] != pixel_values.shape[:2]:
        return None
    if not bool(mx.all(pixel_mask).item()):
        return None
    tag = library.global_image_token_id(request.processor)
    views, positions = pixel_values.shape[1], request.positions
    if tag is None or not views or len(positions) % views:
        return None
    per_view = len(positions) // views
    # the views whose first position follows the tag are the global ones: an image ends with its own
    firsts = [positions[v * per_view] for v in range(views)]
    ends = [v + 1 for v, first in enumerate(firsts) if first > 0 and request.ids[first - 1] == tag]
    if not ends or ends[-1] != views:
        return None
    pixels, mask = _host(pixel_values), np.asarray(pixel_mask)
    items, start = [], 0
    for end in ends:
        inputs = {"pixel_values": pixel_values[:, start:end], "pixel_attention_mask": pixel_mask[:, start:end]}
        items.append(ItemInputs((end - start) * per_view, 1,
                                ("pixel_attention_mask", mask[:, start:end], "pixel_values", pixels[:, start:end]),
                                inputs))
        start = end
    return items


def _packed(model: Any, media_inputs: dict[str, Any], request: RequestMedia) -> list[ItemInputs] | None:
    if set(media_inputs) != {"pixel_values", "pixel_attention_mask", "spatial_shapes"}:
        return None
    pixel_values, mask = mx.array(media_inputs["pixel_values"]), mx.array(media_inputs["pixel_attention_mask"])
    shapes = mx.array(media_inputs["spatial_shapes"])
    valid = np.asarray(mask).astype(bool)
    if pixel_values.ndim != 3 or valid.shape != pixel_values.shape[:2] or shapes.shape[0] != valid.shape[0]:
        return None
    pixels = _host(pixel_values)
    return [ItemInputs(int(row.sum()), 1, ("pixel_attention_mask", row, "spatial_shapes", np.asarray(shapes[i]),
                                           "pixel_values", pixels[i]),
                       {"pixel_values": pixel_values[i: i + 1], "pixel_attention_mask": mask[i: i + 1],
                        "spatial_shapes": shapes[i: i + 1]})
            for i, row in enumerate(valid)]


_SPLITS = {ItemSplit.GRID: _grid, ItemSplit.STACK: _stack, ItemSplit.SIZED_STACK: _sized_stack,
           ItemSplit.TILES: _tiles, ItemSplit.PACKED: _packed}
