"""What-if accuracy against reality, measured: every workload of tests/tools/whatif_reality.py (timed Poisson
arrivals and bursts, text, image+text and image chats), WHATIF_PAIRS pairs each (default 5), each pair recorded under 12
slots / priority, predicted and really run under 4 slots / FCFS, the two real runs side by side in a child
process pinned to one CPU (`scheduler.tools.whatif_check`). Prints every pair's errors and the recorded
config's own simulation; the suite's CI check is tests/tools/test_whatif_reality.py (3-5 pairs, two workloads).

    python -m pytest -s bench/test_whatif_accuracy.py     (bench/README.md, "Issue 16": the figures)
"""

import dataclasses
import os

import pytest

from scheduler import Engine, EngineConfig, SamplingParams
from scheduler.cli import _demo_workload
from scheduler.tools.simulate import arrivals_from_trace, fit_cost_model, load_recorded, recorded_metrics, simulate
from scheduler.tools.whatif_check import METRICS
from tests.tools.whatif_reality import WORKLOADS, error_table, median_errors, run_pairs

TOLERANCE = 0.15


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(WORKLOADS))
def test_whatif_against_reality(kind, vlm_model_dir, text_model_dir, tmp_path):
    model_dir = vlm_model_dir if kind.startswith("image") else text_model_dir
    checks = run_pairs(model_dir, kind, tmp_path, int(os.environ.get("WHATIF_PAIRS", "5")))
    print(f"\n{kind}, what-if (4 slots, FCFS) predicted from the 12-slot recording:\n{error_table(checks)}")
    print(f"{kind}, the recorded config simulated:\n{error_table(checks, 'recorded')}")
    assert all(abs(e) <= TOLERANCE for e in median_errors(checks).values())


@pytest.mark.slow
def test_simulating_the_recorded_policy_holds_on_the_demo_image_text_workload(vlm_model_dir, tmp_path):
    """The demo's shape (32 chat requests, half with images, all at once, 16 slots), run as `mlxsched demo`
    runs it (in this process, unpinned): the simulation of the recorded config lands within 15% of the
    recording."""
    trace = tmp_path / "demo.jsonl"
    prompts, images = _demo_workload(32, seed=0, with_images=True)
    engine = Engine.from_pretrained(vlm_model_dir, EngineConfig(max_batched_tokens=512, max_seqs=16,
                                                                prefill_chunk=128, prefix_cache_bytes=64 << 20,
                                                                trace_path=str(trace), check_invariants=False))
    engine.generate(prompts, [SamplingParams(max_tokens=48) for _ in prompts], images=images)
    engine.close()
    rec = load_recorded(trace)
    cost = fit_cost_model(rec)
    sim = simulate(arrivals_from_trace(rec), dataclasses.replace(rec.trace.config, trace_path=None), cost,
                   **rec.simulation_settings()).summary()
    real = recorded_metrics(rec)
    errors = {m: (sim[m] - real[m]) / real[m] for m in METRICS}
    print(errors, cost.describe())
    assert all(abs(e) <= TOLERANCE for e in errors.values()), errors
