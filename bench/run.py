"""CLI: compare our Engine with mlx-lm's BatchGenerator on tiny models and print a markdown table.

    python -m bench.run --model text --batch 1 8 32 --new-tokens 64 --prompt-len 128
    python -m bench.run --model text-medium --batch 32 --workload mixed --lo 16 --hi 300 --new-tokens 64
    python -m bench.run --model text --batch 8 --blas both      # same run without and with OpenBLAS preloaded

`main(argv)` is importable (returns an exit code) so it can back a `mlxsched bench` subcommand.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from . import blas as blas_mod
from .compare import PEERS, Comparison, compare_peers, markdown_table
from .workloads import mixed, uniform

MODEL_CHOICES = ("text", "text-medium", "sliding")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.run",
                                 description="Engine vs mlx-lm BatchGenerator on the tiny models.")
    ap.add_argument("--model", nargs="+", default=["text"], choices=MODEL_CHOICES,
                    help="tiny model kind(s) built into a temp dir (default: text)")
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8, 32],
                    help="number of concurrent requests per comparison (default: 1 8 32)")
    ap.add_argument("--workload", choices=("uniform", "mixed"), default="uniform")
    ap.add_argument("--vocab-size", type=int, default=None,
                    help="build the model with this vocabulary size (a real model's, e.g. Qwen's 151936) instead "
                         "of the tokenizer's 512: the ids past 512 are never generated, but every forward and "
                         "every log-softmax computes them")
    ap.add_argument("--prompt-len", type=int, default=128, help="uniform: prompt length (default 128)")
    ap.add_argument("--lo", type=int, default=16, help="mixed: shortest prompt (default 16)")
    ap.add_argument("--hi", type=int, default=300, help="mixed: longest prompt (default 300)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request (default 64)")
    ap.add_argument("--seed", type=int, default=0, help="workload seed")
    ap.add_argument("--sampled-every", type=int, default=0, metavar="N",
                    help="every Nth request (from the first) sampled at --temperature / --top-p, seeded; the rest "
                         "greedy, and only they are compared across sides (default 0: all greedy)")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampled requests' temperature (default 1.0)")
    ap.add_argument("--top-p", type=float, default=1.0, help="sampled requests' top-p (default 1.0: off)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per side, order alternating (default 3)")
    ap.add_argument("--stat", choices=("best", "median"), default="best",
                    help="summary over repeats in the table: best of N (default) or median; JSON has both")
    ap.add_argument("--warmup-tokens", type=int, default=4,
                    help="new tokens of the untimed warm-up run of each side (0: no warm-up)")
    ap.add_argument("--stop-on-eos", action="store_true",
                    help="let our engine stop on the tokenizer eos (default: ignore eos so work is equal)")
    ap.add_argument("--max-batched-tokens", type=int, default=4096)
    ap.add_argument("--max-seqs", type=int, default=64)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--peer", nargs="+", choices=PEERS, default=["mlx-lm"],
                    help="peer(s) run next to ours in the same process, order rotating: mlx-lm (BatchGenerator, "
                         "default) and / or vllm-mlx (the reference's MLLMBatchGenerator; needs "
                         "`pip install --no-deps vllm-mlx==0.4.1`)")
    ap.add_argument("--peer-prefill-batch", type=int, default=8,
                    help="BatchGenerator prefill_batch_size (mlx-lm default 8)")
    ap.add_argument("--peer-completion-batch", type=int, default=None,
                    help="BatchGenerator completion_batch_size (default max(32, batch))")
    ap.add_argument("--blas", choices=("current", "openblas", "reference", "both"), default="current",
                    help="current: this process as is; openblas / reference: re-run in a child with / without "
                         "the Debian OpenBLAS preloaded; both: one child each, plus an output-identity check")
    ap.add_argument("--json", metavar="PATH", help="also write every figure (and per-request outputs) as JSON")
    ap.add_argument("--quiet", action="store_true", help="no per-run progress lines (stderr)")
    return ap


def machine_info() -> dict[str, Any]:
    from importlib.metadata import version

    def v(pkg: str) -> str:
        try:
            return version(pkg)
        except Exception:
            return "?"

    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    commit = ""
    try:
        root = Path(__file__).resolve().parent.parent
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        if commit and dirty:
            commit += "+dirty"
    except Exception:
        pass
    return {
        "commit": commit,
        "machine": platform.machine(), "system": platform.system(), "cpus": os.cpu_count(), "cpu": cpu,
        "python": platform.python_version(), "mlx": v("mlx"), "mlx-lm": v("mlx-lm"),
    }


def _workloads(args: argparse.Namespace) -> list:
    if args.workload == "uniform":
        made = [uniform(n, args.prompt_len, args.new_tokens, args.seed) for n in args.batch]
    else:
        made = [mixed(n, args.lo, args.hi, args.new_tokens, args.seed) for n in args.batch]
    return [wl.with_sampling(args.sampled_every, args.temperature, args.top_p) for wl in made]


def run_here(args: argparse.Namespace, log) -> dict[str, Any]:
    """Run every comparison in this process; returns the JSON-able report."""
    from mlx_lm import load

    from scheduler import EngineConfig
    from scheduler.fixtures.tiny_models import build_model

    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    info = blas_mod.detect_blas()
    blas_line = blas_mod.describe(info)
    log(blas_line)
    config = EngineConfig(max_batched_tokens=args.max_batched_tokens, max_seqs=args.max_seqs,
                          prefill_chunk=args.prefill_chunk)
    comparisons: list[Comparison] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mlxsched-bench-") as tmp:
        for kind in args.model:
            model, tokenizer = load(str(build_model(kind, Path(tmp) / kind, vocab_size=args.vocab_size)))
            for wl in _workloads(args):
                log(f"{kind}: {wl.describe()}")
                comparisons.extend(compare_peers(
                    model, tokenizer, wl, peers=args.peer,
                    model_name=kind if args.vocab_size is None else f"{kind} (vocab {args.vocab_size})",
                    repeats=args.repeats,
                    warmup_tokens=args.warmup_tokens, config=config, ignore_eos=not args.stop_on_eos,
                    peer_prefill_batch=args.peer_prefill_batch, peer_completion_batch=args.peer_completion_batch,
                    blas=info["name"], stat=args.stat, log=log,
                ))
            del model, tokenizer
    return {
        "machine": machine_info(),
        "blas": info,
        "blas_line": blas_line,
        "elapsed_s": time.perf_counter() - t0,
        "comparisons": [c.to_dict() for c in comparisons],
        "stat": args.stat,
        "load_before": load_before,
        "table": markdown_table(comparisons),
        "_objects": comparisons,
    }


def _child_argv(argv: Sequence[str], json_path: str) -> list[str]:
    """argv for a child: same options, --blas current, --json to our temp file."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--blas", "--json"):
            skip = True
            continue
        if a.startswith("--blas=") or a.startswith("--json="):
            continue
        out.append(a)
    return ["-m", "bench.run", *out, "--blas", "current", "--json", json_path]


