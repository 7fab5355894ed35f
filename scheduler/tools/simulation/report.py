"""The comparison table of summaries (recorded vs simulated vs an alternative)."""

from __future__ import annotations

import math
from typing import Any, Mapping


_DISPLAY = (  # key, label, scale
    ("requests", "requests", None),
    ("finished", "finished", None),
    ("aborted", "aborted", None),
    ("failed", "failed", None),
    ("output_tokens", "output tokens", None),
    ("throughput_tok_s", "throughput (tok/s)", 1.0),
    ("makespan_s", "makespan (s)", 1.0),
    ("ttft_mean_s", "TTFT mean (ms)", 1e3),
    ("ttft_p50_s", "TTFT p50 (ms)", 1e3),
    ("ttft_p95_s", "TTFT p95 (ms)", 1e3),
    ("ttft_p99_s", "TTFT p99 (ms)", 1e3),
    ("tpot_mean_s", "TPOT mean (ms)", 1e3),
    ("e2e_p50_s", "e2e p50 (ms)", 1e3),
    ("e2e_p95_s", "e2e p95 (ms)", 1e3),
    ("queue_mean_s", "queue mean (ms)", 1e3),
    ("preemptions", "preemptions", None),
    ("ticks", "ticks", None),
    ("request_ticks", "request-ticks", None),
    ("cache_hit_rate", "prefix cache hit rate", 1.0),
    ("prefix_tokens_saved", "prefix tokens saved", None),
)


def _cell(value: Any, scale: float | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if scale is None and isinstance(value, int):
        return str(value)
    v = float(value) * (scale or 1.0)
    return f"{v:.4g}" if abs(v) < 1e4 else f"{v:,.0f}"


def compare_table(rows: Mapping[str, Mapping[str, Any]]) -> str:
    """A markdown table: one column per run (the keys of `rows`), one row per metric."""
    names = list(rows)
    known = [k for k, _, _ in _DISPLAY]
    extra = [k for k in dict.fromkeys(k for r in rows.values() for k in r) if k not in known]
    spec = [(k, label, scale) for k, label, scale in _DISPLAY if any(k in r for r in rows.values())]
    spec += [(k, k, 1.0) for k in extra]
    lines = ["| metric | " + " | ".join(names) + " |", "| --- |" + " ---: |" * len(names)]
    for key, label, scale in spec:
        lines.append(f"| {label} | " + " | ".join(_cell(rows[n].get(key), scale) for n in names) + " |")
    return "\n".join(lines)
