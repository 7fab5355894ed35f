"""Model-free what-if simulation: the real `Scheduler` driven in virtual time by a fitted per-tick cost model.

    trace ──fit_cost_model──▶ CostModel ─┐
    trace ──arrivals_from_trace──────────┼─▶ simulate(arrivals, config, cost, policy) ─▶ SimResult.summary()
    synthetic_workload(...) ─────────────┘
    trace ──recorded_metrics──────────────────────────────────────────────────────────▶ same keys

`simulate` runs the same planner and `apply` the engine runs (so admission, chunking and finish detection
are the real ones); only the executor is replaced: `SimExecutor` advances a virtual clock by the cost model
and returns an ordinary token until a request has produced its `output_len`, then a stop token. No model is
loaded and no MLX op runs. The scheduler's own features come along: a policy by name, the prefix cache
(`prefix_cache_bytes`: the sim executor offers prompts at prefill end as the real one does, so hits, the
hit rate and the shorter prefills are real decisions) and, given the model's KV layout, the KV budget with
its preemptions.

Time conventions (shared by the recorded and the simulated metrics so the two compare):
  arrival      the request's add time (recorded: arrival `measure.t`)
  admitted     start of the tick whose plan admitted it (recorded: that tick's `outcome.measure.tick_start_t`)
  first/last   end of the tick that sampled its first/last token (recorded: that tick's `outcome.measure.t`)
  makespan     last token time - first arrival time; throughput = output tokens / makespan.

The parts live in `scheduler.tools.simulation`, one concern a module: `cost_model` (features and the fit),
`recorded` (a trace indexed for the simulator), `metrics` (records and summaries), `executor` (`SimExecutor`),
`driver` (`simulate`), `report` (the comparison table), `what_if`. This module is their public face.
"""

from __future__ import annotations

from scheduler.tools.simulation.cost_model import (FEATURES, PHASES, CostModel, context_features, fit_cost_model, nnls,
                                                   tick_features)
from scheduler.tools.simulation.driver import SimResult, simulate
from scheduler.tools.simulation.executor import SimExecutor
from scheduler.tools.simulation.metrics import RequestRecord, recorded_metrics, recorded_records, summarize
from scheduler.tools.simulation.recorded import Recorded, load_recorded
from scheduler.tools.simulation.report import compare_table
from scheduler.tools.simulation.what_if import apply_overrides, what_if
from scheduler.tools.workload import arrivals_from_trace

__all__ = [
    "FEATURES", "PHASES", "CostModel", "Recorded", "RequestRecord", "SimExecutor", "SimResult", "apply_overrides",
    "arrivals_from_trace", "compare_table", "context_features", "fit_cost_model", "load_recorded", "nnls", "recorded_metrics",
    "recorded_records", "simulate", "summarize", "tick_features", "what_if",
]
