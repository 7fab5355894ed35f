"""Prefix-cache index: our block-hash chain vs a per-token trie (mlx-lm's PromptTrie), bookkeeping only.

Stores N prompts (shared system prefixes + unique tails), then looks up N new prompts that share prefixes with
them; reports insert and lookup time per prompt and the Python memory each index holds (tracemalloc).

    python -m bench.prefix_index [--entries 500] [--length 1000]
"""

from __future__ import annotations

import argparse
import random
import time
import tracemalloc

from caches.prefix import PrefixCache


def _systems(length: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(7, 512) for _ in range(length // 2)] for _ in range(8)]


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """Prompts that start with one of 8 shared half-length "system prompts" and end with a unique tail."""
    rng = random.Random(seed)
    systems = _systems(length)
    return [rng.choice(systems) + [rng.randrange(7, 512) for _ in range(length - length // 2)] for _ in range(n)]


def measure(index_kind: str, stored: list[list[int]], queries: list[list[int]]) -> dict:
    # imported before tracing starts: what mlx-lm's import allocates is not the index's memory (and importing
    # under tracemalloc takes seconds)
    from mlx_lm.models.cache import PromptTrie

    tracemalloc.start()
    t0 = time.perf_counter()
    if index_kind == "block-hash chain (ours)":
        index = PrefixCache(max_bytes=1 << 62, block_size=16)
        for p in stored:
            index.store(p, nbytes=1)
        t1 = time.perf_counter()
        found = sum(index.lookup(q, max_len=len(q) - 1) is not None for q in queries)
    else:
        index = PromptTrie()
        for p in stored:
            index.add("m", p, object())
        t1 = time.perf_counter()
        found = sum(index.search("m", q).common_prefix > 0 or index.search("m", q).shorter is not None
                    for q in queries)
    t2 = time.perf_counter()
    memory = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {"insert_us": 1e6 * (t1 - t0) / len(stored), "lookup_us": 1e6 * (t2 - t1) / len(queries),
            "memory_mib": memory / 2**20, "found": found}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prefix_index", description=__doc__)
    ap.add_argument("--entries", type=int, default=500)
    ap.add_argument("--length", type=int, default=1000)
    args = ap.parse_args(argv)
    stored, queries = _prompts(args.entries, args.length, 0), _prompts(args.entries, args.length, 1)
    print(f"{args.entries} stored prompts of {args.length} tokens, {args.entries} lookups")
    print("| index | insert per prompt | lookup per prompt | Python memory | lookups that matched |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for kind in ("block-hash chain (ours)", "per-token trie (mlx-lm PromptTrie)"):
        r = measure(kind, stored, queries)
        print(f"| {kind} | {r['insert_us']:.0f} us | {r['lookup_us']:.0f} us | {r['memory_mib']:.1f} MiB | {r['found']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
