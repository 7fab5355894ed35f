"""Conformance across mlx-lm text families whose caches are more than plain KV: sliding windows, recurrent state,
several caches a layer (`family_conformance`: every schedule against `mlx_lm.generate` alone)."""

from __future__ import annotations

from .family_conformance import (  # noqa: F401  (the tests run here on these builds)
    STATE_BUILDS,
    family_fixture,
    test_declared_cache_kinds_match_the_real_builds,
    test_drafting_is_built_for_every_family,
    test_family_matches_solo_mlx_lm,
    test_family_under_a_kv_budget_that_forces_preemption,
    test_prompt_logprobs_equal_mlx_lms_own_prefill_of_each_prompt,
)

family = family_fixture(STATE_BUILDS)
