"""The tiny models' directories as session fixtures (built offline, once per session), with no settings of the
suite's own: tests/conftest.py and bench/conftest.py both import them."""

from pathlib import Path

import pytest


def build_model(kind: str, out: Path) -> Path:
    # imported on first use: the core tests (tests/core) run where MLX is not importable
    from scheduler.fixtures.tiny_models import build_model as build

    return build(kind, out)


def _model_dir_fixture(kind: str):
    """A session fixture: the `kind` tiny model, built once into a temporary directory."""
    @pytest.fixture(scope="session")
    def model_dir(tmp_path_factory) -> Path:
        return build_model(kind, tmp_path_factory.mktemp(f"tiny-{kind}"))

    return model_dir


text_model_dir = _model_dir_fixture("text")
sliding_model_dir = _model_dir_fixture("sliding")
medium_model_dir = _model_dir_fixture("text-medium")
vlm_model_dir = _model_dir_fixture("vlm")
