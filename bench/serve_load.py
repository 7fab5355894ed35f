"""Load run against `mlxsched serve` on loopback: requests/s and time to first token at 1, 8, 32 clients.

Each level is a closed loop: C clients, each sending its next streaming chat request when the previous one
ended, until the level's request count is done (or its time bound passes). TTFT is measured by the client:
request sent to first content chunk. Everything stays on 127.0.0.1; the server is a subprocess started here.

    python -m bench.serve_load                         # tiny VLM (half the requests with an image) and text-medium
    python -m bench.serve_load --models vlm --clients 1 8 --requests 32 --max-tokens 16
    python -m bench.serve_load --peer mlx-lm           # text-medium also through mlx_lm.server, same load

`--peer mlx-lm` serves the text model with `python -m mlx_lm.server` too and drives it with the same client
loop (the ratio of the two in the same run is the figure to read, not either number alone).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Level:
    server: str
    model: str
    clients: int
    done: int
    wall_s: float
    ttft_s: list[float]
    completion_tokens: int
    errors: int = 0  # requests that failed (connection refused / reset, an error answer): not counted as done

    @property
    def requests_per_s(self) -> float:
        return self.done / self.wall_s if self.wall_s else 0.0

    def ttft(self, q: float) -> float:
        if not self.ttft_s:
            return float("nan")
        ordered = sorted(self.ttft_s)
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, process: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"no answer from {url}")


def _start_ours(model_dir: Path, max_seqs: int, log: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "scheduler.cli", "serve", "--model", str(model_dir), "--port", str(port),
           "--served-model-name", "bench", "--max-seqs", str(max_seqs), "--max-batched-tokens", "4096",
           "--graceful-shutdown-s", "1"]
    process = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    _wait_healthy(base + "/health", process)
    return process, base


def _start_mlx_lm(model_dir: Path, max_seqs: int, log: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--decode-concurrency", str(max_seqs), "--log-level", "WARNING"]
    process = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    _wait_healthy(base + "/v1/models", process)
    return process, base


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _requests(n: int, with_images: bool, seed: int) -> list[list[dict]]:
    import numpy as np
    from PIL import Image

    rng = random.Random(seed)
    words = ["the scheduler", "a cache", "the river", "an old clock", "the market", "a quiet street", "a garden"]
    out = []
    for i in range(n):
        text = "Tell me about " + " and ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        if with_images and i % 2 == 0:
            side = rng.choice([56, 84, 112])
            pixels = np.random.default_rng(seed + i).integers(0, 256, (side, side, 3), dtype=np.uint8)
            buf = io.BytesIO()
            Image.fromarray(pixels).save(buf, format="PNG")
            url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
            out.append([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                     {"type": "text", "text": text}]}])
        else:
            out.append([{"role": "user", "content": text}])
    return out


async def _level(base: str, model: str, server: str, clients: int, work: list, max_tokens: int,
                 max_s: float) -> Level:
    import openai

    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
    todo = list(work)
    ttft: list[float] = []
    tokens = 0
    done = 0
    errors = 0
    deadline = time.perf_counter() + max_s

    async def one_client() -> None:
        nonlocal tokens, done, errors
        while todo and time.perf_counter() < deadline:
            messages = todo.pop()
            sent = time.perf_counter()
            first = None
            try:
                stream = await client.chat.completions.create(model=model, messages=messages,
                                                              max_tokens=max_tokens, temperature=0, stream=True,
                                                              stream_options={"include_usage": True})
                async for chunk in stream:
                    if first is None and any(c.delta.content for c in chunk.choices):
                        first = time.perf_counter()
                    if chunk.usage is not None:
                        tokens += chunk.usage.completion_tokens
            except openai.APIError:
                errors += 1
                continue
            if first is not None:
                ttft.append(first - sent)
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*[one_client() for _ in range(clients)])
    wall = time.perf_counter() - start
    await client.close()
    return Level(server, model, clients, done, wall, ttft, tokens, errors)


def _run(base: str, model_label: str, served_as: str, server: str, clients: list[int], n: int,
         with_images: bool, max_tokens: int, max_s: float) -> list[Level]:
    levels = []
    asyncio.run(_level(base, served_as, server, 2, _requests(4, with_images, seed=99), max_tokens, max_s))  # warm-up
    for c in clients:
        level = asyncio.run(_level(base, served_as, server, c, _requests(n, with_images, seed=c), max_tokens, max_s))
        level.model = model_label
        levels.append(level)
        print(f"  {server:>8} {model_label:<12} clients={c:<3} {level.done} requests in {level.wall_s:.2f}s "
              f"{level.requests_per_s:.2f} req/s  TTFT p50 {level.ttft(0.5) * 1e3:.0f} ms  "
              f"p95 {level.ttft(0.95) * 1e3:.0f} ms  errors {level.errors}", file=sys.stderr)
    return levels


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serve_load", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["vlm", "text-medium"], choices=["vlm", "text-medium", "text"])
    ap.add_argument("--clients", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--requests", type=int, default=64, help="requests per level (bounded count)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-seconds", type=float, default=120.0, help="time bound per level")
    ap.add_argument("--max-seqs", type=int, default=32)
    ap.add_argument("--peer", choices=["mlx-lm"], help="also serve the text models with this peer server")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)

    from scheduler.fixtures.tiny_models import build_model

    results: list[Level] = []
    with tempfile.TemporaryDirectory(prefix="mlxsched-serve-load-") as tmp:
        for kind in args.models:
            model_dir = build_model(kind, Path(tmp) / kind)
            vision = kind == "vlm"
            process, base = _start_ours(model_dir, args.max_seqs, Path(tmp) / f"{kind}.log")
            try:
                results += _run(base, kind, "bench", "mlxsched", args.clients, args.requests, vision,
                                args.max_tokens, args.max_seconds)
            finally:
                _stop(process)
            if args.peer == "mlx-lm" and not vision:
                process, base = _start_mlx_lm(model_dir, args.max_seqs, Path(tmp) / f"{kind}-mlx-lm.log")
                try:
                    results += _run(base, kind, str(model_dir), "mlx-lm", args.clients, args.requests, False,
                                    args.max_tokens, args.max_seconds)
                finally:
                    _stop(process)

    print("| server | model | clients | requests | errors | wall s | req/s | TTFT p50 ms | TTFT p95 ms | completion tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r.server} | {r.model} | {r.clients} | {r.done} | {r.errors} | {r.wall_s:.2f} | {r.requests_per_s:.2f} | "
              f"{r.ttft(0.5) * 1e3:.0f} | {r.ttft(0.95) * 1e3:.0f} | {r.completion_tokens / r.wall_s:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps([{**r.__dict__, "requests_per_s": r.requests_per_s,
                                                "ttft_p50_s": r.ttft(0.5), "ttft_p95_s": r.ttft(0.95),
                                                "median_ttft_s": statistics.median(r.ttft_s) if r.ttft_s else None}
                                               for r in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
