"""LoRA adapters chosen per request: what serving several adapters from one engine costs, and what it saves.

    python -m bench.lora [--model text-medium | --family NAME [--override FIELD=JSON ...]] [--requests 24]
        [--lo 16] [--hi 200] [--new-tokens 48] [--rank 8] [--adapters 2] [--repeats 3]

`--adapters` seeded adapters (`scheduler.fixtures.lora`, rank `--rank`, on every linear layer of every
transformer block, and every expert projection of a mixture-of-experts family such as `--family qwen3_moe`) over
the model; greedy, no eos. Each side runs the same requests through fresh engines:

* ``base``: an engine without adapters, every request on the base model (the floor);
* ``installed, base rows``: the engine with the adapters installed, every request still on the base model (what
  installing them costs a batch that uses none);
* ``one adapter``: every request on the first adapter;
* ``mixed``: the requests on the base model and each adapter in turn, in one engine;
* ``engine per adapter``: the mixed requests without per-request adapters: one engine per adapter
  (`from_pretrained(adapter_path=...)` and the base model), each serving its share, one after another.

Outputs are checked: ``mixed`` must equal ``engine per adapter`` token for token. Sides alternate within each
repeat; best wall time per side.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path



def _run(engine, prompts, loras, new_tokens) -> tuple[float, list[list[int]]]:
    from scheduler import SamplingParams

    sampling = SamplingParams(max_tokens=new_tokens)
    t0 = time.perf_counter()
    index = {engine.add_request(prompt_tokens=p, sampling=sampling, lora=lora): i
             for i, (p, lora) in enumerate(zip(prompts, loras))}
    outputs: list[list[int]] = [[] for _ in prompts]
    while engine.has_pending():
        for out in engine.step():
            outputs[index[out.request_id]].extend(out.token_ids)
    wall = time.perf_counter() - t0
    engine.close()
    return wall, outputs


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="text-medium")
    ap.add_argument("--family", default=None,
                    help="a tiny mlx-lm family build instead (scheduler/fixtures/families.py, e.g. qwen3_moe)")
    ap.add_argument("--override", nargs="*", default=[], metavar="FIELD=JSON",
                    help="with --family: config fields of the build (e.g. hidden_size=256 num_hidden_layers=4)")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--lo", type=int, default=16)
    ap.add_argument("--hi", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--adapters", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    import mlx_lm

    from scheduler import Engine
    from scheduler.fixtures.lora import write_lora_adapter
    from scheduler.fixtures.tiny_models import build_model

    from .compare import _NoEosTokenizer, default_engine_config
    from .workloads import mixed

    config = default_engine_config()
    prompts = [list(p) for p in mixed(args.requests, args.lo, args.hi, args.new_tokens).prompts]
    choices = (None, *(f"a{i}" for i in range(1, args.adapters + 1)))
    mixed_loras = [choices[i % len(choices)] for i in range(len(prompts))]
    with tempfile.TemporaryDirectory(prefix="mlxsched-bench-lora-") as d:
        if args.family:
            from scheduler.fixtures.families import build_family_model

            overrides = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.override)}
            model_dir = build_family_model(args.family, Path(d) / "model", overrides=overrides)
        else:
            model_dir = build_model(args.model, Path(d) / "model")
        paths = {name: write_lora_adapter(model_dir, Path(d) / name, seed=seed, rank=args.rank)
                 for seed, name in enumerate(choices[1:], 1)}
        base, tokenizer = mlx_lm.load(str(model_dir))
        tokenizer = _NoEosTokenizer(tokenizer)
        served, _ = mlx_lm.load(str(model_dir))  # carries both adapters (installed by its first engine)
        alone = {None: base, **{n: mlx_lm.load(str(model_dir), adapter_path=str(p))[0] for n, p in paths.items()}}

        def per_adapter():
            walls, outputs = 0.0, [None] * len(prompts)
            for name, model in alone.items():
                mine = [i for i, lora in enumerate(mixed_loras) if lora == name]
                wall, outs = _run(Engine(model, tokenizer, config), [prompts[i] for i in mine], [None] * len(mine),
                                  args.new_tokens)
                walls += wall
                for i, out in zip(mine, outs):
                    outputs[i] = out
            return walls, outputs

        sides = {
            "base": lambda: _run(Engine(base, tokenizer, config), prompts, [None] * len(prompts), args.new_tokens),
            "installed, base rows": lambda: _run(Engine(served, tokenizer, config, loras=paths), prompts,
                                                 [None] * len(prompts), args.new_tokens),
            "one adapter": lambda: _run(Engine(served, tokenizer, config, loras=paths), prompts,
                                        ["a1"] * len(prompts), args.new_tokens),
            "mixed": lambda: _run(Engine(served, tokenizer, config, loras=paths), prompts, mixed_loras,
                                  args.new_tokens),
            "engine per adapter": per_adapter,
        }
        for run in sides.values():  # warm-up
            run()
        walls: dict[str, list[float]] = {name: [] for name in sides}
        outputs: dict[str, list] = {}
        for rep in range(args.repeats):
            order = list(sides) if rep % 2 == 0 else list(sides)[::-1]
            for name in order:
                wall, outs = sides[name]()
                walls[name].append(wall)
                outputs[name] = outs
                print(f"  rep {rep} {name}: {wall:.3f}s", file=sys.stderr)
    tokens = len(prompts) * args.new_tokens
    best = {name: min(w) for name, w in walls.items()}
    load = os.getloadavg()[0]
    print(f"Command: `python -m bench.lora {shlex.join(argv)}`; {len(prompts)} requests, prompts {args.lo}..{args.hi}, "
          f"{args.new_tokens} new tokens, {args.adapters} adapters of rank {args.rank}; best of {args.repeats}; "
          f"load1 {load:.1f} at the end\n")
    print("| side | wall s | output tok/s | vs base |")
    print("|---|---|---|---|")
    for name, wall in best.items():
        print(f"| {name} | {wall:.3f} | {tokens / wall:.0f} | {best['base'] / wall:.2f}x |")
    same = outputs["mixed"] == outputs["engine per adapter"]
    print(f"\nmixed == engine per adapter, token for token: {same}; "
          f"mixed / engine per adapter: **{best['engine per adapter'] / best['mixed']:.2f}x**")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
