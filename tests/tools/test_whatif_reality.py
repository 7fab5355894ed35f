"""The what-if against reality, in CI: a run recorded under one config (12 slots, priority) predicts another
(4 slots, FCFS), and that other config is really run on the same timed arrivals; TTFT mean, TTFT p95 and
throughput must land within 15% of the real run, for an image chat workload and a text workload. (The demo's
image+text workload, whose images are all misses, is measured in bench/test_whatif_accuracy.py with the rest and
no longer here, for CI's time: the chats' turns each bring a new image beside cache hits.)

Both real runs are served side by side in a child process pinned to one CPU (`scheduler.tools.whatif_check`
says why: on two cores the OS's thread placement moved the same run's decode ticks between 1.3 and 2.1 ms).
Measured on this project's 2-core VM, pairs land within 7% under both BLAS libraries (bench/README.md, "Issue
16: what-if, side by side on one core"), though a noisy spell of the shared machine can spoil two in a row:
hence the median over PAIRS. The suite runs on several workers; these tests are `exclusive` (tests/run_lock.py),
so nothing else runs while they measure.
"""

import pytest

from tests.tools.whatif_reality import error_table, median_errors, median_within_is_decided, run_pairs

TOLERANCE = 0.15
# recorded/what-if pairs per workload: the median error over them is checked. Five, of which three usually decide:
# a noisy spell of this shared VM can spoil two pairs in a row (seen once in CI: -10% then +20% and +15% TTFT p95)
PAIRS = 5


def _pairs(model_dir, kind: str, where) -> list[dict]:
    """Pairs run until the verdict on the median over PAIRS is decided (usually after three, when all are
    within the tolerance: the rest could not move the median out of it), in one child process. The verdict is the
    one all PAIRS would give; a pair costs 3-13 s of CI."""
    checks = run_pairs(model_dir, kind, where, PAIRS, TOLERANCE)
    assert median_within_is_decided(checks, PAIRS, TOLERANCE) and len(checks) <= PAIRS
    return checks


def _assert_within(checks: list[dict]) -> None:
    """The median error over the pairs, per metric, within TOLERANCE: the machine's speed can still change
    within one pair's few seconds (the recorded lane ends first, and the what-if lane's last ticks have no
    counterpart in it), so a pair is not judged alone. (Over the pairs `_pairs` ran, the median lands on the
    same side of the tolerance as the median over PAIRS would.)"""
    assert all(abs(e) <= TOLERANCE for e in median_errors(checks).values()), \
        f"{error_table(checks)}\n{checks[0]['cost_model']}"


@pytest.mark.slow
@pytest.mark.exclusive
def test_whatif_holds_for_an_image_chat_workload(vlm_model_dir, tmp_path):
    """Chat turns that resend earlier images: the fit and the simulator count vision work per image (what each
    outcome records as encoded, vision-cache hits by the arrivals' `media_items`) and arrival time per image."""
    _assert_within(_pairs(vlm_model_dir, "image-chat", tmp_path))
    assert (tmp_path / "pair0" / "what_if.jsonl").exists() and (tmp_path / "pair0" / "recorded.jsonl").exists()


@pytest.mark.slow
@pytest.mark.exclusive
def test_whatif_holds_for_a_text_workload(text_model_dir, tmp_path):
    _assert_within(_pairs(text_model_dir, "text", tmp_path))


def test_stopping_early_gives_the_verdict_of_every_pair():
    """`_pairs` stops as soon as `median_within_is_decided`: on random errors (inside, at and outside the
    tolerance), the median over the pairs run then is within the tolerance exactly when the median over all
    PAIRS is."""
    import random

    from scheduler.tools.whatif_check import METRICS

    rng = random.Random(0)
    values = [-0.3, -TOLERANCE, -0.1, 0.0, 0.05, TOLERANCE, 0.2]
    stopped_early = 0
    for _ in range(2000):
        checks = [{"what_if": {m: {"error": rng.choice(values)} for m in METRICS}} for _ in range(PAIRS)]
        run = 1
        while not median_within_is_decided(checks[:run], PAIRS, TOLERANCE):
            run += 1
        assert run <= PAIRS
        stopped_early += run < PAIRS
        verdict = all(abs(e) <= TOLERANCE for e in median_errors(checks[:run]).values())
        assert verdict == all(abs(e) <= TOLERANCE for e in median_errors(checks).values()), checks
    assert stopped_early > 0
