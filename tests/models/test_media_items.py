"""How a request's media tensors split into items (``scheduler/models/media_items.py``), on synthetic tensors: the
shares each layout gives, an item's tensors and key parts independent of the other images of its request, and
the fallbacks to keying the media whole. Real processors and towers: tests/models/test_vision_batch.py and the
chat-turn test of tests/models/test_vlm_families.py."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from caches.vision import content_key
from scheduler.models.families import ItemSplit
from scheduler.models.media_items import RequestMedia, split_items

GLOBAL_TAG = 5


def _request(positions, num_items, ids=None):
    ids = ids if ids is not None else [1] * (max(positions, default=0) + 2)
    return RequestMedia(ids, tuple(positions), num_items, SimpleNamespace(global_image_token_id=GLOBAL_TAG))


def _pixels(*shape, seed=0):
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def test_whole_is_not_split():
    assert split_items(ItemSplit.WHOLE, None, {"pixel_values": _pixels(2, 3, 4, 4)}, _request(range(8), 2)) is None


def test_a_stack_gives_equal_shares_in_order():
    pixels = _pixels(3, 3, 4, 4)
    items = split_items(ItemSplit.STACK, None, {"pixel_values": pixels}, _request(range(2, 14), 3))
    assert [(i.tokens, i.count) for i in items] == [(4, 1)] * 3
    for k, item in enumerate(items):
        assert mx.array_equal(item.inputs["pixel_values"], pixels[k:k + 1]).item()
    # the same image alone in another request: the same key parts
    alone = split_items(ItemSplit.STACK, None, {"pixel_values": pixels[1:2]}, _request(range(4), 1))
    assert content_key(alone[0].parts) == content_key(items[1].parts)


@pytest.mark.parametrize("positions, num_items, inputs", [
    (range(13), 3, {"pixel_values": _pixels(3, 3, 4, 4)}),  # 13 media tokens do not share out over 3 images
    (range(12), 2, {"pixel_values": _pixels(3, 3, 4, 4)}),  # 3 images where the request has 2
    (range(12), 3, {"pixel_values": _pixels(3, 3, 4, 4), "image_sizes": mx.array([[4, 4]] * 3)}),  # unknown tensor
])
def test_a_stack_that_does_not_fit_the_request_is_keyed_whole(positions, num_items, inputs):
    assert split_items(ItemSplit.STACK, None, inputs, _request(positions, num_items)) is None


PIXTRAL_LIKE = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(patch_size=14),
                                                      spatial_merge_size=2))


def test_a_sized_stack_cuts_each_image_to_its_size():
    """Two images padded to 84x84 (84x56 and 56x84): 3 x 2 and 2 x 3 merged patches; each item is its image cut
    to its size, so it hashes and encodes the same as that image alone in a request of its own."""
    tall, wide = _pixels(3, 84, 56, seed=1), _pixels(3, 56, 84, seed=2)
    stacked = mx.zeros((2, 3, 84, 84))
    stacked[0, :, :, :56] = tall
    stacked[1, :, :56, :] = wide
    sizes = mx.array([[84, 56], [56, 84]])
    items = split_items(ItemSplit.SIZED_STACK, PIXTRAL_LIKE, {"pixel_values": stacked, "image_sizes": sizes},
                        _request(range(12), 2))
    assert [i.tokens for i in items] == [6, 6]
    assert items[0].inputs["pixel_values"].shape == (1, 3, 84, 56)
    assert mx.array_equal(items[1].inputs["pixel_values"][0], wide).item()
    assert items[1].inputs["image_sizes"].tolist() == [[56, 84]]
    alone = split_items(ItemSplit.SIZED_STACK, PIXTRAL_LIKE, {"pixel_values": wide[None],
                                                              "image_sizes": mx.array([[56, 84]])},
                        _request(range(6), 1))
    assert content_key(alone[0].parts) == content_key(items[1].parts)
    bad_sizes = mx.array([[84, 56], [0, 84]])  # an empty image: whole (the tower says what is wrong with it)
    assert split_items(ItemSplit.SIZED_STACK, PIXTRAL_LIKE, {"pixel_values": stacked, "image_sizes": bad_sizes},
                       _request(range(12), 2)) is None


def _tiled_prompt(views_per_image, per_view):
    """Prompt ids with each view's run of image tokens (id 4) after a tag: the global-image tag before an
    image's last view, another tag before its tiles; and the media positions."""
    ids, positions = [1], []
    for views in views_per_image:
        for v in range(views):
            ids.append(GLOBAL_TAG if v == views - 1 else 6)
            positions += range(len(ids), len(ids) + per_view)
            ids += [4] * per_view
            ids.append(3)
    return ids + [2], positions


def test_tiles_end_each_image_at_its_global_view():
    ids, positions = _tiled_prompt([3, 1, 2], per_view=4)
    pixels = _pixels(1, 6, 3, 4, 4)
    mask = mx.ones((1, 6, 4, 4), dtype=mx.bool_)
    items = split_items(ItemSplit.TILES, None, {"pixel_values": pixels, "pixel_attention_mask": mask},
                        _request(positions, 3, ids))
    assert [i.tokens for i in items] == [12, 4, 8]
    assert mx.array_equal(items[2].inputs["pixel_values"], pixels[:, 4:6]).item()
    assert items[2].inputs["pixel_attention_mask"].shape == (1, 2, 4, 4)


def test_tiles_with_a_padded_view_or_no_global_tag_are_keyed_whole():
    ids, positions = _tiled_prompt([2, 2], per_view=4)
    pixels = _pixels(1, 4, 3, 4, 4)
    padded = mx.ones((1, 4, 4, 4), dtype=mx.bool_)
    padded[0, 3, :, 2:] = False  # the second image's global view is padded: its tensors depend on the first's
    assert split_items(ItemSplit.TILES, None, {"pixel_values": pixels, "pixel_attention_mask": padded},
                       _request(positions, 2, ids)) is None
    untagged = [6 if t == GLOBAL_TAG else t for t in ids]
    mask = mx.ones((1, 4, 4, 4), dtype=mx.bool_)
    assert split_items(ItemSplit.TILES, None, {"pixel_values": pixels, "pixel_attention_mask": mask},
                       _request(positions, 2, untagged)) is None


def test_packed_patches_give_each_image_its_valid_patches():
    """phi4-siglip's NaFlex packing: two images of 12 and 16 valid patches, each padded to the processor's 16; an
    item fills as many positions as its mask sets, keeps its padded row (the tower's rows for it depend on the
    padding), and hashes and encodes the same as that image alone in a request of its own."""
    pixels = _pixels(2, 16, 48, seed=3)
    mask = mx.array([[1] * 12 + [0] * 4, [1] * 16], dtype=mx.int32)
    shapes = mx.array([[3, 4], [4, 4]])
    media = {"pixel_values": pixels, "pixel_attention_mask": mask, "spatial_shapes": shapes}
    items = split_items(ItemSplit.PACKED, None, media, _request(range(28), 2))
    assert [i.tokens for i in items] == [12, 16]
    assert items[0].inputs["pixel_values"].shape == (1, 16, 48)
    assert items[1].inputs["spatial_shapes"].tolist() == [[4, 4]]
    alone = split_items(ItemSplit.PACKED, None, {name: value[:1] for name, value in media.items()},
                        _request(range(12), 1))
    assert content_key(alone[0].parts) == content_key(items[0].parts)
    # rows that do not account for the prompt's image positions: keyed whole
    assert split_items(ItemSplit.PACKED, None, media, _request(range(27), 2)) is None
