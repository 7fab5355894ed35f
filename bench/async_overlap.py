"""Does `mx.async_eval` let the host work while the device computes, on this backend?

Asynchronous scheduling (vLLM's `async_scheduling`, SGLang's overlap scheduler, the `async_eval` in mlx-lm's
`generate_step`) builds and launches tick t+1's forward before tick t's bookkeeping, so the host's Python hides
behind the device's compute. That pays only where `async_eval` returns before the work is done. This measures
it: a chain of matmuls evaluated alone (compute), then followed by host work of 80% of that time (one after the
other), then launched with `async_eval` with the same host work done before waiting for it (overlapped).
The host work is a busy loop (holding the GIL, as the engine's Python does) or a sleep (releasing it).

    python -m bench.async_overlap [--dim 256] [--depth 200] [--repeats 5]

Hidden fraction = (sequential - overlapped) / host work: 1 when all of the host's work hid behind the
computation, 0 when none did.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx


def _chain(x: mx.array, w: mx.array, depth: int) -> mx.array:
    for _ in range(depth):
        x = mx.tanh(x @ w) * 0.5
    return x


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def measure(dim: int, depth: int, repeats: int, host: str) -> dict[str, float]:
    """Median seconds of compute alone, compute then host work, and compute launched with async_eval with the
    host work done before waiting."""
    w = mx.random.normal((dim, dim))  # unscaled: tanh keeps the values near +-0.5 (scaled, they decay to denormals)
    x = mx.random.normal((64, dim))
    mx.eval(w, x)
    work = _busy if host == "busy" else time.sleep
    alone, sequential, overlapped = [], [], []
    for _ in range(repeats):
        y = _chain(x, w, depth)  # the graph is built before each clock starts: only its evaluation is timed
        t = time.perf_counter()
        mx.eval(y)
        alone.append(time.perf_counter() - t)
        host_s = 0.8 * alone[-1]
        y = _chain(x, w, depth)
        t = time.perf_counter()
        mx.eval(y)
        work(host_s)
        sequential.append(time.perf_counter() - t)
        y = _chain(x, w, depth)
        t = time.perf_counter()
        mx.async_eval(y)
        work(host_s)
        mx.eval(y)
        overlapped.append(time.perf_counter() - t)
    compute = statistics.median(alone)
    seq, ov = statistics.median(sequential), statistics.median(overlapped)
    return {"compute_s": compute, "sequential_s": seq, "overlapped_s": ov, "hidden": (seq - ov) / (0.8 * compute)}


def main(argv=None) -> int:
    from bench.blas import describe, detect_blas

    ap = argparse.ArgumentParser(prog="python -m bench.async_overlap", description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--depth", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    print(f"{describe(detect_blas())}; device {mx.default_device()}\n")
    print("| host work | compute ms | compute + host, one after the other, ms | async_eval + host ms | hidden |")
    print("|---|---|---|---|---|")
    for host in ("busy", "sleep"):
        r = measure(args.dim, args.depth, args.repeats, host)
        print(f"| {host} | {r['compute_s'] * 1e3:.1f} | {r['sequential_s'] * 1e3:.1f} | {r['overlapped_s'] * 1e3:.1f} "
              f"| {r['hidden']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
