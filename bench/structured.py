"""Structured outputs: what constraining every row costs, ours vs mlx-lm's BatchGenerator given the same processor.

`--batch` requests (prompts of 16..128 tokens) generate up to `--new-tokens` tokens each, every one constrained
to a JSON schema (`--constraint json`, strings and arrays that a random model keeps filling) or a regex
(`--constraint regex`). Sides, alternating per repeat, best of the repeats:

* ours, constrained: `Engine` with `SamplingParams.structured_output`;
* ours, plain: the same requests unconstrained (what the mask costs per token);
* mlx-lm, constrained: `BatchGenerator` with one `GrammarProcessor` per request (`logits_processors`), the same
  processor ours applies, and the model's eos ids as its stop tokens (both sides stop where the grammar ends).

The constrained sides' outputs are compared token for token. The tiny models' vocabulary is 512 tokens, so the
per-token mask (llguidance's, one byte per vocabulary entry) is far cheaper here than on a 150k vocabulary.

    python -m bench.structured [--model text-medium] [--batch 8 32] [--new-tokens 64] [--repeats 3]

`--setup`: what a forced tool call costs to set up per request, in each of several mlx-lm call markups, for one
set of tools (`SETUP_TOOLS`: 10 tools of 5 parameters, three of them objects or arrays): building the grammar
(`constraints.output_constraint`) and the request's processor (`GrammarCompiler.processor`), first for a tool
set the server has not seen (compiling and checking the grammar too), then again (the compiled spec cached).
No model runs; the tokenizer is the tiny models' (512 entries).

    python -m bench.structured --setup [--repeats 20]
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
from pathlib import Path

from .compare import RunStats, _Clock, run_peer
from .workloads import mixed

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 6},
    "score": {"type": "integer", "minimum": 0, "maximum": 100}}, "required": ["name", "tags", "score"]}
REGEX = r"[a-z]{2,9}( [a-z]{2,9}){0,60}\."


def run_ours(engine, prompts, new_tokens: int, constraint) -> RunStats:
    from scheduler import SamplingParams

    sampling = SamplingParams(max_tokens=new_tokens, structured_output=constraint)
    clock = _Clock(len(prompts), new_tokens)
    index = {engine.add_request(prompt_tokens=p, sampling=sampling): i for i, p in enumerate(prompts)}
    while engine.has_pending():
        for out in engine.step():
            clock.record(index[out.request_id], out.token_ids)
        clock.end_step()
    return clock.stats("ours")


SETUP_TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {"type": "object", "properties": {
    "query": {"type": "string"}, "limit": {"type": "integer"},
    "filters": {"type": "object", "properties": {"tag": {"type": "string"}, "since": {"type": "string"}}},
    "ids": {"type": "array", "items": {"type": "string"}}, "options": {"type": "object"}},
    "required": ["query"]}}} for i in range(10)]
SETUP_MARKUPS = ("json_tools", "qwen3_coder", "glm47", "minimax_m2", "kimi_k2", "pythonic")


def setup_costs(repeats: int) -> None:
    import importlib
    import statistics
    import time

    from scheduler.execution.structured import GrammarCompiler
    from scheduler.fixtures.tiny_models import build_tokenizer
    from scheduler.server.constraints import output_constraint
    from scheduler.server.protocol import ChatCompletionRequest
    from scheduler.server.tool_calls import ToolCallFormat

    tokenizer = build_tokenizer()
    print("| markup | grammar chars | first request ms | again ms (median) |")
    print("|---|---|---|---|")
    for name in SETUP_MARKUPS:
        parser = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
        fmt = ToolCallFormat(parser.tool_call_start, parser.tool_call_end, parser.parse_tool_call)
        body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "go"}], tools=SETUP_TOOLS,
                                     tool_choice="required")
        grammars = GrammarCompiler(tokenizer, len(tokenizer.get_vocab()), [tokenizer.eos_token_id])
        grammars.ll_tokenizer  # (built once per model, not per request)
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            constraint = output_constraint(body, fmt, SETUP_TOOLS, None)
            grammars.processor(constraint)
            times.append(time.perf_counter() - start)
        print(f"| {name} | {len(constraint.spec)} | {times[0] * 1e3:.1f} | {statistics.median(times[1:]) * 1e3:.1f} |")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m bench.structured", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="text-medium")
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--constraint", choices=["json", "regex"], default="json")
    ap.add_argument("--setup", action="store_true", help="time a forced tool call's setup per request instead")
    args = ap.parse_args(argv)
    if args.setup:
        print(f"Command: `python -m bench.structured {shlex.join(argv)}`; {os.cpu_count()} CPUs\n")
        setup_costs(args.repeats)
        return 0

    import mlx_lm

    from scheduler import Engine, EngineConfig, StructuredOutput
    from scheduler.fixtures.tiny_models import build_model

    constraint = StructuredOutput.json(SCHEMA) if args.constraint == "json" else StructuredOutput.regex(REGEX)
    with tempfile.TemporaryDirectory(prefix="mlxsched-structured-") as d:
        model, tokenizer = mlx_lm.load(str(build_model(args.model, Path(d) / args.model)))
    print(f"Command: `python -m bench.structured {shlex.join(argv)}`; best of {args.repeats}; {os.cpu_count()} CPUs\n")
    print("| batch | side | wall s | e2e tok/s | tokens | ratio to ours constrained | outputs equal to ours |")
    print("|---|---|---|---|---|---|---|")
    for batch in args.batch:
        workload = mixed(batch, 16, 128, args.new_tokens)
        prompts = workload.prompt_lists
        engine = Engine(model, tokenizer, EngineConfig())
        grammars = engine.grammars
        sides = {"ours, constrained": lambda: run_ours(engine, prompts, args.new_tokens, constraint),
                 "ours, plain": lambda: run_ours(engine, prompts, args.new_tokens, None),
                 "mlx-lm BatchGenerator, constrained": lambda: run_peer(
                     model, workload, stop_tokens=grammars.eos_token_ids,
                     logits_processors=lambda: [grammars.processor(constraint)])}
        for fn in sides.values():  # warm-up
            fn()
        runs: dict[str, list[RunStats]] = {name: [] for name in sides}
        for rep in range(args.repeats):
            order = list(sides.items())
            for name, fn in order if rep % 2 == 0 else order[::-1]:
                runs[name].append(fn())
                print(f"  batch {batch} rep {rep} {name}: {runs[name][-1].wall_s:.3f}s", file=sys.stderr)
        engine.close()
        best = {name: max(r, key=lambda s: s.e2e_tps) for name, r in runs.items()}
        ours = best["ours, constrained"]
        for name, r in best.items():
            same = "-" if name == "ours, plain" else f"{sum(a == b for a, b in zip(r.outputs, ours.outputs))}/{batch}"
            print(f"| {batch} | {name} | {r.wall_s:.3f} | {r.e2e_tps:.0f} | {r.tokens} "
                  f"| {r.e2e_tps / ours.e2e_tps:.2f} | {same} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
