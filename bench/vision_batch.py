"""Vision encoding in batches: the tick's media through the encoders in one call (``VLMAdapter.encode_many``)
against one call per request (``VLMAdapter.encode`` each), on the tiny seeded families.

For each family and each count of images (one 56x56 image per request, distinct pixels, so the equal-shape
families stack them all), the two sides alternate per repeat; the best of ``--repeats`` per side is reported
with the ratio one-by-one / batched (above 1: batching is faster) and the largest difference between the two
sides' embeddings. No vision cache, so every repeat runs the encoders.

``--gemma3`` also measures why gemma3 encodes per request (``scheduler/models/families.py``): its engine run
with the vision tower batched anyway (the spec replaced on this engine's adapter, here only), greedy, against
``mlx_vlm.stream_generate`` alone per request, and the difference of its batched vs single patch conv.

    python -m bench.vision_batch [--repeats 7] [--counts 1 4 8 16] [--families qwen2_vl idefics3 llava] [--gemma3]
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

SEEDS = {"qwen2_5_vl": 1, "idefics3": 4, "smolvlm": 4, "mistral3": 5}  # as tests/models/test_vlm_families.py
PROMPTS = ["Describe it.", "What is in the picture?", "Which colour is most common here?", "Tell me more."]


def _load(name: str, tmp: Path):
    import mlx_vlm

    from scheduler.fixtures.tiny_models import build_model
    from scheduler.fixtures.vlm_families import build_tiny_vlm

    out = tmp / name
    model_dir = build_model("vlm", out) if name == "qwen2_vl" else build_tiny_vlm(name, out, seed=SEEDS.get(name, 0))
    return mlx_vlm.load(str(model_dir))


def _image(seed: int, width: int = 56, height: int = 56):
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def _messages(text: str, n: int = 1) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * n + [{"type": "text", "text": text}]}]


def time_family(name: str, tmp: Path, counts: list[int], repeats: int) -> list[dict]:
    import mlx.core as mx

    from scheduler.models.adapter import VLMAdapter

    model, processor = _load(name, tmp)
    adapter = VLMAdapter(model, processor)  # no vision cache: every call runs the encoders
    rows = []
    for n in counts:
        prepared = [adapter.prepare(_messages(PROMPTS[i % len(PROMPTS)]), images=[_image(100 + i)])
                    for i in range(n)]
        items = [(p, ()) for p in prepared]
        calls: list = []
        adapter.encode_many(items, on_call=calls.append)  # warm-up (and the calls it makes)
        [adapter.encode(p) for p in prepared]
        times = {"batched": [], "one_by_one": []}
        for rep in range(repeats):
            sides = [("batched", lambda: adapter.encode_many(items)),
                     ("one_by_one", lambda: [adapter.encode(p) for p in prepared])]
            for side, fn in sides if rep % 2 == 0 else sides[::-1]:
                t0 = time.perf_counter()
                out = fn()
                times[side].append(time.perf_counter() - t0)
                if side == "batched":
                    batched = out
                else:
                    alone = out
        diff = max(float(mx.max(mx.abs(b.embeddings - a.embeddings)).item()) for b, a in zip(batched, alone))
        best = {k: min(v) for k, v in times.items()}
        rows.append(dict(family=name, batch=adapter.spec.vision_batch.value, images=n, calls=len(calls),
                         batched_ms=best["batched"] * 1e3, one_by_one_ms=best["one_by_one"] * 1e3,
                         ratio=best["one_by_one"] / best["batched"], max_diff=diff, load1=os.getloadavg()[0]))
        r = rows[-1]
        print(f"  {name} n={n}: batched {r['batched_ms']:.1f} ms ({r['calls']} call), one by one "
              f"{r['one_by_one_ms']:.1f} ms, ratio {r['ratio']:.2f}, max diff {diff:.2e}, load1 {r['load1']:.1f}",
              file=sys.stderr)
    return rows


def gemma3_batched(tmp: Path) -> dict:
    """gemma3 with its tower batched anyway: requests whose greedy tokens differ from mlx_vlm alone."""
    import dataclasses

    import mlx.core as mx
    import mlx_vlm
    from mlx_vlm.prompt_utils import apply_chat_template

    from scheduler import Engine, EngineConfig, SamplingParams
    from scheduler.models.families import VisionBatch

    model, processor = _load("gemma3", tmp)
    requests = [(_messages(PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS))), [_image(200 + i)])
                for i in range(8)]
    requests += [(_messages("Compare the two pictures, please.", 2), [_image(300), _image(301)])]
    truth = []
    for messages, images in requests:
        prompt = apply_chat_template(processor, model.config, messages, num_images=len(images))
        for last in mlx_vlm.stream_generate(model, processor, prompt, image=images, max_tokens=16, temperature=0.0):
            pass
        truth.append(list(last.token_ids))
    result = {}
    for mode in (VisionBatch.PER_REQUEST, VisionBatch.EQUAL_SHAPE):
        engine = Engine(model, processor, EngineConfig(vision_budget=64, vision_cache_bytes=0))
        adapter = engine._runner.adapter  # this engine's own adapter: the shipped spec is per request
        adapter.spec = dataclasses.replace(adapter.spec, vision_batch=mode)
        ids = [engine.add_request(prompt=m, images=im, sampling=SamplingParams(max_tokens=16)) for m, im in requests]
        tokens = {rid: [] for rid in ids}
        while engine.has_pending():
            for out in engine.step():
                tokens[out.request_id] += out.token_ids
        result[mode.value] = [i for i, rid in enumerate(ids) if tokens[rid] != truth[i]]
        engine.close()
    conv = model.vision_tower.vision_model.embeddings.patch_embedding
    adapter = engine._runner.adapter
    pixels = [adapter.prepare(m, images=im).media_inputs["pixel_values"].transpose(0, 2, 3, 1)
              for m, im in requests[:4]]
    stacked = conv(mx.concatenate(pixels))
    result["conv_diff"] = max(float(mx.max(mx.abs(stacked[i: i + 1] - conv(p))).item()) for i, p in enumerate(pixels))
    result["requests"] = len(requests)
    return result


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m bench.vision_batch", description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--counts", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--families", nargs="+", default=["qwen2_vl", "idefics3", "llava"])
    ap.add_argument("--gemma3", action="store_true", help="also measure gemma3 with its tower batched")
    args = ap.parse_args(argv)

    from .blas import describe, detect_blas

    blas = describe(detect_blas()).split(" (")[0]
    rows = []
    with tempfile.TemporaryDirectory(prefix="mlxsched-vision-batch-") as d:
        for name in args.families:
            rows += time_family(name, Path(d), args.counts, args.repeats)
        gemma = gemma3_batched(Path(d)) if args.gemma3 else None
    loads = [r["load1"] for r in rows]
    print(f"Command: `python -m bench.vision_batch {shlex.join(argv)}`; {blas}; best of {args.repeats} per side; "
          f"load1 {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} CPUs\n")
    print("| family | rule | images | encoder calls batched | batched ms | one by one ms | one-by-one / batched "
          "| max abs diff of embeddings | load1 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['family']} | {r['batch']} | {r['images']} | {r['calls']} | {r['batched_ms']:.1f} "
              f"| {r['one_by_one_ms']:.1f} | **{r['ratio']:.2f}x** | {r['max_diff']:.1e} | {r['load1']:.1f} |")
    if gemma is not None:
        print(f"\ngemma3, {gemma['requests']} image requests in one tick, greedy vs mlx_vlm alone: requests that "
              f"differ per request {gemma['per_request']}, batched {gemma['equal_shape']}; its patch conv on 4 "
              f"stacked images vs each alone: max abs diff {gemma['conv_diff']:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
