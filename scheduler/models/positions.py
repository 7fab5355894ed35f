"""How a family's language model places tokens, as two small strategies (``FamilySpec.positions``).

``RopePositions``  plain 1-D RoPE: the language model derives every position from the row's cache offset, so
                   no position is passed and every rope delta is 0.
``MRopePositions`` Qwen2/2.5/3-VL: ``get_rope_index`` gives a prompt (3, 1, L) positions (temporal, height,
                   width); image / video tokens get grid positions and the text after them continues from the
                   largest position so far. The rope delta is ``max_position + 1 - L``; a row's next position is
                   then (tokens in its cache + its delta) on all three axes, which is what mlx-vlm's own decode
                   step computes from the state it keeps on the model instance. We pass explicit positions on
                   every call instead, so that state (``_position_ids`` / ``_rope_deltas``, one per model, not per
                   row) is never read or written and rows with different deltas batch correctly.

Per-row position state lives in the executor (one delta per row), never on the model object.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from scheduler.models import library
from scheduler.models.families import Positions


class RopePositions:
    def prompt(self, model: Any, ids: mx.array, media_inputs: dict, mask: mx.array | None) -> tuple[None, int]:
        return None, 0

    def prefill_kwargs(self, positions: mx.array | None, start: int, end: int) -> dict:
        return {}

    def decode_kwargs(self, cache: list, rope_deltas: mx.array | None, width: int = 1) -> dict:
        return {}


class MRopePositions:
    def prompt(self, model: Any, ids: mx.array, media_inputs: dict, mask: mx.array | None) -> tuple[mx.array, int]:
        positions, deltas = library.rope_index(model, ids, media_inputs.get("image_grid_thw"),
                                            media_inputs.get("video_grid_thw"), mask)
        length = ids.shape[1]
        if positions.ndim == 2:  # text only: the same position on every axis
            positions = mx.broadcast_to(positions[None], (3, *positions.shape))
        if positions.shape != (3, 1, length):
            raise ValueError(f"unexpected prompt position shape {tuple(positions.shape)}")
        delta = int(mx.array(deltas).reshape(-1)[0].item()) if deltas is not None else 0
        return positions.astype(mx.int32), delta

    def prefill_kwargs(self, positions: mx.array, start: int, end: int) -> dict:
        return {"position_ids": positions[:, :, start:end]}

    def decode_kwargs(self, cache: list, rope_deltas: mx.array, width: int = 1) -> dict:
        """(3, B, width) positions of the next ``width`` tokens of every row (computed before the forward
        moves the offsets)."""
        offsets = library.row_offsets(cache)
        deltas = mx.array(rope_deltas).reshape(-1).astype(mx.int32)
        if deltas.shape[0] != offsets.shape[0]:
            raise ValueError(f"{deltas.shape[0]} rope deltas for a batch of {offsets.shape[0]} rows")
        positions = (offsets + deltas)[:, None] + mx.arange(width, dtype=mx.int32)[None]
        return {"position_ids": mx.broadcast_to(positions[None], (3, *positions.shape))}


STRATEGIES = {Positions.ROPE: RopePositions(), Positions.MROPE: MRopePositions()}
