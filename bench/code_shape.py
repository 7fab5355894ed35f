"""The shape of the code, measured: the longest functions (lines, decorators to last line) over the given
packages, and where the plan -> execute -> apply -> release tick loop is written (a function that calls
`.apply(` with `.plan(` or `.execute(`: one copy of the loop per function or loop statement).

    python -m bench.code_shape [--top 10] [PATH ...]   (default: scheduler caches kernels; the loop count also
                                                        looks in tests/ and bench/)
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path


def functions(paths: list[str]):
    for root in paths:
        for file in sorted(Path(root).rglob("*.py")):
            tree = ast.parse(file.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                    yield file, node, node.end_lineno - start + 1


def _calls(node: ast.AST) -> set[str]:
    return {n.func.attr for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}


def _ticks(node: ast.AST) -> bool:
    """Whether `node` runs a tick itself: it applies a result, and plans or executes in the same body."""
    calls = _calls(node)
    return "apply" in calls and bool(calls & {"plan", "execute"})


def _innermost(node: ast.AST, kinds: tuple) -> list[ast.AST]:
    """`node`'s descendants of `kinds` that plan and apply a tick, and hold no such descendant themselves."""
    hits = [n for n in ast.walk(node) if n is not node and isinstance(n, kinds) and _ticks(n)]
    return [n for n in hits if not any(m is not n and m in set(ast.walk(n)) for m in hits)]


def tick_loops(paths: list[str]):
    """Copies of the tick loop: each innermost loop (for/while) that runs a tick, or a function that runs one
    per call (the engine's `step`, `TickLoop.carry_out`)."""
    found = []
    for file, node, _ in functions(paths):
        if not _ticks(node) or _innermost(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        loops = _innermost(node, (ast.For, ast.While)) or [node]
        found += [f"{file}:{loop.lineno} {node.name}" for loop in loops]
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("paths", nargs="*", default=["scheduler", "caches", "kernels"])
    args = parser.parse_args()
    ranked = sorted(functions(args.paths), key=lambda f: -f[2])[: args.top]
    print(f"longest functions ({', '.join(args.paths)}):")
    for file, node, n in ranked:
        print(f"  {n:4d}  {file}:{node.lineno} {node.name}")
    loops = tick_loops(args.paths + ["tests", "bench"])
    print(f"tick-loop copies: {len(loops)}")
    for where in loops:
        print("  " + where)


if __name__ == "__main__":
    main()
