"""The id expansion of spliced images (scheduler/models/splice.py): a prompt with one id per image becomes one id
per embedding row and back, with the images' row counts; the engine-level equality with solo mlx-vlm is in
tests/models/test_vlm_families*.py, on the families that splice."""

from __future__ import annotations

import numpy as np
import pytest

from scheduler.models import splice

M = -200


def test_expand_writes_each_image_id_once_per_row_and_collapse_undoes_it():
    ids = [5, M, 6, 7, M, M, 8]  # the last two images side by side: one run of markers once expanded
    rows = (3, 2, 4)
    expanded = splice.expand(ids, M, rows)
    assert expanded == [5, M, M, M, 6, 7, M, M, M, M, M, M, 8]
    assert splice.collapse(expanded, M, rows) == ids
    # re-fed outputs after the prompt (a preempted request's) pass through
    assert splice.collapse(expanded + [9, 10], M, rows) == ids + [9, 10]


def test_the_mask_follows_the_ids():
    ids = [5, M, 6]
    mask = np.array([[1, 1, 0]])
    wide = splice.expand_along(mask, ids, M, (3,))
    assert wide.tolist() == [[1, 1, 1, 1, 0]]
    assert splice.collapse_along(wide, splice.expand(ids, M, (3,)), M, (3,)).tolist() == mask.tolist()


@pytest.mark.parametrize("ids, rows", [([5, M, 6], (2, 2)), ([5, 6], (2,)), ([M, M], (1,))])
def test_a_marker_count_other_than_the_images_is_refused(ids, rows):
    with pytest.raises(ValueError, match="image ids"):
        splice.expand(ids, M, rows)


def test_collapse_refuses_runs_that_are_not_the_images_rows():
    with pytest.raises(ValueError, match="do not match"):
        splice.collapse([5, M, M, 6], M, (3,))
    with pytest.raises(ValueError, match="1 spliced images of 2"):
        splice.collapse([5, M, M, 6], M, (2, 2))
