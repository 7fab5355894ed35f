"""Every measurement script in bench/ still runs: each command bench/README.md quotes, at the smallest sizes, as a
user runs it (`python -m bench.NAME ...`), ends with status 0 and prints a table row.

The scripts run one after another in ONE child process (tests/bench_scripts.py: each executed as `-m` executes
it, with its own argv): a child per script spent about 2 s of CI each importing MLX, mlx-lm and mlx-vlm again.
One script is also run in a child of its own, the way a user types it, so the `-m` entry itself is covered.

The figures are not checked (bench/ measures, tests never time anything); what is checked is that a script has
not rotted when an interface it drives moved (bench.prefill_mix once called `TextRunner.prefill_many` with the
chunk tuples of an earlier version, and nothing noticed until it was rerun).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# module -> (arguments, what its output must hold); MODEL_DIR: the tiny text model's directory. The smallest
# workloads each script allows. "|" is a markdown table row.
SCRIPTS: dict[str, tuple[list[str], str]] = {
    "run": (["--model", "text", "--workload", "mixed", "--batch", "4", "--lo", "8", "--hi", "40", "--new-tokens", "8",
             "--repeats", "1", "--peer", "mlx-lm", "vllm-mlx"], "|"),
    "run:sampled": (["--model", "text", "--batch", "3", "--new-tokens", "4", "--prompt-len", "8", "--repeats", "1",
                     "--sampled-every", "2", "--top-p", "0.9", "--peer", "mlx-lm", "vllm-mlx"], "(1 greedy of 3)"),
    "decode_overhead": (["--model", "text", "--batch", "4", "--steps", "4", "--repeats", "1"], "overhead"),
    "decode_overhead:vlm": (["--model", "vlm", "--batch", "2", "--prompt-len", "8", "--steps", "4", "--repeats", "1"],
                            "overhead"),
    "async_overlap": (["--dim", "32", "--depth", "5", "--repeats", "1"], "|"),
    "run:vocab": (["--model", "text", "--vocab-size", "2048", "--workload", "mixed", "--batch", "2", "--lo", "8",
                   "--hi", "20", "--new-tokens", "4", "--repeats", "1", "--peer", "mlx-lm"], "|"),
    "drafting": (["--model-dir", "MODEL_DIR", "--batch", "1", "--new-tokens", "16", "--repeats", "1"], "|"),
    "verify_tick": (["--model-dir", "MODEL_DIR", "--batch", "1", "2", "--width", "1", "3", "--context", "32", "--iters",
                     "5", "--repeats", "1", "--new-tokens", "8"], "|"),
    "features": (["--model", "text", "--prefix-len", "64", "--long-prompt", "64", "--streams", "4", "--new-tokens", "8",
                  "--repeats", "1"], "interleave:"),
    "lifecycle_cost": (["--n", "100"], "one logged transition"),
    "memory": (["--requests", "8", "--early", "4"], "peak MLX memory"),
    "prefix_index": (["--entries", "10", "--length", "100"], "|"),
    "profile_tick": (["--model", "text", "--batch", "2", "--ticks", "5"], "ms/tick under cProfile"),
    "quantized_kv": (["--batch", "2", "--prompt-len", "16", "--new-tokens", "4", "--admit-requests", "2",
                      "--admit-len", "16", "--admit-base", "1"], "|"),
    "quantized_kv:vlm": (["--vlm"], "|"),
    "scheduler_cost": (["--live", "4"], "|"),
    "vision_batch": (["--repeats", "1", "--counts", "1", "2"], "|"),
    "vision_peer": (["--requests", "4", "--new-tokens", "4", "--repeats", "1"], "|"),
    "image_chats": (["--chats", "2", "--vision-token-budget", "64", "--new-tokens", "2", "--repeats", "1"],
                    "| 2: the same images again | 1 |"),
    "prefill_mix": (["--model", "text", "--n", "4", "--lo", "8", "--hi", "40", "--repeats", "1", "--ratios", "0.0625",
                     "--split-ratios", "1"], "|"),
    "prefill_mix:family": (["--family", "qwen3_next", "--n", "3", "--lo", "20", "--hi", "20", "--new-tokens", "2",
                            "--repeats", "1", "--ratios", "0", "--split-ratios"], "| grouped r=0 |"),
    "op_floor": (["--model", "text", "--batch", "2", "--iters", "3", "--prefill-len", "16", "--widths", "1", "3"], "|"),
    "code_shape": ([], "longest functions"),
    "shared_prefix": (["--requests", "2", "--turns", "2", "--system-words", "40", "--new-tokens", "4", "--repeats",
                       "1"], "|"),
    "scoring": (["--model", "text", "--n", "3", "--lo", "8", "--hi", "20", "--repeats", "1"], "|"),
    "lora": (["--model", "text", "--requests", "3", "--lo", "8", "--hi", "20", "--new-tokens", "4", "--rank", "4",
              "--repeats", "1"], "mixed == engine per adapter, token for token: True"),
    "lora:experts": (["--family", "qwen3_moe", "--requests", "3", "--lo", "8", "--hi", "20", "--new-tokens", "4",
                      "--rank", "4", "--repeats", "1"], "mixed == engine per adapter, token for token: True"),
    "structured": (["--model", "text", "--batch", "2", "--new-tokens", "8", "--repeats", "1"], "|"),
}


def _jobs(text_model_dir: Path) -> list[tuple[str, list[str]]]:
    """(script, argv) per SCRIPTS key, in sorted order, MODEL_DIR filled in."""
    return [(module.split(":")[0],  # "NAME:variant": the same script with other arguments
             [str(text_model_dir) if a == "MODEL_DIR" else a for a in SCRIPTS[module][0]])
            for module in sorted(SCRIPTS)]


@pytest.fixture(scope="module")
def script_results(text_model_dir, tmp_path_factory) -> dict[str, dict]:
    """SCRIPTS key -> {"status", "output"} of its run in the one child (tests/bench_scripts.py); a key is missing
    when the child died before reaching it (its own output is then under "<child>")."""
    where = tmp_path_factory.mktemp("bench-smoke")
    (where / "jobs.json").write_text(json.dumps(_jobs(text_model_dir)))
    proc = subprocess.run([sys.executable, "-m", "tests.bench_scripts", str(where / "jobs.json"),
                           str(where / "results.jsonl")], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    lines = (where / "results.jsonl").read_text().splitlines() if (where / "results.jsonl").exists() else []
    results = dict(zip(sorted(SCRIPTS), map(json.loads, lines)))
    results["<child>"] = {"status": proc.returncode, "output": proc.stdout[-3000:] + proc.stderr[-3000:]}
    return results


@pytest.mark.slow
@pytest.mark.parametrize("module", sorted(SCRIPTS))
def test_the_bench_script_runs(module, script_results):
    child = script_results["<child>"]
    assert module in script_results, f"the child ended (status {child['status']}) before {module}:\n{child['output']}"
    result = script_results[module]
    assert result["name"] == module.split(":")[0]
    assert result["status"] == 0, result["output"][-6000:]
    assert SCRIPTS[module][1] in result["output"], result["output"][-3000:]


def test_a_bench_script_runs_as_a_user_types_it():
    """`python -m bench.NAME` from the checkout's root, in a child of its own."""
    proc = subprocess.run([sys.executable, "-m", "bench.lifecycle_cost", "--n", "100"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "one logged transition" in proc.stdout
