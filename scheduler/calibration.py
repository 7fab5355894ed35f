"""Calibration: a short synthetic run at the start of a trace that shows the cost model every batch size.

A what-if simulation fits its per-tick cost model on a recorded run. A run that keeps its slots full decodes
at one batch size, and from such ticks alone the cost of a decode forward cannot be split into what it
costs per forward and what it costs per row: a what-if at another `max_seqs` then extrapolates an arbitrary
split (measured: 30-120% off on TTFT for a 12-slot recording predicting 4 slots). `calibrate` runs, through
the engine's own loop and so into its trace, a ramp per prompt length: `max_seqs` requests admitted together
whose lengths of output differ by `step_tokens`, so that the batch decodes at every size from `max_seqs`
down to 1, at a short and at a long context, with half its rows sampling. The trace's `calibration` event names these requests: the
cost-model fit uses their ticks like any others, and the recorded metrics and the simulated arrivals leave
them out.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler.request import SamplingParams

if TYPE_CHECKING:
    from scheduler.engine import Engine

#: The event that names the calibration requests (scheduler.tools.simulation.recorded reads it).
CALIBRATION_EVENT = "calibration"
#: Request ids of calibration requests start with this (a caller's request with such an id, already in the
#: engine, makes `calibrate` fail with the engine's duplicate-id error).
CALIBRATION_ID_PREFIX = "mlxsched-calibration-"


@dataclass(frozen=True)
class Calibration:
    """What `calibrate` ran: its requests, the ticks they took and the wall time."""

    request_ids: tuple[str, ...]
    first_tick: int
    ticks: int
    seconds: float


def calibrate(engine: "Engine", prompt_lens: tuple[int, ...] = (16, 256), step_tokens: int = 4,
              seed: int = 0) -> Calibration:
    """Run the calibration ramps on an idle engine (see the module docstring) and record them in its trace.

    Each ramp admits `engine.config.max_seqs` requests of `prompt_len` random tokens (drawn from the middle of
    the vocabulary, away from the special tokens either end usually holds); the i-th of n asks for
    `step_tokens * (n - i)` tokens, so the batch shrinks by one row every `step_tokens` ticks; the odd ones
    sample (temperature 1), the even ones are greedy. The prefix cache is cleared afterwards (their entries
    would only take room). Raises RuntimeError when requests are pending: their ticks would mix with the
    ramp's.
    """
    if engine.has_pending():
        raise RuntimeError("calibrate: the engine has pending requests; calibrate an idle engine")
    if step_tokens < 1:
        raise ValueError(f"calibrate: step_tokens must be >= 1, got {step_tokens}")
    rows = engine.config.max_seqs
    longest_output = step_tokens * rows
    rng = random.Random(seed)
    low, high = max(1, engine.vocab_size // 8), max(2, engine.vocab_size // 2)
    start_tick, start = engine.tick, time.perf_counter()
    ids: list[str] = []
    for prompt_len in prompt_lens:
        # prompt + output stays within the model's context (and at least one token of prompt)
        prompt_len = max(1, min(prompt_len, engine.max_model_len - longest_output - 1))
        for i in range(rows):
            rid = f"{CALIBRATION_ID_PREFIX}{len(ids)}"
            # the first admitted asks for the most tokens: a long prompt is admitted over several ticks (the
            # token budget), and the batch must be whole before its first row ends
            # every other request samples (the sampler costs a decode forward more than the greedy argmax);
            # the last row standing is greedy, so the ramp also shows greedy-only ticks
            sampling = SamplingParams(max_tokens=step_tokens * (rows - i), temperature=1.0 if i % 2 else 0.0)
            engine.add_request(prompt_tokens=[rng.randrange(low, high) for _ in range(prompt_len)],
                               sampling=sampling, request_id=rid)
            ids.append(rid)
        while engine.has_pending():
            engine.step()
    engine.clear_prefix_cache()
    engine.events.emit(CALIBRATION_EVENT, engine.tick, request_ids=ids)
    return Calibration(tuple(ids), start_tick, engine.tick - start_tick, time.perf_counter() - start)
