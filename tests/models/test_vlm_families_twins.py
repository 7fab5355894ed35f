"""The model types that are a second name of another row's mlx-vlm model class (``TWIN_FAMILIES``: bunny-llama is
llava_bunny's class, as llava-qwen2, with Llama-3 text in place of Qwen2's): the main test of test_vlm_families.py,
batched greedy output equal to solo mlx_vlm in every schedule, on the twin's own build. The other per-family tests
exercise the class's code, not the name, and run on the first name's build (test_vlm_families_splice.py)."""

from __future__ import annotations

from .test_vlm_families import (  # noqa: F401  (the test runs here on these families)
    TWIN_FAMILIES,
    family_fixture,
    test_family_batches_exactly,
)

family = family_fixture(TWIN_FAMILIES)
