"""`mlxsched sweep TRACE --grid max_seqs=4,8,16 policy=fcfs,priority`: the what-if simulator over a grid.

The cost model is fitted once on the trace; every grid point (the cross product of the axes) simulates the
trace's arrivals in a worker process. The simulation is deterministic, so the results (and their order: the
grid's) are the same whatever the number of workers. `to_png` draws the trade-off: p95 TTFT against
throughput, one marker per point, the recorded run marked.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from scheduler.tools.simulate import (CostModel, apply_overrides, arrivals_from_trace, fit_cost_model,
                                      load_recorded, recorded_metrics, simulate)

COLUMNS = (("ttft_p50_s", "TTFT p50 (ms)", 1e3), ("ttft_p95_s", "TTFT p95 (ms)", 1e3),
           ("tpot_mean_s", "TPOT (ms)", 1e3), ("throughput_tok_s", "throughput (tok/s)", 1.0),
           ("preemptions", "preemptions", None))


@dataclass(frozen=True)
class SweepPoint:
    settings: tuple[tuple[str, str], ...]  # (axis, value) in axis order
    metrics: dict[str, Any]

    @property
    def label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.settings)


@dataclass
class SweepResult:
    points: list[SweepPoint]
    recorded: dict[str, Any]
    recorded_settings: dict[str, Any]
    cost_model: CostModel

    def table(self) -> str:
        lines = ["| point | " + " | ".join(label for _, label, _ in COLUMNS) + " |",
                 "| --- |" + " ---: |" * len(COLUMNS)]
        rows = [("recorded (" + ", ".join(f"{k}={v}" for k, v in self.recorded_settings.items()) + ")",
                 self.recorded)] + [(p.label, p.metrics) for p in self.points]
        for label, metrics in rows:
            cells = []
            for key, _, scale in COLUMNS:
                value = metrics.get(key)
                cells.append("-" if value is None else str(value) if scale is None else f"{value * scale:.4g}")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        return "\n".join(lines)


def parse_grid(items: Sequence[str]) -> dict[str, list[str]]:
    """`["max_seqs=4,8", "policy=fcfs,priority"]` -> {"max_seqs": ["4", "8"], "policy": ["fcfs", "priority"]}."""
    grid: dict[str, list[str]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key or not values:
            raise ValueError(f"grid axis {item!r}: expected KEY=V1,V2,...")
        grid[key.strip()] = [v.strip() for v in values.split(",") if v.strip()]
    if not grid:
        raise ValueError("the grid is empty: give at least one KEY=V1,V2,...")
    return grid


def _simulate_point(job: tuple) -> dict[str, Any]:
    arrivals, config, cost, policy, kwargs = job
    return simulate(arrivals, config, cost, policy=policy, **kwargs).summary()


def sweep(trace: Any, grid: Mapping[str, Sequence[str]], workers: int | None = None) -> SweepResult:
    """Simulate every point of `grid` (axes: EngineConfig fields, and `policy`) on the trace's arrivals."""
    rec = load_recorded(trace)
    cost = fit_cost_model(rec)
    arrivals = arrivals_from_trace(rec)
    base = dataclasses.replace(rec.trace.config, trace_path=None)
    kwargs = rec.simulation_settings()
    axes = list(grid)
    jobs, settings = [], []
    for values in itertools.product(*(grid[a] for a in axes)):
        point = dict(zip(axes, values))
        policy = point.get("policy", base.policy)
        config = apply_overrides(base, {k: v for k, v in point.items() if k != "policy"})
        jobs.append((arrivals, dataclasses.replace(config, policy=policy), cost, policy, kwargs))
        settings.append(tuple(point.items()))
    workers = workers if workers is not None else min(len(jobs), os.cpu_count() or 1)
    if workers <= 1:
        results = [_simulate_point(job) for job in jobs]
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(_simulate_point, jobs))  # map keeps the grid's order
    recorded_settings = {a: base.policy if a == "policy" else getattr(base, a) for a in axes}
    return SweepResult([SweepPoint(s, m) for s, m in zip(settings, results)], recorded_metrics(rec),
                       recorded_settings, cost)


def to_png(result: SweepResult, path: str | os.PathLike) -> None:
    """p95 TTFT against throughput, one labelled marker per grid point, the recorded run as a star."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    at: dict[tuple[float, float], list[str]] = {}  # points that land on the same spot share one marker
    for point in result.points:
        x, y = point.metrics.get("throughput_tok_s"), point.metrics.get("ttft_p95_s")
        if x is not None and y is not None:
            at.setdefault((x, y * 1e3), []).append(point.label)
    for (x, y), labels in at.items():
        ax.scatter([x], [y], s=40, color="tab:blue")
        ax.annotate("\n".join(labels), (x, y), textcoords="offset points", xytext=(6, 4), fontsize=7)
    x, y = result.recorded.get("throughput_tok_s"), result.recorded.get("ttft_p95_s")
    if x is not None and y is not None:
        ax.scatter([x], [y * 1e3], s=160, marker="*", color="tab:red", label="recorded run", zorder=3)
        ax.legend(loc="best", fontsize=8)
    ax.set_xlabel("throughput (output tok/s)")
    ax.set_ylabel("TTFT p95 (ms)")
    ax.set_title("what-if sweep: latency vs throughput (simulated)")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.fspath(path))
