"""A system prompt shared by image requests, each with its own image, arriving one after another: our Engine with
and without its prefix cache, and the reference (vllm-mlx `MLLMBatchGenerator`) with and without its own, on the
tiny Qwen2-VL.

Our prefix keys carry the media from a request's first media token on (`Request.prefix_key`), so every request
after the first restores the system prompt's state and prefills only its image and question. The reference keys
its prefix cache by token ids alone: the image placeholders of two images of one size are the same ids, so a
request reuses the state of another request's image and its output is not what its own image gives (counted in
the last column).

Requests arrive on a wall-clock schedule (request i at i x `--interval` seconds after the start), the same for
each side: a loop adds what has arrived, steps, and sleeps only when nothing is running. Reported per side:
time to first token (mean and the largest) and request latency (arrival to last token, mean), the prefill tokens
the prefix cache saved (ours), and the outputs checked against `mlx_vlm.stream_generate` run alone.

    python -m bench.shared_prefix [--requests 16] [--system-words 300] [--interval 0.04] [--new-tokens 16]
                                  [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

SENTENCE = "The old man reads many books in the morning, and the teacher brings a warm coat to the farmer."
SIZES = [(56, 84), (84, 56), (84, 84), (112, 56)]


@dataclass
class Timings:
    side: str
    ttft_s: list[float]
    latency_s: list[float]
    outputs: list[list[int]]
    wall_s: float
    tokens_saved: int = 0

    def row(self, exact: int) -> str:
        return (f"| {self.side} | {statistics.mean(self.ttft_s) * 1e3:.1f} | {max(self.ttft_s) * 1e3:.1f} | "
                f"{statistics.mean(self.latency_s) * 1e3:.1f} | {self.wall_s:.3f} | {self.tokens_saved} | "
                f"{exact}/{len(self.outputs)} |")


def workload(processor: Any, config: Any, tmp: Path, n: int, system_words: int) -> tuple[list[str], list[str]]:
    """Templated prompts (the shared system message, then an image and a question) and one image file each."""
    import numpy as np
    from mlx_vlm.prompt_utils import apply_chat_template
    from PIL import Image

    words = SENTENCE.split()
    system = " ".join(words[i % len(words)] for i in range(system_words))
    prompts, paths = [], []
    for i in range(n):
        w, h = SIZES[i % len(SIZES)]
        path = tmp / f"img{i}.png"
        Image.fromarray(np.random.default_rng(100 + i).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"What is in picture {i}?"}]}]
        prompts.append(apply_chat_template(processor, config, messages, num_images=1))
        paths.append(str(path))
    return prompts, paths


def _arrivals_loop(n: int, interval: float, add: Callable[[int], Any], step: Callable[[], list[tuple[Any, list[int],
                   bool]]], pending: Callable[[], bool], side: str) -> Timings:
    """Add request i once i x interval seconds have passed; step while anything runs. `step` returns (handle,
    new tokens, finished) per request that produced something."""
    outputs: list[list[int]] = [[] for _ in range(n)]
    first: list[float | None] = [None] * n
    done: list[float | None] = [None] * n
    index: dict[Any, int] = {}
    t0 = time.perf_counter()
    added = 0
    while added < n or pending():
        now = time.perf_counter() - t0
        while added < n and added * interval <= now:
            index[add(added)] = added
            added += 1
        if not pending():
            time.sleep(max(0.0, added * interval - (time.perf_counter() - t0)))
            continue
        for handle, tokens, finished in step():
            i = index[handle]
            t = time.perf_counter() - t0
            if tokens and first[i] is None:
                first[i] = t
            outputs[i].extend(tokens)
            if finished:
                done[i] = t
    wall = time.perf_counter() - t0
    ttft = [(f if f is not None else wall) - i * interval for i, f in enumerate(first)]
    latency = [(d if d is not None else wall) - i * interval for i, d in enumerate(done)]
    return Timings(side, ttft, latency, outputs, wall)


def run_ours(model: Any, processor: Any, prompts: list[str], paths: list[str], new_tokens: int, interval: float,
             prefix_cache: bool) -> Timings:
    from scheduler import Engine, EngineConfig, SamplingParams

    engine = Engine(model, processor, EngineConfig(prefix_cache_bytes=(256 << 20) if prefix_cache else 0))
    sampling = SamplingParams(max_tokens=new_tokens)
    try:
        timings = _arrivals_loop(
            len(prompts), interval,
            lambda i: engine.add_request(prompt=prompts[i], images=[paths[i]], sampling=sampling),
            lambda: [(o.request_id, list(o.token_ids), o.finished) for o in engine.step()],
            engine.has_pending, "ours" if prefix_cache else "ours, no prefix cache")
        timings.tokens_saved = engine.prefix_cache_stats()["tokens_saved"] if prefix_cache else 0
        return timings
    finally:
        engine.close()


def run_reference(model: Any, processor: Any, prompts: list[str], paths: list[str], new_tokens: int,
                  interval: float, prefix_cache: bool) -> Timings:
    from vllm_mlx.memory_cache import MemoryCacheConfig
    from vllm_mlx.mllm_batch_generator import MLLMBatchGenerator, MLLMBatchRequest

    from .reference import _data_uri, quiet_reference_logs

    quiet_reference_logs()
    gen = MLLMBatchGenerator(model, processor, stop_tokens=set(), completion_batch_size=max(32, len(prompts)),
                             prefill_step_size=1024,
                             prefix_cache_config=MemoryCacheConfig(max_memory_mb=256) if prefix_cache else None)
    live: set[int] = set()

    def add(i: int) -> int:
        uid = gen.insert([MLLMBatchRequest(uid=0, request_id=f"r{i}", prompt=prompts[i], images=[_data_uri(paths[i])],
                                           max_tokens=new_tokens, temperature=0.0, top_p=1.0)])[0]
        live.add(uid)
        return uid

    def step() -> list[tuple[int, list[int], bool]]:
        out = []
        for r in gen.next():
            finished = r.finish_reason is not None
            if finished:
                live.discard(r.uid)
            out.append((r.uid, [] if r.finish_reason == "error" else [r.token], finished))
        return out

    try:
        timings = _arrivals_loop(len(prompts), interval, add, step, lambda: bool(live),
                                 "vllm-mlx" if prefix_cache else "vllm-mlx, no prefix cache")
        timings.tokens_saved = gen.prefix_cache.get_stats()["tokens_saved"] if prefix_cache else 0
        return timings
    finally:
        gen.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.shared_prefix", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--system-words", type=int, default=300)
    parser.add_argument("--interval", type=float, default=0.04, help="seconds between arrivals")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-peer", action="store_true", help="ours only (no vllm-mlx)")
    args = parser.parse_args(argv)

    import mlx_vlm

    from scheduler.fixtures.tiny_models import build_model

    from .reference import available
    from .vision_peer import solo

    peer = not args.no_peer
    if peer and (why := available()) is not None:
        print(why, file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model, processor = mlx_vlm.load(str(build_model("vlm", tmp / "vlm")))
        prompts, paths = workload(processor, model.config, tmp, args.requests, args.system_words)
        want = solo(model, processor, prompts, [[p] for p in paths], args.new_tokens)
        sides: list[Callable[[], Timings]] = [
            lambda: run_ours(model, processor, prompts, paths, args.new_tokens, args.interval, True),
            lambda: run_ours(model, processor, prompts, paths, args.new_tokens, args.interval, False)]
        if peer:  # its own model instance: it keeps per-instance state on the language model
            ref_model, ref_processor = mlx_vlm.load(str(tmp / "vlm"))
            sides += [lambda cache=cache: run_reference(ref_model, ref_processor, prompts, paths, args.new_tokens,
                                                        args.interval, cache) for cache in (True, False)]
        for side in sides:  # warm-up
            side()
        best: dict[str, Timings] = {}
        for rep in range(args.repeats):
            order = sides if rep % 2 == 0 else sides[::-1]
            for side in order:
                t = side()
                print(f"  rep {rep} {t.side}: mean TTFT {statistics.mean(t.ttft_s) * 1e3:.1f} ms, "
                      f"wall {t.wall_s:.3f} s, load1 {os.getloadavg()[0]:.1f}", file=sys.stderr)
                if t.side not in best or statistics.mean(t.ttft_s) < statistics.mean(best[t.side].ttft_s):
                    best[t.side] = t
        prompt_tokens = len(processor.tokenizer.encode(prompts[0]))
    print(f"Command: `python -m bench.shared_prefix {shlex.join(argv if argv is not None else sys.argv[1:])}`; "
          f"{args.requests} requests of about {prompt_tokens} prompt tokens before image expansion, one every "
          f"{args.interval * 1e3:.0f} ms; the run with the lowest mean TTFT of {args.repeats} per side; "
          f"load1 {os.getloadavg()[0]:.1f}\n")
    print("| side | mean TTFT ms | max TTFT ms | mean latency ms | wall s | prefill tokens from the prefix cache | "
          "outputs equal to mlx_vlm.stream_generate alone |")
    print("|---|---|---|---|---|---|---|")
    for t in best.values():
        print(t.row(sum(got == w for got, w in zip(t.outputs, want))))
    ours = statistics.mean(best["ours"].ttft_s)
    for name, t in best.items():
        if name != "ours":
            print(f"\n{name} / ours, mean TTFT: **{statistics.mean(t.ttft_s) / ours:.2f}x**")
    return 0


if __name__ == "__main__":
    sys.exit(main())
