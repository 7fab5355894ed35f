"""The benchmarks use the tests' tiny-model fixtures (built offline, once per session)."""

from tests.conftest import text_model_dir, vlm_model_dir  # noqa: F401
