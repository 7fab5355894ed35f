"""How a family's language model places tokens, as two small strategies (``FamilySpec.positions``).

``RopePositions``  plain 1-D RoPE: the language model derives every position from the row's cache offset, so
                   no position is passed and every rope delta is 0.
``MRopePositions`` Qwen2/2.5/3-VL, Qwen3.5: a prompt's (3, 1, L) positions (temporal, height, width), as the
                   language model's ``get_rope_index`` computes them: image / video tokens get grid positions and
                   the text after each block continues from that block's largest position + 1. The rope delta is
                   ``max_position + 1 - L``; a row's next position is then (tokens in its cache + its delta) on
                   all three axes, which is what mlx-vlm's own decode step computes from the state it keeps on
                   the model instance. We pass explicit positions on every call instead, so that state
                   (``_position_ids`` / ``_rope_deltas``, one per model, not per row) is never read or written
                   and rows with different deltas batch correctly.
                   MiniCPM-V 4.7 (``FamilySpec.canvas_positions``): the prompt's positions from mlx-vlm's own
                   ``CanvasRoPE`` (``canvas_index``), each image's thumbnail and slices on one 2-D canvas.

Per-row position state lives in the executor (one delta per row), never on the model object.

Why our own ``mrope_index`` and not mlx-vlm's ``get_rope_index``: theirs builds each block with a dozen small MLX
ops and reads them back (``.item()``, ``.tolist()``), about 0.6 ms a prompt on a 2-core x86 CPU, 8% of the
16-image benchmark's run (bench/README.md, issue 18 table, session 35); this is the same integer arithmetic in
numpy. The families differ only in where video frames go: Qwen2/2.5-VL give a video one block whose temporal
axis counts its frame groups; Qwen3-VL and Qwen3.5 split it into one block per frame group (their processors put
a vision-start token and a timestamp before each), each with temporal position 0
(``FamilySpec.video_block_per_frame``). tests/models/test_positions.py holds it equal to each family's
``get_rope_index`` (images, videos, images and videos in one prompt, masks, text only), so a change in mlx-vlm
fails there first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from scheduler.models import library
from scheduler.models.families import FamilySpec, Positions


class RopePositions:
    def prompt(self, model: Any, ids: mx.array, media_inputs: dict, mask: mx.array | None) -> tuple[None, int]:
        return None, 0

    def prefill_kwargs(self, positions: mx.array | None, start: int, end: int) -> dict:
        return {}

    def decode_kwargs(self, cache: list, rope_deltas: mx.array | None, width: int = 1) -> dict:
        return {}


@dataclass(frozen=True)
class MRopeLayout:
    """What ``mrope_index`` reads from a model's config: the media token ids and the patch merge."""

    image_token: int
    video_token: int
    vision_start: int
    spatial_merge: int
    video_block_per_frame: bool = False


def mrope_index(tokens: np.ndarray, mask: np.ndarray, layout: MRopeLayout | None, image_grids: np.ndarray | None,
                video_grids: np.ndarray | None) -> tuple[np.ndarray, int]:
    """(3, L) int64 positions and the rope delta of one prompt (``tokens``, ``mask``: (L,)), as ``get_rope_index``
    computes them for a batch of one, quirks included: masked-out columns get position 1; with grids, the delta
    counts the kept tokens, without them the whole row."""
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    keep = np.asarray(mask).reshape(-1) == 1
    length = tokens.shape[0]
    if image_grids is None and video_grids is None:  # text only: positions count the kept tokens
        positions = np.cumsum(keep.astype(np.int64)) - 1
        positions[~keep] = 1
        delta = int(positions.max()) + 1 - length if length else 0
        return np.broadcast_to(positions, (3, length)).copy(), delta
    images = [tuple(int(x) for x in row) for row in np.asarray(image_grids).reshape(-1, 3)] \
        if image_grids is not None else []
    videos = [tuple(int(x) for x in row) for row in np.asarray(video_grids).reshape(-1, 3)] \
        if video_grids is not None else []
    if layout.video_block_per_frame:
        videos = [(1, h, w) for t, h, w in videos for _ in range(t)]
    kept = tokens[keep]
    after_start = kept[1:][kept[:-1] == layout.vision_start]
    # a family whose videos share the image token (ERNIE 4.5 VL) counts each block once, as an image (its
    # get_rope_index tests the image token first)
    remaining = {"image": int(np.sum(after_start == layout.image_token)),
                 "video": int(np.sum(after_start == layout.video_token)) if layout.video_token != layout.image_token
                 else 0}
    grids = {"image": iter(images), "video": iter(videos)}
    where = {"image": np.flatnonzero(kept == layout.image_token), "video": np.flatnonzero(kept == layout.video_token)}
    pieces: list[np.ndarray] = []
    next_position, cursor = 0, 0
    for _ in range(remaining["image"] + remaining["video"]):
        found = {}
        for kind in ("image", "video"):
            at = where[kind][where[kind] >= cursor] if remaining[kind] > 0 else ()
            if remaining[kind] > 0 and len(where[kind]) and not len(at):
                raise ValueError(f"no {kind} token after position {cursor} for the {kind} block the prompt announces")
            found[kind] = int(at[0]) if len(at) else len(kept) + 1
        kind = "image" if found["image"] < found["video"] else "video"
        remaining[kind] -= 1
        try:
            t, h, w = next(grids[kind])
        except StopIteration:
            raise ValueError(f"the prompt has more {kind} blocks than {kind} grids") from None
        h, w = h // layout.spatial_merge, w // layout.spatial_merge
        if t * h * w == 0:
            raise ValueError(f"an empty {kind} grid ({t}, {h}, {w} after the merge)")
        text_len = found[kind] - cursor
        pieces.append(np.broadcast_to(np.arange(text_len) + next_position, (3, text_len)))
        grid = np.stack([np.repeat(np.arange(t), h * w), np.tile(np.repeat(np.arange(h), w), t),
                         np.tile(np.arange(w), t * h)]) + text_len + next_position
        pieces.append(grid)
        next_position = int(grid.max()) + 1
        cursor = found[kind] + t * h * w
    if cursor < len(kept):
        pieces.append(np.broadcast_to(np.arange(len(kept) - cursor) + next_position, (3, len(kept) - cursor)))
    compact = np.concatenate(pieces, axis=1) if pieces else np.zeros((3, 0), dtype=np.int64)
    if compact.shape[1] != len(kept):
        raise ValueError(f"the media grids cover {compact.shape[1]} positions of a {len(kept)}-token prompt")
    positions = np.ones((3, length), dtype=np.int64)
    positions[:, keep] = compact
    return positions, (int(compact.max()) + 1 - len(kept)) if compact.size else 0


