"""Batched prefill for a mix of chunks: prefill tokens/s of one forward per chunk, of the executor's grouping
(right padding within a pad ratio), and of a bare batched forward over the same tokens.

    python -m bench.prefill_mix [--model text-medium | --family NAME [--override FIELD=JSON ...]]
        [--n 32 --lo 16 --hi 300] [--ratios 0 0.125 0.25 0.5]

The chunks are the engine's own: the workload runs once through an Engine with the default budget
(EngineConfig()) and every tick's prefill chunks are read from its plan events. Then each scheme replays those
ticks at the runner level, no engine around it (so only the prefill forwards and their cache moves differ):

* ``solo``: one `TextRunner.prefill` per chunk, each request's own cache carried from tick to tick;
* ``grouped r``: the executor's grouping (`prefill_groups`: at pad ratio r, or for a family whose caches
  split back only unpadded chunks at one start of one length; then `TextRunner.prefill_many`
  on the requests' caches, which merges, pads, splits), the ungrouped chunks one by one;
* ``split r``: the no-pad alternative on the same groups: the group's shortest length batched, each row's
  remainder in a forward of its own;
* ``bare``: per tick one forward over a fresh batch cache, the tick's prefill tokens as a (chunks, mean
  length) rectangle: the same token count with no padding, no cache history and no merge or split -- the
  target the issue sets (grouped >= 80% of bare). A lower bound no real mix reaches: its attention is the
  rectangle's (chunks x mean length^2), where chunks of unequal lengths attend over sum(length^2), more by the
  lengths' variance (15% more for the default workload's 32 prompts);
* ``padded``: per tick one forward over the tick's own chunks, right-padded to the longest (what a single
  batched forward over exactly these tokens costs), fresh caches, no merge or split.

Schemes alternate within each repeat; the best repeat per scheme is reported. tokens/s counts real prefill
tokens only (pads are work, not output).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import mlx.core as mx


def _ticks(model, tokenizer, prompts, new_tokens):
    """The engine's prefill chunks per tick under the default budget: [(prompt index, start, n fed)]."""
    from scheduler import Engine, EngineConfig, SamplingParams
    from scheduler.events import MemorySink

    log = MemorySink()
    engine = Engine(model, tokenizer, EngineConfig(), event_sinks=[log])
    ids = [engine.add_request(prompt_tokens=p, sampling=SamplingParams(max_tokens=new_tokens)) for p in prompts]
    index = {rid: i for i, rid in enumerate(ids)}
    while engine.has_pending():
        engine.step()
    ticks = []
    for plan in log.of_kind("plan"):
        chunks = [(index[rid], start, (end - 1 if completes else end) - start)
                  for rid, start, end, completes in plan["prefill"]]
        chunks = [c for c in chunks if c[2] > 0]
        if chunks:
            ticks.append(chunks)
    return ticks, engine.prefill_stats()


class _Prompt:
    """What `TextRunner` reads of a request: its prefill tokens."""

    def __init__(self, tokens):
        self.tokens = tokens

    def prefill_tokens(self, start, end):
        return self.tokens[start:end]


def _solo(runner, prompts, ticks):
    caches = {}
    t0 = time.perf_counter()
    for chunks in ticks:
        for i, start, n in chunks:
            cache = caches.setdefault(i, runner.make_cache())
            runner.prefill(cache, prompts[i], None, start, start + n)
    return time.perf_counter() - t0, 0, 0


def _grouped(runner, prompts, ticks, ratio):
    from scheduler.execution.executor import prefill_groups

    caches, forwards, pads = {}, 0, 0
    t0 = time.perf_counter()
    for chunks in ticks:
        grouped = set()
        for group, _, padded in prefill_groups(chunks, runner.prefill_sharing, ratio):
            rows = [(prompts[i], None, caches.get(i) if start else None, start, n) for i, start, n in group]
            for (i, _, _), cache in zip(group, runner.prefill_many(rows)[0]):
                caches[i] = cache
                grouped.add(i)
            forwards, pads = forwards + 1, pads + padded
        for i, start, n in chunks:
            if i not in grouped:
                runner.prefill(caches.setdefault(i, runner.make_cache()), prompts[i], None, start, start + n)
                forwards += 1
    return time.perf_counter() - t0, forwards, pads


def _split(runner, prompts, ticks, ratio):
    """The no-pad alternative: the same groups, but each row feeds only the group's shortest length in the
    batched forward, and the rest of its chunk in a forward of its own."""
    from scheduler.execution.executor import _pad_groups

    caches, forwards = {}, 0
    t0 = time.perf_counter()
    for chunks in ticks:
        grouped = {}
        for group, _, _ in _pad_groups(chunks, ratio):
            w = min(n for *_, n in group)
            rows = [(prompts[i], None, caches.get(i) if start else None, start, w) for i, start, n in group]
            for (i, start, n), cache in zip(group, runner.prefill_many(rows)[0]):
                caches[i] = cache
                grouped[i] = w
            forwards += 1
        for i, start, n in chunks:
            w = grouped.get(i, 0)
            if w < n:
                runner.prefill(caches.setdefault(i, runner.make_cache()), prompts[i], None, start + w, start + n)
                forwards += 1
    return time.perf_counter() - t0, forwards, 0


