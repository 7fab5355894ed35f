"""What sharding costs per tick: the plan message (bytes, build + serialise time, broadcast time) against the
tick itself, on a model split across the ranks of an `mlx.launch`.

    mlx.launch -n 2 --backend ring -- python -m bench.tensor_parallel --model text-medium --requests 32
    mlx.launch -n 2 --backend ring -- mlxsched bench --tensor-parallel --requests 32      # the same

Every rank builds the tiny model (seeded, byte-identical), loads it sharded and builds the engine; rank 0
drives the workload and prints the table, the others follow. Ranks on this machine are pinned to CPUs of their
own first (`scheduler/execution/rank_pinning.py`; `--no-pin-ranks`: not), and rank 0 unpinned again for its
one-process run. After the followers are released, rank 0 runs the
same workload on the unsharded model alone for comparison (on one machine the ranks share its cores, so
sharding is not expected to be faster here: it is for a model that does not fit one machine).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import mlx.core as mx

from scheduler.execution.rank_pinning import pin_local_rank, unpin


def _workload(n: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(7, 512) for _ in range(prompt_len)] for _ in range(n)]


def _run(engine, prompts, new_tokens: int) -> tuple[float, list[float], int]:
    from scheduler import SamplingParams

    for i, p in enumerate(prompts):
        engine.add_request(prompt_tokens=p, sampling=SamplingParams(max_tokens=new_tokens), request_id=f"r{i}")
    ticks, generated = [], 0
    t0 = time.perf_counter()
    while engine.has_pending():
        t = time.perf_counter()
        generated += sum(len(o.token_ids) for o in engine.step())
        ticks.append(time.perf_counter() - t)
    return time.perf_counter() - t0, ticks, generated


def main(argv: Sequence[str] | None = None) -> int:
    from scheduler import Engine, EngineConfig
    from scheduler.fixtures.tiny_models import build_model

    ap = argparse.ArgumentParser(prog="python -m bench.tensor_parallel")
    ap.add_argument("--model", default="text-medium", choices=["text", "text-medium"])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--no-pin-ranks", action="store_true",
                    help="leave ranks on this machine unpinned (by default each runs on its share of the CPUs)")
    args = ap.parse_args(argv)
    group = mx.distributed.init()
    if group.size() < 2:
        print("run this under `mlx.launch -n 2 --backend ring -- ...` (one process has nothing to shard over)")
        return 2
    pinning = pin_local_rank(enabled=not args.no_pin_ranks)
    tmp = tempfile.TemporaryDirectory(prefix=f"mlxsched-tp-{group.rank()}-")
    model_dir = build_model(args.model, Path(tmp.name) / args.model)
    config = EngineConfig(max_batched_tokens=2048, max_seqs=args.requests, prefill_chunk=512)
    engine = Engine.from_pretrained(model_dir, config, tensor_group=group)
    if group.rank() != 0:
        engine.follow()
        return 0
    prompts = _workload(args.requests, args.prompt_len)
    wall, ticks, generated = _run(engine, prompts, args.new_tokens)
    channel, sharded = engine.executor.channel, engine.executor
    engine.close()
    decode_ticks = ticks[len(ticks) // 4:]  # after the prompts are in: steady decoding at full batch
    messages = channel.messages
    print(f"## Sharded over {group.size()} ranks: {args.model}, {args.requests} requests x ({args.prompt_len} prompt, "
          f"{args.new_tokens} new tokens); {pinning.describe()}\n")
    print("| per tick | value |\n| --- | --- |")
    print(f"| ticks (messages) | {messages} |")
    print(f"| message bytes, mean | {channel.bytes_sent / messages:.0f} |")
    print(f"| build + serialise, mean | {1e6 * sharded.encode_seconds / messages:.0f} us |")
    print(f"| broadcast (two all_sums), mean | {1e6 * channel.seconds / messages:.0f} us |")
    print(f"| whole tick, median (steady decode) | {1e6 * statistics.median(decode_ticks):.0f} us |")
    print(f"| message share of the tick | {(sharded.encode_seconds + channel.seconds) / sum(ticks):.1%} |")
    print(f"| end-to-end generation tok/s, sharded | {generated / wall:.0f} |")
    unpin(pinning)  # the one-process run below gets every CPU, as an unsharded engine would
    alone = Engine.from_pretrained(model_dir, config)  # rank 0 alone, the followers are gone
    wall1, _, generated1 = _run(alone, prompts, args.new_tokens)
    print(f"| end-to-end generation tok/s, one process | {generated1 / wall1:.0f} |")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
