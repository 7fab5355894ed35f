"""Peak memory over a long run: MLX peak memory after 200 requests vs after 2,000 (same engine, caches on).

    python -m bench.memory [--requests 2000] [--early 200]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import mlx.core as mx


def main(argv=None) -> int:
    from mlx_lm import load

    from scheduler import Engine, EngineConfig, SamplingParams
    from scheduler.fixtures.tiny_models import build_model

    ap = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--early", type=int, default=200)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        model, tokenizer = load(str(build_model("text", Path(d) / "text")))
        engine = Engine(model, tokenizer, EngineConfig(max_seqs=32, max_batched_tokens=512, prefix_cache_bytes=8 << 20))
        mx.reset_peak_memory()
        peaks = {}
        for i in range(args.requests):
            prompt = ([100 + k for k in range(40)] if i % 3 == 0 else []) + [7 + (i * 7919 + k) % 500 for k in range(8 + i % 50)]
            engine.add_request(prompt_tokens=prompt, sampling=SamplingParams(max_tokens=4 + i % 12))
            if i % 8 == 7:
                while engine.has_pending():
                    engine.step()
            if i + 1 in (args.early, args.requests):
                while engine.has_pending():
                    engine.step()
                peaks[i + 1] = mx.get_peak_memory()
    early, late = peaks[args.early], peaks[args.requests]
    print(f"peak MLX memory after {args.early} requests: {early / 2**20:.2f} MiB; after {args.requests}: "
          f"{late / 2**20:.2f} MiB ({100 * (late / early - 1):+.1f}%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