def run_children(argv: Sequence[str], which: Sequence[str]) -> dict[str, dict[str, Any]]:
    reports = {}
    for label in which:
        lib = blas_mod.openblas_path() if label == "openblas" else None
        if label == "openblas" and lib is None:
            raise SystemExit("OpenBLAS is not installed: apt-get update && apt-get install -y libopenblas0-pthread")
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            path = f.name
        try:
            proc = blas_mod.run_with_blas(_child_argv(argv, path), lib, stdout=subprocess.DEVNULL)
            if proc.returncode != 0:
                raise SystemExit(f"{label} run failed with exit code {proc.returncode}")
            reports[label] = json.loads(Path(path).read_text())
        finally:
            os.unlink(path)
    return reports


def blas_identity(reports: dict[str, dict[str, Any]]) -> list[str]:
    """Per comparison: are our engine's greedy outputs identical across the BLAS variants?"""
    labels = list(reports)
    lines = []
    if len(labels) < 2:
        return lines
    a, b = (reports[k]["comparisons"] for k in labels[:2])
    for ca, cb in zip(a, b):
        oa, ob = ca["ours_outputs"], cb["ours_outputs"]
        diff = sum(x != y for x, y in zip(oa, ob))
        lines.append(f"- {ca['model']} {ca['workload']}: engine greedy outputs {labels[0]} vs {labels[1]}: "
                     + ("identical" if diff == 0 else f"{diff}/{len(oa)} requests differ"))
    return lines


def print_report(report: dict[str, Any], cmd: str, label: str = "") -> None:
    m = report["machine"]
    title = f"### {label}" if label else "###"
    print(f"{title} {report['blas_line']}".rstrip())
    print(f"Machine: {m['machine']} {m['system']}, {m['cpus']} CPUs ({m['cpu']}), Python {m['python']}, "
          f"mlx {m['mlx']} (CPU), mlx-lm {m['mlx-lm']}; tree {m.get('commit') or '?'}; "
          f"elapsed {report['elapsed_s']:.0f} s")
    print(f"Command: `{cmd}`")
    print(f"Figures: {report.get('stat', 'best')} of {report['comparisons'][0]['repeats'] if report['comparisons'] else 0}"
          f" runs per side, order rotating; cells are ours / peer (mlx-lm: BatchGenerator; vllm-mlx: "
          f"MLLMBatchGenerator); ratios ours / peer "
          f"(> 1: ours faster); load1 before the runs: {report.get('load_before', 0):.1f}\n")
    print(report["table"])
    print()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    cmd = "python -m bench.run " + shlex.join(argv)

    def log(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    if args.blas != "current":
        which = ["reference", "openblas"] if args.blas == "both" else [args.blas]
        reports = run_children(argv, which)
        for label, rep in reports.items():
            print_report(rep, cmd, label)
        ident = blas_identity(reports)
        if ident:
            print("Greedy outputs of our engine across BLAS libraries:")
            print("\n".join(ident))
        if args.json:
            Path(args.json).write_text(json.dumps({"command": cmd, "runs": reports}, indent=1))
        return 0

    if "vllm-mlx" in args.peer:
        from .reference import available

        why = available()
        if why:
            print(why, file=sys.stderr)
            return 2
    report = run_here(args, log)
    report.pop("_objects")
    report["command"] = cmd
    print_report(report, cmd)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
