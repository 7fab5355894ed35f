"""The child process of the what-if reality check (tests/tools/test_whatif_reality.py, bench/test_whatif_accuracy.py):

    python -m tests.tools.whatif_reality MODEL_DIR {text,image+text} TRACE_DIR

records WORKLOADS[kind] under RECORDED, predicts WHAT_IF with the simulator, really runs WHAT_IF on the same
timed arrivals side by side with the recording (`scheduler.tools.whatif_check`), and prints the check as one
JSON object. The parent runs it pinned to one CPU (`run_on_one_cpu`; the module docstring there says why).
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys

from scheduler import EngineConfig, SamplingParams
from scheduler.cli import _demo_workload
from scheduler.tools.whatif_check import check_what_if

BASE = EngineConfig(max_batched_tokens=512, prefill_chunk=128, prefix_cache_bytes=64 << 20)
# Recorded with 12 slots under priority, predicted and really run with 4 slots under FCFS: both the slot count
# and the policy change. (The other direction, 4 -> 12 slots, extrapolates the per-row decode cost beyond the
# batch sizes the recording served.)
RECORDED = dataclasses.replace(BASE, max_seqs=12, policy="priority")
WHAT_IF = dataclasses.replace(BASE, max_seqs=4, policy="fcfs")


def poisson_offsets(n: int, rate: float, seed: int) -> list[float]:
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def text_workload() -> tuple[list[dict], list[float]]:
    """128 prompts of 8, 40, 120 or 300 random tokens, 32 greedy new tokens each, three priorities, Poisson
    arrivals at 200/s: the 4-slot config is overloaded, so its TTFT is a queueing time its schedule decides."""
    rng = random.Random(7)
    requests = [dict(prompt_tokens=[rng.randrange(7, 200) for _ in range(rng.choice([8, 40, 120, 300]))],
                     priority=i % 3, sampling=SamplingParams(max_tokens=32)) for i in range(128)]
    return requests, poisson_offsets(len(requests), 200.0, 2)


def image_text_workload() -> tuple[list[dict], list[float]]:
    """The demo's chat requests (half of them with an image of one of four sizes), 64 of them, 24 greedy new
    tokens each, three priorities, Poisson arrivals at 100/s."""
    prompts, images = _demo_workload(64, seed=3, with_images=True)
    requests = [dict(prompt=p, images=im, priority=i % 3, sampling=SamplingParams(max_tokens=24))
                for i, (p, im) in enumerate(zip(prompts, images))]
    return requests, poisson_offsets(len(requests), 100.0, 1)


WORKLOADS = {"text": text_workload, "image+text": image_text_workload}


def main(argv: list[str]) -> None:
    model_dir, kind, trace_dir = argv
    requests, offsets = WORKLOADS[kind]()
    check = check_what_if(model_dir, requests, offsets, RECORDED, WHAT_IF, trace_dir)
    print(json.dumps(check.record()))


if __name__ == "__main__":
    main(sys.argv[1:])
