"""`what_if`: fit on a trace, simulate it under the recorded and another policy / config, and report."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from scheduler.config import EngineConfig
from scheduler.policy import Policy
from scheduler.tools.replay import Trace
from scheduler.tools.simulation.cost_model import fit_cost_model
from scheduler.tools.simulation.driver import simulate
from scheduler.tools.simulation.metrics import recorded_metrics
from scheduler.tools.simulation.recorded import load_recorded
from scheduler.tools.simulation.report import compare_table
from scheduler.tools.workload import arrivals_from_trace


def _coerce(name: str, value: Any, current: Any, annotation: str) -> Any:
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.lower() in ("none", "null") and "None" in annotation:
        return None
    if "bool" in annotation:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}: expected a boolean, got {value!r}")
    if "int" in annotation:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{name}: expected an integer, got {value!r}") from None
    if "float" in annotation:
        return float(text)
    return text


def apply_overrides(config: EngineConfig, overrides: Mapping[str, Any] | None) -> EngineConfig:
    """`config` with fields replaced; string values (from `--set key=value`) are converted to the field's type."""
    if not overrides:
        return config
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    changes = {}
    for name, value in overrides.items():
        if name not in fields:
            raise ValueError(f"unknown config field {name!r}; known: {sorted(fields)}")
        changes[name] = _coerce(name, value, getattr(config, name), str(fields[name].type))
    return dataclasses.replace(config, **changes)


def _label(policy: str | Policy | None, overrides: Mapping[str, Any] | None) -> str:
    parts = []
    if policy is not None:
        parts.append(f"policy={policy if isinstance(policy, str) else getattr(policy, 'name', policy)}")
    parts += [f"{k}={v}" for k, v in (overrides or {}).items()]
    return "simulated (" + ", ".join(parts) + ")"


def what_if(trace_path: "str | os.PathLike | Trace", policy: str | Policy | None = None,
            overrides: Mapping[str, Any] | None = None, kv_layout: Any = None) -> str:
    """Fit the cost model on a trace, simulate its arrivals under the recorded policy and config and under
    `policy` / `overrides`, and return the cost model and a table: recorded vs simulated vs alternative.

    A KV budget (`kv_memory_bytes`) needs the model's KV layout: the one the trace recorded, else `kv_layout`.
    """
    rec = load_recorded(trace_path)
    cost = fit_cost_model(rec)
    arrivals = arrivals_from_trace(rec)
    config = dataclasses.replace(rec.trace.config, trace_path=None)
    kwargs = rec.simulation_settings(kv_layout)
    other_config = apply_overrides(config, overrides)
    if getattr(other_config, "kv_memory_bytes", None) is not None and kwargs["kv_layout"] is None:
        raise ValueError("kv_memory_bytes needs the model's KV layout: this trace has none (engine_start "
                         "kv_layout); pass kv_layout=")
    recorded_policy = config.policy
    rows = {"recorded": recorded_metrics(rec)}
    same = simulate(arrivals, config, cost, policy=recorded_policy, **kwargs)
    rows[f"simulated ({recorded_policy})"] = same.summary()
    if policy is not None or overrides:
        other = simulate(arrivals, other_config, cost, policy=policy if policy is not None else recorded_policy,
                         **kwargs)
        rows[_label(policy, overrides)] = other.summary()
    lines = [cost.describe(), ""]
    rec_row, sim_row = rows["recorded"], rows[f"simulated ({recorded_policy})"]
    errs = []
    for key, label in (("throughput_tok_s", "throughput"), ("ttft_mean_s", "mean TTFT")):
        a, b = rec_row.get(key), sim_row.get(key)
        if a and b is not None:
            errs.append(f"{label} {(b - a) / a:+.1%}")
    if errs:
        lines += ["simulation of the recorded policy vs the recording: " + ", ".join(errs), ""]
    lines.append(compare_table(rows))
    return "\n".join(lines)
