"""The tiny models' directories as session fixtures (built offline, once per session), with no settings of the
suite's own: tests/conftest.py and bench/conftest.py both import them."""

from pathlib import Path

import pytest


def build_model(kind: str, out: Path) -> Path:
    # imported on first use: the core tests (tests/core) run where MLX is not importable
    from scheduler.fixtures.tiny_models import build_model as build

    return build(kind, out)


@pytest.fixture(scope="session")
def text_model_dir(tmp_path_factory) -> Path:
    return build_model("text", tmp_path_factory.mktemp("tiny-text"))


@pytest.fixture(scope="session")
def sliding_model_dir(tmp_path_factory) -> Path:
    return build_model("sliding", tmp_path_factory.mktemp("tiny-sliding"))


@pytest.fixture(scope="session")
def medium_model_dir(tmp_path_factory) -> Path:
    return build_model("text-medium", tmp_path_factory.mktemp("tiny-text-medium"))


@pytest.fixture(scope="session")
def vlm_model_dir(tmp_path_factory) -> Path:
    return build_model("vlm", tmp_path_factory.mktemp("tiny-vlm"))