def canvas_index(model: Any, tokens: np.ndarray, mask: np.ndarray, crop_grids: Any) -> tuple[np.ndarray, int]:
    """(3, L) positions and the rope delta of one prompt laid out as MiniCPM-V 4.7 lays it (``mrope_mode``
    "canvas"): each image's thumbnail and slices on one 2-D canvas, its markers at the canvas' edges, the text after
    it from the canvas' origin + max(height, width) + 1. This is mlx-vlm's own ``CanvasRoPE`` (numpy already), fed
    as its ``get_input_embeddings`` feeds it: the crop grids (the processor's ``tgt_sizes``, one (rows, cols) of
    patches per run of image or video tokens, in prompt order) split by the run's kind; the delta counts the whole
    row, as there."""
    config = model.config
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    kinds = np.where(tokens == config.image_token_id, 1, np.where(tokens == config.video_token_id, 2, 0))
    starts = np.flatnonzero((kinds != 0) & (np.concatenate(([0], kinds[:-1])) != kinds))
    grids = np.asarray(crop_grids[0] if isinstance(crop_grids, (list, tuple)) else crop_grids).reshape(-1, 2) \
        if crop_grids is not None else np.zeros((0, 2), dtype=np.int64)
    if len(grids) != len(starts):
        raise ValueError(f"{len(grids)} crop grids for {len(starts)} runs of media tokens")
    sizes = {kind: np.asarray([g for g, s in zip(grids, starts) if kinds[s] == kind]).reshape(-1, 2) for kind in (1, 2)}
    positions, _ = library.canvas_rope(config).get_rope_index(tokens[None], mm_token_type_ids=kinds[None],
                                                              target_sizes=sizes[1], target_sizes_videos=sizes[2],
                                                              downsample_mode=config.downsample_mode,
                                                              attention_mask=np.asarray(mask).reshape(1, -1))
    positions = positions[:, 0].astype(np.int64)
    return positions, int(positions.max()) + 1 - len(tokens) if len(tokens) else 0


class MRopePositions:
    def __init__(self, video_block_per_frame: bool, canvas: bool = False):
        self.video_block_per_frame = video_block_per_frame
        self.canvas = canvas

    def prompt(self, model: Any, ids: mx.array, media_inputs: dict, mask: mx.array | None) -> tuple[mx.array, int]:
        tokens = np.array(ids).reshape(-1)
        keep = np.ones_like(tokens) if mask is None else np.array(mask).reshape(-1)
        if self.canvas:
            positions, delta = canvas_index(model, tokens, keep, media_inputs.get("tgt_sizes"))
            return mx.array(positions.astype(np.int32))[:, None, :], delta
        grids = [media_inputs.get(name) for name in ("image_grid_thw", "video_grid_thw")]
        # the media token ids matter only with grids: a prompt without them (text, or a family whose media take
        # plain positions, MiniCPM-V 4.6) counts its tokens, and its config need not name them
        layout = MRopeLayout(*library.mrope_tokens(model), video_block_per_frame=self.video_block_per_frame) \
            if any(g is not None for g in grids) else None
        positions, delta = mrope_index(tokens, keep, layout, *(None if g is None else np.array(g) for g in grids))
        return mx.array(positions.astype(np.int32))[:, None, :], delta

    def prefill_kwargs(self, positions: mx.array, start: int, end: int) -> dict:
        return {"position_ids": positions[:, :, start:end]}

    def decode_kwargs(self, cache: list, rope_deltas: mx.array, width: int = 1) -> dict:
        """(3, B, width) positions of the next ``width`` tokens of every row (computed before the forward
        moves the offsets)."""
        offsets = library.row_offsets(cache)
        deltas = rope_deltas if isinstance(rope_deltas, mx.array) and rope_deltas.dtype == mx.int32 \
            else mx.array(rope_deltas).astype(mx.int32)
        deltas = deltas.reshape(-1) if deltas.ndim != 1 else deltas
        if deltas.shape[0] != offsets.shape[0]:
            raise ValueError(f"{deltas.shape[0]} rope deltas for a batch of {offsets.shape[0]} rows")
        positions = (offsets + deltas)[:, None]
        if width > 1:  # (a plain decode step's one position needs no range: fewer ops on a tick of a tiny model)
            positions = positions + mx.arange(width, dtype=mx.int32)[None]
        return {"position_ids": mx.broadcast_to(positions[None], (3, *positions.shape))}


def for_family(spec: FamilySpec) -> RopePositions | MRopePositions:
    """The positions strategy a family declares."""
    if spec.positions is Positions.MROPE:
        return MRopePositions(video_block_per_frame=spec.video_block_per_frame, canvas=spec.canvas_positions)
    return RopePositions()
