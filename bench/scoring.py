"""Scoring prompts (what lm-eval's loglikelihood tasks ask a server for): each prompt token's logprob, through
our Engine (`SamplingParams(max_tokens=1, prompt_logprobs=k)`: batched, chunked prefill) against mlx-lm alone
(one forward of each prompt, `model(prompt)` then a log-softmax: the way to score with mlx-lm, which has no
batch scoring API), and against our Engine on the same prompts without prompt logprobs (what reading the
logits costs on top of the prefill).

    python -m bench.scoring [--model text-medium] [--n 64 --lo 40 --hi 160] [--k 1] [--repeats 3]

The sides alternate within each repeat; the best repeat per side is reported. The values of both scoring sides
are compared (they differ only by BLAS order: the engine's chunks and batches are other matrix shapes).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import mlx.core as mx


def _mlx_lm_alone(model, prompts: list[list[int]]) -> list[list[float]]:
    """Each prompt token's logprob (after the first) from one forward of the prompt, prompt by prompt."""
    out = []
    for prompt in prompts:
        logits = model(mx.array(prompt)[None])[0].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        picked = mx.take_along_axis(logprobs[:-1], mx.array(prompt[1:])[:, None], axis=1)[:, 0]
        out.append(picked.tolist())
    return out


def _engine(model, tokenizer, prompts: list[list[int]], k: int | None) -> list[list[float]]:
    from scheduler import Engine, EngineConfig, SamplingParams

    engine = Engine(model, tokenizer, EngineConfig())
    outs = engine.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=k))
    return [o.prompt_logprobs[1:] if o.prompt_logprobs is not None else [] for o in outs]


def main(argv=None) -> int:
    from mlx_lm import load

    from bench.blas import describe, detect_blas
    from bench.decode_overhead import build
    from bench.workloads import mixed

    ap = argparse.ArgumentParser(prog="python -m bench.scoring", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="text-medium", choices=["text", "text-medium"])
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--lo", type=int, default=40)
    ap.add_argument("--hi", type=int, default=160)
    ap.add_argument("--k", type=int, default=1, help="alternatives per prompt position (lm-eval asks for 1)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    print(describe(detect_blas()))
    load_before = os.getloadavg()[0]
    prompts = [list(p) for p in mixed(args.n, args.lo, args.hi, 1).prompt_lists]
    tokens = sum(map(len, prompts))
    with tempfile.TemporaryDirectory() as d:
        model, tokenizer = load(str(build(args.model, Path(d) / args.model)))
        sides = {"mlx-lm, one forward per prompt": lambda: _mlx_lm_alone(model, prompts),
                 "ours, prompt_logprobs": lambda: _engine(model, tokenizer, prompts, args.k),
                 "ours, no prompt_logprobs": lambda: _engine(model, tokenizer, prompts, None)}
        for fn in sides.values():  # warm-up
            fn()
        best: dict[str, float] = {}
        values: dict[str, list] = {}
        for _ in range(args.repeats):
            for name, fn in sides.items():
                t0 = time.perf_counter()
                values[name] = fn()
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
    ours, alone = values["ours, prompt_logprobs"], values["mlx-lm, one forward per prompt"]
    diff = max(abs(a - b) for got, want in zip(ours, alone) for a, b in zip(got, want))
    same_lengths = all(len(a) == len(b) for a, b in zip(ours, alone))
    print(f"{args.n} prompts of {args.lo}..{args.hi} tokens ({tokens} tokens), {args.model}, k={args.k}, "
          f"best of {args.repeats}; load1 {load_before:.2f} before, {os.getloadavg()[0]:.2f} after")
    print(f"values: ours vs mlx-lm alone, max |difference| {diff:.2e}, every prompt's length equal: {same_lengths}")
    base = best["mlx-lm, one forward per prompt"]
    print("| side | wall s | prompt tok/s | speed vs mlx-lm alone |")
    print("|---|---|---|---|")
    for name, seconds in best.items():
        print(f"| {name} | {seconds:.3f} | {tokens / seconds:.0f} | {base / seconds:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
