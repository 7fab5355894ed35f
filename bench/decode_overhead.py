"""Steady-state decode: the engine's tick vs a bare forward loop (batched forward + argmax, nothing else) on the
same model, batch and cache length, in one process: what the scheduler, the cache-layer protocol and the
executor's bookkeeping add to a decode step.

    python -m bench.decode_overhead [--model text-medium | qwen3_next-medium | vlm] [--batch 32] [--steps 32]
        [--vocab-size N]

`vlm` is the tiny Qwen2-VL of the image benchmarks (`bench.vision_peer`), its rows text-only: its bare loop calls
mlx-vlm's language model with each row's M-RoPE positions, as the engine's decode does. On a model this small
the tick's fixed costs (planning, bookkeeping, events) weigh most.

`qwen3_next-medium` is a hybrid of about text-medium's size (hidden 512 x 8 layers: gated delta-net
linear-attention layers, whose recurrent state is an `ArraysCache`, alternating with attention layers; MoE
MLPs), built from the conformance suite's tiny qwen3_next config with larger dimensions.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx

# Hybrid builds at about text-medium's size: the family's tiny config with these fields changed.
MEDIUM_FAMILIES = {
    "qwen3_next-medium": ("qwen3_next", {
        "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 64, "linear_num_value_heads": 8, "linear_num_key_heads": 4, "linear_key_head_dim": 64,
        "linear_value_head_dim": 64, "intermediate_size": 1536, "moe_intermediate_size": 384,
        "shared_expert_intermediate_size": 384}),
}


def build(kind: str, out: Path, vocab_size: int | None = None) -> Path:
    from scheduler.fixtures.families import build_family_model
    from scheduler.fixtures.tiny_models import build_model

    if kind in MEDIUM_FAMILIES:
        model_type, overrides = MEDIUM_FAMILIES[kind]
        return build_family_model(model_type, out, overrides=overrides)
    return build_model(kind, out, vocab_size=vocab_size)


def bare_loop_vlm(model, prompts, steps):
    """The VLM's bare loop: each prompt prefilled alone through the language model (positions 0..n-1 on the three
    M-RoPE axes, as a text prompt's are), one merged batch cache, then forward + argmax per step, each row at
    its own next position."""
    from mlx_lm.models.cache import BatchKVCache
    from mlx_vlm.models.cache import make_prompt_cache

    lm = model.language_model
    caches = []
    for p in prompts:
        cache = make_prompt_cache(lm)
        n = len(p) - 1
        lm(mx.array(p[:-1])[None], cache=cache, position_ids=mx.broadcast_to(mx.arange(n)[None, None], (3, 1, n)))
        mx.eval([a for layer in cache for a in layer.state])
        caches.append(cache)
    batch = [BatchKVCache.merge([c[i] for c in caches]) for i in range(len(caches[0]))]
    y = mx.array([p[-1] for p in prompts])
    next_position = mx.array([len(p) - 1 for p in prompts])
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        positions = mx.broadcast_to(next_position[None, :, None], (3, len(prompts), 1))
        out = lm(y[:, None], cache=batch, position_ids=positions)
        y = mx.argmax(getattr(out, "logits", out)[:, -1, :], axis=-1)
        next_position = next_position + 1
        mx.eval(y)
        times.append(time.perf_counter() - t0)
    return times


def bare_loop(model, prompts, steps):
    from mlx_lm.models.cache import make_prompt_cache

    from scheduler.execution import library

    caches = []
    for p in prompts:  # the same per-request prefill the engine does, then one merged batch cache
        cache = make_prompt_cache(model)
        model(mx.array(p[:-1])[None], cache=cache)
        mx.eval(library.cache_arrays(cache))
        caches.append(cache)
    batch = library.merge_caches(caches)
    y = mx.array([p[-1] for p in prompts])
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        y = mx.argmax(model(y[:, None], cache=batch)[:, -1, :], axis=-1)
        mx.eval(y)
        times.append(time.perf_counter() - t0)
    return times


def engine_loop(model, tokenizer, prompts, steps):
    from scheduler import Engine, EngineConfig, SamplingParams

    engine = Engine(model, tokenizer, EngineConfig(max_seqs=len(prompts), max_batched_tokens=1 << 16,
                                                   prefill_chunk=1 << 12))
    for p in prompts:
        engine.add_request(prompt_tokens=p, sampling=SamplingParams(max_tokens=steps + 8))
    engine.step()  # every prompt prefilled and its first token sampled in the first tick
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times


def main(argv=None) -> int:
    from mlx_lm import load

    from bench.blas import describe, detect_blas

    ap = argparse.ArgumentParser(prog="python -m bench.decode_overhead", description=__doc__)
    ap.add_argument("--model", default="text-medium", choices=["text", "text-medium", "vlm", *MEDIUM_FAMILIES])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--vocab-size", type=int, default=None,
                    help="text kinds: build the model with this vocabulary size (a real model's, e.g. 151936)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    print(describe(detect_blas()))
    with tempfile.TemporaryDirectory() as d:
        if args.model == "vlm":
            import mlx_vlm

            model, tokenizer = mlx_vlm.load(str(build(args.model, Path(d) / args.model)))
            loop = bare_loop_vlm
        else:
            model, tokenizer = load(str(build(args.model, Path(d) / args.model, args.vocab_size)))
            loop = bare_loop
        rng = random.Random(0)
        prompts = [[rng.randrange(7, 512) for _ in range(args.prompt_len)] for _ in range(args.batch)]
        bare, ours = [], []
        for _ in range(args.repeats):  # alternate, median of steps, best of repeats
            bare.append(statistics.median(loop(model, prompts, args.steps)))
            ours.append(statistics.median(engine_loop(model, tokenizer, prompts, args.steps)))
    b, o = min(bare), min(ours)
    vocab = "" if args.vocab_size is None else f" (vocab {args.vocab_size})"
    print(f"{args.model}{vocab}, batch {args.batch}, prompt {args.prompt_len}: "
          f"bare forward+argmax {b * 1e3:.2f} ms/step, "
          f"engine tick {o * 1e3:.2f} ms/step, overhead {100 * (o / b - 1):+.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
