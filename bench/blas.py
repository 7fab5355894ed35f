"""Which BLAS does MLX's CPU backend use in this process, and how fast is an fp32 matmul?

The `mlx[cpu]` Linux wheel links a bundled *reference* (netlib) BLAS (`mlx_cpu.libs/libblas-*.so.3`): a
single-threaded, unblocked `cblas_sgemm` that reaches a few GFLOP/s. libmlx resolves `cblas_sgemm`
dynamically, so a BLAS preloaded into the global symbol scope wins. Debian's OpenBLAS::

    apt-get update && apt-get install -y libopenblas0-pthread
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python ...

`detect_blas()` reports what this process actually uses (the library that serves `cblas_sgemm` in the global
scope if any, else the bundled one seen in /proc/self/maps) and, unless `measure=False`, a short 512x512
fp32 matmul throughput (well under a second even on the reference BLAS).

`python -m bench.blas` prints the report; `python -m bench.blas --compare` runs it in two subprocesses,
with and without the OpenBLAS preload.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# Where Debian's libopenblas0-pthread (and -openmp / -serial) put the BLAS alternative.
OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/x86_64-linux-gnu/openblas-openmp/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-openmp/libblas.so.3",
    "/usr/lib/x86_64-linux-gnu/openblas-serial/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-serial/libblas.so.3",
)

_LIB_RE = re.compile(r"(blas|lapack|mkl|blis|accelerate)", re.IGNORECASE)


def openblas_path() -> str | None:
    """Path of an installed Debian OpenBLAS `libblas.so.3` to preload, or None."""
    for p in OPENBLAS_CANDIDATES:
        if os.path.exists(p):
            return p
    return None


def preload_env(blas: str | None, base: dict[str, str] | None = None) -> dict[str, str]:
    """An environment for a child process: LD_PRELOAD set to `blas` (None: any BLAS preload removed)."""
    env = dict(os.environ if base is None else base)
    kept = [p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if not _LIB_RE.search(Path(p).name)]
    if blas:
        kept.insert(0, blas)
    if kept:
        env["LD_PRELOAD"] = " ".join(kept)
    else:
        env.pop("LD_PRELOAD", None)
    return env


def _mapped_blas_libs() -> list[str]:
    """Shared objects with a BLAS/LAPACK-like name mapped into this process, in first-seen order."""
    seen: dict[str, None] = {}
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6:
                    path = parts[5].strip()
                    if path.startswith("/") and _LIB_RE.search(Path(path).name):
                        seen.setdefault(path, None)
    except OSError:  # not Linux
        pass
    return list(seen)


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def _defining_library(addr: int | None) -> str | None:
    if not addr:
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    info = _DlInfo()
    if not libc.dladdr(ctypes.c_void_p(addr), ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.path.realpath(info.dli_fname.decode())


def _symbol_owner(handle: ctypes.CDLL, symbol: str = "cblas_sgemm") -> str | None:
    """The file that defines `symbol` as `handle` resolves it (dlsym + dladdr), or None."""
    try:
        return _defining_library(ctypes.cast(getattr(handle, symbol), ctypes.c_void_p).value)
    except (AttributeError, OSError):
        return None


def _global_provider(symbol: str = "cblas_sgemm") -> str | None:
    """The library serving `symbol` in the global scope (where an LD_PRELOAD puts it), or None."""
    try:
        return _symbol_owner(ctypes.CDLL(None), symbol)
    except OSError:
        return None


def _linked_blas(mapped: list[str]) -> str | None:
    """The library that defines cblas_sgemm for libmlx when nothing is preloaded: the wheel's own first.

    numpy's bundled scipy-openblas is mapped too, but exports only suffixed names (scipy_cblas_sgemm64_),
    so it is never what MLX calls. Only already-mapped libraries are inspected (RTLD_NOLOAD).
    """
    owners: list[str] = []
    for path in mapped:
        try:
            owner = _symbol_owner(ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY))
        except OSError:
            continue
        if owner and owner not in owners:
            owners.append(owner)
    return next((o for o in owners if "mlx" in o), owners[0] if owners else None)


def _classify(path: str | None) -> str:
    if not path:
        return "unknown"
    name = path.lower()
    if "openblas" in name:
        return "openblas"
    if "mkl" in name:
        return "mkl"
    if "blis" in name:
        return "blis"
    if "mlx_cpu.libs" in name or "libblas" in name:
        return "reference"
    return "unknown"


def matmul_gflops(n: int = 512, min_time: float = 0.25, max_reps: int = 50) -> float:
    """fp32 n x n @ n x n throughput of MLX on the CPU, in GFLOP/s (one warm-up, then >= min_time s)."""
    import mlx.core as mx

    with mx.stream(mx.cpu):
        key = mx.random.key(0)
        a = mx.random.normal((n, n), key=key)
        b = mx.random.normal((n, n), key=mx.random.split(key)[0])
        mx.eval(a, b)
        mx.eval(a @ b)  # warm-up
        reps = 0
        t0 = time.perf_counter()
        while True:
            mx.eval(a @ b)
            reps += 1
            dt = time.perf_counter() - t0
            if dt >= min_time or reps >= max_reps:
                break
    return 2.0 * n ** 3 * reps / dt / 1e9


def detect_blas(measure: bool = True) -> dict[str, Any]:
    """What BLAS MLX uses here. Keys:

    name: "openblas" | "reference" | "mkl" | "blis" | "unknown";
    library: path of the library serving cblas_sgemm for libmlx;
    preloaded: True when that library comes from the global scope (LD_PRELOAD);
    mapped: every BLAS/LAPACK-like library mapped into the process;
    ld_preload: the LD_PRELOAD environment value;
    openblas_available: a Debian OpenBLAS libblas.so.3 one could preload (or None);
    gflops_fp32_512: measured 512^3 fp32 matmul GFLOP/s (only when measure=True).
    """
    import mlx.core as mx  # noqa: F401  (loads libmlx and the bundled BLAS before /proc/self/maps is read)

    mapped = _mapped_blas_libs()
    provider = _global_provider()
    preloaded = provider is not None and _classify(provider) != "unknown"
    library = provider if preloaded else _linked_blas(mapped)
    info: dict[str, Any] = {
        "name": _classify(library),
        "library": library,
        "preloaded": preloaded,
        "mapped": mapped,
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "openblas_available": openblas_path(),
    }
    if measure:
        info["gflops_fp32_512"] = round(matmul_gflops(), 2)
    return info


def describe(info: dict[str, Any]) -> str:
    """One line for reports."""
    how = "preloaded" if info.get("preloaded") else "linked"
    line = f"BLAS: {info['name']} ({how}: {info.get('library')})"
    if "gflops_fp32_512" in info:
        line += f", fp32 512x512 matmul {info['gflops_fp32_512']:.1f} GFLOP/s"
    return line


def run_with_blas(argv: list[str], blas: str | None, **kwargs: Any) -> subprocess.CompletedProcess:
    """Run `python argv...` in a child with `blas` preloaded (None: without any BLAS preload)."""
    return subprocess.run([sys.executable, *argv], env=preload_env(blas), **kwargs)


def compare() -> dict[str, Any]:
    """detect_blas() in two child processes: without and with the OpenBLAS preload."""
    out: dict[str, Any] = {}
    ob = openblas_path()
    for label, lib in (("reference", None), ("openblas", ob)):
        if label == "openblas" and lib is None:
            out[label] = {"error": "libopenblas0-pthread not installed (apt-get install -y libopenblas0-pthread)"}
            continue
        proc = run_with_blas(["-m", "bench.blas", "--json"], lib, capture_output=True, text=True, check=True)
        out[label] = json.loads(proc.stdout)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench.blas", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the detect_blas() dict as JSON")
    ap.add_argument("--compare", action="store_true", help="measure without and with the OpenBLAS preload")
    args = ap.parse_args(argv)
    if args.compare:
        res = compare()
        if args.json:
            print(json.dumps(res, indent=2))
        else:
            for label, info in res.items():
                print(f"{label:>9}: " + (info["error"] if "error" in info else describe(info)))
        return 0
    info = detect_blas()
    print(json.dumps(info) if args.json else describe(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
