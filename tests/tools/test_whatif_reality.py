"""The what-if against reality, in CI: a run recorded under one config (12 slots, priority) predicts another
(4 slots, FCFS), and that other config is really run on the same timed arrivals; TTFT mean, TTFT p95 and
throughput must land within 15% of the real run, for an image+text workload and for a text workload.

Both real runs are served side by side in a child process pinned to one CPU (`scheduler.tools.whatif_check`
says why: on two cores the OS's thread placement moved the same run's decode ticks between 1.3 and 2.1 ms).
Measured on this project's 2-core VM, every pair landed within 7% under both BLAS libraries
(bench/README.md, "Issue 16: what-if, side by side on one core").
"""

import json
import statistics

import pytest

from scheduler.tools.whatif_check import METRICS, run_on_one_cpu

TOLERANCE = 0.15
PAIRS = 3  # recorded/what-if pairs per workload: the median error over them is checked


def _checks(model_dir, kind, tmp_path) -> list[dict]:
    """PAIRS checks, each in its own child process pinned to one CPU."""
    checks = []
    for i in range(PAIRS):
        where = tmp_path / f"pair{i}"
        where.mkdir()
        done = run_on_one_cpu(["-m", "tests.tools.whatif_reality", str(model_dir), kind, str(where)], timeout=600)
        checks.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return checks


def _assert_within(checks: list[dict]) -> None:
    """The median error over the pairs, per metric, within TOLERANCE: the machine's speed can still change
    within one pair's few seconds (the recorded lane ends first, and the what-if lane's last ticks have no
    counterpart in it); a pair is not judged alone."""
    medians = {m: statistics.median(c["what_if"][m]["error"] for c in checks) for m in METRICS}
    table = "\n".join(f"{m}: errors {', '.join(format(c['what_if'][m]['error'], '+.1%') for c in checks)}"
                      f" (median {medians[m]:+.1%})" for m in METRICS)
    assert all(abs(e) <= TOLERANCE for e in medians.values()), f"{table}\n{checks[0]['cost_model']}"


@pytest.mark.slow
def test_whatif_holds_for_an_image_text_workload(vlm_model_dir, tmp_path):
    _assert_within(_checks(vlm_model_dir, "image+text", tmp_path))
    assert (tmp_path / "pair0" / "what_if.jsonl").exists() and (tmp_path / "pair0" / "recorded.jsonl").exists()


@pytest.mark.slow
def test_whatif_holds_for_a_text_workload(text_model_dir, tmp_path):
    _assert_within(_checks(text_model_dir, "text", tmp_path))
