"""The child process of the what-if reality check (tests/tools/test_whatif_reality.py, bench/test_whatif_accuracy.py):

    python -m tests.tools.whatif_reality MODEL_DIR WORKLOAD TRACE_DIR PAIRS [TOLERANCE]
                                                        (WORKLOAD: a key of WORKLOADS)

records WORKLOADS[kind] under RECORDED, predicts WHAT_IF with the simulator, really runs WHAT_IF on the same
timed arrivals side by side with the recording (`scheduler.tools.whatif_check`), and prints the check as one
JSON object; PAIRS times over (TRACE_DIR/pair{i}), or with TOLERANCE until the verdict on the median over PAIRS
is decided (`median_within_is_decided`). One process runs them all: each check builds its engines anew, and a
process per check spent seconds of each on starting up. The parent runs it pinned to one CPU (`run_on_one_cpu`;
the module docstring there says why).
"""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
import sys
from pathlib import Path

from scheduler import EngineConfig, SamplingParams
from scheduler.cli import _demo_workload
from scheduler.tools.whatif_check import METRICS, check_what_if, run_on_one_cpu

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


def burst(with_images: bool) -> tuple[list[dict], list[float]]:
    """The demo's workload doubled, all arriving at once: 64 chat requests (half with an image on the VLM), 48
    new tokens, half of them sampling (seeded), three priorities (bench/test_whatif_accuracy.py)."""
    prompts, images = _demo_workload(64, seed=0, with_images=with_images)
    requests = [dict(prompt=p, images=im, priority=i % 3,
                     sampling=SamplingParams(max_tokens=48, temperature=0.0 if i % 2 == 0 else 0.8, seed=i))
                for i, (p, im) in enumerate(zip(prompts, images))]
    return requests, [0.0] * len(requests)


def image_chat_workload() -> tuple[list[dict], list[float]]:
    """16 chats of 3 turns, each turn resending the chat so far (its images, questions and a fixed answer) with
    a new image of one of four sizes, 24 greedy new tokens each: a turn's earlier images are vision-cache hits
    (the tiny Qwen2-VL keys media per image) and its earlier turns prefix-cache hits. Chats start 20 ms apart,
    a chat's turns 150 ms apart, so later turns arrive while earlier ones run."""
    import numpy as np
    from PIL import Image

    sizes = [(112, 140), (56, 56), (84, 112), (140, 84)]
    requests, offsets = [], []
    for chat in range(16):
        messages: list[dict] = [{"role": "system", "content": "You describe pictures in a few words."}]
        images = []
        for turn in range(3):
            w, h = sizes[(chat + turn) % len(sizes)]
            images.append(Image.fromarray(np.random.default_rng(100 * chat + turn).integers(0, 256, (h, w, 3),
                                                                                            dtype=np.uint8)))
            if turn:
                messages.append({"role": "assistant", "content": "A picture of coloured noise."})
            messages.append({"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                             "text": f"And picture {turn}?"}]})
            requests.append(dict(prompt=list(messages), images=list(images), priority=chat % 3,
                                 sampling=SamplingParams(max_tokens=24)))
            offsets.append(0.02 * chat + 0.15 * turn)
    order = sorted(range(len(requests)), key=offsets.__getitem__)
    return [requests[i] for i in order], [offsets[i] for i in order]


WORKLOADS = {"text": text_workload, "image+text": image_text_workload, "image-chat": image_chat_workload,
             "text-burst": lambda: burst(False), "image+text-burst": lambda: burst(True)}


def run_pairs(model_dir: Path, kind: str, where: Path, pairs: int, tolerance: float | None = None) -> list[dict]:
    """Checks of WORKLOADS[kind] in one child process pinned to one CPU (traces kept in where/pair{i}): `pairs`
    of them, or with `tolerance` as many as decide the verdict on the median over `pairs`; their JSON records."""
    args = ["-m", "tests.tools.whatif_reality", str(model_dir), kind, str(where), str(pairs)]
    done = run_on_one_cpu(args + ([] if tolerance is None else [str(tolerance)]), timeout=600 * pairs)
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def median_within_is_decided(checks: list[dict], pairs: int, tolerance: float, part: str = "what_if") -> bool:
    """Whether the first checks of `pairs` (odd) already decide if every metric's median error over all of them
    is within `tolerance`: the median is within it exactly when a majority of the errors are <= tolerance and a
    majority are >= -tolerance, so once both majorities are reached, or one can no longer be, the checks not yet
    run cannot change the verdict."""
    assert pairs % 2 == 1, "a median over an odd number of pairs"
    majority, left = pairs // 2 + 1, pairs - len(checks)
    within_all = True
    for m in METRICS:
        errors = [c[part][m]["error"] for c in checks]
        below, above = sum(e <= tolerance for e in errors), sum(e >= -tolerance for e in errors)
        if below + left < majority or above + left < majority:
            return True  # this metric's median is out of tolerance whatever the rest measure
        within_all &= below >= majority and above >= majority
    return within_all


def median_errors(checks: list[dict], part: str = "what_if") -> dict[str, float]:
    return {m: statistics.median(c[part][m]["error"] for c in checks) for m in METRICS}


def error_table(checks: list[dict], part: str = "what_if") -> str:
    """One row per metric: every pair's error and the median."""
    medians = median_errors(checks, part)
    return "\n".join(f"{m}: errors {', '.join(format(c[part][m]['error'], '+.1%') for c in checks)}"
                     f" (median {medians[m]:+.1%})" for m in METRICS)


def main(argv: list[str]) -> None:
    model_dir, kind, trace_dir, pairs, *tolerance = argv
    requests, offsets = WORKLOADS[kind]()
    checks: list[dict] = []
    while len(checks) < int(pairs):
        pair_dir = Path(trace_dir) / f"pair{len(checks)}"
        pair_dir.mkdir(parents=True)
        checks.append(check_what_if(model_dir, requests, offsets, RECORDED, WHAT_IF, pair_dir).record())
        print(json.dumps(checks[-1]), flush=True)
        if tolerance and median_within_is_decided(checks, int(pairs), float(tolerance[0])):
            break


if __name__ == "__main__":
    main(sys.argv[1:])
