"""A system prompt shared by image requests, each with its own image, arriving one after another: our Engine with
and without its prefix cache, and the reference (vllm-mlx `MLLMBatchGenerator`) with and without its own, on the
tiny Qwen2-VL.

Our prefix keys carry each media item from its first token on (`Request.prefix_key`), so every request after the
first restores the system prompt's state and prefills only its image and question, and (`--turns T`) each turn
of a chat that adds an image restores the turns before it. The reference keys its prefix cache by token ids
alone: the image placeholders of two images of one size are the same ids, so a request reuses the state of
another request's image and its output is not what its own image gives (counted in the last column).

Requests arrive on a wall-clock schedule (request i, or chat i's first turn, at i x `--interval` seconds after
the start; a chat's next turn when its previous one has ended), the same for each side: a loop adds what has
arrived, steps, and sleeps only when nothing is running. Reported per side:
time to first token (mean and the largest) and request latency (arrival to last token, mean), the prefill tokens
the prefix cache saved (ours), and the outputs checked against `mlx_vlm.stream_generate` run alone.

`--family NAME` runs another tiny family (`scheduler/fixtures/vlm_families.py`, seed 0) in place of the tiny
Qwen2-VL: with `--turns`, what keying media per image (`FamilySpec.item_split`) gives a chat on that family.

    python -m bench.shared_prefix [--requests 16] [--system-words 300] [--interval 0.04] [--new-tokens 16]
                                  [--turns 1] [--repeats 3] [--family qwen2_vl] [--no-peer]
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

    @property
    def failed(self) -> int:
        """Requests that ended without a token (the side's own error: its TTFT is the time it took to fail)."""
        return sum(1 for out in self.outputs if not out)

    def row(self, exact: int) -> str:
        return (f"| {self.side} | {statistics.mean(self.ttft_s) * 1e3:.1f} | {max(self.ttft_s) * 1e3:.1f} | "
                f"{statistics.mean(self.latency_s) * 1e3:.1f} | {self.wall_s:.3f} | {self.tokens_saved} | "
                f"{exact}/{len(self.outputs)} | {self.failed} |")


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds after the start, at the earliest
    after: int | None = None  # the request whose end it waits for (the chat's previous turn)


def workload(processor: Any, config: Any, tmp: Path, n: int, system_words: int, turns: int, interval: float
             ) -> tuple[list[str], list[list[str]], list[Arrival]]:
    """Templated prompts, image files and arrivals. `turns` 1: `n` requests, each the shared system message, an
    image and a question, one every `interval`. `turns` T > 1: `n` chats started `interval` apart, each turn
    resending the chat so far (its images, questions and a fixed answer) with a new image and question, sent
    when the chat's previous turn has ended."""
    import numpy as np
    from mlx_vlm.prompt_utils import apply_chat_template
    from PIL import Image

    words = SENTENCE.split()
    system = [{"role": "system", "content": " ".join(words[i % len(words)] for i in range(system_words))}]
    prompts, paths, arrivals = [], [], []
    for chat in range(n):
        messages, images = list(system), []
        for turn in range(turns):
            k = chat * turns + turn
            w, h = SIZES[k % len(SIZES)]
            path = tmp / f"img{k}.png"
            Image.fromarray(np.random.default_rng(100 + k).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
            if turn:
                messages.append({"role": "assistant", "content": "It is a picture of coloured noise."})
            messages.append({"role": "user", "content": [{"type": "image"},
                                                         {"type": "text", "text": f"What is in picture {k}?"}]})
            images.append(str(path))
            prompts.append(apply_chat_template(processor, config, messages, num_images=len(images)))
            paths.append(list(images))
            arrivals.append(Arrival(chat * interval, len(arrivals) - 1 if turn else None))
    return prompts, paths, arrivals


def _arrivals_loop(arrivals: list[Arrival], add: Callable[[int], Any], step: Callable[[], list[tuple[Any, list[int],
                   bool]]], pending: Callable[[], bool], side: str) -> Timings:
    """Add each request once its time has come and the request it waits for has ended; step while anything
    runs. `step` returns (handle, new tokens, finished) per request that produced something. TTFT and latency
    count from each request's arrival."""
    n = len(arrivals)
    outputs: list[list[int]] = [[] for _ in range(n)]
    arrived: list[float | None] = [None] * n
    first: list[float | None] = [None] * n
    done: list[float | None] = [None] * n
    index: dict[Any, int] = {}
    t0 = time.perf_counter()
    while any(d is None for d in done):
        now = time.perf_counter() - t0
        for i, a in enumerate(arrivals):
            if arrived[i] is None and a.at <= now and (a.after is None or done[a.after] is not None):
                arrived[i] = max(a.at, done[a.after] if a.after is not None else 0.0)
                index[add(i)] = i
        if not pending():
            waiting = [a.at for i, a in enumerate(arrivals) if arrived[i] is None and a.after is None]
            time.sleep(max(0.0, min(waiting, default=now) - (time.perf_counter() - t0)))
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
    ttft = [(f if f is not None else d) - a for f, d, a in zip(first, done, arrived)]
    latency = [d - a for d, a in zip(done, arrived)]
    return Timings(side, ttft, latency, outputs, wall)


def run_ours(model: Any, processor: Any, prompts: list[str], paths: list[list[str]], new_tokens: int,
             arrivals: list[Arrival], prefix_cache: bool) -> Timings:
    from scheduler import Engine, EngineConfig, SamplingParams

    engine = Engine(model, processor, EngineConfig(prefix_cache_bytes=(256 << 20) if prefix_cache else 0))
    sampling = SamplingParams(max_tokens=new_tokens)
    try:
        timings = _arrivals_loop(
            arrivals, lambda i: engine.add_request(prompt=prompts[i], images=paths[i], sampling=sampling),
            lambda: [(o.request_id, list(o.token_ids), o.finished) for o in engine.step()],
            engine.has_pending, "ours" if prefix_cache else "ours, no prefix cache")
        timings.tokens_saved = engine.prefix_cache_stats()["tokens_saved"] if prefix_cache else 0
        return timings
    finally:
        engine.close()


def run_reference(model: Any, processor: Any, prompts: list[str], paths: list[list[str]], new_tokens: int,
                  arrivals: list[Arrival], prefix_cache: bool) -> Timings:
    from vllm_mlx.memory_cache import MemoryCacheConfig
    from vllm_mlx.mllm_batch_generator import MLLMBatchGenerator, MLLMBatchRequest

    from .reference import _data_uri, quiet_reference_logs

    quiet_reference_logs()
    gen = MLLMBatchGenerator(model, processor, stop_tokens=set(), completion_batch_size=max(32, len(prompts)),
                             prefill_step_size=1024,
                             prefix_cache_config=MemoryCacheConfig(max_memory_mb=256) if prefix_cache else None)
    live: set[int] = set()

    def add(i: int) -> int:
        request = MLLMBatchRequest(uid=0, request_id=f"r{i}", prompt=prompts[i],
                                   images=[_data_uri(path) for path in paths[i]], max_tokens=new_tokens,
                                   temperature=0.0, top_p=1.0)
        uid = gen.insert([request])[0]
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
        timings = _arrivals_loop(arrivals, add, step, lambda: bool(live),
                                 "vllm-mlx" if prefix_cache else "vllm-mlx, no prefix cache")
        timings.tokens_saved = gen.prefix_cache.get_stats()["tokens_saved"] if prefix_cache else 0
        return timings
    finally:
        gen.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.shared_prefix", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--system-words", type=int, default=300)
    parser.add_argument("--interval", type=float, default=0.04, help="seconds between arrivals (between chats' "
                        "first turns with --turns)")
    parser.add_argument("--turns", type=int, default=1, help="turns per chat, each adding an image (1: single "
                        "requests)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-peer", action="store_true", help="ours only (no vllm-mlx)")
    parser.add_argument("--family", default="qwen2_vl", help="the tiny family to run (default: the tiny Qwen2-VL "
                        "of `mlxsched make-model vlm`; others from scheduler/fixtures/vlm_families.py)")
    args = parser.parse_args(argv)

    import mlx_vlm

    from scheduler.fixtures.tiny_models import build_model
    from scheduler.fixtures.vlm_families import build_tiny_vlm

    from .reference import available
    from .vision_peer import solo

    peer = not args.no_peer
    if peer and (why := available()) is not None:
        print(why, file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model_dir = (build_model("vlm", tmp / "vlm") if args.family == "qwen2_vl"
                     else build_tiny_vlm(args.family, tmp / "vlm"))
        model, processor = mlx_vlm.load(str(model_dir))
        prompts, paths, arrivals = workload(processor, model.config, tmp, args.requests, args.system_words,
                                            args.turns, args.interval)
        want = solo(model, processor, prompts, paths, args.new_tokens)
        sides: list[Callable[[], Timings]] = [
            lambda: run_ours(model, processor, prompts, paths, args.new_tokens, arrivals, True),
            lambda: run_ours(model, processor, prompts, paths, args.new_tokens, arrivals, False)]
        if peer:  # its own model instance: it keeps per-instance state on the language model
            ref_model, ref_processor = mlx_vlm.load(str(model_dir))
            sides += [lambda cache=cache: run_reference(ref_model, ref_processor, prompts, paths, args.new_tokens,
                                                        arrivals, cache) for cache in (True, False)]
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
    shape = (f"{args.requests} requests of about {prompt_tokens} prompt tokens before image expansion, one every "
             f"{args.interval * 1e3:.0f} ms" if args.turns == 1 else
             f"{args.requests} chats of {args.turns} turns (first turn about {prompt_tokens} prompt tokens before image "
             f"expansion), started {args.interval * 1e3:.0f} ms apart")
    if args.family != "qwen2_vl":
        shape = f"tiny {args.family}: {shape}"
    # the reference runs without stop tokens (as in bench.vision_peer): its outputs compare with solo ones only
    # where those ran to --new-tokens
    early = sum(len(w) < args.new_tokens for w in want)
    print(f"Command: `python -m bench.shared_prefix {shlex.join(argv if argv is not None else sys.argv[1:])}`; "
          f"{shape}; the run with the lowest mean TTFT of {args.repeats} per side; load1 {os.getloadavg()[0]:.1f}; "
          f"solo outputs that stopped before --new-tokens: {early}\n")
    print("| side | mean TTFT ms | max TTFT ms | mean latency ms | wall s | prefill tokens from the prefix cache | "
          "outputs equal to mlx_vlm.stream_generate alone | failed (no token) |")
    print("|---|---|---|---|---|---|---|---|")
    for t in best.values():
        print(t.row(sum(got == w for got, w in zip(t.outputs, want))))
    ours = statistics.mean(best["ours"].ttft_s)
    for name, t in best.items():
        if name != "ours":
            ratio = (f"**{statistics.mean(t.ttft_s) / ours:.2f}x**" if not t.failed else
                     f"not comparable: {t.failed} of {len(t.outputs)} requests failed")
            print(f"\n{name} / ours, mean TTFT: {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
