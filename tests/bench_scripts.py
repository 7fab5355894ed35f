"""The child process of tests/test_bench_smoke.py: runs bench scripts one after another, each as `python -m
bench.NAME ARGS...` runs it (`runpy` executes the module as `__main__` with that argv), and writes one JSON line
per script to RESULTS: its exit status and what it printed.

    python -m tests.bench_scripts JOBS.json RESULTS.jsonl      (JOBS: [[NAME, [ARGS...]], ...])

One interpreter for all of them: a fresh one per script spent most of its time importing MLX, mlx-lm and
mlx-vlm again (about 2 s a script, under 0.5 s of running at the smallest sizes). A script that fails, or exits
with a status, does not stop the ones after it.
"""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import sys
import traceback
from pathlib import Path


def run_script(name: str, args: list[str]) -> dict:
    """{"name", "status", "output"} of `python -m bench.NAME ARGS...` run in this process."""
    out = io.StringIO()
    argv = sys.argv
    sys.argv = [f"bench/{name}.py", *args]
    status = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_module(f"bench.{name}", run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = exit_.code
        status = code if isinstance(code, int) else (0 if code is None else 1)
        if not isinstance(code, (int, type(None))):
            out.write(f"{code}\n")
    except BaseException:  # noqa: BLE001 (reported as the script's failure; the next script still runs)
        status = 1
        out.write(traceback.format_exc())
    finally:
        sys.argv = argv
    return {"name": name, "status": status, "output": out.getvalue()}


def main(argv: list[str]) -> None:
    jobs, results = json.loads(Path(argv[0]).read_text()), Path(argv[1])
    with results.open("w") as sink:  # (a file, not stdout: MLX and BLAS may print there from C)
        for name, args in jobs:
            sink.write(json.dumps(run_script(name, args)) + "\n")
            sink.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
