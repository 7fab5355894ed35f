"""Where a verify tick's time goes on the trained tiny model: the batched forward at width 1 (a plain decode
step) against width w = k + 1 (the last token and k drafts), for batch 1 and 4, and the KV rollback after it
(a plain ``trim`` when every row drops the same number of positions; when drops differ, masked holes in the
executor's batch cache, no copy, until they are squeezed out: `caches.layers._HoleBatchKVCache`; a per-row
shift copy before 2026-12-05),
and the greedy acceptance that reads the verdict back. The draft gate's cost model
(`scheduler/execution/draft_gate.py`, `VerifyCost`) comes from these figures; the probe prints the fit for the
model and machine it ran on (`VerifyCost.fit`), to pass as `EngineConfig(draft_cost=...)`.

Each figure is the 10th percentile of ``--iters`` timed repetitions (after warm-up) of: one forward over a left-padded
batch cache holding ``--context`` tokens per row, ``mx.eval`` of its logits, then the rollback that restores the
cache (so every repetition sees the same cache).

    python -m bench.verify_tick --model-dir DIR [--batch 1 4] [--width 1 2 3 4 5] [--context 160] [--iters 200]
        [--new-tokens 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


# Wall time of each timed call, summarised by a low percentile: on a shared machine most calls are slowed by
# other processes, the fastest tenth are the call's own cost.
_clock = time.perf_counter


def _batch_cache(model, batch: int, context: int):
    """A batch cache of ``batch`` rows of ``context`` tokens each, built as the executor builds it (one
    single-request cache per row, merged)."""
    import mlx.core as mx

    from scheduler.execution import library

    caches = []
    for b in range(batch):
        cache = library.make_request_cache(model)
        toks = mx.array([(7 + 13 * b + 31 * i) % 500 + 7 for i in range(context)])[None]
        model(toks, cache=cache)
        mx.eval(library.cache_arrays(cache))
        caches.append(cache)
    batch_cache, _ = library.join_rows([], caches)
    return batch_cache


def _low_ms(fn, iters: int) -> float:
    """The 10th percentile of ``iters`` timings, in ms: on a shared machine the low tail is the op's own
    cost, the median is mostly other processes' interference."""
    for _ in range(max(5, iters // 10)):
        fn()
    times = []
    for _ in range(iters):
        t0 = _clock()
        fn()
        times.append(_clock() - t0)
    return 1e3 * sorted(times)[len(times) // 10]


def probe(model, batch: int, widths: list[int], context: int, iters: int) -> dict:
    import mlx.core as mx

    from caches.layers import rollback_rows
    from kernels.speculative import greedy_accept

    cache = _batch_cache(model, batch, context)
    out: dict = {"batch": batch, "forward_ms": {}, "accept_ms": {}}
    for w in widths:
        inputs = mx.array([[11 + (b + j) % 50 for j in range(w)] for b in range(batch)], dtype=mx.int32)
        equal = [w] * batch

        def step():
            mx.eval(model(inputs, cache=cache))
            rollback_rows(cache, equal)  # every row drops the same: a trim

        out["forward_ms"][w] = _low_ms(step, iters)
        if w > 1:
            logits = model(inputs, cache=cache)
            mx.eval(logits)
            rollback_rows(cache, equal)
            drafts = inputs[:, 1:]
            lens = mx.array([w - 1] * batch)

            def accept():
                res = greedy_accept(logits, drafts, lens)
                mx.eval(res.accepted, res.emitted)
                res.accepted.tolist(), res.emitted.tolist()

            out["accept_ms"][w] = _low_ms(accept, iters)
    # rollback alone, after a width-5 forward: equal drops (trim) vs differing drops (holes; a compaction now
    # and then)
    w = max(widths)
    inputs = mx.array([[11 + (b + j) % 50 for j in range(w)] for b in range(batch)], dtype=mx.int32)
    mixed = [w - (b % w) for b in range(batch)]  # row b keeps b % w of the w positions

    def timed_rollback(drops):
        times = []
        for i in range(iters):
            mx.eval(model(inputs, cache=cache))
            t0 = _clock()
            rollback_rows(cache, drops)
            mx.eval([layer.keys for layer in cache])
            times.append(_clock() - t0)
            # restore every row to `context` tokens: drop what each row kept of the w
            kept = [w - d for d in drops]
            if any(kept):
                rollback_rows(cache, kept)
        return 1e3 * sorted(times)[len(times) // 10]

    out["rollback_equal_ms"] = timed_rollback([w] * batch)
    out["rollback_mixed_ms"] = timed_rollback(mixed) if batch > 1 else None
    return out


def engine_ticks(model, tokenizer, batch: int, widths: list[int], new_tokens: int, repeats: int) -> dict[int, float]:
    """Milliseconds per engine tick (`Engine.step`), decoding ``batch`` repetitive prompts with fixed-k prompt
    lookup at k = w - 1 (`adaptive_drafting=False`; k = 0 is plain decoding): what a whole tick at width w
    costs, forward, sampling, acceptance, rollback and scheduling together. Prompt lookup with 1-grams finds
    a match almost every tick, so nearly every tick of a k-run is verified at width k + 1. Every decode tick
    is timed alone (``repeats`` runs per width, the widths interleaved) and the figure is the 10th percentile
    of all of them, like the op figures above."""
    from scheduler import Engine, EngineConfig, SamplingParams

    from .compare import _NoEosTokenizer
    from .drafting import repetitive_prompts

    prompts = repetitive_prompts(tokenizer, batch)
    times: dict[int, list[float]] = {w: [] for w in widths}
    for rep in range(repeats + 1):  # the first round is a warm-up
        for w in widths:
            engine = Engine(model, _NoEosTokenizer(tokenizer),
                            EngineConfig(max_batched_tokens=2048, draft_tokens=w - 1, adaptive_drafting=False))
            for p in prompts:
                engine.add_request(prompt_tokens=p, sampling=SamplingParams(max_tokens=new_tokens))
            engine.step()  # the prefill tick (every prompt fits one), not timed
            while engine.has_pending():
                t0 = _clock()
                engine.step()
                if rep:
                    times[w].append(_clock() - t0)
            engine.close()
    return {w: 1e3 * sorted(t)[len(t) // 10] for w, t in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.verify_tick", description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True, help="a model from `mlxsched make-model trained DIR`")
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--width", nargs="+", type=int, default=[1, 2, 3, 4, 5])
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=128, help="per request, for the whole-tick figures")
    ap.add_argument("--repeats", type=int, default=3, help="whole-tick runs per width (every tick timed)")
    args = ap.parse_args(argv)

    from mlx_lm import load

    model, tokenizer = load(str(Path(args.model_dir)))
    load1 = os.getloadavg()[0]
    rows = [probe(model, b, sorted(set(args.width) | {1}), args.context, args.iters) for b in args.batch]
    ticks = {b: engine_ticks(model, tokenizer, b, sorted(set(args.width) | {1}), args.new_tokens, args.repeats)
             for b in args.batch}
    load1 = max(load1, os.getloadavg()[0])
    print(f"Command: `python -m bench.verify_tick {' '.join(argv or sys.argv[1:])}`; 10th percentile of "
          f"{args.iters} per op, of every tick per width; context {args.context} tokens per row; load1 {load1:.1f}")
    print()
    widths = sorted(set(args.width) | {1})
    print("| batch | " + " | ".join(f"forward w={w} ms (x w=1)" for w in widths)
          + " | accept w=max ms | rollback trim ms | rollback, drops differ ms |")
    print("|---|" + "---|" * (len(widths) + 3))
    for r in rows:
        base = r["forward_ms"][1]
        cells = [f"{r['forward_ms'][w]:.3f} ({r['forward_ms'][w] / base:.2f})" for w in widths]
        mixed = f"{r['rollback_mixed_ms']:.3f}" if r["rollback_mixed_ms"] is not None else "n/a (one row)"
        print(f"| {r['batch']} | " + " | ".join(cells)
              + f" | {r['accept_ms'].get(max(widths), 0):.3f} | {r['rollback_equal_ms']:.3f} | {mixed} |")
    print()
    print("Whole engine ticks (fixed-k prompt lookup, k = w - 1; w=1 is plain decoding), ms per tick, "
          "10th percentile (x w=1):")
    print()
    print("| batch | " + " | ".join(f"w={w}" for w in widths) + " |")
    print("|---|" + "---|" * len(widths))
    for b, t in ticks.items():
        print(f"| {b} | " + " | ".join(f"{t[w]:.3f} ({t[w] / t[1]:.2f})" for w in widths) + " |")
    if len(widths) > 1:
        from scheduler.execution.draft_gate import VerifyCost

        # what a plain engine tick costs beyond its bare forward, the same at every width
        overhead = sum(max(0.0, ticks[r["batch"]][1] - r["forward_ms"][1]) for r in rows) / len(rows)
        fit = VerifyCost.fit({r["batch"]: r["forward_ms"] for r in rows}, overhead)
        print()
        print(f"The gate's cost model fitted to these forwards (engine work per tick {overhead:.3f} ms): {fit}; "
              f"EngineConfig(draft_cost=({fit.verify}, {fit.width}, {fit.rows}, {fit.shift})), "
              f"`mlxsched serve --draft-cost {fit.verify},{fit.width},{fit.rows},{fit.shift}`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
