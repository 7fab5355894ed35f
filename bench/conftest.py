"""The benchmarks build the tests' tiny models (offline, once per session) but not the test suite's settings:
tests/conftest.py turns on `check_invariants` for every engine (through MLXSCHED_CHECK_INVARIANTS), which costs
0.4-0.6 ms a tick on the tiny models and is not what an engine serves with."""

from pathlib import Path

import pytest

from scheduler.fixtures.tiny_models import build_model


@pytest.fixture(scope="session")
def text_model_dir(tmp_path_factory) -> Path:
    return build_model("text", tmp_path_factory.mktemp("tiny-text"))


@pytest.fixture(scope="session")
def vlm_model_dir(tmp_path_factory) -> Path:
    return build_model("vlm", tmp_path_factory.mktemp("tiny-vlm"))
