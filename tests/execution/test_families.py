"""Conformance across mlx-lm text families whose caches are plain KV (`family_conformance`: every schedule
against `mlx_lm.generate` alone), quantized builds included, and the README's family table."""

from __future__ import annotations

from .family_conformance import (  # noqa: F401  (the tests run here, on these builds)
    PLAIN_KV_BUILDS,
    family_fixture,
    test_declared_cache_kinds_match_the_real_builds,
    test_drafting_is_built_for_every_family,
    test_family_matches_solo_mlx_lm,
    test_family_under_a_kv_budget_that_forces_preemption,
    test_prompt_logprobs_equal_mlx_lms_own_prefill_of_each_prompt,
)

family = family_fixture(PLAIN_KV_BUILDS)


def test_the_readme_table_is_generated_from_the_family_table():
    from pathlib import Path

    from scheduler.families import support_table

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    start = readme.index("<!-- families-table:begin")
    body = readme[readme.index("\n", start) + 1: readme.index("<!-- families-table:end -->")]
    assert body.strip() == support_table().strip(), "README's family table is stale: regenerate it from support_table()"
