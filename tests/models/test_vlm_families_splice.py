"""The per-family tests of test_vlm_families.py (its docstring says what they check) on the families whose images are
spliced (``SPLICE_FAMILIES``, scheduler/models/splice.py): one file per part, so pytest-xdist runs the parts side by
side."""

from __future__ import annotations

from .test_vlm_families import (  # noqa: F401  (the tests run here on these families)
    SPLICE_FAMILIES,
    family_fixture,
    test_family_batches_exactly,
    test_family_batches_exactly_with_quantized_kv,
    test_family_chat_turn_adding_an_image_reuses_the_turn_before,
    test_family_is_quiet_per_request,
    test_family_prompt_logprobs_equal_mlx_vlms_own_prefill,
    test_family_serves_from_the_async_engines_thread,
    test_family_shares_the_text_before_its_media,
    test_family_stops_on_what_mlx_vlm_stops_on,
    test_family_video_batches_exactly,
    test_model_instance_position_state_is_neither_read_nor_written,
)

family = family_fixture(SPLICE_FAMILIES)
