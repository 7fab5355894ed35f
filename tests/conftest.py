"""Shared fixtures: tiny real models built once per test session (offline)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Every EngineConfig a test builds checks the engine's invariants after every tick (scheduler/config.py).
os.environ["MLXSCHED_CHECK_INVARIANTS"] = "1"

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# the tiny models' directories, shared with bench/conftest.py (which does not take the suite's settings above)
from tests.model_dirs import (build_model, medium_model_dir, sliding_model_dir, text_model_dir,  # noqa: E402,F401
                              vlm_model_dir)
from tests import run_lock  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "exclusive: measures time, so no other test runs meanwhile "
                                       "(tests/run_lock.py)")
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        # the controller of a run on several workers, before it starts them (they inherit the environment):
        # one OpenBLAS thread per worker, as many workers as cores. OpenBLAS's idle threads spin, so two
        # threads in each of two workers on two cores slow every matmul down.
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


# The files that take longest (minutes of CI between them), longest first. `--dist loadfile` hands a worker one
# file at a time in collection order (pyproject's addopts keep xdist from reordering by test count), so these
# start first and the run ends on short files rather than one worker finishing a long file while the other
# idles. Only an order: a file missing here runs after them, and a stale entry costs time, nothing else.
LONGEST_FIRST = (
    "tests/tools/test_whatif_reality.py",  # `exclusive`: both workers' time
    "tests/surfaces/test_serve_tools.py",
    "tests/execution/test_families_state.py",
    "tests/models/test_vlm_families_more.py",
    "tests/models/test_vlm_families.py",
    "tests/execution/test_tensor_parallel.py",
    "tests/models/test_vlm_families_newest.py",
    "tests/execution/test_families.py",
    "tests/fixtures/test_vlm_fixtures.py",
    "tests/execution/test_hybrids.py",
    "tests/models/test_audio.py",
    "tests/execution/test_engine_equality.py",
    "tests/models/test_vlm_families_splice.py",
    "tests/surfaces/test_stateful.py",
    "tests/execution/test_real_checkpoint_options.py",
    "tests/caches/test_quantized_kv.py",
    "tests/models/test_vision_batch.py",
    "tests/execution/test_drafting.py",
    "tests/surfaces/test_serve.py",
)


def pytest_collection_modifyitems(config, items):
    """LONGEST_FIRST's files first, in its order; the rest after them in the order collected (a stable sort keeps
    each file's own order, which pytest arranged around its module-scoped parametrized fixtures)."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Setup, call and teardown under the run's lock: shared, or alone for an `exclusive` test."""
    with run_lock.hold(run_lock.run_of(item.config), exclusive=item.get_closest_marker("exclusive") is not None):
        yield


@pytest.fixture(scope="module")
def media_server():
    """A loopback HTTP server of media and of every failure a fetch must bound (tests/media_http.py)."""
    from tests.media_http import MediaServer

    server = MediaServer()
    yield server
    server.close()


@pytest.fixture(scope="session")
def text_model(text_model_dir):
    """(model, TokenizerWrapper) from mlx_lm.load of the tiny qwen3."""
    import mlx_lm

    return mlx_lm.load(str(text_model_dir))


@pytest.fixture(scope="session")
def sliding_model(sliding_model_dir):
    """(model, TokenizerWrapper) from mlx_lm.load of the tiny gemma3_text."""
    import mlx_lm

    return mlx_lm.load(str(sliding_model_dir))


@pytest.fixture(scope="session")
def text_eos_model(tmp_path_factory):
    """(model, TokenizerWrapper) of the tiny qwen3 that stops on eos for some prompts (tiny_models text-eos)."""
    import mlx_lm

    return mlx_lm.load(str(build_model("text-eos", tmp_path_factory.mktemp("tiny-text-eos"))))


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory):
    """family -> the directory of its tiny VLM (scheduler.fixtures.vlm_families), built once per session."""
    from scheduler.fixtures.vlm_families import build_tiny_vlm

    root = tmp_path_factory.mktemp("tiny-vlm-families")
    return lambda family: build_tiny_vlm(family, root / family)  # a built directory is returned as is


@pytest.fixture(scope="session")
def vlm_eos_model_dir(tmp_path_factory) -> Path:
    return build_model("vlm-eos", tmp_path_factory.mktemp("tiny-vlm-eos"))


@pytest.fixture(scope="session")
def native_mtp_model(tmp_path_factory):
    """(model, TokenizerWrapper): the tiny qwen3 carrying its own MTP module the way vllm-mlx's MTP models do
    (scheduler/fixtures/native_mtp.py), with the text-mtp build's fitted head."""
    from scheduler.fixtures.native_mtp import load_native_mtp

    return load_native_mtp(build_model("text-mtp", tmp_path_factory.mktemp("tiny-text-mtp")))
