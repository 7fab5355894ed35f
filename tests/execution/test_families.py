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


def test_the_readme_sentence_on_left_out_types_is_generated_from_left_out():
    from pathlib import Path

    from scheduler.families import left_out_text

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    start = readme.index("<!-- left-out:begin")
    body = readme[readme.index("\n", start) + 1: readme.index("<!-- left-out:end -->")]
    assert body.split() == left_out_text().split(), "README's left-out sentence is stale: regenerate it"


def test_every_mlx_lm_model_type_is_a_row_or_left_out_with_a_reason():
    """Each module of the installed mlx-lm's `mlx_lm.models` is a family row, a left-out type with its reason
    (`LEFT_OUT`), or model code shared between families (`SHARED_MODULES`): an mlx-lm that adds a model type fails
    here, naming it. mlx-lm's `MODEL_REMAPPING` names load their target's module, so each target must be covered."""
    import importlib
    import pkgutil

    import mlx_lm.models
    from mlx_lm.utils import MODEL_REMAPPING

    from scheduler.families import FAMILIES, LEFT_OUT, SHARED_MODULES

    modules = {m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__)}
    assert not set(FAMILIES) & set(LEFT_OUT), "a model type is both a row and left out"
    assert all(reason.strip() for reason in LEFT_OUT.values()), "every left-out type needs its reason"
    unclaimed = sorted(modules - set(FAMILIES) - set(LEFT_OUT) - SHARED_MODULES)
    assert not unclaimed, (f"mlx-lm model types with neither a row in scheduler/families.py nor a reason in its "
                           f"LEFT_OUT: {unclaimed}")
    stale = sorted((set(LEFT_OUT) | SHARED_MODULES) - modules)
    assert not stale, f"LEFT_OUT / SHARED_MODULES name modules mlx-lm no longer has: {stale}"
    model_code = sorted(m for m in SHARED_MODULES if hasattr(importlib.import_module(f"mlx_lm.models.{m}"), "Model"))
    assert not model_code, f"SHARED_MODULES holds modules with a Model class (model types): {model_code}"
    uncovered = {name: target for name, target in MODEL_REMAPPING.items()
                 if target not in FAMILIES and target not in LEFT_OUT}
    assert not uncovered, f"mlx-lm MODEL_REMAPPING names whose target has no row and no reason: {uncovered}"
