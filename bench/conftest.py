"""The benchmarks build the tests' tiny models (tests/model_dirs.py) but not the test suite's settings:
tests/conftest.py turns on `check_invariants` for every engine (through MLXSCHED_CHECK_INVARIANTS), which costs
0.4-0.6 ms a tick on the tiny models and is not what an engine serves with."""

from tests.model_dirs import text_model_dir, vlm_model_dir  # noqa: F401