def _bare(runner, ticks):
    from scheduler.execution import library

    t0 = time.perf_counter()
    for chunks in ticks:
        rows = len(chunks)
        width = max(1, sum(n for *_, n in chunks) // rows)
        batch = runner.merge([runner.make_cache() for _ in range(rows)])
        runner.model(mx.full((rows, width), 7, dtype=mx.int32), cache=batch)
        mx.eval(library.cache_arrays(batch))
    return time.perf_counter() - t0, len(ticks), 0


def _padded(runner, prompts, ticks):
    from scheduler.execution import library

    t0, pads = time.perf_counter(), 0
    for chunks in ticks:
        width = max(n for *_, n in chunks)
        rows = [list(prompts[i].prefill_tokens(start, start + n)) + [7] * (width - n) for i, start, n in chunks]
        pads += sum(width - n for *_, n in chunks)
        batch = runner.merge([runner.make_cache() for _ in rows])
        runner.model(mx.array(rows, dtype=mx.int32), cache=batch)
        mx.eval(library.cache_arrays(batch))
    return time.perf_counter() - t0, len(ticks), pads


def main(argv=None) -> int:
    from mlx_lm import load

    from bench.blas import describe, detect_blas
    from bench.decode_overhead import build
    from bench.workloads import mixed
    from scheduler.execution.runners import TextRunner

    ap = argparse.ArgumentParser(prog="python -m bench.prefill_mix", description=__doc__)
    ap.add_argument("--model", default="text-medium", choices=["text", "text-medium"])
    ap.add_argument("--family", default=None,
                    help="a tiny mlx-lm family build instead (scheduler/fixtures/families.py, e.g. qwen3_next, "
                         "gemma3_text); one whose caches split only unpadded (PrefillSharing.ALIGNED) takes "
                         "--ratios 0 --split-ratios and prompts that fit one chunk")
    ap.add_argument("--override", nargs="*", default=[], metavar="FIELD=JSON",
                    help="with --family: config fields of the build (e.g. hidden_size=512 num_hidden_layers=8), "
                         "to measure a larger model than the tiny test build")
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--lo", type=int, default=16)
    ap.add_argument("--hi", type=int, default=300)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.0, 0.125, 0.25, 0.5])
    ap.add_argument("--split-ratios", type=float, nargs="*", default=[0.25],
                    help="the no-pad alternative (shortest length batched, remainders alone) on the same groups")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    print(describe(detect_blas()))
    print(f"load1 before: {os.getloadavg()[0]:.2f}")
    workload = mixed(args.n, args.lo, args.hi, args.new_tokens)
    with tempfile.TemporaryDirectory() as d:
        if args.family:
            from scheduler.fixtures.families import build_family_model

            overrides = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.override)}
            model, tokenizer = load(str(build_family_model(args.family, Path(d) / args.family,
                                                           overrides=overrides)))
        else:
            model, tokenizer = load(str(build(args.model, Path(d) / args.model)))
        ticks, stats = _ticks(model, tokenizer, workload.prompt_lists, args.new_tokens)
        runner = TextRunner(model)
        prompts = [_Prompt(p) for p in workload.prompt_lists]
        real = sum(n for chunks in ticks for *_, n in chunks)
        print(f"{workload.describe()}; {len(ticks)} ticks with prefill, {sum(map(len, ticks))} chunks, "
              f"{real} prefill tokens; the engine's own run: {stats}")
        schemes = {"solo": lambda: _solo(runner, prompts, ticks), "bare": lambda: _bare(runner, ticks),
                   "padded": lambda: _padded(runner, prompts, ticks)}
        for r in args.ratios:
            schemes[f"grouped r={r:g}"] = lambda r=r: _grouped(runner, prompts, ticks, r)
        for r in args.split_ratios:
            schemes[f"split r={r:g}"] = lambda r=r: _split(runner, prompts, ticks, r)
        schemes["solo"]()  # warm-up (the model's kernels and the allocator; every scheme runs the same ones)
        best: dict[str, tuple[float, int, int]] = {}
        cpu: dict[str, float] = {}
        for _ in range(args.repeats):
            for name, fn in schemes.items():
                c0 = time.process_time()
                out = fn()
                cpu[name] = min(cpu.get(name, float("inf")), time.process_time() - c0)
                if name not in best or out[0] < best[name][0]:
                    best[name] = out
    bare, padded = best["bare"][0], best["padded"][0]
    print("| scheme | forwards | pad positions | wall s (best) | prefill tok/s | vs solo | vs bare | vs padded "
          "| CPU s (best) | CPU vs bare |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, (s, forwards, pads) in best.items():
        forwards = forwards or sum(map(len, ticks))
        print(f"| {name} | {forwards} | {pads} | {s:.3f} | {real / s:.0f} | {best['solo'][0] / s:.2f}x | "
              f"{100 * bare / s:.0f}% | {100 * padded / s:.0f}% | {cpu[name]:.2f} | {100 * cpu['bare'] / cpu[name]:.0f}% |")
    print(f"load1 after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
