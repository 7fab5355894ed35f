"""End-to-end tok/s of a mixed image + text workload per VLM family: our Engine (all requests batched) vs each
request alone through mlx_vlm.stream_generate, on the same loaded tiny model, in one process.

Workload: 16 chat requests, 8 with one image (four sizes, distinct pixels) and 8 text-only of varied length,
greedy, at most ``--new-tokens`` each (both sides stop on the model's eos, so they do the same work: the outputs
are compared token by token). Ours: every request submitted at once, timed from the first ``add_request`` to the
last token. Peer: the requests one after the other through ``mlx_vlm.stream_generate``, timed end to end. Each
side first runs a short warm-up; then ``--repeats`` timed runs each, alternating; tok/s = generated tokens / the
best wall seconds (the ratio of the medians is printed beside it).

    python -m bench.vlm_families --families qwen2_vl qwen3_vl gemma3 --new-tokens 32
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

SIZES = [(112, 140), (56, 56), (84, 112), (140, 84)]
TEXTS = ["Hi.", "What does the cat see today?",
         "The old man reads many books in the morning, and the teacher brings a warm coat.",
         "Why does the river see the green door? The machine loads a new token; then the farmer keeps it."]


def build(family: str, out: Path) -> Path:
    if family == "qwen2_vl":
        from scheduler.fixtures.tiny_models import build_model

        return build_model("vlm", out)
    from scheduler.fixtures.vlm_families import build_tiny_vlm

    return build_tiny_vlm(family, out)


def workload(n: int = 16) -> list[tuple[list[dict], list]]:
    requests = []
    for i in range(n):
        if i % 2 == 0:
            w, h = SIZES[(i // 2) % 4]
            image = Image.fromarray(np.random.default_rng(i).integers(0, 256, (h, w, 3), dtype=np.uint8))
            content = [{"type": "image"}, {"type": "text", "text": f"Picture {i}: {TEXTS[(i // 2) % 2]}"}]
            requests.append(([{"role": "user", "content": content}], [image]))
        else:
            requests.append(([{"role": "user", "content": " ".join(TEXTS[: 1 + (i // 2) % 4]) + f" ({i})"}], []))
    return requests


def run_ours(model, processor, requests, new_tokens: int) -> tuple[float, list[list[int]]]:
    from scheduler import Engine, EngineConfig, SamplingParams

    engine = Engine(model, processor, EngineConfig(max_batched_tokens=4096, max_seqs=64, prefill_chunk=512))
    t0 = time.perf_counter()
    ids = [engine.add_request(prompt=m, images=im or None, sampling=SamplingParams(max_tokens=new_tokens))
           for m, im in requests]
    tokens = {rid: [] for rid in ids}
    while engine.has_pending():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
    return time.perf_counter() - t0, [tokens[rid] for rid in ids]


def run_peer(model, processor, requests, new_tokens: int) -> tuple[float, list[list[int]]]:
    import mlx_vlm
    from mlx_vlm.prompt_utils import apply_chat_template

    t0 = time.perf_counter()
    outputs = []
    for messages, images in requests:
        prompt = apply_chat_template(processor, model.config, messages, num_images=len(images))
        last = None
        for last in mlx_vlm.stream_generate(model, processor, prompt, image=images or None, max_tokens=new_tokens,
                                            temperature=0.0):
            pass
        outputs.append(list(last.token_ids))
    return time.perf_counter() - t0, outputs


def measure(family: str, new_tokens: int, workdir: Path, repeats: int) -> dict:
    """`repeats` timed runs per side, the sides alternating; the best wall time of each side (the median too)."""
    import mlx_vlm

    model, processor = mlx_vlm.load(str(build(family, workdir / family)))
    requests = workload()
    run_ours(model, processor, requests[:4], 2)  # warm-up
    run_peer(model, processor, requests[:2], 2)
    ours_times, peer_times = [], []
    for _ in range(repeats):
        ours_s, ours = run_ours(model, processor, requests, new_tokens)
        peer_s, peer = run_peer(model, processor, requests, new_tokens)
        ours_times.append(ours_s)
        peer_times.append(peer_s)
    tokens = sum(len(t) for t in ours)
    ours_s, peer_s = min(ours_times), min(peer_times)
    return {"family": family, "tokens": tokens, "ours_s": ours_s, "peer_s": peer_s,
            "ours_tps": tokens / ours_s, "peer_tps": sum(len(t) for t in peer) / peer_s,
            "median_ratio": float(np.median(peer_times)) / float(np.median(ours_times)),
            "identical": ours == peer}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=["qwen2_vl", "qwen3_vl", "gemma3"])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side, alternating (best and median)")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            print(f"{family} ...", file=sys.stderr)
            rows.append(measure(family, args.new_tokens, Path(tmp), args.repeats))
    print(f"best of {args.repeats} per side (ratio of medians beside it)")
    print("| family | tokens | ours s | ours tok/s | mlx-vlm alone s | mlx-vlm alone tok/s | ratio (median) | "
          "outputs identical |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['family']} | {r['tokens']} | {r['ours_s']:.2f} | {r['ours_tps']:.1f} | {r['peer_s']:.2f} | "
              f"{r['peer_tps']:.1f} | {r['ours_tps'] / r['peer_tps']:.2f}x ({r['median_ratio']:.2f}x) | "
              f"{r['identical']} |")
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
