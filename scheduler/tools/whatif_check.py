"""How far a what-if lands from reality: record a run under one config, predict another config with the
simulator, really run that other config on the same timed arrivals, and compare (TTFT mean and p95,
throughput).

    check = check_what_if(model_dir, requests, offsets, recorded_config, what_if_config, trace_dir)
    check.what_if["ttft_mean_s"].error   # (predicted - real) / real
    check.recorded[...]                  # the recorded config simulated against its own recording

The two real runs are served side by side (`tools.side_by_side`: tick by tick, each engine on a clock that
stops while the other works), so that a change in the machine's speed during the check lands on both; the
recorded run calibrates first (`Engine.calibrate()`), so the fit sees every batch size.

Where it is run matters as much. On a 2-core Linux VM, one decode tick of the tiny text model took 1.3 or
2.1 ms in blocks of 40 and more ticks, as the OS placed MLX's worker thread beside the Python thread or on
the other core: the same config's throughput moved 18% between consecutive runs in one process, and no
recording predicts which mode the next run meets. Pinned to one CPU (`run_on_one_cpu`), the same runs' throughput
moved under 1% and the what-if landed within 7% (bench/README.md, "Issue 16: what-if, side by side on one
core"). A check that must hold run after run is therefore run in a child process pinned to one CPU.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.events import JsonlSink
from scheduler.tools.side_by_side import EngineClock, Lane, run_side_by_side
from scheduler.tools.simulation.cost_model import fit_cost_model
from scheduler.tools.simulation.driver import simulate
from scheduler.tools.simulation.metrics import recorded_metrics
from scheduler.tools.simulation.recorded import load_recorded
from scheduler.tools.workload import arrivals_from_trace

METRICS = ("ttft_mean_s", "ttft_p95_s", "throughput_tok_s")
#: what BLAS libraries read for their thread count: on one CPU, a second thread only waits on the first
ONE_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")
#: requests a throwaway engine serves before the check, so first-use costs (kernels, the processor's first
#: image) land in neither lane
WARMUP_REQUESTS = 4


@dataclass(frozen=True)
class MetricError:
    real: float
    predicted: float

    @property
    def error(self) -> float:
        """(predicted - real) / real."""
        return (self.predicted - self.real) / self.real

    def record(self) -> dict[str, float]:
        return {"real": self.real, "predicted": self.predicted, "error": self.error}


@dataclass(frozen=True)
class WhatIfCheck:
    what_if: dict[str, MetricError]  # the what-if config: predicted from the recording vs really run
    recorded: dict[str, MetricError]  # the recorded config simulated vs its own recording
    cost_model: str  # CostModel.describe() of the fit
    lane_seconds: tuple[float, float]  # each real run's length on its own clock (recorded, what-if)

    def record(self) -> dict[str, Any]:
        return {"what_if": {m: e.record() for m, e in self.what_if.items()},
                "recorded": {m: e.record() for m, e in self.recorded.items()},
                "cost_model": self.cost_model, "lane_seconds": list(self.lane_seconds)}


def _predict(rec: Any, cost: Any, config: EngineConfig) -> dict[str, Any]:
    return simulate(arrivals_from_trace(rec), dataclasses.replace(config, trace_path=None), cost,
                    policy=config.policy, **rec.simulation_settings()).summary()


def check_what_if(model_dir: str | os.PathLike, requests: Sequence[Mapping[str, Any]], offsets: Sequence[float],
                  recorded: EngineConfig, what_if: EngineConfig, trace_dir: str | os.PathLike) -> WhatIfCheck:
    """Serve `requests` (`Engine.add_request` keyword arguments) arriving at `offsets` under both configs side
    by side, the `recorded` one calibrated first; predict `what_if` from the recorded trace; compare. The
    traces are written to `trace_dir` (recorded.jsonl, what_if.jsonl). Greedy and seeded requests produce the
    same tokens under both configs, so only the schedule differs. The engines run with `check_invariants` off
    whatever the configs say (the test suite turns it on through the environment): it runs after a tick's last
    timestamp, so it would land in the gaps between ticks (0.4-0.6 ms each on the tiny models, against 0.05 ms),
    grow with the live requests, and is not what an engine serves with."""
    trace_dir = Path(trace_dir)
    warmup = Engine.from_pretrained(model_dir, dataclasses.replace(what_if, trace_path=None, check_invariants=False))
    for request in requests[:WARMUP_REQUESTS]:
        warmup.add_request(**request)
    while warmup.has_pending():
        warmup.step()
    warmup.close()
    paths = trace_dir / "recorded.jsonl", trace_dir / "what_if.jsonl"
    # the traces are written when the engines close: no file I/O in the measured ticks
    engines = [Engine.from_pretrained(model_dir, dataclasses.replace(config, trace_path=None, check_invariants=False),
                                      clock=EngineClock(), event_sinks=[JsonlSink(path, hold_until_close=True)])
               for config, path in zip((recorded, what_if), paths)]
    # what this process holds already (modules, models, other work) stays out of the collector's full passes,
    # which otherwise grow with it and land in whichever lane happens to trigger them
    gc.collect()
    gc.freeze()
    try:
        seconds = run_side_by_side([Lane(engines[0], requests, offsets, calibrate=True),
                                    Lane(engines[1], requests, offsets)])
    finally:
        for engine in engines:
            engine.close()
        gc.unfreeze()
    rec = load_recorded(paths[0])
    cost = fit_cost_model(rec)
    predicted, real = _predict(rec, cost, what_if), recorded_metrics(paths[1])
    own, own_real = _predict(rec, cost, rec.trace.config), recorded_metrics(rec)
    return WhatIfCheck({m: MetricError(real[m], predicted[m]) for m in METRICS},
                       {m: MetricError(own_real[m], own[m]) for m in METRICS}, cost.describe(),
                       (seconds[0].seconds, seconds[1].seconds))


def run_on_one_cpu(args: Sequence[str], timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run `python args...` in a child process pinned to one CPU with one BLAS thread (the child and every
    thread it starts inherit the pinning). Linux only pins (`os.sched_setaffinity`); elsewhere the child runs
    unpinned. Output is captured as text; a failing child raises CalledProcessError."""
    pin = None
    if hasattr(os, "sched_setaffinity"):
        cpu = max(os.sched_getaffinity(0))
        pin = lambda: os.sched_setaffinity(0, {cpu})  # noqa: E731 (runs in the child, before exec)
    env = {**os.environ, **{name: "1" for name in ONE_THREAD_VARIABLES}}
    return subprocess.run([sys.executable, *args], env=env, preexec_fn=pin, capture_output=True, text=True,
                          timeout=timeout, check=True)

