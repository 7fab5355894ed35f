"""The what-if against reality, in CI: a run recorded under one config (12 slots, priority) predicts another
(4 slots, FCFS), and that other config is really run on the same timed arrivals; TTFT mean, TTFT p95 and
throughput must land within 15% of the real run, for an image+text workload, an image chat workload and a text
workload.

Both real runs are served side by side in a child process pinned to one CPU (`scheduler.tools.whatif_check`
says why: on two cores the OS's thread placement moved the same run's decode ticks between 1.3 and 2.1 ms).
Measured on this project's 2-core VM, every pair landed within 7% under both BLAS libraries
(bench/README.md, "Issue 16: what-if, side by side on one core").
"""

import pytest

from tests.tools.whatif_reality import error_table, median_errors, run_pairs

TOLERANCE = 0.15
PAIRS = 3  # recorded/what-if pairs per workload: the median error over them is checked


def _assert_within(checks: list[dict]) -> None:
    """The median error over the pairs, per metric, within TOLERANCE: the machine's speed can still change
    within one pair's few seconds (the recorded lane ends first, and the what-if lane's last ticks have no
    counterpart in it), so a pair is not judged alone."""
    assert all(abs(e) <= TOLERANCE for e in median_errors(checks).values()), \
        f"{error_table(checks)}\n{checks[0]['cost_model']}"


@pytest.mark.slow
def test_whatif_holds_for_an_image_text_workload(vlm_model_dir, tmp_path):
    _assert_within(run_pairs(vlm_model_dir, "image+text", tmp_path, PAIRS))
    assert (tmp_path / "pair0" / "what_if.jsonl").exists() and (tmp_path / "pair0" / "recorded.jsonl").exists()


@pytest.mark.slow
def test_whatif_holds_for_an_image_chat_workload(vlm_model_dir, tmp_path):
    """Chat turns that resend earlier images: the fit and the simulator count vision work per image (what each
    outcome records as encoded, vision-cache hits by the arrivals' `media_items`) and arrival time per image."""
    _assert_within(run_pairs(vlm_model_dir, "image-chat", tmp_path, PAIRS))


@pytest.mark.slow
def test_whatif_holds_for_a_text_workload(text_model_dir, tmp_path):
    _assert_within(run_pairs(text_model_dir, "text", tmp_path, PAIRS))
