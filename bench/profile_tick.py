"""Profile decode ticks of our Engine (and BatchGenerator.next for reference) with cProfile.

    python -m bench.profile_tick --model text --batch 32 --ticks 200 [--peer] [--top 25]

Prefill is done before profiling starts; only steady-state decode ticks are profiled. Prints the top
functions by own time (tottime) and by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from .compare import _NoEosTokenizer, default_engine_config
from .workloads import uniform


def _engine_ticks(model, tokenizer, prompts, ticks):
    from scheduler import Engine, SamplingParams

    engine = Engine(model, _NoEosTokenizer(tokenizer), default_engine_config())
    for p in prompts:
        engine.add_request(prompt_tokens=p, sampling=SamplingParams(max_tokens=ticks + 10))
    while engine.scheduler.waiting or engine.scheduler.prefilling:
        engine.step()
    for _ in range(3):
        engine.step()
    return engine.step


def _peer_ticks(model, prompts, ticks):
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=ticks + 10, completion_batch_size=max(32, len(prompts)),
                         prefill_batch_size=len(prompts))
    gen.insert(prompts)
    got = set()
    while len(got) < len(prompts):
        for r in gen.next()[1]:
            got.add(r.uid)
    for _ in range(3):
        gen.next()
    return gen.next


def _wrap_mlx_sync() -> None:
    """cProfile does not see nanobind functions: wrap the synchronising calls in Python functions so the time
    spent waiting for the computation is attributed to `mx_eval` / `mx_async_eval` instead of their caller."""
    import mlx.core as mx

    real_eval, real_async = mx.eval, mx.async_eval

    def mx_eval(*a, **k):
        return real_eval(*a, **k)

    def mx_async_eval(*a, **k):
        return real_async(*a, **k)

    mx.eval, mx.async_eval = mx_eval, mx_async_eval


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.profile_tick")
    ap.add_argument("--model", default="text", choices=("text", "text-medium", "sliding"))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--ticks", type=int, default=200)
    ap.add_argument("--peer", action="store_true", help="profile BatchGenerator.next() instead")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--no-wrap", action="store_true",
                    help="do not wrap mx.eval / mx.async_eval (then their wait shows in the caller's own time)")
    args = ap.parse_args(argv)

    from mlx_lm import load

    from scheduler.fixtures.tiny_models import build_model

    with tempfile.TemporaryDirectory() as tmp:
        model, tokenizer = load(str(build_model(args.model, Path(tmp) / args.model)))
    prompts = uniform(args.batch, args.prompt_len, args.ticks).prompt_lists
    step = _peer_ticks(model, prompts, args.ticks) if args.peer else _engine_ticks(model, tokenizer, prompts,
                                                                                    args.ticks)
    if not args.no_wrap:
        _wrap_mlx_sync()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(args.ticks):
        step()
    prof.disable()
    dt = time.perf_counter() - t0
    side = "BatchGenerator.next" if args.peer else "Engine.step"
    print(f"{side}: {args.ticks} decode ticks at batch {args.batch} on {args.model}: "
          f"{1000 * dt / args.ticks:.3f} ms/tick under cProfile")
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).strip_dirs().sort_stats(key).print_stats(args.top)
        print(f"--- by {key} ---")
        print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
