"""Mixed image + text workload on the tiny Qwen2-VL: our Engine vs the reference (vllm-mlx `MLLMBatchGenerator`).

16 requests, every other one with an image (4 sizes; `--image-every 1`: all of them), greedy, `--new-tokens` each. Both sides get the same
templated prompt strings (mlx-vlm's `apply_chat_template`) and the same image files; ground truth is
`mlx_vlm.stream_generate` run alone per request, and each side's outputs are checked against it. The sides
alternate (ours, reference / reference, ours / ...), each warmed up once first.

    python -m bench.vision_peer [--requests 16] [--new-tokens 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

from .compare import RunStats, _Clock

SIZES = [(112, 140), (56, 56), (84, 112), (140, 84)]


def _workload(processor, config, tmp: Path, n: int,
              image_every: int = 2) -> tuple[list[str], list[list[str] | None]]:
    import numpy as np
    from mlx_vlm.prompt_utils import apply_chat_template
    from PIL import Image

    prompts, images = [], []
    for i in range(n):
        if i % image_every == 0:
            w, h = SIZES[(i // image_every) % len(SIZES)]
            path = tmp / f"img{i}.png"
            Image.fromarray(np.random.default_rng(i).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
            prompts.append(apply_chat_template(processor, config, f"picture {i}", num_images=1))
            images.append([str(path)])
        else:
            prompts.append(apply_chat_template(processor, config, "tell me something " * (1 + i), num_images=0))
            images.append(None)
    return prompts, images


def run_ours(engine, prompts, images, new_tokens: int) -> RunStats:
    from scheduler import SamplingParams

    sampling = SamplingParams(max_tokens=new_tokens)
    clock = _Clock(len(prompts), new_tokens)
    index = {engine.add_request(prompt=p, images=imgs, sampling=sampling): i
             for i, (p, imgs) in enumerate(zip(prompts, images))}
    while engine.has_pending():
        for out in engine.step():
            clock.record(index[out.request_id], out.token_ids)
        clock.end_step()
    return clock.stats("ours")


def solo(model, processor, prompts, images, new_tokens: int) -> list[list[int]]:
    import mlx_vlm

    out = []
    for p, imgs in zip(prompts, images):
        last = None
        for last in mlx_vlm.stream_generate(model, processor, p, image=imgs, max_tokens=new_tokens,
                                            temperature=0.0):
            pass
        out.append(list(last.token_ids))
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m bench.vision_peer", description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--image-every", type=int, default=2,
                    help="every Nth request has an image (2: the mixed workload; 1: images only)")
    args = ap.parse_args(argv)

    import mlx_vlm

    from scheduler import Engine, EngineConfig
    from scheduler.fixtures.tiny_models import build_model

    from .reference import available, run_reference_media

    why = available()
    if why:
        print(why, file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="mlxsched-vision-peer-") as d:
        tmp = Path(d)
        model_dir = build_model("vlm", tmp / "vlm")
        model, processor = mlx_vlm.load(str(model_dir))
        prompts, images = _workload(processor, model.config, tmp, args.requests, args.image_every)
        truth = solo(model, processor, prompts, images, args.new_tokens)
        # the reference gets a model instance of its own: mlx-vlm's Qwen2-VL language model keeps position
        # state between calls (its rope deltas), which the solo runs above and our engine's calls would leave
        ref_model, ref_processor = mlx_vlm.load(str(model_dir))

        def ours() -> RunStats:
            # a fresh engine per run: vision cache cold, like the reference's fresh generator
            engine = Engine(model, processor, EngineConfig())
            try:
                return run_ours(engine, prompts, images, args.new_tokens)
            finally:
                engine.close()

        def ref() -> RunStats:
            return run_reference_media(ref_model, ref_processor, prompts, images, args.new_tokens)

        run_ours(Engine(model, processor, EngineConfig()), prompts, images, 2)  # warm-up
        run_reference_media(ref_model, ref_processor, prompts, images, 2)
        runs = {"ours": [], "vllm-mlx": []}
        for rep in range(args.repeats):
            order = [("ours", ours), ("vllm-mlx", ref)]
            for name, fn in order if rep % 2 == 0 else order[::-1]:
                runs[name].append(fn())
                r = runs[name][-1]
                print(f"  rep {rep} {name}: wall {r.wall_s:.3f}s e2e {r.e2e_tps:.1f} tok/s load1 {r.load1:.2f}",
                      file=sys.stderr)
    best = {k: min(v, key=lambda r: r.wall_s) for k, v in runs.items()}
    exact = {k: sum(a == b for a, b in zip(v[0].outputs, truth)) for k, v in runs.items()}
    load = max(r.load1 for v in runs.values() for r in v)
    print(f"Command: `python -m bench.vision_peer {shlex.join(argv)}`; best of {args.repeats} per side; "
          f"max load1 {load:.1f} on {os.cpu_count()} CPUs\n")
    print("| side | wall s | e2e tok/s | all-first s | requests short (error or early stop) "
          "| outputs equal to mlx_vlm.stream_generate alone |")
    print("|---|---|---|---|---|---|")
    for k, r in best.items():
        print(f"| {k} | {r.wall_s:.3f} | {r.e2e_tps:.0f} | {r.t_all_first_s:.3f} | {r.short_requests} "
              f"| {exact[k]}/{args.requests} |")
    if best["vllm-mlx"].e2e_tps and not best["vllm-mlx"].short_requests:
        # best of the repeats per side (the least disturbed run), and the medians (how a typical run compares)
        median = {k: statistics.median(r.e2e_tps for r in v) for k, v in runs.items()}
        print(f"\nours / reference, e2e: **{best['ours'].e2e_tps / best['vllm-mlx'].e2e_tps:.2f}x** "
              f"(medians of the repeats: {median['ours'] / median['vllm-mlx']:.2f}x)")
    else:
        print("\nours / reference: no ratio (the reference did not complete every request, so the work differs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
