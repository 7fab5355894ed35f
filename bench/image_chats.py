"""Second turns of image chats: what the vision budget costs when the images are already in the vision cache.

``--chats`` chats on the tiny Qwen2-VL, each with its own 224 x 224 image, all arriving at once. The tiny model's
processor caps an image at 224 x 224 pixels, 64 media tokens, where a real Qwen2-VL photo is about 1,000: so
``--vision-token-budget 64`` gives the tiny model what the default budget of 1024 gives a real one, one image a
tick (the default here takes 16). Their first
turns run to the end; then every chat's second turn arrives at once: the first turn's messages, the answer, a
new question, and the same image, which the vision cache holds (and the prefix cache the first turn's KV).
Reported per turn: the ticks that encoded media, the ticks until every request had its first token, time to
first token (mean and max) and the turn's wall time; the outputs of the second turn are checked against
``mlx_vlm.stream_generate`` run alone on the same prompt.

Since the vision budget pays only for media the encoders run on (ARCHITECTURE.md, "Media"), a second turn's
cached image costs nothing: all of them are taken in one tick. Run the same script on a tree from before that
rule to see what counting every image cost.

    python -m bench.image_chats [--chats 16] [--vision-token-budget 64] [--new-tokens 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _image(seed: int, size: int):
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8))


def _turn(engine, requests, new_tokens: int) -> dict:
    """Add every (messages, images) at once, step to the end; ticks and times of this turn."""
    from scheduler import SamplingParams

    sampling = SamplingParams(max_tokens=new_tokens)
    start_tick = engine.tick
    t0 = time.perf_counter()
    ids = [engine.add_request(prompt=m, images=im, sampling=sampling) for m, im in requests]
    first: dict[str, float] = {}
    first_tick: dict[str, int] = {}
    tokens = {rid: [] for rid in ids}
    while engine.has_pending():
        tick = engine.tick
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
            if out.token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - t0
                first_tick[out.request_id] = tick - start_tick
    wall = time.perf_counter() - t0
    return {"ids": ids, "tokens": [tokens[r] for r in ids], "wall_s": wall,
            "ttft_mean_s": statistics.mean(first.values()), "ttft_max_s": max(first.values()),
            "all_first_ticks": max(first_tick.values()) + 1, "start_tick": start_tick, "end_tick": engine.tick}


def _encode_ticks(sink, start: int, end: int) -> int:
    return len({e["tick"] for e in sink.events if e["event"] == "vision_encode" and start <= e["tick"] < end}
               | {e["tick"] for e in sink.events if e["event"] == "plan" and e.get("encode")
                  and start <= e["tick"] < end})


def run(model, processor, chats: int, new_tokens: int, vision_token_budget: int | None) -> tuple[dict, dict, list]:
    from scheduler import Engine, EngineConfig
    from scheduler.events import MemorySink

    images = [[_image(100 + i, 224)] for i in range(chats)]
    first_msgs = [[{"role": "user", "content": [{"type": "image"},
                                                {"type": "text", "text": f"What is in picture {i}?"}]}]
                  for i in range(chats)]
    sink = MemorySink()
    budget = {} if vision_token_budget is None else {"vision_token_budget": vision_token_budget}
    engine = Engine(model, processor, EngineConfig(**budget), event_sinks=[sink])
    try:
        one = _turn(engine, list(zip(first_msgs, images)), new_tokens)
        answers = [processor.tokenizer.decode(t) for t in one["tokens"]]
        second_msgs = [m + [{"role": "assistant", "content": [{"type": "text", "text": a}]},
                            {"role": "user", "content": [{"type": "text", "text": "And its colours?"}]}]
                       for m, a in zip(first_msgs, answers)]
        two = _turn(engine, list(zip(second_msgs, images)), new_tokens)
        for turn in (one, two):
            turn["encode_ticks"] = _encode_ticks(sink, turn["start_tick"], turn["end_tick"])
        stats = engine.vision_cache_stats() or {}
        two["vision_hits"] = stats.get("hits")
    finally:
        engine.close()
    return one, two, list(zip(second_msgs, images))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m bench.image_chats", description=__doc__.split("\n")[0])
    ap.add_argument("--chats", type=int, default=16)
    ap.add_argument("--vision-token-budget", type=int, default=None,
                    help="EngineConfig.vision_token_budget (default: the engine's)")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    import mlx_vlm

    from scheduler.fixtures.tiny_models import build_model

    from .vision_peer import solo

    with tempfile.TemporaryDirectory(prefix="mlxsched-image-chats-") as d:
        model, processor = mlx_vlm.load(str(build_model("vlm", Path(d) / "vlm")))
        run(model, processor, 2, 2, args.vision_token_budget)  # warm-up
        runs = []
        for rep in range(args.repeats):
            runs.append(run(model, processor, args.chats, args.new_tokens, args.vision_token_budget))
            one, two, _ = runs[-1]
            print(f"  rep {rep}: turn 1 {one['wall_s']:.3f}s, turn 2 {two['wall_s']:.3f}s", file=sys.stderr)
        from mlx_vlm.prompt_utils import apply_chat_template

        second = runs[0][2]
        truth = solo(model, processor, [apply_chat_template(processor, model.config, m, num_images=len(im))
                                        for m, im in second], [im for _, im in second], args.new_tokens)
    load = os.getloadavg()[0]
    print(f"Command: `python -m bench.image_chats {shlex.join(argv)}`; best of {args.repeats} by wall time; "
          f"load1 {load:.1f} on {os.cpu_count()} CPUs\n")
    print("| turn | ticks that encoded media | ticks until every first token | TTFT mean s | TTFT max s | wall s |"
          " vision-cache hits | outputs equal to mlx_vlm alone |")
    print("|---|---|---|---|---|---|---|---|")
    for index, name in ((0, "1: new images"), (1, "2: the same images again")):
        best = min((r[index] for r in runs), key=lambda t: t["wall_s"])
        exact = (f"{sum(a == b for a, b in zip(best['tokens'], truth))}/{len(truth)}" if index == 1 else "")
        hits = best.get("vision_hits", "") if index == 1 else ""
        print(f"| {name} | {best['encode_ticks']} | {best['all_first_ticks']} | {best['ttft_mean_s']:.3f} | "
              f"{best['ttft_max_s']:.3f} | {best['wall_s']:.3f} | {hits} | {exact} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
